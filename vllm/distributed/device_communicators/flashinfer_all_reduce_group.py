# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""The FlashInfer all-reduce backend of a process group, agreed by its ranks.

Creating a FlashInfer workspace is collective, so every rank of a group must
take the same path. This module gathers the inputs of
`decide_fi_ar_backend` on each rank, makes the ranks agree on its outcome
once per group, and lets them vote on each workspace creation.
"""

import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.device_communicators.flashinfer_all_reduce_installed import (
    installed_kernel_inputs,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_ENV,
    FLASHINFER_VERSION_CHECK_ENV,
    FiArBackendDecision,
    FiArBackendInputs,
    decide_fi_ar_backend,
)
from vllm.distributed.parallel_state import _node_count
from vllm.logger import init_logger
from vllm.platforms import current_platform

logger = init_logger(__name__)

# Both per-group caches hold their groups weakly: a strong reference would
# keep every destroyed group's gloo threads and sockets alive, one set per
# re-initialisation of the distributed state in a process (repeated LLM()).
# Node counting is itself a collective and a group's nodes never change, so
# count once per process group (0.33.0 counted several times at start-up).
_fi_ar_node_counts: weakref.WeakKeyDictionary[ProcessGroup, int] = (
    weakref.WeakKeyDictionary()
)
# The backend every rank of a group agreed on. It outlives
# destroy_fi_ar_workspace(): a workspace re-created after a destroy (a
# recompile, sleep/wake) may run with no vLLM config current, and deciding
# again then would read HiSparse as off and pick the racy mnnvl. It goes
# with its group.
_fi_ar_decisions: weakref.WeakKeyDictionary[ProcessGroup, tuple[str | None, bool]] = (
    weakref.WeakKeyDictionary()
)
# How a (backend, allow_trtllm_fallback) decision travels between ranks.
_DECISION_BACKENDS = (None, "trtllm", "mnnvl")


def group_node_count(group: ProcessGroup) -> int:
    """Node count of `group`, computed once: counting nodes is collective."""
    node_count = _fi_ar_node_counts.get(group)
    if node_count is None:
        node_count = _fi_ar_node_counts[group] = _node_count(group)
    return node_count


def hisparse_enabled() -> bool:
    """Whether HiSparse is on for the engine being built.

    Its host gathers are what set off the MNNVL race. vLLM infers
    `hisparse_config` from a HiSparseConnector (also inside a
    MultiConnector), so this one field covers every way to turn it on.
    Workers build their communicators inside `set_current_vllm_config`;
    with no current config there is no HiSparse.
    """
    config = get_current_vllm_config_or_none()
    return config is not None and config.attention_config.hisparse_config is not None


def device_capability() -> int | None:
    """This GPU's compute capability as `<major><minor>`, if there is one."""
    capability = current_platform.get_device_capability()
    return None if capability is None else capability.to_int()


def _decide_for_group(group: ProcessGroup) -> FiArBackendDecision:
    """This rank's view of the decision: gather the inputs and decide."""
    setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    decision = decide_fi_ar_backend(
        FiArBackendInputs(
            setting=setting,
            node_count=group_node_count(group),
            device_capability=device_capability(),
            hisparse=hisparse_enabled(),
            **installed_kernel_inputs(),
        )
    )
    if decision.known_issue is not None and setting != "auto":
        logger.warning_once(
            "%s. Unset %s to let vLLM pick a safe backend.",
            decision.reason,
            FI_AR_BACKEND_ENV,
        )
    return decision


def _decision_code(decision: tuple[str | None, bool]) -> int:
    """A (backend, allow_trtllm_fallback) pair as one int, to all-gather."""
    backend, allow_trtllm_fallback = decision
    return _DECISION_BACKENDS.index(backend) * 2 + int(allow_trtllm_fallback)


def _describe_decision_code(code: int) -> str:
    backend = _DECISION_BACKENDS[code // 2] or "off"
    return f"{backend} (may fall back to trtllm)" if code % 2 else backend


def _agree_on_backend(
    group: ProcessGroup, decision: FiArBackendDecision
) -> tuple[str | None, bool]:
    """Use the decision only if every rank made it; otherwise turn it off.

    Ranks can see different inputs (the env var set on one node only,
    HiSparse configured on some ranks), and ranks that create different
    workspaces hang. One small CPU collective, once per group.
    """
    mine = (decision.backend, decision.allow_trtllm_fallback)
    ranks = tuple(dist.get_process_group_ranks(group))
    code = _decision_code(mine)
    codes = [code]
    if len(ranks) > 1:
        gathered = [torch.zeros(1, dtype=torch.int32) for _ in ranks]
        dist.all_gather(gathered, torch.tensor([code], dtype=torch.int32), group=group)
        codes = [int(c.item()) for c in gathered]
    if len(set(codes)) > 1:
        views = ", ".join(
            f"rank {rank}: {_describe_decision_code(code)}"
            for rank, code in zip(ranks, codes, strict=True)
        )
        logger.error_once(
            "FlashInfer all-reduce is off for ranks %s: they chose different "
            "backends (%s). Make these the same on every node: %s, the HiSparse "
            "config, the GPU, the flashinfer-python release, the "
            "flashinfer-jit-cache release and its providers' releases, and "
            "whether %s is set.",
            ranks,
            views,
            FI_AR_BACKEND_ENV,
            FLASHINFER_VERSION_CHECK_ENV,
        )
        return None, False
    logger.info_once(
        "FlashInfer all-reduce backend for ranks %s: %s (%s)",
        ranks,
        decision.backend or "off",
        decision.reason,
    )
    return mine


def resolve_fi_ar_backend(group: ProcessGroup) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses.

    Decided and agreed on once per process group, for the life of the
    process; see `decide_fi_ar_backend` for the rules.
    """
    agreed = _fi_ar_decisions.get(group)
    if agreed is None:
        agreed = _agree_on_backend(group, _decide_for_group(group))
        _fi_ar_decisions[group] = agreed
    return agreed


def all_ranks_succeeded(succeeded: bool, group: ProcessGroup) -> bool:
    """Vote on a creation outcome so every rank takes the same next step.

    A rank that fell back (or gave up) on its own while the others kept
    their workspace would leave the group hung in mismatched collectives.
    """
    if dist.get_world_size(group) == 1:
        return succeeded
    vote = torch.tensor([int(succeeded)], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    return bool(vote.item())
