# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added beside the replaced flashinfer_all_reduce.py (vllm#64327);
#  goes away with it.
"""The FlashInfer all-reduce backend of a process group, and its workspaces.

Creating a workspace is collective, so the ranks of a group agree on the
backend once, and each creation ends the same way on every rank in bounded
time. Nothing here makes a process group: torch numbers groups per process,
so a process that made one more than its peers would hang in their next
new_group."""

import dataclasses
import importlib
import pickle
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_ENV,
    FI_AR_DTYPES,
    FiArBackendDecision,
    FiArBackendInputs,
    decide_fi_ar_backend,
    installed_kernels,
)
from vllm.distributed.parallel_state import _node_count
from vllm.logger import init_logger
from vllm.platforms import current_platform

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
# The workspace dtypes a group decides for; None is the dtype not yet known.
_DTYPE_KEYS = (None, *FI_AR_DTYPES)


@dataclasses.dataclass
class _Group:
    """What every rank of a group agreed on, and how its creations went."""

    decisions: dict[str | None, FiArBackendDecision]
    failed: set[str] = dataclasses.field(default_factory=set)
    creations: int = 0
    """Numbers each creation's keys in the group's store."""


# Held weakly, so that per-group state goes with its group.
_groups: weakref.WeakKeyDictionary[ProcessGroup, _Group] = weakref.WeakKeyDictionary()
_node_counts: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
# Upstream's warnings for a creation that failed on this rank, for its vote.
_creation_warnings: list[str] = []


def group_node_count(group: ProcessGroup) -> int:
    """vLLM's node count of `group`, once: counting nodes is collective."""
    if group not in _node_counts:
        _node_counts[group] = _node_count(group)
    return _node_counts[group]


def hisparse_enabled() -> bool | None:
    """vLLM sets `hisparse_config` for a HiSparseConnector, also inside a
    MultiConnector; None without a current vLLM config: unknown."""
    config = get_current_vllm_config_or_none()
    return (
        None if config is None else config.attention_config.hisparse_config is not None
    )


def device_capability() -> int | None:
    capability = current_platform.get_device_capability()
    return None if capability is None else capability.to_int()


def nvlink_fabric() -> bool:
    """FlashInfer's own probe; one that fails counts as no fabric."""
    try:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        return bool(mnnvl.is_mnnvl_fabric_supported(torch.cuda.current_device()))
    except Exception as e:
        logger.warning_once("FlashInfer's NVLink fabric probe failed: %s", e)
        return False


def creation_warning(msg: str, *args: Any) -> None:
    """Upstream's warning that a creation failed on this rank. vLLM logs
    *_once lines on local rank 0 only, so the text travels in the
    creation's vote, and every rank's give-up line carries it."""
    _creation_warnings.append(msg % args)


def _gather(group: ProcessGroup, mine: Any) -> list[Any]:
    """One object from each rank of `group`, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _some(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _describe(choice: tuple[str | None, bool]) -> str:
    backend, fallback = choice
    return f"{backend} (may fall back to trtllm)" if fallback else str(backend or "off")


def _decide_every_dtype(
    inputs: FiArBackendInputs,
) -> dict[str | None, FiArBackendDecision]:
    """A known issue may hit one dtype only."""
    return {
        key: decide_fi_ar_backend(dataclasses.replace(inputs, dtype=key))
        for key in _DTYPE_KEYS
    }


def _agree(group: ProcessGroup) -> _Group:
    """Decide for every workspace dtype and agree, in one round that also
    carries each rank's NVLink fabric probe where mnnvl would span nodes.

    Ranks can see different inputs (the variable set on one node only), and
    ranks that create different workspaces hang: disagreeing, they are off.
    """
    inputs = FiArBackendInputs(
        setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
        node_count=group_node_count(group),
        device_capability=device_capability(),
        hisparse=hisparse_enabled(),
        kernels=installed_kernels(),
    )
    if inputs.hisparse is None:
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash."
        )
    decisions = _decide_every_dtype(inputs)
    choice = tuple((d.backend, d.allow_trtllm_fallback) for d in decisions.values())
    probe = inputs.node_count > 1 and "mnnvl" in {d.backend for d in decisions.values()}
    views = _gather(group, (choice, nvlink_fabric() if probe else True))
    ranks = _ranks(group)
    if len({view for view, _ in views}) > 1:
        i = next(i for i in range(len(choice)) if len({v[i] for v, _ in views}) > 1)
        logger.error_once(
            "FlashInfer all-reduce is off for ranks %s: they chose different "
            "backends%s (%s). Make these the same on every node: %s, the "
            "HiSparse config, the GPU and the FlashInfer packages.",
            ranks,
            f" for {_DTYPE_KEYS[i]} workspaces" if i else "",
            ", ".join(
                f"rank {rank}: {_describe(view[i])}"
                for rank, (view, _) in zip(ranks, views, strict=True)
            ),
            FI_AR_BACKEND_ENV,
        )
        off = FiArBackendDecision(None, False, "the ranks disagree")
        return _Group(dict.fromkeys(_DTYPE_KEYS, off))
    if no_fabric := [
        r for r, (_, fabric) in zip(ranks, views, strict=True) if not fabric
    ]:
        probed = (
            f"FlashInfer's is_mnnvl_fabric_supported is false on {_some(no_fabric)}"
        )
        decisions = {
            key: dataclasses.replace(d, reason=f"{d.reason}; {probed}")
            for key, d in _decide_every_dtype(
                dataclasses.replace(inputs, fabric=False)
            ).items()
        }
    _log_decisions(ranks, decisions)
    return _Group(decisions)


def _log_decisions(
    ranks: tuple[int, ...], decisions: dict[str | None, FiArBackendDecision]
) -> None:
    """The start-up line: the backend and why; where workspace dtypes differ
    (in backend, or in a setting that runs into a known issue), each with
    its dtypes. A warning where a setting runs into a known issue."""

    def warns(d: FiArBackendDecision) -> bool:
        return d.known_issue is not None and d.known_issue.backend == d.backend

    by_outcome: dict[tuple, list[str]] = {}
    for key, d in decisions.items():
        if key is not None:
            outcome = (d.backend, d.allow_trtllm_fallback, warns(d))
            by_outcome.setdefault(outcome, []).append(key)
    shown = {"": decisions[None]}
    if len(by_outcome) > 1:
        shown = {f" for {', '.join(k)}": decisions[k[0]] for k in by_outcome.values()}
    warn = any(map(warns, shown.values()))
    (logger.warning_once if warn else logger.info_once)(
        "FlashInfer all-reduce backend for ranks %s: %s%s",
        ranks,
        "; ".join(f"{d.backend or 'off'}{k} ({d.reason})" for k, d in shown.items()),
        f". Unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend." if warn else "",
    )


def resolve_fi_ar_backend(
    group: ProcessGroup, dtype: torch.dtype | None = None
) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses for
    a workspace of `dtype` (None: not yet known). Agreed once per group."""
    if group not in _groups:
        _groups[group] = _agree(group)
    decisions = _groups[group].decisions
    key = None if dtype is None else str(dtype).removeprefix("torch.")
    decision = decisions.get(key, decisions[None])
    return decision.backend, decision.allow_trtllm_fallback


def _load_kernels(backend: str) -> str | None:
    """Load `backend`'s kernels (a JIT build on a cold cache); the error."""
    module_name, loader = BACKEND_KERNEL_LOADERS[backend]
    try:
        getattr(importlib.import_module(module_name), loader)()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class _CreationCommBackend:
    """FlashInfer's CommBackend for one creation. Until `done`, collectives
    run over the group's store, each wait ending at the creation's deadline;
    after it, on vLLM's group (FlashInfer keeps the backend for
    `checkpoint_prepare`'s barrier). The allreduce fusion workspaces of
    flashinfer-python 0.7.2.post1 and 0.7.4 call no other method."""

    def __init__(self, group: ProcessGroup, key: str, backend_type: type):
        self._store = dist.PrefixStore(key, group.get_group_store())
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._deadline = time.monotonic() + FI_AR_CREATE_TIMEOUT_S
        self._after = backend_type(group=group)
        self._bounded = True
        self._written: list[str] = []
        self.steps = 0
        self.missing: list[int] = []
        """The group ranks this rank stopped waiting for, at step `steps`."""

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def allgather(self, data: Any) -> tuple[Any, ...]:
        if not self._bounded:
            return self._after.allgather(data)
        return tuple(self._exchange(data, range(self._size)))

    def bcast(self, data: Any, root: int) -> Any:
        if not self._bounded:
            return self._after.bcast(data, root)
        return self._exchange(data, [root])[0]

    def barrier(self) -> None:
        if not self._bounded:
            return self._after.barrier()
        self._exchange(None, range(self._size))

    def _exchange(self, data: Any, senders: Iterable[int]) -> list[Any]:
        keys = {rank: f"{self.steps}/{rank}" for rank in senders}
        if self._rank in keys:
            value = pickle.dumps(data)
            self._store.set(keys[self._rank], value)  # type: ignore[arg-type]
            self._written.append(keys[self._rank])
        left = self._deadline - time.monotonic()
        try:
            self._store.wait(list(keys.values()), timedelta(seconds=max(left, 1e-3)))
        except dist.DistStoreError:
            self.missing = [
                r for r, key in keys.items() if not self._store.check([key])
            ]
            raise TimeoutError(
                f"FlashInfer's collective waited {FI_AR_CREATE_TIMEOUT_S} s for "
                f"group {_some(self.missing)}"
            ) from None
        self.steps += 1
        return [pickle.loads(self._store.get(key)) for key in keys.values()]

    def done(self) -> None:
        self._bounded = False

    def remove_keys(self) -> None:
        """Once every rank has voted, no rank reads this creation's keys."""
        for key in self._written:
            self._store.delete_key(key)


def create_on_every_rank(
    group: ProcessGroup,
    backend: str,
    create: Callable[[Any], Any],
    release: Callable[[Any], None],
    backend_type: type,
) -> Any | None:
    """Run `create(comm_backend)`, this rank's part (None on failure), so that
    every rank of `group` keeps the workspace or none does, within
    FI_AR_CREATE_TIMEOUT_S once the kernels are loaded; `release` destroys
    it where another rank failed. A failed backend is not tried again, and
    an exception from `create` is raised once every rank has voted."""
    state = _groups[group]
    if backend in state.failed:
        return None
    ranks = _ranks(group)
    workspace = raised = None
    if errors := _failed(ranks, _gather(group, _load_kernels(backend))):
        failure: str | None = f"could not load kernels on {errors}"
    else:
        state.creations += 1
        key = f"vllm-fi-ar/{backend}/{state.creations}/"
        workspace, raised, failure = _create_and_vote(group, key, create, backend_type)
    if failure is None:
        return workspace
    if workspace is not None:
        release(workspace)
    state.failed.add(backend)
    logger.warning_once(
        "FlashInfer %s all-reduce workspace for ranks %s: %s; every rank gave it up.",
        *(backend, ranks, failure),
    )
    if raised is not None:
        raise raised
    return None


def _create_and_vote(
    group: ProcessGroup, key: str, create: Callable[[Any], Any], backend_type: type
) -> tuple[Any | None, Exception | None, str | None]:
    """This rank's workspace, its exception, and why the group gives the
    workspace up, if it does: every rank's outcome goes to one vote."""
    ranks = _ranks(group)
    comm_backend = _CreationCommBackend(group, key, backend_type)
    _creation_warnings.clear()
    workspace = raised = None
    try:
        workspace = create(comm_backend)
    except Exception as e:
        # Upstream's own errors; not a collective this rank gave up on.
        raised = None if comm_backend.missing else e
        creation_warning("%s: %s", type(e).__name__, e)
    finally:
        comm_backend.done()
    waited = bool(comm_backend.missing)
    error = " ".join(_creation_warnings) or "no workspace"
    votes = _gather(
        group,
        (
            None if waited or workspace is not None else error,
            comm_backend.steps if waited else None,
            [ranks[r] for r in comm_backend.missing],
        ),
    )
    comm_backend.remove_keys()
    if failures := _failed(ranks, [error for error, _, _ in votes]):
        return workspace, raised, f"failed on {failures}"
    if waits := [(step, missing) for _, step, missing in votes if step is not None]:
        first = min(step for step, _ in waits)
        late = {rank for step, missing in waits if step == first for rank in missing}
        limit = f"did not answer within {FI_AR_CREATE_TIMEOUT_S} s"
        return workspace, raised, f"{_some(late)} {limit}"
    return workspace, raised, None


def _failed(ranks: tuple[int, ...], errors: list[str | None]) -> str:
    """The ranks with an error, each error once: 'rank 1 (error)'."""
    by_error: dict[str, list[int]] = {}
    for rank, error in zip(ranks, errors, strict=True):
        if error is not None:
            by_error.setdefault(error, []).append(rank)
    return ", ".join(f"{_some(r)} ({error})" for error, r in by_error.items())
