# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Turn the verified base wheel into the overlay wheel, fast and reproducibly.

Part of the precompiled_overlay build backend (tools/ is its backend-path).
Compressing the few hundred MB of upstream binaries is nearly all of a
build's time, so:

- the target tags and version are written into the few unpacked members
  that change, and everything is packed once (``wheel``'s WheelFile, which
  writes RECORD), streaming the untouched members from the base wheel;
- a built wheel is cached, keyed by everything that decides its bytes, so
  reinstalling an unchanged tree copies a file instead of repacking;
- ``SOURCE_DATE_EPOCH`` (default: the base wheel's own newest timestamp) and
  normalised file modes make two builds of one tree byte-identical.

The editable variant leaves the tree's Python files out of the wheel and adds
an import hook (tools/finder.py) that loads them from the working tree.
"""

import ast
import calendar
import email.policy
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import zipfile
from collections.abc import Iterable
from email.generator import BytesGenerator
from email.parser import BytesParser
from pathlib import Path

import precompiled_overlay as ovl
from finder import pth_line
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import parse_wheel_filename
from wheel.wheelfile import WheelFile

CACHE_SUBDIR = "overlay-wheels"
# Each entry is a full wheel (a few hundred MB): keep the latest few only.
CACHE_KEEP = 2
VERSION_MODULE = "vllm/_version.py"
FINDER_SOURCE = Path(__file__).with_name("finder.py")
EDITABLE_FINDER = "_vllm_overlay_finder"
EDITABLE_PTH = "_vllm_overlay_editable.pth"
_ZIP_EPOCH = 315532800  # 1980-01-01: the earliest time a zip entry can hold
_VERSION_LINE = re.compile(r"^(__version__ = version = ).*$", re.M)
_TUPLE_LINE = re.compile(r"^(__version_tuple__ = version_tuple = )(.*)$", re.M)
# Local labels that vLLM 0.33.0 reads as something else (see check_label).
_LABEL_MISREAD = (
    ("cpu", "vllm/platforms picks the CPU platform when 'cpu' is in the version"),
    ("g", "vllm collect-env reads a last version part starting with 'g' as a git sha"),
)


def check_label(label: str) -> None:
    """Refuse local labels that vLLM's own version checks would misread."""
    lowered = label.lower()
    for text, why in _LABEL_MISREAD:
        if lowered.startswith(text) if text == "g" else text in lowered:
            raise ovl.OverlayError(
                f"local-label {label!r} in pyproject.toml cannot be used: {why}.\n"
                "Fix: choose another local-label"
            )


def source_date_epoch(base_wheel: Path) -> str:
    """``$SOURCE_DATE_EPOCH``, else the newest timestamp inside the base wheel.

    The default ties the build's timestamps to the pinned input, not to the
    clock, so rebuilding the same tree anywhere gives the same bytes.
    """
    given = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if given:
        if not given.isdigit():
            raise ovl.OverlayError(
                f"SOURCE_DATE_EPOCH={given!r} is not a whole number of seconds.\n"
                "Fix: unset it, or set it to e.g. $(git log -1 --format=%ct)"
            )
        return given
    with zipfile.ZipFile(base_wheel) as zf:
        newest = max(info.date_time for info in zf.infolist())
    return str(calendar.timegm((*newest, 0, 0, 0)))


def backend_digest() -> str:
    """Hash of the backend's own code: a changed backend must not hit the cache."""
    digest = hashlib.sha256()
    for path in ovl.backend_modules():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(
    base_wheel: Path,
    pins: "ovl.Pins",
    overlay_root: Path,
    files: list[Path],
    editable: bool,
    epoch: str,
) -> str:
    """Everything that decides the built wheel's bytes, hashed.

    The base wheel counts by its pin (it has just been verified against it);
    an editable wheel holds no tree Python file, only their names and where
    the tree is.
    """
    tree = overlay_root.parent
    entries = []
    for rel in files:
        path = tree / rel
        live = editable and rel.suffix == ".py"
        content = "" if live else ovl.sha256_of(path)
        executable = bool(path.stat().st_mode & stat.S_IXUSR)
        entries.append([rel.as_posix(), content, executable])
    facts = {
        "base": [base_wheel.name, pins.sha256[base_wheel.name]],
        "version": pins.version,
        "files": entries,
        "editable": str(tree.resolve()) if editable else None,
        "epoch": epoch,
        "backend": backend_digest(),
    }
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def target_name(base_wheel: Path, pins: "ovl.Pins") -> str:
    """The overlay wheel's file name: the base file name's tags, new version."""
    python_tag, abi_tag, platform_tag = base_wheel.name[: -len(".whl")].split("-")[-3:]
    return f"{pins.name}-{pins.version}-{python_tag}-{abi_tag}-{platform_tag}.whl"


def place(built: Path, wheel_directory: Path) -> None:
    """Put a finished wheel into ``wheel_directory`` by atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=wheel_directory, prefix=".overlay-")
    os.close(fd)
    try:
        shutil.copyfile(built, tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is not what a dist/ file has
        os.replace(tmp, wheel_directory / built.name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_cached(
    base_wheel: Path,
    wheel_directory: Path,
    pins: "ovl.Pins",
    overlay_root: Path,
    files: list[Path],
    *,
    editable: bool = False,
    cache_root: Path | None = None,
) -> str:
    """Build (or reuse) the overlay wheel; return its file name."""
    check_label(pins.local_label)
    name = target_name(base_wheel, pins)
    epoch = source_date_epoch(base_wheel)
    with ovl.stage("hashed the overlay"):
        key = cache_key(base_wheel, pins, overlay_root, files, editable, epoch)
    cache = (cache_root or ovl.default_cache_dir().parent) / CACHE_SUBDIR
    ovl.ensure_folder(cache, "overlay wheel cache")
    entry = cache / key
    if (entry / name).is_file():
        with ovl.stage(f"reused the cached build {entry / name}"):
            os.utime(entry)  # most recently used: kept by _prune
            place(entry / name, wheel_directory)
        return name
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-") as s:
        stage_dir = Path(s)
        repack(base_wheel, stage_dir, pins, overlay_root, files, editable, epoch)
        try:
            os.replace(stage_dir, entry)
        except OSError:  # a concurrent build got there first: same bytes
            place(stage_dir / name, wheel_directory)
            return name
        stage_dir.mkdir()  # for TemporaryDirectory's clean-up
    place(entry / name, wheel_directory)
    _prune(cache, keep=entry)
    return name


def _prune(cache: Path, keep: Path) -> None:
    """Drop all but the CACHE_KEEP most recently used entries."""
    entries = sorted(
        (p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[CACHE_KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def repack(
    base_wheel: Path,
    dest: Path,
    pins: "ovl.Pins",
    overlay_root: Path,
    files: list[Path],
    editable: bool,
    epoch: str,
) -> Path:
    """Overlay, relabel and pack once; return the wheel in ``dest``.

    Only the members that change (metadata, the version file, the overlaid
    files) are unpacked; the rest streams from the base wheel straight into
    the new one, which saves writing and re-reading the whole tree.
    """
    name = target_name(base_wheel, pins)
    tree_root = overlay_root.parent
    with (
        zipfile.ZipFile(base_wheel) as src,
        tempfile.TemporaryDirectory(prefix="vllm-overlay-") as work,
    ):
        members = {i.filename: i for i in src.infolist() if not i.is_dir()}
        tree = Path(work) / base_wheel.name.split("-")[0]
        dist_info = _dist_info_name(members)
        touched = [f"{dist_info}/METADATA", f"{dist_info}/WHEEL", VERSION_MODULE]
        touched += [rel.as_posix() for rel in files if rel.as_posix() in members]
        for member in touched:
            if member in members:
                _extract(src, members[member], tree)
        if editable:
            dropped = _make_editable(tree, tree_root, files)
        else:
            dropped = set()
            ovl.apply_overlay(tree, tree_root, files, pins.adds)
            _normalise_modes(tree, tree_root, files)
        _check_requires_python(tree / dist_info)
        write_tags(tree / dist_info / "WHEEL", base_wheel.name)
        write_version(tree / VERSION_MODULE, pins)
        write_metadata_version(tree / dist_info / "METADATA", pins.version)
        with ovl.stage(f"packed {name} (SOURCE_DATE_EPOCH={epoch})"):
            _pack(src, members, tree, dist_info, dropped, dest / name, pins, epoch)
    return dest / name


def _dist_info_name(members: dict) -> str:
    found = {
        n.split("/", 1)[0] for n in members if n.split("/", 1)[0].endswith(".dist-info")
    }
    if len(found) != 1:
        raise ovl.OverlayError(f"the base wheel has {len(found)} .dist-info folders")
    return found.pop()


def _extract(src: zipfile.ZipFile, info: zipfile.ZipInfo, tree: Path) -> None:
    """Unpack one member with the mode the archive gives it."""
    target = tree / info.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(src.read(info))
    target.chmod((info.external_attr >> 16) & 0o777 or 0o644)


def _pack(
    src: zipfile.ZipFile,
    members: dict,
    tree: Path,
    dist_info: str,
    dropped: set,
    target: Path,
    pins: "ovl.Pins",
    epoch: str,
) -> None:
    """Write the new wheel: changed files from ``tree``, the rest from ``src``.

    ``wheel``'s WheelFile writes RECORD; files go in sorted order with the
    .dist-info folder last, as ``wheel pack`` does, and all carry one time.
    """
    new_dist_info = f"{pins.name}-{pins.version}.dist-info"
    local = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
    names = (set(members) | local) - dropped - {f"{dist_info}/RECORD"}
    in_dist_info = sorted(n for n in names if n.startswith(f"{dist_info}/"))
    ordered = sorted(set(names) - set(in_dist_info)) + in_dist_info
    date_time = time.gmtime(max(int(epoch), _ZIP_EPOCH))[:6]
    saved = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = epoch  # for the RECORD entry WheelFile adds
    try:
        with WheelFile(target, "w") as out:
            for member in ordered:
                if member in local:
                    path = tree / member
                    data, mode = path.read_bytes(), stat.S_IMODE(path.stat().st_mode)
                else:
                    info = members[member]
                    data, mode = src.read(info), (info.external_attr >> 16) & 0o777
                arcname = member.replace(f"{dist_info}/", f"{new_dist_info}/", 1)
                zinfo = zipfile.ZipInfo(arcname, date_time=date_time)
                zinfo.external_attr = ((mode or 0o644) | stat.S_IFREG) << 16
                zinfo.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(zinfo, data)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    finally:
        if saved is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = saved


def write_metadata_version(metadata: Path, version: str) -> None:
    """Set METADATA's Version, as ``wheel pack --local-version`` does."""
    with metadata.open("rb") as f:
        message = BytesParser(policy=email.policy.compat32).parse(f)
    del message["Version"]
    message["Version"] = version
    with metadata.open("wb") as f:
        BytesGenerator(f, maxheaderlen=0).flatten(message)


def _normalise_modes(tree: Path, source_root: Path, files: Iterable[Path]) -> None:
    """Give overlay files fixed modes: ``wheel pack`` stores what it finds.

    Without this, the umask or checkout would leak into the wheel's bytes.
    """
    for rel in files:
        executable = (source_root / rel).stat().st_mode & stat.S_IXUSR
        (tree / rel).chmod(0o755 if executable else 0o644)


def _make_editable(tree: Path, source_root: Path, files: list[Path]) -> set[str]:
    """Leave the tree's Python files out and add the hook that imports them.

    Other files (data, if the tree ever has any) are copied in: vLLM finds
    those next to its installed modules, so they take effect on reinstall.
    """
    python = [rel for rel in files if rel.suffix == ".py"]
    for rel in python:
        (tree / rel).unlink(missing_ok=True)
    data = [rel for rel in files if rel.suffix != ".py"]
    if data:
        ovl.apply_overlay(tree, source_root, data)
        _normalise_modes(tree, source_root, data)
    finder = tree / f"{EDITABLE_FINDER}.py"
    shutil.copyfile(FINDER_SOURCE, finder)
    finder.chmod(0o644)
    pth = tree / EDITABLE_PTH
    pth.write_text(pth_line(EDITABLE_FINDER, source_root.resolve()))
    pth.chmod(0o644)
    ovl.log(
        f"editable: vllm modules under {source_root} load from there; edit "
        "and restart, no reinstall"
    )
    return {rel.as_posix() for rel in python}


def _check_requires_python(dist_info: Path) -> None:
    """The pinned Python range must be the base wheel's: it is what pip checks."""
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    found = re.search(r"^Requires-Python:\s*(.+?)\s*$", metadata, re.M)
    pinned = ovl.supported_python()
    if found is None:
        return
    try:
        same = SpecifierSet(found.group(1)) == SpecifierSet(pinned)
    except InvalidSpecifier:
        same = False
    if not same:
        raise ovl.OverlayError(
            f"the base wheel requires Python {found.group(1)}, but "
            f'requires-python = "{pinned}" in [tool.{ovl.CONFIG_TABLE}] of '
            "pyproject.toml.\n"
            f'Fix: set requires-python = "{found.group(1)}" there'
        )


def write_tags(wheel_file: Path, base_name: str) -> None:
    """Give the WHEEL file the base file name's tags before packing.

    Upstream's WHEEL says ``linux_x86_64`` while its file name says
    ``manylinux_2_28_x86_64``; ``wheel pack`` names the file after WHEEL, so
    this makes the packed name right without a second compression pass.
    """
    tags = sorted(str(tag) for tag in parse_wheel_filename(base_name)[3])
    lines = wheel_file.read_text(encoding="utf-8").splitlines()
    # Headers only: upstream's file ends with a blank line, after which a
    # Tag line would be body text that ``wheel pack`` does not read.
    kept = [line for line in lines if line.strip() and not line.startswith("Tag:")]
    wheel_file.write_text("\n".join([*kept, *(f"Tag: {t}" for t in tags)]) + "\n")


def write_version(module: Path, pins: "ovl.Pins") -> None:
    """Make ``vllm.__version__`` say what ``pip show vllm`` says.

    The base's ``_version.py`` is generated by vcs-versioning; its version
    gets ``+label`` and its tuple gets the label as the last part, the same
    shape a local version has in vLLM's own builds (collect-env reads it).
    """
    try:
        text = module.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    version_lines = _VERSION_LINE.findall(text)
    tuple_lines = _TUPLE_LINE.findall(text)
    if len(version_lines) != 1 or len(tuple_lines) != 1:
        raise ovl.OverlayError(
            f"cannot set the version in {VERSION_MODULE} of the base wheel: "
            "expected one '__version__ = version = ...' and one "
            "'__version_tuple__ = version_tuple = ...' line.\n"
            "Fix: the base wheel's version file changed format; update "
            "write_version in tools/overlay_repack.py"
        )
    new_tuple = (*ast.literal_eval(tuple_lines[0][1]), pins.local_label)
    text = _VERSION_LINE.sub(lambda m: f"{m.group(1)}{pins.version!r}", text)
    text = _TUPLE_LINE.sub(lambda m: f"{m.group(1)}{new_tuple!r}", text)
    module.write_text(text, encoding="utf-8")
