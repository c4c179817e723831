# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m tools diff|rebase``, run from the repository's root."""

import argparse
import sys
from pathlib import Path

from .check import check_base_wheel, check_tree
from .fetch import fetch_base_wheel
from .pins import CLI, DIST_NAME, REPO_ROOT, load_pins
from .rebase import rebase, unified_diff
from .util import OverlayError


def diff(root: Path) -> str:
    """The patch that, applied to upstream's tree at base-version with ``git
    apply``, gives back the tree's files byte for byte; checked as a build."""
    pins = load_pins(root / "pyproject.toml")
    files = check_tree(pins, root / DIST_NAME)
    originals = check_base_wheel(pins, files, fetch_base_wheel(pins))
    chunks = []
    for path in sorted(pins.declared):
        before, after = originals.get(path), (root / path).read_bytes()
        if before != after:
            chunks.append(f"diff --git a/{path} b/{path}\n")
            chunks += ["new file mode 100644\n"] if before is None else []
            a = "/dev/null" if before is None else f"a/{path}"
            chunks.append(unified_diff(before or b"", after, path, a, f"b/{path}"))
    return "".join(chunks)


def main(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    parser = argparse.ArgumentParser(prog=CLI)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("diff", help="the patch against upstream, for git apply")
    rebase_parser = commands.add_parser("rebase", help="move onto a new release")
    rebase_parser.add_argument("--base-version", required=True, metavar="X")
    rebase_parser.add_argument("--continue", dest="resolved", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "diff":
            sys.stdout.write(diff(root))
            return 0
        return rebase(root, args.base_version, resolved=args.resolved)
    except OverlayError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
