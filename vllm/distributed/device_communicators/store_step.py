# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A bounded, voted step over a torch store, for a collective that must end
the same way on every rank: the ranks join it, exchange data, vote, and one
map (`outcome`) turns the votes into what every rank returns.

Each phase is one key that every rank appends a record to and reads whole,
without blocking. Every reader sees a prefix of the same log, so the first
record for each rank is the same for all of them, however late they read.
Deadlines run on each rank's own monotonic clock: no rank reads another's
time. Records are decoded as plain data: no class is looked up."""

import dataclasses
import enum
import io
import pickle
import re
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

SLOT = "slot"  # the nonce of the step being joined; freed once all joined
GONE = b"gone"  # what compare_set(key, GONE, GONE) reads for a missing key
POLL_S = 0.1  # the longest pause between two looks at the store
GRACE_S = 0.5  # past the bound, for the ballots of ranks that left at it


def some_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


class Vote(enum.Enum):
    """How a rank ended a step. ABSENT and UNJOINED are written by a peer."""

    DONE = "completed"
    FAILED = "failed"
    RAISED = "raised"
    LEFT = "stopped exchanging"
    ABSENT = "did not answer within the bound"
    UNJOINED = "did not join within the bound"


PEER_WRITTEN = (Vote.ABSENT, Vote.UNJOINED)


class Outcome(enum.Enum):
    """What every rank does after a step; the caller says what each means."""

    KEEP = "keep"
    GIVE_UP = "give up"
    OFF = "off"
    RAISE = "raise"


@dataclasses.dataclass(frozen=True)
class Ballot:
    vote: Vote
    step: str = ""  # what the rank ran
    detail: str = ""
    rounds: int = 0  # exchanges written, for the last rank out to delete

    def encode(self) -> tuple:
        return self.vote.name, self.step, self.detail, self.rounds

    @classmethod
    def decode(cls, value: tuple) -> "Ballot":
        vote, step, detail, rounds = value
        if not (type(step) is type(detail) is str and type(rounds) is int):
            raise ValueError(value)
        return cls(Vote[vote], step, detail, rounds)


def outcome(ranks: Iterable[int], ballots: list[Ballot]) -> tuple[Outcome, str]:
    """The one map from a step's ballots to its outcome: KEEP only where every
    rank completed the same step."""
    by_rank = list(zip(ranks, ballots, strict=True))
    if len({b.step for _, b in by_rank if b.vote not in PEER_WRITTEN}) > 1:
        ran = ", ".join(f"rank {r}: {b.step or '?'}" for r, b in by_rank)
        return Outcome.OFF, f"the ranks ran different steps ({ran})"
    if any(b.vote is Vote.UNJOINED for _, b in by_rank):
        joined = [r for r, b in by_rank if b.vote is not Vote.UNJOINED]
        return Outcome.OFF, f"only {some_ranks(joined)} joined within the bound"
    rules = [(Vote.ABSENT, Outcome.OFF), (Vote.RAISED, Outcome.RAISE)]
    rules += [(Vote.FAILED, Outcome.GIVE_UP), (Vote.LEFT, Outcome.OFF)]
    for vote, result in rules:
        by_detail: dict[str, list[int]] = {}
        for r, b in by_rank:
            if b.vote is vote:
                by_detail.setdefault(b.detail, []).append(r)
        if by_detail:
            return result, "; ".join(
                f"{some_ranks(r)} {vote.value}" + f": {detail}" * bool(detail)
                for detail, r in by_detail.items()
            )
    return Outcome.KEEP, ""


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _record(writer: int, subject: int, value: tuple) -> bytes:
    return pickle.dumps((writer, subject, value), protocol=3)


def _first_records(
    log: bytes, size: int, decode: Callable[[tuple], Any]
) -> tuple[dict[int, tuple[int, Any]], bool]:
    """Each rank's first record (its writer and value), in log order, and
    whether all that was read decodes. Reading stops once every rank has one,
    so bytes appended after that change nothing."""
    first: dict[int, tuple[int, Any]] = {}
    stream = io.BytesIO(log)
    records = _PlainData(stream)
    while stream.tell() < len(log) and len(first) < size:
        try:
            writer, subject, value = records.load()
            if not {type(writer), type(subject)} == {int}:
                raise ValueError("not a record")
            if not (0 <= writer < size and 0 <= subject < size):
                raise ValueError("not a rank")
            first.setdefault(subject, (writer, decode(value)))
        except Exception:
            return first, False
    return first, True


def _exchanged(value: tuple) -> tuple:
    if len(value) > 1:
        raise ValueError(value)
    return value  # (data,), or () where the rank ended its part


def _joined(value: tuple) -> str:
    (what,) = value
    if type(what) is not str:
        raise ValueError(value)
    return what


class Left(Exception):
    """This rank stopped exchanging: a peer ended the step, or the bound passed."""


class StoreGone(RuntimeError):
    """The store stopped answering: its host (for a TCPStore, the process of
    global rank 0) has ended, and the group with it."""


class Step:
    """One collective step over `store`, under a nonce claimed through SLOT.
    The last rank out (counting the ranks whose ballots it wrote) deletes its
    keys; a rank back after that deletes what it wrote again."""

    def __init__(self, store, ranks, rank, what: str, bound_s: float, last=""):
        self.store, self.ranks, self.size, self.rank = store, ranks, len(ranks), rank
        self.what, self.bound_s, self.nonce = what, bound_s, last
        self.deadline = time.monotonic() + bound_s  # to join; then for the step
        self.rounds, self.failures, self.left = 0, list[str](), ""
        self.joined: set[int] = set()
        self.speaker = -1  # the first rank that answered: it logs the outcome

    def _append(self, name: str, *records: tuple[int, tuple]) -> None:
        self.store.append(
            f"{self.nonce}/{name}", b"".join(_record(self.rank, *r) for r in records)
        )

    def _read(self, name: str, decode: Callable) -> tuple[dict, bool]:
        log = self.store.compare_set(f"{self.nonce}/{name}", GONE, GONE)
        return _first_records(b"" if log == GONE else log, self.size, decode)

    def _gather(self, name: str, value: tuple, decode, until: float):
        """Appends this rank's record, then polls until every rank has one, a
        record does not decode, or `until` passes."""
        self._append(name, (self.rank, value))
        pause_s = 0.001
        while True:
            time.sleep(min(pause_s, max(until - time.monotonic(), 0)))
            pause_s = min(2 * pause_s, POLL_S)
            first, clean = self._read(name, decode)
            if len(first) == self.size or not clean or time.monotonic() >= until:
                return first, clean

    def exchange(self, data: Any) -> list[Any]:
        """An allgather, for FlashInfer's comm backend; none once this rank left,
        whatever FlashInfer made of the Left it raised."""
        if not self.left:
            self.rounds += 1
            name = str(self.rounds)
            first, clean = self._gather(name, (data,), _exchanged, self.deadline)
            if not clean:
                self.left = f"exchange {name} held a value that does not decode"
            elif len(first) < self.size:
                self.left = f"exchange {name} reached the bound"
            elif () in (value for _, value in first.values()):
                self.left = f"a peer had ended before exchange {name}"
            else:
                return [first[i][1][0] for i in range(self.size)]
        raise Left(self.left)

    def run(self, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        """`body()`, then the ballots: the outcome, why, this rank's result and
        the exception it raised."""
        try:
            return self._run(body)
        except dist.DistError as e:
            raise StoreGone(f"the group's store is gone: {e}") from e

    def _run(self, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        result = raised = None
        if not self._claim():
            return Outcome.OFF, "the step before it never freed the slot", None, None
        joined = self._join()
        mine = Ballot(Vote.DONE if joined else Vote.LEFT, self.what)
        try:
            result = body() if joined else None
        except Exception as e:
            raised = e
            mine = Ballot(Vote.RAISED, self.what, f"{type(e).__name__}: {e}")
        if self.left:
            mine, raised = Ballot(Vote.LEFT, self.what, self.left), None
        elif self.failures and not raised:
            mine = Ballot(Vote.FAILED, self.what, " ".join(self.failures))
        mine = dataclasses.replace(mine, rounds=self.rounds)
        return *self._vote(mine), result, raised

    def _claim(self) -> bool:
        """The slot's nonce, unless it is the step this rank ran last: one it
        left before all joined holds the slot until its last rank out frees it.
        A slot that holds no nonce (bytes a client wrote) is cleared."""
        fresh = uuid.uuid4().hex[:12]
        while time.monotonic() <= self.deadline:
            held = self.store.compare_set(SLOT, "", fresh)
            if not re.fullmatch(rb"[0-9a-f]{12}", held):
                self.store.compare_set(SLOT, held, "")  # an empty slot is free
            elif held != self.nonce.encode():
                self.nonce = held.decode()
                return True
            else:
                time.sleep(POLL_S)
        return False

    def _join(self) -> bool:
        """Whether every rank joined this same step within the bound; from when
        this rank saw the last one join, the step has the bound again."""
        first, clean = self._gather("j", (self.what,), _joined, self.deadline)
        self.joined = set(first)
        if not clean:
            self.left = "the join held a value that does not decode"
        if len(first) < self.size:
            return False
        self.deadline = time.monotonic() + self.bound_s
        if list(first)[-1] == self.rank:  # the last to join frees the slot
            self._free_slot()
        return len({what for _, what in first.values()}) == 1

    def _free_slot(self) -> None:
        """Unless a later step holds it (a claim needs it free)."""
        if self.store.compare_set(SLOT, GONE, GONE) == self.nonce.encode():
            self.store.delete_key(SLOT)

    def _vote(self, mine: Ballot) -> tuple[Outcome, str]:
        """Every rank's first ballot: its own, or one a peer wrote for it once
        the bound and its grace passed."""
        self._append(str(self.rounds + 1), (self.rank, ()))  # ended its part
        first, clean = self._gather(
            "v", mine.encode(), Ballot.decode, self.deadline + GRACE_S
        )
        if clean and len(first) < self.size:
            missing = [i for i in range(self.size) if i not in first]
            self._append("v", *((i, self._absent(i).encode()) for i in missing))
            first, clean = self._read("v", Ballot.decode)
        if not clean or len(first) < self.size:
            self._count_out(1, self.rounds)
            return Outcome.OFF, "a ballot held a value that does not decode"
        votes = [first[i][1] for i in range(self.size)]
        answered = (i for i, b in enumerate(votes) if b.vote not in PEER_WRITTEN)
        self.speaker = next(answered, -1)
        rounds = max(b.rounds for b in votes)
        self._count_out(sum(w == self.rank for w, _ in first.values()), rounds)
        return outcome(self.ranks, votes)

    def _absent(self, rank: int) -> Ballot:
        return Ballot(Vote.ABSENT if rank in self.joined else Vote.UNJOINED)

    def _count_out(self, ranks: int, rounds: int) -> None:
        """Counts out the ranks whose ballots this rank wrote. The last rank out
        deletes the step (the ballots first: a rank back after that finds them
        missing, writes every ballot itself and so counts the whole group)."""
        if not ranks:
            return
        if self.store.add(f"{self.nonce}/n", ranks) < self.size:
            return
        # Past the size: back after the step was deleted. A rank may have
        # written one exchange past any ballot, then its END.
        for name in ["v", "j", *map(str, range(1, rounds + 3)), "n"]:
            self.store.delete_key(f"{self.nonce}/{name}")
        self._free_slot()
