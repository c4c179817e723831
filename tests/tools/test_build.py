# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The build from end to end: the PEP 517 hooks and the stages.

On tiny synthetic wheels (synthetic.py), with pip cut off from every index
and config file, so no test touches the network.
"""

import ast
import email.parser
import os
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from synthetic import (
    ENTRY_POINTS,
    PATCHED,
    PATCHED_SOURCE,
    REQUIRES_DIST,
    call_hook,
    corrupt,
    fresh_dir,
    make_overlay,
    make_wheel,
    metadata_of,
    pins_for,
    pip_wheel,
    read_member,
    run_limited,
    scratch_project,
    scratch_venv,
)
from wheel.wheelfile import WheelFile

from tools import buildapi, pack, util
from tools.pins import LOCATION_ENV, load_pins

BASE_REQUIRES = ["numpy", "flashinfer-python==0.7.3"]


def upstream_like(tmp_path: Path, **kwargs: object) -> Path:
    """A synthetic base whose WHEEL and file name disagree, as upstream's do."""
    return make_wheel(
        tmp_path,
        wheel_tag="cp38-abi3-linux_x86_64",
        file_tags="cp38-abi3-manylinux_2_28_x86_64",
        **kwargs,  # type: ignore[arg-type]
    )


def test_repo_pins_are_the_upstream_release() -> None:
    pins = load_pins()
    assert pins.version == "0.34.0+hisparse9"
    assert pins.sha256 == {
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
            "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
        ),
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_aarch64.whl": (
            "7d96231fc141ad4b3a441292b77362b285b335ca7d1b0e2ab441d4ebde82f405"
        ),
    }


def test_good_build_overlays_and_relabels(tmp_path: Path, out_dir: Path) -> None:
    base = upstream_like(tmp_path)
    written: list[str] = []
    real_open = zipfile.ZipFile.open

    def recording_open(self, name, mode="r", *args, **kwargs):
        if mode == "w":
            written.append(getattr(name, "filename", name))
        return real_open(self, name, mode, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zipfile.ZipFile, "open", recording_open)
        name = pack.build(
            out_dir,
            pins=pins_for(base),
            overlay_root=make_overlay(tmp_path),
            location=str(base),
        )
    # The base file name's platform tag survives, not the WHEEL file's.
    assert name == "vllm-0.33.0+hisparse1-cp38-abi3-manylinux_2_28_x86_64.whl"
    built = out_dir / name
    with zipfile.ZipFile(built) as zf:
        names = zf.namelist()
    assert written == names  # each member compressed once
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if n.startswith("vllm-0.33.0.dist-info/")]
    dist_info = "vllm-0.33.0+hisparse1.dist-info"
    metadata = email.parser.Parser().parsestr(
        read_member(built, f"{dist_info}/METADATA")
    )
    assert metadata["Version"] == "0.33.0+hisparse1"
    assert metadata.get_all("Requires-Dist") == REQUIRES_DIST
    assert read_member(built, f"{dist_info}/entry_points.txt") == ENTRY_POINTS
    wheel_info = read_member(built, f"{dist_info}/WHEEL")
    assert "Tag: cp38-abi3-manylinux_2_28_x86_64" in wheel_info
    assert "linux_x86_64" not in wheel_info.replace("manylinux_2_28_x86_64", "")
    assert read_member(built, PATCHED.as_posix()) == PATCHED_SOURCE
    values = {}
    for node in ast.parse(read_member(built, "vllm/_version.py")).body:
        if isinstance(node, ast.Assign):
            values[ast.unparse(node.targets[0])] = ast.literal_eval(node.value)
    assert values["__version__"] == "0.33.0+hisparse1"
    assert values["__version_tuple__"] == (0, 33, 0, "hisparse1")
    # RECORD vouches for every member, as pip and wheel read it.
    with WheelFile(built) as wf:
        for member in wf.namelist():
            wf.read(member)  # raises on a hash that does not match
        record = wf.read(f"{dist_info}/RECORD").decode().splitlines()
    assert len(record) == len(names) and record[-1] == f"{dist_info}/RECORD,,"
    patched_row = next(r for r in record if r.startswith(str(PATCHED)))
    assert patched_row.endswith(f",{len(PATCHED_SOURCE)}")


def test_an_interrupted_build_leaves_nothing_under_the_wheels_name(
    tmp_path: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip or a user stopping the build while it packs, or a kill: the
    wheel's name appears only once the wheel is whole."""
    base = upstream_like(tmp_path)
    final = out_dir / "vllm-0.33.0+hisparse1-cp38-abi3-manylinux_2_28_x86_64.whl"
    written: list[str] = []
    real_open = zipfile.ZipFile.open

    def interrupted_open(self, name, mode="r", *args, **kwargs):
        if mode == "w":
            assert not final.exists(), "a kill now would leave a partial wheel"
            written.append(getattr(name, "filename", name))
            if len(written) == 3:
                raise KeyboardInterrupt
        return real_open(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", interrupted_open)
    with pytest.raises(KeyboardInterrupt):
        pack.build(
            out_dir,
            pins=pins_for(base),
            overlay_root=make_overlay(tmp_path),
            location=str(base),
        )
    assert len(written) == 3
    assert list(out_dir.iterdir()) == []


def test_unchanged_members_are_copied_in_chunks(tmp_path: Path, out_dir: Path) -> None:
    """The real base wheel holds a 308 MB .so: no member is read whole."""
    size = 32 << 20
    big = "vllm/_C.abi3.so"
    base = make_wheel(tmp_path, files={big: "x" * size})
    tracemalloc.start()
    try:
        name = pack.build(
            out_dir,
            pins=pins_for(base),
            overlay_root=make_overlay(tmp_path),
            location=str(base),
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size // 4, f"the build held {peak} bytes at once"
    with zipfile.ZipFile(out_dir / name) as zf:
        assert zf.getinfo(big).file_size == size


def test_two_builds_of_one_tree_are_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    overlay_root = make_overlay(tmp_path)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    digests = []
    for mtime, umask in [(1_600_000_000, 0o022), (1_700_000_000, 0o077)]:
        # A fresh checkout: other file times, another umask.
        os.utime(overlay_root.parent / PATCHED, (mtime, mtime))
        out = fresh_dir(tmp_path)
        old_umask = os.umask(umask)
        try:
            name = pack.build(
                out, pins=pins_for(base), overlay_root=overlay_root, location=str(base)
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

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # 2023-11-14 22:13:20
    out = fresh_dir(tmp_path)
    name = pack.build(
        out, pins=pins_for(base), overlay_root=overlay_root, location=str(base)
    )
    with zipfile.ZipFile(out / name) as zf:
        assert {i.date_time for i in zf.infolist()} == {(2023, 11, 14, 22, 13, 20)}


def test_overlay_file_missing_from_base(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    overlay = make_overlay(tmp_path, "vllm/brand_new.py", "vllm/distributed/x.py")
    with pytest.raises(util.OverlayError, match="not declared") as excinfo:
        pack.build(
            out_dir, pins=pins_for(base), overlay_root=overlay, location=str(base)
        )
    message = str(excinfo.value)
    assert "vllm/brand_new.py" in message and "vllm/distributed/x.py" in message
    assert str(PATCHED) not in message
    assert list(out_dir.iterdir()) == []


def test_hook_error_is_a_short_message(capsys: pytest.CaptureFixture) -> None:
    @buildapi._hook
    def broken() -> str:
        raise util.OverlayError("base wheel is bad.\nFix: do the thing")

    with pytest.raises(SystemExit) as excinfo:
        broken()
    assert excinfo.value.code == 1
    assert capsys.readouterr().err == "error: base wheel is bad.\nFix: do the thing\n"


def test_pip_builds_the_overlay(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    proc = pip_wheel(scratch_project(tmp_path, base), out_dir, base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in out_dir.iterdir()] == [
        "vllm-0.33.0+hisparse1-py3-none-any.whl"
    ]


def test_pip_shows_the_error_without_traceback(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    corrupt(base)
    proc = pip_wheel(project, out_dir, base)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "does not match its pin" in output
    assert util.sha256_of(base) in output  # the actual hash, next to the expected
    assert "Traceback" not in output
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("settings", [None, {"flashinfer-python": "0.7.3"}])
def test_metadata_hook_needs_no_base_wheel(
    tmp_path: Path, settings: dict | None
) -> None:
    """pip reads the METADATA from the tree; the wheel then says the same,
    with or without a -C, which changes nothing."""
    base = upstream_like(tmp_path, requires_dist=BASE_REQUIRES)
    project = scratch_project(tmp_path, base, ["flashinfer-python==0.7.4"])
    prepared = fresh_dir(tmp_path)
    # No index, no cache and no VLLM_PRECOMPILED_WHEEL_LOCATION: nothing to fetch.
    proc = call_hook(project, "prepare_metadata_for_build_wheel", prepared, settings)
    assert proc.returncode == 0, proc.stderr
    dist_info = proc.stdout.splitlines()[-1]
    assert dist_info == "vllm-0.33.0+hisparse1.dist-info"
    assert "fetching" not in proc.stderr
    out = fresh_dir(tmp_path)
    env = {LOCATION_ENV: str(base)}
    proc = call_hook(project, "build_wheel", out, settings, env)
    assert proc.returncode == 0, proc.stderr
    wheel = out / proc.stdout.splitlines()[-1]
    metadata = read_member(wheel, f"{dist_info}/METADATA")
    assert (prepared / dist_info / "METADATA").read_text() == metadata
    assert "Requires-Dist: flashinfer-python==0.7.4\n" in metadata


def test_pip_dry_run_downloads_nothing_of_vllm(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    python = scratch_venv(tmp_path)
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install"]
    cmd += ["--dry-run", "--no-deps", "--no-build-isolation", str(project)]
    proc = run_limited(cmd)  # offline: there is no base wheel to be had
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install vllm-0.33.0+hisparse1" in proc.stdout
    assert not (tmp_path / "vllm-cache").exists()


def test_pip_refuses_a_python_outside_the_base_range_before_a_build(
    tmp_path: Path,
) -> None:
    """The base wheel's Requires-Python is in the METADATA pip is given."""
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    metadata = project / "tools" / "base_wheel_METADATA"
    below = f"{sys.version_info.major}.{sys.version_info.minor}"
    text = metadata.read_text().replace("\n", f"\nRequires-Python: <{below}\n", 1)
    metadata.write_text(text)
    python = scratch_venv(tmp_path)
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install"]
    proc = run_limited([*cmd, "-v", "--no-deps", "--no-build-isolation", str(project)])
    assert proc.returncode == 1
    assert "requires a different Python" in proc.stdout + proc.stderr
    assert "fetching" not in proc.stdout + proc.stderr  # build_wheel never ran


def test_any_setting_is_ignored(tmp_path: Path) -> None:
    """pip passes -C to every build it runs; this build takes none."""
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    settings = {"flashinfer-python": "0.7.3", "editable_mode": "compat"}
    env = {LOCATION_ENV: str(base)}
    digests = set()
    for hook_settings in (None, settings):
        out = fresh_dir(tmp_path)
        proc = call_hook(project, "build_wheel", out, hook_settings, env)
        assert proc.returncode == 0, proc.stderr
        digests.add(util.sha256_of(out / proc.stdout.splitlines()[-1]))
    assert len(digests) == 1, "a -C changed the wheel"


def test_base_metadata_is_checked_against_the_base_wheel(
    tmp_path: Path, out_dir: Path
) -> None:
    base = make_wheel(tmp_path)
    project = scratch_project(tmp_path, base)
    (project / "tools/base_wheel_METADATA").write_bytes(
        metadata_of(base).replace(b"numpy", b"numpyy")
    )
    proc = pip_wheel(project, out_dir, base)
    assert proc.returncode != 0
    assert f"{base.name}'s METADATA is not tools/base_wheel_METADATA" in proc.stderr
    assert list(out_dir.iterdir()) == []
