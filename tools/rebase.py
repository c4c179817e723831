# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``rebase``: move the overlay onto a new upstream release, losing nothing.

Each replaced file is three-way merged with ``git merge-file`` from the
original it is pinned to (kept in the originals store, or read from the
pinned base wheel) to the new release's original. A clean merge re-pins at
once. On a conflict the files keep diff3 markers and the pins stay; after
resolving them, ``--continue`` re-pins.

``--continue`` keeps no state. It accepts a file only when it has no
conflict line, compiles, and already holds every change upstream made that
does not conflict with ours: merging upstream's change into it again, taking
our side of each conflict, must give it back unchanged. So no sequence of
commands can re-pin a file that lacks one of upstream's changes.

Before it records a release (on a clean merge, and on ``--continue``) it
reads the new wheels' sources with ``ast`` (``couplings``) and refuses a
release that lacks a module, name, class attribute or keyword argument the
tree's files (merged ones as merged) take from upstream, or whose
``vllm/envs.py`` lists other choices than a tuple the tree declares in
``[tool.vllm-overlay.env-choices]``: such a release merges cleanly and
builds, then fails at import. One line per problem; nothing is written.

When every wheel of the new release pins the package of
``[tool.vllm-overlay.known-issues]`` at or above every known issue's
``fixed_in``, it says in one line that the workaround can be dropped.

A rebase starts only on a tree whose ``vllm/`` and ``pyproject.toml`` are
committed, so that every piece of advice it prints keeps work recoverable.
"""

import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from .check import (
    collect_overlay,
    known_issues_retired,
    read_release,
    recall,
    remember,
    tree_problems,
    unified_diff,
    wheel_metadata,
)
from .couplings import coupling_problems
from .fetch import default_cache_dir, fetch_base_wheel, fetch_release
from .pins import ADDS_KEY, CLI, CONFIG_TABLE, REPLACES_TABLE, Pins, load_pins
from .util import OverlayError, sha256, sha256_of, write_atomic

GIT_TIMEOUT_S = 120


def rebase(
    root: Path, version: str, *, resolved: bool = False, cache_dir: Path | None = None
) -> int:
    """Move the overlay at ``root`` onto ``version``: 0 when done, 1 on conflicts.

    Everything that can refuse runs before any file is written.
    """
    try:
        import tomlkit  # noqa: F401  (checked before fetching anything)
    except ImportError:
        raise OverlayError(
            "rebase edits pyproject.toml with tomlkit, which keeps its comments.\n"
            "Fix: pip install tomlkit"
        ) from None
    try:
        Version(version)
    except InvalidVersion:
        raise OverlayError(f"--base-version {version!r} is not a version") from None
    pins = load_pins(root / "pyproject.toml")
    cache_dir = cache_dir or default_cache_dir()
    if not resolved:
        _refuse_uncommitted(root, pins, version)
    files = collect_overlay(root / pins.name)
    problems = [
        f"{rel}: not declared in pyproject.toml; declare it in {REPLACES_TABLE} "
        f"or {ADDS_KEY} first"
        for rel in files
        if rel.as_posix() not in pins.declared
    ]
    problems += tree_problems(pins, root, files)
    wheels = fetch_release(pins, version, cache_dir)
    new_originals, release_problems = read_release(pins, wheels)
    problems += release_problems
    _refuse(problems, f"cannot rebase onto {pins.name}=={version}")
    retired = _retired(pins, root, version, wheels.values())
    old_originals = pinned_originals(pins, cache_dir)
    remember(new_originals.values(), cache_dir)

    merged: dict[str, bytes] = {}
    if resolved:
        missing = [
            _missing_upstream(root / path, path, pins, version, old, new)
            for path in sorted(pins.replaces)
            if (old := old_originals[path]) != (new := new_originals[path])
        ]
        _refuse(
            [m for m in missing if m],
            f"cannot record the rebase onto {pins.name}=={version}",
        )
    else:
        conflicts = {}
        for path in sorted(pins.replaces):
            old, new = old_originals[path], new_originals[path]
            if old != new:
                ours = (root / path).read_bytes()
                merged[path], conflicts[path] = merge_file(
                    ours, old, new, _labels(ours, pins, version)
                )
        if any(conflicts.values()):
            for path, data in merged.items():
                write_atomic(root / path, data)
            _report_conflicts(pins, version, {p: n for p, n in conflicts.items() if n})
            _say(retired)
            return 1

    _refuse_missing_couplings(root, pins, version, merged, wheels.values(), resolved)
    wheel_pins = {name: sha256_of(path) for name, path in wheels.items()}
    file_pins = {path: sha256(data) for path, data in new_originals.items()}
    text = _new_pyproject(root / "pyproject.toml", version, wheel_pins, file_pins)
    for path in sorted(pins.declared):
        data = merged.get(path, (root / path).read_bytes())
        updated = _with_base_line(data, pins, version)
        if path in merged or updated != data:
            write_atomic(root / path, updated)
    write_atomic(root / "pyproject.toml", text.encode())
    print(
        f"rebased onto {pins.name}=={version}: merged upstream's changes into "
        f"{len(merged)} file(s){': ' if merged else ''}{', '.join(sorted(merged))}; "
        "pinned the new wheels and originals in pyproject.toml.\n"
        "Next: review with git diff, then pip install . && pytest tests",
        file=sys.stderr,
    )
    _say(retired)
    return 0


def _refuse(problems: list[str], what: str, fix: str = "") -> None:
    if problems:
        raise OverlayError(
            f"{what}; nothing was changed:\n"
            + "\n".join(f"- {p}" for p in problems)
            + (f"\nFix: {fix}" if fix else "")
        )


def _refuse_missing_couplings(
    root: Path,
    pins: Pins,
    version: str,
    merged: Mapping[str, bytes],
    wheels: Iterable[Path],
    resolved: bool,
) -> None:
    """Refuse a release that lacks an upstream name the tree's files use.

    The files are read as they would be recorded: merged ones as merged.
    """
    release = f"{pins.name}=={version}"
    tree = {
        path: merged[path] if path in merged else (root / path).read_bytes()
        for path in sorted(pins.declared)
    }
    command = f"{CLI} rebase --base-version {version}"
    _refuse(
        coupling_problems(pins, tree, wheels, release),
        f"cannot {'record the rebase' if resolved else 'rebase'} onto {release}",
        f"make those files use what {release} has instead, then run "
        + (
            f"{command} --continue again"
            if resolved
            else f"{command} again "
            "(commit them first: a rebase starts on a committed tree)"
        ),
    )


def _retired(pins: Pins, root: Path, version: str, wheels: Iterable[Path]) -> str:
    """The known-issues line for the new release's wheels, or empty."""
    metadata = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            metadata.append(wheel_metadata(zf))
    return known_issues_retired(pins, root, metadata, f"{pins.name}=={version}")


def _say(line: str) -> None:
    if line:
        print(line, file=sys.stderr)


def _refuse_uncommitted(root: Path, pins: Pins, version: str) -> None:
    """Start only where ``git stash`` or a commit can bring back every edit."""
    paths = ("--", pins.name, "pyproject.toml")
    status = _git(root, "status", "--porcelain", "--untracked-files=all", *paths)
    if status.strip():
        raise OverlayError(
            f"uncommitted changes under {pins.name}/ or in pyproject.toml:\n"
            + "".join(f"  {line}\n" for line in status.splitlines())
            + "A rebase rewrites those files.\nFix: commit or stash them "
            "(git stash push --include-untracked), then run it again; if this "
            "is a conflicted rebase that you resolved, record it with:\n"
            f"  {CLI} rebase --base-version {version} --continue"
        )


def _git(root: Path, *args: str, conflicts_ok: bool = False) -> str:
    """Run git; ``merge-file`` exits with its number of conflicts."""
    try:
        proc = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, timeout=GIT_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise OverlayError(f"rebase needs git (git {args[0]}): {err}") from None
    if not (proc.returncode == 0 or conflicts_ok and 0 < proc.returncode < 128):
        raise OverlayError(
            f"git {args[0]} failed in {root}: {proc.stderr.decode(errors='replace')}"
            "Fix: run the rebase in a git clone of the repository"
        )
    return proc.stdout.decode(errors="surrogateescape")


def _missing_upstream(
    file: Path, path: str, pins: Pins, version: str, old: bytes, new: bytes
) -> str:
    """Upstream's non-conflicting changes that ``file`` lacks, as a problem."""
    ours = file.read_bytes()
    labels = _labels(ours, pins, version)
    again, _ = merge_file(ours, old, new, labels, keep_ours=True)
    if again == ours:
        return ""
    return (
        f"{path} lacks upstream's change(s) between {labels[1]} and "
        f"{labels[2]} that do not conflict with ours:\n"
        + unified_diff(ours, again, path, f"a/{path}", f"b/{path}")
        + f"Fix: take them in, or commit (or stash) the file and run {CLI} "
        f"rebase --base-version {version} to merge them again"
    )


def pinned_originals(pins: Pins, cache_dir: Path) -> dict[str, bytes]:
    """The originals the file pins name: from the store, else the pinned base."""
    originals = {p: recall(pin, cache_dir) for p, pin in pins.replaces.items()}
    missing = [path for path, data in originals.items() if data is None]
    if missing:
        base = fetch_base_wheel(pins, cache_dir=cache_dir)
        with zipfile.ZipFile(base) as zf:
            shipped = set(zf.namelist())
            for path in missing:
                data = zf.read(path) if path in shipped else b""
                if sha256(data) != pins.replaces[path]:
                    raise OverlayError(
                        f"the original that {path} is pinned to "
                        f"(sha256 {pins.replaces[path]}) is neither cached nor in "
                        f"{base.name}.\nFix: put base-version and "
                        f"[tool.{CONFIG_TABLE}.sha256] back to the release the file "
                        "pins were written against (git stash push -- "
                        "pyproject.toml keeps your edit), then run the rebase again"
                    )
                originals[path] = data
        remember([d for d in originals.values() if d is not None], cache_dir)
    return originals  # type: ignore[return-value]


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


def _labels(ours: bytes, pins: Pins, version: str) -> list[str]:
    """Name the pinned original after the DEP-3 ``Base:`` line, if there is one."""
    pattern = rb"^# Base: (" + re.escape(pins.name.encode()) + rb"==\S+)"
    found = re.search(pattern, ours, re.M)
    base = found.group(1).decode() if found else "pinned upstream"
    return ["ours", base, f"{pins.name}=={version}"]


def _with_base_line(data: bytes, pins: Pins, version: str) -> bytes:
    """Keep the DEP-3 header's ``# Base: vllm==X`` line true after a rebase."""
    pattern = re.compile(
        rb"^(# Base: " + re.escape(pins.name.encode()) + rb"==)\S+", re.M
    )
    return pattern.sub(lambda m: m.group(1) + version.encode(), data, count=1)


def _new_pyproject(
    pyproject: Path,
    version: str,
    wheels: Mapping[str, str],
    replaces: Mapping[str, str],
) -> str:
    """pyproject.toml with the new pins, comments kept (tomlkit), and checked."""
    import tomlkit

    doc = tomlkit.parse(pyproject.read_text())
    table: Any = doc["tool"][CONFIG_TABLE]  # type: ignore[index]
    table["base-version"] = version
    sha = table["sha256"]
    for key in list(sha):
        del sha[key]
    for key, digest in wheels.items():
        sha[key] = digest
    for path, digest in replaces.items():
        table["replaces"][path] = digest
    text = tomlkit.dumps(doc)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-pins-") as tmp:
        Path(tmp, "pyproject.toml").write_text(text)
        load_pins(Path(tmp, "pyproject.toml"))
    return text


def _report_conflicts(pins: Pins, version: str, conflicts: Mapping[str, int]) -> None:
    listed = "".join(f"  {p} ({n} conflict(s))\n" for p, n in conflicts.items())
    print(
        f"CONFLICT: {pins.name}=={version} changed lines that this patch "
        f"changes too, in:\n{listed}"
        "Those files now hold conflict markers (<<<<<<< ours, ||||||| "
        f"the pinned original, >>>>>>> {pins.name}=={version}); the other "
        "files are merged. pyproject.toml is unchanged, and a build refuses "
        "files with conflict markers.\n"
        "Next: resolve the conflicts, then run\n"
        f"  {CLI} rebase --base-version {version} --continue\n"
        f"or start over with: git stash push -- {pins.name}/ (the merge stays "
        "in the stash), then run the rebase again",
        file=sys.stderr,
    )
