# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check FlashInfer's fused all-reduce + RMSNorm on this machine's GPUs.

Runs what `vllm serve` runs, without a model, where the MNNVL race
(flashinfer#7782) shows: vLLM's distributed state and workspace with this
build's decision and HiSparse on; per token count, a CUDA graph of L
DeepSeek V3.2 decoder layers (vLLM's `fused_allreduce_rms_norm` twice a
layer, the residual chained, a GEMM before each call, HiSparse's host
traffic in flight across them), replayed back to back, every output checked
against the kernels' own arithmetic. PASS exits 0, FAIL 1, bad input 2,
a deployment vLLM would not fuse included: its TP size without a row of
vLLM's fusion table at the GPUs' capability (--capability on CPU).

    python benchmarks/check_fused_all_reduce.py -tp 8 [--seconds 120] [--json]
    python benchmarks/check_fused_all_reduce.py -tp 8 --self-test
    python benchmarks/check_fused_all_reduce.py -tp 8 --device cpu [--capability 9.0]

The backend is VLLM_FLASHINFER_ALLREDUCE_BACKEND's, as for `vllm serve`.
What a result means: docs/configuration/flashinfer_all_reduce.md
(#checking-the-fused-kernel-on-your-gpus); how it works:
docs/contributing/gpu_check.md.
"""

import argparse
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fused_all_reduce_options import BadInput, parse_args, validate
from fused_all_reduce_summary import (
    PROG,
    describe_fault,
    describe_mismatch,
    format_summary,
    summarize,
)

RANK_SCRIPT = Path(__file__).resolve().parent / "fused_all_reduce_rank.py"
# A rank's phases (fused_all_reduce_rank.PHASE_*), as its progress says.
PHASES = ("start-up", "warm-up", "replay", "done")
PHASE_REPLAY = 2
PROGRESS_START = {"phase": 0, "iterations": 0, "mismatches": 0, "findings": 0}
# How long a rank may go without progress: in start-up and warm-up
# (FlashInfer's JIT builds included), and while replaying; on GPUs and CPU.
STARTUP_SECONDS = {"cuda": 1200.0, "cpu": 300.0}
STALL_SECONDS = {"cuda": 60.0, "cpu": 30.0}
# After a first fault, how long the other ranks get to report before they
# are killed; and how long a killed rank may take to be reaped.
GRACE_SECONDS = 2.0
REAP_SECONDS = 10.0
LOG_TAIL_LINES = 15
# --self-test's replay time per fault, and its stall limit.
SELF_TEST_SECONDS = 10.0


@dataclass
class RankState:
    proc: subprocess.Popen
    pipe: int
    log: Path
    buffer: str = ""
    done: bool = False
    closed: bool = False
    # Progress events received, and the last one: phase, iterations,
    # mismatches and known-issue tokens (findings).
    step: int = 0
    progress: dict[str, int] = field(default_factory=lambda: PROGRESS_START)
    exited: float = 0.0
    changed: float = field(default_factory=time.monotonic)


class Launcher:
    """Starts the ranks, watches them, and stops them all, whatever happens."""

    def __init__(self, args: argparse.Namespace, inject: dict | None, seconds: float):
        self.args, self.inject, self.seconds = args, inject, seconds
        self.startup_seconds = STARTUP_SECONDS[args.device]
        self.stall_seconds = STALL_SECONDS[args.device]
        self.events: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.aftermath: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.printed: set[str] = set()
        self.ranks: list[RankState] = []

    def run(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="cfar-") as tmp:
            spec = Path(tmp, "spec.json")
            spec.write_text(json.dumps(self.spec()))
            try:
                for rank in range(self.args.tp):
                    self.ranks.append(self.start(rank, spec, Path(tmp)))
                self.watch()
            finally:
                self.stop_all()
            for entry in self.faults + self.aftermath:  # each rank's last words
                entry["log_tail"] = {
                    str(rank): self.log_tail(rank) for rank in entry["ranks"]
                }
        self.elapsed = time.monotonic() - self.started
        return summarize(self)

    def spec(self) -> dict[str, Any]:
        """What every rank is told."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        told = "tp device capability dtypes hidden_sizes max_tokens layers "
        told += "host_traffic_mib"
        return {k: getattr(self.args, k) for k in told.split()} | {
            "port": port,
            "seconds": self.seconds,
            "inject": self.inject,
        }

    def start(self, rank: int, spec: Path, tmp: Path) -> RankState:
        read_fd, write_fd = os.pipe()
        log = tmp / f"rank{rank}.log"
        # What vLLM, torch and FlashInfer leave in the temporary folder goes
        # with the run's. Short: vLLM's IPC socket paths must fit in 107 bytes.
        scratch = tmp / f"t{rank}"
        scratch.mkdir()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT), str(spec), str(rank), str(write_fd)],
                env={**os.environ, "TMPDIR": str(scratch)},
                pass_fds=(write_fd,),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        return RankState(proc=proc, pipe=read_fd, log=log)

    def watch(self) -> None:
        """Until every rank is done, or a fault's grace is over."""
        selector = selectors.DefaultSelector()
        for rank, state in enumerate(self.ranks):
            selector.register(state.pipe, selectors.EVENT_READ, rank)
        deadline = self.started + self.seconds + 3 * self.startup_seconds + 60
        last_line = 0.0
        first_fault: float | None = None
        while True:
            for key, _ in selector.select(timeout=0.2):
                self.read(key.data, selector)
            now = time.monotonic()
            self.check_exits()
            if self.faults and first_fault is None:
                first_fault = now
            if first_fault is not None and now - first_fault > GRACE_SECONDS:
                return
            exited = all(s.done or s.proc.poll() is not None for s in self.ranks)
            if exited and (all(s.closed for s in self.ranks) or first_fault):
                return
            if first_fault is None:
                self.check_stall(now)
                if now > deadline:
                    self.fault(None, "stalled", "the run passed its overall deadline")
            if now - last_line >= 5 and not self.faults:
                last_line = now
                counts = [s.progress for s in self.ranks]
                self.say(
                    f"{now - self.started:.0f}s "
                    f"{PHASES[min(c['phase'] for c in counts)]}: "
                    f"{min(c['iterations'] for c in counts)} replays per rank, "
                    f"{sum(c['mismatches'] for c in counts)} mismatches, "
                    f"{sum(c['findings'] for c in counts)} known-issue tokens"
                )

    def read(self, rank: int, selector: selectors.BaseSelector) -> None:
        state = self.ranks[rank]
        try:
            chunk = os.read(state.pipe, 65536)
        except BlockingIOError:
            return
        if not chunk:
            selector.unregister(state.pipe)
            os.close(state.pipe)
            state.closed = True
            return
        state.buffer += chunk.decode()
        *lines, state.buffer = state.buffer.split("\n")
        for line in filter(None, lines):
            event = json.loads(line)
            if event["event"] == "progress":
                state.step, state.changed = state.step + 1, time.monotonic()
                state.progress = event
                continue
            if event["event"] == "done":
                state.done = True
            elif event["event"] == "fault":
                self.fault([rank], "error", event["error"], event.get("traceback"))
                continue
            self.events.append(event)
            # vLLM's lines about FlashInfer, once: the start-up line and kin.
            for text in event.get("lines", ()):
                if text not in self.printed:
                    self.printed.add(text)
                    self.say(f"rank {rank}: {text}")

    def fault(
        self, ranks: list[int] | None, kind: str, error: str, trace: str | None = None
    ) -> None:
        """Record a fault; after the first, others are its aftermath, but a
        rank that died without a word goes first: its peers' errors (a
        closed connection) can reach us before its exit does."""
        entry: dict[str, Any] = {
            "ranks": ranks or list(range(self.args.tp)),
            "kind": kind,
            "error": error,
        }
        if trace:
            entry["traceback"] = trace
        if self.faults and not (kind == "died" and self.faults[0]["kind"] != "died"):
            self.aftermath.append(entry)
            return
        self.aftermath += self.faults
        self.faults = [entry]
        self.say(f"FAULT {describe_fault(entry)}")

    def check_exits(self) -> None:
        for rank, state in enumerate(self.ranks):
            code = state.proc.poll()
            if code is None or state.done:
                continue
            if not state.closed:
                # Its last words may still be in the pipe, unless a child
                # it left behind holds the pipe open.
                state.exited = state.exited or time.monotonic()
                if time.monotonic() - state.exited < GRACE_SECONDS:
                    continue
            if any(rank in f["ranks"] for f in self.faults + self.aftermath):
                continue
            how = f"exited with status {code}"
            if code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            self.fault([rank], "died", f"rank {rank} {how} without reporting why")

    def check_stall(self, now: float) -> None:
        """All running ranks quiet past their phase's limit: the ones
        furthest behind stalled."""
        running = [
            (rank, s)
            for rank, s in enumerate(self.ranks)
            if s.proc.poll() is None and not s.done
        ]
        limits = {PHASE_REPLAY: self.stall_seconds}
        if not running or not all(
            now - s.changed > limits.get(s.progress["phase"], self.startup_seconds)
            for _, s in running
        ):
            return
        behind = min(s.step for _, s in running)
        stalled = [rank for rank, s in running if s.step == behind]
        phase = PHASES[min(s.progress["phase"] for _, s in running)]
        quiet = min(now - s.changed for _, s in running)
        others = "" if len(stalled) == len(running) else " while the others waited"
        self.fault(
            stalled, "stalled", f"no progress for {quiet:.0f}s in {phase}{others}"
        )

    def stop_all(self) -> None:
        """Kill every rank's session, with anything it started; a rank that
        is not reaped in REAP_SECONDS (stuck in the driver) is reported."""
        for state in self.ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.proc.pid, signal.SIGKILL)
        for rank, state in enumerate(self.ranks):
            try:
                state.proc.wait(timeout=REAP_SECONDS)
            except subprocess.TimeoutExpired:
                self.say(
                    f"rank {rank} (pid {state.proc.pid}) did not exit "
                    f"{REAP_SECONDS:.0f}s after SIGKILL; its GPU may be wedged"
                )
            if not state.closed:
                os.close(state.pipe)
                state.closed = True

    def log_tail(self, rank: int) -> list[str]:
        log = self.ranks[rank].log.read_text(errors="replace")
        return log.splitlines()[-LOG_TAIL_LINES:]

    def say(self, text: str) -> None:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)


# --self-test: (kind, name, the rank it hits: 0 or the last)
SELF_TEST_FAULTS = (
    ("wrong", "one wrong token", -1),
    ("die", "a rank that dies", 0),
    ("stall", "a rank that stalls", -1),
)


def caught(kind: str, rank: int, result: dict[str, Any]) -> str | None:
    """How the run reported the fault, or None if it did not, on its rank.
    A known issue the kernels also show does not hide the wrong token."""
    first = result["faults"][0] if result["faults"] else None
    if kind == "wrong":
        found = [
            m
            for m in result["mismatch_details"]
            if m["rank"] == rank and m["token"] == m["tokens"] - 1
        ]
        others = result["mismatches"] - len(found)
        return None if first or others or not found else describe_mismatch(found[0])
    if first is None or first["ranks"] != [rank]:
        return None
    if (kind == "stall") != (first["kind"] == "stalled"):
        return None
    if kind == "die" and "unspecified launch failure" not in first["error"]:
        return None
    return describe_fault(first)


def self_test(args: argparse.Namespace) -> int:
    """Each injected fault must come back as FAIL naming its rank."""
    outcomes = []
    for kind, name, rank in SELF_TEST_FAULTS:
        rank %= args.tp
        inject = {"kind": kind, "rank": rank, "after": 3}
        launcher = Launcher(args, inject, min(args.seconds, SELF_TEST_SECONDS))
        launcher.stall_seconds = SELF_TEST_SECONDS
        result = launcher.run()
        how = caught(kind, rank, result)
        outcomes.append(
            {"fault": name, "rank": rank, "reported": how, "result": result}
        )
        state = f"caught: FAIL, {how}" if how else f"MISSED ({result['verdict']})"
        print(f"{PROG}: self-test: {name} on rank {rank}: {state}", file=sys.stderr)
    verdict = "PASS" if all(o["reported"] for o in outcomes) else "FAIL"
    if args.json:
        print(json.dumps({"self_test": verdict, "faults": outcomes}, indent=2))
    else:
        print(f"{PROG}: self-test {verdict}")
    return 0 if verdict == "PASS" else 1


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, __doc__ or "")
    try:
        validate(args)
    except BadInput as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # A launcher stopped by SIGTERM still stops its ranks (Launcher.run).
    signal.signal(signal.SIGTERM, _terminated)
    if args.self_test:
        return self_test(args)
    result = Launcher(args, args.inject_spec, args.seconds).run()
    print(json.dumps(result, indent=2) if args.json else format_summary(result))
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
