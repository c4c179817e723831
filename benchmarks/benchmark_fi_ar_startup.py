# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a FlashInfer all-reduce workspace creation costs vLLM's store and the
clock, at each TP size, with this tree and with an earlier commit's.

Runs one gloo group of N ranks on this machine per TP size and tree, and what
a worker does at start-up: the backend's agreement, then the workspaces of
the standalone all-reduce, the fusion pass and quant fusion (one mnnvl
creation). FlashInfer's constructor is the test suite's fake (two exchanges
through the comm backend); one rank comes `--slow` seconds late to them, as
ranks do, so that what waiting costs shows. Reported per TP size and tree:
the store requests of the creation (all ranks together: every call on a
PrefixStore it makes) and its wall time (slowest rank), medians over
`--repeats` fresh groups.

    python benchmarks/benchmark_fi_ar_startup.py --tp 2 8 16 --before 7c69a3b
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "distributed")]

import tree_imports  # noqa: E402
from fi_ar_utils import run_group  # noqa: E402


def measure(source: str, tp: int, slow: float, repeats: int) -> dict[str, float]:
    """Run the creation `repeats` times on fresh groups of `tp` ranks."""
    os.environ[tree_imports.SOURCE_ENV] = source
    late = {"1": {"late_seconds": slow}}
    cases: list[dict[str, Any]] = [
        {"name": f"run-{i}", "per_rank": late} for i in range(repeats)
    ]
    per_rank = run_group(cases, nnodes=1, ranks_per_node=tp, timeout=1200)
    runs = []
    for case in (c["name"] for c in cases):
        results = [rank[case] for rank in per_rank]
        for r in results:
            if "error" in r or r.get("workspace") != "mnnvl":
                raise RuntimeError(f"{source}: {r.get('error')}\n{r.get('traceback')}")
        runs.append(
            {
                "requests": sum(r["store_requests"] for r in results),
                "seconds": max(r["seconds"] for r in results),
            }
        )
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def checkout(ref: str, into: Path) -> Path:
    """This repository's `vllm/` at `ref`, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "vllm"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--before", metavar="REF", help="a commit to compare with")
    parser.add_argument("--slow", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fi-ar-before-") as tmp:
        trees: dict[str, Any] = {"this tree": "tree"}
        if args.before:
            trees[args.before] = str(checkout(args.before, Path(tmp)))
        print(
            f"one mnnvl creation, one rank {args.slow:g} s late; "
            f"median of {args.repeats} fresh groups"
        )
        print(f"{'TP':>3} {'tree':<10} {'store requests':>15} {'wall ms':>9}")
        for tp in args.tp:
            for label, source in trees.items():
                m = measure(source, tp, args.slow, args.repeats)
                print(
                    f"{tp:>3} {label:<10} {m['requests']:>15.0f} "
                    f"{m['seconds'] * 1e3:>9.0f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
