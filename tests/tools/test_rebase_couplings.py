# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What ``rebase`` checks that a merge cannot (tools/couplings.py, check.py).

A release that renames an upstream name the tree uses merges cleanly and
builds, then fails at import; ``rebase`` refuses it with one line per name.
And when the base pins a FlashInfer with every known issue's fix, rebase and
the build say so in one line. The scratch projects (synthetic.py) run on tiny
synthetic wheels whose vllm modules stand in for upstream's; the last tests
scan the real tree against the real 0.33.0 sources.
"""

import importlib.util
import subprocess
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    ADDED,
    NEW_VERSION,
    ORIGINAL,
    OURS,
    PATCHED,
    REQUIRES_DIST,
    UPSTREAM_CLASH,
    UPSTREAM_FIX,
    build,
    make_project,
    release,
    sha,
)

from tools import check, couplings, fetch
from tools.pins import Pins, load_pins

ENVS = """\
def env_with_choices(env_name, default, choices):
    return lambda: default


environment_variables = {{
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": env_with_choices(
        "VLLM_FLASHINFER_ALLREDUCE_BACKEND", "auto", {choices}
    ),
}}


def __getattr__(name):
    return environment_variables[name]()
"""
FACTORY = """\
class KVConnectorFactory:
    _registry = {}

    @classmethod
    def supports_hma_config(cls, config):
        return True
"""
PARSER = """\
class FlexibleArgumentParser:
    def __init__(self, prog=None, add_json_tip=True):
        self.prog = prog
"""
# Upstream's modules that the tree's added module uses, as in 0.33.0.
UPSTREAM = {
    PATCHED.as_posix(): ORIGINAL,
    "vllm/envs.py": ENVS.format(choices='["auto", "trtllm", "mnnvl"]'),
    "vllm/distributed/parallel_state.py": "def _node_count(pg):\n    return 1\n",
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/factory.py": FACTORY,
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": PARSER,
}
# An added module that uses one upstream name of each kind.
HELPER = """\
import vllm.envs as envs
from vllm.distributed.parallel_state import _node_count
from vllm.utils.argparse_utils import FlexibleArgumentParser

CHOICES = ("auto", "trtllm", "mnnvl")


class HelpParser(FlexibleArgumentParser):
    \"\"\"Takes upstream's __init__, so its keywords are upstream's.\"\"\"


def registered(name):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return name in KVConnectorFactory._registry


def parser():
    return HelpParser(prog="explain", add_json_tip=False)


def backend(group):
    return envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND if _node_count(group) else None
"""
ENV_CHOICES = (
    "\n[tool.vllm-overlay.env-choices]\n"
    f'VLLM_FLASHINFER_ALLREDUCE_BACKEND = "{ADDED}:CHOICES"\n'
)
RELEASE = f"vllm=={NEW_VERSION}"
FIX = (
    f"Fix: make those files use what {RELEASE} has instead, then run "
    f"python -m tools rebase --base-version {NEW_VERSION}"
)
FACTORY_PATH = "vllm/distributed/kv_transfer/kv_connector/factory.py"
# What a new release drops, and the one line that names it.
DROPPED: dict[str, tuple[dict[str, str | None], str]] = {
    "function": (
        {"vllm/distributed/parallel_state.py": "def _count_nodes(pg):\n    return 1\n"},
        "vllm.distributed.parallel_state._node_count is not in vllm==0.34.0",
    ),
    "class-attribute": (
        {FACTORY_PATH: FACTORY.replace("_registry", "_loaders")},
        (
            "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory."
            "_registry is not in vllm==0.34.0"
        ),
    ),
    "keyword": (
        {"vllm/utils/argparse_utils.py": PARSER.replace(", add_json_tip=True", "")},
        (
            "vllm.utils.argparse_utils.FlexibleArgumentParser() takes no keyword "
            "argument add_json_tip in vllm==0.34.0"
        ),
    ),
    "module": (
        {FACTORY_PATH: None},
        "vllm.distributed.kv_transfer.kv_connector.factory is not in vllm==0.34.0",
    ),
    "choices": (
        {"vllm/envs.py": ENVS.format(choices='["auto", "trtllm"]')},
        (
            "CHOICES is ('auto', 'trtllm', 'mnnvl'), but vllm/envs.py of "
            "vllm==0.34.0 declares ['auto', 'trtllm'] for "
            "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
        ),
    ),
}


def upstream(changes: dict[str, str | None]) -> dict[str, str]:
    """UPSTREAM with files changed (a path -> None drops that file)."""
    files = {**UPSTREAM, **changes}
    return {path: text for path, text in files.items() if text is not None}


def coupled_project(tmp_path: Path, index: Path, new_files: dict[str, str]) -> Path:
    """A project on 0.33.0 whose added module uses UPSTREAM; 0.34.0 in the index."""
    old = release(tmp_path, index, "0.33.0", UPSTREAM)
    release(tmp_path, index, NEW_VERSION, new_files)
    files = {PATCHED.as_posix(): OURS, ADDED: HELPER}
    return make_project(tmp_path, old, files, adds=(ADDED,), tables=ENV_CHOICES)


def snapshot(project: Path) -> dict[Path, bytes]:
    return {
        p: p.read_bytes()
        for p in project.rglob("*")
        if p.is_file() and ".git" not in p.parts
    }


def problem_lines(stderr: str) -> list[str]:
    return [line[2:] for line in stderr.splitlines() if line.startswith("- ")]


def rebase(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return tree_imports.run_tool(
        project, "rebase", "--base-version", NEW_VERSION, *args
    )


@pytest.mark.parametrize("dropped", sorted(DROPPED))
def test_release_without_a_coupled_name_is_refused(
    tmp_path: Path, index: Path, dropped: str
) -> None:
    changes, line = DROPPED[dropped]
    project = coupled_project(
        tmp_path, index, upstream({PATCHED.as_posix(): UPSTREAM_FIX, **changes})
    )
    before = snapshot(project)

    proc = rebase(project)
    assert proc.returncode == 1
    assert f"error: cannot rebase onto {RELEASE}; nothing was changed:\n" in (
        proc.stderr
    )
    assert problem_lines(proc.stderr) == [f"{ADDED}: {line}"]
    assert f"{FIX} again (commit them first" in proc.stderr
    # The clean merge of PATCHED was not written, nor anything else.
    assert snapshot(project) == before


def test_release_with_every_coupled_name_rebases(tmp_path: Path, index: Path) -> None:
    project = coupled_project(
        tmp_path, index, upstream({PATCHED.as_posix(): UPSTREAM_FIX})
    )
    proc = rebase(project)
    assert proc.returncode == 0, proc.stderr
    assert "retires the known issues" not in proc.stderr
    pins = load_pins(project / "pyproject.toml")
    assert pins.base_version == NEW_VERSION
    assert pins.replaces == {PATCHED.as_posix(): sha(UPSTREAM_FIX)}
    assert "line_9 = 'upstream'" in (project / PATCHED).read_text()


def test_continue_checks_the_couplings_too(tmp_path: Path, index: Path) -> None:
    renamed = "def _count_nodes(pg):\n    return 1\n"
    project = coupled_project(
        tmp_path,
        index,
        upstream(
            {
                PATCHED.as_posix(): UPSTREAM_CLASH,
                "vllm/distributed/parallel_state.py": renamed,
            }
        ),
    )
    pyproject = (project / "pyproject.toml").read_bytes()
    assert rebase(project).returncode == 1  # the conflict
    resolved = OURS.replace("line_2 = 'ours'", "line_2 = ('ours', 'upstream')")
    (project / PATCHED).write_text(resolved)

    proc = rebase(project, "--continue")
    assert proc.returncode == 1
    assert f"cannot record the rebase onto {RELEASE}; nothing was changed" in (
        proc.stderr
    )
    assert problem_lines(proc.stderr) == [
        f"{ADDED}: vllm.distributed.parallel_state._node_count is not in vllm==0.34.0"
    ]
    assert f"{FIX} --continue again" in proc.stderr
    assert (project / "pyproject.toml").read_bytes() == pyproject
    assert (project / PATCHED).read_text() == resolved

    # Ported to the new name, the rebase is recorded.
    (project / ADDED).write_text(HELPER.replace("_node_count", "_count_nodes"))
    proc = rebase(project, "--continue")
    assert proc.returncode == 0, proc.stderr
    assert load_pins(project / "pyproject.toml").base_version == NEW_VERSION


KNOWN = "vllm/distributed/device_communicators/known_issues.py"
KNOWN_SOURCE = """\
class KnownIssue:
    def __init__(self, name, fixed_in):
        self.name, self.fixed_in = name, fixed_in


KNOWN_ISSUES = (KnownIssue(name="flashinfer#7782", fixed_in={fixed_in!r}),)
"""
KNOWN_ISSUES = (
    "\n[tool.vllm-overlay.known-issues]\n"
    f'in = "{KNOWN}:KNOWN_ISSUES"\n'
    'package = "flashinfer-python"\n'
)
OURS_WITH_DROP_WHEN = "# Drop-When: FlashInfer ships the fix\n" + OURS


def retired_line(base: str) -> str:
    return (
        f"{base} retires the known issues: it pins flashinfer-python==0.7.4, "
        f"at or above the fixed_in of every entry of {KNOWN}:KNOWN_ISSUES "
        "(flashinfer#7782 fixed in 0.7.4), so the part of the patch that steers "
        f"around them can be dropped (see Drop-When in the DEP-3 header of {PATCHED})"
    )


def known_issues_project(
    tmp_path: Path, index: Path, fixed_in: str | None, pin: str, new: bool
) -> tuple[Path, list[Path]]:
    """A project whose known issue has ``fixed_in``, on a base pinning ``pin``.

    With ``new``, 0.34.0 pins it and 0.33.0 pins 0.7.2.post1; else 0.33.0 does.
    """
    upstream_pin = "flashinfer-python==0.7.2.post1"
    old = release(
        tmp_path,
        index,
        "0.33.0",
        {PATCHED.as_posix(): ORIGINAL},
        [*REQUIRES_DIST, upstream_pin if new else pin],
    )
    if new:
        release(
            tmp_path,
            index,
            NEW_VERSION,
            {PATCHED.as_posix(): UPSTREAM_FIX},
            [*REQUIRES_DIST, pin],
        )
    files = {
        PATCHED.as_posix(): OURS_WITH_DROP_WHEN,
        KNOWN: KNOWN_SOURCE.format(fixed_in=fixed_in),
    }
    project = make_project(tmp_path, old, files, adds=(KNOWN,), tables=KNOWN_ISSUES)
    return project, old


@pytest.mark.parametrize(
    ("fixed_in", "pin", "retired"),
    [
        ("0.7.4", "flashinfer-python==0.7.4", True),
        (None, "flashinfer-python==0.7.4", False),
        ("0.7.4", "flashinfer-python==0.7.2.post1", False),
    ],
    ids=["fixed-and-pinned", "unfixed", "older-pin"],
)
def test_rebase_says_when_the_base_retires_the_known_issues(
    tmp_path: Path, index: Path, fixed_in: str | None, pin: str, retired: bool
) -> None:
    project, _ = known_issues_project(tmp_path, index, fixed_in, pin, new=True)
    proc = rebase(project)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "known issues" in line]
    assert said == ([retired_line(RELEASE)] if retired else [])


@pytest.mark.parametrize(
    ("pin", "retired"),
    [("flashinfer-python==0.7.4", True), ("flashinfer-python==0.7.2.post1", False)],
    ids=["fixed", "older"],
)
def test_build_says_when_its_base_retires_the_known_issues(
    tmp_path: Path, index: Path, capsys: pytest.CaptureFixture, pin: str, retired: bool
) -> None:
    project, old = known_issues_project(tmp_path, index, "0.7.4", pin, new=False)
    build(project, old[0], tmp_path)
    said = [line for line in capsys.readouterr().err.splitlines() if "known" in line]
    assert said == (
        [f"vllm-overlay: {retired_line('vllm==0.33.0')}"] if retired else []
    )


@pytest.mark.parametrize(
    ("requires", "floor"),
    [
        (["flashinfer-python==0.7.4"], "0.7.4"),
        (["flashinfer-python>=0.7.4"], "0.7.4"),
        (["flashinfer_python>=0.7,<0.8"], "0.7"),
        (["flashinfer-python>=0.7.2,>=0.7.4"], "0.7.4"),
        (["flashinfer-python==0.7.*"], "0.7"),
        (["flashinfer-python<0.8"], None),
        (["flashinfer-python"], None),
        ([], None),
        (
            ["flashinfer-python==0.7.4", 'flashinfer-python>=0.7.2; extra == "fi"'],
            "0.7.2",
        ),
    ],
)
def test_pinned_floor_is_the_lowest_release_allowed(
    requires: list[str], floor: str | None
) -> None:
    metadata = "".join(f"Requires-Dist: {r}\n" for r in ["numpy", *requires])
    found = check.pinned_floor(
        f"Name: vllm\n{metadata}\n".encode(), "flashinfer-python"
    )
    assert (None if found is None else str(found[1])) == floor


@pytest.mark.parametrize(
    ("pins", "expected"),
    [
        (
            {"env_choices": {"VLLM_X": "vllm/gone.py:CHOICES"}},
            (
                "[tool.vllm-overlay.env-choices]: VLLM_X = 'vllm/gone.py:CHOICES' must "
                "name a constant in a declared file"
            ),
        ),
        (
            {"env_choices": {"not-a-var": f"{ADDED}:CHOICES"}},
            "'not-a-var' is not an environment variable name",
        ),
        (
            {"known_issues": {"in": f"{ADDED}:KNOWN"}},
            "must have exactly the keys in and package",
        ),
        (
            {"known_issues": {"in": ADDED, "package": "flashinfer-python"}},
            f"[tool.vllm-overlay.known-issues]: in = '{ADDED}' must name a constant",
        ),
    ],
)
def test_bad_coupling_declarations_are_named(pins: dict, expected: str) -> None:
    declared = Pins("0.33.0", "hisparse1", {}, adds=(ADDED,), **pins)
    problems = check.declared_name_problems(declared)
    assert len(problems) == 1 and expected in problems[0]


# The real tree's pins and files, against the real vllm 0.33.0 sources.
REPO_PINS = load_pins()
# Read before the fixtures move the cache root to a scratch folder.
REAL_WHEELS = [
    fetch.default_cache_dir() / name
    for name in sorted(REPO_PINS.sha256)
    if (fetch.default_cache_dir() / name).is_file()
]


def real_tree() -> dict[str, bytes]:
    return {
        path: (tree_imports.REPO_ROOT / path).read_bytes()
        for path in sorted(REPO_PINS.declared)
    }


def test_real_tree_uses_only_names_the_installed_vllm_has() -> None:
    """Every upstream name the tree uses is in the installed vllm 0.33.0."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    site = Path(next(iter(spec.submodule_search_locations))).parent
    sources = couplings.Sources.of_folder(site, "vllm", "the installed vllm")
    scan = couplings.scan_tree(REPO_PINS, real_tree(), sources)
    assert scan.problems == []
    found = {(Path(c.path).name, c.name, c.kind) for c in scan.couplings}
    group = "flashinfer_all_reduce_group.py"
    explain = "explain_flashinfer_all_reduce.py"
    factory = "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory"
    assert {
        (group, "vllm.distributed.parallel_state._node_count", "function"),
        (group, "vllm.config.get_current_vllm_config_or_none", "function"),
        (group, "vllm.envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND", "name"),
        (explain, "vllm.engine.arg_utils.get_kwargs", "function"),
        (explain, "vllm.config.kv_transfer.hisparse_host_pool_gib", "function"),
        (explain, f"{factory}.get_connector_class", "method"),
        (
            "flashinfer_all_reduce_policy.py",
            "vllm/envs.py: VLLM_FLASHINFER_ALLREDUCE_BACKEND",
            "choices",
        ),
    } <= found


@pytest.mark.skipif(
    not REAL_WHEELS,
    reason="the real vllm 0.33.0 base wheel is not cached here (CI: the "
    "installed-sources test covers the same scan)",
)
def test_real_tree_fits_the_real_base_wheel() -> None:
    assert (
        couplings.coupling_problems(
            REPO_PINS, real_tree(), REAL_WHEELS, REPO_PINS.requirement
        )
        == []
    )


def test_real_known_issues_are_read_statically() -> None:
    fixes = check.known_issue_fixes(REPO_PINS, tree_imports.REPO_ROOT)
    assert [name for name, _ in fixes] == [
        "flashinfer#7782",
        "mnnvl fp16 RMSNorm overflow",
    ]
    # 0.33.0 pins flashinfer-python 0.7.2.post1, which has no fix.
    metadata = b"Name: vllm\nRequires-Dist: flashinfer-python==0.7.2.post1\n\n"
    assert (
        check.known_issues_retired(REPO_PINS, tree_imports.REPO_ROOT, [metadata]) == ""
    )
