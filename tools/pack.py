# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 3, the tree's files into the base wheel, packed once; and the whole
build in stage order.

Only the members that change are held in memory; the rest is copied from the
base wheel in chunks, each hashed on the way for RECORD. Fixed modes, and
times from ``SOURCE_DATE_EPOCH`` or the base wheel's newest, make builds
reproducible. The wheel is written beside its final name and renamed to it.
"""

import ast
import base64
import calendar
import csv
import hashlib
import io
import re
import stat
import time
import zipfile
from pathlib import Path
from typing import IO

from packaging.utils import parse_wheel_filename

from .check import check_base_wheel, check_tree
from .fetch import fetch_base_wheel
from .pins import DIST_NAME, REPO_ROOT, Pins, overlay_metadata
from .util import OverlayError, replacing, source_date_epoch

VERSION_MODULE = "vllm/_version.py"
_ZIP_EPOCH = 315532800  # 1980-01-01: the earliest time a zip entry can hold
_CHUNK = 1 << 20  # bytes copied at a time: the base wheel holds a 308 MB .so
_VERSION_LINE = re.compile(r"^(__version__ = version = ).*$", re.M)
_TUPLE_LINE = re.compile(r"^(__version_tuple__ = version_tuple = )(.*)$", re.M)


def build(
    wheel_directory: Path,
    *,
    pins: Pins,
    overlay_root: Path | None = None,
    location: str | None = None,
    cache_dir: Path | None = None,
) -> str:
    """The whole build; returns the wheel's file name."""
    tree = (overlay_root or REPO_ROOT / DIST_NAME).parent
    files = check_tree(pins, tree / DIST_NAME)  # before a download
    base = fetch_base_wheel(pins, location=location, cache_dir=cache_dir)
    check_base_wheel(pins, files, base)
    tags = base.name.removesuffix(".whl").split("-")[-3:]
    name = "-".join([DIST_NAME, pins.version, *tags]) + ".whl"
    with zipfile.ZipFile(base) as zf:  # the default time: the base wheel's
        newest = max(info.date_time for info in zf.infolist())
    epoch = str(source_date_epoch() or calendar.timegm((*newest, 0, 0, 0)))
    repack(base, wheel_directory / name, pins, tree, files, epoch)
    return name


def repack(
    base_wheel: Path,
    target: Path,
    pins: Pins,
    tree: Path,
    files: list[Path],
    epoch: str,
) -> None:
    """Overlay, relabel and pack once into ``target``: the members that change
    from memory, the rest copied from the base wheel in chunks, sorted with
    the .dist-info folder last (as ``wheel pack`` does), all with one time,
    and RECORD last, as ``wheel``'s WheelFile writes it."""
    with zipfile.ZipFile(base_wheel) as src:
        members = {i.filename: i for i in src.infolist() if not i.is_dir()}
        dist_info = next(n.split("/")[0] for n in members if ".dist-info/" in n)

        ours = {f.as_posix(): tree / f for f in files}
        changed = {name: path.read_bytes() for name, path in ours.items()}
        wheel_file = f"{dist_info}/WHEEL"
        changed[wheel_file] = with_tags(src.read(wheel_file), base_wheel.name)
        version = src.read(VERSION_MODULE) if VERSION_MODULE in members else b""
        changed[VERSION_MODULE] = with_version(version, pins)
        changed[f"{dist_info}/METADATA"] = overlay_metadata(pins)
        names = (set(members) | set(changed)) - {f"{dist_info}/RECORD"}
        date_time = time.gmtime(max(int(epoch), _ZIP_EPOCH))[:6]
        new_dist_info = f"{DIST_NAME}-{pins.version}.dist-info/"
        last = f"{dist_info}/"

        def entry(member: str, mode: int) -> zipfile.ZipInfo:
            zinfo = zipfile.ZipInfo(member.replace(last, new_dist_info, 1), date_time)
            zinfo.external_attr = ((mode or 0o644) | stat.S_IFREG) << 16
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            return zinfo

        rows = []
        with replacing(target) as part, zipfile.ZipFile(part, "w") as out:
            for member in sorted(names, key=lambda n: (n.startswith(last), n)):
                info = members.get(member)
                mode = (info.external_attr >> 16) & 0o777 if info else 0o644
                if member in ours:  # the umask or checkout must not leak in
                    mode = 0o755 if ours[member].stat().st_mode & 0o100 else 0o644
                zinfo, data = entry(member, mode), changed.get(member)
                if data is None:  # unchanged: copied in chunks, zip64 if large
                    zinfo.file_size = members[member].file_size
                    rows.append(copy_member(src.open(member), out, zinfo))
                else:
                    rows.append(copy_member(io.BytesIO(data), out, zinfo))
            rows.append([f"{new_dist_info}RECORD", "", ""])
            record = io.StringIO()
            csv.writer(record, lineterminator="\n").writerows(rows)
            # The mode wheel's WheelFile gives RECORD.
            out.writestr(entry(f"{last}RECORD", 0o664), record.getvalue())


def copy_member(chunks: IO[bytes], out: zipfile.ZipFile, zinfo: zipfile.ZipInfo):
    """Write one member in chunks; return its RECORD row."""
    digest, size = hashlib.sha256(), 0
    with chunks, out.open(zinfo, "w") as dest:
        while chunk := chunks.read(_CHUNK):
            digest.update(chunk)
            size += dest.write(chunk)
    hashed = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    return [zinfo.filename, f"sha256={hashed}", size]


def with_tags(wheel_file: bytes, base_name: str) -> bytes:
    """The WHEEL file with the base file name's tags.

    Upstream's WHEEL says ``linux_x86_64`` where its file name says
    ``manylinux_2_28_x86_64``; pip names the installed wheel after WHEEL.
    Its blank last line goes: a Tag line after it would be body text.
    """
    tags = sorted(str(tag) for tag in parse_wheel_filename(base_name)[3])
    lines = wheel_file.decode().splitlines()
    kept = [line for line in lines if line.strip() and not line.startswith("Tag:")]
    return "\n".join([*kept, *(f"Tag: {t}" for t in tags), ""]).encode()


def with_version(module: bytes, pins: Pins) -> bytes:
    """The base's ``vllm/_version.py`` saying what ``pip show vllm`` says.

    vcs-versioning's version gets ``+label``, its tuple the label as last
    part, the shape vLLM's own local builds have (collect-env reads it):
    ``(0, 33, 0, "hisparse3")``.
    """
    text = module.decode()
    tuples = _TUPLE_LINE.findall(text)
    if len(_VERSION_LINE.findall(text)) != 1 or len(tuples) != 1:
        raise OverlayError(
            f"the base wheel's {VERSION_MODULE} changed format.\n"
            "Fix: update with_version in tools/pack.py"
        )
    new_tuple = (*ast.literal_eval(tuples[0][1]), pins.local_label)
    text = _VERSION_LINE.sub(lambda m: f"{m.group(1)}{pins.version!r}", text)
    return _TUPLE_LINE.sub(lambda m: f"{m.group(1)}{new_tuple!r}", text).encode()
