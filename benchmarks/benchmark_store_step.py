# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What one fault-free step (store_step.Step) costs vLLM's store, by group size.

Ranks are processes forked from this one once it imported torch and the
tree's step module; each runs `--repeats` steps of `--exchanges` exchanges
(FlashInfer's trtllm creation makes about 12) through a proxy counting its
store calls. Columns: store calls of a step (polls included) per rank and
exchange, the mean over ranks and the max (the last rank out also deletes
the keys); blocking calls (get/wait/multi_get) among them; the step's wall
time, first rank in to last out, median over the steps (these on a TCPStore
this process hosts, as rank 0's does in vLLM); the bytes a step appends to a
FileStore's file (vLLM's multiproc executor on one node), which never
shrinks (append rewrites the whole value, a delete adds a tombstone); keys
left in both stores; whether every step kept. Last, one sleep/wake cycle at
TP8 on a FileStore: checkpoint_prepare (2 exchanges: the two barriers of
FlashInfer 0.7.4's mnnvl prepare) and checkpoint_restore (6, counted in
0.7.4's mnnvl.py with FABRIC handles: the handle type, 3 to create and
import, the multicast broadcast, a barrier).

    python benchmarks/benchmark_store_step.py --sizes 2 8 72 --exchanges 12
"""

import argparse
import multiprocessing as mp
import os
import shutil
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

BLOCKING = {"get", "wait", "multi_get"}
TIMEOUT = timedelta(seconds=600)
FIELDS = 5  # per rank and step (after go, port): calls, blocking, start, end, kept


class Counting:
    def __init__(self, store) -> None:
        self.store, self.calls, self.blocking = store, 0, 0

    def __getattr__(self, name: str):
        def call(*args):
            self.calls += 1
            self.blocking += name in BLOCKING
            return getattr(self.store, name)(*args)

        return call


def rank_main(kind: str, path: str, rank: int, size: int, steps, cells) -> None:
    while kind == "tcp" and not cells[1]:  # the port of the parent's store
        time.sleep(0.002)
    raw: dist.Store
    if kind == "file":
        raw = dist.FileStore(path, size)
    else:
        raw = dist.TCPStore("127.0.0.1", int(cells[1]), None, False, TIMEOUT, False)
    store, last = Counting(dist.PrefixStore("vllm-fi-ar", raw)), ""
    for i, (what, exchanges) in enumerate(steps):
        while cells[0] < i + 1:  # the parent's go
            time.sleep(0.002)
        start, calls, blocking = time.monotonic(), store.calls, store.blocking
        step = store_step.Step(store, tuple(range(size)), rank, what, 600.0, last)

        def body(step=step, exchanges=exchanges) -> None:
            for x in range(exchanges):
                step.exchange((rank, x))

        kept = step.run(body)[0] is store_step.Outcome.KEEP
        at, last = 2 + (i * size + rank) * FIELDS, step.nonce
        row = [store.calls - calls, store.blocking - blocking, start]
        cells[at : at + FIELDS] = [*row, time.monotonic(), kept]
    os._exit(0)


def run_group(kind: str, size: int, steps) -> list[dict]:
    """`size` forked ranks running `steps` ((what, exchanges), ...)."""
    folder = tempfile.mkdtemp(prefix="store-step-")
    path = os.path.join(folder, "store")
    ctx = mp.get_context("fork")
    cells = ctx.RawArray("d", 2 + len(steps) * size * FIELDS)
    procs = [
        ctx.Process(target=rank_main, args=(kind, path, r, size, steps, cells))
        for r in range(size)
    ]
    for proc in procs:  # before the TCPStore's threads: a fork copies no lock
        proc.start()
    store: dist.Store
    if kind == "file":
        store = dist.FileStore(path, size + 1)
    else:
        store = host = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, False)
        cells[1] = host.port
    keys, out = store.num_keys(), []
    grown = (lambda: os.path.getsize(path)) if kind == "file" else (lambda: 0)
    try:
        for i in range(len(steps)):
            before = grown()
            cells[0] = i + 1
            at = [2 + (i * size + r) * FIELDS for r in range(size)]
            while not all(cells[a + 3] for a in at):
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank of {size} died")
                time.sleep(0.005)
            rows = [cells[a : a + FIELDS] for a in at]
            calls, blocking, starts, ends, kept = zip(*rows, strict=True)
            out.append(dict(calls=calls, blocking=sum(blocking), kept=all(kept)))
            out[-1].update(seconds=max(ends) - min(starts), bytes=grown() - before)
        for proc in procs:
            proc.join(60)
        out[-1]["keys_left"] = store.num_keys() - keys
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 72])
    parser.add_argument("--exchanges", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps = [("create", args.exchanges)] * args.repeats
    print(f"a fault-free step of {args.exchanges} exchanges, {args.repeats} steps")
    print(
        f"{'ranks':>5} {'calls/rank/exch':>15} {'max':>5} {'blocking':>8} "
        f"{'step ms':>8} {'FileStore B':>11} {'keys left':>9} {'kept':>5}"
    )
    for size in args.sizes:
        tcp, file = run_group("tcp", size, steps), run_group("file", size, steps)
        per = max(args.exchanges, 1)
        mean = statistics.mean(sum(s["calls"]) / size / per for s in tcp)
        print(
            f"{size:>5} {mean:>15.2f} {max(max(s['calls']) for s in tcp) / per:>5.2f} "
            f"{sum(s['blocking'] for s in tcp):>8.0f} "
            f"{statistics.median(s['seconds'] for s in tcp) * 1e3:>8.1f} "
            f"{statistics.median(s['bytes'] for s in file):>11.0f} "
            f"{tcp[-1]['keys_left'] + file[-1]['keys_left']:>9} "
            f"{all(s['kept'] for s in tcp + file)!s:>5}"
        )
    cycle = [("checkpoint_prepare", 2), ("checkpoint_restore", 6)]
    prepare, restore = run_group("file", 8, cycle)
    print(
        f"one sleep/wake cycle at TP8 on a FileStore: checkpoint_prepare (2 "
        f"exchanges) {prepare['bytes']} B + checkpoint_restore (6 exchanges) "
        f"{restore['bytes']} B = {prepare['bytes'] + restore['bytes']} B, "
        f"kept: {prepare['kept'] and restore['kept']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
