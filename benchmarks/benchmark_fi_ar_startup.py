# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start-up cost of FlashInfer all-reduce backend selection: patch vs stock.

Runs one gloo group of `--ranks` processes on this machine for each module,
this tree's flashinfer_all_reduce.py and the vllm 0.34.0 original, and
measures what a worker does at start-up: backend resolution plus workspace
acquisition for the standalone all-reduce, the fusion pass and quant fusion.
FlashInfer's workspace constructor is the test suite's fake (one collective,
like FlashInfer's handle exchange), so only the selection logic is measured.

Reported per scenario and module: collective rounds (on the group, and
over its store where the patch runs FlashInfer's creation collectives
there), node probes, process groups made (a gloo group's creation is a
rendezvous of its ranks), and wall time (slowest rank, median over
`--repeats` fresh groups). The patch adds an agreement round, and per
creation a kernel-load vote and a vote on the outcome; it makes no process
group, and counts nodes once instead of on every resolve. The targets are
no more collective rounds than stock and no new process groups.

    python benchmarks/benchmark_fi_ar_startup.py --ranks 8
"""

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "distributed")]

import tree_imports  # noqa: E402
from fi_ar_utils import run_group  # noqa: E402

SCENARIOS: dict[str, dict[str, Any]] = {
    "auto": {},
    "hisparse": {"hisparse": "connector"},
}
MODULES = {"patched": "tree", "stock": "stock"}


def measure(
    source: str, scenario: dict[str, Any], ranks: int, repeats: int
) -> dict[str, float]:
    """Run the scenario `repeats` times on fresh groups with one module."""
    os.environ[tree_imports.SOURCE_ENV] = source
    cases = [{"name": f"run-{i}", **scenario} for i in range(repeats)]
    per_rank = run_group(cases, nnodes=1, ranks_per_node=ranks, timeout=900)
    runs = []
    for case in (c["name"] for c in cases):
        results = [rank[case] for rank in per_rank]
        for r in results:
            if "error" in r:
                raise RuntimeError(f"{source}: {r['error']}\n{r['traceback']}")
        runs.append(
            {
                "collectives": max(r["collectives"] for r in results),
                "node_probes": max(r["node_probes"] for r in results),
                "groups": max(r.get("groups", 0) for r in results),
                "seconds": max(r["seconds"] for r in results),
            }
        )
    return {
        key: statistics.median(run[key] for run in runs)
        for key in ("collectives", "node_probes", "groups", "seconds")
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    args = parser.parse_args()

    rows = []
    worse = False
    for name in args.scenario or list(SCENARIOS):
        got = {
            label: measure(source, SCENARIOS[name], args.ranks, args.repeats)
            for label, source in MODULES.items()
        }
        patched, stock = got["patched"], got["stock"]
        worse |= patched["collectives"] > stock["collectives"] or patched["groups"] > 0
        for label, m in got.items():
            rows.append(
                f"{name:<10} {label:<8} {m['collectives']:>11.0f} "
                f"{m['node_probes']:>11.0f} {m['groups']:>10.0f} "
                f"{m['seconds'] * 1e3:>10.1f}"
            )
        rows.append(
            f"{name:<10} {'ratio':<8} "
            f"{patched['collectives'] / stock['collectives']:>11.2f} "
            f"{patched['node_probes'] / stock['node_probes']:>11.2f} "
            f"{'':>10} {patched['seconds'] / stock['seconds']:>10.2f}"
        )
    print(f"{args.ranks}-rank gloo group, median of {args.repeats} fresh groups")
    print(
        f"{'scenario':<10} {'module':<8} {'collectives':>11} {'node probes':>11} "
        f"{'new groups':>10} {'wall ms':>10}"
    )
    print("\n".join(rows))
    if worse:
        print(
            "FAIL: the patch needs more collective rounds than stock, or makes groups"
        )
        return 1
    print("OK: no more collective rounds than stock, and no new process groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
