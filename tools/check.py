# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 2: the tree's files, and whether they still fit the base wheel.

Without the per-file pins, bumping ``base-version`` would build fine and
silently revert every upstream fix in a replaced file. So before the base
wheel is unpacked, this stage reads its file list and the replaced originals
and refuses, listing every reason at once:

* a file under ``vllm/`` that is not declared, or a symlink or other
  non-regular file there (a wheel holds regular files only);
* a file with conflict markers, or a Python file that does not compile;
* a replaced file whose upstream original is no longer the pinned one,
  showing upstream's diff, or which upstream no longer ships;
* an added file that upstream ships, or shadows by another import form (a
  package folder, an extension module, a ``.pyc``), because the installed
  wheel would then import upstream's module while the tests import ours;
* an entry of ``[tool.vllm-overlay.env-choices]`` or ``known-issues`` that
  names no ``"path:NAME"`` of a declared file.

When the base wheel pins the package of ``known-issues`` at or above every
known issue's ``fixed_in`` (read from the tree with ``ast``), it logs one
line: the workaround for them can be dropped.

Every verified original is kept in a small content-addressed store, so a pin
mismatch can show upstream's diff after the pins moved to a release without
the old file, and ``rebase`` finds the original its merge starts from.
"""

import ast
import contextlib
import difflib
import email.parser
import os
import re
import stat
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .pins import ADDS_KEY, CLI, CONFIG_TABLE, REPLACES_TABLE, Pins
from .util import OverlayError, log, sha256, write_atomic

ENV_CHOICES = f"[tool.{CONFIG_TABLE}.env-choices]"
KNOWN_ISSUES = f"[tool.{CONFIG_TABLE}.known-issues]"
ENV_VAR_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
# Specifier operators that put a floor under the versions they allow.
_FLOOR_OPERATORS = ("==", "===", ">=", ">", "~=")
SKIPPED_DIRS = frozenset({"__pycache__"})
SKIPPED_SUFFIXES = (".pyc",)
# The four line kinds of a diff3 conflict that git merge-file leaves.
CONFLICT_RE = re.compile(rb"^(?:(?:<{7}|\|{7}|>{7})(?: .*)?|={7})\r?$", re.M)


def collect_overlay(overlay_root: Path) -> list[Path]:
    """The tree's files relative to the wheel root (``vllm/...``), sorted.

    A symlink or other non-regular file is refused: the wheel and the sdist
    hold only regular files, while the tests would still import through it.
    """
    if not overlay_root.is_dir():
        raise OverlayError(
            f"nothing to overlay: {overlay_root} does not exist; it must hold "
            "the upstream files that this build replaces"
        )
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(overlay_root):
        odd += [Path(dirpath, d) for d in dirnames if os.path.islink(Path(dirpath, d))]
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIPPED_DIRS and Path(dirpath, d) not in odd
        )
        for filename in sorted(filenames):
            path = Path(dirpath, filename)
            if not stat.S_ISREG(path.lstat().st_mode):
                odd.append(path)
            elif not filename.endswith(SKIPPED_SUFFIXES):
                files.append(path.relative_to(overlay_root.parent))
    if odd:
        raise OverlayError(
            f"{', '.join(str(p.relative_to(overlay_root.parent)) for p in odd)}: "
            "a symlink or other non-regular file under vllm/, which a wheel "
            "cannot hold as it is.\nFix: replace it with a regular file (or folder)"
        )
    if not files:
        raise OverlayError(f"nothing to overlay: no files under {overlay_root}")
    return files


def tree_problems(pins: Pins, root: Path, files: Iterable[Path]) -> list[str]:
    """What is wrong with the tree itself, whatever the base wheel."""
    on_disk = {rel.as_posix() for rel in files}
    problems = [
        f"{path}: declared in pyproject.toml but not in the tree; restore the "
        "file or remove its entry"
        for path in sorted(pins.declared - on_disk)
    ]
    for path in sorted(pins.declared & on_disk):
        problems += broken(path, (root / path).read_bytes())
    return problems + declared_name_problems(pins)


def split_declared_name(value: object) -> tuple[str, str] | None:
    """``"vllm/a/b.py:NAME"`` -> its path and name; None if it is not one."""
    if not isinstance(value, str):
        return None
    path, _, name = value.rpartition(":")
    return (path, name) if path.endswith(".py") and name.isidentifier() else None


def declared_name_problems(pins: Pins) -> list[str]:
    """Entries of env-choices and known-issues that name no declared constant."""
    problems = [
        f"{ENV_CHOICES}: {var!r} is not an environment variable name"
        for var in pins.env_choices
        if not ENV_VAR_RE.fullmatch(var)
    ]
    named: list[tuple[str, object]] = [
        (f"{ENV_CHOICES}: {var}", v) for var, v in pins.env_choices.items()
    ]
    if pins.known_issues:
        keys = set(pins.known_issues)
        if keys != {"in", "package"} or not isinstance(
            pins.known_issues["package"], str
        ):
            problems.append(
                f"{KNOWN_ISSUES} must have exactly the keys in and package, e.g. "
                'in = "vllm/a/policy.py:KNOWN_ISSUES", package = "flashinfer-python"'
            )
        named.append((f"{KNOWN_ISSUES}: in", pins.known_issues.get("in")))
    for where, value in named:
        found = split_declared_name(value)
        if found is None or found[0] not in pins.declared:
            problems.append(
                f"{where} = {value!r} must name a constant in a declared file "
                'of the tree, as "vllm/path/to/module.py:NAME"'
            )
    return problems


def broken(path: str, data: bytes) -> list[str]:
    """Conflict markers left by a merge, or Python that does not compile."""
    marker = CONFLICT_RE.search(data)
    if marker is not None:
        line = data.count(b"\n", 0, marker.start()) + 1
        fix = f"resolve the conflict, then run {CLI} rebase --base-version X --continue"
        return [f"{path}: holds a conflict marker on line {line}.\nFix: {fix}"]
    if path.endswith(".py"):
        try:
            compile(data, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as err:
            where = getattr(err, "lineno", None)
            return [f"{path}: does not compile (line {where}): {err}"]
    return []


def import_names(members: Iterable[str]) -> dict[str, str]:
    """The modules a wheel's files make importable, each with one such file."""
    names: dict[str, str] = {}
    for member in members:
        parts = member.split("/")
        if "__pycache__" in parts or parts[0].endswith((".dist-info", ".data")):
            continue
        stem, dot, suffix = parts[-1].partition(".")
        extension = suffix in ("so", "pyd") or suffix.endswith((".so", ".pyd"))
        if dot and (suffix in ("py", "pyc") or extension):
            module = parts[:-1] if stem == "__init__" else [*parts[:-1], stem]
            names.setdefault(".".join(module), member)
    return names


def module_name(path: str) -> str | None:
    """``vllm/a/b.py`` -> ``vllm.a.b``; None for a file that is no module."""
    if not path.endswith(".py"):
        return None
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def release_problems(pins: Pins, zf: zipfile.ZipFile, wheel: str) -> list[str]:
    """An added file that the release ``zf`` ships or shadows."""
    shipped = set(zf.namelist())
    problems = []
    names = import_names(shipped)
    for path in sorted(pins.adds):
        if path in shipped:
            problems.append(
                f"{path}: declared as added, but {wheel} ships its own, which "
                "the overlay would silently overwrite.\nFix: merge upstream's "
                f"file into ours and move the entry from {ADDS_KEY} to "
                f'{REPLACES_TABLE} as "{path}" = "{sha256(zf.read(path))}", '
                "or rename our module"
            )
        elif (name := module_name(path)) in names:
            problems.append(
                f"{path}: declared as added, but {wheel} ships {names[name]}, "
                f"which the installed wheel would import as {name} instead of "
                "ours (the tests and editable installs import ours).\nFix: "
                "rename our module, or port our change into upstream's"
            )
    return problems


def check_base_wheel(
    pins: Pins,
    overlay_root: Path,
    files: Iterable[Path],
    base_wheel: Path,
    cache_dir: Path,
) -> dict[str, bytes]:
    """Refuse a base wheel the declared overlay does not fit; list every reason.

    Only the zip directory and the replaced members are read, so this runs
    before the wheel is unpacked. Returns upstream's replaced originals.
    """
    files = list(files)
    problems = tree_problems(pins, overlay_root.parent, files)
    originals: dict[str, bytes] = {}
    with zipfile.ZipFile(base_wheel) as zf:
        shipped = set(zf.namelist())
        for rel in files:
            if rel.as_posix() not in pins.declared:
                problems.append(_undeclared(rel.as_posix(), zf, shipped))
        problems += release_problems(pins, zf, base_wheel.name)
        for path, pin in sorted(pins.replaces.items()):
            if path not in shipped:
                problems.append(
                    f"{path}: declared as replaced, but {base_wheel.name} does not "
                    "ship it (upstream removed or renamed it), so it is no drop-in.\n"
                    "Fix: port the change to upstream's new layout; if the file is "
                    f"new code now, move it to {ADDS_KEY}"
                )
            elif sha256(data := zf.read(path)) == pin:
                originals[path] = data
            else:
                problems.append(_moved_upstream(path, pin, data, pins, cache_dir))
        metadata = wheel_metadata(zf)
    if problems:
        raise OverlayError(
            f"the overlay does not fit the base wheel {base_wheel.name}; "
            "nothing was built:\n" + "\n".join(f"- {p}" for p in problems)
        )
    remember(originals.values(), cache_dir)
    retired = known_issues_retired(pins, overlay_root.parent, [metadata])
    if retired:
        log(retired)
    return originals


def _undeclared(path: str, zf: zipfile.ZipFile, shipped: set[str]) -> str:
    if path not in shipped:
        return (
            f"{path}: not declared in pyproject.toml, and upstream does not ship "
            "it, so it is no drop-in replacement.\n"
            f"Fix: if it is a new module, list it in {ADDS_KEY}; otherwise rename "
            "or remove it"
        )
    return (
        f"{path}: not declared in pyproject.toml. It replaces upstream's file; "
        f'pin that in {REPLACES_TABLE}:\n  "{path}" = "{sha256(zf.read(path))}"'
    )


def _moved_upstream(
    path: str, pin: str, data: bytes, pins: Pins, cache_dir: Path
) -> str:
    """Say what upstream changed and how to take it in, instead of reverting it."""
    rebase = f"{CLI} rebase --base-version {pins.base_version}"
    head = (
        f"{path}: upstream's file changed since this overlay was written against "
        "it; building would silently revert that change.\n"
        f"  pinned original sha256: {pin}\n"
        f"  {pins.requirement}'s sha256:  {sha256(data)}\n"
    )
    pinned = recall(pin, cache_dir)
    if pinned is None:
        return head + (
            "  (the pinned original is not cached here, so upstream's diff cannot "
            "be shown)\nFix: put base-version and [tool.vllm-overlay.sha256] back "
            "to the release these file pins were written against (git stash "
            f"push -- pyproject.toml keeps your edit), then run:\n  {rebase}"
        )
    diff = unified_diff(
        pinned,
        data,
        path,
        f"a/{path} (pinned original)",
        f"b/{path} ({pins.requirement})",
    )
    return head + (
        "  upstream's change:\n"
        + "".join("    " + line for line in diff.splitlines(keepends=True))
        + f"Fix: merge it into this file and re-pin, with:\n  {rebase}"
    )


def unified_diff(before: bytes, after: bytes, path: str, a: str, b: str) -> str:
    """A unified diff that ``git apply`` reads back byte for byte."""
    lines = difflib.unified_diff(_lines(before, path), _lines(after, path), a, b)
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in lines
    )


def _lines(data: bytes, path: str) -> list[str]:
    """Split on newlines only: str.splitlines would also split on \\f and more."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise OverlayError(f"{path} is not UTF-8 text; cannot diff it") from None
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def originals_dir(cache_dir: Path) -> Path:
    """Beside the cached wheels, so whoever clears one clears the other."""
    return cache_dir / "originals"


def remember(originals: Iterable[bytes], cache_dir: Path) -> None:
    """Keep verified originals by sha256; losing this cache only costs a diff."""
    store = originals_dir(cache_dir)
    try:
        store.mkdir(parents=True, exist_ok=True)
        for data in originals:
            if not (store / sha256(data)).is_file():
                write_atomic(store / sha256(data), data)
    except OSError as err:
        log(f"not caching originals: {err}")


def recall(digest: str, cache_dir: Path) -> bytes | None:
    """An original by its sha256, or None; a damaged entry counts as missing."""
    try:
        data = (originals_dir(cache_dir) / digest).read_bytes()
    except OSError:
        return None
    return data if sha256(data) == digest else None


def read_release(
    pins: Pins, wheels: Mapping[str, Path]
) -> tuple[dict[str, bytes], list[str]]:
    """A new release's originals of the replaced files, and what stops a rebase.

    The wheels of one release must agree on them: one merge serves them all.
    """
    found: dict[str, dict[str, bytes | None]] = {p: {} for p in pins.replaces}
    problems = []
    for name, wheel in sorted(wheels.items()):
        with zipfile.ZipFile(wheel) as zf:
            shipped = set(zf.namelist())
            for path in pins.replaces:
                found[path][name] = zf.read(path) if path in shipped else None
            problems += release_problems(pins, zf, name)
    originals: dict[str, bytes] = {}
    for path, per_wheel in sorted(found.items()):
        copies = set(per_wheel.values())
        if copies == {None}:
            problems.append(
                f"{path}: the new release does not ship it (removed or renamed "
                "upstream); port the change to upstream's new layout by hand"
            )
        elif len(copies) > 1:
            listed = ", ".join(
                f"{name}: {sha256(d) if d is not None else 'missing'}"
                for name, d in sorted(per_wheel.items())
            )
            problems.append(f"{path}: the new wheels disagree on it ({listed})")
        elif (data := copies.pop()) is not None:
            originals[path] = data
    return originals, problems


def wheel_metadata(zf: zipfile.ZipFile) -> bytes:
    """A wheel's ``*.dist-info/METADATA``; empty if it has none."""
    for member in zf.namelist():
        top, _, rest = member.partition("/")
        if top.endswith(".dist-info") and rest == "METADATA":
            return zf.read(member)
    return b""


def pinned_floor(metadata: bytes, package: str) -> tuple[str, Version] | None:
    """The lowest ``package`` release a wheel's Requires-Dist allows, if bounded.

    Every requirement on the package counts (markers and extras too), so the
    floor is the lowest any of them allows: ``==0.7.4`` and ``>=0.7.4`` give
    0.7.4; no requirement, or one without a floor (``<1``), gives None.
    """
    headers = email.parser.BytesParser().parsebytes(metadata, headersonly=True)
    floors = []
    for line in headers.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != canonicalize_name(package):
            continue
        bounds = []
        for spec in req.specifier:
            if spec.operator in _FLOOR_OPERATORS:
                with contextlib.suppress(InvalidVersion):
                    bounds.append(Version(spec.version.removesuffix(".*")))
        if not bounds:
            return None
        floors.append((f"{req.name}{req.specifier}", max(bounds)))
    return min(floors, key=lambda found: found[1]) if floors else None


def assigned_value(source: bytes, name: str) -> ast.expr | None:
    """The expression a module assigns to ``name`` at its top level, if any."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if node.value is not None and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            return node.value
    return None


def known_issue_fixes(pins: Pins, root: Path) -> list[tuple[str, str | None]]:
    """(name, fixed_in) of each known issue the tree declares, read statically.

    Each entry is a call with a ``fixed_in=`` keyword (a version string, or
    None while unreleased) inside the constant that known-issues names; the
    tree is not imported, so this works for any base and without vLLM.
    """
    declared = split_declared_name(pins.known_issues.get("in"))
    if declared is None:
        return []
    path, name = declared
    where = f"{path}: {name} (in of {KNOWN_ISSUES})"
    value = assigned_value((root / path).read_bytes(), name)
    if value is None:
        raise OverlayError(
            f"{where} is not assigned at module level.\nFix: point in at the "
            "constant that lists the known issues"
        )
    fixes: list[tuple[str, str | None]] = []
    for node in ast.walk(value):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if "fixed_in" not in keywords:
            continue
        fixed_in = _literal(keywords["fixed_in"])
        if fixed_in is not None and not _is_version(fixed_in):
            raise OverlayError(
                f"{where}: the fixed_in on line {node.lineno} is not a version "
                'string or None.\nFix: write it as a literal, e.g. fixed_in="0.7.4"'
            )
        label = _literal(keywords.get("name", ast.Constant(None)))
        fixes.append(
            (
                label if isinstance(label, str) else f"line {node.lineno}",
                fixed_in if isinstance(fixed_in, str) else None,
            )
        )
    return fixes


def _is_version(value: object) -> bool:
    try:
        Version(value)  # type: ignore[arg-type]
    except (InvalidVersion, TypeError):
        return False
    return True


def _literal(node: ast.expr) -> object:
    """A literal's value; Ellipsis for an expression that is not one."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


def known_issues_retired(
    pins: Pins, root: Path, metadata: Iterable[bytes], base: str | None = None
) -> str:
    """One line when the base pins a release with every known issue's fix.

    ``metadata`` holds the METADATA of each of the base's wheels; every one
    must pin the package at or above every ``fixed_in``. Empty otherwise.
    """
    fixes = known_issue_fixes(pins, root)
    if not fixes or any(fixed_in is None for _, fixed_in in fixes):
        return ""
    needed = max(Version(fixed_in) for _, fixed_in in fixes if fixed_in)
    pins_found = []
    for data in metadata:
        floor = pinned_floor(data, pins.known_issues["package"])
        if floor is None or floor[1] < needed:
            return ""
        pins_found.append(floor[0])
    if not pins_found:
        return ""
    pin = pins_found[0]
    issues = ", ".join(f"{name} fixed in {fixed_in}" for name, fixed_in in fixes)
    drop_when = [
        path
        for path in sorted(pins.replaces)
        if re.search(rb"^# Drop-When:", (root / path).read_bytes(), re.M)
    ]
    return (
        f"{base or pins.requirement} retires the known issues: it pins {pin}, "
        "at or above the fixed_in of every entry of "
        f"{pins.known_issues['in']} ({issues}), so the part of the patch that "
        "steers around them can be dropped (see Drop-When in the DEP-3 header "
        f"of {', '.join(drop_when) or 'the replaced files'})"
    )
