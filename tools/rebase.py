# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``rebase``: move the overlay onto a new upstream release, losing nothing.

Each replaced file is three-way merged (``git merge-file``) from its pinned
original to the new release's; a clean merge re-pins at once. On a conflict
the files keep diff3 markers and the pins stay. ``--continue`` keeps no
state: it re-pins only files with no conflict line that compile and already
hold every upstream change that does not conflict with ours.
"""

import difflib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .check import (
    check_base_wheel,
    check_tree,
    refuse,
    release_problems,
    wheel_metadata,
)
from .fetch import default_cache_dir, fetch_base_wheel, fetch_release
from .pins import BASE_METADATA, CLI, CONFIG_TABLE, DIST_NAME, Pins, load_pins
from .util import OverlayError, sha256, sha256_of


def rebase(
    root: Path, version: str, *, resolved: bool = False, cache_dir: Path | None = None
) -> int:
    """Move the overlay at ``root`` onto ``version``: 0 when done, 1 on
    conflicts. Everything that can refuse runs before any file is written."""
    try:
        import tomlkit
    except ImportError:
        raise OverlayError("rebase needs tomlkit.\nFix: pip install tomlkit") from None
    pins = load_pins(root / "pyproject.toml")
    again = f"{CLI} rebase --base-version {version}"
    cache_dir = cache_dir or default_cache_dir()
    # Start only where git can bring back every edit a rebase makes.
    paths = ["--", DIST_NAME, "pyproject.toml", BASE_METADATA]
    if not resolved and (status := _git(root, "status", "--porcelain", *paths)):
        raise OverlayError(
            f"uncommitted changes to files a rebase rewrites:\n{status}Fix: commit "
            "or stash them (git stash push --include-untracked), then run it again"
            f"; a resolved conflict is recorded with: {again} --continue"
        )
    # The tree must fit the pinned release as a build needs, and the new one.
    files = check_tree(pins, root / DIST_NAME)
    old = check_base_wheel(pins, files, fetch_base_wheel(pins, cache_dir=cache_dir))
    wheels = fetch_release(pins, version, cache_dir)
    new, metadata, problems = read_release(pins, wheels)
    refuse(problems, f"cannot rebase onto {DIST_NAME}=={version}; nothing was changed")

    merged, conflicts = {}, {}
    for path in sorted(p for p in pins.replaces if old[p] != new[p]):
        ours = (root / path).read_bytes()
        labels = ["ours", pins.requirement, f"{DIST_NAME}=={version}"]
        if not resolved:
            merged[path], conflicts[path] = merge_file(
                ours, old[path], new[path], labels
            )
            continue
        # Upstream's changes merged in again, our side of each conflict kept.
        taken, _ = merge_file(ours, old[path], new[path], labels, keep_ours=True)
        if taken != ours:
            problems.append(
                f"{path} lacks upstream's change(s) that do not conflict with ours:\n"
                + unified_diff(ours, taken, path, f"a/{path}", f"b/{path}")
                + f"Fix: take them in, or commit the file and run {again}"
            )
    refuse(problems, "cannot record the rebase; nothing was changed")
    if any(conflicts.values()):
        for path, data in merged.items():
            (root / path).write_bytes(data)
        listed = "".join(
            f"  {p} ({n} conflict(s))\n" for p, n in conflicts.items() if n
        )
        print(
            f"CONFLICT: {DIST_NAME}=={version} changed lines that this patch "
            f"changes too, in:\n{listed}The pins are unchanged, and a build "
            "refuses conflict markers.\nNext: resolve them, then run "
            f"{again} --continue (to start over: git stash push -- {DIST_NAME}/)",
            file=sys.stderr,
        )
        return 1

    doc = tomlkit.parse((root / "pyproject.toml").read_text())
    table: Any = doc["tool"][CONFIG_TABLE]  # type: ignore[index]
    table["base-version"] = version
    table["sha256"].clear()
    table["sha256"].update({name: sha256_of(path) for name, path in wheels.items()})
    table["replaces"].update({path: sha256(data) for path, data in new.items()})
    for path in sorted(pins.declared):
        data = merged.get(path, (root / path).read_bytes())
        # Keep the DEP-3 header's "# Base: vllm==X" line true.
        base_line = rb"\g<1>" + version.encode()
        updated = re.sub(rb"^(# Base: vllm==)\S+", base_line, data, count=1, flags=re.M)
        if updated != (root / path).read_bytes():
            (root / path).write_bytes(updated)
    (root / BASE_METADATA).write_bytes(metadata)
    (root / "pyproject.toml").write_text(tomlkit.dumps(doc))
    print(
        f"rebased onto {DIST_NAME}=={version}, merged: {', '.join(merged) or '-'}.\n"
        "Next: review with git diff, then pip install . && pytest tests",
        file=sys.stderr,
    )
    return 0


def read_release(
    pins: Pins, wheels: Mapping[str, Path]
) -> tuple[dict[str, bytes], bytes, list[str]]:
    """A release's originals of the replaced files, its METADATA, and what
    stops a rebase onto it. Its wheels must agree: one merge serves them all."""
    found: dict[str, set[bytes]] = {p: set() for p in [*pins.replaces, BASE_METADATA]}
    problems = []
    for name, wheel in sorted(wheels.items()):
        with zipfile.ZipFile(wheel) as zf:
            problems += release_problems(pins, zf, name)
            shipped = set(zf.namelist()) & set(pins.replaces)
            for path in shipped:
                found[path].add(zf.read(path))
            found[BASE_METADATA].add(wheel_metadata(zf))
    problems += [
        f"{path}: the new release's wheels differ in it"
        for path, copies in found.items()
        if len(copies) > 1
    ]
    copies = {path: copies.pop() for path, copies in found.items() if copies}
    return copies, copies.pop(BASE_METADATA, b""), problems


def _git(root: Path, *args: str, conflicts_ok: bool = False) -> str:
    """Run git; ``merge-file`` exits with its number of conflicts."""
    try:
        proc = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise OverlayError(f"rebase needs git (git {args[0]}): {err}") from None
    if not (proc.returncode == 0 or conflicts_ok and 0 < proc.returncode < 128):
        raise OverlayError(
            f"git {args[0]} failed in {root}: {proc.stderr.decode(errors='replace')}"
            "Fix: run the rebase in a git clone of the repository"
        )
    return proc.stdout.decode(errors="surrogateescape")


def merge_file(
    ours: bytes, old: bytes, new: bytes, labels: list[str], keep_ours: bool = False
) -> tuple[bytes, int]:
    """Three-way merge with git; returns the result and its number of conflicts."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        for name, data in zip(("ours", "old", "new"), (ours, old, new), strict=True):
            Path(tmp, name).write_bytes(data)
        flags = ["-p", "--ours" if keep_ours else "--diff3"]
        flags += [arg for label in labels for arg in ("-L", label)]
        out = _git(
            Path(tmp), "merge-file", *flags, "ours", "old", "new", conflicts_ok=True
        )
    merged = out.encode(errors="surrogateescape")
    return merged, len(re.findall(rb"^<{7} ", merged, re.M))


def unified_diff(before: bytes, after: bytes, path: str, a: str, b: str) -> str:
    """A unified diff that ``git apply`` reads back byte for byte: lines split
    on newlines only (str.splitlines also splits on \\f and more)."""
    try:
        old, new = (
            re.findall(r"[^\n]*\n|[^\n]+\Z", t.decode()) for t in (before, after)
        )
    except UnicodeDecodeError:
        raise OverlayError(f"{path} is not UTF-8 text; cannot diff it") from None
    lines = difflib.unified_diff(old, new, a, b)
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in lines
    )
