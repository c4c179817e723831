# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the overlay is built on, read from ``[tool.vllm-overlay]``.

``pyproject.toml`` pins the upstream release (its version and the sha256 of
each platform's wheel) and declares every file under ``vllm/``: each file
that replaces an upstream one, pinned to the sha256 of the upstream original
it was written against, and each file upstream does not ship. Everything is
checked here, so a typo fails before any download.

This module must import on Python 3.10 too (no tomllib), so that a Python
outside the supported range gets a message instead of a traceback.
"""

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: check_python() says so
    tomllib = None  # type: ignore[assignment]

from packaging.specifiers import SpecifierSet
from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from .util import OverlayError

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
CONFIG_TABLE = "vllm-overlay"
DIST_NAME = "vllm"
LOCATION_ENV = "VLLM_PRECOMPILED_WHEEL_LOCATION"
CLI = "python -m tools"
REPLACES_TABLE = f"[tool.{CONFIG_TABLE}.replaces]"
ADDS_KEY = f"adds in [tool.{CONFIG_TABLE}]"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Paths that need no quoting in a git patch header.
_PATH_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+")
# A PEP 440 local label that is also valid in a wheel file name (no "-").
_LABEL_RE = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*", re.I)
_REQUIRES_PYTHON_RE = re.compile(r'^requires-python\s*=\s*"([^"]*)"', re.M)
# Local labels that vLLM 0.33.0 reads as something else.
_LABEL_MISREAD = (
    ("cpu", "vllm/platforms picks the CPU platform when 'cpu' is in the version"),
    ("g", "vllm collect-env reads a last version part starting with 'g' as a git sha"),
)


@dataclass(frozen=True)
class Pins:
    """One upstream release, pinned by hash, and the files declared over it."""

    base_version: str
    local_label: str
    sha256: Mapping[str, str]
    name: str = DIST_NAME
    replaces: Mapping[str, str] = field(default_factory=dict)
    adds: tuple[str, ...] = ()
    # Tables that name tree constants coupled to upstream (check.py reads them).
    env_choices: Mapping[str, str] = field(default_factory=dict)
    known_issues: Mapping[str, str] = field(default_factory=dict)

    @property
    def requirement(self) -> str:
        """The requirement that ``pip download`` resolves to the base wheel."""
        return f"{self.name}=={self.base_version}"

    @property
    def version(self) -> str:
        """The version of the overlay wheel, e.g. ``0.33.0+hisparse1``."""
        return f"{self.base_version}+{self.local_label}"

    @property
    def declared(self) -> set[str]:
        return {*self.replaces, *self.adds}

    def pinned_files(self) -> str:
        """The pinned file names, for error messages that list the choices."""
        return ", ".join(sorted(self.sha256))


def load_pins(pyproject: Path = PYPROJECT) -> Pins:
    """Read and sanity-check the pins, so a typo fails before any download."""
    try:
        with pyproject.open("rb") as f:
            table = tomllib.load(f)["tool"][CONFIG_TABLE]
        replaces, adds = read_declarations(table, pyproject)
        pins = Pins(
            base_version=str(table["base-version"]),
            local_label=str(table["local-label"]),
            sha256=dict(table["sha256"]),
            replaces=replaces,
            adds=adds,
            env_choices=dict(table.get("env-choices", {})),
            known_issues=dict(table.get("known-issues", {})),
        )
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise OverlayError(
            f"cannot read [tool.{CONFIG_TABLE}] (base-version, local-label, "
            f"sha256) from {pyproject}: {err!r}"
        ) from None
    check_label(pins.local_label, pyproject)
    try:
        Version(pins.version)
    except InvalidVersion:
        raise OverlayError(f"{pyproject}: invalid version {pins.version!r}") from None
    if not pins.sha256:
        raise OverlayError(f"{pyproject}: [tool.{CONFIG_TABLE}.sha256] is empty")
    for filename, digest in pins.sha256.items():
        if wheel_name_version(filename) != (
            canonicalize_name(pins.name),
            Version(pins.base_version),
        ):
            raise OverlayError(
                f"{pyproject}: pinned file {filename!r} is not a "
                f"{pins.requirement} wheel"
            )
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            raise OverlayError(
                f"{pyproject}: sha256 of {filename} must be 64 lowercase hex digits"
            )
    return pins


def check_label(label: str, source: Path = PYPROJECT) -> None:
    """Refuse a local-label that makes a bad wheel name or that vLLM misreads."""
    where = f"local-label = {label!r} in [tool.{CONFIG_TABLE}] of {source}"
    if not _LABEL_RE.fullmatch(label):
        raise OverlayError(
            f"{where} is not a valid local version label: use letters and "
            "digits, optionally separated by dots ('-' and '_' would make an "
            'invalid wheel file name).\nFix: e.g. local-label = "hisparse1"'
        )
    lowered = label.lower()
    for text, why in _LABEL_MISREAD:
        if lowered.startswith(text) if text == "g" else text in lowered:
            raise OverlayError(
                f"{where} cannot be used: {why}.\nFix: choose another local-label"
            )


def read_declarations(
    table: Mapping[str, Any], source: Path, name: str = DIST_NAME
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Validate ``replaces`` and ``adds``, listing every problem at once."""
    replaces = table.get("replaces", {})
    adds = table.get("adds", [])
    if not isinstance(replaces, Mapping):
        raise OverlayError(f"{source}: {REPLACES_TABLE} must be a table")
    if not isinstance(adds, list):
        raise OverlayError(f"{source}: {ADDS_KEY} must be a list of paths")
    problems = []
    for path, digest in replaces.items():
        if not _is_overlay_path(path, name):
            problems.append(f"{REPLACES_TABLE}: {path!r} is not a path under {name}/")
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            problems.append(
                f"{REPLACES_TABLE}: the pin of {path} must be the upstream "
                "original's sha256, 64 lowercase hex digits"
            )
    for path in adds:
        if not _is_overlay_path(path, name):
            problems.append(f"{ADDS_KEY}: {path!r} is not a path under {name}/")
    listed = [p for p in adds if isinstance(p, str)]
    problems += [
        f"{ADDS_KEY}: {p} is listed twice"
        for p in sorted({p for p in listed if listed.count(p) > 1})
    ]
    problems += [
        f"{p} is both in {REPLACES_TABLE} and in {ADDS_KEY}; a file either "
        "replaces an upstream file or is new"
        for p in sorted(set(replaces) & set(listed))
    ]
    if problems:
        raise OverlayError(
            f"{source}: bad overlay declarations:\n"
            + "".join(f"  {problem}\n" for problem in problems)
        )
    return dict(replaces), tuple(adds)


def _is_overlay_path(path: object, name: str) -> bool:
    """A normalized relative POSIX path inside the package, safe in a patch."""
    if not isinstance(path, str) or not _PATH_RE.fullmatch(path):
        return False
    parts = PurePosixPath(path).parts
    return parts[0] == name and not {".", ".."} & set(parts)


def supported_python(pyproject: Path = PYPROJECT) -> str:
    """The Python range of the pinned base wheel, read even without tomllib."""
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
    if not spec or (
        tomllib is not None and found in SpecifierSet(spec, prereleases=True)
    ):
        return
    raise OverlayError(
        f"this vLLM build needs Python {spec} (the pinned base wheel's "
        f"range; requires-python in [tool.{CONFIG_TABLE}] of "
        f"pyproject.toml), but this is Python {found} ({sys.executable}).\n"
        "Fix: run pip with a Python in that range, e.g. python3.12 -m pip "
        "install ."
    )


def wheel_name_version(filename: str) -> tuple[str, Version] | None:
    """Name and version from a wheel file name, or None if it is not one."""
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return name, version


def cache_root() -> Path:
    """vLLM's own cache root, where the build keeps its wheels."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        root = os.path.join(xdg, "vllm")
    return Path(root).expanduser()
