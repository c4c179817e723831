# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sdist: what a wheel build needs, nothing else.

Frontends such as ``python -m build`` and ``uv build`` build an sdist first
and then a wheel from it, so the sdist carries the tree's ``vllm/`` files,
``pyproject.toml`` (the pins) and this build tool; the wheel build fetches
the base wheel exactly as a build from the repository does. Entries are
sorted and carry fixed owners, modes and ``SOURCE_DATE_EPOCH`` times, so one
tree always gives the same bytes.
"""

import gzip
import io
import stat
import tarfile
from pathlib import Path

from .check import collect_overlay
from .pack import backend_modules
from .pins import REPO_ROOT, Pins, load_pins, supported_python
from .util import source_date_epoch, stage, write_atomic

# Metadata that only the base wheel knows; PEP 643 says to mark it dynamic.
DYNAMIC_FIELDS = [
    "Author",
    "Classifier",
    "Description",
    "Description-Content-Type",
    "License-Expression",
    "License-File",
    "Project-URL",
    "Provides-Extra",
    "Requires-Dist",
    "Summary",
]
# Files at the top of the tree that the sdist carries besides vllm/, tools/.
TOP_FILES = ("pyproject.toml", "README.md")


def sdist_files(root: Path, pins: Pins) -> list[Path]:
    """The tree's files an sdist holds, relative to ``root``, sorted."""
    files = [Path(name) for name in TOP_FILES if (root / name).is_file()]
    files += [path.relative_to(root) for path in backend_modules()]
    files += collect_overlay(root / pins.name)
    return sorted(files, key=lambda rel: rel.as_posix())


def pkg_info(pins: Pins, pyproject: Path) -> bytes:
    """Core metadata for the sdist; what comes from upstream is dynamic."""
    lines = ["Metadata-Version: 2.4", f"Name: {pins.name}", f"Version: {pins.version}"]
    requires_python = supported_python(pyproject)
    if requires_python:
        lines.append(f"Requires-Python: {requires_python}")
    lines += [f"Dynamic: {field}" for field in DYNAMIC_FIELDS]
    return ("\n".join(lines) + "\n").encode()


def _member(name: str, size: int, executable: bool, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = epoch
    info.mode = 0o755 if executable else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_sdist(sdist_directory: Path, root: Path = REPO_ROOT) -> str:
    """Write ``vllm-<version>.tar.gz`` into ``sdist_directory``; return its name."""
    pins = load_pins(root / "pyproject.toml")
    top = f"{pins.name}-{pins.version}"
    name = f"{top}.tar.gz"
    epoch = source_date_epoch() or 0  # the tree holds no trustworthy time
    with stage(f"wrote {name}"):
        raw = io.BytesIO()
        # GzipFile with an empty name and fixed mtime: no build path or
        # build time in the header.
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            meta = pkg_info(pins, root / "pyproject.toml")
            tar.addfile(
                _member(f"{top}/PKG-INFO", len(meta), False, epoch), io.BytesIO(meta)
            )
            for rel in sdist_files(root, pins):
                data = (root / rel).read_bytes()
                executable = bool((root / rel).stat().st_mode & stat.S_IXUSR)
                info = _member(f"{top}/{rel.as_posix()}", len(data), executable, epoch)
                tar.addfile(info, io.BytesIO(data))
        write_atomic(sdist_directory / name, raw.getvalue(), mode=0o644)
    return name
