# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The FlashInfer all-reduce backend of a process group, agreed by its ranks:
ranks that create different workspaces hang. They agree once, in one round on
vLLM's group, and make no process group of their own (torch numbers groups
per process, so one more on some ranks hangs every later new_group)."""

import dataclasses
import importlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import VllmConfig
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


@dataclasses.dataclass
class Agreement:
    """What every rank of a group agreed on: a decision per workspace dtype
    (None: not yet known), vLLM's node count, taken once as counting is
    collective, and the decisions the group's rank 0 has logged."""

    decisions: dict[str | None, FiArBackendDecision]
    node_count: int
    logged: set[FiArBackendDecision]


_DTYPE_KEYS = (None, *FI_AR_DTYPES)
# Held weakly, so that per-group state goes with its group.
_groups = weakref.WeakKeyDictionary[ProcessGroup, Agreement]()


def node_count(group: ProcessGroup) -> int:
    return agreed(group).node_count


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


def gather(group: ProcessGroup, mine: Any) -> list[Any]:
    """One object from each rank of `group`, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def group_ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _decide_every_dtype(inputs: FiArBackendInputs, **changes: Any) -> dict:
    """A known issue may hit one dtype only."""
    return {
        key: decide_fi_ar_backend(dataclasses.replace(inputs, dtype=key, **changes))
        for key in _DTYPE_KEYS
    }


def agreed(group: ProcessGroup, config: VllmConfig | None = None) -> Agreement:
    """The group's agreement, reached on first use under `config` (the vLLM
    config current then), in one round that also carries each rank's NVLink
    fabric probe where mnnvl would span nodes. Ranks can see different inputs
    (the variable set on one node only): disagreeing, they are off."""
    if group in _groups:
        return _groups[group]
    # vLLM sets hisparse_config for a HiSparseConnector, also in a MultiConnector.
    attention = None if config is None else config.attention_config
    inputs = FiArBackendInputs(
        setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
        node_count=_node_count(group),
        device_capability=device_capability(),
        hisparse=None if attention is None else attention.hisparse_config is not None,
        kernels=installed_kernels(),
    )
    decisions = _decide_every_dtype(inputs)
    unknown = inputs.hisparse is None
    if unknown and decisions != _decide_every_dtype(inputs, hisparse=False):
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash on these kernels."
        )
    choice = tuple((d.backend, d.allow_trtllm_fallback) for d in decisions.values())
    probe = inputs.node_count > 1 and "mnnvl" in {d.backend for d in decisions.values()}
    views = gather(group, (choice, nvlink_fabric() if probe else True))
    ranks, logged = group_ranks(group), set()
    if no_fabric := tuple(r for r, (_, ok) in zip(ranks, views, strict=True) if not ok):
        decisions = _decide_every_dtype(inputs, no_fabric=no_fabric)
    if len({view for view, _ in views}) > 1:
        i = next(i for i in range(len(choice)) if len({v[i] for v, _ in views}) > 1)
        if dist.get_rank(group) == 0:
            logger.error(
                "FlashInfer all-reduce is off for ranks %s: they chose different "
                "backends%s (%s). Make these the same on every node: %s, the "
                "HiSparse config, the GPU and the FlashInfer packages.",
                ranks,
                f" for {_DTYPE_KEYS[i]} workspaces" if i else "",
                ", ".join(
                    f"rank {rank}: {view[i][0] or 'off'}"
                    + " (may fall back to trtllm)" * view[i][1]
                    for rank, (view, _) in zip(ranks, views, strict=True)
                ),
                FI_AR_BACKEND_ENV,
            )
        off = FiArBackendDecision(None, False, "the ranks disagree")
        decisions, logged = dict.fromkeys(_DTYPE_KEYS, off), {off}
    _groups[group] = Agreement(decisions, inputs.node_count, logged)
    return _groups[group]


def decision(group: ProcessGroup, dtype: torch.dtype | None) -> FiArBackendDecision:
    """The group's decision for a workspace of `dtype` (None: not yet known)."""
    decisions = agreed(group).decisions
    return decisions.get(str(dtype).removeprefix("torch."), decisions[None])


def resolve_fi_ar_backend(
    group: ProcessGroup, dtype: torch.dtype | None, config: VllmConfig | None
) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses for a
    workspace of `dtype`. The group's own rank 0 logs it, whatever its local
    rank (vLLM's *_once lines print on each node's local rank 0): the first
    dtype's line, then one for each dtype that a known issue moves."""
    state = agreed(group, config)
    d = decision(group, dtype)
    if d not in state.logged and dist.get_rank(group) == 0:
        state.logged.add(d)
        warn = d.known_issue is not None and d.known_issue.backend == d.backend
        (logger.warning if warn else logger.info)(
            "FlashInfer all-reduce backend for ranks %s: %s%s (%s)%s",
            group_ranks(group),
            f"{str(dtype).removeprefix('torch.')}: " * (d != state.decisions[None]),
            d.backend or "off",
            d.reason,
            f". Unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend." * warn,
        )
    return d.backend, d.allow_trtllm_fallback
