# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The build from end to end: stages, PEP 517 hooks, pins and checks.

On tiny synthetic wheels (synthetic.py), with pip cut off from every index
and config file, so no test touches the network.
"""

import email.parser
import zipfile
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    ENTRY_POINTS,
    PATCHED,
    PATCHED_SOURCE,
    REQUIRES_DIST,
    STOCK_SOURCE,
    corrupt,
    make_overlay,
    make_wheel,
    pins_for,
    pip_wheel,
    read_member,
    scratch_project,
)

from tools import buildapi, check, pack, util
from tools.pins import Pins, load_pins


def test_repo_pins_are_the_upstream_release() -> None:
    pins = load_pins()
    assert pins.version == "0.33.0+hisparse3"
    assert pins.sha256 == {
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
            "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
        ),
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl": (
            "e9e404f52c8494b69bd83fe99fe7ecfa9f6b89fbd156d2a9639c24ea41d6d606"
        ),
    }


def test_good_build_overlays_and_relabels(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(
        tmp_path,
        wheel_tag="cp38-abi3-linux_x86_64",
        file_tags="cp38-abi3-manylinux_2_28_x86_64",
    )
    name = pack.build(
        out_dir,
        pins=pins_for(base),
        overlay_root=make_overlay(tmp_path),
        location=str(base),
    )

    # The base file name's platform tag survives, not the WHEEL file's.
    assert name == "vllm-0.33.0+hisparse1-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert sorted(p.name for p in out_dir.iterdir()) == [name]
    built = out_dir / name
    dist_info = "vllm-0.33.0+hisparse1.dist-info"
    metadata = email.parser.Parser().parsestr(
        read_member(built, f"{dist_info}/METADATA")
    )
    assert metadata["Version"] == "0.33.0+hisparse1"
    assert metadata.get_all("Requires-Dist") == REQUIRES_DIST
    assert read_member(built, f"{dist_info}/entry_points.txt") == ENTRY_POINTS
    assert "Tag: cp38-abi3-manylinux_2_28_x86_64" in read_member(
        built, f"{dist_info}/WHEEL"
    )
    assert read_member(built, PATCHED.as_posix()) == PATCHED_SOURCE
    with zipfile.ZipFile(built) as zf:
        names = zf.namelist()
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if n.startswith("vllm-0.33.0.dist-info/")]
    # The RECORD that wheel wrote must vouch for the replaced file.
    record = read_member(built, f"{dist_info}/RECORD")
    patched_row = next(r for r in record.splitlines() if r.startswith(str(PATCHED)))
    assert patched_row.endswith(f",{len(PATCHED_SOURCE)}")


def test_wrong_base_version_is_refused(tmp_path: Path, out_dir: Path) -> None:
    old = make_wheel(tmp_path, version="0.32.0")
    pins = Pins(
        base_version="0.33.0",
        local_label="hisparse1",
        sha256={"vllm-0.33.0-py3-none-any.whl": "0" * 64},
    )
    with pytest.raises(util.OverlayError, match=r"0\.32\.0.*vllm==0\.33\.0"):
        pack.build(
            out_dir, pins=pins, overlay_root=make_overlay(tmp_path), location=str(old)
        )
    assert list(out_dir.iterdir()) == []


def test_pins_must_match_base_version(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[tool.vllm-overlay]\nbase-version = '0.33.0'\nlocal-label = 'x1'\n"
        f"[tool.vllm-overlay.sha256]\n'vllm-0.32.0-py3-none-any.whl' = '{'a' * 64}'\n"
    )
    with pytest.raises(util.OverlayError, match=r"is not a vllm==0\.33\.0 wheel"):
        load_pins(pyproject)


def test_overlay_file_missing_from_base(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    overlay = make_overlay(tmp_path, "vllm/brand_new.py", "vllm/distributed/x.py")
    with pytest.raises(util.OverlayError, match="drop-in") as excinfo:
        pack.build(
            out_dir, pins=pins_for(base), overlay_root=overlay, location=str(base)
        )
    message = str(excinfo.value)
    assert "vllm/brand_new.py" in message and "vllm/distributed/x.py" in message
    assert str(PATCHED) not in message
    assert list(out_dir.iterdir()) == []


def test_extract_base_files_gives_stock_sources(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    folder = tree_imports.extract_base_files(
        [PATCHED.as_posix()], tmp_path / "stock", base
    )
    assert (folder / PATCHED).read_text() == STOCK_SOURCE
    assert [p.name for p in (folder / PATCHED).parent.iterdir()] == [PATCHED.name]
    with pytest.raises(util.OverlayError, match=r"vllm/brand_new\.py"):
        tree_imports.extract_base_files(["vllm/brand_new.py"], tmp_path / "x", base)


def test_empty_overlay_is_refused(tmp_path: Path) -> None:
    (tmp_path / "vllm" / "__pycache__").mkdir(parents=True)
    with pytest.raises(util.OverlayError, match="nothing to overlay"):
        check.collect_overlay(tmp_path / "vllm")


def test_hook_error_is_a_short_message(capsys: pytest.CaptureFixture) -> None:
    def broken() -> str:
        raise util.OverlayError("base wheel is bad.\nFix: do the thing")

    with pytest.raises(SystemExit) as excinfo:
        buildapi._run(broken)
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
