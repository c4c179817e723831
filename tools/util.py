# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bottom layer: the error type, logging and file helpers every stage uses."""

import contextlib
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Scratch folders in the caches carry the host and pid of their builder, so
# the next build can tell a dead build's leftovers from a running one's.
SCRATCH_PREFIXES = (".building-", ".download-")


class OverlayError(Exception):
    """A build problem the user can fix; the message says how."""


def log(message: str) -> None:
    """One progress line on stderr; pip shows these with ``-v``."""
    print(f"vllm-overlay: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Log a finished stage with its duration, so slow steps are visible."""
    started = time.monotonic()
    yield
    log(f"{what} ({time.monotonic() - started:.1f} s)")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: Path) -> str:
    """Hash a file in chunks: the real base wheel is a few hundred MB."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_atomic(target: Path, data: bytes, mode: int | None = None) -> None:
    """Write by rename, keeping an old file's mode: never a half file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is None:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_folder(path: Path, what: str) -> None:
    """Create a cache folder, or say which path is in the way (no traceback)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.is_file()), path)
        raise OverlayError(
            f"cannot use {path} as the {what}: {blocker} is a file, not a "
            "folder.\nFix: set VLLM_CACHE_ROOT to a folder (now: "
            f"{os.environ.get('VLLM_CACHE_ROOT') or 'unset'}), or move "
            f"{blocker} away"
        ) from None
    except PermissionError as err:
        raise OverlayError(
            f"cannot create the {what} {path}: {err.strerror}.\n"
            "Fix: set VLLM_CACHE_ROOT to a folder you can write to"
        ) from None


def scratch_folder(parent: Path, prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder in a cache, named so a later build can reap it.

    A build killed by a signal (a CI timeout sends SIGTERM) never runs its
    clean-up; ``remove_leftovers`` in the next build does it instead.
    """
    owner = f"{prefix}{socket.gethostname()}-{os.getpid()}-"
    return tempfile.TemporaryDirectory(dir=parent, prefix=owner)


def remove_leftovers(parent: Path) -> None:
    """Delete scratch folders whose builder on this host is no longer running."""
    host = socket.gethostname()
    for path in parent.glob(".*-*"):
        for prefix in SCRATCH_PREFIXES:
            owner = path.name.removeprefix(prefix)
            if owner == path.name or not owner.startswith(f"{host}-"):
                continue
            pid = owner[len(host) + 1 :].split("-", 1)[0]
            if pid.isdigit() and not _running(int(pid)):
                log(f"removing {path}, left by a build that was killed")
                shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


def source_date_epoch() -> int | None:
    """``$SOURCE_DATE_EPOCH`` if set: reproducible builds take their time from it."""
    given = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if given and not given.isdigit():
        raise OverlayError(
            f"SOURCE_DATE_EPOCH={given!r} is not a whole number of seconds.\n"
            "Fix: unset it, or set it to e.g. $(git log -1 --format=%ct)"
        )
    return int(given) if given else None
