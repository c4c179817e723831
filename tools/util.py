# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bottom layer: the error type, logging, hashing, files and time."""

import contextlib
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


class OverlayError(Exception):
    """A build problem the user can fix; the message says how."""


def log(message: str) -> None:
    """One progress line on stderr; pip shows these with ``-v``."""
    print(f"vllm-overlay: {message}", file=sys.stderr, flush=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: Path) -> str:
    """Hash a file in chunks: the real base wheel is a few hundred MB."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_folder(path: Path) -> Path:
    """Create a cache folder, or say what to change."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OverlayError(
            f"cannot use {path} as the build's cache: {err.strerror or err}.\n"
            "Fix: set VLLM_CACHE_ROOT to a folder you can write to"
        ) from None
    return path


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A file beside ``target`` to write, renamed to it once the block ends
    without error: an interrupted write leaves nothing under its name."""
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        yield part
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)


def source_date_epoch() -> int | None:
    """``$SOURCE_DATE_EPOCH`` if set: reproducible builds take their time from it."""
    given = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if given and not given.isdigit():
        raise OverlayError(
            f"SOURCE_DATE_EPOCH={given!r} is not a whole number of seconds.\n"
            "Fix: unset it, or set it to e.g. $(git log -1 --format=%ct)"
        )
    return int(given) if given else None
