# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added beside the replaced flashinfer_all_reduce.py (vllm#64327);
#  goes away with it.
"""The FlashInfer all-reduce backend of a process group, and its workspaces.

Creating a workspace is collective, so the ranks of a group agree on the
backend once, and each creation ends the same way on every rank in bounded
time."""

import dataclasses
import importlib
import weakref
from collections.abc import Callable
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
# A decision travels as 3 bits per dtype key: backend index * 2 + fallback.
_BACKENDS = (None, "trtllm", "mnnvl")
_DTYPE_KEYS = (None, *FI_AR_DTYPES)
_NO_FABRIC = 1 << 3 * len(_DTYPE_KEYS)
# The collectives of FlashInfer's CommBackend (flashinfer/comm/comm_backend.py).
_COLLECTIVES = ("allgather", "bcast", "barrier")
# How a rank's part of a creation ended (the code's low 2 bits).
_OK, _FAILED, _WAITED = 0, 1, 2


@dataclasses.dataclass
class _Group:
    """What every rank of a group agreed on, and how its creations went."""

    decisions: dict[str | None, FiArBackendDecision]
    channels: dict[str, ProcessGroup]
    """Per backend, the bounded gloo group of FlashInfer's creation."""
    failed: set[str] = dataclasses.field(default_factory=set)


# Held weakly, or destroyed groups' gloo threads and sockets would outlive
# each re-initialisation (repeated LLM()).
_groups: weakref.WeakKeyDictionary[ProcessGroup, _Group] = weakref.WeakKeyDictionary()
_node_counts: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()


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


def gather_codes(group: ProcessGroup, code: int) -> list[int]:
    """One int from each rank of `group`, in rank order."""
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in _ranks(group)]
    dist.all_gather(gathered, torch.tensor([code], dtype=torch.int64), group=group)
    return [int(c.item()) for c in gathered]


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _some(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _encode(decisions: dict[str | None, FiArBackendDecision]) -> int:
    return sum(
        (_BACKENDS.index(d.backend) * 2 + d.allow_trtllm_fallback) << (3 * i)
        for i, d in enumerate(decisions.values())
    )


def _describe(code: int) -> str:
    backend = _BACKENDS[(code & 7) // 2] or "off"
    return f"{backend} (may fall back to trtllm)" if code & 1 else backend


def _bounded_channels(group: ProcessGroup) -> dict[str, ProcessGroup]:
    """Per backend, a gloo group of `group`'s ranks whose collectives time out
    at the bound, so a rank that fails leaves the others waiting there only.

    Made at every group's agreement, whatever its outcome: torch names
    groups by a per-process counter, so processes that made different
    numbers of groups would hang in any later new_group.
    """
    channels = {}
    for backend in BACKEND_KERNEL_LOADERS:
        channel = dist.new_group(
            list(_ranks(group)),
            backend="gloo",
            timeout=timedelta(seconds=FI_AR_CREATE_TIMEOUT_S),
            use_local_synchronization=True,
        )
        assert isinstance(channel, ProcessGroup)
        channels[backend] = channel
    return channels


def _decide_every_dtype(
    inputs: FiArBackendInputs,
) -> dict[str | None, FiArBackendDecision]:
    """A known issue may hit one dtype only; None is the dtype not yet known."""
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
    code = _encode(decisions)
    if inputs.node_count > 1 and "mnnvl" in {d.backend for d in decisions.values()}:
        code |= 0 if nvlink_fabric() else _NO_FABRIC
    channels = _bounded_channels(group)
    codes = gather_codes(group, code)
    ranks = _ranks(group)
    differ = [
        i for i in range(len(_DTYPE_KEYS)) if len({c >> 3 * i & 7 for c in codes}) > 1
    ]
    if differ:
        first = differ[0]
        views = ", ".join(
            f"rank {rank}: {_describe(c >> 3 * first)}"
            for rank, c in zip(ranks, codes, strict=True)
        )
        logger.error_once(
            "FlashInfer all-reduce is off for ranks %s: they chose different "
            "backends%s (%s). Make these the same on every node: %s, the "
            "HiSparse config, the GPU and the FlashInfer packages.",
            ranks,
            f" for {_DTYPE_KEYS[first]} workspaces" if first else "",
            views,
            FI_AR_BACKEND_ENV,
        )
        off = FiArBackendDecision(None, False, "the ranks disagree")
        return _Group(dict.fromkeys(_DTYPE_KEYS, off), channels)
    if no_fabric := [r for r, c in zip(ranks, codes, strict=True) if c & _NO_FABRIC]:
        decisions = _decide_every_dtype(dataclasses.replace(inputs, fabric=False))
        decisions[None] = dataclasses.replace(
            decisions[None],
            reason=f"{decisions[None].reason}; FlashInfer's is_mnnvl_fabric_supported "
            f"is false on {_some(no_fabric)}",
        )
    _log_decision(f"ranks {ranks}", decisions[None])
    return _Group(decisions, channels)


def _log_decision(who: str, decision: FiArBackendDecision) -> None:
    """The start-up line; a warning where a setting runs into a known issue."""
    issue = decision.known_issue
    warn = issue is not None and issue.backend == decision.backend
    (logger.warning_once if warn else logger.info_once)(
        "FlashInfer all-reduce backend for %s: %s (%s)%s",
        *(who, decision.backend or "off", decision.reason),
        f". Unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend." if warn else "",
    )


def resolve_fi_ar_backend(
    group: ProcessGroup, dtype: torch.dtype | None = None
) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses for
    a workspace of `dtype` (None: not yet known). Agreed once per group."""
    if group not in _groups:
        _groups[group] = _agree(group)
    state = _groups[group]
    key = None if dtype is None else str(dtype).removeprefix("torch.")
    decision = state.decisions.get(key, state.decisions[None])
    # Only a dtype's own known issue makes its decision differ from the group's.
    if decision.known_issue is not state.decisions[None].known_issue:
        _log_decision(f"ranks {_ranks(group)}, {key}", decision)
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
    """FlashInfer's CommBackend for one creation: its collectives run on the
    bounded channel and are counted; after `done` (FlashInfer keeps it for
    `checkpoint_prepare`'s barrier) everything runs on vLLM's group."""

    def __init__(self, backend_type: type, channel: ProcessGroup, group: ProcessGroup):
        self._current = self._bounded = backend_type(group=channel)
        self._after = backend_type(group=group)
        self.steps = 0
        self.waited = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._current, name)
        if self._current is not self._bounded or name not in _COLLECTIVES:
            return method

        def collective(*args: Any, **kwargs: Any) -> Any:
            try:
                result = method(*args, **kwargs)
            except Exception:
                self.waited = True
                raise
            self.steps += 1
            return result

        return collective

    def done(self) -> None:
        self._current = self._after


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
    it where another rank failed. A failed backend is not tried again."""
    state = _groups[group]
    if backend in state.failed:
        return None
    workspace, failure = _create_and_vote(group, backend, create, backend_type)
    if failure is None:
        return workspace
    if workspace is not None:
        release(workspace)
    state.failed.add(backend)
    logger.warning_once(
        "FlashInfer %s all-reduce workspace for ranks %s: %s; every rank gave it up.",
        *(backend, _ranks(group), failure),
    )
    return None


def _create_and_vote(
    group: ProcessGroup, backend: str, create: Callable[[Any], Any], backend_type: type
) -> tuple[Any | None, str | None]:
    """This rank's workspace, and why the group gives it up, if it does."""
    ranks = _ranks(group)
    error = _load_kernels(backend)
    loaded = gather_codes(group, int(error is not None))
    if any(loaded):
        where = _some([r for r, c in zip(ranks, loaded, strict=True) if c])
        return None, f"{where} could not load its kernels ({error or 'see there'})"
    channel = _groups[group].channels[backend]
    comm_backend = _CreationCommBackend(backend_type, channel, group)
    try:
        workspace = create(comm_backend)
    finally:
        comm_backend.done()
    status = _OK if workspace is not None else _FAILED
    status = _WAITED if comm_backend.waited else status
    codes = gather_codes(group, status | comm_backend.steps << 2)
    if not any(code & 3 for code in codes):
        return workspace, None
    if failed := [r for r, c in zip(ranks, codes, strict=True) if c & 3 == _FAILED]:
        return workspace, f"failed on {_some(failed)} (see the log there)"
    steps = [code >> 2 for code in codes]
    late = [r for r, step in zip(ranks, steps, strict=True) if step == min(steps)]
    return workspace, f"{_some(late)} did not answer within {FI_AR_CREATE_TIMEOUT_S} s"
