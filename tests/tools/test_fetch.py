# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 1 (tools/fetch.py): a checked base wheel, or one line saying why not.

On tiny synthetic wheels (synthetic.py), with pip cut off from every index
and config file: a local copy, the cache, pip's hash-checking download, and
what a missing network looks like.
"""

import os
from pathlib import Path

import pytest
from packaging.tags import Tag
from synthetic import (
    cached_copy,
    corrupt,
    make_overlay,
    make_wheel,
    pins_for,
    pip_sees_only,
)

from tools import fetch, pack, util
from tools.pins import LOCATION_ENV, Pins


def test_a_corrupt_local_copy_names_both_hashes(tmp_path: Path, out_dir: Path) -> None:
    base = make_wheel(tmp_path)
    pins = pins_for(base)
    corrupt(base)
    with pytest.raises(util.OverlayError) as excinfo:
        pack.build(
            out_dir, pins=pins, overlay_root=make_overlay(tmp_path), location=str(base)
        )
    message = str(excinfo.value)
    assert pins.sha256[base.name] in message and util.sha256_of(base) in message
    assert str(base) in message and f"Fix: point {LOCATION_ENV}" in message
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("kind", ["other name", "link", "url", "missing"])
def test_a_location_that_is_not_a_pinned_copy_is_one_line(
    tmp_path: Path, kind: str, no_download: None
) -> None:
    pinned = make_wheel(tmp_path / "a")
    location = {
        "other name": make_wheel(tmp_path / "b", wheel_tag="py3-none-linux_x86_64"),
        "link": tmp_path / "vllm-0.32.0-py3-none-any.whl",
        "url": f"http://127.0.0.1:1/{pinned.name}",
        "missing": tmp_path / "gone" / pinned.name,
    }[kind]
    if kind == "link":
        location.symlink_to(pinned)  # type: ignore[union-attr]
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins_for(pinned), location=str(location))
    assert str(excinfo.value) == (
        f"{LOCATION_ENV}={location} is not a local copy of a pinned wheel.\n"
        f"Fix: point it at a copy of one of: {pinned.name}"
    )


def test_a_download_is_checked_by_pip_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    pip_sees_only(monkeypatch, base.parent)
    got = fetch.fetch_base_wheel(pins_for(base))
    assert got == tmp_path / "vllm-cache" / "precompiled-wheels" / base.name
    assert got.read_bytes() == base.read_bytes()
    assert [p.name for p in got.parent.iterdir()] == [base.name]


def test_the_download_moves_into_the_cache_by_one_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip writes inside the cache folder, so the whole wheel arrives under
    its name by one rename on the same file system, never copied in part."""
    base = make_wheel(tmp_path)
    pip_sees_only(monkeypatch, base.parent)
    cache = tmp_path / "cache"
    renames = []
    for name in ("rename", "replace"):
        real = getattr(os, name)

        def spy(src, dst, *args, real=real, **kwargs):
            renames.append((Path(src), Path(dst)))
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    got = fetch.fetch_base_wheel(pins_for(base), cache_dir=cache)
    assert got == cache / base.name and got.read_bytes() == base.read_bytes()
    [source] = [src for src, dst in renames if dst == got]
    assert source.parent.parent == cache, f"moved in from {source}"
    assert [p.name for p in cache.iterdir()] == [base.name]


def test_pip_refuses_a_download_that_matches_no_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """A well-formed wheel with the pinned name but other bytes, as a bad
    mirror would serve: pip's hash-checking mode refuses it, in its words."""
    pins = pins_for(make_wheel(tmp_path / "upstream"))
    impostor = make_wheel(tmp_path / "mirror", init_source="evil = True\n")
    pip_sees_only(monkeypatch, impostor.parent)
    cache = tmp_path / "cache"
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins, cache_dir=cache)
    assert str(excinfo.value).splitlines() == [
        "could not fetch vllm==0.33.0 (pip's output is above).",
        (
            "Fix: check pip's index and proxy settings (pip.conf, PIP_INDEX_URL, "
            f"HTTPS_PROXY), or set {LOCATION_ENV} to a local copy of {impostor.name}"
        ),
    ]
    err = capfd.readouterr().err
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in err
    assert pins.sha256[impostor.name] in err and util.sha256_of(impostor) in err
    assert list(cache.iterdir()) == []


def test_no_network_is_pips_error_and_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(util.OverlayError, match="could not fetch vllm==0.33.0"):
        fetch.fetch_base_wheel(pins_for(base), cache_dir=cache)
    # PIP_RETRIES=0 (offline_pip): pip's own words for a refused connection.
    assert "No matching distribution found for vllm==0.33.0" in capfd.readouterr().err
    assert list(cache.iterdir()) == []


def test_a_cache_hit_does_not_fetch(tmp_path: Path, no_download: None) -> None:
    base = make_wheel(tmp_path)
    cached = cached_copy(base, tmp_path / "cache")
    assert fetch.fetch_base_wheel(pins_for(base), cache_dir=cached.parent) == cached


def test_a_corrupt_cached_copy_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    base = make_wheel(tmp_path)
    cached = cached_copy(base, tmp_path / "cache")
    corrupt(cached)
    pip_sees_only(monkeypatch, base.parent)
    assert fetch.fetch_base_wheel(pins_for(base), cache_dir=cached.parent) == cached
    assert cached.read_bytes() == base.read_bytes()
    assert f"{cached} does not match its pin" in capsys.readouterr().err


def test_no_pinned_wheel_for_this_platform(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    pins = Pins("0.33.0", "x1", {"vllm-0.33.0-cp38-abi3-manylinux_2_28_s390x.whl": ""})
    supported = [Tag("cp311", "cp311", "manylinux_2_36_x86_64")]
    with pytest.raises(util.OverlayError, match="fits this platform") as excinfo:
        fetch.fetch_base_wheel(pins, cache_dir=tmp_path, supported_tags=supported)
    assert "s390x" in str(excinfo.value)
    assert fetch.wheel_for_platform(
        pins_for(base), supported + [Tag("py3", "none", "any")]
    )


def test_a_cache_root_that_is_a_file(
    tmp_path: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    not_a_folder = tmp_path / "cache-root"
    not_a_folder.write_text("oops")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(not_a_folder))
    with pytest.raises(util.OverlayError, match="set VLLM_CACHE_ROOT") as excinfo:
        pack.build(out_dir, pins=pins_for(base), overlay_root=make_overlay(tmp_path))
    assert str(not_a_folder) in str(excinfo.value)
    assert not_a_folder.read_text() == "oops"
    assert list(out_dir.iterdir()) == []
