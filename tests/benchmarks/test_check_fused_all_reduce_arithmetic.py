# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused all-reduce check's arithmetic, against the kernels' own.

tests/benchmarks/fused_all_reduce_cpu.py emulates the released trtllm and
mnnvl kernels from their headers; the check must accept those emulations at
every shape and dtype it sweeps, reject one wrong value just past its
allowance, and tell 0.7.2.post1's fp16 one-shot overflow apart from a
mismatch. In-process, on CPU, without torch.distributed: the group's fp32
sum is taken in the other order than the kernels', as NCCL may take it.
"""

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
EPS = 1e-6
HIDDEN_SIZES = (7168, 6144)
# The CPU sweep (top 64), and 128: two-shot for mnnvl at TP 2.
TOP_TOKENS = 128
EMULATIONS = ("trtllm", "mnnvl 0.7.2.post1", "mnnvl 0.7.4")


def _load(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


ref = _load("fused_all_reduce_reference")
step = _load("fused_all_reduce_step")
cpu = _load("fused_all_reduce_cpu")


def _case(tp: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """The ranks' partials, the residual, gamma, and the check's reference
    with its allowances, as a Step builds them."""
    inputs = [step.input_sets(r, tokens, hidden, dtype, seed, 1) for r in range(tp)]
    partials = [p[0] for p, _ in inputs]
    residual = inputs[0][1][0]
    gamma = (
        1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    ).to(dtype)
    reduced32 = partials[-1].float()
    for partial in reversed(partials[:-1]):
        reduced32 = reduced32 + partial.float()
    magnitude = sum(p.float().abs() for p in partials)
    want = ref.reference(reduced32, residual, gamma, EPS)
    near_tie = ref.near_ties(reduced32, magnitude, tp, dtype)
    want["allow_normed"], want["allow_residual"] = ref.allowances(want, near_tie, gamma)
    return partials, residual, gamma, want


def _emulate(name: str, partials, residual, gamma):
    if name == "trtllm":
        return cpu.emulate_trtllm(partials, residual, gamma, EPS)
    return cpu.emulate_mnnvl(partials, residual, gamma, EPS, release=name.split()[1])


def _stats(normed, summed, want, known_overflow: bool) -> dict[str, list[float]]:
    rows = step.check_stats(normed, summed, want, known_overflow).tolist()
    return {"normed": rows[0], "residual": rows[1]}


@pytest.mark.parametrize("emulation", EMULATIONS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_check_accepts_the_kernels_arithmetic_at_every_shape(
    emulation: str, dtype: str
) -> None:
    torch_dtype = step.DTYPES[dtype]
    # 0.7.2.post1's zeroed fp16 tokens are a finding, not a mismatch.
    known = emulation == "mnnvl 0.7.2.post1" and dtype == "fp16"
    for hidden in HIDDEN_SIZES:
        for tokens in step.token_counts(TOP_TOKENS):
            partials, residual, gamma, want = _case(2, tokens, hidden, torch_dtype)
            normed, summed = _emulate(emulation, partials, residual, gamma)
            stats = _stats(normed, summed, want, known)
            shape = (emulation, dtype, hidden, tokens)
            assert stats["normed"][0] == 0 and stats["residual"][0] == 0, shape


@pytest.mark.parametrize("tp", [4, 8])
def test_more_ranks_are_accepted_too(tp: int) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        partials, residual, gamma, want = _case(tp, 17, 6144, dtype)
        for emulation in ("trtllm", "mnnvl 0.7.4"):
            normed, summed = _emulate(emulation, partials, residual, gamma)
            stats = _stats(normed, summed, want, False)
            assert stats["normed"][0] == stats["residual"][0] == 0, (tp, emulation)


def test_the_unrounded_reference_would_reject_a_correct_kernel() -> None:
    """What the CPU stand-in (the trtllm emulation) gives differs from the
    fp32 sum, unrounded, by far more than the old few ulps of that sum at
    token 10, where a +300 residual cancels a large reduced sum: the check
    must round as the kernels do to accept it."""
    partials, residual, gamma, want = _case(2, 11, 7168, torch.bfloat16)
    _, summed = cpu.emulate_trtllm(partials, residual, gamma, EPS)
    unrounded = sum(p.float() for p in partials) + residual.float()
    error = (summed.float() - unrounded).abs()
    old_allowance = 2**-6 + 2**-6 * unrounded.abs()
    assert bool((error[10] > old_allowance[10]).any())
    assert error[10].max() > 1
    assert (
        _stats(*cpu.emulate_trtllm(partials, residual, gamma, EPS), want, False)[
            "residual"
        ][0]
        == 0
    )


def _step_away(value: torch.Tensor, steps: int) -> torch.Tensor:
    """`value` moved `steps` representable values of its dtype upwards."""
    for _ in range(steps):
        value = torch.nextafter(value, torch.tensor(float("inf"), dtype=value.dtype))
    return value


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("output, steps", [("normed", 2), ("residual", 1)])
def test_one_value_off_by_a_few_units_is_rejected(
    dtype: str, output: str, steps: int
) -> None:
    """The kernels round the residual output exactly as the reference does,
    so one unit off is wrong; the normed output may be one unit off, so
    two units off is wrong. Counted in the dtype's own values (nextafter),
    not by the check's own `ulp`."""
    torch_dtype = step.DTYPES[dtype]
    partials, residual, gamma, want = _case(2, 17, 6144, torch_dtype)
    outputs = dict(
        zip(
            ("normed", "residual"),
            cpu.emulate_trtllm(partials, residual, gamma, EPS),
            strict=True,
        )
    )
    for token, column in ((1, 7), (10, 3)):  # an ordinary token, a cancelling one
        assert not bool(want["allow_residual"][token, column])
        wrong = {k: v.clone() for k, v in outputs.items()}
        value = wrong[output][token, column].clone()
        wrong[output][token, column] = _step_away(value, steps)
        stats = _stats(wrong["normed"], wrong["residual"], want, False)[output]
        assert stats[0] == 1 and stats[1] == 1, (token, stats)
        assert int(stats[2]) == token * 6144 + column
    # And one unit off in the normed output is what a kernel may do.
    wrong = {k: v.clone() for k, v in outputs.items()}
    wrong["normed"][1, 7] = _step_away(wrong["normed"][1, 7].clone(), 1)
    assert _stats(wrong["normed"], wrong["residual"], want, False)["normed"][0] == 0


def test_the_fp16_overflow_is_counted_apart_from_mismatches() -> None:
    partials, residual, gamma, want = _case(2, 16, 7168, torch.float16)
    normed, summed = cpu.emulate_mnnvl(
        partials, residual, gamma, EPS, release="0.7.2.post1"
    )
    past = int((summed.float().abs().amax(-1) > ref.FP16_SQUARE_LIMIT).sum())
    assert past > 0
    as_issue = _stats(normed, summed, want, True)
    assert as_issue["normed"][0] == 0 and as_issue["normed"][6] == past
    # Where the issue does not apply (trtllm), the same tokens are mismatches.
    as_mismatch = _stats(normed, summed, want, False)
    assert as_mismatch["normed"][1] == past and as_mismatch["normed"][6] == 0
    # 0.7.4 squares in fp32: nothing zeroed.
    fixed = cpu.emulate_mnnvl(partials, residual, gamma, EPS, release="0.7.4")
    assert _stats(*fixed, want, True)["normed"][6] == 0
    # A token zeroed where no value passed 255.94 is a mismatch, not the issue.
    small = normed.clone()
    ordinary = int(
        (summed.float().abs().amax(-1) <= ref.FP16_SQUARE_LIMIT).nonzero()[0]
    )
    small[ordinary] = 0
    assert _stats(small, summed, want, True)["normed"][1] == 1


def test_another_input_sets_outputs_are_rejected() -> None:
    """A stale slot (last replay's outputs, of another input set) fails."""
    _, _, _, want = _case(2, 8, 6144, torch.bfloat16, seed=1)
    partials, residual, gamma, _ = _case(2, 8, 6144, torch.bfloat16, seed=2)
    stale = cpu.emulate_trtllm(partials, residual, gamma, EPS)
    stats = _stats(*stale, want, False)
    assert stats["normed"][1] == 8 and stats["residual"][1] == 8


def test_an_unwritten_output_fails() -> None:
    """Between replays the rank fills each normed output with NaN; NaN is
    never within tolerance."""
    partials, residual, gamma, want = _case(2, 4, 6144, torch.bfloat16)
    _, summed = cpu.emulate_trtllm(partials, residual, gamma, EPS)
    poisoned = torch.full_like(summed, float("nan"))
    assert _stats(poisoned, summed, want, False)["normed"][0] == poisoned.numel()
