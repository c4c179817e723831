# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/benchmark_store_step.py at 2 and 8 ranks, against the bar for
the step's store load: at most 10 store calls per rank per exchange (polls
included). That no call blocks and no key is left is test_store_step.py's.

The bar is per exchange of a creation (about 12 exchanges): with fewer, the
step's fixed calls (claim, join, vote, the last rank's deletes) dominate the
per-exchange figure, so the run keeps 12.
It runs in its own session under a hard timeout that kills every rank.
"""

import sys
from pathlib import Path

import tree_imports

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_store_step.py"
SIZES = (2, 8)
CALLS_PER_EXCHANGE = 10


def test_store_calls_per_rank_per_exchange_meet_the_bar() -> None:
    cmd = [sys.executable, str(SCRIPT), "--sizes", *map(str, SIZES)]
    run = tree_imports.run_in_session([*cmd, "--exchanges", "12"], timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    lines = run.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["ranks"])
    rows = {int(line.split()[0]): line.split() for line in lines[header + 1 :][:2]}
    assert sorted(rows) == list(SIZES), run.stdout
    for size, (_, mean, most, _, _, kept) in rows.items():
        assert float(mean) <= CALLS_PER_EXCHANGE, f"{size} ranks: {mean} calls"
        assert float(most) <= CALLS_PER_EXCHANGE, f"{size} ranks: {most} (max)"
        assert kept == "True", run.stdout
    assert lines[-1].startswith("a sleep/wake cycle at TP8: "), run.stdout
    assert lines[-1].endswith("kept: True"), run.stdout
