# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""The FlashInfer all-reduce backend of a process group, agreed by its ranks.

Creating a FlashInfer workspace is collective, so every rank of a group must
take the same path. This module gathers the inputs of
`decide_fi_ar_backend` on each rank and makes the ranks agree on its
outcome once per group. The agreement round also carries, from each rank,
whether its GPU has an NVLink fabric (on a group that spans nodes) and
whether it loaded the backend's kernels; each workspace creation is then
run and voted on by flashinfer_all_reduce_creation.
"""

import dataclasses
import importlib
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.device_communicators.flashinfer_all_reduce_creation import (
    describe_load_failures,
    gather_codes,
    gather_details,
    mark_prepared,
    prepare_backend,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_installed import (
    installed_kernel_inputs,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_ENV,
    FLASHINFER_VERSION_CHECK_ENV,
    FiArBackendDecision,
    FiArBackendInputs,
    backend_span_error,
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
# How a (backend, allow_trtllm_fallback) decision travels between ranks: the
# low bits of the agreement code; the flags below ride beside it.
_DECISION_BACKENDS = (None, "trtllm", "mnnvl")
_DECISION_BITS = 7
# This rank's GPU has no NVLink fabric (asked only where mnnvl spans nodes).
_NO_FABRIC = 8
# This rank failed to load the backend's kernels.
_NOT_PREPARED = 16
# FlashInfer's probe for an NVLink fabric (flashinfer/comm/mnnvl.py in
# 0.7.2.post1 and 0.7.4), with which 0.7.2.post1's handle exchange picks
# fabric handles or local file descriptors (`make_handle_exchanger`).
FLASHINFER_FABRIC_PROBE = ("flashinfer.comm.mnnvl", "is_mnnvl_fabric_supported")


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


def nvlink_fabric() -> bool:
    """Whether this GPU has an NVLink fabric, by FlashInfer's own probe.

    A probe that fails counts as no fabric: FlashInfer's handle exchange
    would fail the same way.
    """
    module_name, probe = FLASHINFER_FABRIC_PROBE
    try:
        module = importlib.import_module(module_name)
        return bool(getattr(module, probe)(torch.cuda.current_device()))
    except Exception as e:
        logger.warning_once("FlashInfer's NVLink fabric probe failed: %s", e)
        return False


def _decide_for_group(
    group: ProcessGroup,
) -> tuple[FiArBackendInputs, FiArBackendDecision]:
    """This rank's view of the decision: gather the inputs and decide.

    Fabric support is left unknown here: it counts only once every rank
    has answered (`_agree_on_backend`).
    """
    setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=group_node_count(group),
        device_capability=device_capability(),
        hisparse=hisparse_enabled(),
        **installed_kernel_inputs(),
    )
    decision = decide_fi_ar_backend(inputs)
    if decision.known_issue is not None and setting != "auto":
        logger.warning_once(
            "%s. Unset %s to let vLLM pick a safe backend.",
            decision.reason,
            FI_AR_BACKEND_ENV,
        )
    return inputs, decision


def _decision_code(decision: tuple[str | None, bool]) -> int:
    """A (backend, allow_trtllm_fallback) pair as one int, to all-gather."""
    backend, allow_trtllm_fallback = decision
    return _DECISION_BACKENDS.index(backend) * 2 + int(allow_trtllm_fallback)


def _describe_decision_code(code: int) -> str:
    backend = _DECISION_BACKENDS[code // 2] or "off"
    return f"{backend} (may fall back to trtllm)" if code % 2 else backend


def _prepare(
    inputs: FiArBackendInputs, decision: FiArBackendDecision
) -> tuple[bool | None, str | None]:
    """This rank's fabric answer and kernel-load error, before any creation.

    Fabric is asked only where mnnvl would span nodes; kernels are loaded
    only for a backend that will be created.
    """
    backend = decision.backend
    fabric = None
    if backend == "mnnvl" and inputs.node_count > 1:
        fabric = nvlink_fabric()
    if (
        backend is None
        or fabric is False
        or backend_span_error(backend, inputs.node_count)
    ):
        return fabric, None
    return fabric, prepare_backend(backend)


def _agree_on_backend(
    group: ProcessGroup, inputs: FiArBackendInputs, decision: FiArBackendDecision
) -> tuple[str | None, bool]:
    """Use the decision only if every rank made it; otherwise turn it off.

    Ranks can see different inputs (the env var set on one node only,
    HiSparse configured on some ranks), and ranks that create different
    workspaces hang. One small CPU collective, once per group, which also
    carries each rank's NVLink fabric answer (mnnvl across nodes needs it
    on every rank) and whether it loaded the backend's kernels.
    """
    mine = (decision.backend, decision.allow_trtllm_fallback)
    ranks = tuple(dist.get_process_group_ranks(group))
    fabric, load_error = _prepare(inputs, decision)
    code = _decision_code(mine)
    code |= _NO_FABRIC if fabric is False else 0
    code |= _NOT_PREPARED if load_error is not None else 0
    codes = gather_codes(group, code) if len(ranks) > 1 else [code]
    decisions = [code & _DECISION_BITS for code in codes]
    if len(set(decisions)) > 1:
        views = ", ".join(
            f"rank {rank}: {_describe_decision_code(code)}"
            for rank, code in zip(ranks, decisions, strict=True)
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
    no_fabric = [
        rank for rank, code in zip(ranks, codes, strict=True) if code & _NO_FABRIC
    ]
    if no_fabric:
        return _without_fabric(ranks, inputs, no_fabric)
    if any(code & _NOT_PREPARED for code in codes):
        return _without_kernels(group, ranks, decision, load_error)
    if decision.backend is not None:
        mark_prepared(group, decision.backend)
    logger.info_once(
        "FlashInfer all-reduce backend for ranks %s: %s (%s)",
        ranks,
        decision.backend or "off",
        decision.reason,
    )
    return mine


def _without_fabric(
    ranks: tuple[int, ...], inputs: FiArBackendInputs, no_fabric: list[int]
) -> tuple[str | None, bool]:
    """Off for a multi-node group where some rank has no NVLink fabric.

    The ranks agreed on mnnvl, so the policy's answer with the fabric known
    to be missing is the same on each: off. An explicit mnnvl is warned
    about, as it cannot work here.
    """
    decision = decide_fi_ar_backend(dataclasses.replace(inputs, fabric=False))
    log = logger.info_once if inputs.setting == "auto" else logger.warning_once
    log(
        "FlashInfer all-reduce backend for ranks %s: %s (%s; FlashInfer's "
        "is_mnnvl_fabric_supported is false on ranks %s)",
        ranks,
        decision.backend or "off",
        decision.reason,
        ", ".join(map(str, no_fabric)),
    )
    return decision.backend, decision.allow_trtllm_fallback


def _without_kernels(
    group: ProcessGroup,
    ranks: tuple[int, ...],
    decision: FiArBackendDecision,
    load_error: str | None,
) -> tuple[str | None, bool]:
    """The trtllm fallback, where allowed, when a rank could not load the
    agreed backend's kernels; otherwise off."""
    errors = [load_error] if len(ranks) == 1 else gather_details(group, load_error)
    assert decision.backend is not None
    fallback = "trtllm" if decision.allow_trtllm_fallback else None
    logger.warning_once(
        "%s; FlashInfer all-reduce for ranks %s: %s.",
        describe_load_failures(decision.backend, ranks, errors),
        ranks,
        f"{fallback} instead" if fallback else "off",
    )
    return fallback, False


def resolve_fi_ar_backend(group: ProcessGroup) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses.

    Decided and agreed on once per process group, for the life of the
    process; see `decide_fi_ar_backend` for the rules.
    """
    agreed = _fi_ar_decisions.get(group)
    if agreed is None:
        agreed = _agree_on_backend(group, *_decide_for_group(group))
        _fi_ar_decisions[group] = agreed
    return agreed
