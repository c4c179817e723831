# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The arithmetic of check_fused_all_reduce.py: reference and tolerance.

`reference` is what every output is checked against: it computes as
FlashInfer's fused kernels do (the reduced sum rounded to the dtype before
the residual is added), and `allowances` is the most a correct kernel can
differ from it. tests/benchmarks/fused_all_reduce_cpu.py emulates the
released kernels from their headers, and the arithmetic tests hold these
to it.
"""

import torch

# (significand bits, exponent of the smallest normal + 1) per dtype.
_FORMATS = {torch.bfloat16: (8, -125), torch.float16: (11, -13)}
# Past this, x * x overflows fp16 (sqrt(65504) rounds there).
FP16_SQUARE_LIMIT = 255.94


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at each of `values` (fp32)."""
    bits, min_exponent = _FORMATS[dtype]
    _, exponent = torch.frexp(values.float())
    return torch.ldexp(
        torch.ones_like(values, dtype=torch.float32),
        exponent.clamp(min=min_exponent) - bits,
    )


def rms_scale(summed: torch.Tensor, eps: float) -> torch.Tensor:
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
    scale = rms_scale(summed.float(), eps)
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
