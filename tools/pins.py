# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the build is: ``[tool.vllm-overlay]``, and the METADATA it gives pip.

``tools/base_wheel_METADATA`` is the pinned release's METADATA, byte for
byte, so the build's is known before any download, and pip refuses a Python
outside its Requires-Python. This module imports on Python 3.10 (no
tomllib), so such a Python is told what to do.
"""

import email.parser
import email.policy
import io
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.generator import BytesGenerator
from email.message import Message
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11: load_pins says so
    tomllib = None  # type: ignore[assignment]

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .util import OverlayError, log

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
BASE_METADATA = "tools/base_wheel_METADATA"  # relative to pyproject.toml
CONFIG_TABLE = "vllm-overlay"
KEYS = {"base-version", "local-label", "sha256", "replaces", "adds", "requires"}
DIST_NAME = "vllm"
LOCATION_ENV = "VLLM_PRECOMPILED_WHEEL_LOCATION"
CLI = "python -m tools"
# A local version label that is also valid in a wheel file name (no "-").
_LABEL = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


@dataclass(frozen=True)
class Pins:
    """One upstream release, pinned by hash, and the files over it."""

    base_version: str
    local_label: str
    sha256: Mapping[str, str]
    replaces: Mapping[str, str] = field(default_factory=dict)
    adds: tuple[str, ...] = ()
    # Each replaces the base METADATA's Requires-Dist of the same project.
    requires: tuple[Requirement, ...] = ()
    base_metadata: bytes = b""

    @property
    def requirement(self) -> str:
        return f"{DIST_NAME}=={self.base_version}"

    @property
    def version(self) -> str:
        return f"{self.base_version}+{self.local_label}"

    @property
    def declared(self) -> set[str]:
        return {*self.replaces, *self.adds}


def load_pins(pyproject: Path = PYPROJECT) -> Pins:
    """Read and check ``[tool.vllm-overlay]``."""
    if tomllib is None:  # before pip has a Requires-Python to refuse
        raise OverlayError(
            f"this vLLM build needs Python 3.11 or newer, but this is Python "
            f"{sys.version.split()[0]} ({sys.executable}).\nFix: run pip with a "
            "newer Python, e.g. python3.12 -m pip install ."
        )
    try:
        with pyproject.open("rb") as f:
            table = tomllib.load(f)["tool"][CONFIG_TABLE]
        pins = Pins(
            base_version=table["base-version"],
            local_label=table["local-label"],
            sha256=table["sha256"],
            replaces=table.get("replaces", {}),
            adds=tuple(table.get("adds", ())),
            requires=tuple(map(Requirement, table.get("requires", ()))),
            base_metadata=(pyproject.parent / BASE_METADATA).read_bytes(),
        )
        problems = [f"unknown key {key!r}" for key in sorted(set(table) - KEYS)]
        if not _LABEL.fullmatch(pins.local_label):
            problems.append(f"label {pins.local_label!r} is not letters and digits")
        problems += [
            f"sha256: {name} is not a {pins.requirement} wheel"
            for name in pins.sha256
            if parse_wheel_filename(name)[:2] != (DIST_NAME, Version(pins.base_version))
        ]
        problems += [f"requires: {r} has a marker" for r in pins.requires if r.marker]
    except (OSError, tomllib.TOMLDecodeError, LookupError, TypeError, ValueError) as e:
        raise OverlayError(f"cannot read the pins in {pyproject}: {e!r}") from None
    if problems:
        raise OverlayError(f"{pyproject}: {'; '.join(problems)}")
    return pins


def parse_metadata(data: bytes) -> Message:
    return email.parser.BytesParser(policy=email.policy.compat32).parsebytes(data)


def overlay_metadata(pins: Pins) -> bytes:
    """The base wheel's METADATA with this build's Version and requirements.

    Version goes last, as ``wheel pack --local-version`` puts it. Each of
    ``requires`` replaces the line of its project where it stands, keeping
    that line's marker: ``pip check`` and every later resolve go by it.
    """
    message = parse_metadata(pins.base_metadata)
    headers = [(k, v) for k, v in message.items() if k.lower() != "version"]
    headers.append(("Version", pins.version))
    for wanted in pins.requires:
        name, found = canonicalize_name(wanted.name), []
        for i, (key, text) in enumerate(headers):
            old = Requirement(text) if key.lower() == "requires-dist" else None
            if old and canonicalize_name(old.name) == name:
                found.append(text)
                new = f"{wanted}; {old.marker}" if old.marker else str(wanted)
                headers[i] = (key, new)
        if not found:
            raise OverlayError(
                f"{wanted} in [tool.{CONFIG_TABLE}] requires overrides nothing: "
                f"{pins.requirement} does not require {wanted.name}. Fix: remove it"
            )
        log(f"{wanted} in place of {' and '.join(found)}")
    for key in {key for key, _ in message.items()}:
        del message[key]
    for key, text in headers:
        message[key] = text
    out = io.BytesIO()
    BytesGenerator(out, maxheaderlen=0).flatten(message)
    return out.getvalue()
