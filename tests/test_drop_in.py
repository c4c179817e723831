# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each file under vllm/ is a drop-in for its upstream original.

The rest of vLLM imports names from these files, so every top-level name
the original defines must still be there (the names it imports are its own
business), and every function and method must take the original's
parameters: the same ones first, any added one with a default.
"""

import ast
import difflib
import itertools
import subprocess
import zipfile
from pathlib import Path

import pytest
import tree_imports

from tools import check, fetch
from tools.pins import load_pins

Signatures = dict[str, list[str]]


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Each parameter with its default, if any: `dtype=None`."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    names = [
        a.arg + (f"={ast.unparse(d)}" if d else "")
        for a, d in zip(positional, defaults, strict=True)
    ]
    names += [f"*{args.vararg.arg}"] if args.vararg else []
    names += [
        a.arg + (f"={ast.unparse(d)}" if d else "")
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    names += [f"**{args.kwarg.arg}"] if args.kwarg else []
    return names


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, including those under top-level try/if."""
    flat = []
    for stmt in body:
        flat.append(stmt)
        if isinstance(stmt, ast.Try):
            flat += _statements(stmt.body + stmt.orelse + stmt.finalbody)
            for handler in stmt.handlers:
                flat += _statements(handler.body)
        elif isinstance(stmt, ast.If):
            flat += _statements(stmt.body + stmt.orelse)
    return flat


def _top_level(path: Path) -> tuple[set[str], Signatures]:
    """Top-level names defined, and the parameters of functions and methods."""
    names: set[str] = set()
    signatures: Signatures = {}
    for stmt in _statements(ast.parse(path.read_text()).body):
        if isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)
            signatures[stmt.name] = _parameters(stmt)
        elif isinstance(stmt, ast.ClassDef):
            names.add(stmt.name)
            for item in stmt.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    signatures[f"{stmt.name}.{item.name}"] = _parameters(item)
    return names, signatures


@pytest.fixture(scope="module")
def stock() -> Path:
    return tree_imports.stock_root()


@pytest.mark.parametrize("relative", tree_imports.replaced_files(), ids=str)
def test_replaced_file_keeps_upstream_names_and_signatures(stock, relative):
    ours_names, ours_signatures = _top_level(tree_imports.REPO_ROOT / relative)
    upstream_names, upstream_signatures = _top_level(stock / relative)
    assert upstream_names - ours_names == set()
    for name, parameters in upstream_signatures.items():
        ours = ours_signatures.get(name, [])
        assert ours[: len(parameters)] == parameters, name
        assert all("=" in p for p in ours[len(parameters) :]), name


def test_replaced_file_opens_with_a_dep3_header():
    fields = ("Description:", "Bug:", "Origin:", "Forwarded:", "Base: vllm==")
    fields += ("Last-Update:", "Applied-Upstream:", "Drop-When:")
    for relative in tree_imports.replaced_files():
        lines = (tree_imports.REPO_ROOT / relative).read_text().splitlines()
        header = "\n".join(itertools.takewhile(lambda x: x.startswith("#"), lines))
        for field in fields:
            assert f"# {field}" in header, f"{relative}: no {field} line"


# A replaced file carries only the change; new logic goes in added modules.
MAX_CHANGED_LINES = 120


@pytest.mark.parametrize("relative", tree_imports.replaced_files(), ids=str)
def test_replaced_file_carries_only_the_change(stock, relative):
    ours = (tree_imports.REPO_ROOT / relative).read_text().splitlines()
    upstream = (stock / relative).read_text().splitlines()
    changed = [
        line
        for line in difflib.unified_diff(upstream, ours, lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert len(changed) <= MAX_CHANGED_LINES, (
        f"{relative} differs from upstream by {len(changed)} lines added plus "
        f"removed; move new logic into an added module beside it"
    )


def test_every_file_is_declared_and_fits_the_base_wheel():
    # The build's own check, on the real pinned wheel: a file under vllm/
    # missing from pyproject.toml, a stale pin, or a tools/base_wheel_METADATA
    # that is not the wheel's (pip is given it before the build) fails here.
    pins = load_pins()
    files = check.check_tree(pins, tree_imports.REPO_ROOT / "vllm")
    originals = check.check_base_wheel(pins, files, fetch.fetch_base_wheel(pins))
    assert sorted(originals) == sorted(pins.replaces)
    with zipfile.ZipFile(fetch.fetch_base_wheel(pins)) as zf:
        assert check.wheel_metadata(zf) == pins.base_metadata


def test_diff_applied_to_upstream_gives_back_our_files(tmp_path):
    pins = load_pins()
    proc = tree_imports.run_tool(tree_imports.REPO_ROOT, "diff", timeout=300)
    assert proc.returncode == 0, proc.stderr
    source = tree_imports.extract_base_files(
        pins.replaces, tmp_path / "upstream", fetch.fetch_base_wheel(pins)
    )
    (tmp_path / "overlay.diff").write_text(proc.stdout)
    subprocess.run(
        ["git", "apply", str(tmp_path / "overlay.diff")],
        cwd=source,
        check=True,
        timeout=60,
    )
    for relative in [*pins.replaces, *pins.adds]:
        ours = (tree_imports.REPO_ROOT / relative).read_bytes()
        assert (source / relative).read_bytes() == ours, relative
