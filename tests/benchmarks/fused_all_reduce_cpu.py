# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's fused all-reduce + RMSNorm kernels, emulated on CPU.

`emulate_trtllm` and `emulate_mnnvl` replay the released kernels'
arithmetic from their headers (lines cited are of flashinfer-python
0.7.2.post1 unless told); the arithmetic tests hold the check's reference
and tolerance (benchmarks/fused_all_reduce_reference.py) to them.
`install_cpu_kernel`, for `check_fused_all_reduce.py --device cpu` (the
harness on gloo, without GPUs), fakes CUDA below FlashInfer so that its own
workspace creation runs, and puts the emulation of the backend it made where
FlashInfer's kernel serves vLLM's op. Test code: no GPU run uses it.
"""

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fused_all_reduce_reference import rms_scale

FI_AR_MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
MiB = 1024 * 1024
# flashinfer/comm/trtllm_mnnvl_ar.py (0.7.2.post1 and 0.7.4) lines 44-51:
# one-shot where tokens * hidden * tp * element size is at most 1 MiB.
MNNVL_ONE_SHOT_THRESHOLD = 64 * 1024 * 8 * 2


def _fp32_sum_in_rank_order(partials: list[torch.Tensor]) -> torch.Tensor:
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    return total


def emulate_trtllm(
    partials: list[torch.Tensor],
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight_bias: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """trtllm's kARResidualRMSNorm with fp32_acc, as vLLM's op calls it.

    include/flashinfer/comm/trtllm_allreduce_fusion.cuh: allreduce_sum
    (lines 1464-1471) sums the ranks in fp32 and rounds with
    `static_cast<T>`; the fused op (lines 1109-1110) adds the residual with
    vec_add (lines 813-820: fp32 add, rounded to T); rms_norm (lines
    1291-1328) squares the T values in fp32 and scales in fp32. 0.7.4 does
    the same at lines 1591-1598, 919-928, 1228-1229 and 1418-1453.
    Returns (normed, residual out).
    """
    dtype = residual.dtype
    reduced = _fp32_sum_in_rank_order(partials).to(dtype)
    summed = (reduced.float() + residual.float()).to(dtype)
    scale = rms_scale(summed.float(), eps)
    normed = summed.float() * scale * (weight_bias + gamma.float())
    return normed.to(dtype), summed


def emulate_mnnvl(
    partials: list[torch.Tensor],
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    release: str,
    weight_bias: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mnnvl's fused all-reduce + RMSNorm, one-shot or two-shot as AUTO picks.

    include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh: the ranks summed in
    fp32 and rounded with `fromFloat<T>` (reduceOneshotDeterministic, lines
    544-547; the two-shot reduce, lines 595-598), then the residual added in
    T (`packedAccum += residualIn`, lines 995-997; `inp + res`, line 1428).
    (0.7.4: lines 548-551, 599-602, 1001, 1468.)
    One-shot squares in T in 0.7.2.post1 (lines 1009-1010:
    `toFloat<T>(x * x)`, inf in fp16 past 255.94, so rsqrtf gives 0 and
    the token is zeroed) and in fp32 in 0.7.4 (lines 1013-1016); it scales
    as `x * rcpRms * (bias + gamma)` (lines 1029-1033). Two-shot squares in
    fp32 and scales as `(bias + gamma) * x * rcpRms` (lines 1435-1438,
    1465-1478; 0.7.4: 1475-1478, 1505-1518) in both. Returns (normed, residual out).
    """
    dtype = residual.dtype
    tokens, hidden = residual.shape
    size = tokens * hidden * len(partials) * residual.element_size()
    oneshot = size <= MNNVL_ONE_SHOT_THRESHOLD
    reduced = _fp32_sum_in_rank_order(partials).to(dtype)
    summed = reduced + residual  # T + T, rounded to T
    weight = weight_bias + gamma.float()
    x = summed.float()
    # T * T, rounded to T (inf past 255.94 in fp16), or fp32 squares.
    in_t = oneshot and _squares_in_t(release)
    squares = (summed * summed).float() if in_t else x * x
    scale = torch.rsqrt(squares.sum(-1, keepdim=True) / hidden + eps)
    normed = x * scale * weight if oneshot else weight * x * scale
    return normed.to(dtype), summed


def _squares_in_t(release: str) -> bool:
    from packaging.version import Version

    return Version(release) < Version("0.7.4")


def install_cpu_kernel(
    op_module: Any, release: str, size_mb: float, rank: int, tp_size: int
) -> "CpuDevice":
    """Fake CUDA below FlashInfer, and put the emulated kernel where it
    serves the op; returns the device that stands in for this rank's GPU.

    FlashInfer's own create_allreduce_fusion_workspace runs, over this
    build's get_fi_ar_workspace and the patch's creation, on the faked
    device of tests/distributed/fake_cuda.py that the suite runs it on
    (with multicast, as NVSwitch GPUs have): the check's start-up is the
    suite's sequence. The fake holds no memory, so the kernel is emulated:
    vLLM's gate (`_can_use_flashinfer`) is kept but for its check of a CUDA
    tensor, and sized by vLLM's fusion table (`size_mb`, the row the
    launcher read), as on GPUs; the kernel gathers every rank's partial
    sums (in rank order, as the kernels read them) and runs the emulation
    of the backend FlashInfer made, at `release`.
    """
    import pytest
    from fake_cuda import FakeCuda  # tests/distributed, which the rank adds

    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tp_group,
    )

    fi_ar = importlib.import_module(FI_AR_MODULE)
    device = CpuDevice(FakeCuda(device=rank, device_count=max(8, tp_size)), size_mb)
    device.cuda.install(pytest.MonkeyPatch())  # for the process's life

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
        max_token_num = device.op_max_token_num(tp_size, hidden, hidden_states.dtype)
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
        partials = [torch.empty_like(allreduce_in) for _ in range(world_size)]
        group = get_tp_group().cpu_group
        dist.all_gather(partials, allreduce_in.contiguous(), group=group)
        emulate = (
            functools.partial(emulate_mnnvl, release=release)
            if ws.backend == "mnnvl"
            else emulate_trtllm
        )
        normed, summed = emulate(
            partials, residual, rms_gamma, rms_eps, weight_bias=weight_bias
        )
        allreduce_in.copy_(summed)
        norm_out.copy_(normed)

    op_module._can_use_flashinfer = can_use
    op_module.flashinfer_trtllm_fused_allreduce_norm = kernel
    return device


def use_oneshot(
    backend: str, tp_size: int, tokens: int, hidden: int, dtype: torch.dtype
) -> bool:
    """As on GPUs (fused_all_reduce_gpu.use_oneshot) without a device
    capability: vLLM's op picks one-shot for trtllm, FlashInfer's AUTO by
    size for mnnvl."""
    size = tokens * hidden * tp_size * dtype.itemsize
    return backend != "mnnvl" or size <= MNNVL_ONE_SHOT_THRESHOLD


@dataclass
class CpuDevice:
    """What stands in for a rank's GPU on CPU: its faked CUDA device (whose
    `driver_calls` say what FlashInfer's creation did) and the size of
    vLLM's fusion table row, which vLLM's gate reads on GPUs."""

    cuda: Any  # fake_cuda.FakeCuda
    size_mb: float
    use_oneshot = staticmethod(use_oneshot)

    def op_max_token_num(self, tp_size: int, hidden: int, dtype: torch.dtype) -> int:
        """The workspace token budget vLLM's op asks for (`_max_token_num`)."""
        element_size = torch.tensor([], dtype=dtype).element_size()
        return int(self.size_mb * MiB) // (hidden * element_size)
