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
            for i in range(exchanges):
                assert step.exchange(i) == [i] * size

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
