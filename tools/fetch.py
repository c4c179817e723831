# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 1: a verified copy of the pinned upstream wheel.

The wheel comes from ``pip download`` (so the user's pip index, certificate
and proxy settings apply), or from ``VLLM_PRECOMPILED_WHEEL_LOCATION`` (a
local path or a URL), and must match the sha256 pinned in ``pyproject.toml``.
Verified wheels are cached, so a rebuild needs no network; ``rebase``
fetches new releases through here too.
"""

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from packaging.tags import Tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .pins import LOCATION_ENV, Pins, cache_root, wheel_name_version
from .util import (
    OverlayError,
    ensure_folder,
    log,
    remove_leftovers,
    scratch_folder,
    sha256_of,
    stage,
)

_NETWORK_TROUBLE = re.compile(r"connect|retrying|could not fetch|ssl|proxy", re.I)
# Reprs in pip's retry warnings that push the actual cause off the line.
_PIP_NOISE = re.compile(r"\(Retry\([^)]*\)\) |<[^<>]* object at 0x[0-9a-f]+>: ")
# What pip's debug log says about a URL it could not read: the real cause.
_PIP_CAUSE = re.compile(r"(Could not fetch URL .*|Retrying .*|.*\bSSLError\b.*)")
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
# The first pip with --progress-bar=raw; older ones print their usage for it.
_RAW_PROGRESS_PIP = Version("24.1")


def default_cache_dir() -> Path:
    """Where verified base wheels live; the same root as vLLM's own cache."""
    return cache_root() / "precompiled-wheels"


def verify_base_wheel(
    path: Path, pins: Pins, fix: str | None = None, shown: str | None = None
) -> None:
    """Refuse any base wheel that is not byte-for-byte the pinned release.

    ``fix`` replaces the default advice when deleting ``path`` is not the
    remedy; ``shown`` names the file when ``path`` is a temporary one.
    """
    name = path.name
    found = wheel_name_version(name)
    if found != (canonicalize_name(pins.name), Version(pins.base_version)):
        what = f"{found[0]} {found[1]}" if found else "not a wheel file name"
        raise OverlayError(
            f"base wheel {shown or path} is {what}, but this overlay is pinned to "
            f"{pins.requirement}.\n"
            f"Fix: point {LOCATION_ENV} at one of: {pins.pinned_files()}"
        )
    expected = pins.sha256.get(name)
    if expected is None:
        raise OverlayError(
            f"no sha256 is pinned for {name} (from {shown or path}).\n"
            f"Fix: point {LOCATION_ENV} at one of: {pins.pinned_files()} "
            "(or pin this file in [tool.vllm-overlay.sha256] in pyproject.toml)"
        )
    with stage(f"checked the sha256 of {name}"):
        actual = sha256_of(path)
    if actual != expected:
        advice = fix or (
            f"delete {path} and build again, or point {LOCATION_ENV} at an "
            f"intact copy of {name}"
        )
        raise OverlayError(
            f"base wheel {name} does not match its pin.\n"
            f"  file:     {shown or path}\n"
            f"  sha256:   {actual}\n"
            f"  expected: {expected} (pyproject.toml, "
            f'[tool.vllm-overlay.sha256] "{name}")\n'
            f"Fix: {advice}"
        )


def select_wheel_for_platform(
    pins: Pins, supported_tags: Iterable[Tag] | None = None
) -> str:
    """Pick the pinned file this interpreter would prefer, as pip would.

    Done before downloading so that a cache hit needs no network at all, and
    so an unsupported platform is reported plainly instead of as a pip error.
    """
    supported = list(supported_tags or sys_tags())
    ranks = {tag: i for i, tag in enumerate(supported)}
    best: tuple[int, str] | None = None
    for filename in pins.sha256:
        file_ranks = [
            ranks[tag] for tag in parse_wheel_filename(filename)[3] if tag in ranks
        ]
        if file_ranks and (best is None or min(file_ranks) < best[0]):
            best = (min(file_ranks), filename)
    if best is None:
        raise OverlayError(
            f"no pinned {pins.requirement} wheel fits this platform "
            f"({supported[0] if supported else 'unknown'}); "
            f"pinned: {pins.pinned_files()}.\n"
            f"Fix: build on a supported platform, or set {LOCATION_ENV} to one of "
            f"the pinned files to cross-build for its platform"
        )
    return best[1]


def _take_cached(path: Path, pins: Pins) -> bool:
    """Use a verified cached wheel; drop a corrupt one so it is fetched again.

    A cached file that is an intact wheel yet misses its pin is kept: the
    likelier culprit is the pin (it only got into the cache by matching one),
    and deleting it would cost a download that fails the same way.
    """
    if not path.is_file():
        return False
    with stage(f"checked the sha256 of {path.name}"):
        actual = sha256_of(path)
    expected = pins.sha256[path.name]
    if actual == expected:
        log(f"using cached base wheel {path}")
        return True
    if _is_intact_zip(path):
        raise OverlayError(
            f"the cached base wheel {path.name} does not match its pin in "
            f"pyproject.toml, but it is an intact wheel (every member passes "
            f"its CRC check), so it was kept.\n"
            f"  file:     {path}\n"
            f"  sha256:   {actual}\n"
            f"  expected: {expected} "
            f'([tool.vllm-overlay.sha256] "{path.name}" in pyproject.toml)\n'
            "Fix: if the pin was changed by mistake, restore it; if the file "
            f"is not the release you want, delete {path} and build again"
        )
    log(
        f"cached base wheel {path} is corrupt (sha256 mismatch); removing it "
        "and fetching it again"
    )
    path.unlink(missing_ok=True)
    return False


def _is_intact_zip(path: Path) -> bool:
    """Tell a damaged file from a different but well-formed one."""
    with stage(f"checked every member of {path.name}"):
        try:
            with zipfile.ZipFile(path) as zf:
                return zf.testzip() is None
        except Exception:  # BadZipFile, OSError, zlib.error from a damaged stream
            return False


def _pip_download(
    target: str,
    dest: Path,
    platforms: Sequence[str] = (),
    what: str = "",
    fix: str = "",
) -> Path:
    """``pip download`` one wheel into ``dest`` through the user's pip.

    pip's console output is streamed (with download progress) while its
    debug log is kept, because only the log says why an index URL failed.
    """
    where = f" for {', '.join(platforms)}" if platforms else ""
    log(f"fetching {target}{where} with pip")
    with stage(f"downloaded {target}{where}"):
        code, console, debug = _run_pip_download(target, dest, platforms)
    files = sorted(dest.glob("*.whl"))
    if code != 0 or len(files) != 1:
        raise OverlayError(
            f"could not fetch {what or target}{where} (pip download {target}):\n"
            + "".join(f"  {line}\n" for line in _pip_gist(console, debug))
            + "Fix: configure pip's index/proxy (pip.conf, PIP_INDEX_URL, "
            f"HTTPS_PROXY){fix}"
        )
    return files[0]


def _progress_bar() -> str:
    """``raw`` progress for the log where pip has it; else none at all."""
    try:
        pip = Version(installed_version("pip"))
    except (PackageNotFoundError, ValueError):
        return "off"
    return "raw" if pip >= _RAW_PROGRESS_PIP else "off"


def _run_pip_download(
    target: str, dest: Path, platforms: Sequence[str]
) -> tuple[int, str, str]:
    """Run ``pip download``; return its status, console output and debug log."""
    log_file = dest / ".pip-debug.log"
    cmd = [
        *(sys.executable, "-m", "pip", "download", "--no-deps"),
        *("--only-binary=:all:", f"--progress-bar={_progress_bar()}"),
        *("--log", str(log_file), "--dest", str(dest)),
        *(f"--platform={platform}" for platform in platforms),
        target,
    ]
    env = {**os.environ, "COLUMNS": "1000"}  # keep pip's lines unwrapped
    console: list[str] = []
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
    ) as proc:
        assert proc.stdout is not None
        shown = -1
        for line in proc.stdout:
            line = line.rstrip("\n")
            match = _PIP_PROGRESS.match(line)
            if match is None:
                console.append(line)
                log(f"pip: {line}")
                continue
            done, total = int(match.group(1)), int(match.group(2)) or 1
            if done * 10 // total > shown:
                shown = done * 10 // total
                log(f"downloaded {done / 1e6:.0f} of {total / 1e6:.0f} MB")
    try:
        debug = log_file.read_text(errors="replace")
        log_file.unlink()
    except OSError:
        debug = ""
    return proc.returncode, "\n".join(console), debug


def _pip_gist(output: str, debug: str = "", width: int = 400) -> list[str]:
    """pip's error lines plus the network cause that its console leaves out.

    pip's errors for a dead network only say "No matching distribution"
    (with ``PIP_RETRIES=0``, nothing else at all); the cause is in its retry
    warnings, or only in its debug log ("Could not fetch URL ...").
    """
    lines = output.splitlines()
    errors = _error_lines(lines)
    network = [
        line.strip()
        for line in lines
        if line.lstrip().startswith("WARNING:") and _NETWORK_TROUBLE.search(line)
    ]
    causes = [
        m.group(1)
        for line in debug.splitlines()
        if (m := _PIP_CAUSE.search(line)) and _NETWORK_TROUBLE.search(line)
    ]
    cause = [c for c in causes[-1:] if c not in output and not network]
    gist = [_PIP_NOISE.sub("", line) for line in network[-1:] + cause] + errors
    gist = gist if errors else lines[-5:]
    return [line if len(line) <= width else line[: width - 3] + "..." for line in gist]


def _error_lines(lines: list[str]) -> list[str]:
    """``ERROR:`` lines, and pip's newer ``error:`` blocks (× / ╰─> / hint)."""
    found: list[str] = []
    in_block = False
    for line in lines:
        if line.startswith(("ERROR:", "error:")):
            found.append(line)
            in_block = line.startswith("error:")
        elif in_block and line.strip():
            found.append(line.strip())
        elif in_block and found and found[-1].startswith("hint:"):
            in_block = False
    return found


def _download_into_cache(
    target: str, cache_dir: Path, verify: Callable[[Path], None], **pip: Any
) -> Path:
    """Download, verify, then rename into the cache: never a half file there."""
    with scratch_folder(cache_dir, ".download-") as tmp:
        fetched = _pip_download(target, Path(tmp), **pip)
        verify(fetched)
        os.replace(fetched, cache_dir / fetched.name)
    log(f"cached verified {fetched.name}")
    return cache_dir / fetched.name


def _verify_download(pins: Pins, target: str) -> Callable[[Path], None]:
    return lambda fetched: verify_base_wheel(
        fetched,
        pins,
        fix="nothing was cached. Either the index served another file "
        "than the pinned upstream release (check pip's index settings), "
        f"or the pin in pyproject.toml is wrong; or set {LOCATION_ENV} to "
        f"an intact copy of {fetched.name}",
        shown=f"{fetched.name}, as downloaded from {target}",
    )


def fetch_base_wheel(
    pins: Pins,
    *,
    location: str | None = None,
    cache_dir: Path | None = None,
    supported_tags: Iterable[Tag] | None = None,
) -> Path:
    """Return the path of a verified copy of the pinned upstream wheel.

    ``location`` defaults to ``$VLLM_PRECOMPILED_WHEEL_LOCATION``: a local path
    is verified and used in place; a URL, or nothing (``pip download`` of the
    pinned requirement), goes through the cache.
    """
    if location is None:
        location = os.environ.get(LOCATION_ENV, "").strip()
    if location and "://" not in location:
        path = Path(location).expanduser().absolute()  # a link's own name counts
        if not path.is_file():
            raise OverlayError(
                f"{LOCATION_ENV}={location} is not a file.\n"
                f"Fix: point it at a local copy of one of: {pins.pinned_files()}"
            )
        verify_base_wheel(
            path,
            pins,
            fix=f"replace it with an intact copy of {path.name}, or unset "
            f"{LOCATION_ENV} to let pip download the pinned release",
        )
        log(f"using base wheel {path}")
        return path

    cache_dir = cache_dir or default_cache_dir()
    if location:
        target = location
        wanted = unquote(urlsplit(location).path).rsplit("/", 1)[-1]
        if wanted not in pins.sha256:  # checked before any download
            raise OverlayError(
                f"{LOCATION_ENV}={location} does not name a pinned wheel file "
                f"(its last path part is {wanted!r}).\n"
                f"Fix: point it at the URL of one of: {pins.pinned_files()}"
            )
    else:
        target = pins.requirement
        wanted = select_wheel_for_platform(pins, supported_tags)
    ensure_folder(cache_dir, "base wheel cache")
    remove_leftovers(cache_dir)
    if _take_cached(cache_dir / wanted, pins):
        if location:
            log(
                f"{LOCATION_ENV}={location} was not fetched: the cache "
                f"already holds the verified {wanted}"
            )
        return cache_dir / wanted
    choices = wanted if wanted in pins.sha256 else pins.pinned_files()
    return _download_into_cache(
        target,
        cache_dir,
        _verify_download(pins, target),
        what=f"the base wheel {pins.requirement}",
        fix=f", or set {LOCATION_ENV} to a local copy of {choices}",
    )


def fetch_release(pins: Pins, version: str, cache_dir: Path) -> dict[str, Path]:
    """Each pinned platform's wheel of upstream ``version``, for a rebase.

    There is no pin for a new release yet, so its first download is trusted;
    its sha256 is what the rebase pins. A wheel already in the cache (an
    earlier rebase fetched it) is used as is, unless it contradicts a pin.
    """
    ensure_folder(cache_dir, "base wheel cache")
    remove_leftovers(cache_dir)
    wheels: dict[str, Path] = {}
    for pinned in pins.sha256:  # in pyproject.toml's order, kept by the rebase
        tags = pinned.removesuffix(".whl").split("-")[-3:]
        guess = cache_dir / ("-".join([pins.name, version, *tags]) + ".whl")
        if guess.is_file() and pins.sha256.get(guess.name) in (None, sha256_of(guess)):
            log(f"using cached {guess}")
            wheels[guess.name] = guess
            continue
        platforms = [] if tags[2] == "any" else tags[2].split(".")
        wheel = _download_into_cache(
            f"{pins.name}=={version}",
            cache_dir,
            lambda fetched: _refuse_unpinned(pins, fetched),
            platforms=platforms,
            fix=", and check the version; nothing was changed",
        )
        wheels[wheel.name] = wheel
    return wheels


def _refuse_unpinned(pins: Pins, fetched: Path) -> None:
    """A new release's download is trusted, unless it contradicts a pin."""
    pinned = pins.sha256.get(fetched.name)
    if pinned not in (None, sha256_of(fetched)):
        raise OverlayError(
            f"pip fetched {fetched.name} with sha256 {sha256_of(fetched)}, "
            f"but pyproject.toml pins {pinned}; check pip's index. Nothing was "
            "changed"
        )
