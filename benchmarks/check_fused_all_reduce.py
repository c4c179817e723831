# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check FlashInfer's fused all-reduce + RMSNorm on this machine's GPUs.

Runs the kernels `vllm serve` would run, without a model, under the
conditions that set off the MNNVL race (flashinfer#7782): vLLM's own
distributed state and workspace (this build's decision, HiSparse on), and
for each token count of a sweep one CUDA graph of L decoder layers, each with
the two calls of vLLM's `fused_allreduce_rms_norm` that DeepSeek V3.2's makes,
the residual chained, a GEMM before each call and HiSparse's host traffic in
flight across them, replayed back to back. Every output is checked against
the kernels' own arithmetic, with inputs taken by call index; 0.7.2.post1's
fp16 mnnvl overflow is a finding of its own. Ends PASS (exit 0) or FAIL
(exit 1); bad input exits 2.

    python benchmarks/check_fused_all_reduce.py -tp 8 [--seconds 120] [--json]
    python benchmarks/check_fused_all_reduce.py -tp 8 --self-test

The backend is VLLM_FLASHINFER_ALLREDUCE_BACKEND's, as for `vllm serve`.
`--self-test` injects a wrong token, a rank that dies and a rank that stalls,
and passes only if each is reported as FAIL on the right rank. `--device cpu`
runs everything but the kernel (an emulation of it stands in) on gloo,
without GPUs, graphs or host traffic. What a result means:
docs/configuration/flashinfer_all_reduce.md#checking-the-fused-kernel-on-your-gpus.
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

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "fused_all_reduce_rank.py"
# Must match fused_all_reduce_rank.PROGRESS and its phases.
PROGRESS_SIZE = 40
PHASE_REPLAY = 2
PHASES = ("start-up", "warm-up", "replay", "done")
# After a first fault, how long the other ranks get to report before they
# are killed.
GRACE_SECONDS = 2.0
LOG_TAIL_LINES = 15
SELF_TEST_SECONDS = 10.0
SELF_TEST_STALL_SECONDS = 10.0
# How long a killed rank may take to be reaped.
REAP_SECONDS = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankState:
    proc: subprocess.Popen
    pipe: Any
    log: Path
    buffer: str = ""
    done: bool = False
    closed: bool = False
    step: int = -1
    phase: int = 0
    iterations: int = 0
    mismatches: int = 0
    findings: int = 0
    exited: float = 0.0
    changed: float = field(default_factory=time.monotonic)


class Launcher:
    """Starts the ranks, watches them, and stops them all, whatever happens."""

    def __init__(self, args: argparse.Namespace, inject: dict | None, seconds: float):
        self.args = args
        self.inject = inject
        self.seconds = seconds
        self.events: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.aftermath: list[dict[str, Any]] = []
        self.label = "starting"
        self.started = time.monotonic()
        self.printed_lines: set[str] = set()

    def run(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="cfar-") as tmp:
            progress = Path(tmp, "progress")
            progress.write_bytes(b"\0" * PROGRESS_SIZE * self.args.tp)
            spec_path = Path(tmp, "spec.json")
            spec_path.write_text(json.dumps(self.spec(progress)))
            self.ranks: list[RankState] = []
            try:
                for rank in range(self.args.tp):
                    self.ranks.append(self.start(rank, spec_path, Path(tmp)))
                self.watch(progress)
            finally:
                self.stop_all()
            self.primary_fault_first()
            self.collect_log_tails()
        return self.result()

    def spec(self, progress: Path) -> dict[str, Any]:
        args = self.args
        return {
            "tp": args.tp,
            "port": free_port(),
            "device": args.device,
            "hisparse": args.hisparse,
            "seconds": self.seconds,
            "dtypes": args.dtype_list,
            "hidden_sizes": args.hidden_list,
            "max_tokens": args.max_tokens,
            "host_traffic_mib": args.host_traffic_mib,
            "gather_rows": args.gather_rows,
            "layers": args.layers,
            "input_sets": args.input_sets,
            "replays_per_sync": args.replays_per_sync,
            "inject": self.inject,
            "progress": str(progress),
        }

    def start(self, rank: int, spec_path: Path, tmp: Path) -> RankState:
        read_fd, write_fd = os.pipe()
        log = tmp / f"rank{rank}.log"
        # What vLLM, torch and FlashInfer leave in the temporary folder (IPC
        # sockets, scratch folders) goes with the run's folder.
        # Short: vLLM's IPC socket paths under it must fit in 107 bytes.
        scratch = tmp / f"t{rank}"
        scratch.mkdir()
        with log.open("w") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(RANK_SCRIPT),
                    str(spec_path),
                    str(rank),
                    str(write_fd),
                ],
                env={**os.environ, "TMPDIR": str(scratch)},
                pass_fds=(write_fd,),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        return RankState(proc=proc, pipe=read_fd, log=log)

    def watch(self, progress: Path) -> None:
        selector = selectors.DefaultSelector()
        for rank, state in enumerate(self.ranks):
            selector.register(state.pipe, selectors.EVENT_READ, rank)
        args = self.args
        hard_deadline = self.started + self.seconds + 3 * args.startup_seconds + 60
        last_line = 0.0
        first_fault_at: float | None = None
        while True:
            for key, _ in selector.select(timeout=0.2):
                self.read(key.data, selector)
            now = time.monotonic()
            self.read_progress(progress, now)
            self.check_exits()
            if self.faults and first_fault_at is None:
                first_fault_at = now
            if first_fault_at is not None and now - first_fault_at > GRACE_SECONDS:
                return
            exited = all(s.done or s.proc.poll() is not None for s in self.ranks)
            if exited and (
                all(s.closed for s in self.ranks) or first_fault_at is not None
            ):
                return
            if first_fault_at is None:
                self.check_stall(now)
                if now > hard_deadline:
                    self.fault(None, "stalled", "the run passed its overall deadline")
            if now - last_line >= 5 and not self.faults:
                last_line = now
                self.progress_line(now)

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
        for line in lines:
            if line:
                self.handle(json.loads(line))

    def handle(self, event: dict[str, Any]) -> None:
        kind, rank = event["event"], event["rank"]
        if kind == "done":
            self.ranks[rank].done = True
        elif kind == "fault":
            self.fault([rank], "error", event["error"], event.get("traceback"))
            return
        self.events.append(event)
        for line in event.get("lines", ()):
            if line not in self.printed_lines:
                self.printed_lines.add(line)
                self.say(f"rank {rank}: {line}")
        if kind == "config" and rank == 0:
            self.label = f"{event['dtype']} hidden {event['hidden']}"
            tokens = event["tokens"]
            self.say(
                f"checking {self.label} on {event['backend']}: token counts "
                f"{tokens[0]}..{tokens[-1]} ({len(tokens)} shapes)"
            )
        if kind == "mismatch":
            self.say(
                f"MISMATCH rank {rank}: {event['dtype']} hidden {event['hidden']} "
                f"{event['tokens']} tokens, {event['call']} "
                f"{event['output']} token {event['token']}"
            )
        if kind == "known_issue":
            self.say(
                f"KNOWN ISSUE rank {rank}: {event['name']} (fixed in FlashInfer "
                f"{event['fixed_in']}): {event['zeroed_tokens']} tokens zeroed, "
                f"{event['dtype']} hidden {event['hidden']} {event['tokens']} tokens"
            )

    def fault(
        self, ranks: list[int] | None, kind: str, error: str, trace: str | None = None
    ) -> None:
        """Record a fault; after the first, others are its aftermath."""
        if ranks is None:
            ranks = list(range(self.args.tp))
        entry = {"ranks": ranks, "kind": kind, "error": error}
        if trace:
            entry["traceback"] = trace
        if self.faults:
            self.aftermath.append(entry)
            return
        self.faults.append(entry)
        who = ", ".join(map(str, ranks))
        self.say(f"FAULT rank {who} {kind}: {error}")

    def read_progress(self, progress: Path, now: float) -> None:
        import struct

        data = progress.read_bytes()
        for rank, state in enumerate(self.ranks):
            step, phase, iterations, mismatches, findings = struct.unpack_from(
                "<qqqqq", data, rank * PROGRESS_SIZE
            )
            if step != state.step:
                state.step, state.changed = step, now
            state.phase, state.iterations = phase, iterations
            state.mismatches, state.findings = mismatches, findings

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
            if code < 0:
                how = f"was killed by {signal.Signals(-code).name}"
            else:
                how = f"exited with status {code}"
            self.fault([rank], "died", f"rank {rank} {how} without reporting why")

    def check_stall(self, now: float) -> None:
        running = [
            (rank, s)
            for rank, s in enumerate(self.ranks)
            if s.proc.poll() is None and not s.done
        ]
        if not running:
            return

        def limit(state: RankState) -> float:
            if state.phase == PHASE_REPLAY:
                return self.args.stall_seconds
            return self.args.startup_seconds

        if not all(now - s.changed > limit(s) for _, s in running):
            return
        behind = min(s.step for _, s in running)
        stalled = [rank for rank, s in running if s.step == behind]
        phase = PHASES[min(s.phase for _, s in running)]
        quiet = min(now - s.changed for _, s in running)
        others = (
            "" if len(stalled) == len(running) else " while the others waited for it"
        )
        self.fault(
            stalled,
            "stalled",
            f"no progress for {quiet:.0f}s in {phase}{others}",
        )

    def primary_fault_first(self) -> None:
        """A rank that died without a word goes first: its peers' errors
        (a closed connection) can reach us before its exit does."""
        entries = self.faults + self.aftermath
        died = [e for e in entries if e["kind"] == "died"]
        if died and self.faults and self.faults[0]["kind"] != "died":
            entries.remove(died[0])
            self.faults, self.aftermath = [died[0]], entries

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

    def collect_log_tails(self) -> None:
        for entry in self.faults + self.aftermath:
            tails = {}
            for rank in entry["ranks"]:
                lines = self.ranks[rank].log.read_text(errors="replace").splitlines()
                tails[str(rank)] = lines[-LOG_TAIL_LINES:]
            entry["log_tail"] = tails

    def progress_line(self, now: float) -> None:
        iterations = min(s.iterations for s in self.ranks)
        mismatches = sum(s.mismatches for s in self.ranks)
        phase = PHASES[min(s.phase for s in self.ranks)]
        self.say(
            f"{now - self.started:.0f}s {phase} {self.label}: {iterations} "
            f"iterations per rank, {mismatches} mismatches"
        )

    def say(self, text: str) -> None:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def result(self) -> dict[str, Any]:
        return summarize(
            self.args,
            self.seconds,
            self.events,
            self.faults,
            self.aftermath,
            self.ranks,
            time.monotonic() - self.started,
        )


def run_check(args: argparse.Namespace, inject: dict | None, seconds: float) -> dict:
    return Launcher(args, inject, seconds).run()


@dataclass(frozen=True)
class InjectedFault:
    kind: str
    name: str
    rank: int


def self_test_faults(tp: int) -> list[InjectedFault]:
    return [
        InjectedFault("wrong", "one wrong token", tp - 1),
        InjectedFault("die", "a rank that dies", 0),
        InjectedFault("stall", "a rank that stalls", tp - 1),
    ]


def caught(fault: InjectedFault, result: dict[str, Any]) -> str | None:
    """How the run reported `fault`, or None if it did not, on the right rank."""
    if result["verdict"] != "FAIL":
        return None
    if fault.kind == "wrong":
        details = result["mismatch_details"]
        if result["faults"] or result["known_issues"] or not details:
            return None
        if any(m["rank"] != fault.rank for m in details):
            return None
        return describe_mismatch(details[0])
    first = result["faults"][0] if result["faults"] else None
    if first is None or first["ranks"] != [fault.rank]:
        return None
    if fault.kind == "die" and "unspecified launch failure" not in first["error"]:
        return None
    if fault.kind == "stall" and first["kind"] != "stalled":
        return None
    return describe_fault(first)


def self_test(args: argparse.Namespace) -> int:
    """Each injected fault must come back as FAIL naming its rank."""
    args.stall_seconds = min(args.stall_seconds, SELF_TEST_STALL_SECONDS)
    seconds = min(args.seconds, SELF_TEST_SECONDS)
    outcomes = []
    for fault in self_test_faults(args.tp):
        inject = {"kind": fault.kind, "rank": fault.rank, "after": 3}
        result = run_check(args, inject, seconds)
        how = caught(fault, result)
        outcomes.append(
            {
                "fault": fault.name,
                "rank": fault.rank,
                "caught": how is not None,
                "reported": how,
                "result": result,
            }
        )
        print(
            f"{PROG}: self-test: {fault.name} on rank {fault.rank}: "
            + (f"caught: FAIL, {how}" if how else f"MISSED ({result['verdict']})"),
            file=sys.stderr,
            flush=True,
        )
    passed = all(o["caught"] for o in outcomes)
    verdict = "PASS" if passed else "FAIL"
    if args.json:
        print(json.dumps({"self_test": verdict, "faults": outcomes}, indent=2))
    else:
        print(f"{PROG}: self-test {verdict}")
        for o in outcomes:
            state = "caught" if o["caught"] else "MISSED"
            print(f"  {o['fault']} on rank {o['rank']}: {state}: {o['reported']}")
    return 0 if passed else 1


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        validate(args)
    except BadInput as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    # A launcher stopped by SIGTERM still stops its ranks (Launcher.run).
    signal.signal(signal.SIGTERM, _terminated)
    if args.self_test:
        return self_test(args)
    result = run_check(args, args.inject_spec, args.seconds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_summary(result))
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
