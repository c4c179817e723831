# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added beside the replaced flashinfer_all_reduce.py (vllm#64327);
#  goes away with it.
"""A FlashInfer all-reduce workspace creation that ends the same way on every
rank of its group, in bounded time, with every rank's error in the log.

FlashInfer's collectives run over the group's store, never on a process
group of our own (see flashinfer_all_reduce_group), and each rank's outcome
goes to one vote on vLLM's group."""

import functools
import importlib
import inspect
import pickle
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
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

# The bound on FlashInfer's collectives in one workspace creation, in
# seconds. Between two of them a healthy rank only allocates and maps
# memory; kernels are loaded before. vLLM's own gloo groups wait 30 min.
FI_AR_CREATE_TIMEOUT_S = 300
# Each backend's kernel loader (functools.cache'd in flashinfer-python 0.7.2.post1
# and 0.7.4), which trtllm's creation calls between two of its collectives.
BACKEND_KERNEL_LOADERS = {
    "trtllm": ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
    "mnnvl": ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module"),
}
# The creation in progress on this rank; creations run one at a time.
_creation: "_CreationCommBackend | None" = None


def creation_warning(msg: str, *args: Any) -> None:
    """Upstream's warning that the creation in progress failed on this rank.
    vLLM logs *_once lines on local rank 0 only, so the text travels in the
    creation's vote, and every rank's give-up line carries it."""
    assert _creation is not None
    _creation.warnings.append(msg % args)


def creation_comm_backend(after: Any) -> Any:
    """FlashInfer's CommBackend for the creation in progress: bounded until
    it ends, then `after`'s collectives on vLLM's group (FlashInfer keeps
    the backend for `checkpoint_prepare`'s barrier)."""
    assert _creation is not None
    _creation.after = after
    return _creation


def _load_kernels(backend: str) -> str | None:
    """Load `backend`'s kernels (a JIT build on a cold cache); the error."""
    module_name, loader = BACKEND_KERNEL_LOADERS[backend]
    try:
        getattr(importlib.import_module(module_name), loader)()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class _CreationCommBackend:
    """FlashInfer's CommBackend for one creation: until `done`, collectives
    over the group's store, each wait ending at the creation's deadline,
    then those of `after`. The allreduce fusion workspaces of
    flashinfer-python 0.7.2.post1 and 0.7.4 call no other method."""

    def __init__(self, group: ProcessGroup, key: str):
        self._store = dist.PrefixStore(key, group.get_group_store())
        self._ranks = group_ranks(group)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._deadline = time.monotonic() + FI_AR_CREATE_TIMEOUT_S
        self._written: list[str] = []
        self.after: Any = None
        self.done = False
        self.warnings: list[str] = []
        self.steps = 0
        self.missing: list[int] = []
        """The ranks this rank stopped waiting for, at step `steps`."""

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def allgather(self, data: Any) -> tuple[Any, ...]:
        if self.done:
            return self.after.allgather(data)
        return tuple(self._exchange(data, range(self._size)))

    def bcast(self, data: Any, root: int) -> Any:
        if self.done:
            return self.after.bcast(data, root)
        return self._exchange(data, [root])[0]

    def barrier(self) -> None:
        if self.done:
            return self.after.barrier()
        self._exchange(None, range(self._size))

    def _exchange(self, data: Any, senders: Iterable[int]) -> list[Any]:
        keys = {rank: f"{self.steps}/{rank}" for rank in senders}
        if (mine := keys.get(self._rank)) is not None:
            self._store.set(mine, pickle.dumps(data))  # type: ignore[arg-type]
            self._written.append(mine)
        for rank, key in keys.items():
            left = timedelta(seconds=max(self._deadline - time.monotonic(), 1e-3))
            try:
                self._store.wait([key], left)
            except dist.DistStoreError:
                self.missing.append(self._ranks[rank])
        if self.missing:
            raise TimeoutError(
                f"FlashInfer's collective waited {FI_AR_CREATE_TIMEOUT_S} s for "
                f"{some_ranks(self.missing)}"
            )
        self.steps += 1
        return [pickle.loads(self._store.get(key)) for key in keys.values()]

    def remove_keys(self) -> None:
        """Once every rank has voted, no rank reads this creation's keys."""
        for key in self._written:
            self._store.delete_key(key)


def on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create`, this rank's part of a creation (None on failure),
    end the same way on every rank of its `group`: all keep the workspace
    or none does, within FI_AR_CREATE_TIMEOUT_S once the kernels are
    loaded; where another rank failed, it is destroyed and taken out of
    `registry` (workspaces by id). A failed
    backend is not tried again, and an exception from `create` is raised
    once every rank has voted."""

    def decorate(create: Callable) -> Callable:
        @functools.wraps(create)
        def create_on_every_rank(*args: Any, **kwargs: Any) -> Any:
            call = inspect.signature(create).bind(*args, **kwargs).arguments
            group, backend = call["group"], call["backend"]
            state = agreed(group)
            if backend in state.failed:
                return None
            ranks = group_ranks(group)
            workspace = raised = None
            if errors := _failed(ranks, gather(group, _load_kernels(backend))):
                failure: str | None = f"could not load kernels on {errors}"
            else:
                state.creations += 1
                key = f"vllm-fi-ar/{backend}/{state.creations}/"
                workspace, raised, failure = _create_and_vote(
                    group, key, lambda: create(*args, **kwargs)
                )
            if failure is None:
                return workspace
            if workspace is not None:
                del registry[id(workspace)]
                workspace.destroy()
            state.failed.add(backend)
            logger.warning_once(
                "FlashInfer %s all-reduce workspace for ranks %s: %s; every rank "
                "gave it up.",
                *(backend, ranks, failure),
            )
            if raised is not None:
                raise raised
            return None

        return create_on_every_rank

    return decorate


def _create_and_vote(
    group: ProcessGroup, key: str, create: Callable[[], Any]
) -> tuple[Any | None, Exception | None, str | None]:
    """This rank's workspace, its exception, and why the group gives the
    workspace up, if it does: every rank's outcome goes to one vote."""
    global _creation
    _creation = comm_backend = _CreationCommBackend(group, key)
    workspace = raised = None
    try:
        workspace = create()
    except Exception as e:
        # Upstream's own errors; not a collective this rank gave up on.
        raised = None if comm_backend.missing else e
        creation_warning("%s: %s", type(e).__name__, e)
    finally:
        comm_backend.done = True
        _creation = None
    error = None
    if workspace is None and not comm_backend.missing:
        error = " ".join(comm_backend.warnings) or "no workspace"
    votes = gather(group, (error, comm_backend.steps, comm_backend.missing))
    comm_backend.remove_keys()
    if failures := _failed(group_ranks(group), [error for error, _, _ in votes]):
        return workspace, raised, f"failed on {failures}"
    if waits := [(step, missing) for _, step, missing in votes if missing]:
        first = min(step for step, _ in waits)
        late = {rank for step, missing in waits if step == first for rank in missing}
        limit = f"did not answer within {FI_AR_CREATE_TIMEOUT_S} s"
        return workspace, raised, f"{some_ranks(late)} {limit}"
    return workspace, raised, None


def _failed(ranks: tuple[int, ...], errors: list[str | None]) -> str:
    """The ranks with an error, each error once: 'rank 1 (error)'."""
    by_error: dict[str, list[int]] = {}
    for rank, error in zip(ranks, errors, strict=True):
        if error is not None:
            by_error.setdefault(error, []).append(rank)
    return ", ".join(f"{some_ranks(r)} ({error})" for error, r in by_error.items())
