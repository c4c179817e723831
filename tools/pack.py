# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 4: pack the overlay wheel, fast and reproducibly; and the whole build.

Compressing the few hundred MB of upstream binaries is nearly all of a
build's time, so:

- the target tags and version are written into the few unpacked members
  that change, and everything is packed once (``wheel``'s WheelFile, which
  writes RECORD), streaming the untouched members from the base wheel;
- a built wheel is cached, keyed by everything that decides its bytes, so
  reinstalling an unchanged tree copies a file instead of repacking;
- ``SOURCE_DATE_EPOCH`` (default: the base wheel's own newest timestamp) and
  fixed file modes make two builds of one tree byte-identical.
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
from email.generator import BytesGenerator
from email.parser import BytesParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelFile  # type: ignore[import-untyped]

from .check import check_base_wheel, collect_overlay
from .fetch import default_cache_dir, fetch_base_wheel
from .overlay import apply_editable, apply_overlay
from .pins import (
    CONFIG_TABLE,
    REPO_ROOT,
    Pins,
    Variant,
    load_pins,
    supported_python,
)
from .util import (
    OverlayError,
    ensure_folder,
    log,
    remove_leftovers,
    scratch_folder,
    sha256_of,
    source_date_epoch,
    stage,
)

CACHE_SUBDIR = "overlay-wheels"
# Each entry is a full wheel (a few hundred MB): keep the latest few only.
CACHE_KEEP = 2
VERSION_MODULE = "vllm/_version.py"
_ZIP_EPOCH = 315532800  # 1980-01-01: the earliest time a zip entry can hold
_VERSION_LINE = re.compile(r"^(__version__ = version = ).*$", re.M)
_TUPLE_LINE = re.compile(r"^(__version_tuple__ = version_tuple = )(.*)$", re.M)


def build(
    wheel_directory: Path,
    *,
    pins: Pins | None = None,
    overlay_root: Path | None = None,
    location: str | None = None,
    cache_dir: Path | None = None,
    editable: bool = False,
) -> str:
    """The whole build, stage by stage, with injectable inputs; the PEP 517
    hooks call this. Returns the wheel's file name."""
    started = time.monotonic()
    pins = pins or load_pins()
    overlay_root = overlay_root or REPO_ROOT / pins.name
    cache_dir = cache_dir or default_cache_dir()
    files = collect_overlay(overlay_root)  # fail fast, before a download
    base = fetch_base_wheel(pins, location=location, cache_dir=cache_dir)
    check_base_wheel(pins, overlay_root, files, base, cache_dir)
    name = build_cached(
        base, wheel_directory, pins, overlay_root, files, editable, cache_dir.parent
    )
    log(f"built {name}")
    log(f"done in {time.monotonic() - started:.1f} s")
    return name


def backend_modules() -> list[Path]:
    """This build tool's own files: shipped in the sdist, hashed into the key."""
    return sorted(Path(__file__).parent.glob("*.py"))


def base_epoch(base_wheel: Path) -> str:
    """``$SOURCE_DATE_EPOCH``, else the newest timestamp inside the base wheel.

    The default ties the build's timestamps to the pinned input, not to the
    clock, so rebuilding the same tree anywhere gives the same bytes.
    """
    given = source_date_epoch()
    if given is not None:
        return str(given)
    with zipfile.ZipFile(base_wheel) as zf:
        newest = max(info.date_time for info in zf.infolist())
    return str(calendar.timegm((*newest, 0, 0, 0)))


def cache_key(
    base_wheel: Path,
    pins: Pins,
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
        content = "" if editable and rel.suffix == ".py" else sha256_of(path)
        entries.append([rel.as_posix(), content, bool(path.stat().st_mode & 0o100)])
    backend = hashlib.sha256()
    for path in backend_modules():
        backend.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    facts = {
        "base": [base_wheel.name, pins.sha256[base_wheel.name]],
        "version": pins.version,
        "requires": list(pins.requires),
        "files": entries,
        "editable": str(tree.resolve()) if editable else None,
        "epoch": epoch,
        "backend": backend.hexdigest(),
    }
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def target_name(base_wheel: Path, pins: Pins) -> str:
    """The overlay wheel's file name: the base file name's tags, new version."""
    tags = base_wheel.name.removesuffix(".whl").split("-")[-3:]
    return "-".join([pins.name, pins.version, *tags]) + ".whl"


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
    pins: Pins,
    overlay_root: Path,
    files: list[Path],
    editable: bool,
    cache_root: Path,
) -> str:
    """Build (or reuse) the overlay wheel; return its file name."""
    name = target_name(base_wheel, pins)
    epoch = base_epoch(base_wheel)
    with stage("hashed the overlay"):
        key = cache_key(base_wheel, pins, overlay_root, files, editable, epoch)
    cache = cache_root / CACHE_SUBDIR
    ensure_folder(cache, "overlay wheel cache")
    remove_leftovers(cache)
    entry = cache / key
    if (entry / name).is_file():
        with stage(f"reused the cached build {entry / name}"):
            os.utime(entry)  # most recently used: kept by _prune
            place(entry / name, wheel_directory)
        return name
    with scratch_folder(cache, ".building-") as s:
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
    pins: Pins,
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
    with (
        zipfile.ZipFile(base_wheel) as src,
        tempfile.TemporaryDirectory(dir=dest, prefix=".work-") as work,
    ):
        members = {i.filename: i for i in src.infolist() if not i.is_dir()}
        tree = Path(work) / "tree"
        dist_info = _dist_info_name(members)
        touched = [f"{dist_info}/METADATA", f"{dist_info}/WHEEL", VERSION_MODULE]
        touched += [rel.as_posix() for rel in files if rel.as_posix() in members]
        for member in touched:
            if member in members:
                _extract(src, members[member], tree)
        dropped: set[str] = set()
        if editable:
            dropped = apply_editable(tree, overlay_root.parent, files)
        else:
            apply_overlay(tree, overlay_root.parent, files, pins.adds)
        _check_requires_python(tree / dist_info)
        write_tags(tree / dist_info / "WHEEL", base_wheel.name)
        write_version(tree / VERSION_MODULE, pins)
        write_metadata_version(tree / dist_info / "METADATA", pins.version)
        replace_requirements(tree / dist_info / "METADATA", pins)
        with stage(f"packed {name} (SOURCE_DATE_EPOCH={epoch})"):
            _pack(src, members, tree, dist_info, dropped, dest / name, pins, epoch)
    return dest / name


def _dist_info_name(members: dict) -> str:
    found = {n.split("/", 1)[0] for n in members}
    found = {n for n in found if n.endswith(".dist-info")}
    if len(found) != 1:
        raise OverlayError(f"the base wheel has {len(found)} .dist-info folders")
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
    pins: Pins,
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


def replace_requirements(metadata: Path, pins: Pins) -> None:
    """Give the chosen variants' requirements in place of the base wheel's.

    Each replaces every Requires-Dist of its project where it stands, and
    keeps that line's marker: the installed metadata is what ``pip check``
    and every later resolve go by. The default build leaves METADATA as is.
    """
    if not pins.variants:
        return
    with metadata.open("rb") as f:
        message = BytesParser(policy=email.policy.compat32).parse(f)
    headers = message.items()
    for variant in pins.variants:
        for text in variant.requires:
            headers = _replaced(headers, Requirement(text), variant, pins)
    for key in {key for key, _ in headers}:
        del message[key]
    for key, value in headers:
        message[key] = value
    with metadata.open("wb") as f:
        BytesGenerator(f, maxheaderlen=0).flatten(message)


def _replaced(
    headers: list[tuple[str, str]], wanted: Requirement, variant: Variant, pins: Pins
) -> list[tuple[str, str]]:
    """``headers`` with ``wanted`` in place of the base's lines of its project."""
    name = canonicalize_name(wanted.name)
    result, found = [], []
    for key, value in headers:
        old = _requirement(value) if key.lower() == "requires-dist" else None
        if old is None or canonicalize_name(old.name) != name:
            result.append((key, value))
            continue
        _refuse_pointless(old, wanted, variant, pins)
        found.append(value)
        result.append((key, f"{wanted}; {old.marker}" if old.marker else str(wanted)))
    if not found:
        raise OverlayError(
            f"{variant.option}: {pins.requirement} does not require {wanted.name}, "
            f"so the variant has nothing to replace.\n{_retire(variant)}"
        )
    log(f"{variant.option}: {wanted} in place of {' and '.join(found)}")
    return result


def _requirement(text: str) -> Requirement | None:
    try:
        return Requirement(text)
    except InvalidRequirement:
        return None


def _refuse_pointless(
    old: Requirement, wanted: Requirement, variant: Variant, pins: Pins
) -> None:
    """A base wheel that pins the variant's release or a later one retires it.

    Building the variant there would move the dependency back, not forward.
    """
    pinned, ours = _exact(old.specifier), _exact(wanted.specifier)
    if pinned is None or ours is None or pinned < ours:
        return
    raise OverlayError(
        f"{variant.option}: {pins.requirement} already pins "
        f"{old.name}{old.specifier}, at or above the variant's {wanted}, so "
        f"its default build has that release.\n{_retire(variant)}"
    )


def _retire(variant: Variant) -> str:
    """The fix for a variant that the base wheel has made pointless."""
    return (
        f"Fix: build without {variant.option}, and remove the variant "
        f"{variant.value!r} from {variant.table} in pyproject.toml"
    )


def _exact(specifier: SpecifierSet) -> Version | None:
    """The one release an ``==X`` specifier allows, else None."""
    specs = list(specifier)
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        return None
    return Version(specs[0].version)


def _check_requires_python(dist_info: Path) -> None:
    """The pinned Python range must be the base wheel's: it is what pip checks."""
    metadata = (dist_info / "METADATA").read_text(encoding="utf-8")
    found = re.search(r"^Requires-Python:\s*(.+?)\s*$", metadata, re.M)
    pinned = supported_python()
    if found is None:
        return
    try:
        same = SpecifierSet(found.group(1)) == SpecifierSet(pinned)
    except InvalidSpecifier:
        same = False
    if not same:
        raise OverlayError(
            f"the base wheel requires Python {found.group(1)}, but "
            f'requires-python = "{pinned}" in [tool.{CONFIG_TABLE}] of '
            "pyproject.toml.\n"
            f'Fix: set requires-python = "{found.group(1)}" there'
        )


def write_tags(wheel_file: Path, base_name: str) -> None:
    """Give the WHEEL file the base file name's tags before packing.

    Upstream's WHEEL says ``linux_x86_64`` while its file name says
    ``manylinux_2_28_x86_64``; pip names the installed wheel after WHEEL, so
    this makes the name right without a second compression pass.
    """
    tags = sorted(str(tag) for tag in parse_wheel_filename(base_name)[3])
    lines = wheel_file.read_text(encoding="utf-8").splitlines()
    # Headers only: upstream's file ends with a blank line, after which a
    # Tag line would be body text that nothing reads.
    kept = [line for line in lines if line.strip() and not line.startswith("Tag:")]
    wheel_file.write_text("\n".join([*kept, *(f"Tag: {t}" for t in tags)]) + "\n")


def write_version(module: Path, pins: Pins) -> None:
    """Make ``vllm.__version__`` say what ``pip show vllm`` says.

    The base's ``_version.py`` is generated by vcs-versioning; its version
    gets ``+label`` and its tuple gets the label as the last part, the same
    shape a local version has in vLLM's own builds (collect-env reads it). A
    variant's label is part of it: ``(0, 33, 0, "hisparse2.fi074")``.
    """
    try:
        text = module.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    version_lines = _VERSION_LINE.findall(text)
    tuple_lines = _TUPLE_LINE.findall(text)
    if len(version_lines) != 1 or len(tuple_lines) != 1:
        raise OverlayError(
            f"cannot set the version in {VERSION_MODULE} of the base wheel: "
            "expected one '__version__ = version = ...' and one "
            "'__version_tuple__ = version_tuple = ...' line.\n"
            "Fix: the base wheel's version file changed format; update "
            "write_version in tools/pack.py"
        )
    new_tuple = (*ast.literal_eval(tuple_lines[0][1]), pins.label)
    text = _VERSION_LINE.sub(lambda m: f"{m.group(1)}{pins.version!r}", text)
    text = _TUPLE_LINE.sub(lambda m: f"{m.group(1)}{new_tuple!r}", text)
    module.write_text(text, encoding="utf-8")
