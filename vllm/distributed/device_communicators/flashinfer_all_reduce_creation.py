# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A FlashInfer all-reduce workspace creation that ends the same way on every
rank of its group, within a bound: once the kernels load, FlashInfer's
collectives and the vote wait on the group's store until one deadline, not
on vLLM's gloo group (30 minutes) nor on a process group of our own."""

import functools
import importlib
import os
import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    agreed,
    gather,
    group_ranks,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    some_ranks,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# The bound on a creation once its kernels are loaded, in seconds, unless
# FI_AR_CREATE_TIMEOUT_ENV says otherwise. Between two of FlashInfer's
# collectives a healthy rank only allocates and maps memory.
FI_AR_CREATE_TIMEOUT_S = 300
FI_AR_CREATE_TIMEOUT_ENV = "VLLM_FLASHINFER_ALLREDUCE_CREATE_TIMEOUT_S"
# How long the vote waits past the deadline for a rank that stopped waiting
# too: the ranks' deadlines are apart by the kernel-load vote's skew.
VOTE_GRACE_S = 5
# Each backend's kernel loader (functools.cache'd in flashinfer-python 0.7.2.post1
# and 0.7.4), which trtllm's creation calls between two of its collectives.
BACKEND_KERNEL_LOADERS = {
    "trtllm": ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
    "mnnvl": ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module"),
}


def create_timeout_s() -> int:
    """The bound, read as vllm.envs reads its variables (upstream's
    envs.py, which this patch does not replace, does not know this one)."""
    value = os.getenv(FI_AR_CREATE_TIMEOUT_ENV, str(FI_AR_CREATE_TIMEOUT_S))
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{FI_AR_CREATE_TIMEOUT_ENV}={value!r}: not a number of seconds")


def _load_kernels(backend: str) -> str | None:
    """Load `backend`'s kernels (a JIT build on a cold cache); the error."""
    module_name, loader = BACKEND_KERNEL_LOADERS[backend]
    try:
        getattr(importlib.import_module(module_name), loader)()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class Creation:
    """One creation on this rank: FlashInfer's CommBackend (`comm_backend`),
    whose collectives go over the group's store and wait until the deadline
    or until a rank they wait for has voted (it left the creation); then the
    vote. These are the methods flashinfer-python 0.7.2.post1 and 0.7.4 call."""

    def __init__(self, group: ProcessGroup, key: str, bound: int):
        self._store = dist.PrefixStore(key, group.get_group_store())
        self.ranks = group_ranks(group)
        self._rank = dist.get_rank(group)
        self.bound = bound
        self._deadline = time.monotonic() + bound
        self._written: list[str] = []
        self._after: Any = None
        self.done = False
        self.warnings: list[str] = []
        self.steps = 0
        self.stopped: tuple[int, list[int]] | None = None
        """The step where this rank stopped, and the ranks it stopped for."""

    def comm_backend(self, after: Any) -> "Creation":
        """Itself; after the creation, its barrier is `after`'s, on vLLM's group
        (FlashInfer's only later call: the workspace's checkpoint_prepare)."""
        self._after = after
        return self

    def warning(self, msg: str, *args: Any) -> None:
        """Upstream's warning that this creation failed here: it goes into
        the vote, and the group's rank 0 logs it."""
        self.warnings.append(msg % args)

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return len(self.ranks)

    def allgather(self, data: Any) -> tuple[Any, ...]:
        return tuple(self._exchange(data, range(len(self.ranks))))

    def bcast(self, data: Any, root: int) -> Any:
        return self._exchange(data, [root])[0]

    def barrier(self) -> None:
        if self.done:
            return self._after.barrier()
        self._exchange(None, range(len(self.ranks)))

    def _set(self, key: str, value: Any) -> None:
        self._store.set(key, pickle.dumps(value))  # type: ignore[arg-type]
        self._written.append(key)

    def _get(self, key: str) -> Any:
        """The value, or None; unlike get, it never waits for the key."""
        value = self._store.compare_set(key, "-", "-")  # type: ignore[arg-type]
        return None if value == b"-" else pickle.loads(value)

    def _poll(self, keys: list[str], deadline: float, stop: Callable) -> list[str]:
        """The keys still absent at `deadline` or once `stop(absent)`."""
        pause = 0.001
        while (absent := [k for k in keys if not self._store.check([k])]) and not (
            stop(absent) or time.monotonic() >= deadline
        ):
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return absent

    def _exchange(self, data: Any, senders: Iterable[int]) -> list[Any]:
        step, came_late = self.steps, time.monotonic() >= self._deadline
        keys = {f"{step}/{rank}": rank for rank in senders}
        if self._rank in keys.values():
            self._set(f"{step}/{self._rank}", data)

        def left(absent: list[str]) -> list[int]:
            # Its vote is there, and then still not its part: it has left.
            votes = [k for k in absent if self._store.check([f"vote/{keys[k]}"])]
            return [keys[k] for k in votes if not self._store.check([k])]

        if absent := self._poll(list(keys), self._deadline, left):
            late = [self._rank] if came_late else [keys[k] for k in absent]
            self.stopped = (step, [self.ranks[r] for r in left(absent) or late])
            raise TimeoutError(f"stopped for {some_ranks(self.stopped[1])}")
        self.steps += 1
        return [self._get(key) for key in keys]

    def run(self, create: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """This rank's workspace, the group's decision ("keep", "backend",
        "group" or "raise"), why, and this rank's exception."""
        workspace = raised = None
        try:
            workspace = create(*args, creation=self)
        except Exception as e:
            raised = None if self.stopped else e
        self.done = True
        try:
            return workspace, *self._vote(workspace, raised), raised
        except BaseException:  # the store failed: remove what this rank can
            self._remove(self._written)
            raise

    def _vote(self, workspace: Any, raised: Exception | None) -> tuple[str, str]:
        """Each rank's outcome goes to the store, and each proposes the
        group's decision from the votes there by the deadline (no vote: the
        rank did not answer); the first proposal stands on every rank. The
        last of its voters out removes every key."""
        mine: tuple[str, Any] = ("ok", None)
        if raised is not None:
            mine = ("raised", f"{type(raised).__name__}: {raised}")
        elif self.stopped:
            mine = ("stopped", self.stopped)
        elif workspace is None:
            mine = ("failed", " ".join(self.warnings) or "no workspace")
        self._set(f"vote/{self._rank}", (*mine, self.steps))
        gone = self.stopped[1] if self.stopped else []
        keys = [f"vote/{i}" for i, r in enumerate(self.ranks) if r not in gone]
        self._poll(keys, self._deadline + VOTE_GRACE_S, lambda _: self._get("decision"))
        votes = {i: v for i in range(len(self.ranks)) if (v := self._get(f"vote/{i}"))}
        proposal = pickle.dumps((*_decide(self.ranks, votes, self.bound), votes))
        stored = self._store.compare_set("decision", "", proposal)  # type: ignore[arg-type]
        *decision, voters = pickle.loads(stored)
        if self._rank not in voters:
            self._remove(self._written)
        elif self._store.add("left", 1) == len(voters):
            steps = range(max(steps for *_, steps in voters.values()) + 2)
            everyone = [f"{s}/{i}" for s in steps for i in range(len(self.ranks))]
            everyone += [f"vote/{i}" for i in range(len(self.ranks))]
            self._remove([*everyone, "decision", "left"])
        return tuple(decision)

    def _remove(self, keys: list[str]) -> None:
        for key in keys:
            self._store.delete_key(key)


def _decide(ranks: tuple[int, ...], votes: dict[int, tuple], bound: int) -> tuple:
    """The group's decision from the votes at hand: a rank that raised makes
    every rank raise; one that failed gives the backend up; one that did not
    answer gives FlashInfer all-reduce up for the group (it may be dead)."""
    for kind, action in (("raised", "raise"), ("failed", "backend")):
        errors: dict[str, list[int]] = {}
        for i, vote in votes.items():
            if vote[0] == kind:
                errors.setdefault(vote[1], []).append(ranks[i])
        if failed := [f"{some_ranks(r)} ({e})" for e, r in errors.items()]:
            return action, f"{kind} on {', '.join(failed)}"
    stops = [detail for kind, detail, _ in votes.values() if kind == "stopped"]
    first = min((step for step, _ in stops), default=None)
    late = {r for step, missing in stops if step == first for r in missing}
    late |= {r for i, r in enumerate(ranks) if i not in votes}
    if late:
        return "group", f"{some_ranks(late)} did not answer within {bound} s"
    return "keep", ""


def on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create` (upstream's _create_workspace, given `creation`) end the
    same way on every rank of its group, within FI_AR_CREATE_TIMEOUT_S or its
    setting plus VOTE_GRACE_S once the kernels load: all keep the workspace, give
    it up (destroyed, out of `registry`, not tried again) or raise one error."""

    def decorate(create: Callable) -> Callable:
        @functools.wraps(create)
        def create_on_every_rank(backend: str, *args: Any) -> Any:
            group = args[-1]
            state = agreed(group)
            if backend in state.failed:
                return None
            workspace, raised, ranks = None, None, group_ranks(group)
            loads = gather(group, _load_kernels(backend))
            if any(loads):
                votes = {i: ("failed", e, 0) for i, e in enumerate(loads) if e}
                action, why = _decide(ranks, votes, 0)
                why = why.replace("failed on", "could not load kernels on", 1)
            else:
                state.creations += 1
                key = f"vllm-fi-ar/{backend}/{state.creations}/"
                creation = Creation(group, key, create_timeout_s())
                workspace, action, why, raised = creation.run(create, backend, *args)
            if action == "keep":
                return workspace
            if workspace is not None:
                del registry[id(workspace)]
                workspace.destroy()
            state.failed.update(
                BACKEND_KERNEL_LOADERS if action == "group" else [backend]
            )
            if action == "raise":
                what = f"FlashInfer {backend} all-reduce workspace for ranks {ranks}"
                raise RuntimeError(f"{what}: {why}") from raised
            if dist.get_rank(group) == 0:
                logger.warning(
                    "FlashInfer %s all-reduce workspace for ranks %s: %s; every rank "
                    "gave it up%s.",
                    *(backend, ranks, why),
                    " and FlashInfer all-reduce with it" * (action == "group"),
                )
            return None

        return create_on_every_rank

    return decorate
