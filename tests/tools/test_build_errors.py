# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build errors name their cause and leave nothing half-done.

Synthetic wheels only; pip reaches nothing but a closed loopback port (the
offline_pip fixture, tests/tools/conftest.py).
"""

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tree_imports
from synthetic import (
    cached_copy,
    make_overlay,
    make_wheel,
    pins_for,
    pip_sees_only,
)

from tools import fetch, pack, util
from tools.pins import LOCATION_ENV, Pins, check_python, supported_python

TIMEOUT = 120
REPO_RANGE = ">=3.11,<3.15"


def test_wrong_pin_keeps_the_good_cached_wheel(
    tmp_path: Path, no_download: None
) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    cached = cached_copy(base, cache)
    good = util.sha256_of(base)
    wrong = "0" * 64  # a pin edited by hand
    pins = Pins("0.33.0", "hisparse1", {base.name: wrong})
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins, cache_dir=cache)
    message = str(excinfo.value)
    assert cached.read_bytes() == base.read_bytes()  # kept
    assert good in message and wrong in message
    assert "pyproject.toml" in message and "[tool.vllm-overlay.sha256]" in message
    assert "was kept" in message


def test_download_that_misses_its_pin_names_both_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    pip_sees_only(monkeypatch, base.parent)
    cache = tmp_path / "cache"
    pins = Pins("0.33.0", "hisparse1", {base.name: "1" * 64})
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins, cache_dir=cache)
    message = str(excinfo.value)
    assert util.sha256_of(base) in message and "1" * 64 in message
    assert "pin in pyproject.toml" in message and "nothing was cached" in message
    assert ".download-" not in message  # no temporary path that is gone
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("version", [(3, 10, 13), (3, 15, 0)])
def test_python_outside_the_range_is_refused(version: tuple) -> None:
    with pytest.raises(util.OverlayError) as excinfo:
        check_python(REPO_RANGE, version)
    message = str(excinfo.value)
    assert REPO_RANGE in message and ".".join(map(str, version)) in message
    assert "requires-python" in message and "pyproject.toml" in message
    check_python(REPO_RANGE, (3, 12, 1))


def test_repo_pins_the_base_wheels_python_range() -> None:
    assert supported_python() == REPO_RANGE


def _hook_without_tomllib(python: str, pythonpath: str = "") -> subprocess.Popen:
    """The first hook pip calls, in a Python without tomllib."""
    code = (
        "import sys; sys.modules['tomllib'] = None; "
        f"sys.path.insert(0, {str(tree_imports.REPO_ROOT)!r}); "
        "from tools import buildapi as b; b.get_requires_for_build_wheel()"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        check=False,
    )


def test_python_without_tomllib_gets_a_message_not_a_traceback() -> None:
    proc = _hook_without_tomllib(sys.executable)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"needs Python {REPO_RANGE}" in proc.stderr


def _python310() -> str | None:
    """A Python 3.10 on this machine (pyenv's, say), if there is one."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which("python3.10")]
    candidates += sorted(glob.glob(f"{pyenv}/versions/3.10*/bin/python3.10"))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        if probe.stdout.strip() == "(3, 10)":
            return candidate
    return None


@pytest.mark.skipif(_python310() is None, reason="no Python 3.10 here")
def test_real_python310_gets_the_message(tmp_path: Path) -> None:
    # packaging and wheel are pure Python: lend this interpreter's copies, as
    # pip's build environment would install them.
    import packaging
    import wheel

    lent = tmp_path / "lent"
    lent.mkdir()
    for package in (packaging, wheel):
        (lent / package.__name__).symlink_to(Path(package.__file__).parent)
    proc = _hook_without_tomllib(_python310() or "", str(lent))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"needs Python {REPO_RANGE}" in proc.stderr and "3.10." in proc.stderr


def test_refused_connection_reaches_the_user(tmp_path: Path) -> None:
    base = make_wheel(tmp_path)
    # PIP_RETRIES=0 (offline_pip): pip's console only says "from versions: none".
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins_for(base), cache_dir=tmp_path / "cache")
    message = str(excinfo.value)
    assert "Connection refused" in message
    assert "No matching distribution" in message


def test_pips_new_error_blocks_are_kept() -> None:
    output = (
        "Collecting vllm==0.33.0\n"
        "error: connection-failed\n"
        "\n"
        "× Failed to connect to 127.0.0.1 while fetching "
        "http://127.0.0.1:9/x/vllm-0.33.0-py3-none-any.whl\n"
        "╰─> [Errno 111] Connection refused\n"
        "\n"
        "hint: Are you connected to the Internet?\n"
    )
    gist = fetch._pip_gist(output)
    assert gist[0] == "error: connection-failed"
    assert "╰─> [Errno 111] Connection refused" in gist
    assert gist[-1] == "hint: Are you connected to the Internet?"


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/", "http://127.0.0.1:1"])
def test_bare_url_location_is_checked_before_download(
    tmp_path: Path, url: str, no_download: None
) -> None:
    base = make_wheel(tmp_path)
    with pytest.raises(util.OverlayError) as excinfo:
        fetch.fetch_base_wheel(pins_for(base), location=url, cache_dir=tmp_path / "c")
    message = str(excinfo.value)
    assert url in message
    assert message.splitlines()[-1].endswith(base.name)  # the Fix line is whole


def test_ignored_url_location_is_said(
    tmp_path: Path, no_download: None, capsys: pytest.CaptureFixture
) -> None:
    base = make_wheel(tmp_path)
    cache = tmp_path / "cache"
    cached_copy(base, cache)
    url = f"http://127.0.0.1:1/files/{base.name}"
    fetch.fetch_base_wheel(pins_for(base), location=url, cache_dir=cache)
    err = capsys.readouterr().err
    assert f"{LOCATION_ENV}={url} was not fetched" in err


def test_cache_root_that_is_a_file(
    tmp_path: Path, out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_wheel(tmp_path)
    not_a_folder = tmp_path / "cache-root"
    not_a_folder.write_text("oops")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(not_a_folder))
    for location in (None, str(base)):  # base from the index, or given
        with pytest.raises(util.OverlayError, match="is a file, not a folder") as e:
            pack.build(
                out_dir,
                pins=pins_for(base),
                overlay_root=make_overlay(tmp_path / str(bool(location))),
                location=location,
            )
        assert "VLLM_CACHE_ROOT" in str(e.value) and str(not_a_folder) in str(e.value)
    assert not_a_folder.read_text() == "oops"
    assert list(out_dir.iterdir()) == []
