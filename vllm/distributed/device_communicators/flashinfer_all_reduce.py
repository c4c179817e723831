# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Description: Keep HiSparse off FlashInfer's MNNVL all-reduce, and make
#  every rank agree on the backend.
#  FlashInfer's MNNVL fused all-reduce + residual + RMSNorm kernel has a
#  cluster-barrier race that HiSparse's host gathers on its copy stream set
#  off; the engine then dies with "CUDA error: unspecified launch failure"
#  (7 of 7 runs on 8xB200 TP8). With HiSparse on and
#  VLLM_FLASHINFER_ALLREDUCE_BACKEND=auto, a single node now uses trtllm and
#  a multi-node group turns FlashInfer all-reduce off (trtllm cannot span
#  nodes). An explicit backend is still obeyed; explicit mnnvl with HiSparse
#  logs a warning.
#  Workspace creation is collective, so the ranks of a group now agree on
#  the backend (off if they differ) and vote on each creation, and the node
#  count is computed once per group. The decision is a pure function,
#  explained without a GPU by running this module (`--help`).
#  Everything else behaves as in vllm 0.33.0.
# Bug: https://github.com/vllm-project/vllm/issues/64327
# Bug-FlashInfer: https://github.com/flashinfer-ai/flashinfer/issues/7782
# Origin: vendor
# Forwarded: https://github.com/vllm-project/vllm/issues/64327
# Base: vllm==0.33.0
# Last-Update: 2026-11-29
# Applied-Upstream: no
# Drop-When: vLLM upstream guards HiSparse off MNNVL itself (vllm#64327), or
#  the pinned flashinfer-python ships the fix for flashinfer#7782 (set
#  `fixed_in` on its entry in FI_AR_KNOWN_ISSUES; the override then retires
#  itself and this file can go at the next rebase).
"""FlashInfer fused all-reduce workspaces and the standalone all-reduce.

The backend choice is split in two: `decide_fi_ar_backend` is a pure
function of what the choice depends on (so it can be tested and explained
without a GPU), and `_resolve_fi_ar_backend` gathers those inputs for a
process group.
"""

import argparse
import atexit
import json
import os
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.config.compilation import PassConfig
from vllm.distributed.device_communicators.all_reduce_utils import (
    FI_MNNVL_ALLREDUCE_MAX_SIZE_MB,
)
from vllm.distributed.parallel_state import _node_count
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

logger = init_logger(__name__)

# The empirical value for small batch
PDL_ADVANCE_LAUNCH_TOKENS = 16

MiB = 1024 * 1024

fi_ar_available = False
try:
    import flashinfer.comm as flashinfer_comm  # type: ignore[no-redef]
    from flashinfer.comm.mnnvl import (
        TorchDistBackend,  # type: ignore[import-not-found, no-redef]
    )

    fi_ar_available = hasattr(flashinfer_comm, "allreduce_fusion")
except ImportError:
    pass

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
FI_AR_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")

# Workspace for standalone allreduce and non-quant ar+rms fusion
_fi_ar_workspace = None
# Extra workspace for quant fusion patterns. It may share the primary
# workspace, or use the trtllm fallback where mnnvl is unavailable.
_fi_ar_quant_workspace = None
# Creation is collective, so a failed attempt must not be retried on every
# all-reduce call.
_fi_ar_workspace_failed = False
_fi_ar_quant_workspace_failed = False
_fi_ar_workspace_groups: dict[int, ProcessGroup] = {}
# Node counting is itself a collective and a group's nodes never change, so
# count once per process group (0.33.0 counted several times at start-up).
_fi_ar_node_counts: dict[ProcessGroup, int] = {}
# The backend every rank of a group agreed on; reset with the workspaces.
_fi_ar_decisions: dict[ProcessGroup, tuple[str | None, bool]] = {}
# How a (backend, allow_trtllm_fallback) decision travels between ranks.
_DECISION_BACKENDS = (None, "trtllm", "mnnvl")


@dataclass(frozen=True)
class FiArBackendInputs:
    """Everything the FlashInfer all-reduce backend choice depends on."""

    setting: str
    """`VLLM_FLASHINFER_ALLREDUCE_BACKEND`: auto, trtllm or mnnvl."""
    node_count: int
    """Number of nodes the all-reduce process group spans."""
    device_capability: int | None
    """CUDA compute capability as `<major><minor>` (90, 100, ...)."""
    hisparse: bool
    """Whether HiSparse sparse-MLA KV offload is on."""
    flashinfer_version: str | None
    """Installed flashinfer-python version, if known."""
    multicast: bool | None = None
    """NVSwitch multicast availability; None while unknown (at start-up it is
    only learned by trying to create an mnnvl workspace)."""


@dataclass(frozen=True)
class FiArBackendDecision:
    """The outcome of `decide_fi_ar_backend`."""

    backend: str | None
    """The backend to create, or None to turn FlashInfer all-reduce off."""
    allow_trtllm_fallback: bool
    """Whether a failed mnnvl workspace may be retried as trtllm."""
    reason: str
    """One line saying why, for logs and `explain`."""
    known_issue: str | None = None
    """The FI_AR_KNOWN_ISSUES entry that changed or flagged the choice."""


@dataclass(frozen=True)
class FiArKnownIssue:
    """A FlashInfer bug that makes `auto` steer clear of a backend.

    An entry retires itself: once the installed flashinfer-python is at or
    above `fixed_in`, `auto` makes its normal choice again. Adding an entry
    needs no change to the decision logic.
    """

    name: str
    summary: str
    links: tuple[str, ...]
    trigger: str
    """When it fires, in words."""
    applies: Callable[[FiArBackendInputs], bool]
    """The trigger condition, on the decision inputs."""
    unsafe_backend: str
    single_node_backend: str | None
    """What `auto` uses instead on a single node (None: off)."""
    multi_node_backend: str | None
    """What `auto` uses instead on a multi-node group (None: off)."""
    replacement_note: str
    """Why those replacements, for the reason line."""
    fixed_in: str | None
    """First flashinfer-python release with the fix; None while unreleased."""

    def is_fixed(self, flashinfer_version: str | None) -> bool:
        """Whether the installed FlashInfer already carries the fix."""
        if self.fixed_in is None or flashinfer_version is None:
            return False
        try:
            return Version(flashinfer_version) >= Version(self.fixed_in)
        except InvalidVersion:
            return False

    def replacement(self, node_count: int) -> str | None:
        """The backend `auto` uses instead of the unsafe one."""
        if node_count == 1:
            return self.single_node_backend
        return self.multi_node_backend


FI_AR_KNOWN_ISSUES: tuple[FiArKnownIssue, ...] = (
    FiArKnownIssue(
        name="flashinfer#7782",
        summary=(
            "FlashInfer's MNNVL all-reduce has a cluster-barrier race that "
            "HiSparse host gathers set off (CUDA error: unspecified launch "
            "failure)"
        ),
        links=(
            "https://github.com/flashinfer-ai/flashinfer/issues/7782",
            "https://github.com/vllm-project/vllm/issues/64327",
        ),
        trigger="HiSparse is on",
        applies=lambda inputs: inputs.hisparse,
        unsafe_backend="mnnvl",
        single_node_backend="trtllm",
        multi_node_backend=None,
        replacement_note="trtllm has no such race but cannot span nodes",
        fixed_in=None,
    ),
)


def backend_span_error(backend: str | None, node_count: int) -> str | None:
    """Why `backend` cannot serve a group of `node_count` nodes, if it cannot.

    trtllm is single-node only; start-up and `explain` both apply this rule.
    """
    if backend != "trtllm" or node_count == 1:
        return None
    return (
        f"FlashInfer all-reduce backend 'trtllm' cannot span nodes, but this "
        f"process group spans {node_count} nodes. Set {FI_AR_BACKEND_ENV}=mnnvl "
        f"(Blackwell MNNVL systems) or {FI_AR_BACKEND_ENV}=auto."
    )


def _auto_choice(inputs: FiArBackendInputs) -> FiArBackendDecision:
    """What `auto` picks when no known issue applies (vllm 0.33.0's rule)."""
    if inputs.node_count == 1:
        if inputs.multicast is False:
            return FiArBackendDecision(
                "trtllm", False, "auto, single node without NVSwitch multicast"
            )
        # MNNVL decodes faster than TRTLLM on single-node NVSwitch systems
        # (about 3-5% at TP4/TP8 on H200 and B200); TRTLLM is the fallback
        # where the node lacks the multicast that MNNVL needs.
        return FiArBackendDecision(
            "mnnvl",
            True,
            "auto, single node (trtllm if NVSwitch multicast is unavailable)",
        )
    if inputs.device_capability is not None and inputs.device_capability >= 100:
        return FiArBackendDecision(
            "mnnvl",
            False,
            f"auto, {inputs.node_count} nodes on Blackwell: mnnvl is the only "
            "backend that spans nodes",
        )
    return FiArBackendDecision(
        None,
        False,
        f"auto, {inputs.node_count} nodes: a multi-node group needs MNNVL on "
        "Blackwell (SM100+), so FlashInfer all-reduce is off",
    )


def decide_fi_ar_backend(
    inputs: FiArBackendInputs,
    known_issues: tuple[FiArKnownIssue, ...] | None = None,
) -> FiArBackendDecision:
    """Choose the FlashInfer all-reduce backend; a pure function of `inputs`.

    An explicit setting is obeyed (a known issue only adds a warning to the
    reason). `auto` takes vllm 0.33.0's choice, then steers around any
    unfixed known issue that applies to it. `known_issues` defaults to
    FI_AR_KNOWN_ISSUES.
    """
    if known_issues is None:
        known_issues = FI_AR_KNOWN_ISSUES
    if inputs.setting not in FI_AR_BACKEND_CHOICES:
        raise ValueError(
            f"Invalid value {inputs.setting!r} for {FI_AR_BACKEND_ENV}. "
            f"Valid options: {list(FI_AR_BACKEND_CHOICES)}."
        )
    if inputs.setting != "auto":
        for issue in known_issues:
            if (
                issue.unsafe_backend == inputs.setting
                and issue.applies(inputs)
                and not issue.is_fixed(inputs.flashinfer_version)
            ):
                return FiArBackendDecision(
                    inputs.setting,
                    False,
                    f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly; "
                    f"this is known to crash when {issue.trigger}: "
                    f"{issue.summary} ({issue.name})",
                    known_issue=issue.name,
                )
        return FiArBackendDecision(
            inputs.setting,
            False,
            f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly",
        )

    choice = _auto_choice(inputs)
    retired = []
    for issue in known_issues:
        if choice.backend != issue.unsafe_backend or not issue.applies(inputs):
            continue
        if issue.is_fixed(inputs.flashinfer_version):
            retired.append(
                f"the {issue.name} override is retired: flashinfer-python "
                f"{inputs.flashinfer_version} >= {issue.fixed_in} has the fix"
            )
            continue
        backend = issue.replacement(inputs.node_count)
        where = (
            "on a single node"
            if inputs.node_count == 1
            else f"on {inputs.node_count} nodes"
        )
        action = f"using {backend}" if backend else "FlashInfer all-reduce is off"
        return FiArBackendDecision(
            backend,
            False,
            f"auto, {issue.trigger}: {issue.summary} ({issue.name}); {action} "
            f"{where} ({issue.replacement_note}). Set "
            f"{FI_AR_BACKEND_ENV}={issue.unsafe_backend} to override",
            known_issue=issue.name,
        )
    if retired:
        return FiArBackendDecision(
            choice.backend,
            choice.allow_trtllm_fallback,
            f"{choice.reason}; {'; '.join(retired)}",
        )
    return choice


def _hisparse_enabled() -> bool:
    """Whether HiSparse is on for the engine being built.

    Its host gathers are what set off the MNNVL race. vLLM infers
    `hisparse_config` from a HiSparseConnector (also inside a
    MultiConnector), so this one field covers every way to turn it on.
    Workers build their communicators inside `set_current_vllm_config`;
    with no current config there is no HiSparse.
    """
    config = get_current_vllm_config_or_none()
    return config is not None and config.attention_config.hisparse_config is not None


def _installed_flashinfer_version() -> str | None:
    """The flashinfer-python release, which known issues retire against."""
    try:
        return version("flashinfer-python")
    except PackageNotFoundError:
        return None


def _group_node_count(group: ProcessGroup) -> int:
    """Node count of `group`, computed once: counting nodes is collective."""
    node_count = _fi_ar_node_counts.get(group)
    if node_count is None:
        node_count = _fi_ar_node_counts[group] = _node_count(group)
    return node_count


def _device_capability() -> int | None:
    capability = current_platform.get_device_capability()
    return None if capability is None else capability.to_int()


def _get_tuned_standalone_max_size(
    world_size: int,
    backend: str,
    group: ProcessGroup,
) -> int | None:
    if backend != "mnnvl":
        return None
    capability = _device_capability()
    if capability is None:
        return None
    max_size_mb = FI_MNNVL_ALLREDUCE_MAX_SIZE_MB.get(
        (capability, world_size, _group_node_count(group))
    )
    return None if max_size_mb is None else int(max_size_mb * MiB)


def _try_create_workspace(
    backend: str,
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
):
    """This rank's part of creating a workspace; None if it failed here."""
    comm_backend = TorchDistBackend(group=group)
    rng_state = random.getstate()
    try:
        # FlashInfer draws workspace handles from `random`; reseed so ranks
        # that share a seed do not collide, and restore the caller's state.
        random.seed(int.from_bytes(os.urandom(16), byteorder="big"))
        # Creation may run lazily inside the first sync-checked forward (e.g.
        # with enforce_eager, which skips warmup).
        with gpu_sync_allowed(first_only=True):
            workspace = flashinfer_comm.create_allreduce_fusion_workspace(
                backend=backend,
                world_size=world_size,
                rank=rank,
                max_token_num=max_token_num,
                hidden_dim=hidden_dim,
                dtype=dtype,
                comm_backend=comm_backend,
                group=group,
            )
        if backend == "mnnvl" and not getattr(workspace, "mc_ptr", 0):
            workspace.destroy()
            logger.warning_once(
                "FlashInfer MNNVL multicast is unavailable on the current topology."
            )
            return None
    except Exception as e:
        hint = (
            " This is expected on GPUs without NVSwitch (e.g., NVLink "
            "bridge-only or PCIe topologies)."
            if "multicast" in str(e).lower()
            else ""
        )
        logger.warning_once(
            "Failed to initialize FlashInfer All Reduce workspace: %s.%s", e, hint
        )
        return None
    finally:
        random.setstate(rng_state)
    return workspace


def _all_ranks_succeeded(succeeded: bool, group: ProcessGroup) -> bool:
    """Vote on a creation outcome so every rank takes the same next step.

    Creation is collective: a rank that fell back (or gave up) on its own
    while the others kept their workspace would leave the group hung in
    mismatched collectives.
    """
    if dist.get_world_size(group) == 1:
        return succeeded
    vote = torch.tensor([int(succeeded)], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    return bool(vote.item())


def _create_workspace(
    backend: str,
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
):
    """Create a flashinfer allreduce workspace, returning None on failure.

    It fails on every rank if it fails on any.
    """
    workspace = _try_create_workspace(
        backend, world_size, rank, max_token_num, hidden_dim, dtype, group
    )
    if not _all_ranks_succeeded(workspace is not None, group):
        if workspace is not None:
            workspace.destroy()
            logger.warning_once(
                "FlashInfer %s all-reduce workspace failed on another rank; "
                "released it here so all ranks take the same path.",
                backend,
            )
        return None
    owner = _fi_ar_workspace_groups.setdefault(id(workspace), group)
    if owner is not group:
        raise RuntimeError(
            "FlashInfer returned an all-reduce workspace already associated "
            "with a different process group"
        )
    logger.debug(
        "Initialized FlashInfer All Reduce workspace: backend=%s, "
        "world_size=%d, rank=%d, max_token_num=%d, hidden_dim=%d, dtype=%s",
        backend,
        world_size,
        rank,
        max_token_num,
        hidden_dim,
        dtype,
    )
    return workspace


def _decide_for_group(group: ProcessGroup) -> FiArBackendDecision:
    """This rank's view of the decision: gather the inputs and decide."""
    setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    decision = decide_fi_ar_backend(
        FiArBackendInputs(
            setting=setting,
            node_count=_group_node_count(group),
            device_capability=_device_capability(),
            hisparse=_hisparse_enabled(),
            flashinfer_version=_installed_flashinfer_version(),
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
            "backends (%s). Set %s and the HiSparse config the same on every "
            "node.",
            ranks,
            views,
            FI_AR_BACKEND_ENV,
        )
        return None, False
    logger.info_once(
        "FlashInfer all-reduce backend for ranks %s: %s (%s)",
        ranks,
        decision.backend or "off",
        decision.reason,
    )
    return mine


def _resolve_fi_ar_backend(group: ProcessGroup) -> tuple[str | None, bool]:
    """Resolve the flashinfer allreduce backend for the current setup.

    Decided once per process group and agreed on by all of its ranks; see
    `decide_fi_ar_backend` for the rules.

    Returns:
        A ``(backend, allow_trtllm_fallback)`` tuple. ``backend`` is ``None``
        when FlashInfer all-reduce should stay off for the process group.
    """
    agreed = _fi_ar_decisions.get(group)
    if agreed is None:
        agreed = _agree_on_backend(group, _decide_for_group(group))
        _fi_ar_decisions[group] = agreed
    return agreed


def _check_backend_spans_group(backend: str, group: ProcessGroup) -> None:
    """Fail clearly instead of at the first kernel launch."""
    error = backend_span_error(backend, _group_node_count(group))
    if error is not None:
        raise ValueError(error)


def _reuse_or_create(
    backend: str,
    other,
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
):
    """Share `other` when it already has `backend`; one workspace is enough."""
    if other is not None and other.backend == backend:
        return other
    return _create_workspace(
        backend, world_size, rank, max_token_num, hidden_dim, dtype, group
    )


def _acquire_workspace(
    backend: str,
    allow_trtllm_fallback: bool,
    other,
    shape: tuple,
    kind: str,
):
    """Create (or share) a `kind` workspace, falling back to trtllm if allowed.

    Returns None after logging the failure; callers remember it, because
    creation is collective and is not retried.
    """
    workspace = _reuse_or_create(backend, other, *shape)
    if workspace is None and allow_trtllm_fallback and backend != "trtllm":
        logger.warning_once(
            "FlashInfer mnnvl allreduce %s workspace unavailable (likely no "
            "NVSwitch multicast support); falling back to trtllm backend for "
            "single node.",
            kind,
        )
        backend = "trtllm"
        workspace = _reuse_or_create(backend, other, *shape)
    if workspace is not None:
        logger.info_once(
            "Initialized FlashInfer Allreduce norm %s workspace with backend=%s",
            kind,
            backend,
        )
    else:
        logger.error_once(
            "Failed to initialize FlashInfer Allreduce norm %s workspace with "
            "backend=%s",
            kind,
            backend,
        )
    return workspace


def get_fi_ar_workspace(
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
):
    """Return the allreduce workspace for non-quant patterns, initializing if needed.

    Used by AllReduceFusionPass (non-quant patterns) and FlashInferAllReduce
    for standalone allreduce. Backend is controlled by
    VLLM_FLASHINFER_ALLREDUCE_BACKEND env var.
    """
    global _fi_ar_workspace, _fi_ar_workspace_failed
    if _fi_ar_workspace is not None or _fi_ar_workspace_failed:
        return _fi_ar_workspace

    backend, allow_trtllm_fallback = _resolve_fi_ar_backend(group)
    if backend is None:
        return None
    _check_backend_spans_group(backend, group)

    if (
        envs.VLLM_ALLREDUCE_USE_FLASHINFER
        and (max_size := _get_tuned_standalone_max_size(world_size, backend, group))
        is not None
    ):
        element_size = torch.empty((), dtype=dtype, device="cpu").element_size()
        max_token_num = max(max_token_num, max_size // (hidden_dim * element_size))

    shape = (world_size, rank, max_token_num, hidden_dim, dtype, group)
    _fi_ar_workspace = _acquire_workspace(
        backend, allow_trtllm_fallback, _fi_ar_quant_workspace, shape, "fusion"
    )
    _fi_ar_workspace_failed = _fi_ar_workspace is None
    return _fi_ar_workspace


def get_fi_ar_quant_workspace(
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
):
    """Return the allreduce workspace for quant patterns, initializing if needed.

    Backend is controlled by VLLM_FLASHINFER_ALLREDUCE_BACKEND env var, matching
    non-quant fusion. With ``auto`` this prefers mnnvl and falls back to trtllm
    only on single-node topologies where mnnvl multicast is unavailable.
    """
    global _fi_ar_quant_workspace, _fi_ar_quant_workspace_failed
    if _fi_ar_quant_workspace is not None or _fi_ar_quant_workspace_failed:
        return _fi_ar_quant_workspace

    backend, allow_trtllm_fallback = _resolve_fi_ar_backend(group)
    if backend is None:
        return None
    _check_backend_spans_group(backend, group)

    shape = (world_size, rank, max_token_num, hidden_dim, dtype, group)
    if (
        allow_trtllm_fallback
        and backend != "trtllm"
        and _fi_ar_workspace is not None
        and _fi_ar_workspace.backend == "trtllm"
    ):
        # The non-quant workspace already fell back; mnnvl would fail again.
        backend = "trtllm"
    _fi_ar_quant_workspace = _acquire_workspace(
        backend, allow_trtllm_fallback, _fi_ar_workspace, shape, "quantization fusion"
    )
    _fi_ar_quant_workspace_failed = _fi_ar_quant_workspace is None
    return _fi_ar_quant_workspace


_fi_ar_workspace_lock = threading.Lock()


def destroy_fi_ar_workspace():
    global _fi_ar_workspace, _fi_ar_quant_workspace
    global _fi_ar_workspace_failed, _fi_ar_quant_workspace_failed
    with _fi_ar_workspace_lock:
        shared = _fi_ar_workspace is _fi_ar_quant_workspace
        if _fi_ar_workspace is not None:
            _fi_ar_workspace.destroy()
        if _fi_ar_quant_workspace is not None and not shared:
            _fi_ar_quant_workspace.destroy()

        _fi_ar_workspace = _fi_ar_quant_workspace = None
        _fi_ar_workspace_failed = _fi_ar_quant_workspace_failed = False
        _fi_ar_workspace_groups.clear()
        _fi_ar_decisions.clear()


def _fi_ar_workspaces_for_group(group: ProcessGroup) -> list[Any]:
    workspaces = [_fi_ar_workspace]
    if _fi_ar_quant_workspace is not _fi_ar_workspace:
        workspaces.append(_fi_ar_quant_workspace)

    group_workspaces = []
    for workspace in workspaces:
        if workspace is None:
            continue
        owner = _fi_ar_workspace_groups.get(id(workspace))
        if owner is None:
            raise RuntimeError(
                "FlashInfer all-reduce workspace process group was not retained"
            )
        if owner is group:
            group_workspaces.append(workspace)
    return group_workspaces


def checkpoint_prepare_fi_ar_workspaces(
    group: ProcessGroup, skip_unsupported: bool = False
) -> None:
    for workspace in _fi_ar_workspaces_for_group(group):
        try:
            workspace.checkpoint_prepare()
        except NotImplementedError:
            if not skip_unsupported:
                raise
            logger.info_once(
                "FlashInfer all-reduce workspace backed by torch symmetric memory "
                "stays resident during suspend."
            )


def checkpoint_restore_fi_ar_workspaces(
    group: ProcessGroup, skip_unsupported: bool = False
) -> None:
    for workspace in _fi_ar_workspaces_for_group(group):
        try:
            workspace.checkpoint_restore(TorchDistBackend(group=group))
        except NotImplementedError:
            if not skip_unsupported:
                raise


atexit.register(destroy_fi_ar_workspace)


class FlashInferAllReduce:
    def __init__(
        self,
        group: ProcessGroup,
        device: int | str | torch.device,
    ):
        self.disabled = True

        if not fi_ar_available:
            logger.info(
                "FlashInfer All Reduce is disabled because flashinfer is not available"
            )
            return

        if not current_platform.is_cuda():
            logger.info(
                "FlashInfer All Reduce is disabled because it requires CUDA platform"
            )
            return

        self.group = group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device
        if self.world_size == 1:
            return

        default_max_size_mb = PassConfig.default_fi_allreduce_fusion_max_size_mb().get(
            self.world_size
        )
        if not default_max_size_mb:
            logger.warning(
                "FlashInfer All Reduce is disabled because it "
                "is not supported for world_size=%d.",
                self.world_size,
            )
            return
        backend, _ = _resolve_fi_ar_backend(self.group)
        if backend is None:
            logger.info(
                "FlashInfer All Reduce is disabled because no supported backend "
                "is available for this process group."
            )
            return
        tuned_max_size = _get_tuned_standalone_max_size(
            self.world_size, backend, self.group
        )
        self.max_workspace_size = (
            tuned_max_size
            if tuned_max_size is not None
            else int(default_max_size_mb * MiB)
        )
        self.max_num_tokens = 0
        self.disabled = False

    def _max_tokens_for(self, hidden_dim: int, dtype: torch.dtype) -> int:
        element_size = torch.tensor([], dtype=dtype, device="cpu").element_size()
        return self.max_workspace_size // (hidden_dim * element_size)

    def _ensure_workspace(self, hidden_dim: int, dtype: torch.dtype) -> bool:
        """Ensure the all reduce workspace is initialized."""
        if self.max_num_tokens == 0:
            self.max_num_tokens = self._max_tokens_for(hidden_dim, dtype)
        workspace = get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=self.max_num_tokens,
            hidden_dim=hidden_dim,
            dtype=dtype,
            group=self.group,
        )
        if workspace is None:
            self.disabled = True
            return False
        return True

    def should_use_fi_ar(self, input_tensor: torch.Tensor) -> bool:
        if self.disabled:
            return False
        if not input_tensor.is_cuda or not input_tensor.is_contiguous():
            return False
        if len(input_tensor.shape) != 2:
            return False
        if input_tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if input_tensor.nbytes > self.max_workspace_size:
            return False

        num_tokens, hidden_dim = input_tensor.shape
        if not self.max_num_tokens:
            self.max_num_tokens = self._max_tokens_for(hidden_dim, input_tensor.dtype)
        if num_tokens > self.max_num_tokens:
            return False

        if not self._ensure_workspace(hidden_dim, input_tensor.dtype):
            return False

        workspace = get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=self.max_num_tokens,
            hidden_dim=hidden_dim,
            dtype=input_tensor.dtype,
            group=self.group,
        )
        assert workspace is not None
        # The token bound above uses the whole allocation, but mnnvl's Lamport
        # buffers rotate through three slots, so only about a third is usable
        # per call; let the workspace reject sizes the kernel cannot fit.
        return workspace.is_buffer_size_sufficient(
            tp_size=self.world_size,
            num_tokens=num_tokens,
            hidden_dim=hidden_dim,
            dtype=input_tensor.dtype,
        )

    def all_reduce(self, input_tensor: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_dim = input_tensor.shape
        workspace = get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=self.max_num_tokens,
            hidden_dim=hidden_dim,
            dtype=input_tensor.dtype,
            group=self.group,
        )
        return flashinfer_comm.allreduce_fusion(
            input=input_tensor,
            workspace=workspace,
            pattern=flashinfer_comm.AllReduceFusionPattern.kAllReduce,
            launch_with_pdl=True,
            trigger_completion_at_end=num_tokens > PDL_ADVANCE_LAUNCH_TOKENS,
        )

    def destroy(self):
        if not self.disabled:
            destroy_fi_ar_workspace()


# --- explain: the decision for a deployment, on any machine -----------------


def explain_fi_ar_backend(inputs: FiArBackendInputs) -> dict[str, Any]:
    """The decision for `inputs` and whether start-up would fail, as data."""
    decision = decide_fi_ar_backend(inputs)
    error = backend_span_error(decision.backend, inputs.node_count)
    return {
        "backend": decision.backend,
        "allow_trtllm_fallback": decision.allow_trtllm_fallback,
        "reason": decision.reason,
        "known_issue": decision.known_issue,
        "error": error,
        "inputs": asdict(inputs),
    }


def _describe_backend(explained: dict[str, Any]) -> str:
    if explained["error"]:
        return f"error: {explained['backend']} cannot span nodes"
    if explained["backend"] is None:
        return "off"
    if explained["allow_trtllm_fallback"]:
        return f"{explained['backend']} (trtllm if no multicast)"
    return explained["backend"]


def fi_ar_decision_table() -> str:
    """The decision across its input matrix, as a Markdown table for docs.

    Multicast is left unknown, as it is at start-up, and FlashInfer is
    taken to be a release without the fixes in FI_AR_KNOWN_ISSUES.
    """
    lines = [
        f"| `{FI_AR_BACKEND_ENV}` | Nodes | GPU | HiSparse | Backend | Why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for setting in FI_AR_BACKEND_CHOICES:
        for node_count in (1, 2):
            for capability in (90, 100):
                for hisparse in (False, True):
                    explained = explain_fi_ar_backend(
                        FiArBackendInputs(
                            setting=setting,
                            node_count=node_count,
                            device_capability=capability,
                            hisparse=hisparse,
                            flashinfer_version=None,
                        )
                    )
                    why = explained["error"] or explained["reason"]
                    lines.append(
                        f"| `{setting}` | {node_count} | SM{capability} | "
                        f"{'on' if hisparse else 'off'} | "
                        f"{_describe_backend(explained)} | {why} |"
                    )
    return "\n".join(lines) + "\n"


def _parse_capability(text: str) -> int:
    """Accept 10.0, 100 or sm100 for a compute capability."""
    value = text.lower().removeprefix("sm").removeprefix("_")
    try:
        if "." in value:
            major, minor = value.split(".", 1)
            return int(major) * 10 + int(minor)
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability; use e.g. 9.0, 10.0 or 100"
        ) from None


def _hisparse_in_kv_transfer_config(text: str) -> bool:
    """HiSparse as `vllm serve --kv-transfer-config` would turn it on."""
    from vllm.config import KVTransferConfig

    try:
        config = KVTransferConfig(**json.loads(text))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"invalid --kv-transfer-config: {e}") from e
    return config.has_connector("HiSparseConnector")


def _explain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.distributed.device_communicators.flashinfer_all_reduce",
        description="Explain which FlashInfer all-reduce backend vLLM picks for "
        "a deployment, and why. Needs no GPU.",
    )
    parser.add_argument(
        "--backend",
        choices=FI_AR_BACKEND_CHOICES,
        help=f"the {FI_AR_BACKEND_ENV} setting (default: the environment's)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the tensor-parallel group spans (default: 1)",
    )
    parser.add_argument(
        "--capability",
        type=_parse_capability,
        help="GPU compute capability, e.g. 9.0 or 10.0 (default: this GPU's)",
    )
    hisparse = parser.add_mutually_exclusive_group()
    hisparse.add_argument(
        "--hisparse",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="whether HiSparse is on (default: off)",
    )
    hisparse.add_argument(
        "--kv-transfer-config",
        type=_hisparse_in_kv_transfer_config,
        dest="hisparse",
        metavar="JSON",
        help="the --kv-transfer-config given to vllm serve; HiSparse is on if "
        "it has a HiSparseConnector, also inside a MultiConnector",
    )
    parser.add_argument(
        "--multicast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether the node has NVSwitch multicast (default: unknown, as "
        "at start-up)",
    )
    parser.add_argument(
        "--flashinfer-version",
        default=_installed_flashinfer_version(),
        help="flashinfer-python version (default: the installed one)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the decision table for the docs and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the backend choice for the given deployment; 1 if it would fail."""
    parser = _explain_parser()
    args = parser.parse_args(argv)
    if args.table:
        print(fi_ar_decision_table(), end="")
        return 0
    try:
        setting = args.backend or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        parser.error(str(e))
    if args.nnodes < 1:
        parser.error("--nnodes must be at least 1")
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=args.nnodes,
        device_capability=(
            args.capability if args.capability is not None else _device_capability()
        ),
        hisparse=args.hisparse,
        flashinfer_version=args.flashinfer_version,
        multicast=args.multicast,
    )
    explained = explain_fi_ar_backend(inputs)
    if args.json:
        print(json.dumps(explained, indent=2))
    else:
        capability = inputs.device_capability
        multicast = {None: "unknown", True: "yes", False: "no"}[inputs.multicast]
        print(f"FlashInfer all-reduce backend: {_describe_backend(explained)}")
        print(f"  why: {explained['error'] or explained['reason']}")
        print(
            f"  inputs: {FI_AR_BACKEND_ENV}={inputs.setting}, "
            f"{inputs.node_count} node(s), "
            f"GPU {f'SM{capability}' if capability else 'unknown'}, "
            f"HiSparse {'on' if inputs.hisparse else 'off'}, "
            f"multicast {multicast}, "
            f"flashinfer-python {inputs.flashinfer_version or 'not installed'}"
        )
    return 1 if explained["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
