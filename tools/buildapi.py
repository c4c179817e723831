# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PEP 517 and PEP 660 hooks of the overlay build.

Each hook hands over to its stage module. Every input comes from
pyproject.toml and the environment, like vLLM's own setup.py, except the
variant: ``config_settings`` (``pip install -C flashinfer=0.7.4 .``) picks one
of those declared in ``[tool.vllm-overlay.variants]``. Every hook checks
them first, so a bad one stops the build before anything is fetched or built.
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from . import pack, sdist
from .pins import ConfigSettings, check_python, load_pins
from .util import OverlayError

T = TypeVar("T")


def _run(hook: Callable[[], T], python: bool = True) -> T:
    """Turn an OverlayError into one message and exit status 1.

    pip shows the backend's output when a build fails; a bare message reads
    better there than a traceback. Hooks that need the base wheel check the
    Python version first, before any download.
    """
    try:
        if python:
            check_python()
        return hook()
    except OverlayError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _no_requires(config_settings: ConfigSettings) -> list[str]:
    """Check the settings; the build needs nothing beyond its own requires."""
    load_pins(settings=config_settings)
    return []


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """Everything needed is already in ``build-system.requires``."""
    return _run(lambda: _no_requires(config_settings))


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel with the tree's files in it (tools/pack.py)."""
    return _run(
        lambda: pack.build(
            Path(wheel_directory), pins=load_pins(settings=config_settings)
        )
    )


def get_requires_for_build_editable(
    config_settings: ConfigSettings = None,
) -> list[str]:
    """Same as for a wheel: the editable wheel is built the same way."""
    return _run(lambda: _no_requires(config_settings))


def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel without the tree's Python files, plus the import
    hook that loads them from this working tree (tools/finder.py)."""
    return _run(
        lambda: pack.build(
            Path(wheel_directory),
            pins=load_pins(settings=config_settings),
            editable=True,
        )
    )


def get_requires_for_build_sdist(config_settings: ConfigSettings = None) -> list[str]:
    """The sdist is assembled from the tree alone.

    Settings are checked only when given: without them this hook needs no
    tomllib, as on a Python older than the base wheel's range.
    """
    if not config_settings:
        return []
    return _run(lambda: _no_requires(config_settings), python=False)


def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The tree's files and this build tool (tools/sdist.py)."""
    return _run(
        lambda: sdist.build_sdist(Path(sdist_directory), settings=config_settings),
        python=False,
    )
