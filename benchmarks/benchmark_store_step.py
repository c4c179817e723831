# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What fault-free steps (store_step.Step) cost vLLM's store, by group size:
store calls per rank and exchange, polls included (mean over ranks; max,
the last rank out's), the step's time on a TCPStore that rank 0 hosts, and
the bytes a step appends to a FileStore, whose append rewrites the whole
value. Last, a sleep/wake cycle at TP8 (0.7.4's mnnvl checkpoints: 2, 6).
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tree_imports  # noqa: E402

tree_imports.install()  # this tree, or the source a test run chose
import torch.distributed as dist  # noqa: E402

from vllm.distributed.device_communicators import store_step  # noqa: E402
from vllm.utils.network_utils import get_open_port  # noqa: E402

REPEATS = 3


class Counting:
    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str):
        self.calls += 1
        return getattr(self.store, name)


def rank_main(where: str, rank: int, size: int, steps, sync, results) -> None:
    """Runs `steps` on the TCPStore at port `where`, or the FileStore there."""
    raw: dist.Store
    if where.isdigit():
        timeout = timedelta(seconds=300)
        raw = dist.TCPStore("127.0.0.1", int(where), None, rank == 0, timeout, False)
    else:
        raw = dist.FileStore(where, size)
    store, last = Counting(dist.PrefixStore("vllm-fi-ar", raw)), ""
    sync.wait()  # every rank connected: the parent measures the file
    sync.wait()
    for i, (what, exchanges) in enumerate(steps):
        start, calls = time.monotonic(), store.calls
        step = store_step.Step(store, tuple(range(size)), rank, what, 300.0, last)

        def body(step=step, exchanges=exchanges) -> None:
            for _ in range(exchanges):
                step.exchange(0)

        ran = step.run(body)
        last, kept = step.nonce, ran[0] is store_step.Outcome.KEEP
        results.put((i, store.calls - calls, start, time.monotonic(), kept))
    sync.wait()  # rank 0 hosts a TCPStore until every rank is done with it


def run_group(size: int, steps, file: bool) -> tuple[list, int]:
    """Each rank's (step, calls, start, end, kept) per step; bytes appended."""
    ctx = mp.get_context("fork")
    results, sync = ctx.Queue(), ctx.Barrier(size + 1)
    where = tempfile.mktemp() if file else str(get_open_port())
    procs = [
        ctx.Process(target=rank_main, args=(where, r, size, steps, sync, results))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    try:
        sync.wait(300)
        before = os.path.getsize(where) if file else 0
        sync.wait(300)
        rows = [results.get(timeout=300) for _ in range(size * len(steps))]
        sync.wait(300)  # the ranks still hold the FileStore, so the file is there
        return rows, (os.path.getsize(where) if file else 0) - before
    finally:
        for proc in procs:
            proc.join(10)
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 72])
    parser.add_argument("--exchanges", type=int, default=12)
    args = parser.parse_args()
    steps, per = [("create", args.exchanges)] * REPEATS, max(args.exchanges, 1)
    print(f"{REPEATS} fault-free steps of {args.exchanges} exchanges each")
    print("ranks calls/rank/exch   max  step ms FileStore B  kept")
    for size in args.sizes:
        rows, _ = run_group(size, steps, file=False)
        file_rows, appended = run_group(size, steps, file=True)
        by_step = [[r for r in rows if r[0] == i] for i in range(REPEATS)]
        step_s = [max(r[3] for r in s) - min(r[2] for r in s) for s in by_step]
        print(
            f"{size:>5} {statistics.mean(r[1] for r in rows) / per:>15.2f} "
            f"{max(r[1] for r in rows) / per:>5.2f} "
            f"{statistics.median(step_s) * 1e3:>8.1f} {appended // REPEATS:>11} "
            f"{all(r[4] for r in rows + file_rows)!s:>5}"
        )
    rows, appended = run_group(8, [("prepare", 2), ("restore", 6)], file=True)
    print(f"a sleep/wake cycle at TP8: {appended} B, kept: {all(r[4] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
