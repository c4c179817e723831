# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PEP 517 hooks, each handing over to its stage module.

Every input comes from pyproject.toml and the environment; ``-C`` settings
are ignored. The metadata hook answers from the tree: ``pip install
--dry-run .`` downloads nothing.
"""

import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from . import pack, sdist
from .pins import DIST_NAME, load_pins, overlay_metadata
from .util import OverlayError

# What a PEP 517 frontend passes for ``-C KEY=VALUE``.
ConfigSettings = Mapping[str, str | list[str]] | None


def _hook(function: Callable) -> Callable:
    """Print an OverlayError as one message with exit status 1: pip shows it
    better than a traceback."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except OverlayError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return run


@_hook
def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: ConfigSettings = None
) -> str:
    """The wheel's METADATA, from the tree: nothing is downloaded or packed."""
    pins = load_pins()
    metadata = overlay_metadata(pins)
    dist_info = Path(metadata_directory, f"{DIST_NAME}-{pins.version}.dist-info")
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_bytes(metadata)
    return dist_info.name


@_hook
def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel with the tree's files in it (tools/pack.py)."""
    return pack.build(Path(wheel_directory), pins=load_pins())


@_hook
def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The tree's files and this build tool."""
    return sdist.build_sdist(Path(sdist_directory), load_pins())
