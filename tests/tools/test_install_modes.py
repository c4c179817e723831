# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ways people install vLLM: wheel, editable, sdist, reproducible, cached.

All on tiny synthetic base wheels, with pip cut off from every index (the
offline_pip fixture, tests/tools/conftest.py).
"""

import ast
import gzip
import importlib.util
import os
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    PATCHED,
    PATCHED_SOURCE,
    editable_install,
    make_overlay,
    make_wheel,
    pins_for,
    read_member,
    run_limited,
    scratch_project,
    scratch_venv,
    site_packages,
)

from tools import buildapi, check, fetch, pack, util
from tools.pins import LOCATION_ENV, check_label

TIMEOUT = 180


UPSTREAM_NAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"


BUILT_NAME = "vllm-0.33.0+hisparse1-cp38-abi3-manylinux_2_28_x86_64.whl"


def upstream_like(tmp_path: Path) -> Path:
    """A synthetic base whose WHEEL and file name disagree, as upstream's do."""
    return make_wheel(
        tmp_path,
        wheel_tag="cp38-abi3-linux_x86_64",
        file_tags="cp38-abi3-manylinux_2_28_x86_64",
    )


def test_built_wheel_reports_the_local_version(tmp_path: Path, out_dir: Path) -> None:
    base = upstream_like(tmp_path)
    written: list[str] = []

    class RecordingWheelFile(pack.WheelFile):
        def writestr(self, zinfo_or_arcname, data, compress_type=None) -> None:
            written.append(getattr(zinfo_or_arcname, "filename", zinfo_or_arcname))
            super().writestr(zinfo_or_arcname, data, compress_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack, "WheelFile", RecordingWheelFile)
        name = pack.build(
            out_dir,
            pins=pins_for(base),
            overlay_root=make_overlay(tmp_path),
            location=str(base),
        )
    assert name == BUILT_NAME
    with zipfile.ZipFile(out_dir / name) as zf:
        assert written == zf.namelist()  # each member compressed once
    source = read_member(out_dir / name, "vllm/_version.py")
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                values[ast.unparse(target)] = ast.literal_eval(node.value)
    assert values["__version__"] == "0.33.0+hisparse1"
    assert values["__version_tuple__"] == (0, 33, 0, "hisparse1")
    assert values["__commit_id__"] == "g4ba787ec9"
    wheel_info = read_member(out_dir / name, "vllm-0.33.0+hisparse1.dist-info/WHEEL")
    assert "Tag: cp38-abi3-manylinux_2_28_x86_64" in wheel_info
    assert "linux_x86_64" not in wheel_info.replace("manylinux_2_28_x86_64", "")


def test_stages_are_logged_with_times(
    tmp_path: Path, out_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    base = make_wheel(tmp_path)
    pack.build(
        out_dir,
        pins=pins_for(base),
        overlay_root=make_overlay(tmp_path),
        location=str(base),
    )
    err = capsys.readouterr().err
    for stage in ("checked the sha256", "hashed the overlay", "packed", "done in"):
        assert f"vllm-overlay: {stage}" in err
    assert " s)\n" in err


def test_two_builds_of_one_tree_are_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    overlay_root = make_overlay(tmp_path)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    digests = []
    for i, (mtime, umask) in enumerate(
        [(1_600_000_000, 0o022), (1_700_000_000, 0o077)]
    ):
        # A fresh checkout: other file times, another umask, no build cache.
        os.utime(overlay_root.parent / PATCHED, (mtime, mtime))
        out = tmp_path / f"out{i}"
        out.mkdir()
        old_umask = os.umask(umask)
        try:
            name = pack.build(
                out,
                pins=pins_for(base),
                overlay_root=overlay_root,
                location=str(base),
                cache_dir=tmp_path / f"cache{i}" / "precompiled-wheels",
            )
        finally:
            os.umask(old_umask)
        digests.append(util.sha256_of(out / name))
    assert digests[0] == digests[1]
    # The default time is the base wheel's own, not the clock's.
    with zipfile.ZipFile(base) as zf:
        base_time = max(info.date_time for info in zf.infolist())
    with zipfile.ZipFile(out / name) as zf:
        assert {info.date_time for info in zf.infolist()} == {base_time}


def test_source_date_epoch_is_honoured(
    tmp_path: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # 2023-11-14 22:13:20
    name = pack.build(
        out_dir,
        pins=pins_for(base),
        overlay_root=make_overlay(tmp_path),
        location=str(base),
    )
    with zipfile.ZipFile(out_dir / name) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}


def test_unchanged_rebuild_reuses_the_cached_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    overlay_root = make_overlay(tmp_path)

    def build(out: Path) -> Path:
        out.mkdir()
        return out / pack.build(
            out, pins=pins_for(base), overlay_root=overlay_root, location=str(base)
        )

    first = build(tmp_path / "out1")

    def no_repack(*args: object, **kwargs: object) -> None:
        raise AssertionError("an unchanged tree must not be repacked")

    with monkeypatch.context() as mp:
        mp.setattr(pack, "repack", no_repack)
        second = build(tmp_path / "out2")
    assert second.read_bytes() == first.read_bytes()
    assert [p.name for p in second.parent.iterdir()] == [second.name]

    # Any change to the tree is a new build.
    (overlay_root.parent / PATCHED).write_text(PATCHED_SOURCE + "# edited\n")
    third = build(tmp_path / "out3")
    assert read_member(third, PATCHED.as_posix()).endswith("# edited\n")
    cache = fetch.default_cache_dir().parent / pack.CACHE_SUBDIR
    assert len([p for p in cache.iterdir()]) <= pack.CACHE_KEEP


def test_tags_are_written_as_headers(tmp_path: Path) -> None:
    wheel_file = tmp_path / "WHEEL"
    # Upstream's WHEEL file, blank last line included.
    wheel_file.write_text(
        "Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\n"
        "Root-Is-Purelib: false\nTag: cp38-abi3-linux_x86_64\n\n"
    )
    pack.write_tags(wheel_file, UPSTREAM_NAME)
    assert wheel_file.read_text() == (
        "Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\n"
        "Root-Is-Purelib: false\nTag: cp38-abi3-manylinux_2_28_x86_64\n"
    )


@pytest.mark.parametrize("label", ["cpu1", "gfix1"])
def test_labels_vllm_would_misread_are_refused(label: str) -> None:
    with pytest.raises(util.OverlayError, match="local-label"):
        check_label(label)
    check_label("hisparse1")


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
    assert names[0].name == "vllm-0.33.0+hisparse3.tar.gz"
    with tarfile.open(names[0]) as tar:
        members = tar.getmembers()
        pkg_info = tar.extractfile("vllm-0.33.0+hisparse3/PKG-INFO").read().decode()
    top = "vllm-0.33.0+hisparse3/"
    listed = sorted(m.name.removeprefix(top) for m in members)
    repo = tree_imports.REPO_ROOT
    expected = ["PKG-INFO", "README.md", "pyproject.toml"]
    expected += [f"tools/{p.name}" for p in pack.backend_modules()]
    expected += [p.as_posix() for p in check.collect_overlay(repo / "vllm")]
    assert listed == sorted(expected)
    assert {m.uid for m in members} == {0} and {m.mtime for m in members} == {0}
    assert {m.uname for m in members} == {""}
    assert "Version: 0.33.0+hisparse3\n" in pkg_info
    assert "Requires-Python: >=3.11,<3.15\n" in pkg_info
    assert "Dynamic: Requires-Dist\n" in pkg_info


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


def test_editable_install_imports_the_working_tree(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    python = editable_install(tmp_path, project, base)

    module = ".".join(PATCHED.with_suffix("").parts)
    probe = (
        "import vllm, vllm._version as v, importlib.metadata as md\n"
        f"import {module} as m\n"
        "print(m.STOCK, m.__file__, v.__version__, md.version('vllm'))\n"
    )

    def run_probe() -> list[str]:
        # A fresh interpreter each time, as a restarted `vllm serve` is.
        proc = run_limited([str(python), "-c", probe], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.split()

    tree_file = project / PATCHED
    stock, path, version, dist_version = run_probe()
    assert (stock, Path(path)) == ("False", tree_file)
    assert version == dist_version == "0.33.0+hisparse1"

    tree_file.write_text("STOCK = 'edited'\n")
    assert run_probe()[0] == "edited"

    # A module the tree adds later is found too, without reinstalling.
    (tree_file.parent / "added_helper.py").write_text("VALUE = 7\n")
    added = module.rsplit(".", 1)[0] + ".added_helper"
    proc = run_limited([str(python), "-c", f"import {added} as a; print(a.VALUE)"])
    assert proc.stdout.strip() == "7", proc.stderr

    # The installed tree does not hold a stale copy of the replaced file.
    site = site_packages(python)
    assert not (site / PATCHED).exists()
    assert (site / "vllm" / "__init__.py").is_file()


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
