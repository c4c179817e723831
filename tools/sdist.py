# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sdist: what a wheel build needs, nothing else.

Frontends such as ``python -m build`` and ``uv build`` build an sdist first
and then a wheel from it, so the sdist carries the tree's ``vllm/`` files,
``pyproject.toml`` (the pins) and this build tool; the wheel build fetches
the base wheel exactly as a build from the repository does. Entries are
sorted and carry fixed owners, modes and ``SOURCE_DATE_EPOCH`` times, so one
tree always gives the same bytes.

An sdist made with ``-C`` (a variant) records the choice in the
``pyproject.toml`` it carries, so that every wheel built from it, by a pip
that is given no ``-C``, is the variant its file name and PKG-INFO say.
"""

import gzip
import io
import stat
import tarfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: load_pins cannot run either
    tomllib = None  # type: ignore[assignment]

from .check import collect_overlay
from .pack import backend_modules
from .pins import (
    CONFIG_TABLE,
    REPO_ROOT,
    SETTINGS_KEY,
    SETTINGS_TABLE,
    ConfigSettings,
    Pins,
    load_pins,
    read_recorded_settings,
    supported_python,
)
from .util import OverlayError, source_date_epoch, stage, write_atomic

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


def carried_pyproject(pins: Pins, pyproject: Path) -> bytes:
    """``pyproject.toml`` as the sdist carries it: with the chosen variants.

    Without ``-C`` it is the tree's file as it is.
    """
    data = pyproject.read_bytes()
    chosen = {v.setting: v.value for v in pins.variants}
    table = tomllib.loads(data.decode("utf-8"))["tool"][CONFIG_TABLE]
    recorded = read_recorded_settings(table, pyproject)
    if chosen == recorded:
        return data
    if recorded:
        raise OverlayError(
            f"{pyproject} already records {recorded} in {SETTINGS_TABLE}, so "
            f"this sdist cannot record {chosen} as well.\nFix: set them all "
            "in that table and build the sdist without -C"
        )
    options = " ".join(v.option for v in pins.variants)
    lines = [
        "",
        f"# Recorded by the sdist build for `{options}`: every wheel built",
        "# from this sdist is that variant.",
        f"[tool.{CONFIG_TABLE}.{SETTINGS_KEY}]",
        *(f'{key} = "{value}"' for key, value in sorted(chosen.items())),
    ]
    text = data.decode("utf-8").rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    table = tomllib.loads(text)["tool"][CONFIG_TABLE]
    assert read_recorded_settings(table, pyproject) == chosen
    return text.encode("utf-8")


def _member(name: str, size: int, executable: bool, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = epoch
    info.mode = 0o755 if executable else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_sdist(
    sdist_directory: Path, root: Path = REPO_ROOT, settings: ConfigSettings = None
) -> str:
    """Write ``vllm-<version>.tar.gz`` into ``sdist_directory``; return its name.

    ``settings`` (``-C``) choose a variant, which the name and PKG-INFO carry.
    """
    pins = load_pins(root / "pyproject.toml", settings)
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
                if rel == Path("pyproject.toml"):
                    data = carried_pyproject(pins, root / rel)
                else:
                    data = (root / rel).read_bytes()
                executable = bool((root / rel).stat().st_mode & stat.S_IXUSR)
                info = _member(f"{top}/{rel.as_posix()}", len(data), executable, epoch)
                tar.addfile(info, io.BytesIO(data))
        write_atomic(sdist_directory / name, raw.getvalue(), mode=0o644)
    return name
