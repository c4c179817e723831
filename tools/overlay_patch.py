# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the overlay replaces and adds, checked against upstream and rebased.

``pyproject.toml`` declares every file under ``vllm/``:

* ``[tool.vllm-overlay.replaces]`` pins each file that replaces an upstream
  one to the sha256 of the upstream original it was written against;
* ``adds`` in ``[tool.vllm-overlay]`` lists the files upstream does not ship.

Without the pins, bumping ``base-version`` would build fine and silently revert
every upstream fix in a replaced file. With them, the build (see
``check_base_wheel``) stops before unpacking the base wheel when upstream moved
under a replaced file, when an added file turns up upstream, or when a file is
not declared. The maintainer commands of ``tools/precompiled_overlay.py`` live
here too:

* ``diff`` prints the patch as one unified diff against upstream's source;
* ``rebase --base-version X`` merges upstream's changes into each replaced file
  with ``git merge-file`` and re-pins the new release.

Every verified upstream original is kept in a small content-addressed store in
the wheel cache, so a pin mismatch can show upstream's diff even after the
whole-wheel pins were bumped to a release that no longer has the old file.
"""

import argparse
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import precompiled_overlay as po
from packaging.version import InvalidVersion, Version

CLI = "python tools/precompiled_overlay.py"
ORIGINALS_SUBDIR = "originals"
REBASE_STATE = ".vllm-overlay-rebase.json"
REPLACES_TABLE = f"[tool.{po.CONFIG_TABLE}.replaces]"
ADDS_KEY = f"adds in [tool.{po.CONFIG_TABLE}]"
# Paths that need no quoting in a git patch header.
_PATH_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+")
_CONFLICT_RE = re.compile(rb"^(<{7}|>{7}) ", re.M)
MERGE_TIMEOUT_S = 120


# --- declarations -----------------------------------------------------------


def read_declarations(
    table: Mapping[str, Any], source: Path, name: str = po.DIST_NAME
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Validate ``replaces`` and ``adds`` so a typo fails before any download.

    Every problem is listed at once, each naming the table it is in.
    """
    replaces = table.get("replaces", {})
    adds = table.get("adds", [])
    if not isinstance(replaces, Mapping):
        raise po.OverlayError(f"{source}: {REPLACES_TABLE} must be a table")
    if not isinstance(adds, list):
        raise po.OverlayError(f"{source}: {ADDS_KEY} must be a list of paths")
    problems = []
    for path, digest in replaces.items():
        if not _is_overlay_path(path, name):
            problems.append(f"{REPLACES_TABLE}: {path!r} is not a path under {name}/")
        if not isinstance(digest, str) or not po._SHA256_RE.fullmatch(digest):
            problems.append(
                f"{REPLACES_TABLE}: the pin of {path} must be the upstream "
                "original's sha256, 64 lowercase hex digits"
            )
    for path in adds:
        if not isinstance(path, str) or not _is_overlay_path(path, name):
            problems.append(f"{ADDS_KEY}: {path!r} is not a path under {name}/")
    duplicates = sorted({p for p in adds if isinstance(p, str) and adds.count(p) > 1})
    problems += [f"{ADDS_KEY}: {path} is listed twice" for path in duplicates]
    both = sorted(set(replaces) & {p for p in adds if isinstance(p, str)})
    problems += [
        f"{path} is both in {REPLACES_TABLE} and in {ADDS_KEY}; a file either "
        "replaces an upstream file or is new"
        for path in both
    ]
    if problems:
        raise po.OverlayError(
            f"{source}: bad overlay declarations:\n"
            + "".join(f"  {problem}\n" for problem in problems)
        )
    return dict(replaces), tuple(adds)


def _is_overlay_path(path: object, name: str) -> bool:
    """A normalized relative POSIX path inside the package, safe in a patch."""
    if not isinstance(path, str) or not _PATH_RE.fullmatch(path):
        return False
    parts = PurePosixPath(path).parts
    return parts[0] == name and not {".", ".."} & set(parts)


def _declared(pins: po.Pins) -> set[str]:
    return {*pins.replaces, *pins.adds}


def _tree_problems(pins: po.Pins, files: Iterable[Path]) -> tuple[list[str], list[str]]:
    """Files in the tree that are not declared, and declared files not there."""
    on_disk = {rel.as_posix() for rel in files}
    undeclared = sorted(on_disk - _declared(pins))
    absent = [
        f"{path}: declared in pyproject.toml but not in the tree; restore the "
        "file or remove its entry"
        for path in sorted(_declared(pins) - on_disk)
    ]
    return undeclared, absent


# --- the content-addressed store of upstream originals -----------------------


def originals_dir(cache_dir: Path | None = None) -> Path:
    """Beside the cached wheels, so whoever clears one clears the other."""
    return (cache_dir or po.default_cache_dir()) / ORIGINALS_SUBDIR


def remember(originals: Iterable[bytes], cache_dir: Path | None = None) -> None:
    """Keep verified originals by sha256; losing this cache only costs a diff."""
    store = originals_dir(cache_dir)
    try:
        store.mkdir(parents=True, exist_ok=True)
        for data in originals:
            target = store / _sha256(data)
            if not target.is_file():
                _write_atomic(target, data)
    except OSError as err:
        po.log(f"not caching originals: {err}")


def recall(digest: str, cache_dir: Path | None = None) -> bytes | None:
    """An original by its sha256, or None; a damaged entry counts as missing."""
    try:
        data = (originals_dir(cache_dir) / digest).read_bytes()
    except OSError:
        return None
    return data if _sha256(data) == digest else None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(target: Path, data: bytes) -> None:
    """Write by rename, keeping the old file's mode: never a half file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the build's check ------------------------------------------------------


def check_base_wheel(
    pins: po.Pins,
    overlay_root: Path,
    files: Iterable[Path],
    base_wheel: Path,
    cache_dir: Path | None = None,
) -> dict[str, bytes]:
    """Refuse a base wheel the declared overlay does not fit; list every reason.

    Only the zip directory and the replaced members are read, so this runs
    before the wheel is unpacked. Returns upstream's originals of the
    replaced files.
    """
    undeclared, problems = _tree_problems(pins, files)
    state = _read_state(overlay_root.parent / REBASE_STATE) or {}
    problems += [
        f"{path}: still holds conflict markers from a rebase.\nFix: resolve "
        f"them, then run {CLI} rebase --base-version "
        f"{state.get('version', 'X')} --continue"
        for path in _conflicted(overlay_root, _declared(pins))
    ]
    originals: dict[str, bytes] = {}
    with zipfile.ZipFile(base_wheel) as zf:
        shipped = set(zf.namelist())
        for path in undeclared:
            problems.append(_undeclared(path, zf if path in shipped else None))
        for path in sorted(pins.adds):
            if path in shipped:
                problems.append(_added_but_shipped(path, zf.read(path), base_wheel))
        for path, pin in sorted(pins.replaces.items()):
            if path not in shipped:
                problems.append(
                    f"{path}: declared as replaced, but {base_wheel.name} does not "
                    "ship it (upstream removed or renamed it), so it is no drop-in.\n"
                    "Fix: port the change to upstream's new layout; if the file is "
                    f"new code now, move it to {ADDS_KEY}"
                )
                continue
            data = zf.read(path)
            if _sha256(data) == pin:
                originals[path] = data
            else:
                problems.append(_moved_upstream(path, pin, data, pins, cache_dir))
    if problems:
        raise po.OverlayError(
            f"the overlay does not fit the base wheel {base_wheel.name}; "
            "nothing was built:\n" + "\n".join(f"- {p}" for p in problems)
        )
    remember(originals.values(), cache_dir)
    return originals


def _undeclared(path: str, zf: zipfile.ZipFile | None) -> str:
    if zf is None:
        return (
            f"{path}: not declared in pyproject.toml, and upstream does not ship "
            "it, so it is no drop-in replacement.\n"
            f"Fix: if it is a new module, list it in {ADDS_KEY}; otherwise rename "
            "or remove it"
        )
    return (
        f"{path}: not declared in pyproject.toml. It replaces upstream's file; "
        f"pin that in {REPLACES_TABLE}:\n"
        f'  "{path}" = "{_sha256(zf.read(path))}"'
    )


def _added_but_shipped(path: str, upstream: bytes, base_wheel: Path) -> str:
    return (
        f"{path}: declared as added, but {base_wheel.name} ships its own, which "
        "the overlay would silently overwrite.\n"
        "Fix: merge upstream's file into ours and move the entry from "
        f'{ADDS_KEY} to {REPLACES_TABLE} as "{path}" = "{_sha256(upstream)}", '
        "or rename our module"
    )


def _moved_upstream(
    path: str, pin: str, data: bytes, pins: po.Pins, cache_dir: Path | None
) -> str:
    """Say what upstream changed and how to take it in, instead of reverting it."""
    rebase = f"{CLI} rebase --base-version {pins.base_version}"
    head = (
        f"{path}: upstream's file changed since this overlay was written against "
        "it; building would silently revert that change.\n"
        f"  pinned original sha256: {pin}\n"
        f"  {pins.requirement}'s sha256:  {_sha256(data)}\n"
    )
    pinned = recall(pin, cache_dir)
    if pinned is None:
        return head + (
            "  (the pinned original is not cached here, so upstream's diff cannot "
            "be shown)\n"
            "Fix: put base-version and [tool.vllm-overlay.sha256] back to the "
            "release these file pins were written against (git checkout "
            f"pyproject.toml), then run:\n  {rebase}"
        )
    diff = "".join(
        _terminated(line)
        for line in difflib.unified_diff(
            _lines(pinned, path),
            _lines(data, path),
            f"a/{path} (pinned original)",
            f"b/{path} ({pins.requirement})",
        )
    )
    return head + (
        f"  upstream's change:\n{_indent(diff, '    ')}"
        f"Fix: merge it into this file and re-pin, with:\n  {rebase}"
    )


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))


# --- diff -------------------------------------------------------------------


def render_patch(
    pins: po.Pins, overlay_root: Path, originals: Mapping[str, bytes]
) -> str:
    """The overlay as one patch that ``git apply`` applies to upstream's tree.

    Replaced files are diffed against their originals; added files are
    created. Applied to upstream's originals it gives back the tree's files
    byte for byte (a missing final newline is marked as git marks it).
    """
    chunks = []
    for path in sorted(_declared(pins)):
        ours = (overlay_root.parent / path).read_bytes()
        chunks.append(_file_patch(path, originals.get(path), ours))
    return "".join(chunks)


def _file_patch(path: str, before: bytes | None, after: bytes) -> str:
    if before == after:
        return ""
    head = f"diff --git a/{path} b/{path}\n"
    if before is None:
        head += "new file mode 100644\n"
        if not after:
            return head
    body = difflib.unified_diff(
        _lines(before, path) if before is not None else [],
        _lines(after, path),
        "/dev/null" if before is None else f"a/{path}",
        f"b/{path}",
    )
    return head + "".join(_terminated(line) for line in body)


def _lines(data: bytes, path: str) -> list[str]:
    """Split on newlines only: str.splitlines would also split on \\f and more."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise po.OverlayError(f"{path} is not UTF-8 text; cannot diff it") from None
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _terminated(line: str) -> str:
    if line.endswith("\n"):
        return line
    return line + "\n\\ No newline at end of file\n"


def diff_command(root: Path, cache_dir: Path | None = None) -> str:
    """Check the overlay against its base exactly as the build does, then diff."""
    pins = po.load_pins(root / "pyproject.toml")
    overlay_root = root / pins.name
    files = po.collect_overlay(overlay_root)
    base = po.fetch_base_wheel(pins, cache_dir=cache_dir)
    originals = check_base_wheel(pins, overlay_root, files, base, cache_dir)
    return render_patch(pins, overlay_root, originals)


# --- rebase -----------------------------------------------------------------


def fetch_release(pins: po.Pins, version: str, cache_dir: Path) -> dict[str, Path]:
    """``version``'s wheel for each platform pinned now, fetched as the build does.

    There is no pin for a new release yet, so its first download is trusted;
    its sha256 is what the rebase pins. A wheel already in the cache (an
    earlier rebase fetched it) is used as is, unless it contradicts a pin.
    """
    wheels: dict[str, Path] = {}
    for pinned in pins.sha256:  # in pyproject.toml's order, kept by the rebase
        python_tag, abi_tag, platform_tag = pinned.removesuffix(".whl").split("-")[-3:]
        guess = f"{pins.name}-{version}-{python_tag}-{abi_tag}-{platform_tag}.whl"
        cached = cache_dir / guess
        if cached.is_file() and pins.sha256.get(guess) in (None, po.sha256_of(cached)):
            po.log(f"using cached {cached}")
            wheels[guess] = cached
            continue
        platforms = [] if platform_tag == "any" else platform_tag.split(".")
        wheel = _download_release(pins, version, platforms, cache_dir)
        wheels[wheel.name] = wheel
    return wheels


def _download_release(
    pins: po.Pins, version: str, platforms: list[str], cache_dir: Path
) -> Path:
    target = f"{pins.name}=={version}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        code, console, debug = po.run_pip_download(target, Path(tmp), platforms)
        found = sorted(Path(tmp).glob("*.whl"))
        if code != 0 or len(found) != 1:
            where = f" for {', '.join(platforms)}" if platforms else ""
            said = po._pip_gist(console, debug)
            raise po.OverlayError(
                f"could not fetch {target}{where}:\n"
                + "".join(f"  {line}\n" for line in said)
                + "Fix: check the version, and pip's index/proxy settings (pip.conf, "
                "PIP_INDEX_URL, HTTPS_PROXY); nothing was changed"
            )
        fetched = found[0]
        pinned = pins.sha256.get(fetched.name)
        if pinned is not None and po.sha256_of(fetched) != pinned:
            raise po.OverlayError(
                f"pip fetched {fetched.name} with sha256 {po.sha256_of(fetched)}, "
                f"but pyproject.toml pins {pinned}; check pip's index. Nothing was "
                "changed"
            )
        final = cache_dir / fetched.name
        os.replace(fetched, final)
    return final


def read_release(
    pins: po.Pins, wheels: Mapping[str, Path]
) -> tuple[dict[str, bytes], list[str]]:
    """The new originals of the replaced files, and what stops a rebase.

    The wheels of one release must agree on them: one merge result serves
    every platform.
    """
    found: dict[str, dict[str, bytes | None]] = {p: {} for p in pins.replaces}
    problems = []
    for name, wheel in sorted(wheels.items()):
        with zipfile.ZipFile(wheel) as zf:
            shipped = set(zf.namelist())
            for path in pins.replaces:
                found[path][name] = zf.read(path) if path in shipped else None
            problems += [
                _added_but_shipped(path, zf.read(path), wheel)
                for path in sorted(pins.adds)
                if path in shipped
            ]
    originals = {}
    for path, per_wheel in sorted(found.items()):
        copies = set(per_wheel.values())
        if copies == {None}:
            problems.append(
                f"{path}: the new release does not ship it (removed or renamed "
                "upstream); port the change to upstream's new layout by hand"
            )
        elif len(copies) > 1:
            listed = ", ".join(
                f"{name}: {_sha256(d) if d is not None else 'missing'}"
                for name, d in sorted(per_wheel.items())
            )
            problems.append(f"{path}: the new wheels disagree on it ({listed})")
        else:
            (data,) = copies
            assert data is not None
            originals[path] = data
    return originals, problems


def pinned_originals(pins: po.Pins, cache_dir: Path) -> dict[str, bytes]:
    """The originals the file pins name: from the store, else the pinned base."""
    originals = {}
    missing = []
    for path, pin in pins.replaces.items():
        data = recall(pin, cache_dir)
        if data is None:
            missing.append(path)
        else:
            originals[path] = data
    if missing:
        base = po.fetch_base_wheel(pins, cache_dir=cache_dir)
        with zipfile.ZipFile(base) as zf:
            shipped = set(zf.namelist())
            for path in missing:
                data = zf.read(path) if path in shipped else b""
                if _sha256(data) != pins.replaces[path]:
                    raise po.OverlayError(
                        f"the original that {path} is pinned to "
                        f"(sha256 {pins.replaces[path]}) is neither cached nor in "
                        f"{base.name}.\nFix: put base-version and "
                        "[tool.vllm-overlay.sha256] back to the release the file "
                        "pins were written against (git checkout pyproject.toml), "
                        "then run the rebase again"
                    )
                originals[path] = data
        remember(originals.values(), cache_dir)
    return originals


def merge_file(
    ours: bytes, old: bytes, new: bytes, labels: list[str]
) -> tuple[bytes, int]:
    """Three-way merge with git; returns the result and its number of conflicts."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        paths = [Path(tmp, name) for name in ("ours", "old", "new")]
        for path, data in zip(paths, (ours, old, new), strict=True):
            path.write_bytes(data)
        cmd = ["git", "merge-file", "-p", "--diff3"]
        for label in labels:
            cmd += ["-L", label]
        try:
            proc = subprocess.run(
                cmd + [str(p) for p in paths],
                capture_output=True,
                timeout=MERGE_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise po.OverlayError(f"rebase needs git (git merge-file): {err}") from None
    if not 0 <= proc.returncode <= 127:
        raise po.OverlayError(
            f"git merge-file failed: {proc.stderr.decode(errors='replace')}"
        )
    return proc.stdout, proc.returncode


def _with_base_line(data: bytes, pins: po.Pins, version: str) -> bytes:
    """Keep the DEP-3 header's ``# Base: vllm==X`` line true after a rebase."""
    pattern = re.compile(
        rb"^(# Base: " + re.escape(pins.name.encode()) + rb"==)\S+", re.M
    )
    return pattern.sub(lambda m: m.group(1) + version.encode(), data, count=1)


def _base_label(data: bytes, pins: po.Pins) -> str:
    """Name the pinned original after the DEP-3 ``Base:`` line, if there is one."""
    pattern = rb"^# Base: (" + re.escape(pins.name.encode()) + rb"==\S+)"
    found = re.search(pattern, data, re.M)
    return found.group(1).decode() if found else "pinned upstream"


def _new_pyproject(
    pyproject: Path,
    version: str,
    wheels: Mapping[str, str],
    replaces: Mapping[str, str],
) -> str:
    """pyproject.toml with the new pins, comments kept (tomlkit), and checked."""
    import tomlkit

    doc = tomlkit.parse(pyproject.read_text())
    table: Any = doc["tool"][po.CONFIG_TABLE]  # type: ignore[index]
    table["base-version"] = version
    sha256 = table["sha256"]
    for key in list(sha256):
        del sha256[key]
    for key, digest in wheels.items():
        sha256[key] = digest
    for path, digest in replaces.items():
        table["replaces"][path] = digest
    text = tomlkit.dumps(doc)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-pins-") as tmp:
        check = Path(tmp, "pyproject.toml")
        check.write_text(text)
        po.load_pins(check)
    return text


def rebase(
    root: Path, version: str, *, resolved: bool = False, cache_dir: Path | None = None
) -> int:
    """Move the overlay onto ``version``; 0 when done, 1 on merge conflicts.

    Everything that can refuse (fetching, cross-platform agreement, added
    files shipped upstream) runs before any file is written. On conflicts
    the files keep git's markers (which the build refuses) and the pins stay
    as they are until ``--continue`` records the resolved files.
    """
    try:
        import tomlkit  # noqa: F401  (checked before fetching anything)
    except ImportError:
        raise po.OverlayError(
            "rebase edits pyproject.toml with tomlkit, which keeps its comments.\n"
            "Fix: pip install tomlkit"
        ) from None
    try:
        Version(version)
    except InvalidVersion:
        raise po.OverlayError(f"--base-version {version!r} is not a version") from None
    pyproject = root / "pyproject.toml"
    pins = po.load_pins(pyproject)
    overlay_root = root / pins.name
    cache_dir = cache_dir or po.default_cache_dir()
    state_file = root / REBASE_STATE
    _check_resume(root, pins, version, resolved, _read_state(state_file))

    undeclared, problems = _tree_problems(pins, po.collect_overlay(overlay_root))
    problems += [
        f"{path}: not declared in pyproject.toml; declare it in {REPLACES_TABLE} "
        f"or {ADDS_KEY} first"
        for path in undeclared
    ]
    wheels = fetch_release(pins, version, cache_dir)
    new_originals, release_problems = read_release(pins, wheels)
    problems += release_problems
    if problems:
        raise po.OverlayError(
            f"cannot rebase onto {pins.name}=={version}; nothing was changed:\n"
            + "\n".join(f"- {p}" for p in problems)
        )
    wheel_pins = {name: po.sha256_of(path) for name, path in wheels.items()}
    file_pins = {path: _sha256(data) for path, data in new_originals.items()}
    remember(new_originals.values(), cache_dir)

    merged: dict[str, bytes] = {}
    if not resolved:
        old_originals = pinned_originals(pins, cache_dir)
        merged, conflicts = _merge_all(
            root, pins, version, old_originals, new_originals
        )
        if conflicts:
            before = {path: _sha256((root / path).read_bytes()) for path in merged}
            _write_state(state_file, version, before)
            for path, data in merged.items():
                _write_atomic(root / path, data)
            _report_conflicts(pins, version, conflicts)
            return 1

    text = _new_pyproject(pyproject, version, wheel_pins, file_pins)
    for path in sorted(_declared(pins)):
        data = merged[path] if path in merged else (root / path).read_bytes()
        updated = _with_base_line(data, pins, version)
        if path in merged or updated != data:
            _write_atomic(root / path, updated)
    _write_atomic(pyproject, text.encode())
    state_file.unlink(missing_ok=True)
    changed = sorted(merged)
    print(
        f"rebased onto {pins.name}=={version}: merged upstream's changes into "
        f"{len(changed)} file(s){': ' if changed else ''}{', '.join(changed)}; "
        "pinned the new wheels and originals in pyproject.toml.\n"
        "Next: review with git diff, then pip install . && pytest tests",
        file=sys.stderr,
    )
    return 0


def _merge_all(
    root: Path,
    pins: po.Pins,
    version: str,
    old_originals: Mapping[str, bytes],
    new_originals: Mapping[str, bytes],
) -> tuple[dict[str, bytes], dict[str, int]]:
    """Merge each replaced file that upstream changed; nothing is written yet."""
    merged, conflicts = {}, {}
    for path in sorted(pins.replaces):
        ours = (root / path).read_bytes()
        old, new = old_originals[path], new_originals[path]
        if old == new:
            continue
        labels = ["ours", _base_label(ours, pins), f"{pins.name}=={version}"]
        merged[path], count = merge_file(ours, old, new, labels)
        if count:
            conflicts[path] = count
    return merged, conflicts


def _report_conflicts(
    pins: po.Pins, version: str, conflicts: Mapping[str, int]
) -> None:
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
        f"or start over with: git checkout -- {pins.name}/",
        file=sys.stderr,
    )


def _conflicted(overlay_root: Path, paths: Iterable[str]) -> list[str]:
    """The files that still hold git's conflict markers."""
    return sorted(
        path
        for path in paths
        if (overlay_root.parent / path).is_file()
        and _CONFLICT_RE.search((overlay_root.parent / path).read_bytes())
    )


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _write_state(path: Path, version: str, before: Mapping[str, str]) -> None:
    """Record a conflicted rebase, so ``--continue`` knows one is under way.

    ``before`` holds the sha256 of each file to merge as it was before the
    merge, so that a rebase undone with git checkout cannot be "continued"
    into pins that silently drop upstream's change.
    """
    state = {"version": version, "before": dict(before)}
    _write_atomic(path, json.dumps(state, indent=1).encode())


def _check_resume(
    root: Path,
    pins: po.Pins,
    version: str,
    resolved: bool,
    state: Mapping[str, Any] | None,
) -> None:
    """Start a rebase only on a clean tree; continue only a conflicted one."""
    conflicted = _conflicted(root / pins.name, pins.replaces)
    again = f"{CLI} rebase --base-version {version}"
    if not resolved:
        if conflicted:
            raise po.OverlayError(
                f"{', '.join(conflicted)} still hold conflict markers.\nFix: "
                f"resolve them and run {again} --continue, or start over with "
                f"git checkout -- {pins.name}/"
            )
        return
    if state is None or state.get("version") != version:
        raise po.OverlayError(
            f"no conflicted rebase onto {version} to continue ({REBASE_STATE} "
            f"records none).\nFix: run {again}"
        )
    if conflicted:
        raise po.OverlayError(
            f"conflict markers are still in: {', '.join(conflicted)}.\nFix: "
            f"resolve them, then run {again} --continue"
        )
    unmerged = sorted(
        path
        for path, digest in state.get("before", {}).items()
        if (root / path).is_file() and _sha256((root / path).read_bytes()) == digest
    )
    if unmerged:
        raise po.OverlayError(
            f"{', '.join(unmerged)} are as they were before the rebase (undone "
            "with git checkout?), without upstream's changes.\nFix: run "
            f"{again} to merge them again"
        )


# --- CLI --------------------------------------------------------------------


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    """``python tools/precompiled_overlay.py {diff,rebase}`` on the repo at ``root``."""
    root = root or po.REPO_ROOT
    parser = argparse.ArgumentParser(
        prog="python tools/precompiled_overlay.py",
        description="Maintain the vLLM overlay against its upstream release.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "diff",
        help="print the patch as one unified diff against upstream's source "
        "(git apply applies it to vLLM's tree at base-version)",
    )
    rebase_parser = commands.add_parser(
        "rebase",
        help="merge a new upstream release into the replaced files and re-pin",
    )
    rebase_parser.add_argument("--base-version", required=True, metavar="X")
    rebase_parser.add_argument(
        "--continue",
        dest="resolved",
        action="store_true",
        help="after resolving conflicts: check no markers are left, then re-pin",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "diff":
            sys.stdout.write(diff_command(root))
            return 0
        return rebase(root, args.base_version, resolved=args.resolved)
    except po.OverlayError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
