# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 1: the pinned base wheel.

A local copy (``$VLLM_PRECOMPILED_WHEEL_LOCATION``) or a cached one is checked
here; otherwise ``pip download`` fetches it in pip's hash-checking mode, with
the user's pip settings: pip refuses a file that matches no pin and says what
went wrong, and the build adds one line on what to do.
"""

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from packaging.tags import Tag, sys_tags
from packaging.utils import parse_wheel_filename

from .pins import DIST_NAME, LOCATION_ENV, Pins
from .util import OverlayError, cache_folder, log, sha256_of


def default_cache_dir() -> Path:
    """Where base wheels live: under vLLM's own cache root."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(xdg, "vllm")
    return Path(root, "precompiled-wheels").expanduser()


def wheel_for_platform(pins: Pins, supported: Iterable[Tag] | None = None) -> str:
    """The pinned file this interpreter installs, known before any download."""
    tags = set(supported or sys_tags())
    for name in pins.sha256:
        if tags & parse_wheel_filename(name)[3]:
            return name
    raise OverlayError(
        f"no pinned {pins.requirement} wheel fits this platform; pinned: "
        f"{', '.join(pins.sha256)}.\nFix: build on one of those platforms"
    )


def fetch_base_wheel(
    pins: Pins,
    *,
    location: str | None = None,
    cache_dir: Path | None = None,
    supported_tags: Iterable[Tag] | None = None,
) -> Path:
    """A checked copy of the pinned base wheel: at ``location`` (by default
    ``$VLLM_PRECOMPILED_WHEEL_LOCATION``), else in the cache, else pip's."""
    if location is None:
        location = os.environ.get(LOCATION_ENV, "").strip()
    if location:
        path = Path(location).expanduser().absolute()  # a link's own name counts
        if not path.is_file() or path.name not in pins.sha256:
            raise OverlayError(
                f"{LOCATION_ENV}={location} is not a local copy of a pinned wheel.\n"
                f"Fix: point it at a copy of one of: {', '.join(pins.sha256)}"
            )
        if (actual := sha256_of(path)) != pins.sha256[path.name]:
            raise OverlayError(
                f"{path} does not match its pin: its sha256 is {actual}, "
                f"pyproject.toml pins {pins.sha256[path.name]}.\n"
                f"Fix: point {LOCATION_ENV} at an intact copy of {path.name}"
            )
        return path
    wanted = wheel_for_platform(pins, supported_tags)
    cached = cache_folder(cache_dir or default_cache_dir()) / wanted
    if cached.is_file() and sha256_of(cached) == pins.sha256[wanted]:
        return cached
    if cached.is_file():  # the download replaces it
        log(f"{cached} does not match its pin: fetching it again")
    hashes = [f"--hash=sha256:{pin}" for pin in sorted(pins.sha256.values())]
    return pip_download(
        " ".join([pins.requirement, *hashes]),
        cached.parent,
        fix="check pip's index and proxy settings (pip.conf, PIP_INDEX_URL, "
        f"HTTPS_PROXY), or set {LOCATION_ENV} to a local copy of {wanted}",
    )


def pip_download(
    requirement: str, cache_dir: Path, fix: str, platform: str | None = None
) -> Path:
    """``pip download`` one wheel into ``cache_dir``, pip's output on stderr.
    pip writes into a folder inside it, so the wheel moves in by one rename."""
    shown = requirement.split(" --hash")[0] + (f" for {platform}" if platform else "")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        scratch = Path(tmp)
        (scratch / "requirement.txt").write_text(requirement + "\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-r"]
        cmd += [str(scratch / "requirement.txt"), f"--dest={scratch}"]
        cmd += [
            "--only-binary=:all:",
            *([f"--platform={platform}"] if platform else []),
        ]
        log(f"fetching {shown} with pip")
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as pip:
            for line in pip.stdout or ():
                print(f"pip: {line}", end="", file=sys.stderr, flush=True)
        wheels = list(scratch.glob("*.whl"))
        if pip.returncode != 0 or len(wheels) != 1:
            raise OverlayError(
                f"could not fetch {shown} (pip's output is above).\nFix: {fix}"
            )
        os.replace(wheels[0], cache_dir / wheels[0].name)
    log(f"cached {cache_dir / wheels[0].name}")
    return cache_dir / wheels[0].name


def fetch_release(pins: Pins, version: str, cache_dir: Path) -> dict[str, Path]:
    """Each pinned platform's wheel of upstream ``version``, for a rebase. No
    pin exists yet, so the first download is trusted (docs/contributing/
    rebase.md says to compare it with the index's sha256)."""
    wheels = {}
    for pinned in pins.sha256:  # in pyproject.toml's order, kept by the rebase
        tags = pinned.removesuffix(".whl").split("-")[-3:]
        path = cache_folder(cache_dir) / f"{DIST_NAME}-{version}-{'-'.join(tags)}.whl"
        if not path.is_file():
            path = pip_download(
                f"{DIST_NAME}=={version}",
                cache_dir,
                "check the version and pip's index settings; nothing was changed",
                None if tags[2] == "any" else tags[2].split(".")[0],
            )
        wheels[path.name] = path
    return wheels
