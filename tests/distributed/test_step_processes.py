# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The step protocol (`Step`) in production's world: ranks are processes and
the store is one vLLM sets up.

Each case forks its ranks from this process (which imported torch and the
step module, so a child costs little memory and imports nothing). Each rank
opens the store itself, a FileStore on a file in a temp dir (vLLM's
multiproc executor on one node) or a TCPStore that rank 0's process hosts,
wraps it in `PrefixStore("vllm-fi-ar", ...)` as the backend module does, and
runs its script of steps. A proxy counts the rank's store calls and, at its
k-th, sends the rank SIGKILL or SIGSTOP; the parent sends SIGCONT after
STOP_S, or never ('stopped for good': it kills the rank once the others
settled, or after FOREVER_S). Ranks and parent share only lock-free flags (a
`Board`), so a rank killed or stopped anywhere holds no lock of theirs. Each
rank counts the store's keys (`num_keys`) before its steps and once every
rank that returns has returned.

`violations` checks each case, as tests/distributed/test_step_matrix.py does:
every rank that returns ends each step with the same Outcome, without raising
(but `StoreGone` where the TCPStore's host died); KEEP only if every rank
completed; within the bound, GRACE and SLACK_S of real time (plus the time a
rank, or the TCPStore's host, was stopped); no key left, but where a rank
died (or stopped for good) once its ballot was in. Run with `-s` for one line
per case (its wall time and what each rank ended with).

With `--vllm-tree PATH` pointing at a checkout whose Step still lives in
flashinfer_all_reduce_backend.py, the clock cases show what that protocol did
with other ranks' clocks.
"""

import contextlib
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

COMMUNICATORS = "vllm.distributed.device_communicators"
try:
    step_module: Any = importlib.import_module(f"{COMMUNICATORS}.store_step")
except ImportError:  # an earlier checkout: the step lived in the backend module
    step_module = importlib.import_module(
        f"{COMMUNICATORS}.flashinfer_all_reduce_backend"
    )

Step, Outcome, GRACE_S = step_module.Step, step_module.Outcome, step_module.GRACE_S
SLOT = getattr(step_module, "SLOT", "slot")

CTX = mp.get_context("fork")
PREFIX = "vllm-fi-ar"
BOUND_S = 1.0
GRACE = 0.3  # the step module's GRACE_S in every rank (production: GRACE_S)
SLACK_S = 1.0  # for a loaded 2-core machine
STOP_S = BOUND_S + GRACE + 0.5  # a stopped rank is continued after this
FOREVER_S = STOP_S + 1.0  # a rank stopped for good is killed after this
CASE_TIMEOUT_S = 15.0  # a rank neither back, dead nor stopped by then hung
TCP_TIMEOUT = timedelta(seconds=CASE_TIMEOUT_S)  # for waits only: see FOREVER_S
WORKERS = 48  # cases at once (their ranks mostly sleep)
STORES = ("file", "tcp")
STORE_CALLS = {
    "add", "append", "check", "compare_set", "delete_key", "get", "multi_get",
    "set", "wait",
}  # fmt: skip
STORE_GONE = "the group's store is gone"
OPENED, COUNTED, DONE, COUNTED_AFTER = 1, 2, 3, 4  # a rank's phases
FLAGS = ("count", "release", "x_started", "x_done")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's script."""

    steps: tuple[tuple[str, int], ...] = (("create", 1),)  # (what, exchanges)
    fault: str = ""  # kill, stop or forever, at its `at_call`-th store call
    at_call: int = 0
    skew_s: float = 0.0  # its step module's clocks, ahead from the start
    jump_s: float = 0.0  # added to them as its body starts (after its join)
    wall_jump_s: float = 0.0  # added to time.time() only, as its body starts
    dies_in_body: bool = False  # SIGKILL as its first body starts
    waits: tuple[tuple[int, str], ...] = ()  # (step, flag): waits before it
    raises: tuple[tuple[int, str, str], ...] = ()  # (step, flag, before|after)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    store: str
    plans: tuple[Plan, ...]
    bound_s: float = BOUND_S
    attack: Callable | None = None  # run by a client that is not a rank

    @property
    def size(self) -> int:
        return len(self.plans)


class Board:
    """Flags shared by the parent and a case's processes, without a lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cells = CTX.RawArray("d", 2 * size + 1 + len(FLAGS))

    def phase(self, rank: int) -> int:
        return int(self.cells[rank])

    def set_phase(self, rank: int, phase: int) -> None:
        self.cells[rank] = phase

    def fired(self, rank: int) -> float:
        return self.cells[self.size + rank]

    def set_fired(self, rank: int) -> None:
        self.cells[self.size + rank] = time.monotonic()

    @property
    def port(self) -> int:
        return int(self.cells[2 * self.size])

    @port.setter
    def port(self, port: int) -> None:
        self.cells[2 * self.size] = port

    def flag(self, name: str) -> bool:
        return bool(self.cells[2 * self.size + 1 + FLAGS.index(name)])

    def raise_flag(self, name: str) -> None:
        self.cells[2 * self.size + 1 + FLAGS.index(name)] = 1

    def wait(self, done: Callable[[], bool], timeout: float = CASE_TIMEOUT_S) -> None:
        until = time.monotonic() + timeout
        while not done():
            if time.monotonic() > until:
                raise TimeoutError("the case's processes did not meet")
            time.sleep(0.002)

    def all_at(self, phase: int) -> bool:
        return all(self.phase(r) >= phase for r in range(self.size))


class Clock:
    """The step module's `time`: its clocks offset as the plan says."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s, self.wall_s = offset_s, 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset_s

    def time(self) -> float:
        return time.time() + self.offset_s + self.wall_s

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)  # sleep, perf_counter, ...


def save(path: Path, record: dict) -> None:
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


class Faulty:
    """A rank's store: counts its calls and, at the plan's, fires its fault."""

    def __init__(self, store, plan: Plan, rank: int, board: Board, report) -> None:
        self._store, self._plan, self._rank = store, plan, rank
        self._board, self._report = board, report
        self.calls, self.ballot_in, self.body_done = 0, False, False

    def fire(self, fault: str, where: str) -> None:
        self._report(
            fired={
                "fault": fault,
                "at": where,
                "ballot_in": self.ballot_in,
                "body_done": self.body_done,
            }
        )
        self._board.set_fired(self._rank)
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name not in STORE_CALLS:
            return method

        def call(*args: Any) -> Any:
            self.calls += 1
            if self._plan.fault and self.calls == self._plan.at_call:
                self.fire(self._plan.fault, f"{name}({short(args[0])})")
            out = method(*args)
            self.ballot_in |= name == "append" and str(args[0]).endswith("/v")
            return out

        return call


def short(key: Any) -> str:
    return re.sub(r"[0-9a-f]{12,}", "N", str(key))


def open_store(kind: str, rank: int, size: int, board: Board, folder: Path):
    """The store as vLLM opens it in each process: a FileStore on one file, or
    a TCPStore whose host is rank 0's process."""
    if kind == "file":
        return dist.FileStore(str(folder / "store"), size)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, None, True, TCP_TIMEOUT, wait_for_workers=False
        )
        board.port = store.port
        return store
    board.wait(lambda: board.port > 0)
    return dist.TCPStore(
        "127.0.0.1", board.port, None, False, TCP_TIMEOUT, wait_for_workers=False
    )


def rank_main(case: Case, rank: int, board: Board, folder: Path) -> None:
    log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)  # TCPStore's warnings of a host gone
    path = folder / f"rank{rank}.json"
    record: dict[str, Any] = {"steps": [], "error": ""}

    def report(**fields: Any) -> None:
        record.update(fields)
        save(path, record)

    try:
        run_rank(case, rank, board, folder, record, report)
    except BaseException as e:
        report(error=f"{type(e).__name__}: {e}")
    finally:
        os._exit(0)


def run_rank(case, rank, board, folder, record, report) -> None:
    plan = case.plans[rank]
    step_module.GRACE_S = GRACE
    clock = step_module.time = Clock(plan.skew_s)
    raw = open_store(case.store, rank, case.size, board, folder)
    board.set_phase(rank, OPENED)
    board.wait(lambda: board.all_at(OPENED))
    report(before=raw.num_keys())
    board.set_phase(rank, COUNTED)
    board.wait(lambda: board.all_at(COUNTED))
    store = Faulty(dist.PrefixStore(PREFIX, raw), plan, rank, board, report)
    last = ""
    for i, (what, exchanges) in enumerate(plan.steps):
        for _, flag in (w for w in plan.waits if w[0] == i):
            board.wait(lambda flag=flag: board.flag(flag))
        for _, flag, _ in (r for r in plan.raises if r[:1] + r[2:] == (i, "before")):
            board.raise_flag(flag)
        own, real = clock.monotonic(), time.monotonic()
        step = Step(store, tuple(range(case.size)), rank, what, case.bound_s, last)
        entry: dict[str, Any] = {"what": what, "bad": []}

        def body(step=step, exchanges=exchanges, entry=entry) -> None:
            if not record["steps"]:
                clock.offset_s += plan.jump_s
                clock.wall_s += plan.wall_jump_s
                if plan.dies_in_body:
                    store.fire("kill", "the body")
            for x in range(exchanges):
                got = step.exchange((rank, x))
                if got != [(r, x) for r in range(case.size)]:
                    entry["bad"].append(f"exchange {x + 1} returned {got}")
            store.body_done = True

        store.body_done = False
        try:
            outcome, why, _, raised = step.run(body)
            entry.update(outcome=outcome.name, why=why, raised=repr(raised or ""))
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        entry.update(
            own_s=clock.monotonic() - own,
            real_s=time.monotonic() - real,
            nonce=step.nonce,
            body_done=store.body_done and not entry["bad"],
            calls=store.calls,
        )
        store.calls, store.ballot_in = 0, False
        last = step.nonce
        record["steps"].append(entry)
        report()
        for _, flag, _ in (r for r in plan.raises if r[:1] + r[2:] == (i, "after")):
            board.raise_flag(flag)
        if "error" in entry:
            break
    board.set_phase(rank, DONE)
    board.wait(lambda: board.flag("count"))
    with contextlib.suppress(dist.DistError):  # a TCPStore host gone: no count
        report(after=raw.num_keys())
    board.set_phase(rank, COUNTED_AFTER)
    # Until the parent kills it: the TCPStore's host stays up for the others'
    # count, and no FileStore closes (the last to close deletes the file).
    time.sleep(CASE_TIMEOUT_S)


def attack_main(case: Case, board: Board, folder: Path) -> None:
    """A client that is not a rank, for `case.attack`."""
    os.dup2(os.open(folder / "attacker.log", os.O_WRONLY | os.O_CREAT, 0o600), 2)
    try:
        board.wait(lambda: board.all_at(COUNTED))
        raw = open_store(case.store, -1, case.size, board, folder)
        assert case.attack is not None
        case.attack(dist.PrefixStore(PREFIX, raw), board, folder)
    finally:
        os._exit(0)


@dataclasses.dataclass
class Result:
    case: Case
    ranks: list[dict]
    wall_s: float
    hung: list[int]
    fired_at: dict[int, float]  # when each rank's fault fired (0: never)
    files: list[str]  # in the case's folder, at its end


class Run:
    """One case's processes, advanced by `poll` from the parent's one thread."""

    def __init__(self, case: Case) -> None:
        self.case, self.board = case, Board(case.size)
        self.folder = Path(tempfile.mkdtemp(prefix="step-case-"))
        self.procs = [
            CTX.Process(target=rank_main, args=(case, r, self.board, self.folder))
            for r in range(case.size)
        ]
        if case.attack:
            args = (case, self.board, self.folder)
            self.procs.append(CTX.Process(target=attack_main, args=args))
        self.start = time.monotonic()
        for proc in self.procs:
            proc.daemon = True
            proc.start()
        self.counting_until = 0.0
        self.continued: set[int] = set()
        self.killed: dict[int, float] = {}

    def _settled(self, rank: int) -> bool:
        forever = self.case.plans[rank].fault == "forever"
        return (
            self.board.phase(rank) >= DONE
            or not self.procs[rank].is_alive()
            or (forever and bool(self.board.fired(rank)))
        )

    def poll(self) -> Result | None:
        now, board, case = time.monotonic(), self.board, self.case
        for rank, plan in enumerate(case.plans):
            fired = board.fired(rank)
            if not fired or not self.procs[rank].is_alive():
                continue
            if (
                plan.fault == "stop"
                and rank not in self.continued
                and (now >= fired + STOP_S)
            ):
                pid = self.procs[rank].pid
                assert pid is not None
                os.kill(pid, signal.SIGCONT)
                self.continued.add(rank)
            others = [r for r in range(case.size) if r != rank]
            if (
                plan.fault == "forever"
                and rank not in self.killed
                and (now >= fired + FOREVER_S or all(map(self._settled, others)))
            ):
                self.procs[rank].kill()
                self.killed[rank] = now
        if now - self.start > CASE_TIMEOUT_S:
            return self.finish()
        if not self.counting_until:
            if all(map(self._settled, range(case.size))):
                board.raise_flag("count")
                self.counting_until = now + 3.0
        elif now > self.counting_until or all(
            board.phase(r) >= COUNTED_AFTER or not self.procs[r].is_alive()
            for r in range(case.size)
        ):
            return self.finish()
        return None

    def finish(self) -> Result:
        wall = time.monotonic() - self.start
        hung = [
            r
            for r in range(self.case.size)
            if self.procs[r].is_alive()
            and self.board.phase(r) < DONE
            and r not in self.killed  # stopped for good
        ]
        self.kill()
        ranks = []
        for r in range(self.case.size):
            path = self.folder / f"rank{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {})
        fired = {r: self.board.fired(r) for r in range(self.case.size)}
        files = sorted(path.name for path in self.folder.iterdir())
        shutil.rmtree(self.folder, ignore_errors=True)
        return Result(self.case, ranks, wall, hung, fired, files)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
            proc.close()


def run_cases(cases: list[Case], workers: int = WORKERS) -> list[Result]:
    """Every case, `workers` at once, each under CASE_TIMEOUT_S; every process
    killed at the end, whatever happens."""
    results: dict[int, Result] = {}
    pending, running = list(enumerate(cases)), list[tuple[int, Run]]()
    try:
        while pending or running:
            while pending and len(running) < workers:
                i, case = pending.pop(0)
                running.append((i, Run(case)))
            for i, run in list(running):
                if (result := run.poll()) is not None:
                    results[i] = result
                    running.remove((i, run))
            time.sleep(0.01)
    finally:
        for _, run in running:
            run.kill()
            shutil.rmtree(run.folder, ignore_errors=True)
    return [results[i] for i in range(len(cases))]


def allowance_s(result: Result, rank: int) -> float:
    """How long a rank's step may take: the bound, the grace and SLACK_S, and
    how long it was stopped, or blocked in a call to a stopped TCPStore host
    (until it is continued, or killed)."""
    case, plans = result.case, result.case.plans
    held = {"stop": STOP_S, "forever": FOREVER_S}
    extra = held.get(plans[rank].fault, 0.0) * bool(result.fired_at[rank])
    if case.store == "tcp" and rank and result.fired_at[0]:
        extra += held.get(plans[0].fault, 0.0)
    return case.bound_s + GRACE + SLACK_S + extra


def host_gone(result: Result) -> bool:
    """Rank 0 hosts the TCPStore: once it is killed, the store is gone."""
    plan = result.case.plans[0]
    fired = plan.fault in ("kill", "forever") or plan.dies_in_body
    return result.case.store == "tcp" and fired and bool(result.fired_at[0])


def gone_ranks(result: Result) -> list[int]:
    """Ranks killed, or stopped for good, by their fault."""
    return [
        r
        for r, plan in enumerate(result.case.plans)
        if result.fired_at[r]
        and (plan.fault in ("kill", "forever") or plan.dies_in_body)
    ]


def completed(result: Result, rank: int, step: int) -> bool:
    """The rank ran every exchange of its body and got every rank's data; one
    gone by its fault only if its ballot was in by then."""
    record = result.ranks[rank]
    steps = record.get("steps", [])
    if step < len(steps):
        return steps[step]["body_done"]
    fired = record.get("fired", {})
    return bool(fired.get("body_done") and fired.get("ballot_in"))


def names_absent(why: str, rank: int) -> bool:
    """The reason names `rank` as the one that did not answer (or join)."""
    listed = r"ranks? ([\d, ]+) "
    for ranks, verb in re.findall(listed + r"(did not answer|joined)", why):
        named = {int(r) for r in ranks.split(", ")}
        if (verb == "did not answer") == (rank in named):
            return True
    return False


def violations(result: Result) -> list[str]:
    """What a case breaks, one line each: the invariants of the module's
    docstring. Steps are matched by index where all ranks run one script,
    else by nonce."""
    case = result.case
    found = [f"rank {r} hung past {CASE_TIMEOUT_S} s" for r in result.hung]
    gone, tcp_gone = gone_ranks(result), host_gone(result)
    entries: dict[Any, list[tuple[int, dict]]] = {}
    same_script = len({p.steps for p in case.plans}) == 1
    for rank, record in enumerate(result.ranks):
        if record.get("error"):
            found.append(f"rank {rank}: harness: {record['error']}")
        for i, entry in enumerate(record.get("steps", [])):
            entries.setdefault(i if same_script else entry["nonce"], []).append(
                (rank, entry)
            )
            found += [f"rank {rank} step {i}: {bad}" for bad in entry["bad"]]
            if entry["real_s"] > allowance_s(result, rank):
                found.append(f"rank {rank} step {i} took {entry['real_s']:.2f} s")
            error = entry.get("error", "")
            if error and not (tcp_gone and STORE_GONE in error):
                found.append(f"rank {rank} step {i} raised out of run: {error}")
    for step, ran in entries.items():
        outcomes = {e["outcome"] for _, e in ran if "outcome" in e}
        if len(outcomes) > 1:
            found.append(f"step {step}: ranks ended differently: {sorted(outcomes)}")
        if same_script:
            everyone = all(completed(result, r, step) for r in range(case.size))
        else:  # the ranks that ran this step, each with its own index
            everyone = len(ran) == case.size and all(e["body_done"] for _, e in ran)
        if "KEEP" in outcomes and not everyone:
            found.append(f"step {step}: KEEP though not every rank completed")
        for rank, entry in ran:
            if entry.get("outcome") not in (None, "KEEP"):
                for dead in gone:
                    if not names_absent(entry["why"], dead):
                        found.append(f"rank {rank}'s reason does not name rank {dead}")
    ballots_in = any(result.ranks[r].get("fired", {}).get("ballot_in") for r in gone)
    for rank, record in enumerate(result.ranks):
        if "after" in record and record["after"] != record["before"] and not ballots_in:
            found.append(
                f"rank {rank} counted {record['after'] - record['before']} keys left"
            )
    return found


def describe(result: Result) -> str:
    def rank(r: int, record: dict) -> str:
        fired = record.get("fired")
        steps = "; ".join(
            f"{e['what']}: {e.get('outcome') or e.get('error')} in {e['real_s']:.2f}s"
            + (f" ({e['why']})" if e.get("why") else "")
            for e in record.get("steps", [])
        )
        fault = f" [{fired['fault']} at {fired['at']}]" if fired else ""
        return f"rank {r}{fault}: {steps or '-'}"

    ranks = " | ".join(rank(r, rec) for r, rec in enumerate(result.ranks))
    return f"{result.case.name} ({result.wall_s:.2f} s): {ranks}"


def timing_only(found: list[str]) -> bool:
    return bool(found) and all(re.search(r" took [\d.]+ s$", f) for f in found)


def run_checked(label: str, cases: list[Case], verbose: bool = True) -> list[Result]:
    """Run `cases`, print a line per case (or per violating case) and a
    summary; a case that breaks only the timing runs again, 4 at a time, as a
    loaded machine can hold a rank past its grace. Returns the results."""
    start = time.monotonic()
    results = run_cases(cases)
    timing = [i for i, r in enumerate(results) if timing_only(violations(r))]
    for i, again in zip(timing, run_cases([cases[i] for i in timing], 4), strict=True):
        results[i] = again
    bad = [(r, found) for r in results if (found := violations(r))]
    for result in results:
        if verbose or violations(result):
            print(describe(result))
    print(
        f"{label}: {len(cases)} cases, {len(timing)} rerun, {len(bad)} violating, "
        f"{time.monotonic() - start:.1f} s wall"
    )
    lines = [f"{describe(r)}\n    {' | '.join(found)}" for r, found in bad]
    assert not bad, f"{len(bad)} of {len(cases)} cases violate:\n" + "\n".join(lines)
    return results


def outcomes(result: Result, step: int = 0) -> list[str | None]:
    """Each rank's outcome of its step `step` (None where it has none)."""
    steps = [r.get("steps", []) for r in result.ranks]
    return [s[step].get("outcome") if len(s) > step else None for s in steps]


# Fault-free steps --------------------------------------------------------------


def test_fault_free_steps_keep() -> None:
    """0 to 3 exchanges, 2 and 3 ranks, both stores: KEEP, no key left."""
    cases = [
        Case(
            f"{store}, {size} ranks, {n} exchanges", store, (Plan((("c", n),)),) * size
        )
        for store in STORES
        for size in (2, 3)
        for n in range(4)
    ]
    for result in run_checked("fault-free", cases):
        assert outcomes(result) == ["KEEP"] * result.case.size, describe(result)
        assert all(r["before"] == r["after"] for r in result.ranks), describe(result)


# Clocks ------------------------------------------------------------------------

CLOCK_BOUND_S = 2.0
KEEPS = "keeps"


def clock_cases() -> list[tuple[Case, str]]:
    """(case, expectation): rank 1's clocks skewed or jumping; KEEPS, or the
    rank that must end OFF within the bound, GRACE and 1 s of real time as
    its peer is killed, or "" where only the invariants hold."""
    cases = []
    for store in STORES:
        for name, plan, expect in [
            ("ahead 6 s", Plan(skew_s=6.0), KEEPS),
            ("behind 6 s", Plan(skew_s=-6.0), KEEPS),
            ("jumps 1 s after its join", Plan(jump_s=1.0), KEEPS),
            ("jumps 3 s after its join", Plan(jump_s=3.0), ""),
            ("time.time jumps 1 h after its join", Plan(wall_jump_s=3600.0), KEEPS),
            ("time.time jumps -1 h after its join", Plan(wall_jump_s=-3600.0), KEEPS),
            (
                "ahead 6 s, killed after its join",
                Plan(skew_s=6.0, dies_in_body=True),
                "0",
            ),
            (
                "ahead 1 s, killed after its join",
                Plan(skew_s=1.0, dies_in_body=True),
                "0",
            ),
        ]:
            plans = (Plan(), plan)
            cases.append(
                (Case(f"{store}: rank 1 {name}", store, plans, CLOCK_BOUND_S), expect)
            )
        # Rank 0 killed: its peer's clock is behind. (Rank 0 hosts a TCPStore.)
        if store == "file":
            plans = (Plan(dies_in_body=True), Plan(skew_s=-6.0))
            name = f"{store}: rank 1 behind 6 s, rank 0 killed after its join"
            cases.append((Case(name, store, plans, CLOCK_BOUND_S), "1"))
    return cases


def clock_miss(result: Result, expect: str) -> str:
    """How a clock case misses its expectation, or ""."""
    if expect == KEEPS and outcomes(result) != ["KEEP", "KEEP"]:
        return f"not KEEP: {describe(result)}"
    if expect.isdigit():
        entry = (result.ranks[int(expect)].get("steps") or [{}])[0]
        limit = CLOCK_BOUND_S + GRACE + 1.0
        if entry.get("outcome") != "OFF" or entry["real_s"] > limit:
            return f"not OFF within {limit} s of real time: {describe(result)}"
    return ""


def test_clocks_skewed_or_jumping() -> None:
    """Each rank's deadlines on its own clock: however far rank 1's clocks are
    from rank 0's, or jump below the bound once it joined (or its wall clock
    jumps by any amount), a fault-free step keeps; a step whose peer is killed
    ends OFF within the bound, GRACE and 1 s of real time. (A monotonic jump
    past the bound ends the step on that rank's own clock: KEEP or OFF, the
    same on both.) A case that misses runs again alone, as a loaded machine
    can hold a rank past the bound."""
    cases = clock_cases()
    results = run_checked("clocks", [c for c, _ in cases])
    missed = [i for i, (c, e) in enumerate(cases) if clock_miss(results[i], e)]
    again = run_cases([cases[i][0] for i in missed], 1)
    wrong = [
        miss
        for i, result in zip(missed, again, strict=True)
        if (miss := clock_miss(result, cases[i][1]))
    ]
    print(f"clocks: {len(missed)} missed and ran again, {len(wrong)} missed twice")
    assert not wrong, "\n".join(wrong)


# SIGKILL and SIGSTOP at every store call ---------------------------------------

FAULTS = ("kill", "stop", "forever")


def calls_of_fault_free(store: str, exchanges: int) -> int:
    """A rank's store calls in a fault-free step of 2 ranks: the most of any
    rank in a few runs (the last rank out deletes; polls vary)."""
    plans = (Plan((("c", exchanges),)),) * 2
    results = run_cases([Case("count", store, plans)] * 4)
    return max(r["steps"][0]["calls"] for res in results for r in res.ranks)


def check_host_gone(result: Result) -> list[str]:
    """Where rank 0, the TCPStore's host, is killed (or stopped for good, then
    killed): a peer that needs the store after that raises StoreGone."""
    if not host_gone(result):
        return []
    found = []
    ballot_in = result.ranks[0].get("fired", {}).get("ballot_in")
    for rank, record in enumerate(result.ranks[1:], 1):
        entry = (record.get("steps") or [{}])[0]
        error = entry.get("error", "")
        if "outcome" not in entry and not error.startswith(f"StoreGone: {STORE_GONE}"):
            found.append(f"rank {rank} neither ended nor raised StoreGone: {entry}")
        if not ballot_in and "outcome" in entry:
            found.append(f"rank {rank} ended though rank 0 was gone before its ballot")
    return found


@pytest.mark.parametrize("exchanges", [1, 0, 2])
def test_sigkill_and_sigstop_at_every_store_call(exchanges: int) -> None:
    """Two ranks; one gets SIGKILL, or SIGSTOP (continued after STOP_S, or
    never), at its k-th store call, for every k up to the calls of a
    fault-free step (with 0 and 2 exchanges: SIGKILL only). The survivors
    end alike within the bound and name the rank that did not answer; where
    rank 0, the TCPStore's host, is gone, a peer that still needs the store
    raises StoreGone. A stopped host answers no call at all (torch's store
    timeout bounds waits only), so its peers block until it is killed: the
    cases print what they did."""
    cases = []
    for store in STORES:
        calls = calls_of_fault_free(store, exchanges)
        print(f"\n{store}: {calls} store calls per rank, {exchanges} exchanges")
        faults = FAULTS if exchanges == 1 else ("kill",)
        for fault in faults:
            for rank in (0, 1):
                for k in range(1, calls + 1):
                    plans = [Plan((("c", exchanges),))] * 2
                    plans[rank] = dataclasses.replace(
                        plans[rank], fault=fault, at_call=k
                    )
                    name = f"{store}: rank {rank} {fault} at call {k}"
                    cases.append(Case(name, store, tuple(plans)))
    results = run_checked(f"faults at every call, {exchanges} exchanges", cases)
    wrong = [(describe(r), f) for r in results if (f := check_host_gone(r))]
    gone = sum(STORE_GONE in str(r.ranks[1]) for r in results if host_gone(r))
    print(f"StoreGone raised in {gone} cases where the TCPStore's host went")
    assert not wrong, "\n".join(f"{d}\n    {f}" for d, f in wrong)


# Sequences where one rank runs a step the others do not ------------------------


def sequence_cases() -> list[Case]:
    cases = []
    steps0 = (("A", 1), ("X", 1), ("B", 1), ("C", 1))
    steps1 = (("A", 1), ("B", 1), ("C", 1))
    for store in STORES:
        idle = (
            Plan(steps0, raises=((1, "x_done", "after"),)),
            Plan(steps1, waits=((1, "x_done"),)),
        )
        overlap = (
            Plan(steps0, raises=((1, "x_started", "before"),)),
            Plan(steps1, waits=((1, "x_started"),)),
        )
        cases.append(Case(f"{store}: rank 0 runs X alone", store, idle))
        cases.append(
            Case(f"{store}: rank 1 runs B while rank 0 runs X", store, overlap)
        )
    return cases


def test_a_step_that_one_rank_runs_alone() -> None:
    """Rank 0 runs [A, X, B, C], rank 1 [A, B, C]. Where rank 1 starts B once
    rank 0's X returned, X ends OFF on rank 0 without blaming rank 1, and B
    and C keep. Where rank 1 starts B while rank 0 runs X, the steps they run
    together with different names end OFF on both, naming both; later steps
    are only printed (they pair off by position until one runs alone)."""
    results = run_checked("sequences", sequence_cases())
    wrong = []
    for result in results:
        by_what = [{e["what"]: e for e in r["steps"]} for r in result.ranks]
        if "alone" in result.case.name:
            x = by_what[0]["X"]
            if (
                x["outcome"] != "OFF"
                or x["why"] != "only rank 0 joined within the bound"
            ):
                wrong.append(f"X: {x}")
            for what in "ABC":
                if [s[what]["outcome"] for s in by_what] != ["KEEP", "KEEP"]:
                    wrong.append(f"{what} did not keep: {describe(result)}")
        else:
            nonces: dict[str, list[tuple[int, dict]]] = {}
            for rank, record in enumerate(result.ranks):
                for e in record["steps"]:
                    nonces.setdefault(e["nonce"], []).append((rank, e))
            for ran in nonces.values():
                whats = {e["what"] for _, e in ran}
                if len(ran) > 1 and len(whats) > 1:
                    w0, w1 = (e["what"] for _, e in sorted(ran, key=lambda x: x[0]))
                    named = (
                        f"the ranks ran different steps (rank 0: {w0}, rank 1: {w1})"
                    )
                    if any(e["outcome"] != "OFF" or e["why"] != named for _, e in ran):
                        wrong.append(f"{ran}")
        if any(r["before"] != r["after"] for r in result.ranks):
            wrong.append(f"keys left: {describe(result)}")
    assert not wrong, "\n".join(wrong)


# A store value that is not data ------------------------------------------------


class RunsCode:
    """Unpickling this would run a command that creates `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.path}",)


def as_record(value: tuple) -> bytes:
    """A record of rank 1's, as the step module writes one."""
    record = getattr(step_module, "_record", None)
    return record(1, 1, value) if record else pickle.dumps((1, 1, value))


def payload(kind: str, target: str, folder: Path) -> bytes:
    if kind == "random":
        return b"\xff" + os.urandom(63)  # never UTF-8
    code = RunsCode(folder / "code_ran")
    return pickle.dumps(code) if target == "slot" else as_record((code,))


def attack(kind: str, target: str) -> Callable:
    """Where the ranks wait for "release": write the value into `target` (the
    slot, or a key of the nonce rank 0 claimed), then release them."""

    def run(store, board: Board, folder: Path) -> None:
        value = payload(kind, target, folder)
        if target == "slot":
            store.set(SLOT, value)
        else:
            gone = getattr(step_module, "GONE", b"gone")
            board.wait(lambda: store.compare_set(SLOT, gone, gone) != gone)
            nonce = store.compare_set(SLOT, gone, gone).decode()
            store.append(f"{nonce}/{target}", value)
        board.raise_flag("release")

    return run


def not_data(targets: tuple[str, ...], expect: str = "OFF") -> None:
    cases = []
    for store in STORES:
        for kind in ("code", "random"):
            for target in targets:
                held = (0, 1) if target == "slot" else (1,)
                plans = tuple(
                    Plan(waits=((0, "release"),) if r in held else ()) for r in (0, 1)
                )
                name = f"{store}: {kind} in {target}"
                cases.append(Case(name, store, plans, attack=attack(kind, target)))
    results = run_cases(cases)
    wrong = []
    for result in results:
        print(describe(result))
        found = violations(result)
        found += [
            f"rank {r} ended {o}, not {expect}"
            for r, o in enumerate(outcomes(result))
            if o != expect
        ]
        if "code_ran" in result.files:
            found.append("the code ran")
        if found:
            wrong.append(f"{describe(result)}\n    {' | '.join(found)}")
    print(
        f"not data in {', '.join(targets)}: {len(cases)} cases, {len(wrong)} violating"
    )
    assert not wrong, "\n".join(wrong)


def test_a_step_key_that_is_not_data() -> None:
    """A pickle that would run code, or random bytes, in the join, exchange or
    ballot key of the nonce rank 0 claimed: every rank ends OFF, runs no code,
    and leaves no key."""
    not_data(("j", "1", "v"))


def test_a_slot_that_is_not_a_nonce() -> None:
    """The same, set as the slot itself, before any rank claims it: the first
    rank to claim it clears it, and the step goes on."""
    not_data(("slot",), expect="KEEP")
