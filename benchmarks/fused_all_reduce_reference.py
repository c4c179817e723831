# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The arithmetic of check_fused_all_reduce.py: reference, tolerance, kernels.

`reference` is what every output is checked against, on GPUs too: it
computes as FlashInfer's fused kernels do (the reduced sum rounded to the
dtype before the residual is added), and `allowances` is the most a correct
kernel can differ from it. `emulate_trtllm` and `emulate_mnnvl` replay the
released kernels' arithmetic from their headers; with `--device cpu` the
emulation of the backend the build decided on stands in for the kernel.
Header lines cited are of flashinfer-python 0.7.2.post1 unless told.
Nothing here needs a GPU.
"""

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

FI_AR_MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
# FlashInfer's kernel-module loaders (flashinfer/comm/trtllm_ar.py and
# trtllm_mnnvl_ar.py): nothing to load on CPU, and nothing to build for.
FLASHINFER_KERNEL_LOADERS = (
    ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
    ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module"),
)
# The fusion size budget of PassConfig.default_fi_allreduce_fusion_max_size_mb
# on CPU, where that table (it imports CUDA ops) cannot load.
CPU_FUSION_MAX_SIZE_MB = 64
MiB = 1024 * 1024
# flashinfer/comm/trtllm_mnnvl_ar.py (0.7.2.post1 and 0.7.4) lines 44-51:
# one-shot where tokens * hidden * tp * element size is at most 1 MiB.
MNNVL_ONE_SHOT_THRESHOLD = 64 * 1024 * 8 * 2
# (significand bits, exponent of the smallest normal + 1) per dtype.
_FORMATS = {torch.bfloat16: (8, -125), torch.float16: (11, -13)}
# Past this, x * x overflows fp16 (sqrt(65504) rounds there).
FP16_SQUARE_LIMIT = 255.94


@contextlib.contextmanager
def platform_reads_as_cuda(active: bool) -> Iterator[None]:
    """While a VllmConfig validates on CPU, the platform answers as CUDA's.

    vLLM refuses HiSparse off CUDA and decides the hybrid KV cache manager
    by the platform; only the validation sees these answers, so
    distributed state and ops stay on CPU.
    """
    if not active:
        yield
        return
    from vllm.platforms import current_platform

    platform = type(current_platform)
    answers = {
        "is_cuda": lambda self: True,
        "support_hybrid_kv_cache": classmethod(lambda cls: True),
    }
    saved = {name: platform.__dict__.get(name) for name in answers}
    for name, answer in answers.items():
        setattr(platform, name, answer)
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(platform, name)
            else:
                setattr(platform, name, original)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each of `values` (fp32)."""
    bits, min_exponent = _FORMATS[dtype]
    _, exponent = torch.frexp(values.float())
    return torch.ldexp(
        torch.ones_like(values, dtype=torch.float32),
        exponent.clamp(min=min_exponent) - bits,
    )


def _rms_scale(summed: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrtf(sum(v * v) / hidden + eps) over fp32 values, per token."""
    return torch.rsqrt(summed.pow(2).sum(-1, keepdim=True) / summed.shape[-1] + eps)


def reference(
    reduced32: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float
) -> dict[str, torch.Tensor]:
    """One call's outputs as the kernels compute them, from the group's fp32
    sum of the partial sums and the residual the call was given: the sum
    rounded to the dtype, the residual added and rounded, RMSNorm in fp32."""
    dtype = residual.dtype
    reduced = reduced32.to(dtype)
    summed = (reduced.float() + residual.float()).to(dtype)
    scale = _rms_scale(summed.float(), eps)
    normed = (summed.float() * scale * gamma.float()).to(dtype)
    return {"normed": normed, "residual": summed, "reduced": reduced, "scale": scale}


def near_ties(
    reduced32: torch.Tensor, magnitude: torch.Tensor, ranks: int, dtype: torch.dtype
) -> torch.Tensor:
    """Where the fp32 sum is so near a rounding tie of the dtype that a kernel
    summing the ranks in another fp32 order may round it to the neighbour:
    both sums are within (ranks - 1) fp32 roundings of the exact one, and
    `magnitude` (the group's sum of |partial|) bounds those."""
    reduced = reduced32.to(dtype)
    # Half the spacing below the rounded value (the smaller side at a power
    # of two), less how far the sum is from it.
    below = ulp(reduced.float().abs() * (1 - 2**-12), dtype)
    to_tie = below / 2 - (reduced32 - reduced.float()).abs()
    return to_tie <= 2 * max(ranks - 1, 1) * 2**-24 * magnitude


def allowances(
    ref: dict[str, torch.Tensor], near_tie: torch.Tensor, gamma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How far a correct kernel may be from `reference`, per value.

    Residual: nothing, but near a tie, one unit of the reduced sum (the
    kernel's own fp32 order may round it to the neighbour) plus one of the
    output, which that carries through the residual add's rounding.
    Normed: one unit of the output (the kernels' fp32 sums of squares in
    their own order, rsqrtf, and in 0.7.2.post1's mnnvl one-shot squares
    rounded to the dtype, move the scale by well under half a unit) plus
    the residual's allowance through the norm.
    """
    dtype = ref["residual"].dtype
    flip = ulp(ref["reduced"], dtype) + ulp(ref["residual"], dtype)
    residual = torch.where(near_tie, flip, torch.zeros_like(flip))
    normed = ulp(ref["normed"], dtype) + residual * ref["scale"] * gamma.float().abs()
    return normed, residual


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
    scale = _rms_scale(summed.float(), eps)
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


def overflow_zeroed(
    normed: torch.Tensor, summed: torch.Tensor, want_normed: torch.Tensor
) -> torch.Tensor:
    """Tokens as 0.7.2.post1's fp16 mnnvl one-shot leaves them: all of the
    normed output zero, where a value passed 255.94 and the reference is
    not zero."""
    return (
        (normed == 0).all(-1)
        & (want_normed != 0).any(-1)
        & (summed.float().abs().amax(-1) > FP16_SQUARE_LIMIT)
    )


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


def emulated_kernel(ws: Any, release: str) -> Any:
    """The emulation of the workspace's backend at `release`."""
    if ws.backend == "mnnvl":
        return functools.partial(emulate_mnnvl, release=release)
    return emulate_trtllm


def install_cpu_kernel(op_module: Any, release: str) -> None:
    """Put the emulated kernel where FlashInfer serves the op.

    FlashInfer's workspace constructor is replaced where this build's
    get_fi_ar_workspace calls it, so the decision, the rank agreement and
    the creation vote still run; the op's kernel and its gate are replaced
    in the op's module, keeping every check of vLLM's gate
    (`_can_use_flashinfer`) but the one for a CUDA tensor. The kernel
    gathers every rank's partial sums (in rank order, as the kernels read
    them) and runs the emulation of the backend decided, at `release`.
    """
    fi_ar = importlib.import_module(FI_AR_MODULE)
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tp_group,
    )

    fi_ar.flashinfer_comm.create_allreduce_fusion_workspace = create_reference_workspace
    for module_name, loader in FLASHINFER_KERNEL_LOADERS:
        with contextlib.suppress(ImportError):
            setattr(importlib.import_module(module_name), loader, lambda: None)

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
        partials = [torch.empty_like(allreduce_in) for _ in range(world_size)]
        dist.all_gather(partials, allreduce_in.contiguous(), group=ws.group)
        normed, summed = emulated_kernel(ws, release)(
            partials, residual, rms_gamma, rms_eps, weight_bias=weight_bias
        )
        allreduce_in.copy_(summed)
        norm_out.copy_(normed)

    op_module._can_use_flashinfer = can_use
    op_module.flashinfer_trtllm_fused_allreduce_norm = kernel


def cpu_max_token_num(tp_size: int, hidden: int, dtype: torch.dtype) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    return CPU_FUSION_MAX_SIZE_MB * MiB // (hidden * element_size)
