# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ways people install vLLM: wheel, sdist, over stock.

All on tiny synthetic base wheels, with pip cut off from every index (the
offline_pip fixture, tests/tools/conftest.py).
"""

import gzip
import importlib.util
import os
import sys
import tarfile
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    PATCHED,
    PATCHED_SOURCE,
    make_wheel,
    read_member,
    run_limited,
    scratch_project,
    scratch_venv,
)

from tools import buildapi, check, pack
from tools.pins import LOCATION_ENV, load_pins, overlay_metadata

UPSTREAM_NAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def test_tags_are_written_as_headers() -> None:
    # Upstream's WHEEL file, blank last line included.
    wheel_file = (
        b"Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\n"
        b"Root-Is-Purelib: false\nTag: cp38-abi3-linux_x86_64\n\n"
    )
    assert pack.with_tags(wheel_file, UPSTREAM_NAME) == (
        b"Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\n"
        b"Root-Is-Purelib: false\nTag: cp38-abi3-manylinux_2_28_x86_64\n"
    )


def test_sdist_of_this_repo_holds_what_a_build_needs(tmp_path: Path) -> None:
    names = []
    for attempt in ("a", "b"):
        out = tmp_path / attempt
        out.mkdir()
        names.append(out / buildapi.build_sdist(str(out)))
    raw = names[0].read_bytes()
    assert raw == names[1].read_bytes()  # reproducible
    assert raw[3] & 0x08 == 0  # no file name in the gzip header
    assert str(tree_imports.REPO_ROOT).encode() not in gzip.decompress(raw)
    version = load_pins().version
    assert names[0].name == f"vllm-{version}.tar.gz"
    top = f"vllm-{version}/"
    with tarfile.open(names[0]) as tar:
        members = tar.getmembers()
        read = {m.name.removeprefix(top): tar.extractfile(m).read() for m in members}
    repo = tree_imports.REPO_ROOT
    expected = ["LICENSE", "PKG-INFO", "README.md", "pyproject.toml"]
    expected += [f"tools/{p.name}" for p in (repo / "tools").iterdir() if p.is_file()]
    expected += [p.as_posix() for p in check.collect_overlay(repo / "vllm")]
    assert sorted(read) == sorted(expected)
    assert {m.uid for m in members} == {0} and {m.mtime for m in members} == {0}
    assert {m.uname for m in members} == {""}
    assert read["LICENSE"] == (repo / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0" in read["LICENSE"]
    # PKG-INFO is the wheel's METADATA: the base's, with our version.
    assert read["PKG-INFO"] == overlay_metadata(load_pins())
    assert f"Version: {version}\n".encode() in read["PKG-INFO"]
    assert b"Requires-Dist: flashinfer-python==0.7.4\n" in read["PKG-INFO"]
    assert read["pyproject.toml"] == (repo / "pyproject.toml").read_bytes()
    assert b"License-File: LICENSE\n" in read["PKG-INFO"]


def test_wheel_builds_from_the_sdist(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    sdist_dir = tmp_path / "sdist"
    sdist_dir.mkdir()
    hooks = _load_backend_of(project)
    sdist = sdist_dir / hooks.build_sdist(str(sdist_dir))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    unpacked = _only(tmp_path / "unpacked")
    out = tmp_path / "wheels"
    env = {**os.environ, LOCATION_ENV: str(base)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = run_limited([*cmd, "-w", str(out), str(unpacked)], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel = _only(out)
    assert wheel.name == "vllm-0.33.0+hisparse1-py3-none-any.whl"
    assert read_member(wheel, PATCHED.as_posix()) == PATCHED_SOURCE


@pytest.mark.skipif(
    importlib.util.find_spec("build") is None,
    reason="needs `build` (requirements/test.txt)",
)
def test_python_m_build_round_trip(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    env = {**os.environ, LOCATION_ENV: str(base)}
    out = tmp_path / "built"
    # sdist first, then a wheel built from that sdist: build's default.
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)]
    proc = run_limited([*cmd, str(project)], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "vllm-0.33.0+hisparse1-py3-none-any.whl",
        "vllm-0.33.0+hisparse1.tar.gz",
    ]


def _load_backend_of(project: Path):
    """The scratch project's own copy of the backend, as a frontend loads it."""
    code = (
        "import sys; sys.path.insert(0, '.'); "
        "from tools import buildapi as b; "
        "print(b.build_sdist(sys.argv[1]))"
    )

    class Hooks:
        @staticmethod
        def build_sdist(directory: str) -> str:
            proc = run_limited([sys.executable, "-c", code, directory], cwd=project)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc.stdout.strip()

    return Hooks


def _only(folder: Path) -> Path:
    found = list(folder.iterdir())
    assert len(found) == 1, found
    return found[0]


def test_no_deps_install_patches_an_existing_vllm_and_can_go_back(
    tmp_path: Path,
) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    python = str(scratch_venv(tmp_path))
    env = {
        **os.environ,
        LOCATION_ENV: str(base),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(base.parent),
    }
    pip = [sys.executable, "-m", "pip", "--python", python, "install"]
    module = ".".join(PATCHED.with_suffix("").parts)
    code = f"import vllm._version as v, {module} as m; print(v.__version__, m.STOCK)"
    probe = [python, "-c", code]

    def state() -> str:
        proc = run_limited(probe)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    # Stock 0.33.0, like the vllm-openai:v0.33.0 image (which has its deps).
    assert run_limited([*pip, "--no-deps", "vllm==0.33.0"], env=env).returncode == 0
    assert state() == "0.33.0 True"

    proc = run_limited(
        [*pip, "--no-deps", "--no-build-isolation", str(project)], env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert state() == "0.33.0+hisparse1 False"

    # pip counts 0.33.0+hisparse1 as satisfying ==0.33.0, so this does nothing.
    proc = run_limited([*pip, "--no-deps", "vllm==0.33.0"], env=env)
    assert "already satisfied" in proc.stdout
    assert state() == "0.33.0+hisparse1 False"

    # What the README says to do instead.
    proc = run_limited(
        [*pip, "--force-reinstall", "--no-deps", "vllm==0.33.0"], env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert state() == "0.33.0 True"
