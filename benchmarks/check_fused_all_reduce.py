# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check FlashInfer's fused all-reduce + RMSNorm on this machine's GPUs.

Runs the kernels `vllm serve` would run, without a model, under the
conditions that set off the MNNVL race (flashinfer#7782): vLLM's own
distributed state and workspace (this build's decision, rank agreement and
creation vote, HiSparse on), vLLM's `fused_allreduce_rms_norm` captured in
CUDA graphs and replayed over a sweep of token counts, while each rank keeps
host memory busy as HiSparse's gathers do. Every output is checked against
an fp32 reference. Ends PASS (exit 0) or FAIL (exit 1); bad input exits 2.

    python benchmarks/check_fused_all_reduce.py -tp 8 [--seconds 120] [--json]
    python benchmarks/check_fused_all_reduce.py -tp 8 --self-test

The backend is VLLM_FLASHINFER_ALLREDUCE_BACKEND's, as for `vllm serve`.
`--self-test` injects a wrong token, a rank that dies and a rank that stalls,
and passes only if each is reported as FAIL on the right rank. `--device cpu`
runs everything but the kernel (a reference stands in for it) on gloo,
without GPUs. Tolerances and how to read a result:
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

from fused_all_reduce_summary import (
    BACKEND_ENV,
    PROG,
    describe_fault,
    describe_mismatch,
    format_summary,
    summarize,
)

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "fused_all_reduce_rank.py"
# Must match fused_all_reduce_rank.PROGRESS and its phases.
PROGRESS_SIZE = 32
PHASE_REPLAY = 2
PHASES = ("start-up", "warm-up", "replay", "done")
DTYPES = ("bf16", "fp16")
# The hidden sizes of the models HiSparse serves (DeepSeek V3.2, GLM-5).
HIDDEN_SIZES = (7168, 6144)
CPU_MAX_TOKENS = 64
# wrong, die and stall are --self-test's; kill (no last words) and fallback
# (the op's gate refuses every call, on every rank) are for the tests.
INJECT_KINDS = ("wrong", "die", "stall", "kill", "fallback")
# After a first fault, how long the other ranks get to report before they
# are killed.
GRACE_SECONDS = 2.0
LOG_TAIL_LINES = 15
SELF_TEST_SECONDS = 10.0
SELF_TEST_STALL_SECONDS = 10.0


class BadInput(Exception):
    """A problem with what the user gave us; one line, exit 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        required=True,
        help="ranks (GPUs) in the tensor-parallel group, as for vllm serve",
    )
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="replay time (default 120)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="inject faults and check that each is reported (the positive control)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the harness on gloo with a reference kernel (no GPU)",
    )
    parser.add_argument(
        "--no-hisparse",
        dest="hisparse",
        action="store_false",
        help="check with HiSparse off in the vLLM config",
    )
    parser.add_argument(
        "--host-traffic-mib",
        type=int,
        default=256,
        help="pinned host memory each rank copies and gathers from (GPU only; 0: none)",
    )
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="comma-separated: bf16,fp16"
    )
    parser.add_argument(
        "--hidden-sizes",
        default=",".join(map(str, HIDDEN_SIZES)),
        help="comma-separated hidden sizes (default: 7168,6144)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"cap the sweep's token counts (default: the workspace's "
        f"maximum on GPUs, {CPU_MAX_TOKENS} on CPU)",
    )
    parser.add_argument(
        "--stall-seconds",
        type=float,
        help="no progress for this long while replaying is a stall "
        "(default 60; cpu 30)",
    )
    parser.add_argument(
        "--startup-seconds",
        type=float,
        help="limit on start-up and warm-up, FlashInfer's JIT builds included "
        "(default 1200; cpu 300)",
    )
    parser.add_argument(
        "--inject",
        metavar="KIND:RANK[:AFTER]",
        help=f"inject one fault ({', '.join(INJECT_KINDS)}) on RANK after "
        "AFTER replays (default 3); what --self-test does, one at a time",
    )
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.stall_seconds is None:
        args.stall_seconds = 30.0 if cpu else 60.0
    if args.startup_seconds is None:
        args.startup_seconds = 300.0 if cpu else 1200.0
    if args.max_tokens is None and cpu:
        args.max_tokens = CPU_MAX_TOKENS
    return args


def parse_list(text: str, what: str, convert: Any, allowed: Any = None) -> list:
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        choices = f" from {', '.join(allowed)}" if allowed else ""
        raise BadInput(f"--{what} takes a comma-separated list{choices}, not {text!r}")
    return values


def parse_inject(text: str | None, tp: int) -> dict[str, Any] | None:
    if text is None:
        return None
    parts = text.split(":")
    try:
        kind, rank, after = (
            parts[0],
            int(parts[1]),
            int(parts[2]) if len(parts) > 2 else 3,
        )
    except (IndexError, ValueError):
        kind, rank, after = "", -1, 0
    if kind not in INJECT_KINDS or not 0 <= rank < tp or after < 0 or len(parts) > 3:
        raise BadInput(
            f"--inject takes KIND:RANK[:AFTER] with KIND one of "
            f"{', '.join(INJECT_KINDS)} and RANK below -tp {tp}, not {text!r}"
        )
    return {"kind": kind, "rank": rank, "after": after}


def validate(args: argparse.Namespace) -> None:
    """Refuse bad input before anything starts; cheap checks first."""
    if args.tp < 2:
        raise BadInput(
            f"-tp {args.tp}: FlashInfer's all-reduce needs a group of 2 or more "
            "ranks; give -tp 2 or more"
        )
    if args.seconds <= 0 or args.stall_seconds <= 0 or args.startup_seconds <= 0:
        raise BadInput("--seconds, --stall-seconds and --startup-seconds must be > 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadInput("--max-tokens must be 1 or more")
    if args.host_traffic_mib < 0:
        raise BadInput("--host-traffic-mib must be 0 or more")
    args.dtype_list = parse_list(args.dtypes, "dtypes", str.strip, DTYPES)
    args.hidden_list = parse_list(args.hidden_sizes, "hidden-sizes", int)
    if any(h < 1 for h in args.hidden_list):
        raise BadInput("--hidden-sizes must be positive")
    args.inject_spec = parse_inject(args.inject, args.tp)
    import vllm.envs as envs

    try:
        args.backend_setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        raise BadInput(
            f"{str(e).rstrip('.')}; unset {BACKEND_ENV} or give one of those"
        ) from None
    if args.device == "cuda":
        import torch

        found = torch.cuda.device_count()
        if found < args.tp:
            raise BadInput(
                f"-tp {args.tp} needs {args.tp} GPUs and this machine has "
                f"{found or 'none'}; run on a machine with them, or add "
                "--device cpu to run the harness alone"
            )
    try:
        import flashinfer.comm as flashinfer_comm
    except ImportError as e:
        raise BadInput(
            f"FlashInfer does not import ({e}); install this build with its "
            "FlashInfer (pip install .)"
        ) from None
    missing = [
        name
        for name in ("allreduce_fusion", "create_allreduce_fusion_workspace")
        if not hasattr(flashinfer_comm, name)
    ]
    if missing:
        raise BadInput(
            f"this FlashInfer has no fused all-reduce (flashinfer.comm lacks "
            f"{', '.join(missing)}); install this build with its FlashInfer "
            "(pip install .)"
        )


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
                f"{event['tokens']} tokens, {event['output']} token {event['token']}"
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
            step, phase, iterations, mismatches = struct.unpack_from(
                "<qqqq", data, rank * PROGRESS_SIZE
            )
            if step != state.step:
                state.step, state.changed = step, now
            state.phase, state.iterations, state.mismatches = (
                phase,
                iterations,
                mismatches,
            )

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
        """Kill every rank's session, with anything it started."""
        for state in self.ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.proc.pid, signal.SIGKILL)
        for state in self.ranks:
            state.proc.wait()
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
        if result["faults"] or not details:
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
