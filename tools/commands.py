# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The maintainer commands: ``python -m tools diff`` and ``rebase``."""

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from .check import check_base_wheel, collect_overlay, unified_diff
from .fetch import default_cache_dir, fetch_base_wheel
from .pins import CLI, REPO_ROOT, Pins, load_pins
from .rebase import rebase
from .util import OverlayError


def diff(root: Path, cache_dir: Path | None = None) -> str:
    """Check the overlay against its base exactly as the build does, then diff."""
    pins = load_pins(root / "pyproject.toml")
    cache_dir = cache_dir or default_cache_dir()
    files = collect_overlay(root / pins.name)
    base = fetch_base_wheel(pins, cache_dir=cache_dir)
    originals = check_base_wheel(pins, root / pins.name, files, base, cache_dir)
    return render_patch(pins, root, originals)


def render_patch(pins: Pins, root: Path, originals: Mapping[str, bytes]) -> str:
    """The overlay as one patch that ``git apply`` applies to upstream's tree.

    Replaced files are diffed against their originals; added files are
    created. Applied to upstream's originals it gives back the tree's files
    byte for byte.
    """
    chunks = []
    for path in sorted(pins.declared):
        before, after = originals.get(path), (root / path).read_bytes()
        if before == after:
            continue
        chunks.append(f"diff --git a/{path} b/{path}\n")
        if before is None:
            chunks.append("new file mode 100644\n")
        a = "/dev/null" if before is None else f"a/{path}"
        chunks.append(unified_diff(before or b"", after, path, a, f"b/{path}"))
    return "".join(chunks)


def main(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    """``python -m tools {diff,rebase}`` on the repository at ``root``."""
    parser = argparse.ArgumentParser(
        prog=CLI, description="Maintain the vLLM overlay against its upstream release."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "diff",
        help="print the patch as one unified diff against upstream's source "
        "(git apply applies it to vLLM's tree at base-version)",
    )
    rebase_parser = commands.add_parser(
        "rebase", help="merge a new upstream release into the replaced files and re-pin"
    )
    rebase_parser.add_argument("--base-version", required=True, metavar="X")
    rebase_parser.add_argument(
        "--continue",
        dest="resolved",
        action="store_true",
        help="after resolving conflicts: check the files hold upstream's "
        "change, then re-pin",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "diff":
            sys.stdout.write(diff(root))
            return 0
        return rebase(root, args.base_version, resolved=args.resolved)
    except OverlayError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
