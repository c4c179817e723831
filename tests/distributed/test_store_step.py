# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The step's store load and clocks, with ranks as threads over one HashStore.

What the ranks do under faults is the fault matrix's (test_step_matrix.py);
real processes and stores are test_step_processes.py's.
"""

import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist

from vllm.distributed.device_communicators import store_step
from vllm.distributed.device_communicators.store_step import Outcome, Step

EXCHANGES = 12  # about what FlashInfer's trtllm creation makes
CALLS_PER_EXCHANGE = 10  # at most, per rank, polls included
BLOCKING = {"get", "multi_get", "wait"}


class CountingStore:
    """One rank's view of the store: counts its calls by method."""

    def __init__(self, store: Any) -> None:
        self._store, self.calls = store, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return method(*args)

        return counted


def run_step(size: int, exchanges: int, bound_s: float = 30.0):
    """Each rank's outcome and store calls, and the keys left behind."""
    store = dist.HashStore()
    views = [CountingStore(dist.PrefixStore("vllm-fi-ar", store)) for _ in range(size)]
    outcomes: list[Any] = [None] * size

    def rank_main(rank: int) -> None:
        step = Step(views[rank], tuple(range(size)), rank, "create", bound_s)

        def body() -> None:
            for i in range(exchanges):  # bytes, as FlashInfer's handles are
                assert step.exchange(bytes([i]) * 64) == [bytes([i]) * 64] * size

        outcomes[rank] = step.run(body)[:2]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes, [v.calls for v in views], store.num_keys()


@pytest.mark.parametrize("size", [2, 8, 72])
def test_store_calls_per_exchange_are_flat_in_the_group_size(size: int) -> None:
    """NVL72 racks run TP groups of 72 on rank 0's TCPStore: a rank's calls
    per exchange (polls included) do not grow with the group, none blocks,
    and the step leaves no key."""
    outcomes, calls, keys = run_step(size, EXCHANGES)
    assert outcomes == [(Outcome.KEEP, "")] * size
    per_exchange = max(sum(c.values()) for c in calls) / EXCHANGES
    print(f"\n{size} ranks: {per_exchange:.1f} store calls per rank per exchange")
    assert per_exchange <= CALLS_PER_EXCHANGE
    assert not BLOCKING & {name for c in calls for name in c}
    assert keys == 0


def test_a_wall_clock_jump_moves_no_deadline(monkeypatch) -> None:
    """A rank's wall clock steps forward by more than the bound mid-step (NTP,
    a VM migration): the step still completes on every rank."""
    jump = threading.Event()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3 * jump.is_set())
    store = dist.HashStore()
    outcomes: list[Any] = [None, None]

    def rank_main(rank: int) -> None:
        step = Step(store, (0, 1), rank, "create", 2.0)

        def body() -> None:
            step.exchange(rank)
            jump.set()
            time.sleep(0.2)  # the peer reads the jumped clock while it waits
            step.exchange(rank)

        outcomes[rank] = step.run(body)[0]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outcomes == [Outcome.KEEP, Outcome.KEEP]


def test_a_step_some_ranks_never_join_names_the_ranks_that_did() -> None:
    """Ranks 0 and 1 run a step that rank 2, idle, does not: the reason names
    the ranks that ran it, not the one that was not asked to."""
    store, outcomes = dist.HashStore(), [None, None]

    def rank_main(rank: int) -> None:
        outcomes[rank] = Step(store, (0, 1, 2), rank, "create", 0.3).run(list)[:2]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outcomes == [(Outcome.OFF, "only ranks 0, 1 joined within the bound")] * 2
    assert store.num_keys() == 0


def test_a_log_is_read_to_every_ranks_first_record_only() -> None:
    """Bytes appended once every rank has a record change nothing; a record
    naming no rank of the group does not decode."""
    records = [store_step._record(r, r, (b"data",)) for r in range(3)]
    log = b"".join(records)
    whole = {r: (r, (b"data",)) for r in range(3)}
    for tail in (b"", b"not a pickle", store_step._record(3, 0, (b"late",))):
        assert store_step._first_records(log + tail, 3, tuple) == (whole, True)
    for writer, subject in ((3, 0), (0, 3), (-1, 0), (0, -1)):
        bad = store_step._record(writer, subject, ())
        assert store_step._first_records(bad + log, 3, tuple) == ({}, False)


def test_ranks_are_named_as_one_or_many() -> None:
    assert store_step.some_ranks([3]) == "rank 3"
    assert store_step.some_ranks([2, 0]) == "ranks 0, 2"


def test_a_slot_still_held_by_this_ranks_last_step_ends_within_the_bound() -> None:
    """The step this rank left before all joined never freed the slot (its
    last rank out died): the next step ends OFF at the bound, not waiting."""
    store = dist.HashStore()
    store.set(store_step.SLOT, "0123456789ab")
    step = Step(store, (0, 1), 0, "create", 0.3, last="0123456789ab")
    start = time.monotonic()
    assert step.run(list)[:2] == (
        Outcome.OFF,
        "the step before it never freed the slot",
    )
    assert time.monotonic() - start < 1.0


def test_ballots_that_do_not_decode_end_every_rank_alike() -> None:
    """A store client writes bytes into the ballots before every rank voted:
    every rank ends OFF saying so, and the step leaves no key."""
    store, outcomes = dist.HashStore(), [None, None]

    def rank_main(rank: int) -> None:
        step = Step(store, (0, 1), rank, "create", 5.0)

        def body() -> None:
            step.exchange(rank)
            if rank == 0:
                store.append(f"{step.nonce}/v", b"not a pickle")

        outcomes[rank] = step.run(body)[:2]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    why = "a ballot held a value that does not decode"
    assert outcomes == [(Outcome.OFF, why)] * 2
    assert store.num_keys() == 0


@pytest.mark.parametrize(
    ("decode", "value"),
    [
        (store_step.Ballot.decode, ("DONE", 1, "", 0)),
        (store_step.Ballot.decode, ("DONE", "", "", "0")),
        (store_step.Ballot.decode, ("NOT_A_VOTE", "", "", 0)),
        (store_step._exchanged, (1, 2)),
        (store_step._joined, (1,)),
    ],
)
def test_a_record_of_the_wrong_shape_does_not_decode(decode, value) -> None:
    with pytest.raises((ValueError, KeyError)):
        decode(value)
