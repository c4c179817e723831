# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 1 (tools/fetch.py): a verified base wheel, or one line saying why not.

On tiny synthetic wheels (synthetic.py), with pip cut off from every index
and config file: download, verification, the cache, the platform's wheel and
what a missing network looks like.
"""

import shutil
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
