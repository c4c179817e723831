# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the build backend's tests: pip offline, fresh caches."""

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import fetch
from tools.pins import LOCATION_ENV


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: the fastest 'no network' there is."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def offline_pip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, closed_port: int
) -> Iterator[None]:
    """Cut pip off from real indexes, configs and caches for every test."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{closed_port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv(LOCATION_ENV, raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    yield


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The only place pip may fetch wheels from: a local folder."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """The wheel_directory a frontend would pass to build_wheel."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the backend tries to download anything."""

    def download(*args: object) -> Path:
        raise AssertionError("the base wheel must not be downloaded here")

    monkeypatch.setattr(fetch, "pip_download", download)
