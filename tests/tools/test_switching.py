# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Switching between the builds and stock vLLM, with the README's commands.

The README's "Switching builds" table gives, for each target, a command and
the pair of versions it installs. Every command is run as written, by bash,
with a scratch venv's own pip first on PATH (the pip its Python bundles: 23.2
on 3.11), on synthetic releases in a local find-links folder: a vllm 0.33.0
base wheel named like upstream's, which pins flashinfer-python 0.7.2.post1,
and flashinfer-python 0.7.2.post1 and 0.7.4. After each step ``pip check``
must pass and the installed pair must be the one the README names.
"""

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.tags import Tag, sys_tags
from synthetic import make_dist, make_wheel, run_limited, scratch_project, scratch_venv

from tools.pins import load_pins

README = Path(__file__).resolve().parents[2] / "README.md"
ARCH = platform.machine()
# Upstream's file name, which the README's cached-wheel command names.
BASE_TAGS = f"cp38-abi3-manylinux_2_28_{ARCH}"
VARIANT = """
[tool.vllm-overlay.variants.flashinfer]
"0.7.4" = { label = "fi074", requires = ["flashinfer-python==0.7.4"] }
"""
PROBE = (
    "import importlib.metadata as md; "
    "print(md.version('vllm'), md.version('flashinfer-python'))"
)
# | to | `command` (a note) | vllm V, flashinfer-python V |
_ROW = re.compile(
    r"^\| (?P<to>[^|]+) \| `(?P<command>[^`]+)`[^|]* \| (?P<pair>[^|]+) \|$"
)
_PAIR = re.compile(r"^vllm (\S+), flashinfer-python (\S+)$")


@dataclass(frozen=True)
class Switch:
    to: str
    command: str
    versions: tuple[str, str]


def readme_switches() -> dict[str, Switch]:
    """The rows of the README's "Switching builds" table, by a short key."""
    text = README.read_text()
    section = text.split("\n## Switching builds\n", 1)[1].split("\n#", 1)[0]
    switches = {}
    for line in section.splitlines():
        row = _ROW.match(line)
        if row is None or row["to"] == "to":
            continue
        pair = _PAIR.match(row["pair"].strip())
        assert pair, f"README.md: {line!r} does not name vllm and flashinfer-python"
        command = row["command"]
        if "-C flashinfer=0.7.4" in command:
            key = "variant"
        elif "precompiled-wheels" in command:
            key = "stock-cached"
        elif command.startswith("pip install ."):
            key = "default"
        else:
            key = "stock"
        assert key not in switches, f"README.md: two rows for {key}"
        switches[key] = Switch(row["to"].strip(), command, pair.groups())
    assert sorted(switches) == ["default", "stock", "stock-cached", "variant"]
    return switches


def test_the_readme_names_the_builds_this_tree_makes() -> None:
    switches = readme_switches()
    assert switches["default"].versions[0] == load_pins().version
    variant = load_pins(settings={"flashinfer": "0.7.4"}).version
    assert switches["variant"].versions == (variant, "0.7.4")
    assert switches["stock"].versions[0] == load_pins().base_version


@dataclass
class Machine:
    """A venv, a source tree and a find-links folder, driven through bash."""

    python: Path
    project: Path
    index: Path
    base: Path
    env: dict[str, str]

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        return run_limited(["bash", "-c", command], cwd=self.project, env=self.env)

    def installed(self) -> tuple[str, ...]:
        return tuple(run_limited([str(self.python), "-c", PROBE]).stdout.split())


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    if Tag("cp38", "abi3", f"manylinux_2_28_{ARCH}") not in set(sys_tags()):
        pytest.skip(f"needs a platform that installs {BASE_TAGS} wheels")
    index = tmp_path / "index"
    base = make_wheel(
        tmp_path / "base",
        wheel_tag=f"cp38-abi3-linux_{ARCH}",
        file_tags=BASE_TAGS,
        requires_dist=["flashinfer-python==0.7.2.post1"],
    )
    for release in ("0.7.2.post1", "0.7.4"):
        make_dist(index, "flashinfer-python", release)
    shutil.copy(base, index)
    project = scratch_project(tmp_path, base, pyproject_extra=VARIANT)
    pyproject = project / "pyproject.toml"
    label = load_pins().local_label  # the README names this tree's versions
    pyproject.write_text(pyproject.read_text().replace("'hisparse1'", repr(label), 1))
    python = scratch_venv(tmp_path, with_pip=True)
    env = {
        **os.environ,  # tests/tools/conftest.py: no index, a fresh vLLM cache
        "PATH": os.pathsep.join([str(python.parent), os.environ["PATH"]]),
        "VIRTUAL_ENV": str(python.parents[1]),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(index),
        # The build's own requires come from the venv, not an index; pip reads
        # this variable inverted: "0" turns build isolation off.
        "PIP_NO_BUILD_ISOLATION": "0",
    }
    return Machine(python, project, index, base, env)


def switch(machine: Machine, step: Switch, transcript: list[str]) -> None:
    """Run one README command, then ``pip check``; both must succeed."""
    proc = machine.run(step.command)
    transcript.append(f"$ {step.command}   # to {step.to}: exit {proc.returncode}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = machine.run("pip check")
    transcript.append(f"$ pip check\n{check.stdout.strip()}")
    installed = machine.installed()
    transcript.append(f"  vllm {installed[0]}, flashinfer-python {installed[1]}")
    print("\n".join(transcript[-3:]))
    assert check.returncode == 0, (
        f"after `{step.command}`, pip check fails:\n{check.stdout}"
    )
    assert installed == step.versions, f"after `{step.command}`"


@pytest.mark.parametrize("start", ["default", "variant"])
def test_round_trip_through_stock_and_the_other_build(
    machine: Machine, start: str
) -> None:
    """From a build: to stock, to the other build, back, and to stock again.

    Going to stock from the cache must not download the release again: the
    find-links folder no longer holds it then.
    """
    switches = readme_switches()
    other = "variant" if start == "default" else "default"
    cache = Path(machine.env["VLLM_CACHE_ROOT"]) / "precompiled-wheels"
    pip = machine.run("pip --version").stdout
    assert str(machine.python.parents[1]) in pip, "the venv's own pip runs"
    transcript = [f"$ pip --version\n{pip.strip()}"]
    print(transcript[0])
    switch(machine, switches[start], transcript)
    assert (cache / machine.base.name).is_file(), "the build caches the base wheel"

    offered = machine.index / machine.base.name
    offered.unlink()
    switch(machine, switches["stock-cached"], transcript)
    shutil.copy(machine.base, offered)

    for key in (other, start, "stock"):
        switch(machine, switches[key], transcript)
