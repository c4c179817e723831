# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Switching between this build and stock vLLM, with the README's commands.

The README's "Switching builds" table gives, for each target, a command and
the pair of versions it installs, or why it installs nothing. Every command
is run as written, by bash, with a scratch venv's own pip first on PATH (the
pip its Python bundles: 23.2 on 3.11), on synthetic releases in a local
find-links folder that serves what the real index serves: a vllm base wheel
named like upstream's, pinning flashinfer-python as the pinned release does,
and flashinfer-python 0.7.2.post1 and 0.7.4, not 0.7.3. After each step
``pip check`` must pass and the installed pair must be the one the README
names; a command the README says installs nothing must fail and change
nothing.
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

from tools.pins import load_pins, parse_metadata

README = Path(__file__).resolve().parents[2] / "README.md"
ARCH = platform.machine()
# Upstream's file name, which the README's cached-wheel command names.
BASE_TAGS = f"cp38-abi3-manylinux_2_28_{ARCH}"
SERVED = ("0.7.2.post1", "0.7.4")  # the flashinfer-python releases PyPI has
PROBE = (
    "import importlib.metadata as md; "
    "print(md.version('vllm'), md.version('flashinfer-python'))"
)
# | to | `command` (a note) | vllm V, flashinfer-python V | or | nothing: why |
_ROW = re.compile(
    r"^\| (?P<to>[^|]+) \| `(?P<command>[^`]+)`[^|]* \| (?P<installs>[^|]+) \|$"
)
_PAIR = re.compile(r"^vllm (\S+), flashinfer-python (\S+)$")


@dataclass(frozen=True)
class Switch:
    to: str
    command: str
    versions: tuple[str, str] | None  # None: the README says it installs nothing


def readme_switches() -> dict[str, Switch]:
    """The rows of the README's "Switching builds" table, by a short key."""
    text = README.read_text()
    section = text.split("\n## Switching builds\n", 1)[1].split("\n#", 1)[0]
    switches = {}
    for line in section.splitlines():
        row = _ROW.match(line)
        if row is None or row["to"] == "to":
            continue
        command, installs = row["command"], row["installs"].strip()
        assert " -C " not in command, f"README.md: {line!r}: the build takes no -C"
        pair = _PAIR.match(installs)
        assert pair or installs.startswith("nothing: "), (
            f"README.md: {line!r} names neither vllm and flashinfer-python nor "
            "'nothing: why'"
        )
        if "precompiled-wheels" in command:
            key = "stock-cached"
        elif command.startswith("pip install ."):
            key = "this build"
        else:
            key = "stock"
        assert key not in switches, f"README.md: two rows for {key}"
        switches[key] = Switch(row["to"].strip(), command, pair and pair.groups())
    assert {"this build", "stock"} <= set(switches) <= {*switches, "stock-cached"}
    return switches


def base_flashinfer_pin() -> str:
    """The flashinfer-python release the pinned base wheel requires."""
    requires = parse_metadata(load_pins().base_metadata).get_all("Requires-Dist")
    [pin] = [r for r in requires if r.startswith("flashinfer-python==")]
    return pin.split("==")[1].split(";")[0].strip()


def test_the_readme_names_the_builds_this_tree_makes() -> None:
    switches = readme_switches()
    pins = load_pins()
    [flashinfer] = [str(r.specifier)[2:] for r in pins.requires]
    assert switches["this build"].versions == (pins.version, flashinfer)
    for key in ("stock", "stock-cached"):
        if key not in switches:
            continue
        if base_flashinfer_pin() in SERVED:
            assert switches[key].versions == (pins.base_version, base_flashinfer_pin())
        else:  # stock vLLM cannot be installed from the index: say so
            assert switches[key].versions is None, f"README.md: {key} installs nothing"


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
    pins = load_pins()  # the README names this tree's versions
    base = make_wheel(
        tmp_path / "base",
        version=pins.base_version,
        wheel_tag=f"cp38-abi3-linux_{ARCH}",
        file_tags=BASE_TAGS,
        requires_dist=[f"flashinfer-python=={base_flashinfer_pin()}"],
    )
    for release in SERVED:
        make_dist(index, "flashinfer-python", release)
    shutil.copy(base, index)
    requires = [str(r) for r in pins.requires]
    project = scratch_project(tmp_path, base, requires)
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text().replace("'hisparse1'", repr(pins.local_label), 1)
    pyproject.write_text(text.replace("'0.33.0'", repr(pins.base_version), 1))
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
    """Run one README command, then ``pip check``; both must succeed, or,
    where the README says the command installs nothing, it must fail."""
    before = machine.installed()
    proc = machine.run(step.command)
    transcript.append(f"$ {step.command}   # to {step.to}: exit {proc.returncode}")
    if step.versions is None:
        assert proc.returncode != 0, f"`{step.command}` installed something"
        missing = f"flashinfer-python=={base_flashinfer_pin()}"
        output = proc.stdout + proc.stderr
        assert f"No matching distribution found for {missing}" in output
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    check = machine.run("pip check")
    transcript.append(f"$ pip check\n{check.stdout.strip()}")
    installed = machine.installed()
    transcript.append(f"  vllm {installed[0]}, flashinfer-python {installed[1]}")
    print("\n".join(transcript[-3:]))
    assert check.returncode == 0, (
        f"after `{step.command}`, pip check fails:\n{check.stdout}"
    )
    assert installed == (step.versions or before), f"after `{step.command}`"


def test_round_trip_through_stock(machine: Machine) -> None:
    """This build, to stock from the cache and from the index, and back.

    Going to stock from the cache must not download the release again: the
    find-links folder no longer holds it then.
    """
    switches = readme_switches()
    cache = Path(machine.env["VLLM_CACHE_ROOT"]) / "precompiled-wheels"
    pip = machine.run("pip --version").stdout
    assert str(machine.python.parents[1]) in pip, "the venv's own pip runs"
    transcript = [f"$ pip --version\n{pip.strip()}"]
    print(transcript[0])
    switch(machine, switches["this build"], transcript)
    assert (cache / machine.base.name).is_file(), "the build caches the base wheel"

    if "stock-cached" in switches:
        offered = machine.index / machine.base.name
        offered.unlink()
        switch(machine, switches["stock-cached"], transcript)
        shutil.copy(machine.base, offered)

    for key in ("stock", "this build"):
        switch(machine, switches[key], transcript)
