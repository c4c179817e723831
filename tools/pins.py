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
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: check_python() says so
    tomllib = None  # type: ignore[assignment]

from packaging.requirements import InvalidRequirement, Requirement
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
VARIANTS_KEY = "variants"
SETTINGS_KEY = "config-settings"
SETTINGS_TABLE = f"[tool.{CONFIG_TABLE}.{SETTINGS_KEY}]"
# What a PEP 517 frontend passes for ``-C KEY=VALUE`` (a list if repeated).
ConfigSettings = Mapping[str, str | list[str]] | None
# A setting name and value that are safe as a bare TOML key and inside a
# quoted TOML string, so build_sdist can write them back.
_SETTING_RE = re.compile(r"[a-z][a-z0-9_-]*")
_VALUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")
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
class Variant:
    """This build with other requirements than the base wheel's own.

    Picked with ``-C setting=value``; its label joins the version's local
    label, so ``pip show`` and a bug report tell it from the default build.
    """

    setting: str
    value: str
    label: str
    requires: tuple[str, ...]

    @property
    def option(self) -> str:
        """How a user asks for it, e.g. ``-C flashinfer=0.7.4``."""
        return f"-C {self.setting}={self.value}"

    @property
    def table(self) -> str:
        """Where it is declared, for messages."""
        return f"[tool.{CONFIG_TABLE}.{VARIANTS_KEY}.{self.setting}]"


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
    variants: tuple[Variant, ...] = ()

    @property
    def requirement(self) -> str:
        """The requirement that ``pip download`` resolves to the base wheel."""
        return f"{self.name}=={self.base_version}"

    @property
    def label(self) -> str:
        """The local label with the chosen variants', e.g. ``hisparse2.fi074``."""
        return ".".join([self.local_label, *(v.label for v in self.variants)])

    @property
    def version(self) -> str:
        """The version of the overlay wheel, e.g. ``0.33.0+hisparse2``."""
        return f"{self.base_version}+{self.label}"

    @property
    def requires(self) -> tuple[str, ...]:
        """The chosen variants' requirements, which replace the base wheel's."""
        return tuple(req for variant in self.variants for req in variant.requires)

    @property
    def declared(self) -> set[str]:
        return {*self.replaces, *self.adds}

    def pinned_files(self) -> str:
        """The pinned file names, for error messages that list the choices."""
        return ", ".join(sorted(self.sha256))


def load_pins(pyproject: Path = PYPROJECT, settings: ConfigSettings = None) -> Pins:
    """Read and sanity-check the pins, so a typo fails before any download.

    ``settings`` are the build's config settings (``-C``); with the ones the
    tree records, they choose the variants.
    """
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
    offered = read_variants(table, pyproject)
    recorded = read_recorded_settings(table, pyproject)
    chosen = choose_variants(offered, settings, recorded, pyproject)
    pins = replace(pins, variants=chosen)
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
    problem = label_problem(label)
    if problem is None:
        return
    if _LABEL_RE.fullmatch(label):
        fix = "choose another local-label"
    else:
        fix = 'e.g. local-label = "hisparse2"'
    raise OverlayError(f"{where} {problem}\nFix: {fix}")


def label_problem(label: str) -> str | None:
    """Why ``label`` cannot be (part of) the local version label, if it cannot."""
    if not _LABEL_RE.fullmatch(label):
        return (
            "is not a valid local version label: use letters and digits, "
            "optionally separated by dots ('-' and '_' would make an invalid "
            "wheel file name)."
        )
    lowered = label.lower()
    for text, why in _LABEL_MISREAD:
        if lowered.startswith(text) if text == "g" else text in lowered:
            return f"cannot be used: {why}."
    return None


def read_variants(
    table: Mapping[str, Any], source: Path
) -> dict[str, dict[str, Variant]]:
    """Validate ``[tool.vllm-overlay.variants]``, listing every problem at once.

    Its shape is ``[...variants.SETTING]`` with one entry per accepted value:
    ``"VALUE" = { label = "...", requires = ["name==version", ...] }``.
    """
    declared = table.get(VARIANTS_KEY, {})
    where = f"[tool.{CONFIG_TABLE}.{VARIANTS_KEY}]"
    if not isinstance(declared, Mapping) or not all(
        isinstance(values, Mapping) for values in declared.values()
    ):
        raise OverlayError(
            f"{source}: {where} must hold one table per setting, e.g. "
            f"[tool.{CONFIG_TABLE}.{VARIANTS_KEY}.flashinfer]"
        )
    offered: dict[str, dict[str, Variant]] = {}
    problems = []
    for setting, values in declared.items():
        table_name = f"[tool.{CONFIG_TABLE}.{VARIANTS_KEY}.{setting}]"
        if not _SETTING_RE.fullmatch(setting):
            problems.append(
                f"{table_name}: {setting!r} is not a setting name: use lowercase "
                "letters, digits, '-' and '_'"
            )
            continue
        for value, entry in values.items():
            variant, found = _read_variant(setting, value, entry)
            problems += [f"{table_name}: {value!r}: {p}" for p in found]
            if variant is not None:
                offered.setdefault(setting, {})[value] = variant
        labels = [v.label for v in offered.get(setting, {}).values()]
        problems += [
            f"{table_name}: label {label!r} is given to more than one value"
            for label in sorted({x for x in labels if labels.count(x) > 1})
        ]
    if problems:
        raise OverlayError(
            f"{source}: bad variant declarations:\n"
            + "".join(f"  {problem}\n" for problem in problems)
        )
    return offered


def _read_variant(
    setting: str, value: str, entry: object
) -> tuple[Variant | None, list[str]]:
    """One declared variant, or what is wrong with it."""
    if not _VALUE_RE.fullmatch(value):
        why = "is not a value -C can give: use letters, digits and . + ! _ -"
        return None, [f"{why} (e.g. a release number)"]
    if not isinstance(entry, Mapping) or set(entry) != {"label", "requires"}:
        shape = '{ label = "...", requires = ["name==version", ...] }'
        return None, [f"must be {shape}, with these two keys only"]
    problems = []
    label, requires = entry["label"], entry["requires"]
    problem = label_problem(label) if isinstance(label, str) else "is not a string."
    if problem is not None:
        problems.append(f"label = {label!r} {problem}")
    if not isinstance(requires, list) or not requires:
        return None, [*problems, "requires must be a list of requirements"]
    names = []
    for text in requires:
        try:
            requirement = Requirement(str(text))
        except InvalidRequirement as err:
            why = str(err).splitlines()[0]
            problems.append(f"requires: {text!r} is not a requirement ({why})")
            continue
        name = canonicalize_name(requirement.name)
        names.append(name)
        if requirement.marker is not None:
            problems.append(
                f"requires: {text!r} has a marker; give none: the base wheel's "
                "line keeps its own"
            )
        if name == canonicalize_name(DIST_NAME):
            problems.append(f"requires: {text!r} names {DIST_NAME} itself")
    problems += [
        f"requires: {name} is listed twice"
        for name in sorted({n for n in names if names.count(n) > 1})
    ]
    if problems:
        return None, problems
    return Variant(setting, value, label, tuple(map(str, requires))), []


def read_recorded_settings(table: Mapping[str, Any], source: Path) -> dict[str, str]:
    """The config settings a tree always builds with (an sdist made with -C)."""
    recorded = table.get(SETTINGS_KEY, {})
    if not isinstance(recorded, Mapping) or not all(
        isinstance(value, str) for value in recorded.values()
    ):
        raise OverlayError(
            f"{source}: {SETTINGS_TABLE} must map setting names to strings, "
            'e.g. flashinfer = "0.7.4"'
        )
    return dict(recorded)


def choose_variants(
    offered: Mapping[str, Mapping[str, Variant]],
    settings: ConfigSettings,
    recorded: Mapping[str, str],
    source: Path,
) -> tuple[Variant, ...]:
    """The variants that ``-C`` and the tree's recorded settings ask for.

    Anything else is refused in one line that lists what is accepted, before
    any hook does work.
    """
    options = [v.option for values in offered.values() for v in values.values()]
    accepted = (
        f"this build accepts {', '.join(options)}, or no -C for the build on "
        "the base wheel's own pins"
        if options
        else "this build takes no -C settings"
    )
    chosen: dict[str, str] = {}
    for key, given in (settings or {}).items():
        if not isinstance(given, str):
            raise OverlayError(
                f"-C {key} is given {len(given)} times ({', '.join(given)}); "
                f"give it once: {accepted}"
            )
        if key not in offered:
            raise OverlayError(
                f"-C {key}={given} is not a setting of this build: {accepted}"
            )
        if given not in offered[key]:
            raise OverlayError(
                f"-C {key}={given} is not a variant of this build: {accepted}"
            )
        chosen[key] = given
    for key, value in recorded.items():
        if value not in offered.get(key, {}):
            raise OverlayError(
                f"{SETTINGS_TABLE} in {source} records {key} = {value!r}, which "
                f"is not a variant of this build: {accepted}"
            )
        if chosen.setdefault(key, value) != value:
            raise OverlayError(
                f"this source tree was made for -C {key}={value} "
                f"({SETTINGS_TABLE} in {source}), so it cannot build "
                f"-C {key}={chosen[key]}: make the sdist with -C "
                f"{key}={chosen[key]}, or build from the repository"
            )
    return tuple(offered[key][chosen[key]] for key in sorted(chosen))


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
