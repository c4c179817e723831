# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-tree PEP 517 backend that builds vLLM as a precompiled overlay.

The repository's ``vllm/`` folder holds only the files this downstream patch
replaces or adds; everything else comes from the pinned upstream release wheel, in the
same spirit as vLLM's own ``VLLM_USE_PRECOMPILED`` builds. A build:

1. fetches the base wheel with ``pip download`` (so the user's pip index,
   certificate and proxy settings apply), or takes it from
   ``VLLM_PRECOMPILED_WHEEL_LOCATION`` (a local path or a URL), and checks it
   against the sha256 pinned in ``pyproject.toml``;
2. checks that every file under ``vllm/`` is declared in ``pyproject.toml``
   and still fits upstream (``tools/overlay_patch.py``), reading only the
   wheel's file list and the replaced originals;
3. copies every file under ``vllm/`` over the file of the same name, or
   beside them for the files declared as added;
4. writes the version and the base file name's tags into the members that
   change and packs the result once, as ``<version>+<local-label>``
   (tools/overlay_repack.py).

The verified base wheel is cached, so a rebuild does not download it again,
and so is the built wheel, so reinstalling an unchanged tree does not repack.
``build_editable`` (tools/overlay_repack.py, tools/finder.py) and
``build_sdist`` (tools/overlay_sdist.py) are the other PEP 517 hooks. Every
stage is logged with its duration on stderr (``pip install -v`` shows it).

This module must import on Python 3.10 too (no tomllib), so that a Python
outside the supported range gets a message instead of a traceback.
"""

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: check_python() says so
    tomllib = None  # type: ignore[assignment]
from urllib.parse import unquote, urlsplit

from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, sys_tags
from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
CONFIG_TABLE = "vllm-overlay"
DIST_NAME = "vllm"
LOCATION_ENV = "VLLM_PRECOMPILED_WHEEL_LOCATION"
CACHE_SUBDIR = "precompiled-wheels"
# The backend's own modules (shipped in the sdist, hashed into the cache key).
BACKEND_MODULE_GLOBS = ("precompiled_overlay.py", "overlay_*.py", "finder.py")
SKIPPED_DIRS = frozenset({"__pycache__"})
SKIPPED_SUFFIXES = (".pyc",)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_NETWORK_TROUBLE = re.compile(r"connect|retrying|could not fetch|ssl|proxy", re.I)
# Reprs in pip's retry warnings that push the actual cause off the line.
_PIP_NOISE = re.compile(r"\(Retry\([^)]*\)\) |<[^<>]* object at 0x[0-9a-f]+>: ")
# What pip's debug log says about a URL it could not read: the real cause.
_PIP_CAUSE = re.compile(r"(Could not fetch URL .*|Retrying .*|.*\bSSLError\b.*)")
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_REQUIRES_PYTHON_RE = re.compile(r'^requires-python\s*=\s*"([^"]*)"', re.M)

T = TypeVar("T")


class OverlayError(Exception):
    """A build problem the user can fix; the message says how."""


@dataclass(frozen=True)
class Pins:
    """What the overlay is built on: one upstream release, pinned by hash."""

    base_version: str
    local_label: str
    sha256: Mapping[str, str]
    name: str = DIST_NAME
    # Declared overlay files (tools/overlay_patch.py): each replaced file
    # with the sha256 of the upstream original it was written against, and
    # the files upstream does not ship.
    replaces: Mapping[str, str] = field(default_factory=dict)
    adds: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        """The requirement that ``pip download`` resolves to the base wheel."""
        return f"{self.name}=={self.base_version}"

    @property
    def version(self) -> str:
        """The version of the overlay wheel, e.g. ``0.33.0+hisparse1``."""
        return f"{self.base_version}+{self.local_label}"

    def pinned_files(self) -> str:
        """The pinned file names, for error messages that list the choices."""
        return ", ".join(sorted(self.sha256))


def load_pins(pyproject: Path = PYPROJECT) -> Pins:
    """Read and sanity-check the pins, so a typo fails before any download."""
    import overlay_patch

    try:
        with pyproject.open("rb") as f:
            table = tomllib.load(f)["tool"][CONFIG_TABLE]
        replaces, adds = overlay_patch.read_declarations(table, pyproject)
        pins = Pins(
            base_version=str(table["base-version"]),
            local_label=str(table["local-label"]),
            sha256=dict(table["sha256"]),
            replaces=replaces,
            adds=adds,
        )
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise OverlayError(
            f"cannot read [tool.{CONFIG_TABLE}] (base-version, local-label, "
            f"sha256) from {pyproject}: {err!r}"
        ) from None
    _check_pins(pins, pyproject)
    return pins


def _check_pins(pins: Pins, source: Path) -> None:
    """Reject pins that could never verify, naming the bad entry."""
    try:
        Version(pins.version)
    except InvalidVersion:
        raise OverlayError(f"{source}: invalid version {pins.version!r}") from None
    if not pins.sha256:
        raise OverlayError(f"{source}: [tool.{CONFIG_TABLE}.sha256] is empty")
    for filename, digest in pins.sha256.items():
        if _wheel_name_version(filename) != (
            canonicalize_name(pins.name),
            Version(pins.base_version),
        ):
            raise OverlayError(
                f"{source}: pinned file {filename!r} is not a {pins.requirement} wheel"
            )
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise OverlayError(
                f"{source}: sha256 of {filename} must be 64 lowercase hex digits"
            )


def supported_python(pyproject: Path = PYPROJECT) -> str:
    """The Python range the pinned base wheel supports (its Requires-Python).

    Read without tomllib where it is missing: this is what tells a user of an
    older Python that it is too old.
    """
    text = pyproject.read_text(encoding="utf-8")
    if tomllib is not None:
        table = tomllib.loads(text).get("tool", {}).get(CONFIG_TABLE, {})
        return str(table.get("requires-python", ""))
    found = _REQUIRES_PYTHON_RE.search(text)
    return found.group(1) if found else ""


def check_python(
    spec: str | None = None, version: tuple[int, ...] | None = None
) -> None:
    """Stop before any download when this Python cannot run the base wheel."""
    spec = supported_python() if spec is None else spec
    found = ".".join(map(str, (version or sys.version_info)[:3]))
    if not spec:
        return
    if tomllib is not None and found in SpecifierSet(spec, prereleases=True):
        return
    raise OverlayError(
        f"this vLLM build needs Python {spec} (the pinned base wheel's "
        f"range; requires-python in [tool.{CONFIG_TABLE}] of "
        f"pyproject.toml), but this is Python {found} ({sys.executable}).\n"
        "Fix: run pip with a Python in that range, e.g. python3.12 -m pip "
        "install ."
    )


def _wheel_name_version(filename: str) -> tuple[str, Version] | None:
    """Name and version from a wheel file name, or None if it is not one."""
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return name, version


def default_cache_dir() -> Path:
    """Where verified base wheels live; the same root as vLLM's own cache."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        root = os.path.join(xdg, "vllm")
    return Path(root).expanduser() / CACHE_SUBDIR


def sha256_of(path: Path) -> str:
    """Hash a file in chunks: the real base wheel is a few hundred MB."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_base_wheel(
    path: Path, pins: Pins, fix: str | None = None, shown: str | None = None
) -> None:
    """Refuse any base wheel that is not byte-for-byte the pinned release.

    ``fix`` replaces the default advice when deleting ``path`` is not the
    right remedy (e.g. for a download that never reached the cache);
    ``shown`` names the file in the message when ``path`` is a temporary one.
    """
    name = path.name
    found = _wheel_name_version(name)
    if found is None or found != (
        canonicalize_name(pins.name),
        Version(pins.base_version),
    ):
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
            f"(or pin this file in [tool.{CONFIG_TABLE}.sha256] in pyproject.toml)"
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
            f'[tool.{CONFIG_TABLE}.sha256] "{name}")\n'
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


def _is_url(location: str) -> bool:
    """Tell a URL (fetched through pip) from a local path (used in place)."""
    return "://" in location


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
            f'([tool.{CONFIG_TABLE}.sha256] "{path.name}" in {PYPROJECT})\n'
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
        except (zipfile.BadZipFile, OSError, EOFError, ValueError):
            return False
        except Exception:  # zlib.error and friends from a damaged stream
            return False


def _pip_download(target: str, dest: Path, pins: Pins, wanted: str) -> Path:
    """Fetch one wheel through the user's pip, so its settings all apply.

    pip's console output is streamed (with download progress) while its
    debug log is kept, because only the log says why an index URL failed.
    """
    code, console, debug = run_pip_download(target, dest)
    files = sorted(dest.glob("*.whl"))
    if code != 0 or len(files) != 1:
        said = _pip_gist(console, debug)
        choices = wanted if wanted in pins.sha256 else pins.pinned_files()
        raise OverlayError(
            f"could not fetch the base wheel {pins.requirement} "
            f"(pip download {target}):\n"
            + "".join(f"  {line}\n" for line in said)
            + "Fix: configure pip's index/proxy (pip.conf, PIP_INDEX_URL, "
            f"HTTPS_PROXY), or set {LOCATION_ENV} to a local copy of {choices}"
        )
    return files[0]


def run_pip_download(
    target: str, dest: Path, platforms: Sequence[str] = ()
) -> tuple[int, str, str]:
    """``pip download`` one wheel into ``dest``, for ``platforms`` if given.

    Returns pip's status, console output and debug log (for `_pip_gist`).
    The rebase fetches new releases through here too, so both show progress
    and the real cause of a network failure.
    """
    where = f" for {', '.join(platforms)}" if platforms else ""
    log(f"fetching {target}{where} with pip")
    with stage(f"downloaded {target}{where}"):
        code, console, debug = _run_pip_download(target, dest, "raw", platforms)
        if code == 2 and "invalid choice: 'raw'" in console:  # pip < 24.1
            code, console, debug = _run_pip_download(target, dest, "off", platforms)
    return code, console, debug


def _run_pip_download(
    target: str, dest: Path, progress: str, platforms: Sequence[str]
) -> tuple[int, str, str]:
    """Run ``pip download``; return its status, console output and debug log."""
    log_file = dest / ".pip-debug.log"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"--progress-bar={progress}",
        "--log",
        str(log_file),
        "--dest",
        str(dest),
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
            tenth = done * 10 // total
            if tenth > shown:
                shown = tenth
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
    said = "\n".join(lines)
    cause = [c for c in causes[-1:] if c not in said and not network]
    gist = [_PIP_NOISE.sub("", line) for line in network[-1:] + cause] + errors
    gist = gist if errors else lines[-5:]
    return [line if len(line) <= width else line[: width - 3] + "..." for line in gist]


def _error_lines(lines: list[str]) -> list[str]:
    """``ERROR:`` lines, and pip's newer ``error:`` blocks (× / ╰─> / hint)."""
    found = []
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


def _download_into_cache(target: str, cache_dir: Path, pins: Pins, wanted: str) -> Path:
    """Download, verify, then rename into the cache: never a half file there."""
    ensure_folder(cache_dir, "base wheel cache")
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        fetched = _pip_download(target, Path(tmp), pins, wanted)
        verify_base_wheel(
            fetched,
            pins,
            fix="nothing was cached. Either the index served another file "
            "than the pinned upstream release (check pip's index settings), "
            f"or the pin in pyproject.toml is wrong; or set {LOCATION_ENV} to "
            f"an intact copy of {fetched.name}",
            shown=f"{fetched.name}, as downloaded from {target}",
        )
        final = cache_dir / fetched.name
        os.replace(fetched, final)
    log(f"cached verified base wheel {final}")
    return final


def ensure_folder(path: Path, what: str) -> None:
    """Create a cache folder, or say which path is in the way (no traceback)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.is_file()), path)
        raise OverlayError(
            f"cannot use {path} as the {what}: {blocker} is a file, not a "
            "folder.\n"
            "Fix: set VLLM_CACHE_ROOT to a folder (now: "
            f"{os.environ.get('VLLM_CACHE_ROOT') or 'unset'}), or move "
            f"{blocker} away"
        ) from None
    except PermissionError as err:
        raise OverlayError(
            f"cannot create the {what} {path}: {err.strerror}.\n"
            "Fix: set VLLM_CACHE_ROOT to a folder you can write to"
        ) from None


def fetch_base_wheel(
    pins: Pins | None = None,
    *,
    location: str | None = None,
    cache_dir: Path | None = None,
    supported_tags: Iterable[Tag] | None = None,
) -> Path:
    """Return the path of a verified copy of the pinned upstream wheel.

    ``location`` defaults to ``$VLLM_PRECOMPILED_WHEEL_LOCATION``: a local path
    is verified and used in place; a URL, or nothing (``pip download`` of the
    pinned requirement), goes through the cache. The test suite uses this to
    get the stock upstream files too.
    """
    pins = pins or load_pins()
    if location is None:
        location = os.environ.get(LOCATION_ENV, "").strip()
    if location and not _is_url(location):
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
    if _take_cached(cache_dir / wanted, pins):
        if location:
            log(
                f"{LOCATION_ENV}={location} was not fetched: the cache "
                f"already holds the verified {wanted}"
            )
        return cache_dir / wanted
    return _download_into_cache(target, cache_dir, pins, wanted)


def extract_base_files(
    files: Iterable[Path | str],
    dest: Path | None = None,
    *,
    base_wheel: Path | None = None,
) -> Path:
    """Copy upstream's originals of ``files`` (``vllm/...``) out of the base wheel.

    Tests use this to run against stock vLLM. Reading a few members from the
    verified wheel is much cheaper than unpacking its whole tree; each file
    lands by atomic rename, so concurrent test workers never see half a file.
    Returns the folder that mirrors the wheel's layout.
    """
    base = base_wheel or fetch_base_wheel()
    if dest is None:
        dest = default_cache_dir() / "stock-files" / base.name.removesuffix(".whl")
    wanted = [Path(rel).as_posix() for rel in files]
    with zipfile.ZipFile(base) as zf:
        missing = sorted(set(wanted) - set(zf.namelist()))
        if missing:
            raise OverlayError(
                f"not in the base wheel {base.name}: {', '.join(missing)} "
                "(the overlay may only replace files that upstream ships)"
            )
        for member in wanted:
            target = dest / member
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".extract-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(zf.read(member))
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return dest


def collect_overlay(overlay_root: Path) -> list[Path]:
    """List the overlay's files relative to the wheel root (``vllm/...``)."""
    if not overlay_root.is_dir():
        raise OverlayError(
            f"nothing to overlay: {overlay_root} does not exist; it must hold "
            "the upstream files that this build replaces"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(overlay_root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(SKIPPED_SUFFIXES):
                path = Path(dirpath, filename)
                files.append(path.relative_to(overlay_root.parent))
    if not files:
        raise OverlayError(f"nothing to overlay: no files under {overlay_root}")
    return files


def apply_overlay(
    tree: Path, source_root: Path, files: list[Path], adds: Iterable[str] = ()
) -> None:
    """Copy the overlay's files into the unpacked tree.

    What may be replaced or added was settled by
    ``overlay_patch.check_base_wheel``, which `build` runs first and which
    lists every file that does not fit; ``adds`` only counts the new ones.
    """
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_root / rel, tree / rel)
    new = len({rel.as_posix() for rel in files} & set(adds))
    log(f"replaced {len(files) - new} file(s), added {new}")


def build_overlay_wheel(
    base_wheel: Path,
    wheel_directory: Path,
    pins: Pins,
    overlay_root: Path,
    files: list[Path] | None = None,
    *,
    editable: bool = False,
    cache_root: Path | None = None,
) -> str:
    """Unpack, overlay, repack (or reuse a cached build); return the file name.

    The result only appears in ``wheel_directory`` by an atomic rename once
    it is complete, so a failed build leaves nothing there.
    """
    import overlay_repack  # a sibling in backend-path; imports this module

    files = collect_overlay(overlay_root) if files is None else files
    name = overlay_repack.build_cached(
        base_wheel,
        wheel_directory,
        pins,
        overlay_root,
        files,
        editable=editable,
        cache_root=cache_root,
    )
    log(f"built {name}")
    return name


def build(
    wheel_directory: Path,
    *,
    pins: Pins | None = None,
    overlay_root: Path | None = None,
    location: str | None = None,
    cache_dir: Path | None = None,
    editable: bool = False,
) -> str:
    """The whole build with injectable inputs; the PEP 517 hooks call this."""
    started = time.monotonic()
    pins = pins or load_pins()
    overlay_root = overlay_root or REPO_ROOT / pins.name
    files = collect_overlay(overlay_root)  # fail fast, before a download
    base = fetch_base_wheel(pins, location=location, cache_dir=cache_dir)
    import overlay_patch  # before unpacking: the replaced files still fit

    overlay_patch.check_base_wheel(pins, overlay_root, files, base, cache_dir)
    name = build_overlay_wheel(
        base,
        wheel_directory,
        pins,
        overlay_root,
        files,
        editable=editable,
        cache_root=cache_dir.parent if cache_dir else None,
    )
    log(f"done in {time.monotonic() - started:.1f} s")
    return name


def backend_modules() -> list[Path]:
    """This backend's own files in tools/ (not the repo's other tools)."""
    here = Path(__file__).resolve().parent
    found = {p for pattern in BACKEND_MODULE_GLOBS for p in here.glob(pattern)}
    return sorted(found)


def log(message: str) -> None:
    """One progress line on stderr; pip shows these with ``-v``."""
    print(f"precompiled_overlay: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Log a finished stage with its duration, so slow steps are visible."""
    started = time.monotonic()
    yield
    log(f"{what} ({time.monotonic() - started:.1f} s)")


def run_hook(hook: Callable[[], T], python: bool = True) -> T:
    """Turn an OverlayError into a short message and exit status 1.

    pip shows the backend's output when a build fails; a bare message reads
    better there than a traceback through this module. Hooks that need the
    base wheel check the Python version first, before any download.
    """
    try:
        if python:
            check_python()
        return hook()
    except OverlayError as err:
        fail(err)


def fail(err: OverlayError) -> NoReturn:
    """Print the error the way pip users expect to see it, then stop."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# PEP 517 and PEP 660 hooks. ``config_settings`` is accepted and ignored:
# every input comes from pyproject.toml and the environment, like vLLM's own
# setup.py.
ConfigSettings = Mapping[str, str | list[str]] | None


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """Everything needed is already in ``build-system.requires``."""
    return run_hook(list)


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """PEP 517 entry point: build the overlay wheel into ``wheel_directory``."""
    return run_hook(lambda: build(Path(wheel_directory)))


def get_requires_for_build_editable(
    config_settings: ConfigSettings = None,
) -> list[str]:
    """Same as for a wheel: the editable wheel is built the same way."""
    return run_hook(list)


def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """PEP 660: the base wheel without the tree's Python files, plus a hook
    that imports them from this working tree (tools/finder.py)."""
    return run_hook(lambda: build(Path(wheel_directory), editable=True))


def get_requires_for_build_sdist(config_settings: ConfigSettings = None) -> list[str]:
    """The sdist is assembled from the tree alone."""
    return []


def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The tree's files and this backend; a wheel build from it fetches the
    base wheel as a build from the repository does (tools/overlay_sdist.py)."""
    import overlay_sdist  # a sibling in backend-path; imports this module

    return run_hook(
        lambda: overlay_sdist.build_sdist(Path(sdist_directory)), python=False
    )


if __name__ == "__main__":
    # Maintainer commands (diff, rebase) live beside the backend.
    from overlay_patch import main

    raise SystemExit(main())
