# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The requirement overrides: ``requires`` in ``[tool.vllm-overlay]``.

Each replaces the base wheel's Requires-Dist line of the same project, in
place, keeping that line's marker, in every build: the repository's puts
flashinfer-python 0.7.4 where vLLM pins 0.7.3, a release the package index
does not serve. Driven through the real hooks and real ``pip`` on tiny
synthetic wheels, with pip cut off from every index (tests/tools/conftest.py).
"""

import email.parser
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from synthetic import (
    call_hook,
    fresh_dir,
    make_dist,
    make_wheel,
    read_member,
    run_limited,
    scratch_project,
    scratch_venv,
)

from tools import pack, util
from tools.pins import LOCATION_ENV, load_pins

OVERRIDE = ["flashinfer-python==0.7.4"]
BASE_REQUIRES = [
    "numpy",
    "flashinfer-python==0.7.3",
    'torch==2.14.0; platform_machine == "x86_64"',
]
VERSION = "0.33.0+hisparse1"


def base_wheel(tmp_path: Path, requires: Sequence[str] = BASE_REQUIRES) -> Path:
    """A synthetic vllm that pins flashinfer-python as upstream's does."""
    return make_wheel(tmp_path / "base", requires_dist=requires)


def requires_dist(wheel: Path) -> list[str]:
    text = read_member(wheel, f"vllm-{VERSION}.dist-info/METADATA")
    return email.parser.Parser().parsestr(text).get_all("Requires-Dist")


def build(project: Path, base: Path, tmp_path: Path) -> Path:
    out = fresh_dir(tmp_path)
    pins = load_pins(project / "pyproject.toml")
    name = pack.build(out, pins=pins, overlay_root=project / "vllm", location=str(base))
    return out / name


def test_the_repo_builds_on_flashinfer_0_7_4() -> None:
    assert load_pins().requires == (Requirement("flashinfer-python==0.7.4"),)


def test_the_override_takes_the_base_lines_place_and_says_so(tmp_path: Path) -> None:
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, OVERRIDE)
    out = fresh_dir(tmp_path)
    proc = call_hook(project, "build_wheel", out, None, {LOCATION_ENV: str(base)})
    assert proc.returncode == 0, proc.stderr
    wheel = out / proc.stdout.splitlines()[-1]
    assert wheel.name == f"vllm-{VERSION}-py3-none-any.whl"
    assert requires_dist(wheel) == [
        "numpy",
        "flashinfer-python==0.7.4",
        'torch==2.14.0; platform_machine == "x86_64"',
    ]
    line = "flashinfer-python==0.7.4 in place of flashinfer-python==0.7.3"
    assert f"vllm-overlay: {line}" in proc.stderr.splitlines()


def test_a_marker_on_the_base_line_is_kept(tmp_path: Path) -> None:
    base = base_wheel(
        tmp_path, requires=['flashinfer-python==0.7.3; sys_platform == "linux"']
    )
    wheel = build(scratch_project(tmp_path, base, OVERRIDE), base, tmp_path)
    assert requires_dist(wheel) == ['flashinfer-python==0.7.4; sys_platform == "linux"']


@pytest.mark.parametrize(
    "hook", ["prepare_metadata_for_build_wheel", "build_wheel", "build_sdist"]
)
def test_an_override_with_nothing_to_replace_is_one_line(
    tmp_path: Path, hook: str
) -> None:
    base = base_wheel(tmp_path, requires=["numpy"])
    project = scratch_project(tmp_path, base, OVERRIDE)
    out = fresh_dir(tmp_path)
    proc = call_hook(project, hook, out, None, {LOCATION_ENV: str(base)})
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        (
            "error: flashinfer-python==0.7.4 in [tool.vllm-overlay] requires "
            "overrides nothing: vllm==0.33.0 does not require flashinfer-python. "
            "Fix: remove it"
        )
    ]
    assert list(out.iterdir()) == []


def test_the_sdist_builds_the_same_wheel_whatever_the_C(tmp_path: Path) -> None:
    """The sdist carries pyproject.toml as it is; a -C changes nothing."""
    base = base_wheel(tmp_path)
    project = scratch_project(tmp_path, base, OVERRIDE)
    out = fresh_dir(tmp_path)
    proc = call_hook(project, "build_sdist", out, {"flashinfer": "0.7.3"})
    assert proc.returncode == 0, proc.stderr
    sdist = out / proc.stdout.splitlines()[-1]
    assert sdist.name == f"vllm-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        carried = tar.extractfile(f"vllm-{VERSION}/pyproject.toml")
        assert carried and carried.read() == (project / "pyproject.toml").read_bytes()
    env = {**os.environ, LOCATION_ENV: str(base)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    digests = set()
    for settings in ([], ["-C", "flashinfer=0.7.3"]):
        out = fresh_dir(tmp_path)
        proc = run_limited([*cmd, *settings, "-w", str(out), str(sdist)], env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [wheel] = out.iterdir()
        assert "flashinfer-python==0.7.4" in requires_dist(wheel)
        digests.add(util.sha256_of(wheel))
    assert len(digests) == 1


def index_with_flashinfers(tmp_path: Path) -> Path:
    """A local index as the real one: no flashinfer-python 0.7.3."""
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


def test_pip_install_is_clean_and_a_later_resolve_keeps_it(tmp_path: Path) -> None:
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.3"])
    project = scratch_project(tmp_path, base, OVERRIDE)
    python = scratch_venv(tmp_path)
    pip = pip_in(python, index_with_flashinfers(tmp_path), base)
    proc = pip("install", "--no-build-isolation", str(project))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip("check").returncode == 0
    probe = [str(python), "-c", PROBE]
    assert run_limited(probe).stdout.split() == [VERSION, VERSION, "0.7.4"]
    # A later resolve that takes vLLM's requirements in keeps 0.7.4.
    proc = pip("install", "vllm-plugin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_limited(probe).stdout.split()[2] == "0.7.4"
    assert pip("check").returncode == 0


def test_no_deps_over_stock_needs_flashinfer_installed_too(tmp_path: Path) -> None:
    """The container path: stock vLLM and the FlashInfer it pins, installed
    from elsewhere (an image), then this build with --no-deps."""
    base = base_wheel(tmp_path, requires=["flashinfer-python==0.7.3"])
    image = tmp_path / "image"
    make_dist(image, "flashinfer-python", "0.7.3")
    python = scratch_venv(tmp_path)
    pip = pip_in(python, index_with_flashinfers(tmp_path), base)
    proc = pip("install", "--no-deps", str(base), str(next(image.iterdir())))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip("check").returncode == 0

    project = scratch_project(tmp_path, base, OVERRIDE)
    proc = pip("install", "--no-deps", "--no-build-isolation", str(project))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = pip("check")
    assert proc.returncode == 1
    assert "flashinfer-python==0.7.4" in proc.stdout and "0.7.3" in proc.stdout

    # What the README tells the container user to run as well.
    proc = pip("install", "flashinfer-python==0.7.4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert pip("check").returncode == 0
    probe = [str(python), "-c", PROBE]
    assert run_limited(probe).stdout.split() == [VERSION, VERSION, "0.7.4"]
