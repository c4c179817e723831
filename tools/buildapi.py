# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The PEP 517 and PEP 660 hooks of the overlay build.

Each hook hands over to its stage module. ``config_settings`` is accepted and
ignored: every input comes from pyproject.toml and the environment, like
vLLM's own setup.py.
"""

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from . import pack, sdist
from .pins import check_python
from .util import OverlayError

T = TypeVar("T")
ConfigSettings = Mapping[str, str | list[str]] | None


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


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """Everything needed is already in ``build-system.requires``."""
    return _run(list)


def build_wheel(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel with the tree's files in it (tools/pack.py)."""
    return _run(lambda: pack.build(Path(wheel_directory)))


def get_requires_for_build_editable(
    config_settings: ConfigSettings = None,
) -> list[str]:
    """Same as for a wheel: the editable wheel is built the same way."""
    return _run(list)


def build_editable(
    wheel_directory: str,
    config_settings: ConfigSettings = None,
    metadata_directory: str | None = None,
) -> str:
    """The upstream wheel without the tree's Python files, plus the import
    hook that loads them from this working tree (tools/finder.py)."""
    return _run(lambda: pack.build(Path(wheel_directory), editable=True))


def get_requires_for_build_sdist(config_settings: ConfigSettings = None) -> list[str]:
    """The sdist is assembled from the tree alone."""
    return []


def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The tree's files and this build tool (tools/sdist.py)."""
    return _run(lambda: sdist.build_sdist(Path(sdist_directory)), python=False)
