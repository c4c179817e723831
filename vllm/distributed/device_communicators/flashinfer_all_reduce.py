# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Description: Keep HiSparse off FlashInfer's MNNVL all-reduce while the
#  FlashInfer kernels that will run lack the fix; make every rank of a group
#  take the same path, within a bound; no mnnvl across nodes without an
#  NVLink fabric.
#  HiSparse's host gathers set off a cluster-barrier race in FlashInfer's
#  MNNVL fused all-reduce ("CUDA error: unspecified launch failure", 7 of 7
#  runs on 8xB200 TP8), fixed in flashinfer-python 0.7.4 (LamportFlags::
#  ctaArrive()); vllm 0.33.0 pins 0.7.2.post1. flashinfer_all_reduce_policy
#  decides: with HiSparse, `auto` and kernels older than 0.7.4 (also those
#  of an older flashinfer-jit-cache that FLASHINFER_DISABLE_VERSION_CHECK
#  lets FlashInfer load), one node uses trtllm and a multi-node group is off
#  (trtllm cannot span nodes); on 0.7.4 the override retires itself. An
#  explicit backend is obeyed, with a warning for mnnvl without the fix. A
#  multi-node group where FlashInfer's is_mnnvl_fabric_supported is false on
#  some rank is off: mnnvl only times out there (vllm#51986).
#  Creation is collective: flashinfer_all_reduce_group makes the ranks agree
#  once per group (off if they differ) in one round that also carries each
#  rank's kernel load (done first, as a JIT build takes minutes) and fabric
#  probe; flashinfer_all_reduce_creation runs FlashInfer's collectives on a
#  gloo group bounded at FI_AR_CREATE_TIMEOUT_S (300 s; vLLM's wait 30 min)
#  and has the ranks vote, so a creation failing on any rank ends the same
#  way on all within the bound. This fixes start-up hangs of stock 0.33.0.
#  Changes here: _resolve_fi_ar_backend and _node_count come from the group
#  module; _create_workspace hands upstream's (now _create_workspace_on_rank,
#  which takes FlashInfer's comm backend and group and raises on failure) to
#  create_on_every_rank. Messages changed on purpose: one info line per group
#  names the backend and why (a warning for explicit mnnvl without a fabric
#  or with HiSparse); upstream's per-rank creation warnings become one
#  warning on every rank naming the rank that failed and its error.
# Bug: https://github.com/vllm-project/vllm/issues/64327
# Bug: https://github.com/vllm-project/vllm/issues/51986 (the fabric vote)
# Bug-FlashInfer: https://github.com/flashinfer-ai/flashinfer/issues/7782
# Origin: vendor
# Forwarded: https://github.com/vllm-project/vllm/issues/64327 (the HiSparse
#  override); the fabric vote is upstream's open vllm PR 53377; not yet (the
#  rank agreement and the bounded, voted creation)
# Base: vllm==0.33.0
# Last-Update: 2026-12-01
# Applied-Upstream: no
# Drop-When: the HiSparse override, once vLLM pins flashinfer-python 0.7.4
#  or newer, or keeps HiSparse off MNNVL itself (vllm#64327); the fabric
#  vote, once the base release carries vllm PR 53377 or another fix of
#  vllm#51986; the rest, once upstream vLLM makes the ranks of a group agree
#  on the backend and bounds and shares each workspace creation.

import atexit
import functools
import os
import random
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config.compilation import PassConfig
from vllm.distributed.device_communicators.all_reduce_utils import (
    FI_MNNVL_ALLREDUCE_MAX_SIZE_MB,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_creation import (
    create_on_every_rank,
)

# Counting nodes is collective; count each group once.
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    group_node_count as _node_count,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    resolve_fi_ar_backend,
)
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

# Workspace for standalone allreduce and non-quant ar+rms fusion
_fi_ar_workspace = None
# Extra workspace for quant fusion patterns. This may use either the primary
# allreduce backend or a fallback backend when the primary workspace is not
# available on the current topology.
_fi_ar_quant_workspace = None
# Creation is collective, so a failed attempt must not be retried on every
# all-reduce call.
_fi_ar_workspace_failed = False
_fi_ar_quant_workspace_failed = False
_fi_ar_workspace_groups: dict[int, ProcessGroup] = {}


def _get_tuned_standalone_max_size(
    world_size: int,
    backend: str,
    group: ProcessGroup,
) -> int | None:
    if backend != "mnnvl":
        return None
    capability = current_platform.get_device_capability()
    if capability is None:
        return None
    max_size_mb = FI_MNNVL_ALLREDUCE_MAX_SIZE_MB.get(
        (capability.to_int(), world_size, _node_count(group))
    )
    return None if max_size_mb is None else int(max_size_mb * MiB)


def _create_workspace_on_rank(
    backend: str,
    world_size: int,
    rank: int,
    max_token_num: int,
    hidden_dim: int,
    dtype: torch.dtype,
    group: ProcessGroup,
    comm_backend: Any,
):
    """This rank's part of a creation (see create_on_every_rank); raises."""
    rng_state = random.getstate()
    try:
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
            raise RuntimeError(
                "FlashInfer MNNVL multicast is unavailable on the current topology"
            )
    finally:
        random.setstate(rng_state)
    workspace_id = id(workspace)
    workspace_group = _fi_ar_workspace_groups.get(workspace_id)
    if workspace_group is not None and workspace_group is not group:
        raise RuntimeError(
            "FlashInfer returned an all-reduce workspace already associated "
            "with a different process group"
        )
    _fi_ar_workspace_groups[workspace_id] = group
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


def _release_workspace(workspace: Any) -> None:
    """Destroy a workspace that another rank failed to create."""
    del _fi_ar_workspace_groups[id(workspace)]
    workspace.destroy()


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

    On every rank or on none, within FI_AR_CREATE_TIMEOUT_S, even when a rank
    fails before FlashInfer's rendezvous; see create_on_every_rank.
    """
    create = functools.partial(
        _create_workspace_on_rank,
        *(backend, world_size, rank, max_token_num, hidden_dim, dtype, group),
    )
    return create_on_every_rank(
        group, backend, create, _release_workspace, TorchDistBackend
    )


def _resolve_fi_ar_backend(group: ProcessGroup) -> tuple[str | None, bool]:
    """Resolve the flashinfer allreduce backend for the current setup.

    Returns:
        A ``(backend, allow_trtllm_fallback)`` tuple. ``backend`` is ``None``
        when automatic selection has no supported backend for the process
        group.

    Decided once per process group and agreed on by all of its ranks, with
    HiSparse kept off mnnvl (vllm#64327); see `decide_fi_ar_backend`.
    """
    return resolve_fi_ar_backend(group)


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

    if backend == "trtllm" and _node_count(group) > 1:
        raise ValueError(
            "Flashinfer allreduce is not supported for multi-node allreduce with "
            "'trtllm' backend. Please use 'mnnvl' backend instead."
        )

    if (
        envs.VLLM_ALLREDUCE_USE_FLASHINFER
        and (max_size := _get_tuned_standalone_max_size(world_size, backend, group))
        is not None
    ):
        element_size = torch.empty((), dtype=dtype, device="cpu").element_size()
        max_token_num = max(max_token_num, max_size // (hidden_dim * element_size))

    def _get_or_create(be: str):
        # Reuse the quant workspace if it was already created with the same backend
        if _fi_ar_quant_workspace is not None and _fi_ar_quant_workspace.backend == be:
            return _fi_ar_quant_workspace
        return _create_workspace(
            be, world_size, rank, max_token_num, hidden_dim, dtype, group
        )

    _fi_ar_workspace = _get_or_create(backend)
    if _fi_ar_workspace is None and allow_trtllm_fallback and backend != "trtllm":
        logger.warning_once(
            "FlashInfer mnnvl allreduce workspace unavailable (likely no NVSwitch "
            "multicast support); falling back to trtllm backend for single node."
        )
        backend = "trtllm"
        _fi_ar_workspace = _get_or_create(backend)

    if _fi_ar_workspace is not None:
        logger.info_once(
            "Initialized FlashInfer Allreduce norm fusion workspace "
            f"with backend={backend}"
        )
    else:
        _fi_ar_workspace_failed = True
        logger.error_once(
            "Failed to initialize FlashInfer Allreduce norm fusion workspace "
            f"with backend={backend}"
        )

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

    if backend == "trtllm" and _node_count(group) > 1:
        raise ValueError(
            "Flashinfer allreduce quantization fusion is not supported for "
            "multi-node allreduce with 'trtllm' backend. Please use 'mnnvl' "
            "backend instead."
        )

    # Reuse the non-quant workspace if it was already created with the same
    # backend.
    if _fi_ar_workspace is not None and _fi_ar_workspace.backend == backend:
        _fi_ar_quant_workspace = _fi_ar_workspace
        return _fi_ar_quant_workspace

    if (
        _fi_ar_workspace is not None
        and _fi_ar_workspace.backend == "trtllm"
        and allow_trtllm_fallback
        and backend != "trtllm"
    ):
        _fi_ar_quant_workspace = _fi_ar_workspace
        return _fi_ar_quant_workspace

    _fi_ar_quant_workspace = _create_workspace(
        backend, world_size, rank, max_token_num, hidden_dim, dtype, group
    )
    if _fi_ar_quant_workspace is None and allow_trtllm_fallback and backend != "trtllm":
        logger.warning_once(
            "FlashInfer mnnvl allreduce quantization fusion workspace unavailable "
            "(likely no NVSwitch multicast support); falling back to trtllm "
            "backend for single node."
        )
        backend = "trtllm"
        if _fi_ar_workspace is not None and _fi_ar_workspace.backend == backend:
            _fi_ar_quant_workspace = _fi_ar_workspace
        else:
            _fi_ar_quant_workspace = _create_workspace(
                backend, world_size, rank, max_token_num, hidden_dim, dtype, group
            )

    if _fi_ar_quant_workspace is not None:
        logger.info_once(
            "Initialized FlashInfer Allreduce norm quantization "
            f"fusion workspace with backend={backend}"
        )
    else:
        _fi_ar_quant_workspace_failed = True
        logger.error_once(
            "Failed to initialize FlashInfer Allreduce norm quantization "
            f"fusion workspace with backend={backend}"
        )

    return _fi_ar_quant_workspace


_fi_ar_workspace_lock = threading.Lock()


def destroy_fi_ar_workspace():
    global _fi_ar_workspace, _fi_ar_quant_workspace
    global _fi_ar_workspace_failed, _fi_ar_quant_workspace_failed
    with _fi_ar_workspace_lock:
        is_alias = _fi_ar_workspace is _fi_ar_quant_workspace

        if _fi_ar_workspace is not None:
            _fi_ar_workspace.destroy()
        if _fi_ar_quant_workspace is not None and not is_alias:
            _fi_ar_quant_workspace.destroy()

        _fi_ar_workspace = _fi_ar_quant_workspace = None
        _fi_ar_workspace_failed = _fi_ar_quant_workspace_failed = False
        _fi_ar_workspace_groups.clear()


def _fi_ar_workspaces_for_group(group: ProcessGroup) -> list[Any]:
    workspaces = [_fi_ar_workspace]
    if _fi_ar_quant_workspace is not _fi_ar_workspace:
        workspaces.append(_fi_ar_quant_workspace)

    group_workspaces = []
    for workspace in workspaces:
        if workspace is None:
            continue
        workspace_group = _fi_ar_workspace_groups.get(id(workspace))
        if workspace_group is None:
            raise RuntimeError(
                "FlashInfer all-reduce workspace process group was not retained"
            )
        if workspace_group is group:
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
            self.world_size,
            backend,
            self.group,
        )
        self.max_workspace_size = (
            tuned_max_size
            if tuned_max_size is not None
            else int(default_max_size_mb * MiB)
        )
        self.max_num_tokens = 0
        self.disabled = False

    def _ensure_workspace(self, hidden_dim: int, dtype: torch.dtype) -> bool:
        """Ensure the all reduce workspace is initialized."""
        if self.max_num_tokens == 0:
            element_size = torch.tensor([], dtype=dtype, device="cpu").element_size()
            self.max_num_tokens = self.max_workspace_size // (hidden_dim * element_size)
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

        if not input_tensor.is_cuda:
            return False

        if not input_tensor.is_contiguous():
            return False

        if len(input_tensor.shape) != 2:
            return False

        if input_tensor.dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        ):
            return False

        if input_tensor.nbytes > self.max_workspace_size:
            return False

        num_tokens, hidden_dim = input_tensor.shape
        if not self.max_num_tokens:
            element_size = torch.tensor([], dtype=input_tensor.dtype).element_size()
            self.max_num_tokens = self.max_workspace_size // (hidden_dim * element_size)

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
        # The token bound above uses the full allocation budget, but mnnvl's
        # Lamport buffers rotate through three slots, so only ~1/3 is usable per
        # call. Asking the workspace directly to reject sizes the kernel can't fit.
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
