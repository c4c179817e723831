# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One shape of check_fused_all_reduce.py: a step like a DSA model's forward.

A `Step` holds L layers, each as `DeepseekV32DecoderLayer.forward` runs its
fused all-reduce + RMSNorm: vLLM's `fused_allreduce_rms_norm` on the layer's
partial sums, HiSparse's host gather forked on a copy stream (GPUs only), a
GEMM the size of the layer's projection on the normed output, and the
gather joined before the next layer. K input sets rotate through the
layers' static buffers, each layer's outputs are checked on the device
against the reference of the set it got, and the counts wait on the device
until the next synchronize. The same code runs on CPU, without graphs.
"""

from collections.abc import Callable
from typing import Any

import torch
from fused_all_reduce_reference import allowances, kernel_reference, overflow_zeroed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Tokens with values past fp16's old one-shot RMSNorm limit (|x| > 255.94).
LARGE_VALUE = 300.0
# Token counts either side of PDL_ADVANCE_LAUNCH_TOKENS (16) in vLLM's op.
PDL_EDGE = (15, 16, 17)
# A check's record on the device, per layer and output: bad values, bad
# tokens, first bad (flat index), its value, the wanted value, the worst
# error; and, for the normed output, the tokens zeroed as by the known
# fp16 overflow (not counted as bad).
STAT_FIELDS = ("bad", "tokens", "first", "got", "want", "worst", "zeroed")


def token_counts(top: int) -> list[int]:
    """The sweep: powers of two (either side of the one-shot/two-shot switch
    wherever it falls), the PDL edge, and the workspace's top."""
    counts = {top, *PDL_EDGE}
    power = 1
    while power <= top:
        counts.add(power)
        power *= 2
    return sorted(c for c in counts if 1 <= c <= top)


def largest_fitting(ws: Any, tp_size: int, top: int, hidden: int, dtype: Any) -> int:
    """The most tokens up to `top` that the workspace says it can take."""
    low, high = 0, top
    while low < high:
        mid = (low + high + 1) // 2
        if ws.is_buffer_size_sufficient(
            tp_size=tp_size, num_tokens=mid, hidden_dim=hidden, dtype=dtype
        ):
            low = mid
        else:
            high = mid - 1
    return low


def make_inputs(
    rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial sums and the residual, both deterministic.

    Every fifth token carries values past 256 (the residual, so the sum
    too), every seventh large partial sums; token 10 has both, a large
    reduced sum that the residual cancels.
    """
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    partial = torch.randn(tokens, hidden, generator=generator) * 0.5
    residual = torch.randn(
        tokens, hidden, generator=torch.Generator().manual_seed(seed)
    )
    residual[::5] += LARGE_VALUE
    partial[3::7] *= LARGE_VALUE
    return partial.to(dtype), residual.to(dtype)


def check_stats(
    got_normed: torch.Tensor,
    got_residual: torch.Tensor,
    want: dict[str, torch.Tensor],
    known_overflow: bool,
) -> torch.Tensor:
    """Both outputs against their reference, as a (2, 7) tensor on the
    device: nothing here waits for the device.

    With `known_overflow`, tokens zeroed as by 0.7.2.post1's fp16 mnnvl
    one-shot are counted apart and not as bad.
    """
    zeroed = overflow_zeroed(got_normed, got_residual, want["normed"])
    if not known_overflow:
        zeroed = torch.zeros_like(zeroed)
    rows = []
    for got, which in ((got_normed, "normed"), (got_residual, "residual")):
        error = (got.float() - want[which].float()).abs()
        bad = ~(error <= want[f"allow_{which}"])  # NaN is bad
        if which == "normed":
            bad &= ~zeroed[:, None]
        flat = bad.flatten()
        first = torch.argmax(flat.to(torch.uint8))
        rows.append(
            torch.stack(
                [
                    flat.sum().float(),
                    bad.any(-1).sum().float(),
                    first.float(),
                    got.flatten()[first].float(),
                    want[which].flatten()[first].float(),
                    torch.where(bad, error.nan_to_num(nan=float("inf")), 0).amax(),
                    zeroed.sum().float() if which == "normed" else zeroed.new_zeros(()),
                ]
            )
        )
    return torch.stack(rows)


def describe_stats(row: list[float], hidden: int) -> dict[str, Any]:
    """A bad output's record, as the launcher reports it."""
    first = int(row[2])
    return {
        "token": first // hidden,
        "column": first % hidden,
        "got": row[3],
        "want": row[4],
        "worst_error": row[5],
        "bad_values": int(row[0]),
        "bad_tokens": int(row[1]),
    }


def percentiles(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p99": None}
    ordered = torch.tensor(sorted(samples), dtype=torch.float64)
    return {
        "p50": float(torch.quantile(ordered, 0.5)),
        "p99": float(torch.quantile(ordered, 0.99)),
    }


class PoisonedTorch:
    """`torch` for vLLM's op module: its `empty_like` (the op's norm_out)
    comes filled with NaN, so an output the kernel never wrote fails; in a
    graph the fill is captured right before the kernel."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty_like(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full_like(tensor, float("nan"), **kwargs)


class Step:
    """One shape: L layers of the op, K input sets, checks on the device."""

    def __init__(
        self, owner: Any, dtype: str, hidden: int, tokens: int, norm: Any, seed: int
    ):
        self.owner = owner
        self.dtype = dtype
        self.hidden = hidden
        self.tokens = tokens
        self.norm = norm
        spec, device = owner.spec, owner.device
        self.layers = spec["layers"]
        torch_dtype = DTYPES[dtype]
        self.sets = [
            self._input_set(seed * 100 + k, torch_dtype)
            for k in range(spec["input_sets"])
        ]
        self.partials = [
            torch.empty_like(self.sets[0]["partial"]) for _ in range(self.layers)
        ]
        self.residuals = [
            torch.empty_like(self.sets[0]["residual"]) for _ in range(self.layers)
        ]
        weight = torch.Generator().manual_seed(seed)
        self.projection = (
            torch.randn(spec["gemm_columns"], hidden, generator=weight) * hidden**-0.5
        ).to(device=device, dtype=torch_dtype)
        self.gemm_out: list[torch.Tensor] = []
        self.known_overflow = owner.known_overflow(dtype)
        self.run: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] = self.forward
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.step_seconds: list[float] = []
        self.calls = 0
        self.fused_seconds = 0.0
        self.check_seconds = 0.0

    def _input_set(self, seed: int, dtype: torch.dtype) -> dict[str, Any]:
        owner = self.owner
        partial, residual = make_inputs(
            owner.rank, self.tokens, self.hidden, dtype, seed
        )
        partial, residual = partial.to(owner.device), residual.to(owner.device)
        want = kernel_reference(
            partial,
            residual,
            self.norm.weight,
            self.norm.variance_epsilon,
            owner.tp_group.device_group,
        )
        want["allow_normed"], want["allow_residual"] = allowances(
            want, self.norm.weight
        )
        return {"partial": partial, "residual": residual, "want": want}

    def set_of(self, replay: int, layer: int) -> dict[str, Any]:
        return self.sets[(replay + layer) % len(self.sets)]

    def load(self, replay: int) -> None:
        """Put replay `replay`'s input sets in the layers' static buffers."""
        for layer in range(self.layers):
            chosen = self.set_of(replay, layer)
            self.partials[layer].copy_(chosen["partial"])
            self.residuals[layer].copy_(chosen["residual"])

    def forward(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The L layers, as captured; returns each layer's two outputs."""
        gather = self.owner.gather
        outputs = []
        self.gemm_out = []
        for layer in range(self.layers):
            outputs.append(
                self.owner.fused(self.partials[layer], self.residuals[layer], self.norm)
            )
            if gather is not None:
                gather.fork()
            self.gemm_out.append(
                torch.nn.functional.linear(outputs[-1][0], self.projection)
            )
            if gather is not None:
                gather.join()
        return outputs

    def check(
        self, replay: int, outputs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Queue the checks of one replay's outputs; nothing waits."""
        stats = torch.stack(
            [
                check_stats(
                    normed,
                    summed,
                    self.set_of(replay, layer)["want"],
                    self.known_overflow,
                )
                for layer, (normed, summed) in enumerate(outputs)
            ]
        )
        self.pending.append((replay, stats))

    def drain(self) -> list[dict[str, Any]]:
        """The records of the queued checks (waits for the device)."""
        found = []
        for replay, stats in self.pending:
            for layer, rows in enumerate(stats.tolist()):
                for which, row in zip(("normed", "residual"), rows, strict=True):
                    if row[0] or row[6]:
                        found.append(
                            {
                                "replay": replay,
                                "layer": layer,
                                "input_set": (replay + layer) % len(self.sets),
                                "output": which,
                                "zeroed_tokens": int(row[6]),
                                **describe_stats(row, self.hidden),
                            }
                        )
        self.pending = []
        return found

    def latency(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "step": percentiles(self.step_seconds),
            "fused_calls": self.calls,
            "fused_calls_per_second": (
                self.calls / self.fused_seconds if self.fused_seconds else None
            ),
        }
