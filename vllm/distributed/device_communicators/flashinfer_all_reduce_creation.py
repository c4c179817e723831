# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce steps (a workspace's creation, checkpoint_prepare,
checkpoint_restore) that end the same way on every rank of a group within one
deadline, over the group's store: vLLM's gloo group would wait 30 minutes.
Each key is written once, first writer wins, so every rank reads the same
values, the vote's too: a late rank follows the group's decision."""

import functools
import importlib
import os
import pickle
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    decision,
    gather,
    group_ranks,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    node_count as node_count,  # for the replaced module, with the rest
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    resolve_fi_ar_backend as resolve_fi_ar_backend,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    some_ranks,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

FI_AR_CREATE_TIMEOUT_S = 300
FI_AR_CREATE_TIMEOUT_ENV = "VLLM_FLASHINFER_ALLREDUCE_CREATE_TIMEOUT_S"
# How much longer the vote waits than the rounds: ranks start apart.
VOTE_GRACE_S = 5
# What a round holds for a rank that left it, written by itself or by another.
FAILED, LATE = ("left", "failed"), ("left", "late")


def create_timeout_s() -> int:
    """Read as vllm.envs reads its variables: upstream's envs.py lacks it."""
    value = os.getenv(FI_AR_CREATE_TIMEOUT_ENV, str(FI_AR_CREATE_TIMEOUT_S))
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{FI_AR_CREATE_TIMEOUT_ENV}={value!r}: not a number of seconds")


class Stopped(Exception):
    """This rank left the step: a round held FAILED or LATE for a rank."""


class StoreComm:
    """FlashInfer's CommBackend for one group (as flashinfer-python 0.7.2.post1
    and 0.7.4 call it), inside a step only. FlashInfer keeps it for
    checkpoint_prepare's barrier, which on_every_rank runs as a step too."""

    def __init__(self, group: ProcessGroup):
        self.ranks, self.rank = group_ranks(group), dist.get_rank(group)
        self.steps = 0
        self._store: Any = None
        self._last_vote: Any = None
        # The backends every rank gave up: not tried again until destroyed.
        self.failed: set[str] = set()
        self.warnings: list[str] = []
        # Set once this rank left the step: the ranks that came late, if any.
        self.late: tuple[int, ...] | None = None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.ranks)

    def allgather(self, data: Any) -> tuple[Any, ...]:
        return tuple(self._round(data))

    def bcast(self, data: Any, root: int) -> Any:
        return self._round(data)[root]

    def barrier(self) -> None:
        self._round(None)

    def warning(self, msg: str, *args: Any) -> None:
        """Upstream's warning that its creation failed here: into the vote."""
        self.warnings.append(msg % args)

    def _round(self, data: Any) -> list[Any]:
        if self._store is None or self.late is not None:
            raise Stopped("outside a step, or after this rank left it")
        self._rounds += 1
        values = self._exchange(f"{self._rounds}/", ("ok", data), self._deadline)
        left = {self.ranks[i]: v[1] for i, v in enumerate(values) if v[0] == "left"}
        if left:
            self.late = tuple(rank for rank, why in left.items() if why == "late")
            raise Stopped(f"{some_ranks(left)} left the step")
        return [data for _, data in values]

    def _exchange(self, prefix: str, mine: Any, deadline: float) -> list[Any]:
        keys = [f"{prefix}{i}" for i in range(len(self.ranks))]
        self._store.compare_set(keys[self.rank], "", pickle.dumps(mine))
        try:
            wait_s = max(deadline - time.monotonic(), 0.001)
            self._store.wait(keys, timedelta(seconds=wait_s))
        except dist.DistStoreError:  # the deadline: the ranks missing are late
            for key in keys:
                self._store.compare_set(key, "", pickle.dumps(LATE))
        return [pickle.loads(value) for value in self._store.multi_get(keys)]

    def run(self, group: ProcessGroup, step: Callable, *args: Any) -> tuple:
        """`step(*args)`, then the vote: this rank's result, the group's
        decision and why (see decide), and this rank's exception."""
        self.steps += 1
        key = f"vllm-fi-ar/{self.steps}/"
        self._store = dist.PrefixStore(key, group.get_group_store())
        bound = create_timeout_s()
        self._rounds, self._deadline = 0, time.monotonic() + bound
        self.warnings, self.late, result, raised = [], None, None, None
        try:
            result = step(*args)
        except Exception as e:
            raised = e
        mine: tuple = ("ok", None)
        if self.late is not None:
            mine, raised = ("stopped", self.late), None
        elif raised is not None:
            mine = ("raised", f"{type(raised).__name__}: {raised}")
        elif self.warnings:
            mine = ("failed", " ".join(self.warnings))
        if mine[0] != "ok":  # release the ranks waiting for this one
            left = pickle.dumps(FAILED)
            self._store.compare_set(f"{self._rounds + 1}/{self.rank}", "", left)
        for i, rank in enumerate(self.ranks):  # found late: none waits for it
            if rank in (self.late or ()):
                self._store.compare_set(f"vote/{i}", "", pickle.dumps(LATE))
        store, deadline = self._store, self._deadline + VOTE_GRACE_S
        votes, self._store = self._exchange("vote/", mine, deadline), None
        if all(vote == ("ok", None) for vote in votes):
            # Every rank voted: none reads this step's rounds again, nor the
            # last step's vote, which a late rank would have read.
            for r in range(1, self._rounds + 1):
                store.delete_key(f"{r}/{self.rank}")
            if self._last_vote is not None:
                self._last_vote.delete_key(f"vote/{self.rank}")
        self._last_vote = store
        return result, *decide(self.ranks, votes, bound), raised


def decide(ranks: tuple[int, ...], votes: list[tuple], bound: int) -> tuple[str, str]:
    """A rank that raised makes every rank raise; one that failed gives the
    backend up; one that did not answer, FlashInfer all-reduce (it may be dead)."""
    for kind, action in (("raised", "raise"), ("failed", "backend")):
        errors: dict[str, list[int]] = {}
        for rank, (vote_kind, detail) in zip(ranks, votes, strict=True):
            if vote_kind == kind:
                errors.setdefault(detail, []).append(rank)
        if errors:
            failed = ", ".join(f"{some_ranks(r)} ({e})" for e, r in errors.items())
            return action, f"{kind} on {failed}"
    late = {rank for rank, vote in zip(ranks, votes, strict=True) if vote == LATE}
    for kind, detail in votes:
        late.update(detail if kind == "stopped" else ())
    if late:
        return "group", f"{some_ranks(late)} did not answer within {bound} s"
    return "keep", ""


_comms = weakref.WeakKeyDictionary[ProcessGroup, StoreComm]()


def store_comm(group: ProcessGroup) -> StoreComm:
    """The group's StoreComm: FlashInfer keeps the one it was created with."""
    if group not in _comms:
        _comms[group] = StoreComm(group)
    return _comms[group]


def forget_failures() -> None:
    """On destroy_fi_ar_workspace, as upstream resets its failed flags."""
    for comm in _comms.values():
        comm.failed.clear()


def on_every_rank(group: ProcessGroup, step: Callable, *args: Any) -> Any:
    """A workspace's checkpoint_prepare or checkpoint_restore: every rank
    returns, or raises (its own exception where it raised one, such as
    upstream's NotImplementedError)."""
    comm = store_comm(group)
    result, action, why, raised = comm.run(group, step, *args)
    if action != "keep":
        what = f"FlashInfer all-reduce {step.__name__} for ranks {comm.ranks}"
        raise RuntimeError(f"{what}: {why}") if raised is None else raised
    return result


def _load_kernels() -> str | None:
    """trtllm's creation loads its kernels (a JIT build on a cold cache) between
    two of its collectives: loaded before the deadline starts. mnnvl's loads
    none (0.7.4 calls get_trtllm_mnnvl_comm_module at all-reduce)."""
    try:
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def created_on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create` (upstream's _create_workspace, given its StoreComm as
    `creation`) end the same way on every rank within FI_AR_CREATE_TIMEOUT_S
    (or its setting) plus VOTE_GRACE_S once trtllm's kernels load: all keep the
    workspace, give it up (out of `registry`, not tried again) or raise."""

    def decorate(create: Callable) -> Callable:
        @functools.wraps(create)
        def create_on_every_rank(backend: str, *args: Any) -> Any:
            dtype, group = args[-2:]
            comm = store_comm(group)
            if backend in comm.failed:
                return None
            workspace = raised = None
            loads = gather(group, _load_kernels()) if backend == "trtllm" else []
            if any(loads):
                votes = [("failed", e) if e else ("ok", None) for e in loads]
                action, why = decide(comm.ranks, votes, 0)
                why = why.replace("failed on", "could not load kernels on", 1)
            else:
                run = comm.run(group, create, backend, *args, comm)
                workspace, action, why, raised = run
            if action == "keep":
                return workspace
            if workspace is not None:
                del registry[id(workspace)]
                workspace.destroy()
            comm.failed.update(("mnnvl", "trtllm") if action == "group" else [backend])
            what = f"FlashInfer {backend} all-reduce workspace for ranks {comm.ranks}"
            if action == "raise":
                raise RuntimeError(f"{what}: {why}") from raised
            then = "FlashInfer all-reduce is off for these ranks"
            fallback = decision(group, dtype).allow_trtllm_fallback
            if backend == "mnnvl" and fallback and "trtllm" not in comm.failed:
                then = "falls back to trtllm"
            if comm.rank == 0:
                logger.warning("%s: %s; every rank gave it up and %s.", what, why, then)
            return None

        return create_on_every_rank

    return decorate
