# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference of check_fused_all_reduce.py, and its CPU stand-ins.

`fused_reference` is what every output is checked against, on GPUs too:
the all-reduce in fp32, the residual added, an fp32 RMSNorm. With
`--device cpu` the same math stands in for FlashInfer's kernel, a
`ReferenceWorkspace` for its workspace, and the op's gate keeps every check
of vLLM's but the one for a CUDA tensor; this module installs them where
vLLM looks them up. Nothing here needs a GPU.
"""

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

FI_AR_MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
CREATION_MODULE = f"{FI_AR_MODULE}_creation"
# The fusion size budget of PassConfig.default_fi_allreduce_fusion_max_size_mb
# on CPU, where that table (it imports CUDA ops) cannot load.
CPU_FUSION_MAX_SIZE_MB = 64
MiB = 1024 * 1024


@contextlib.contextmanager
def platform_reads_as_cuda(active: bool) -> Iterator[None]:
    """While a config validates on CPU, the platform reads as CUDA.

    vLLM refuses HiSparse off CUDA; the CPU run builds its config as explain
    judges a deployment for a CUDA GPU, and only for the validation, so
    distributed state and ops stay on CPU.
    """
    if not active:
        yield
        return
    from vllm.distributed.device_communicators.flashinfer_all_reduce_deployment import (
        judged_for_a_cuda_gpu,
    )

    with judged_for_a_cuda_gpu():
        yield


class ReferenceWorkspace:
    """Stands in for a FlashInfer all-reduce workspace on CPU."""

    def __init__(self, backend: str, max_token_num: int, hidden_dim: int, group: Any):
        self.backend = backend
        self.mc_ptr = 1
        self.group = group
        self.max_elements = max_token_num * hidden_dim

    def is_buffer_size_sufficient(
        self,
        tp_size: int,
        num_tokens: int,
        hidden_dim: int,
        dtype: torch.dtype,
        use_oneshot: Any = None,
    ) -> bool:
        return num_tokens * hidden_dim <= self.max_elements

    def destroy(self) -> None:
        pass


def create_reference_workspace(
    *, backend: str, max_token_num: int, hidden_dim: int, group: Any, **_: Any
) -> ReferenceWorkspace:
    """FlashInfer's constructor on CPU; a collective, as FlashInfer's is."""
    dist.barrier(group=group)
    return ReferenceWorkspace(backend, max_token_num, hidden_dim, group)


def fused_reference(
    allreduce_in: torch.Tensor,
    residual: torch.Tensor,
    rms_gamma: torch.Tensor,
    rms_eps: float,
    group: Any,
    weight_bias: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """all_reduce(allreduce_in) + residual, and its RMSNorm, in fp32."""
    reduced = allreduce_in.float()
    dist.all_reduce(reduced, group=group)
    summed = reduced + residual.float()
    scale = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
    return summed * scale * (rms_gamma.float() + weight_bias), summed


def install_cpu_kernel(op_module: Any) -> None:
    """Put the reference implementation where FlashInfer serves the op.

    FlashInfer's workspace constructor is replaced where this build's
    get_fi_ar_workspace calls it, so the decision, the rank agreement and
    the creation vote still run; the op's kernel and its gate are replaced
    in the op's module, keeping every check of vLLM's gate
    (`_can_use_flashinfer`) but the one for a CUDA tensor.
    """
    fi_ar = importlib.import_module(FI_AR_MODULE)
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tp_group,
    )

    fi_ar.flashinfer_comm.create_allreduce_fusion_workspace = create_reference_workspace
    _skip_kernel_loads()

    def workspace(tp_size: int, max_token_num: int, hidden_states: torch.Tensor):
        return fi_ar.get_fi_ar_workspace(
            world_size=tp_size,
            rank=get_tensor_model_parallel_rank(),
            max_token_num=max_token_num,
            hidden_dim=hidden_states.shape[-1],
            dtype=hidden_states.dtype,
            group=get_tp_group().cpu_group,
        )

    def can_use(hidden_states: torch.Tensor, tp_size: int) -> tuple[bool, int]:
        if (
            hidden_states.dim() != 2
            or not hidden_states.is_contiguous()
            or hidden_states.dtype not in (torch.bfloat16, torch.float16)
        ):
            return False, 0
        num_tokens, hidden = hidden_states.shape
        max_token_num = cpu_max_token_num(tp_size, hidden, hidden_states.dtype)
        if num_tokens > max_token_num:
            return False, 0
        ws = workspace(tp_size, max_token_num, hidden_states)
        if ws is None or not ws.is_buffer_size_sufficient(
            tp_size=tp_size,
            num_tokens=num_tokens,
            hidden_dim=hidden,
            dtype=hidden_states.dtype,
        ):
            return False, 0
        return True, max_token_num

    def kernel(
        *,
        allreduce_in: torch.Tensor,
        residual: torch.Tensor,
        rms_gamma: torch.Tensor,
        rms_eps: float,
        world_size: int,
        max_token_num: int,
        norm_out: torch.Tensor,
        weight_bias: float = 0.0,
        **_: Any,
    ) -> None:
        ws = workspace(world_size, max_token_num, allreduce_in)
        assert ws is not None, "the workspace must exist when the kernel runs"
        normed, summed = fused_reference(
            allreduce_in, residual, rms_gamma, rms_eps, ws.group, weight_bias
        )
        allreduce_in.copy_(summed)
        norm_out.copy_(normed)

    op_module._can_use_flashinfer = can_use
    op_module.flashinfer_trtllm_fused_allreduce_norm = kernel


def _skip_kernel_loads() -> None:
    """FlashInfer's kernel-module loaders, which the build calls on every
    rank before a creation, load nothing on CPU: the reference needs no
    kernels, and FlashInfer's loaders find no CUDA architecture to build for.
    """
    creation = importlib.import_module(CREATION_MODULE)
    for module_name, loader in creation.BACKEND_KERNEL_LOADERS.values():
        setattr(importlib.import_module(module_name), loader, lambda: None)


def cpu_max_token_num(tp_size: int, hidden: int, dtype: torch.dtype) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    return CPU_FUSION_MAX_SIZE_MB * MiB // (hidden * element_size)
