# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sdist of the precompiled overlay: what a wheel build needs, nothing else.

Part of the precompiled_overlay build backend (tools/ is its backend-path).
Frontends such as ``python -m build`` and ``uv build`` build an sdist first
and then a wheel from it, so the sdist carries the tree's ``vllm/`` files,
``pyproject.toml`` (the pins) and this backend; the wheel build fetches the
base wheel exactly as a build from the repository does. Entries are sorted
and carry fixed owners, modes and ``SOURCE_DATE_EPOCH`` times, so one tree
always gives the same bytes.
"""

import gzip
import io
import os
import stat
import tarfile
import tempfile
from pathlib import Path

import precompiled_overlay as ovl

# Metadata that only the base wheel knows; PEP 643 says to mark it dynamic.
DYNAMIC_FIELDS = (
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
)
# Files at the top of the tree that the sdist carries besides vllm/, tools/.
TOP_FILES = ("pyproject.toml", "README.md")


def sdist_files(root: Path, pins: "ovl.Pins") -> list[Path]:
    """The tree's files an sdist holds, relative to ``root``, sorted."""
    files = [Path(name) for name in TOP_FILES if (root / name).is_file()]
    files += [path.relative_to(root) for path in ovl.backend_modules()]
    files += ovl.collect_overlay(root / pins.name)
    return sorted(files, key=lambda rel: rel.as_posix())


def pkg_info(pins: "ovl.Pins", pyproject: Path) -> bytes:
    """Core metadata for the sdist; what comes from upstream is dynamic."""
    lines = [
        "Metadata-Version: 2.4",
        f"Name: {pins.name}",
        f"Version: {pins.version}",
    ]
    requires_python = ovl.supported_python(pyproject)
    if requires_python:
        lines.append(f"Requires-Python: {requires_python}")
    lines += [f"Dynamic: {field}" for field in DYNAMIC_FIELDS]
    return ("\n".join(lines) + "\n").encode()


def _epoch() -> int:
    """``$SOURCE_DATE_EPOCH``, else 0: the tree holds no trustworthy time."""
    given = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if given and not given.isdigit():
        raise ovl.OverlayError(
            f"SOURCE_DATE_EPOCH={given!r} is not a whole number of seconds.\n"
            "Fix: unset it, or set it to e.g. $(git log -1 --format=%ct)"
        )
    return int(given or 0)


def _member(name: str, size: int, executable: bool, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = epoch
    info.mode = 0o755 if executable else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_sdist(sdist_directory: Path, root: Path | None = None) -> str:
    """Write ``vllm-<version>.tar.gz`` into ``sdist_directory``; return its name."""
    root = root or ovl.REPO_ROOT
    pins = ovl.load_pins(root / "pyproject.toml")
    top = f"{pins.name}-{pins.version}"
    name = f"{top}.tar.gz"
    epoch = _epoch()
    with ovl.stage(f"wrote {name}"):
        raw = io.BytesIO()
        # GzipFile with an empty name and fixed mtime: no build path or
        # build time in the header.
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            meta = pkg_info(pins, root / "pyproject.toml")
            info = _member(f"{top}/PKG-INFO", len(meta), False, epoch)
            tar.addfile(info, io.BytesIO(meta))
            for rel in sdist_files(root, pins):
                data = (root / rel).read_bytes()
                executable = bool((root / rel).stat().st_mode & stat.S_IXUSR)
                info = _member(f"{top}/{rel.as_posix()}", len(data), executable, epoch)
                tar.addfile(info, io.BytesIO(data))
        fd, tmp = tempfile.mkstemp(dir=sdist_directory, prefix=".sdist-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw.getvalue())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 is not what a dist/ file has
            os.replace(tmp, sdist_directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return name
