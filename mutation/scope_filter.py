# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cosmic-ray filter: mutate only the fix, and skip known equivalent mutants.

Marks work items SKIPPED in a session, as cosmic-ray's own `cr-filter-*`
tools do, for mutants that are

* outside the fix: in a replaced file, on a line that upstream's original
  also has (`changed-lines-only`), since upstream's untouched code is not
  ours to test; in any file, inside a type annotation, which Python does
  not evaluate into behaviour;
* equivalent: listed under `[[cosmic-ray.filters.equivalent]]` with the
  operator, the mutated line's text and a one-line reason, so a run does not
  report them again. Matching the line's text, not its number, keeps an
  entry valid while the file around it changes.

    python mutation/scope_filter.py SESSION.sqlite --config CONFIG.toml
"""

import ast
import difflib
import logging
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Iterable
from pathlib import Path

from cosmic_ray.config import ConfigDict, load_config
from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_db import WorkDB
from cosmic_ray.work_item import MutationSpec, WorkerOutcome, WorkResult

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


def upstream_original(module_path: str) -> Path:
    """Upstream's original of a replaced file, from the pinned base wheel."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import tree_imports

    return tree_imports.stock_root() / module_path


def changed_lines(ours: str, upstream: str) -> set[int]:
    """1-based numbers of our lines that upstream's original does not have."""
    matcher = difflib.SequenceMatcher(
        a=upstream.splitlines(), b=ours.splitlines(), autojunk=False
    )
    return {
        line + 1
        for tag, _, _, j1, j2 in matcher.get_opcodes()
        if tag in ("replace", "insert")
        for line in range(j1, j2)
    }


def _spans(nodes: Iterable[ast.AST]) -> list[tuple[int, int, int, int]]:
    return [
        (n.lineno, n.col_offset, n.end_lineno or n.lineno, n.end_col_offset or 0)
        for n in nodes
    ]


def annotation_spans(tree: ast.Module) -> list[tuple[int, int, int, int]]:
    """Where the type annotations are: `str | None` is not a computation."""
    annotations: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation:
            annotations.append(node.annotation)
        elif (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.returns is not None
        ):
            annotations.append(node.returns)
    return _spans(annotations)


# Comparisons whose negation is itself one of the comparison mutants.
_NEGATED_BY_ROR = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def negated_comparisons(tree: ast.Module) -> set[tuple[int, int]]:
    """Where a condition is one comparison that a comparison mutant negates.

    `AddNot` there (`if not (x is None)`) is the same program as the
    `Is_IsNot` mutant (`if x is not None`): running both costs a test run
    and counts one bug twice.
    """
    return {
        (node.test.lineno, node.test.col_offset)
        for node in ast.walk(tree)
        if isinstance(node, ast.If | ast.While | ast.IfExp)
        and isinstance(node.test, ast.Compare)
        and len(node.test.ops) == 1
        and isinstance(node.test.ops[0], _NEGATED_BY_ROR)
    }


def _inside(pos: tuple[int, int], span: tuple[int, int, int, int]) -> bool:
    line, col = pos
    start_line, start_col, end_line, end_col = span
    return (start_line, start_col) <= (line, col) < (end_line, end_col)


class ScopeFilter(FilterApp):
    """Skip mutants outside the fix and mutants known to be equivalent."""

    def description(self) -> str:
        return __doc__ or ""

    def add_args(self, parser: ArgumentParser) -> None:
        parser.add_argument("--config", required=True, help="Config file to use")

    def filter(self, work_db: WorkDB, args: Namespace) -> None:
        config = load_config(args.config)
        module_path = config["module-path"]
        source = (REPO_ROOT / module_path).read_text(encoding="utf-8")
        scope = config.sub("filters", "scope")
        out_of_scope = self._out_of_scope(module_path, source, scope)
        equivalents = [
            entry
            for entry in config.sub("filters").get("equivalent", [])
            if entry["module-path"] == module_path
        ]
        lines = source.splitlines()
        unused = {entry["reason"] for entry in equivalents}
        for item in list(work_db.pending_work_items):
            [mutation] = item.mutations
            why = out_of_scope(mutation)
            if why is None:
                entry = self._equivalent(mutation, lines, equivalents)
                if entry is not None:
                    unused.discard(entry["reason"])
                    why = f"equivalent: {entry['reason']}"
            if why is not None:
                log.info("skipping %s: %s", _describe(mutation), why)
                work_db.set_result(
                    item.job_id,
                    WorkResult(output=why, worker_outcome=WorkerOutcome.SKIPPED),
                )
        for reason in sorted(unused):
            # A stale entry would hide a future mutant that is not equivalent.
            log.warning("equivalent entry matches no mutant: %s", reason)

    @staticmethod
    def _out_of_scope(module_path: str, source: str, scope: ConfigDict):
        """A function saying why a mutation is outside the fix, or None."""
        tree = ast.parse(source)
        annotations = annotation_spans(tree)
        negated = negated_comparisons(tree)
        ours = None
        if scope.get("changed-lines-only", False):
            upstream = upstream_original(module_path).read_text(encoding="utf-8")
            ours = changed_lines(source, upstream)

        def why(mutation: MutationSpec) -> str | None:
            start = tuple(mutation.start_pos)
            if ours is not None and not (
                set(range(start[0], mutation.end_pos[0] + 1)) & ours
            ):
                return "out of scope: upstream's unchanged code"
            if any(_inside(start, span) for span in annotations):
                return "out of scope: type annotation"
            if mutation.operator_name == "core/AddNot" and start in negated:
                return "duplicate: the comparison mutant negates this condition"
            return None

        return why

    @staticmethod
    def _equivalent(mutation: MutationSpec, lines: list[str], equivalents):
        text = lines[mutation.start_pos[0] - 1].strip()
        for entry in equivalents:
            if entry["operator"] == mutation.operator_name and entry["line"] == text:
                return entry
        return None


def _describe(mutation: MutationSpec) -> str:
    line, col = mutation.start_pos
    return f"{mutation.module_path}:{line}:{col} {mutation.operator_name}"


def main(argv: list[str] | None = None) -> int:
    """Run the filter on a session, as cosmic-ray's `cr-filter-*` tools do."""
    return ScopeFilter().main(argv)


if __name__ == "__main__":
    sys.exit(main())
