# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-tree PEP 517 backend that builds vLLM as a precompiled overlay.

The repository's ``vllm/`` folder holds only the files this downstream patch
replaces; everything else comes from the pinned upstream release wheel, in the
same spirit as vLLM's own ``VLLM_USE_PRECOMPILED`` builds. A build:

1. fetches the base wheel with ``pip download`` (so the user's pip index,
   certificate and proxy settings apply), or takes it from
   ``VLLM_PRECOMPILED_WHEEL_LOCATION`` (a local path or a URL), and checks it
   against the sha256 pinned in ``pyproject.toml``;
2. checks that every file under ``vllm/`` is declared in ``pyproject.toml``
   and still fits upstream (``tools/overlay_patch.py``), then unpacks the
   wheel with ``python -m wheel unpack``;
3. copies every file under ``vllm/`` over the file of the same name, or
   beside them for the files declared as added;
4. repacks it with ``python -m wheel pack --local-version <label>`` and
   restores the base file name's tags with ``python -m wheel tags``.

The verified base wheel is cached, so a rebuild does not download it again.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar
from urllib.parse import unquote, urlsplit

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
MIN_WHEEL = "wheel>=0.48.0"
SKIPPED_DIRS = frozenset({"__pycache__"})
SKIPPED_SUFFIXES = (".pyc",)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_NETWORK_TROUBLE = re.compile(r"connect|retrying|could not fetch|ssl|proxy", re.I)
# Reprs in pip's retry warnings that push the actual cause off the line.
_PIP_NOISE = re.compile(r"\(Retry\([^)]*\)\) |<[^<>]* object at 0x[0-9a-f]+>: ")

T = TypeVar("T")


class OverlayError(Exception):
    """A build problem the user can fix; the message says how."""


class UnsupportedOperation(Exception):
    """PEP 517's way for a backend to decline an optional kind of build."""


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


def verify_base_wheel(path: Path, pins: Pins, fix: str | None = None) -> None:
    """Refuse any base wheel that is not byte-for-byte the pinned release.

    ``fix`` replaces the default advice when deleting ``path`` is not the
    right remedy (e.g. for a download that never reached the cache).
    """
    name = path.name
    found = _wheel_name_version(name)
    if found is None or found != (
        canonicalize_name(pins.name),
        Version(pins.base_version),
    ):
        what = f"{found[0]} {found[1]}" if found else "not a wheel file name"
        raise OverlayError(
            f"base wheel {path} is {what}, but this overlay is pinned to "
            f"{pins.requirement}.\n"
            f"Fix: point {LOCATION_ENV} at one of: {pins.pinned_files()}"
        )
    expected = pins.sha256.get(name)
    if expected is None:
        raise OverlayError(
            f"no sha256 is pinned for {name} (from {path}).\n"
            f"Fix: point {LOCATION_ENV} at one of: {pins.pinned_files()} "
            f"(or pin this file in [tool.{CONFIG_TABLE}.sha256] in pyproject.toml)"
        )
    actual = sha256_of(path)
    if actual != expected:
        advice = fix or (
            f"delete {path} and build again, or point {LOCATION_ENV} at an "
            f"intact copy of {name}"
        )
        raise OverlayError(
            f"base wheel {name} does not match its pin.\n"
            f"  file:     {path}\n"
            f"  sha256:   {actual}\n"
            f"  expected: {expected}\n"
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
    """Use a verified cached wheel; drop a corrupt one so it is fetched again."""
    if not path.is_file():
        return False
    try:
        verify_base_wheel(path, pins)
    except OverlayError:
        print(
            f"precompiled_overlay: cached base wheel {path} is corrupt "
            "(sha256 mismatch); removing it and fetching it again",
            file=sys.stderr,
        )
        path.unlink(missing_ok=True)
        return False
    print(f"precompiled_overlay: using cached base wheel {path}", file=sys.stderr)
    return True


def _pip_download(target: str, dest: Path, pins: Pins, wanted: str) -> Path:
    """Fetch one wheel through the user's pip, so its settings all apply."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar=off",
        "--dest",
        str(dest),
        target,
    ]
    print(f"precompiled_overlay: fetching {target} with pip", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    files = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(files) != 1:
        said = _pip_gist(proc.stderr + proc.stdout)
        raise OverlayError(
            f"could not fetch the base wheel {pins.requirement} "
            f"(pip download {target}):\n"
            + "".join(f"  {line}\n" for line in said)
            + "Fix: configure pip's index/proxy (pip.conf, PIP_INDEX_URL, "
            f"HTTPS_PROXY), or set {LOCATION_ENV} to a local copy of {wanted}"
        )
    return files[0]


def _pip_gist(output: str, width: int = 200) -> list[str]:
    """pip's ERROR lines plus its last warning about the network, if any.

    pip's own errors for a dead network only say "No matching distribution";
    the last retry warning is what tells the user it was the network.
    """
    lines = output.splitlines()
    errors = [line for line in lines if line.startswith("ERROR:")]
    network = [
        line
        for line in lines
        if line.startswith("WARNING:") and _NETWORK_TROUBLE.search(line)
    ]
    gist = [_PIP_NOISE.sub("", line) for line in network[-1:]] + errors
    gist = gist if errors else lines[-5:]
    return [line if len(line) <= width else line[: width - 3] + "..." for line in gist]


def _download_into_cache(target: str, cache_dir: Path, pins: Pins, wanted: str) -> Path:
    """Download, verify, then rename into the cache: never a half file there."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        fetched = _pip_download(target, Path(tmp), pins, wanted)
        verify_base_wheel(
            fetched,
            pins,
            fix=f"the file fetched from {target} is not the pinned upstream "
            f"release (nothing was cached); check pip's index, or set "
            f"{LOCATION_ENV} to an intact copy of {fetched.name}",
        )
        final = cache_dir / fetched.name
        os.replace(fetched, final)
    print(f"precompiled_overlay: cached verified base wheel {final}", file=sys.stderr)
    return final


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
        print(f"precompiled_overlay: using base wheel {path}", file=sys.stderr)
        return path

    cache_dir = cache_dir or default_cache_dir()
    if location:
        target = location
        wanted = unquote(urlsplit(location).path).rsplit("/", 1)[-1]
    else:
        target = pins.requirement
        wanted = select_wheel_for_platform(pins, supported_tags)
    if wanted in pins.sha256 and _take_cached(cache_dir / wanted, pins):
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
    """Replace upstream files in the unpacked tree (drop-in rule enforced).

    Only the declared ``adds`` may be new, and those must be. Every bad
    target is listed at once, before anything is copied, so the user fixes
    them in one go.
    """
    added = set(adds)
    missing = [
        rel
        for rel in files
        if not (tree / rel).is_file() and rel.as_posix() not in added
    ]
    shipped = [
        rel for rel in files if (tree / rel).exists() and rel.as_posix() in added
    ]
    if missing or shipped:
        listed = "".join(f"  {rel.as_posix()}\n" for rel in missing)
        listed += "".join(f"  {rel.as_posix()} (declared added)\n" for rel in shipped)
        raise OverlayError(
            f"these overlay files do not fit the base wheel {tree.name}:\n"
            f"{listed}"
            "Fix: the overlay may only replace files that upstream ships "
            "(drop-in rule) and add files it does not; rename or remove them"
        )
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_root / rel, tree / rel)
    new = sum(rel.as_posix() in added for rel in files)
    print(
        f"precompiled_overlay: replaced {len(files) - new} file(s), added {new}",
        file=sys.stderr,
    )


def _wheel_cli(*args: str) -> str:
    """Run ``python -m wheel``; the wheel project owns zip and RECORD details."""
    cmd = [sys.executable, "-m", "wheel", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        hint = f" (this backend needs {MIN_WHEEL})" if "usage:" in proc.stderr else ""
        raise OverlayError(
            f"python -m wheel {args[0]} failed{hint}:\n{proc.stderr}{proc.stdout}"
        )
    return proc.stdout


def _only_child(folder: Path, pattern: str) -> Path:
    """The single entry a wheel CLI step left, found without parsing its output."""
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise OverlayError(f"expected one {pattern} in {folder}, found {found}")
    return found[0]


def build_overlay_wheel(
    base_wheel: Path,
    wheel_directory: Path,
    pins: Pins,
    overlay_root: Path,
    files: list[Path] | None = None,
) -> str:
    """Unpack, overlay, repack; return the new wheel's file name.

    The result only appears in ``wheel_directory`` by an atomic rename once
    it is complete, so a failed build leaves nothing there.
    """
    files = collect_overlay(overlay_root) if files is None else files
    python_tag, abi_tag, platform_tag = base_wheel.name[: -len(".whl")].split("-")[-3:]
    expected = f"{pins.name}-{pins.version}-{python_tag}-{abi_tag}-{platform_tag}.whl"
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-") as work:
        _wheel_cli("unpack", "--dest", work, str(base_wheel))
        tree = _only_child(Path(work), "*")
        apply_overlay(tree, overlay_root.parent, files, pins.adds)
        with tempfile.TemporaryDirectory(dir=wheel_directory, prefix=".overlay-") as s:
            stage = Path(s)
            pack_args = ["--dest-dir", s, "--local-version", pins.local_label]
            _wheel_cli("pack", *pack_args, str(tree))
            shutil.rmtree(tree)  # free the unpacked copy before retagging
            # wheel pack names the file after the WHEEL file's tags, which may
            # be less specific (linux_x86_64) than the base file name's
            # (manylinux_2_28_x86_64); restore the latter.
            _wheel_cli(
                "tags",
                f"--python-tag={python_tag}",
                f"--abi-tag={abi_tag}",
                f"--platform-tag={platform_tag}",
                "--remove",
                str(_only_child(stage, "*.whl")),
            )
            built = _only_child(stage, "*.whl")
            if built.name != expected:
                raise OverlayError(f"built {built.name}, expected {expected}")
            os.replace(built, wheel_directory / built.name)
    print(f"precompiled_overlay: built {expected}", file=sys.stderr)
    return expected


def build(
    wheel_directory: Path,
    *,
    pins: Pins | None = None,
    overlay_root: Path | None = None,
    location: str | None = None,
    cache_dir: Path | None = None,
) -> str:
    """The whole build with injectable inputs; the PEP 517 hook calls this."""
    pins = pins or load_pins()
    overlay_root = overlay_root or REPO_ROOT / pins.name
    files = collect_overlay(overlay_root)  # fail fast, before a download
    base = fetch_base_wheel(pins, location=location, cache_dir=cache_dir)
    import overlay_patch  # before unpacking: the replaced files still fit

    overlay_patch.check_base_wheel(pins, overlay_root, files, base, cache_dir)
    return build_overlay_wheel(base, wheel_directory, pins, overlay_root, files)


def run_hook(hook: Callable[[], T]) -> T:
    """Turn an OverlayError into a short message and exit status 1.

    pip shows the backend's output when a build fails; a bare message reads
    better there than a traceback through this module.
    """
    try:
        return hook()
    except OverlayError as err:
        fail(err)


def fail(err: OverlayError) -> NoReturn:
    """Print the error the way pip users expect to see it, then stop."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    raise SystemExit(1)


# PEP 517 hooks. ``config_settings`` is accepted and ignored: every input
# comes from pyproject.toml and the environment, like vLLM's own setup.py.
ConfigSettings = Mapping[str, str | list[str]] | None


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """Everything needed is already in ``build-system.requires``."""
    return []


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """PEP 517 entry point: build the overlay wheel into ``wheel_directory``."""
    return run_hook(lambda: build(Path(wheel_directory)))


def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """An sdist would still need the binary base wheel, so none is offered."""
    raise UnsupportedOperation(
        "this overlay is built only as a wheel (it repacks the precompiled "
        "upstream wheel); use `pip wheel .` or `python -m build --wheel`"
    )


if __name__ == "__main__":
    # Maintainer commands (diff, rebase) live beside the backend.
    from overlay_patch import main

    raise SystemExit(main())
