# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PEP 517 and PEP 660 hooks, each handing over to its stage module.

Every input comes from pyproject.toml and the environment, except the build
``-C`` picks (``pip install -C flashinfer=0.7.4 .``). The metadata hooks
answer from the tree: ``pip install --dry-run .`` downloads nothing of vLLM.
"""

import functools
import sys
from collections.abc import Callable
from pathlib import Path

from . import pack, sdist
from .pins import DIST_NAME, ConfigSettings, check_python, load_pins, overlay_metadata
from .util import OverlayError


def _hook(function: Callable) -> Callable:
    """Check the Python version first, and print an OverlayError as one
    message with exit status 1: pip shows it better than a traceback."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            check_python()
            return function(*args, **kwargs)
        except OverlayError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return run


@_hook
def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """Nothing beyond ``build-system.requires``; the first hook a frontend
    calls, so the one that warns of each ``-C`` key the build ignores."""
    pins = load_pins(settings=config_settings)
    for ignored in pins.ignored:
        message = f"{ignored} is not a setting of this build, ignored"
        print(f"warning: {message} ({pins.options()})", file=sys.stderr)
    return []


@_hook
def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: ConfigSettings = None
) -> str:
    """The wheel's METADATA, from the tree: nothing is downloaded or packed."""
    pins = load_pins(settings=config_settings)
    dist_info = Path(metadata_directory, f"{DIST_NAME}-{pins.version}.dist-info")
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_bytes(overlay_metadata(pins))
    return dist_info.name


@_hook
def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel with the tree's files in it (tools/pack.py)."""
    pins = load_pins(settings=config_settings)
    return pack.build(Path(wheel_directory), pins=pins)


@_hook
def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel, loading the tree's Python files from the tree."""
    pins = load_pins(settings=config_settings)
    return pack.build(Path(wheel_directory), pins=pins, editable=True)


@_hook
def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The tree's files and this build tool."""
    pins = load_pins(settings=config_settings)
    return sdist.build_sdist(Path(sdist_directory), pins)


get_requires_for_build_editable = get_requires_for_build_wheel
get_requires_for_build_sdist = get_requires_for_build_wheel
prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel
