# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the build is: ``[tool.vllm-overlay]``, the ``-C`` settings, METADATA.

``tools/base_wheel_METADATA`` is the pinned release's METADATA, byte for
byte, so the build's is known before any download. This module imports on
Python 3.10 (no tomllib), so such a Python is told what to do.
"""

import difflib
import email.parser
import email.policy
import io
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from email.generator import BytesGenerator
from email.message import Message
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: check_python() says so
    tomllib = None  # type: ignore[assignment]

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .util import OverlayError, log

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
BASE_METADATA = "tools/base_wheel_METADATA"  # relative to pyproject.toml
CONFIG_TABLE = "vllm-overlay"
SETTINGS_TABLE = f"[tool.{CONFIG_TABLE}.config-settings]"
DIST_NAME = "vllm"
LOCATION_ENV = "VLLM_PRECOMPILED_WHEEL_LOCATION"
CLI = "python -m tools"
# What a PEP 517 frontend passes for ``-C KEY=VALUE`` (a list if repeated).
ConfigSettings = Mapping[str, str | list[str]] | None
# A local version label that is also valid in a wheel file name (no "-").
_LABEL = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


@dataclass(frozen=True)
class Pins:
    """One upstream release, pinned by hash, the files over it, and the -C."""

    base_version: str
    local_label: str
    sha256: Mapping[str, str]
    replaces: Mapping[str, str] = field(default_factory=dict)
    adds: tuple[str, ...] = ()
    # setting -> value -> {"label": "fi074", "requires": ["name==version"]}
    variants: Mapping[str, Mapping[str, Mapping]] = field(default_factory=dict)
    # The (setting, value) pairs asked for, with -C or recorded by an sdist.
    chosen: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()  # -C settings this build does not know
    recorded: bool = False  # the -C is recorded: this tree is an sdist's
    base_metadata: bytes = b""

    @property
    def requirement(self) -> str:
        return f"{DIST_NAME}=={self.base_version}"

    @property
    def label(self) -> str:
        """The local label with the chosen build's, e.g. ``hisparse3.fi074``."""
        chosen = [self.variants[s][v]["label"] for s, v in self.chosen]
        return ".".join([self.local_label, *chosen])

    @property
    def version(self) -> str:
        return f"{self.base_version}+{self.label}"

    @property
    def declared(self) -> set[str]:
        return {*self.replaces, *self.adds}

    def options(self) -> str:
        offered = [f"-C {s}={v}" for s, values in self.variants.items() for v in values]
        return f"this build takes {', '.join(offered) or 'no -C'}"


def load_pins(pyproject: Path = PYPROJECT, settings: ConfigSettings = None) -> Pins:
    """Read and check ``[tool.vllm-overlay]``; pick the build ``-C`` asks for."""
    try:
        with pyproject.open("rb") as f:
            table = tomllib.load(f)["tool"][CONFIG_TABLE]
        pins = Pins(
            base_version=table["base-version"],
            local_label=table["local-label"],
            sha256=table["sha256"],
            replaces=table.get("replaces", {}),
            adds=tuple(table.get("adds", ())),
            variants=table.get("variants", {}),
            base_metadata=(pyproject.parent / BASE_METADATA).read_bytes(),
        )
        labels = [v["label"] for vs in pins.variants.values() for v in vs.values()]
        problems = [
            f"label {label!r} is not letters and digits, dot-separated"
            for label in [pins.local_label, *labels]
            if not _LABEL.fullmatch(label)
        ]
        problems += [
            f"sha256: {name} is not a {pins.requirement} wheel"
            for name in pins.sha256
            if parse_wheel_filename(name)[:2] != (DIST_NAME, Version(pins.base_version))
        ]
    except (OSError, tomllib.TOMLDecodeError, LookupError, TypeError, ValueError) as e:
        raise OverlayError(f"cannot read the pins in {pyproject}: {e!r}") from None
    if problems:
        raise OverlayError(f"{pyproject}: {'; '.join(problems)}")
    return choose(pins, settings or {}, table.get("config-settings", {}), pyproject)


def choose(
    pins: Pins, settings: Mapping, recorded: Mapping[str, str], source: Path
) -> Pins:
    """The build that ``-C`` and the tree's recorded settings ask for.

    A key the build does not know is ignored, as flit and hatchling do,
    unless it is a near-miss of one it knows; a bad value is refused.
    """
    chosen, ignored = {}, []
    for key, value in settings.items():
        if key not in pins.variants:
            typo = key.lower().replace("_", "-")
            if near := difflib.get_close_matches(typo, pins.variants, 1, 0.75):
                raise OverlayError(
                    f"-C {key} is not a setting of this build; did you mean "
                    f"-C {near[0]}? {pins.options()}"
                )
            ignored.append(f"-C {key}={value}")
        elif not isinstance(value, str):
            raise OverlayError(
                f"-C {key} is given {len(value)} times: {pins.options()}"
            )
        elif value not in pins.variants[key]:
            raise OverlayError(f"-C {key}={value} is not a build: {pins.options()}")
        else:
            chosen[key] = value
    for key, value in recorded.items():  # written by build_sdist, so valid
        if chosen.setdefault(key, value) != value:
            raise OverlayError(
                f"this source tree was made for -C {key}={value} ({SETTINGS_TABLE} "
                f"in {source}), so it cannot build -C {key}={chosen[key]}: make "
                f"the sdist with -C {key}={chosen[key]}, or build from the repository"
            )
    chosen_items = tuple(sorted(chosen.items()))
    return replace(
        pins, chosen=chosen_items, ignored=tuple(ignored), recorded=bool(recorded)
    )


def parse_metadata(data: bytes) -> Message:
    return email.parser.BytesParser(policy=email.policy.compat32).parsebytes(data)


def check_python(version: tuple | None = None) -> None:
    """Stop before any download when this Python cannot run the base wheel."""
    spec = parse_metadata((REPO_ROOT / BASE_METADATA).read_bytes())["Requires-Python"]
    found = ".".join(map(str, (version or sys.version_info)[:3]))
    if spec and found not in SpecifierSet(spec, prereleases=True):
        raise OverlayError(
            f"this vLLM build needs Python {spec} (the base wheel's range), but "
            f"this is Python {found} ({sys.executable}).\nFix: run pip with a "
            "Python in that range, e.g. python3.12 -m pip install ."
        )


def overlay_metadata(pins: Pins) -> bytes:
    """The base wheel's METADATA with this build's Version and requirements.

    Version goes last, as ``wheel pack --local-version`` puts it. A chosen
    build's requirement replaces each line of its project where it stands,
    keeping that line's marker: ``pip check`` and every later resolve go by it.
    """
    message = parse_metadata(pins.base_metadata)
    headers = [(k, v) for k, v in message.items() if k.lower() != "version"]
    headers.append(("Version", pins.version))
    for setting, value in pins.chosen:
        for wanted in map(Requirement, pins.variants[setting][value]["requires"]):
            name, found = canonicalize_name(wanted.name), []
            for i, (key, text) in enumerate(headers):
                old = Requirement(text) if key.lower() == "requires-dist" else None
                if old and canonicalize_name(old.name) == name:
                    found.append(text)
                    new = f"{wanted}; {old.marker}" if old.marker else str(wanted)
                    headers[i] = (key, new)
            if not found:
                raise OverlayError(
                    f"-C {setting}={value}: {pins.requirement} does not require "
                    f"{wanted.name}, so there is nothing to replace.\nFix: remove "
                    "it from the variants in pyproject.toml"
                )
            log(f"-C {setting}={value}: {wanted} in place of {' and '.join(found)}")
    for key in {key for key, _ in message.items()}:
        del message[key]
    for key, text in headers:
        message[key] = text
    out = io.BytesIO()
    BytesGenerator(out, maxheaderlen=0).flatten(message)
    return out.getvalue()
