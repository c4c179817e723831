# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""Workspace creation that ends the same way on every rank, in bounded time.

Creating a FlashInfer all-reduce workspace is collective: FlashInfer
exchanges memory handles between the ranks through the comm backend it is
given. A rank that fails before or during that exchange (an allocation on a
fuller GPU, a CUDA error) leaves the others waiting in it for the group's
timeout, 30 minutes for vLLM's gloo groups. So:

1. Before anything collective, each rank loads the kernel modules of the
   backend (`prepare_backend`), which may take minutes on a cold JIT cache,
   and the ranks vote on that (folded into the backend agreement round).
   That part is not bounded.
2. FlashInfer's collectives run on a gloo group of the same ranks whose
   timeout is FI_AR_CREATE_TIMEOUT_S, made for one creation and destroyed
   after it: a rank that fails makes the others' collectives raise within
   the bound, and only that group is broken by the timeout, never vLLM's.
3. The ranks then vote on vLLM's group, sharing each one's outcome, so all
   keep the workspace or all release it, and each logs the same line naming
   the rank that failed and its error, or the one that did not answer.
"""

import importlib
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from vllm.logger import init_logger

logger = init_logger(__name__)

# The bound on FlashInfer's collectives while it creates a workspace, in
# seconds. Between two of them a healthy rank only allocates and maps
# memory (seconds); FlashInfer's own socket exchange of POSIX handles gives
# up after 30 s (`_TIMEOUT_S` in flashinfer/comm/fd_exchange.py). Kernel
# builds happen before (`prepare_backend`) and do not count.
FI_AR_CREATE_TIMEOUT_S = 300
# The kernel modules each backend loads, by FlashInfer module and loader
# (functools.cache'd, in flashinfer-python 0.7.2.post1 and 0.7.4). trtllm
# loads its module in the middle of creation, between two collectives
# (`trtllm_lamport_initialize` in flashinfer/comm/trtllm_ar.py); mnnvl loads
# its own at the first all-reduce.
BACKEND_KERNEL_LOADERS = {
    "trtllm": ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
    "mnnvl": ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module"),
}
# FlashInfer's words for a node without NVSwitch multicast; upstream's hint.
_MULTICAST_HINT = (
    "This is expected on GPUs without NVSwitch (e.g., NVLink bridge-only or "
    "PCIe topologies)."
)
# How a rank's part of a creation ended, as all-gathered.
_OK, _FAILED, _WAITED = 0, 1, 2
# The backend whose kernels every rank of a group loaded and voted on.
_prepared: weakref.WeakKeyDictionary[ProcessGroup, str] = weakref.WeakKeyDictionary()


def _error_text(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def prepare_backend(backend: str) -> str | None:
    """Load the kernel modules of `backend` on this rank; the error, if any.

    Loading may build them (JIT, minutes on a cold cache), so it happens
    before any collective of the creation, where it cannot run into the
    bound, and its failure is voted on rather than left to one rank.
    """
    module_name, loader = BACKEND_KERNEL_LOADERS[backend]
    try:
        getattr(importlib.import_module(module_name), loader)()
    except Exception as e:
        return _error_text(e)
    return None


def mark_prepared(group: ProcessGroup, backend: str) -> None:
    """Record that every rank of `group` loaded the kernels of `backend`."""
    _prepared[group] = backend


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def gather_codes(group: ProcessGroup, code: int) -> list[int]:
    """One small int from each rank of `group`, in rank order."""
    gathered = [torch.zeros(1, dtype=torch.int32) for _ in _ranks(group)]
    dist.all_gather(gathered, torch.tensor([code], dtype=torch.int32), group=group)
    return [int(c.item()) for c in gathered]


def gather_details(group: ProcessGroup, detail: Any) -> list[Any]:
    """Each rank's `detail` (picklable), in rank order. Only on failure paths."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, detail, group=group)
    return gathered


def _all_prepared(group: ProcessGroup, backend: str) -> bool:
    """Load `backend`'s kernels on every rank and vote, unless done already.

    The backend agreed for a group is prepared in the agreement round; a
    fallback backend is prepared here, with a vote of its own.
    """
    if _prepared.get(group) == backend:
        return True
    error = prepare_backend(backend)
    if dist.get_world_size(group) == 1:
        errors = [error]
    else:
        codes = gather_codes(group, int(error is not None))
        errors = gather_details(group, error) if any(codes) else [None] * len(codes)
    if any(errors):
        logger.warning_once(
            "%s; no rank of %s creates a FlashInfer %s all-reduce workspace.",
            describe_load_failures(backend, _ranks(group), errors),
            _ranks(group),
            backend,
        )
        return False
    mark_prepared(group, backend)
    return True


def describe_load_failures(
    backend: str, ranks: tuple[int, ...], errors: list[str | None]
) -> str:
    """One clause naming each rank whose kernels of `backend` failed to load."""
    failed = "; ".join(
        f"rank {rank}: {error}"
        for rank, error in zip(ranks, errors, strict=True)
        if error is not None
    )
    return f"FlashInfer's {backend} all-reduce kernels failed to load ({failed})"


class CreationCommBackend:
    """FlashInfer's `CommBackend` for one workspace creation.

    While the workspace is created, its collectives run on the bounded group
    and are counted, and a failure among them is recorded as waiting on
    another rank. FlashInfer keeps the backend for later collectives
    (`checkpoint_prepare`'s barrier), so `release` points it at vLLM's
    group, where upstream's ran.
    """

    def __init__(self, backend_type: type, bounded: ProcessGroup, group: ProcessGroup):
        self._bounded = backend_type(group=bounded)
        self._after = backend_type(group=group)
        self._current = self._bounded
        self.steps = 0
        self.waited: BaseException | None = None

    def _collective(self, call: Callable[..., Any], *args: Any) -> Any:
        if self._current is not self._bounded:
            return call(*args)
        try:
            result = call(*args)
        except Exception as e:
            self.waited = e
            raise
        self.steps += 1
        return result

    def Get_rank(self) -> int:  # noqa: N802 - FlashInfer's CommBackend API
        return self._current.Get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return self._current.Get_size()

    def allgather(self, data: Any) -> tuple[Any, ...]:
        return self._collective(self._current.allgather, data)

    def bcast(self, data: Any, root: int) -> Any:
        return self._collective(self._current.bcast, data, root)

    def barrier(self) -> None:
        self._collective(self._current.barrier)

    def Split(self, color: int, key: int) -> Any:  # noqa: N802
        return self._current.Split(color, key)

    def release(self) -> None:
        """From now on, collectives run on vLLM's group."""
        self._current = self._after


def _bounded_group(group: ProcessGroup) -> ProcessGroup:
    """A gloo group of `group`'s ranks whose collectives time out at the bound.

    Only the ranks of `group` take part in making it
    (use_local_synchronization), as they all create the workspace together.
    Like any new_group, it advances torch's per-process group counter; a
    creation retried (the trtllm fallback) on some groups and not others
    leaves their processes one apart, so a later world-wide new_group would
    be named differently across them (vLLM makes none after start-up but for
    elastic EP).
    """
    bounded = dist.new_group(
        list(_ranks(group)),
        backend="gloo",
        timeout=timedelta(seconds=FI_AR_CREATE_TIMEOUT_S),
        use_local_synchronization=True,
    )
    assert isinstance(bounded, ProcessGroup)
    return bounded


def _describe_failure(
    backend: str, ranks: tuple[int, ...], outcomes: list[tuple[int, str | None, int]]
) -> str:
    """The line every rank logs: who failed and why, or who did not answer."""
    failed = [
        f"rank {rank} ({error})"
        for rank, (status, error, _) in zip(ranks, outcomes, strict=True)
        if status == _FAILED
    ]
    if failed:
        what = f"failed on {', '.join(failed)}"
        if "multicast" in what.lower():
            what = f"{what}. {_MULTICAST_HINT}"
    else:
        # Each rank stopped waiting on another: the late ones went through
        # fewer of FlashInfer's collectives than the rest.
        steps = [step for _, _, step in outcomes]
        late = [r for r, step in zip(ranks, steps, strict=True) if step == min(steps)]
        who = ", ".join(map(str, late))
        what = (
            f"failed: rank {who} did not answer within {FI_AR_CREATE_TIMEOUT_S} s "
            "in FlashInfer's rendezvous"
        )
    return (
        f"FlashInfer {backend} all-reduce workspace for ranks {ranks} {what}; "
        "every rank gave it up"
    )


def create_on_every_rank(
    group: ProcessGroup,
    backend: str,
    create: Callable[[Any], Any],
    release: Callable[[Any], None],
    backend_type: type,
) -> Any | None:
    """Create a workspace with `create`, on every rank of `group` or none.

    `create(comm_backend)` is this rank's part, calling FlashInfer with
    that comm backend, through which FlashInfer makes every collective of a
    creation but one: the torch symmetric-memory rendezvous of the trtllm
    workspace under NVIDIA Confidential Computing, which runs on the group
    FlashInfer is given, vLLM's, as upstream (a bounded group destroyed after
    the creation would not outlive that memory). It raises on failure.
    `release` destroys a workspace that another rank failed to create.
    Every rank returns the workspace, or every rank None, within
    FI_AR_CREATE_TIMEOUT_S of the last one starting the collective part
    (after the kernels are loaded).
    """
    if not _all_prepared(group, backend):
        return None
    if dist.get_world_size(group) == 1:
        try:
            return create(backend_type(group=group))
        except Exception as e:
            outcome = (_FAILED, _error_text(e), 0)
            logger.warning_once(
                "%s.", _describe_failure(backend, _ranks(group), [outcome])
            )
            return None
    bounded = _bounded_group(group)
    comm_backend = CreationCommBackend(backend_type, bounded, group)
    workspace = None
    status, error = _OK, None
    started = time.perf_counter()
    try:
        workspace = create(comm_backend)
    except Exception as e:
        status = _WAITED if comm_backend.waited is not None else _FAILED
        error = _error_text(e)
    finally:
        comm_backend.release()
    codes = gather_codes(group, status)
    dist.destroy_process_group(bounded)
    if not any(codes):
        return workspace
    outcomes = gather_details(group, (status, error, comm_backend.steps))
    if workspace is not None:
        release(workspace)
    logger.warning_once(
        "%s (after %.1f s here).",
        _describe_failure(backend, _ranks(group), outcomes),
        time.perf_counter() - started,
    )
    return None
