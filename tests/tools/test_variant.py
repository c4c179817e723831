# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The build on another FlashInfer release: ``pip install -C flashinfer=0.7.4 .``.

A variant is declared as data in ``[tool.vllm-overlay.variants]`` and picked
with a PEP 517 config setting; it replaces the base wheel's flashinfer-python
pin in the installed metadata and adds its label to the version. Driven
through the real hooks, real ``pip`` and (where installed) ``uv``, on tiny
synthetic wheels, with pip cut off from every index (tests/tools/conftest.py).
"""

import ast
import email.parser
import importlib.util
import os
import shutil
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from synthetic import (
    PATCHED,
    PATCHED_SOURCE,
    call_hook,
    fresh_dir,
    make_dist,
    make_wheel,
    read_member,
    run_limited,
    scratch_project,
    scratch_venv,
)

from tools import buildapi, pack, util
from tools.pins import LOCATION_ENV, load_pins

# Two variants, so that a tree made for one can be asked for the other.
VARIANTS = """
[tool.vllm-overlay.variants.flashinfer]
"0.7.4" = { label = "fi074", requires = ["flashinfer-python==0.7.4"] }
"0.8.0" = { label = "fi080", requires = ["flashinfer-python==0.8.0"] }
"""
BASE_REQUIRES = [
    "numpy",
    "flashinfer-python==0.7.2.post1",
    'torch==2.14.0; platform_machine == "x86_64"',
]
DEFAULT = "0.33.0+hisparse1"
VARIANT = "0.33.0+hisparse1.fi074"
# This repository's builds: its pyproject.toml has its own local-label.
REPO_DEFAULT = "0.33.0+hisparse3"
REPO_VARIANT = "0.33.0+hisparse3.fi074"
ACCEPTED = "-C flashinfer=0.7.4, -C flashinfer=0.8.0"


def base_wheel(tmp_path: Path, requires: Sequence[str] = BASE_REQUIRES) -> Path:
    """A synthetic vllm 0.33.0 that pins flashinfer-python as upstream's does."""
    return make_wheel(tmp_path / "base", requires_dist=requires)


def metadata_of(wheel: Path, version: str) -> email.message.Message:
    text = read_member(wheel, f"vllm-{version}.dist-info/METADATA")
    return email.parser.Parser().parsestr(text)


def version_values(source: str) -> dict:
    """The assignments of a vcs-versioning ``_version.py``."""
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                values[ast.unparse(target)] = ast.literal_eval(node.value)
    return values


def build_with(
    project: Path, base: Path, tmp_path: Path, settings: Mapping | None
) -> Path:
    """Build the project's wheel in-process, as the hooks do, with ``settings``."""
    out = fresh_dir(tmp_path)
    pins = load_pins(project / "pyproject.toml", settings)
    name = pack.build(out, pins=pins, overlay_root=project / "vllm", location=str(base))
    return out / name


def test_the_repo_offers_flashinfer_0_7_4() -> None:
    pins = load_pins(settings={"flashinfer": "0.7.4"})
    assert pins.version == REPO_VARIANT
    assert pins.chosen == (("flashinfer", "0.7.4"),)
    default = load_pins()
    assert (default.version, default.chosen) == (REPO_DEFAULT, ())


def test_the_variant_wheel_pins_its_flashinfer_and_says_so(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    out = fresh_dir(tmp_path)
    settings = {"flashinfer": "0.7.4"}
    env = {LOCATION_ENV: str(base)}
    proc = call_hook(project, "build_wheel", out, settings, env)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.splitlines()[-1]
    assert name == f"vllm-{VARIANT}-py3-none-any.whl"
    wheel = out / name
    metadata = metadata_of(wheel, VARIANT)
    assert metadata["Version"] == VARIANT
    # Replaced in place; every other requirement as the base wheel has it.
    assert metadata.get_all("Requires-Dist") == [
        "numpy",
        "flashinfer-python==0.7.4",
        'torch==2.14.0; platform_machine == "x86_64"',
    ]
    assert read_member(wheel, PATCHED.as_posix()) == PATCHED_SOURCE
    values = version_values(read_member(wheel, "vllm/_version.py"))
    assert values["__version__"] == VARIANT
    assert values["__version_tuple__"] == (0, 33, 0, "hisparse1.fi074")
    assert (
        "-C flashinfer=0.7.4: flashinfer-python==0.7.4 in place of "
        "flashinfer-python==0.7.2.post1"
    ) in proc.stderr


def test_collect_env_reports_the_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own collect-env, on the version file the variant build wrote."""
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    wheel = build_with(project, base, tmp_path, {"flashinfer": "0.7.4"})
    values = version_values(read_member(wheel, "vllm/_version.py"))
    import vllm
    from vllm import collect_env

    monkeypatch.setattr(vllm, "__version__", values["__version__"])
    monkeypatch.setattr(vllm, "__version_tuple__", values["__version_tuple__"])
    assert collect_env.get_vllm_version() == VARIANT


def test_a_marker_on_the_base_pin_is_kept(tmp_path: Path) -> None:
    base = base_wheel(
        tmp_path, requires=['flashinfer-python==0.7.2.post1; sys_platform == "linux"']
    )
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    wheel = build_with(project, base, tmp_path, {"flashinfer": "0.7.4"})
    assert metadata_of(wheel, VARIANT).get_all("Requires-Dist") == [
        'flashinfer-python==0.7.4; sys_platform == "linux"'
    ]


HOOKS_WITH_DIRECTORY = ("build_wheel", "build_editable", "build_sdist")
HOOKS = (
    "get_requires_for_build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    *HOOKS_WITH_DIRECTORY,
)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"flashinfer": "0.7.3"}, "-C flashinfer=0.7.3 is not a build"),
        ({"flashinfer": ["0.7.4", "0.8.0"]}, "-C flashinfer is given 2 times"),
    ],
    ids=["unknown-version", "given-twice"],
)
def test_a_bad_value_is_one_line_and_builds_nothing(
    tmp_path: Path, hook: str, settings: dict, named: str
) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    out = fresh_dir(tmp_path) if hook in HOOKS_WITH_DIRECTORY else None
    proc = call_hook(project, hook, out, settings, {LOCATION_ENV: str(base)})
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: {named}: this build takes {ACCEPTED}"]
    assert out is None or list(out.iterdir()) == []


def test_no_setting_is_the_default_build(tmp_path: Path) -> None:
    """Declaring variants changes nothing about the build without ``-C``."""
    base = base_wheel(tmp_path)
    plain = scratch_project(tmp_path / "plain", base)
    with_variants = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    digests = set()
    for n, (project, settings) in enumerate(
        [(plain, None), (with_variants, None), (with_variants, {})]
    ):
        out = fresh_dir(tmp_path)
        env = {LOCATION_ENV: str(base), "VLLM_CACHE_ROOT": str(tmp_path / f"c{n}")}
        proc = call_hook(project, "build_wheel", out, settings, env)
        assert proc.returncode == 0, proc.stderr
        wheel = out / proc.stdout.splitlines()[-1]
        assert wheel.name == f"vllm-{DEFAULT}-py3-none-any.whl"
        digests.add(util.sha256_of(wheel))
    assert len(digests) == 1
    metadata = metadata_of(wheel, DEFAULT)
    assert metadata.get_all("Requires-Dist") == BASE_REQUIRES
    # The base wheel's METADATA, only its Version changed.
    base_text = read_member(base, "vllm-0.33.0.dist-info/METADATA")
    ours = read_member(wheel, f"vllm-{DEFAULT}.dist-info/METADATA")
    assert ours.replace(f"Version: {DEFAULT}\n", "") == base_text.replace(
        "Version: 0.33.0\n", ""
    )


def test_the_variant_sdist_builds_the_variant_by_itself(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    settings = {"flashinfer": "0.7.4"}
    sdists = []
    for _ in range(2):
        out = fresh_dir(tmp_path)
        proc = call_hook(project, "build_sdist", out, settings)
        assert proc.returncode == 0, proc.stderr
        sdists.append(out / proc.stdout.splitlines()[-1])
    assert sdists[0].read_bytes() == sdists[1].read_bytes()  # reproducible
    sdist = sdists[0]
    assert sdist.name == f"vllm-{VARIANT}.tar.gz"
    with tarfile.open(sdist) as tar:
        pkg_info = tar.extractfile(f"vllm-{VARIANT}/PKG-INFO").read().decode()
        names = tar.getnames()
    assert f"Version: {VARIANT}\n" in pkg_info
    assert {n.split("/", 1)[0] for n in names} == {f"vllm-{VARIANT}"}

    # pip checks that the sdist's file name and its wheel's version agree;
    # no -C is given: the sdist carries the choice.
    env = {**os.environ, LOCATION_ENV: str(base)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    out = fresh_dir(tmp_path)
    proc = run_limited([*cmd, "-w", str(out), str(sdist)], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = out.iterdir()
    assert wheel.name == f"vllm-{VARIANT}-py3-none-any.whl"
    requires = metadata_of(wheel, VARIANT).get_all("Requires-Dist")
    assert "flashinfer-python==0.7.4" in requires

    # Asking it for another variant is refused, in one line.
    out = fresh_dir(tmp_path)
    proc = run_limited(
        [*cmd, "-C", "flashinfer=0.8.0", "-w", str(out), str(sdist)], env=env
    )
    assert proc.returncode != 0
    [line] = [x for x in proc.stderr.splitlines() if "made for" in x]
    assert "error: this source tree was made for -C flashinfer=0.7.4" in line
    assert "cannot build -C flashinfer=0.8.0" in line
    assert list(out.iterdir()) == []


@pytest.mark.skipif(
    importlib.util.find_spec("build") is None,
    reason="needs `build` (requirements/test.txt)",
)
def test_python_m_build_C_makes_the_variant_sdist_and_wheel(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    env = {**os.environ, LOCATION_ENV: str(base)}
    out = tmp_path / "built"
    # The sdist first, then a wheel from it: build's default.
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)]
    proc = run_limited([*cmd, "-C", "flashinfer=0.7.4", str(project)], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        f"vllm-{VARIANT}-py3-none-any.whl",
        f"vllm-{VARIANT}.tar.gz",
    ]


def test_the_default_sdist_carries_the_pyproject_as_it_is(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    out = fresh_dir(tmp_path)
    proc = call_hook(project, "build_sdist", out, None)
    assert proc.returncode == 0, proc.stderr
    sdist = out / proc.stdout.splitlines()[-1]
    assert sdist.name == f"vllm-{DEFAULT}.tar.gz"
    with tarfile.open(sdist) as tar:
        carried = tar.extractfile(f"vllm-{DEFAULT}/pyproject.toml").read()
    assert carried == (project / "pyproject.toml").read_bytes()


def test_the_real_repo_sdist_records_the_variant(tmp_path: Path) -> None:
    out = fresh_dir(tmp_path)
    name = buildapi.build_sdist(str(out), {"flashinfer": "0.7.4"})
    assert name == f"vllm-{REPO_VARIANT}.tar.gz"
    with tarfile.open(out / name) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    pins = load_pins(tmp_path / "unpacked" / f"vllm-{REPO_VARIANT}" / "pyproject.toml")
    assert (pins.version, pins.chosen) == (REPO_VARIANT, (("flashinfer", "0.7.4"),))


def index_with_flashinfers(tmp_path: Path) -> Path:
    """A local index: both flashinfer-python releases, and a plugin of vLLM."""
    index = tmp_path / "index"
    for release in ("0.7.2.post1", "0.7.4"):
        make_dist(index, "flashinfer-python", release)
    make_dist(index, "vllm-plugin", "1.0", requires=["vllm", "flashinfer-python"])
    return index


def pip_in(python: Path, index: Path, base: Path):
    """``pip ARGS`` run for the venv of ``python``, offline; asserts nothing."""
    env = {
        **os.environ,
        LOCATION_ENV: str(base),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
    }

    def pip(*args: str):
        cmd = [sys.executable, "-m", "pip", "--python", str(python), *args]
        return run_limited(cmd, env=env)

    return pip


PROBE = (
    "import importlib.metadata as md, vllm._version as v; "
    "print(v.__version__, md.version('vllm'), md.version('flashinfer-python'))"
)


def test_pip_install_C_is_clean_and_a_later_resolve_keeps_it(tmp_path: Path) -> None:
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.2.post1"])
    index = index_with_flashinfers(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    python = scratch_venv(tmp_path)
    pip = pip_in(python, index, base)
    proc = pip(
        "install", "--no-build-isolation", "-C", "flashinfer=0.7.4", str(project)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = pip("check")
    assert proc.returncode == 0, proc.stdout
    proc = pip("show", "vllm")
    assert f"Version: {VARIANT}\n" in proc.stdout
    assert run_limited([str(python), "-c", PROBE]).stdout.split() == [
        VARIANT,
        VARIANT,
        "0.7.4",
    ]
    # A later resolve that takes vLLM's requirements in keeps 0.7.4.
    proc = pip("install", "vllm-plugin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_limited([str(python), "-c", PROBE]).stdout.split()[2] == "0.7.4"
    assert pip("check").returncode == 0


def test_editable_install_takes_the_setting(tmp_path: Path) -> None:
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.2.post1"])
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    python = scratch_venv(tmp_path)
    pip = pip_in(python, index_with_flashinfers(tmp_path), base)
    proc = pip(
        "install",
        "--no-build-isolation",
        "-e",
        str(project),
        "-C",
        "flashinfer=0.7.4",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    module = ".".join(PATCHED.with_suffix("").parts)
    code = f"{PROBE}; import {module} as m; print(m.__file__)"
    version, dist_version, flashinfer, path = run_limited(
        [str(python), "-c", code]
    ).stdout.split()
    assert (version, dist_version, flashinfer) == (VARIANT, VARIANT, "0.7.4")
    assert Path(path) == project / PATCHED  # loaded from the working tree
    assert pip("check").returncode == 0


def test_no_deps_over_stock_needs_flashinfer_installed_too(tmp_path: Path) -> None:
    """The container path: stock 0.33.0 and its pinned FlashInfer installed."""
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.2.post1"])
    index = index_with_flashinfers(tmp_path)
    shutil.copy(base, index)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    python = scratch_venv(tmp_path)
    pip = pip_in(python, index, base)
    proc = pip("install", "--no-deps", "vllm==0.33.0", "flashinfer-python==0.7.2.post1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip("check").returncode == 0

    proc = pip(
        "install",
        "--no-deps",
        "--no-build-isolation",
        "-C",
        "flashinfer=0.7.4",
        str(project),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = pip("check")
    assert proc.returncode == 1
    assert "flashinfer-python==0.7.4" in proc.stdout
    assert "0.7.2.post1" in proc.stdout

    # What the README tells the container user to run as well.
    proc = pip("install", "flashinfer-python==0.7.4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip("check").returncode == 0
    assert run_limited([str(python), "-c", PROBE]).stdout.split() == [
        VARIANT,
        VARIANT,
        "0.7.4",
    ]


def test_a_bad_variant_label_is_refused(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    extra = (
        "\n[tool.vllm-overlay.variants.flashinfer]\n"
        '"0.7.4" = { label = "fi-074", requires = ["flashinfer-python==0.7.4"] }\n'
    )
    project = scratch_project(tmp_path, base, pyproject_extra=extra)
    with pytest.raises(util.OverlayError, match="label 'fi-074' is not letters"):
        load_pins(project / "pyproject.toml")


def test_a_variant_with_nothing_to_replace_is_refused(tmp_path: Path) -> None:
    base = base_wheel(tmp_path, requires=["numpy"])
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    out = fresh_dir(tmp_path)
    pins = load_pins(project / "pyproject.toml", {"flashinfer": "0.7.4"})
    with pytest.raises(util.OverlayError, match="does not require flashinfer-python"):
        pack.build(out, pins=pins, overlay_root=project / "vllm", location=str(base))
    assert list(out.iterdir()) == []


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv on PATH")
def test_uv_passes_the_setting_and_keys_its_cache_on_it(tmp_path: Path) -> None:
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.2.post1"])
    index = index_with_flashinfers(tmp_path)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANTS)
    python = scratch_venv(tmp_path)
    env = {
        **os.environ,
        LOCATION_ENV: str(base),
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
    }
    uv = [shutil.which("uv"), "pip", "install", "--python", str(python)]
    uv += ["--offline", "--no-index", "--find-links", str(index)]
    uv += ["--no-build-isolation"]
    probe = [str(python), "-c", PROBE]
    for settings, expected in [
        (["-C", "flashinfer=0.7.4"], [VARIANT, VARIANT, "0.7.4"]),
        ([], [DEFAULT, DEFAULT, "0.7.2.post1"]),
        (["-C", "flashinfer=0.7.4"], [VARIANT, VARIANT, "0.7.4"]),
    ]:
        proc = run_limited([*uv, *settings, str(project)], env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert run_limited(probe).stdout.split() == expected
