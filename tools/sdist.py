# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sdist: ``vllm/``, the pins, this build tool and the LICENSE, with
the wheel's METADATA as PKG-INFO; reproducible.
"""

import gzip
import io
import tarfile
from pathlib import Path

from .check import check_tree
from .pins import DIST_NAME, REPO_ROOT, Pins, overlay_metadata
from .util import replacing, source_date_epoch


def sdist_files(root: Path, pins: Pins) -> list[Path]:
    """The files an sdist holds, relative to ``root``, sorted."""
    top = [Path(name) for name in ("LICENSE", "README.md", "pyproject.toml")]
    files = [rel for rel in top if (root / rel).is_file()]
    tools = Path(__file__).parent  # this build tool
    files += [p.relative_to(root) for p in tools.iterdir() if p.is_file()]
    files += check_tree(pins, root / DIST_NAME)
    return sorted(files, key=lambda rel: rel.as_posix())


def build_sdist(sdist_directory: Path, pins: Pins, root: Path = REPO_ROOT) -> str:
    """Write ``vllm-<version>.tar.gz`` into ``sdist_directory``; return its name."""
    top = f"{DIST_NAME}-{pins.version}"
    epoch = source_date_epoch() or 0  # the tree holds no trustworthy time
    entries = {Path("PKG-INFO"): overlay_metadata(pins)}
    for rel in sdist_files(root, pins):
        entries[rel] = (root / rel).read_bytes()
    raw = io.BytesIO()
    with (  # no file name and a fixed time in the gzip header
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel, data in entries.items():
            info = tarfile.TarInfo(f"{top}/{rel.as_posix()}")
            info.size, info.mtime = len(data), epoch  # owner: root, "", as TarInfo's
            if rel.name != "PKG-INFO" and (root / rel).stat().st_mode & 0o100:
                info.mode = 0o755
            tar.addfile(info, io.BytesIO(data))
    with replacing(sdist_directory / f"{top}.tar.gz") as part:
        part.write_bytes(raw.getvalue())
    return f"{top}.tar.gz"
