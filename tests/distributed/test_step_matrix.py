# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The step protocol (`Step`) under a fault matrix.

Ranks are threads over one real torch store per case (a HashStore). Each runs
`Step(...).run(body)` with a scripted body of 0 to 3 exchanges. A proxy per
rank counts that rank's store calls and, at its k-th call (its point), fires
the rank's fault from FAULTS; a few faults are per rank, without a point.
`points` counts the calls of fault-free runs.
`violations` checks every case:

0. every rank returns (or dies by injection) within a hard timeout, without
   raising, and each exchange gives it every rank's data;
1. every rank that returns returns the same Outcome;
2. KEEP only where every rank completed (`completed`);
3. each rank returns within RETURN_S plus the delay injected into it;
4. no key is left in the store once every rank that returns has returned
   (but where a rank died once its ballot was in: see `violations`);
5. the outcome is the one `expected` derives from what each rank did (a
   fault-free case KEEPs, a failure gives up, a raise raises, ...).

Every single fault runs at every point of every rank, for 2 and 3 ranks and
0 to 3 exchanges; every pair of faults on two ranks at their first calls;
random pairs of faults at random points under Hypothesis.
Cases run concurrently (their waits sleep), each under a hard timeout. Run
with `-s` for each matrix's summary line.
"""

import concurrent.futures
import dataclasses
import re
import threading
import time
import traceback
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from vllm.distributed.device_communicators.store_step import (
    GRACE_S,
    Ballot,
    Outcome,
    Step,
    _first_records,
)

BOUND_S = 0.4
LATE_S = 0.5 * BOUND_S  # within the bound
STALL_S = BOUND_S + GRACE_S + 0.3  # past the bound and its grace
RETURN_S = 2 * BOUND_S + GRACE_S + 1.0  # invariant 3, beyond a rank's own delay
CASE_TIMEOUT_S = 6.0  # a rank not back (or dead) by then hung
# A store call waiting on a missing key raises after this, so that a hung
# rank's thread ends soon after its case (torch's default is 5 minutes).
STORE_TIMEOUT = timedelta(seconds=CASE_TIMEOUT_S + 1)
WORKERS = 48  # cases at once: they mostly sleep (more starve the GIL)
WHAT, OTHER = "create mnnvl bfloat16 x 128 tokens", "checkpoint_prepare"
SIZES, EXCHANGES = (2, 3), (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    at_call: bool  # fires at its rank's k-th store call; else per rank only
    effect: str
    delay_s: float = 0.0  # slept before that call, which then goes ahead


FAULTS = {
    f.name: f
    for f in (
        Fault("fails", True, "the body appends to step.failures and stops"),
        Fault("raises", True, "the body raises InjectedError"),
        Fault("dies", True, "blocks until the case is over, then Died at each call"),
        Fault("stalls", True, "sleeps past the bound and grace, goes on", STALL_S),
        Fault("late", True, "sleeps half the bound, goes on", LATE_S),
        Fault("other_step", False, f"runs {OTHER!r} instead"),
        Fault("fewer", False, "its body does one exchange fewer"),
        # Its deadline is later than the others': it joins the step they gave up.
        Fault("starts_late", False, "calls Step() past the bound", BOUND_S + 0.1),
    )
}
# The body acts on these before each exchange and at its end, if still running.
FLAGGED = ("fails", "raises")
# A rank that these stop before its own ballot is in is absent.
GONE = ("dies", "stalls")


class InjectedError(Exception):
    pass


class Died(BaseException):
    """Not an Exception: nothing in Step may catch it and go on."""


@dataclasses.dataclass(frozen=True)
class Case:
    size: int
    exchanges: int
    faults: tuple[tuple[int, str, int], ...] = ()  # (rank, fault, point or 0)

    def fault(self, rank: int) -> str:
        return next((f for r, f, _ in self.faults if r == rank), "")

    def point(self, rank: int) -> int:
        return next((k for r, _, k in self.faults if r == rank), 0)

    def what(self, rank: int) -> str:
        return OTHER if self.fault(rank) == "other_step" else WHAT

    def exchanges_of(self, rank: int) -> int:
        return self.exchanges - (self.fault(rank) == "fewer")

    def same_script(self) -> bool:
        """Every rank runs the same step with as many exchanges (even if
        every one of them runs the other step, or one exchange fewer)."""
        ranks = range(self.size)
        return len({(self.what(r), self.exchanges_of(r)) for r in ranks}) == 1

    def __str__(self) -> str:
        faults = "; ".join(
            f"rank {r} {f}" + f" at call {k}" * bool(k) for r, f, k in self.faults
        )
        return f"{self.size} ranks, {self.exchanges} exchanges, {faults or 'no fault'}"


@dataclasses.dataclass
class RankRun:
    """What one rank did in a case, as its proxy and its body saw it."""

    rank: int
    what: str = WHAT
    calls: list[tuple[str, Any, float]] = dataclasses.field(default_factory=list)
    fired: str = ""  # the store call its fault fired at: method(key)
    flag: bool = False  # a fails/raises fault fired
    acted: bool = False  # the body acted on it (it was still running)
    body_done: bool = False  # the body returned after all its exchanges
    own_ballot: bool = False  # its own ballot is the first for it
    counted_out: bool = False  # it added itself to the count of ranks done
    ballot_before_fault: bool = False
    died: bool = False
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)
    outcome: Outcome | None = None
    why: str = ""
    raised: BaseException | None = None
    error: str = ""  # anything but an outcome or an injected death
    elapsed_s: float = 0.0
    delay_s: float = 0.0  # injected into this rank
    bad_data: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CaseResult:
    case: Case
    runs: list[RankRun]
    left_keys: list[str]
    num_keys: int
    hung: list[int]


def short(key: Any) -> str:
    """A key (or list of keys) with its 32-hex nonce written as N."""
    text = key if isinstance(key, str) else ",".join(key)
    return re.sub(r"[0-9a-f]{32}", "N", text)


STORE_CALLS = {
    "add", "append", "check", "compare_set", "delete_key", "get", "multi_get",
    "set", "wait",
}  # fmt: skip


class RankStore:
    """One rank's view of the case's store: counts its calls, fires its fault."""

    def __init__(self, store, case: Case, run: RankRun, over, written: set, gone):
        self._store, self._run, self._over, self._written = store, run, over, written
        self._fault, self._point = case.fault(run.rank), case.point(run.rank)
        self._size, self._deleted = case.size, gone

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name not in STORE_CALLS:
            return method

        def call(*args: Any) -> Any:
            self._before(name, args[0])
            out = method(*args)
            if name in ("add", "append", "compare_set", "set"):
                self._written.add(args[0])
            self._track_ballot(name, args, out)
            return out

        return call

    def _track_ballot(self, name: str, args: tuple, out: Any) -> None:
        """Whether this rank's own ballot is the first for it in the ballots
        its peers read (not in a log it wrote anew once they deleted theirs)."""
        run, key = self._run, args[0]
        if name == "add" and key.endswith("/n"):
            run.counted_out = True
        if not isinstance(key, str) or not key.endswith("/v"):
            return
        if name == "delete_key":
            self._deleted.add(key)
        elif name == "append" and key not in self._deleted:
            log = self._store.compare_set(key, "gone", "gone")
            first, _ = _first_records(log, self._size, Ballot.decode)
            if first.get(run.rank, (-1,))[0] == run.rank:
                run.own_ballot = True

    def _before(self, name: str, key: Any) -> None:
        run = self._run
        if run.died:
            raise Died
        run.calls.append((name, key, time.monotonic()))
        if len(run.calls) != self._point or not FAULTS[self._fault].at_call:
            return
        run.fired = f"{name}({short(key)})"
        run.ballot_before_fault = run.own_ballot
        if self._fault in FLAGGED:
            run.flag = True
        elif self._fault == "dies":
            run.died = True
            run.settled.set()
            self._over.wait(CASE_TIMEOUT_S)
            raise Died
        else:
            run.delay_s = FAULTS[self._fault].delay_s
            time.sleep(run.delay_s)


def scripted_body(case: Case, step: Step, run: RankRun):
    def stopped() -> bool:
        if not run.flag:
            return False
        run.acted = True
        if case.fault(run.rank) == "raises":
            raise InjectedError(f"injected on rank {run.rank}")
        step.failures.append(f"injected failure on rank {run.rank}")
        return True

    def body() -> None:
        for i in range(case.exchanges_of(run.rank)):
            if stopped():
                return
            got = step.exchange((run.rank, i))
            if got != [(r, i) for r in range(case.size)]:
                run.bad_data.append(f"exchange {i + 1} returned {got}")
        run.body_done = not stopped()

    return body


def run_case(case: Case) -> CaseResult:
    store = dist.HashStore()
    store.set_timeout(STORE_TIMEOUT)
    over, written, deleted = threading.Event(), set[str](), set[str]()
    runs = [RankRun(rank) for rank in range(case.size)]

    def rank_main(run: RankRun) -> None:
        run.what = case.what(run.rank)
        proxy = RankStore(store, case, run, over, written, deleted)
        if case.fault(run.rank) == "starts_late":
            time.sleep(FAULTS["starts_late"].delay_s)
        start = time.monotonic()
        try:
            step = Step(proxy, tuple(range(case.size)), run.rank, run.what, BOUND_S)
            body = scripted_body(case, step, run)
            run.outcome, run.why, _, run.raised = step.run(body)
        except Died:
            pass
        except BaseException as e:
            frames = traceback.extract_tb(e.__traceback__)[1:]
            where = " <- ".join(f.name for f in reversed(frames))
            run.error = f"{type(e).__name__}: {e} (in {where})"
        finally:
            run.elapsed_s = time.monotonic() - start
            run.settled.set()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in runs]
    for thread in threads:
        thread.start()
    try:
        give_up = time.monotonic() + CASE_TIMEOUT_S
        for run in runs:
            run.settled.wait(max(0.0, give_up - time.monotonic()))
        hung = [run.rank for run in runs if not run.settled.is_set()]
        # Every rank that returns has returned; the dead still block.
        left = sorted(short(key) for key in written if store.check([key]))
        num_keys = store.num_keys()
    finally:
        over.set()
    for thread in threads:
        thread.join(5)
    return CaseResult(case, runs, left, num_keys, hung)


def absent(case: Case, run: RankRun) -> bool:
    """A death or a stall stopped the rank before its own ballot was in, and
    it never got it in (a stall can end before a peer's later deadline)."""
    stopped = case.fault(run.rank) in GONE and bool(run.fired)
    return stopped and not run.ballot_before_fault and not run.own_ballot


def completed(case: Case, run: RankRun) -> bool:
    """The rank ran the same script as every other, its body returned normally
    after all its exchanges, and it was not absent. (A rank that dies or
    stalls once its DONE ballot is in has voted: it completed.)"""
    return case.same_script() and run.body_done and not absent(case, run)


def expected(case: Case, runs: list[RankRun]) -> Outcome:
    """`outcome`'s precedence, from what the ranks did rather than their ballots."""
    acted = {case.fault(r.rank) for r in runs if r.acted}
    steps = {r.what for r in runs}
    if len(steps) > 1 or any(absent(case, r) for r in runs):
        return Outcome.OFF
    if "raises" in acted:
        return Outcome.RAISE
    if "fails" in acted:
        return Outcome.GIVE_UP
    return Outcome.KEEP if all(completed(case, r) for r in runs) else Outcome.OFF


def violations(result: CaseResult) -> list[str]:
    """Every check a case breaks, one line each, numbered as in the docstring."""
    case, runs = result.case, result.runs
    back = [r for r in runs if not r.died and r.rank not in result.hung]
    found = [f"0: rank {r} hung past {CASE_TIMEOUT_S} s" for r in result.hung]
    found += [f"0: rank {r.rank} raised out of run: {r.error}" for r in runs if r.error]
    found += [f"0: rank {r.rank} {bad}" for r in runs for bad in r.bad_data]
    outcomes = {r.outcome for r in back if not r.error}
    if len(outcomes) > 1:
        found.append("1: ranks returned different outcomes")
    if Outcome.KEEP in outcomes and not all(completed(case, r) for r in runs):
        found.append("2: KEEP though not every rank completed")
    for r in back:
        if r.elapsed_s > RETURN_S + r.delay_s:
            found.append(f"3: rank {r.rank} took {r.elapsed_s:.2f} s")
    # A rank that dies once its ballot is in leaves its step's keys: its peers
    # cannot tell it from a rank held up before it reads the ballots, and
    # counting that one out would let it come back to another outcome (check
    # 1). The keys are one step's, under a nonce no later step reads. Where
    # every rank died, none is left to delete anything.
    dead = [r.rank for r in runs if r.died and r.ballot_before_fault]
    if (result.num_keys or result.left_keys) and back and not dead:
        keys = ", ".join(result.left_keys)
        found.append(f"4: {result.num_keys} keys left: {keys}")
    if outcomes and outcomes != {want := expected(case, runs)}:
        found.append(f"5: expected {want.name}")
    for r in back:
        mine = case.fault(r.rank) == "raises" and r.acted
        if mine and not isinstance(r.raised, InjectedError):
            found.append(f"5: rank {r.rank} got back {r.raised!r}, not its raise")
        # A rank held past the bound cannot know its peers' steps, nor they its
        # own: `?` stands for a step no ballot gave.
        held = any(case.fault(x.rank) in GONE and x.fired for x in runs)
        if len({x.what for x in runs}) > 1 and not held:
            named = [rf"rank {x.rank}\W+({re.escape(x.what)}|\?)" for x in runs]
            ran = set(re.findall(r"rank \d+: ([^,)]+)", r.why)) - {"?"}
            if not all(re.search(n, r.why) for n in named) or len(ran) < 2:
                found.append(f"5: rank {r.rank}'s reason names not every step")
    return found


def timing_only(found: list[str]) -> bool:
    return bool(found) and {line.split(":")[0] for line in found} <= {"3", "5"}


def describe(result: CaseResult, found: list[str]) -> str:
    def rank(r: RankRun) -> str:
        ended = f"{r.outcome and r.outcome.name} in {r.elapsed_s:.2f}s"
        fired = f", fault fired at {r.fired}" if r.fired else ""
        why = f" ({r.why})" if r.why else ""
        return f"rank {r.rank}: {'died' if r.died else ended}{fired}{why}"

    ranks = "; ".join(rank(r) for r in result.runs)
    return f"{result.case}: {' | '.join(found)}\n    {ranks}"


def run_matrix(label: str, cases: list[Case]) -> None:
    """Run `cases` concurrently, print a summary and fail on any violation.
    A case that breaks only the checks that assume the ranks keep time (3, 5)
    runs again, four at a time: a loaded machine can hold a rank up past the
    grace, and a rank held up is absent."""
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(run_case, cases))
    timing = [i for i, r in enumerate(results) if timing_only(violations(r))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        again = pool.map(run_case, [cases[i] for i in timing])
        for i, result in zip(timing, again, strict=True):
            results[i] = result
    wall = time.monotonic() - start
    bad = [(res, found) for res in results if (found := violations(res))]
    faults = Counter(f for c in cases for _, f, _ in c.faults)
    checks = Counter(line.split(":")[0] for _, found in bad for line in found)
    print(
        f"\n{label}: {len(cases)} cases (faults {dict(faults)}), {len(timing)} "
        f"rerun, {len(bad)} violating (by check {dict(checks)}), {wall:.1f} s wall"
    )
    lines = [describe(res, found) for res, found in bad]
    assert not bad, f"{len(bad)} of {len(cases)} cases violate:\n" + "\n".join(lines)


_points: dict[tuple[int, int], int] = {}


def points(size: int, exchanges: int) -> int:
    """Store calls of a rank in a fault-free step: the most of any rank in a
    few runs, since any rank may be the one that deletes the keys."""
    if (size, exchanges) not in _points:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = pool.map(run_case, [Case(size, exchanges)] * 4)
            most = max(len(r.calls) for res in results for r in res.runs)
        _points[size, exchanges] = most
    return _points[size, exchanges]


def single_faults(size: int, exchanges: int) -> list[Case]:
    """The fault-free case, and each fault on each rank at each of its points."""
    cases = [Case(size, exchanges)]
    for rank in range(size):
        for fault in FAULTS.values():
            if fault.name == "fewer" and not exchanges:
                continue
            at = range(1, points(size, exchanges) + 1) if fault.at_call else [0]
            cases += [Case(size, exchanges, ((rank, fault.name, k),)) for k in at]
    return cases


@pytest.mark.parametrize("size", SIZES)
def test_every_single_fault_at_every_point(size: int) -> None:
    cases = [c for e in EXCHANGES for c in single_faults(size, e)]
    per_rank = {e: points(size, e) for e in EXCHANGES}
    print(f"\n{size} ranks: points per rank by exchanges {per_rank}", end="")
    run_matrix(f"every single fault, {size} ranks", cases)


@pytest.mark.parametrize("size", SIZES)
def test_which_of_two_faults_decides(size: int) -> None:
    """Every ordered pair of faults on ranks 0 and 1, each at its rank's first
    store call, so that both take effect: `expected`'s precedence."""
    cases = [
        Case(size, e, ((0, a, int(FAULTS[a].at_call)), (1, b, int(FAULTS[b].at_call))))
        for e in EXCHANGES
        for a in FAULTS
        for b in FAULTS
        if e or "fewer" not in (a, b)
    ]
    run_matrix(f"every pair of faults at the first call, {size} ranks", cases)


@st.composite
def fault_pairs(draw: st.DrawFn) -> Case:
    size = draw(st.sampled_from(SIZES))
    exchanges = draw(st.sampled_from(EXCHANGES))
    ranks = sorted(draw(st.permutations(range(size)))[:2])
    names = [f for f in FAULTS if exchanges or f != "fewer"]
    faults = []
    for rank in ranks:
        fault = FAULTS[draw(st.sampled_from(names))]
        point = draw(st.integers(1, points(size, exchanges))) if fault.at_call else 0
        faults.append((rank, fault.name, point))
    return Case(size, exchanges, tuple(faults))


PAIRS_PER_BATCH = 150


@settings(
    max_examples=3,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],  # no shrinking: every violating pair is listed
    suppress_health_check=list(HealthCheck),
)
@given(st.lists(fault_pairs(), min_size=PAIRS_PER_BATCH, max_size=PAIRS_PER_BATCH,
                unique=True))  # fmt: skip
def test_random_pairs_of_faults(cases: list[Case]) -> None:
    run_matrix("pairs of faults on two ranks", cases)
