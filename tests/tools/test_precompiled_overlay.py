# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the precompiled overlay build tool (the package tools/).

Everything runs on tiny synthetic wheels made with the ``wheel`` CLI, with pip
cut off from every index and config file, so no test touches the network or
needs the real 336 MB base wheel.
"""

import email.parser
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import overlay
import pytest
from packaging.tags import Tag

from tools import buildapi, check, fetch, pack, util
from tools.pins import LOCATION_ENV, Pins, load_pins

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHED = Path("vllm/distributed/device_communicators/flashinfer_all_reduce.py")
STOCK_SOURCE = "STOCK = True\n"
PATCHED_SOURCE = "STOCK = False  # hisparse\n"
REQUIRES_DIST = [
    "numpy",
    'torch==2.13.0; platform_machine == "x86_64"',
]
ENTRY_POINTS = "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n"
# The shape of the vcs-versioning file in upstream's wheel.
VERSION_SOURCE = (
    "__version__ = version = '{0}'\n"
    "__version_tuple__ = version_tuple = (0, 33, 0)\n"
    "__commit_id__ = commit_id = 'g4ba787ec9'\n"
)


def make_wheel(
    where: Path,
    *,
    version: str = "0.33.0",
    wheel_tag: str = "py3-none-any",
    file_tags: str | None = None,
    init_source: str = "",
    files: Mapping[str, str] | None = None,
) -> Path:
    """Pack a tiny vllm wheel; ``file_tags`` renames it like upstream's files.

    Upstream's WHEEL file says ``linux_x86_64`` while its file name says
    ``manylinux_2_28_x86_64``; ``file_tags`` reproduces that mismatch.
    ``files`` maps ``vllm/...`` paths to contents that replace or join the
    stock ones.
    """
    tree = where / f"vllm-{version}"
    dist_info = tree / f"vllm-{version}.dist-info"
    (tree / PATCHED).parent.mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text(init_source)
    (tree / "vllm" / "_version.py").write_text(VERSION_SOURCE.format(version))
    (tree / PATCHED).write_text(STOCK_SOURCE)
    for package in PATCHED.parents[:-2]:  # regular packages, as upstream's
        (tree / package / "__init__.py").write_text("")
    for rel, text in (files or {}).items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    dist_info.mkdir()
    requires = "".join(f"Requires-Dist: {req}\n" for req in REQUIRES_DIST)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n{requires}\n"
        "A tiny stand-in for the upstream wheel.\n"
    )
    (dist_info / "WHEEL").write_text(
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
        f"Tag: {wheel_tag}\n"
    )
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    out = where / "dist"
    out.mkdir()
    _run_wheel_cli("pack", "--dest-dir", str(out), str(tree))
    shutil.rmtree(tree)
    built = out / f"vllm-{version}-{wheel_tag}.whl"
    assert built.is_file()
    if file_tags is not None:
        built = built.rename(out / f"vllm-{version}-{file_tags}.whl")
    return built


def _run_wheel_cli(*args: str) -> None:
    """Run the wheel CLI the way the backend does."""
    subprocess.run([sys.executable, "-m", "wheel", *args], check=True, text=True)


STOCK_PIN = hashlib.sha256(STOCK_SOURCE.encode()).hexdigest()


def pins_for(*wheels: Path, base_version: str = "0.33.0"):
    """Pins that trust exactly the given wheels, replacing the stock PATCHED."""
    return Pins(
        base_version=base_version,
        local_label="hisparse1",
        sha256={w.name: util.sha256_of(w) for w in wheels},
        replaces={PATCHED.as_posix(): STOCK_PIN},
    )


def make_overlay(where: Path, *extra: str) -> Path:
    """An overlay tree like the repo's vllm/, with build litter that is skipped."""
    root = where / "overlay" / "vllm"
    (root / PATCHED.relative_to("vllm")).parent.mkdir(parents=True)
    (root.parent / PATCHED).write_text(PATCHED_SOURCE)
    pycache = root / "__pycache__"
    pycache.mkdir()
    (pycache / "not_upstream.cpython-311.pyc").write_bytes(b"junk")
    (root / "stray.pyc").write_bytes(b"junk")
    for rel in extra:
        (root.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        (root.parent / rel).write_text("# new\n")
    return root


def cached_copy(base: Path, cache: Path) -> Path:
    """Put ``base`` in the wheel cache ``cache``, as an earlier build did."""
    cache.mkdir(exist_ok=True)
    return Path(shutil.copyfile(base, cache / base.name))


def pip_sees_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Let pip fetch from ``folder`` and nowhere else."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))


def corrupt(path: Path) -> None:
    """Flip one byte in the middle, as a bad download or disk would."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def read_member(wheel: Path, member: str) -> str:
    """Text of one file inside a built wheel."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(member).decode()


def test_repo_pins_are_the_upstream_release() -> None:
    pins = load_pins()
    assert pins.version == "0.33.0+hisparse1"
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


def test_corrupt_base_wheel_names_expected_hash(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    pins = pins_for(base)
    corrupt(base)
    with pytest.raises(util.OverlayError) as excinfo:
        pack.build(
            out_dir, pins=pins, overlay_root=make_overlay(tmp_path), location=str(base)
        )
    message = str(excinfo.value)
    assert pins.sha256[base.name] in message
    assert str(base) in message
    assert LOCATION_ENV in message and "intact copy" in message
    assert list(out_dir.iterdir()) == []


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


def test_unpinned_file_name_is_refused(tmp_path: Path) -> None:
    pinned = make_wheel(tmp_path / "a")
    other = make_wheel(tmp_path / "b", wheel_tag="py3-none-linux_x86_64")
    with pytest.raises(util.OverlayError, match="no sha256 is pinned") as excinfo:
        fetch.fetch_base_wheel(pins_for(pinned), location=str(other))
    assert pinned.name in str(excinfo.value)


def test_a_link_is_judged_by_its_own_name(tmp_path: Path) -> None:
    pinned = make_wheel(tmp_path)
    link = tmp_path / "vllm-0.32.0-py3-none-any.whl"
    link.symlink_to(pinned)
    with pytest.raises(util.OverlayError, match=r"vllm==0\.33\.0"):
        fetch.fetch_base_wheel(pins_for(pinned), location=str(link))


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
    folder = overlay.extract_base_files([PATCHED.as_posix()], tmp_path / "stock", base)
    assert (folder / PATCHED).read_text() == STOCK_SOURCE
    assert [p.name for p in (folder / PATCHED).parent.iterdir()] == [PATCHED.name]
    with pytest.raises(util.OverlayError, match=r"vllm/brand_new\.py"):
        overlay.extract_base_files(["vllm/brand_new.py"], tmp_path / "x", base)


def test_empty_overlay_is_refused(tmp_path: Path) -> None:
    (tmp_path / "vllm" / "__pycache__").mkdir(parents=True)
    with pytest.raises(util.OverlayError, match="nothing to overlay"):
        check.collect_overlay(tmp_path / "vllm")


def test_no_network_from_index(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(util.OverlayError) as excinfo:
        pack.build(
            out_dir,
            pins=pins_for(base),
            overlay_root=make_overlay(tmp_path),
            cache_dir=cache,
        )
    message = str(excinfo.value)
    assert "could not fetch the base wheel vllm==0.33.0" in message
    assert "proxy" in message and LOCATION_ENV in message
    assert base.name in message
    assert list(cache.iterdir()) == []  # no half file, no temp dir
    assert list(out_dir.iterdir()) == []


def test_no_network_from_url(tmp_path: Path, closed_port: int) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    url = f"http://127.0.0.1:{closed_port}/files/{base.name}"
    with pytest.raises(util.OverlayError, match="could not fetch") as excinfo:
        fetch.fetch_base_wheel(pins_for(base), location=url, cache_dir=cache)
    assert url in str(excinfo.value)
    assert list(cache.iterdir()) == []


def test_pip_failure_gist_keeps_the_network_cause() -> None:
    output = (
        "Looking in indexes: http://127.0.0.1:9/simple\n"
        "WARNING: Location 'file:///x/simple/vllm/' is ignored\n"
        "WARNING: Retrying (Retry(total=0, connect=None)) after connection broken "
        "by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection "
        "object at 0x7fc6432c6550>: Failed to establish a new connection: "
        "[Errno 111] Connection refused')': /simple/vllm/\n"
        "ERROR: No matching distribution found for vllm==0.33.0\n"
    )
    gist = fetch._pip_gist(output)
    assert len(gist) == 2
    assert gist[0] == (
        "WARNING: Retrying after connection broken by 'NewConnectionError("
        "'Failed to establish a new connection: [Errno 111] Connection refused')'"
        ": /simple/vllm/"
    )
    assert gist[1] == "ERROR: No matching distribution found for vllm==0.33.0"


def test_download_is_verified_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    pip_sees_only(monkeypatch, base.parent)
    got = fetch.fetch_base_wheel(pins_for(base))
    assert got == fetch.default_cache_dir() / base.name
    assert got.parent == tmp_path / "vllm-cache" / "precompiled-wheels"
    assert got.read_bytes() == base.read_bytes()
    assert [p.name for p in got.parent.iterdir()] == [base.name]


def test_tampered_download_is_not_cached(tmp_path: Path) -> None:
    # A well-formed wheel with the pinned name but other bytes, as a bad
    # mirror would serve: pip accepts it, the pin must not.
    pins = pins_for(make_wheel(tmp_path / "upstream"))
    impostor = make_wheel(tmp_path / "mirror", init_source="evil = True\n")
    cache = tmp_path / "cache"
    with pytest.raises(util.OverlayError, match="nothing was cached") as excinfo:
        fetch.fetch_base_wheel(pins, location=impostor.as_uri(), cache_dir=cache)
    assert pins.sha256[impostor.name] in str(excinfo.value)
    assert list(cache.iterdir()) == []


def test_cache_hit_does_not_fetch(tmp_path: Path, no_download: None) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    cached = cached_copy(base, cache)
    assert fetch.fetch_base_wheel(pins_for(base), cache_dir=cache) == cached
    url = f"http://127.0.0.1:1/{base.name}"
    assert (
        fetch.fetch_base_wheel(pins_for(base), location=url, cache_dir=cache) == cached
    )


def test_corrupt_cached_file_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    base = make_wheel(tmp_path)
    pins = pins_for(base)
    cache = tmp_path / "cache"
    cached = cached_copy(base, cache)
    corrupt(cached)

    # Offline: the bad copy is gone even though no good one could be fetched.
    with pytest.raises(util.OverlayError, match="could not fetch"):
        fetch.fetch_base_wheel(pins, cache_dir=cache)
    assert list(cache.iterdir()) == []
    err = capsys.readouterr().err
    assert f"cached base wheel {cached} is corrupt" in err
    assert "fetching it again" in err

    shutil.copyfile(base, cached)
    corrupt(cached)
    pip_sees_only(monkeypatch, base.parent)
    assert fetch.fetch_base_wheel(pins, cache_dir=cache) == cached
    assert util.sha256_of(cached) == pins.sha256[base.name]
    assert [p.name for p in cache.iterdir()] == [base.name]
    err = capsys.readouterr().err
    assert f"cached base wheel {cached} is corrupt" in err
    assert "fetching it again" in err


def test_no_pinned_wheel_for_this_platform(tmp_path: Path) -> None:
    pins = Pins(
        base_version="0.33.0",
        local_label="hisparse1",
        sha256={"vllm-0.33.0-cp38-abi3-manylinux_2_28_s390x.whl": "0" * 64},
    )
    supported = Tag("cp311", "cp311", "manylinux_2_36_x86_64")
    with pytest.raises(util.OverlayError, match="fits this platform") as excinfo:
        fetch.fetch_base_wheel(pins, cache_dir=tmp_path, supported_tags=[supported])
    assert "s390x" in str(excinfo.value) and LOCATION_ENV in str(excinfo.value)


def test_platform_choice_follows_tag_priority() -> None:
    pins = Pins(
        base_version="0.33.0",
        local_label="hisparse1",
        sha256={
            "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl": "0" * 64,
            "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl": "1" * 64,
            "vllm-0.33.0-py3-none-any.whl": "2" * 64,
        },
    )
    arm = Tag("cp38", "abi3", "manylinux_2_28_aarch64")
    pure = Tag("py3", "none", "any")
    assert fetch.select_wheel_for_platform(pins, [arm, pure]).endswith("_aarch64.whl")
    assert fetch.select_wheel_for_platform(pins, [pure, arm]).endswith("-any.whl")


def test_hook_error_is_a_short_message(capsys: pytest.CaptureFixture) -> None:
    def broken() -> str:
        raise util.OverlayError("base wheel is bad.\nFix: do the thing")

    with pytest.raises(SystemExit) as excinfo:
        buildapi._run(broken)
    assert excinfo.value.code == 1
    assert capsys.readouterr().err == "error: base wheel is bad.\nFix: do the thing\n"


def copy_tools(project: Path) -> None:
    """Give a scratch project its own copy of the build tool, as a clone has."""
    shutil.copytree(
        REPO_ROOT / "tools",
        project / "tools",
        ignore=shutil.ignore_patterns("__pycache__"),
    )


def _scratch_project(
    tmp_path: Path, base: Path, adds: Mapping[str, str] | None = None
) -> Path:
    """A repo copy whose pins trust ``base``, to drive the backend through pip.

    ``adds`` maps the paths of added modules to their contents.
    """
    project = tmp_path / "project"
    copy_tools(project)
    shutil.copytree(make_overlay(tmp_path), project / "vllm")
    for rel, text in (adds or {}).items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    (project / "pyproject.toml").write_text(
        "[build-system]\n"
        "requires = ['wheel>=0.48.0', 'packaging>=24.0']\n"
        "build-backend = 'tools.buildapi'\n"
        "backend-path = ['.']\n\n"
        "[tool.vllm-overlay]\n"
        "base-version = '0.33.0'\n"
        "local-label = 'hisparse1'\n"
        f"adds = {sorted(adds or {})!r}\n\n"
        "[tool.vllm-overlay.sha256]\n"
        f"'{base.name}' = '{util.sha256_of(base)}'\n\n"
        "[tool.vllm-overlay.replaces]\n"
        f"'{PATCHED.as_posix()}' = '{STOCK_PIN}'\n"
    )
    return project


def _pip_wheel(project: Path, out: Path, base: Path) -> subprocess.CompletedProcess:
    """``pip wheel .`` without build isolation, so no index is needed."""
    env = {**os.environ, LOCATION_ENV: str(base)}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    return subprocess.run(
        [*cmd, "-w", str(out), str(project)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def test_pip_builds_the_overlay(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    proc = _pip_wheel(_scratch_project(tmp_path, base), out_dir, base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in out_dir.iterdir()] == [
        "vllm-0.33.0+hisparse1-py3-none-any.whl"
    ]


def test_pip_shows_the_error_without_traceback(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    project = _scratch_project(tmp_path, base)
    corrupt(base)
    proc = _pip_wheel(project, out_dir, base)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "does not match its pin" in output
    assert util.sha256_of(base) in output  # the actual hash, next to the expected
    assert "Traceback" not in output
    assert list(out_dir.iterdir()) == []
