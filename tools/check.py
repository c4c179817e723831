# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 2: the tree's files, and whether they fit the base wheel.

Each problem is listed at once, before anything is unpacked: files under
``vllm/`` undeclared, missing, not regular, conflicted or not compiling; a
replaced file whose upstream original is not the pinned one (building would
silently revert upstream's change) or gone; an added module upstream ships or
shadows; a METADATA other than the one pip was given.
"""

import os
import re
import stat
import zipfile
from collections.abc import Iterable
from pathlib import Path

from .pins import BASE_METADATA, CLI, Pins
from .util import OverlayError, sha256

# The four line kinds of a diff3 conflict that git merge-file leaves.
CONFLICT_RE = re.compile(rb"^(?:(?:<{7}|\|{7}|>{7})(?: .*)?|={7})\r?$", re.M)
# A module's file: source, a legacy .pyc beside it, or an extension.
_MODULE = re.compile(r"([^.]*?)(?:/__init__)?\.py")
_IMPORTABLE = re.compile(r"([^.]*?)(?:/__init__)?\.(?:pyc?|(?:[^/]*\.)?(?:so|pyd))")


def collect_overlay(overlay_root: Path) -> list[Path]:
    """The tree's files relative to the wheel root (``vllm/...``), sorted."""
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(overlay_root):
        odd += [Path(dirpath, d) for d in dirnames if Path(dirpath, d).is_symlink()]
        dirnames[:] = sorted(
            d for d in dirnames if d != "__pycache__" and Path(dirpath, d) not in odd
        )
        for path in sorted(Path(dirpath, name) for name in filenames):
            if not stat.S_ISREG(path.lstat().st_mode):
                odd.append(path)
            elif path.suffix != ".pyc":
                files.append(path.relative_to(overlay_root.parent))
    if odd:
        raise OverlayError(
            f"{', '.join(str(p) for p in odd)}: a symlink or other non-regular "
            "file, which a wheel cannot hold.\nFix: make it a regular file"
        )
    return files


def check_tree(pins: Pins, overlay_root: Path) -> list[Path]:
    """The tree's files, refused with every problem that needs no base wheel."""
    files = collect_overlay(overlay_root)
    on_disk = {rel.as_posix() for rel in files}
    problems = [
        f"{path}: declared in pyproject.toml, but not in the tree"
        for path in sorted(pins.declared - on_disk)
    ]
    for path in sorted(pins.declared & on_disk):
        data = (overlay_root.parent / path).read_bytes()
        if marker := CONFLICT_RE.search(data):
            line = data.count(b"\n", 0, marker.start()) + 1
            problems.append(
                f"{path}: holds a conflict marker on line {line}.\nFix: resolve "
                f"it, then run {CLI} rebase --base-version X --continue"
            )
        elif path.endswith(".py"):
            try:
                compile(data, path, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as err:
                problems.append(f"{path}: does not compile: {err}")
    refuse(problems, "the files under vllm/ cannot be built")
    return files


def refuse(problems: list[str], what: str) -> None:
    if problems:
        raise OverlayError(f"{what}:\n" + "\n".join(f"- {p}" for p in problems))


def module_name(path: str) -> str | None:
    """``vllm/a/b.py`` -> ``vllm.a.b``; None for a file that is no module."""
    found = _MODULE.fullmatch(path)
    return found[1].replace("/", ".") if found else None


def import_names(members: Iterable[str]) -> dict[str, str]:
    """The modules a wheel's files make importable, each with one such file."""
    names: dict[str, str] = {}
    for member in members:
        if found := _IMPORTABLE.fullmatch(member):
            names.setdefault(found[1].replace("/", "."), member)
    return names


def release_problems(pins: Pins, zf: zipfile.ZipFile, wheel: str) -> list[str]:
    """Added modules that a release ships or shadows; replaced files it lacks."""
    shipped = set(zf.namelist())
    names = import_names(shipped)
    problems = [
        f"{path}: declared as replaced, but {wheel} does not ship it (removed or "
        "renamed upstream).\nFix: port the change to upstream's new layout"
        for path in sorted(pins.replaces)
        if path not in shipped
    ]
    for path in sorted(pins.adds):
        found = path if path in shipped else names.get(module_name(path) or "")
        if found:
            problems.append(
                f"{path}: declared as added, but {wheel} ships {found}, which the "
                "wheel would import instead of ours.\nFix: rename our module, or "
                "merge upstream's into it and declare it replaced"
                + (f': "{path}" = "{sha256(zf.read(path))}"' if found == path else "")
            )
    return problems


def wheel_metadata(zf: zipfile.ZipFile) -> bytes:
    """A wheel's ``*.dist-info/METADATA``; empty if it has none."""
    found = [m for m in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", m)]
    return zf.read(found[0]) if found else b""


def check_base_wheel(
    pins: Pins, files: Iterable[Path], base_wheel: Path
) -> dict[str, bytes]:
    """Refuse a base wheel the tree does not fit; return upstream's originals."""
    originals, problems = {}, []
    with zipfile.ZipFile(base_wheel) as zf:
        shipped = set(zf.namelist())
        for path in sorted({rel.as_posix() for rel in files} - pins.declared):
            fix = "if it is a new module, list it in adds; else remove it"
            if path in shipped:
                fix = f'pin upstream\'s: "{path}" = "{sha256(zf.read(path))}"'
            problems.append(f"{path}: not declared in pyproject.toml.\nFix: {fix}")
        problems += release_problems(pins, zf, base_wheel.name)
        for path, pin in sorted(pins.replaces.items()):
            if path not in shipped:
                continue
            originals[path] = zf.read(path)
            if sha256(originals[path]) != pin:
                problems.append(
                    f"{path}: {base_wheel.name} holds another original than the "
                    "one pinned, so building would revert upstream's change.\n"
                    f"Fix: put the pins back (git checkout pyproject.toml "
                    f"{BASE_METADATA}), then run {CLI} rebase --base-version X"
                )
        if wheel_metadata(zf) != pins.base_metadata:
            problems.append(
                f"{base_wheel.name}'s METADATA is not {BASE_METADATA}, which pip "
                f"was given.\nFix: git checkout {BASE_METADATA}"
            )
    refuse(problems, f"the files under vllm/ do not fit {base_wheel.name}")
    return originals
