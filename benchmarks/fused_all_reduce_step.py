# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One shape of check_fused_all_reduce.py: the step a CUDA graph captures.

L layers with the two fused calls of `DeepseekV32DecoderLayer.forward`
(vllm/models/deepseek_v32/nvidia/model.py), the residual each call returns
fed to the next, a GEMM writing each call's partial sums right before it,
and on GPUs HiSparse's host traffic in flight across the calls
(`step_nodes`). Inputs go by call index; each call is checked against the
reference of its input set and of the residual it was given. The same code
runs on CPU, without graphs or traffic. How and why:
docs/contributing/gpu_check.md.
"""

from typing import Any, NamedTuple

import torch
from fused_all_reduce_reference import (
    allowances,
    near_ties,
    overflow_zeroed,
    reference,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Tokens with values past fp16's old one-shot RMSNorm limit (|x| > 255.94).
LARGE_VALUE = 300.0
# Token counts either side of PDL_ADVANCE_LAUNCH_TOKENS (16) in vLLM's op.
PDL_EDGE = (15, 16, 17)
NORMS = ("input_layernorm", "post_attention_layernorm")
# Input sets K: 4 or more and not a multiple of 3.
INPUT_SETS = 5


class Node(NamedTuple):
    """One launch of a step: its stream, what, and for which call or layer."""

    stream: str
    op: str
    number: int


def step_nodes(layers: int, traffic: bool, gemm: bool = True) -> list[Node]:
    """A step's launches in order: per layer, [h2d copy], GEMM, fused call
    (input_layernorm), [gather], GEMM, fused call (post_attention_layernorm),
    [wait for the gather, d2h copy]; at the end [wait for the copies]."""
    nodes = []
    for layer in range(layers):
        if traffic:
            nodes.append(Node("h2d", "h2d", layer))
        for half in range(2):
            call = 2 * layer + half
            if gemm:
                nodes.append(Node("compute", "gemm", call))
            nodes.append(Node("compute", "fused", call))
            if traffic and half == 0:
                nodes.append(Node("copy", "gather", layer))
        if traffic:
            nodes.append(Node("compute", "wait_gather", layer))
            nodes.append(Node("d2h", "d2h", layer))
    if traffic:
        nodes.append(Node("compute", "wait_copies", layers))
    return nodes


def in_flight(nodes: list[Node]) -> dict[int, list[str]]:
    """For each fused call, the host traffic forked before it and not yet
    waited for: what may run while it runs."""
    forked: dict[str, list[str]] = {}
    found = {}
    joins = {"wait_gather": ("copy",), "wait_copies": ("h2d", "d2h")}
    for node in nodes:
        if node.op == "fused":
            found[node.number] = [name for names in forked.values() for name in names]
        elif node.op in joins:
            for stream in joins[node.op]:
                forked.pop(stream, None)
        elif node.stream != "compute":
            forked.setdefault(node.stream, []).append(f"{node.op} {node.number}")
    return found


def token_counts(top: int) -> list[int]:
    """The sweep: powers of two (either side of the one-shot/two-shot switch
    wherever it falls), the PDL edge, and the workspace's top."""
    powers = {2**k for k in range(top.bit_length())}
    return sorted(n for n in {top, *PDL_EDGE, *powers} if 1 <= n <= top)


def largest_fitting(ws: Any, tp_size: int, top: int, hidden: int, dtype: Any) -> int:
    """The most tokens up to `top` that the workspace says it can take."""
    low, high = 0, top
    while low < high:
        mid = (low + high + 1) // 2
        fits = ws.is_buffer_size_sufficient(
            tp_size=tp_size, num_tokens=mid, hidden_dim=hidden, dtype=dtype
        )
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def input_sets(
    rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` sets of this rank's partial sums and of the residual, stacked;
    deterministic. Every fifth token carries values past 256 (the residual,
    so the sum too), every seventh large partial sums; token 10 has both, a
    large reduced sum that the residual cancels."""
    partials, residuals = [], []
    for k in range(count):
        generator = torch.Generator().manual_seed((seed * 100 + k) * 1000 + rank)
        partials.append(torch.randn(tokens, hidden, generator=generator) * 0.5)
        generator = torch.Generator().manual_seed(seed * 100 + k)
        residuals.append(torch.randn(tokens, hidden, generator=generator))
    partial, residual = torch.stack(partials), torch.stack(residuals)
    residual[:, ::5] += LARGE_VALUE
    partial[:, 3::7] *= LARGE_VALUE
    return partial.to(dtype), residual.to(dtype)


def set_index(replay: int, call: int, calls: int, sets: int) -> int:
    """The input set of `call` in `replay`, by the call's index since the
    first replay. Both kernels rotate three Lamport buffers: with a set count
    of 4 or more and not a multiple of 3, a call that reads the buffer of
    any of the three calls before it reads another set's partial sums."""
    return (replay * calls + call) % sets


def check_stats(
    got_normed: torch.Tensor,
    got_residual: torch.Tensor,
    want: dict[str, torch.Tensor],
    known_overflow: bool,
) -> torch.Tensor:
    """Both outputs against their reference, as a (2, 7) tensor on the
    device (nothing here waits for it): per output, bad values, bad tokens,
    the first bad value's flat index, it, the value wanted there, the worst
    error; and for the normed output, the tokens zeroed as by 0.7.2.post1's
    fp16 mnnvl one-shot, counted apart and not as bad with `known_overflow`.
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
        worst = torch.where(bad, error.nan_to_num(nan=float("inf")), 0).amax()
        count = zeroed.sum() if which == "normed" else zeroed.new_zeros(())
        row = [flat.sum(), bad.any(-1).sum(), first, got.flatten()[first]]
        row += [want[which].flatten()[first], worst, count]
        rows.append(torch.stack([value.float() for value in row]))
    return torch.stack(rows)


def percentiles(samples: list[float]) -> dict[str, float | None]:
    ordered = torch.tensor(samples, dtype=torch.float64)
    return {
        f"p{q}": float(ordered.quantile(q / 100)) if samples else None for q in (50, 99)
    }


class Step:
    """One shape: the step's calls, its input sets, its checks. `owner` is
    the rank: `spec`, `rank`, `device`, `traffic` (None on CPU), `fused()`,
    `group_sum()` and `known_overflow()`."""

    def __init__(
        self,
        owner: Any,
        dtype: str,
        hidden: int,
        tokens: int,
        norms: list[Any],
        seed: int,
        fused_only: bool = False,
    ):
        self.owner, self.dtype, self.hidden, self.tokens = owner, dtype, hidden, tokens
        self.norms, self.fused_only = norms, fused_only
        self.eps = norms[0].variance_epsilon
        spec, device = owner.spec, owner.device
        self.calls = 2 * spec["layers"]
        traffic = owner.traffic is not None and not fused_only
        self.nodes = step_nodes(spec["layers"], traffic, gemm=not fused_only)
        torch_dtype = DTYPES[dtype]
        partials, residuals = input_sets(
            owner.rank, tokens, hidden, torch_dtype, seed, spec["input_sets"]
        )
        reduced32, magnitude = owner.group_sum(partials.to(device))
        self.reduced32 = reduced32
        self.near_tie = near_ties(reduced32, magnitude, owner.world_size, torch_dtype)
        self.residuals = residuals.to(device)
        if fused_only:
            self.sources = partials.to(device)
        else:
            # The GEMM multiplies by a permutation, mm(x, weight)[:, j] ==
            # x[:, perm[j]]: a sum of one product and zeros, exact in any
            # order, so its output is the set's partial sums exactly.
            perm = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))
            weight = torch.zeros(hidden, hidden, dtype=torch_dtype)
            weight[perm, torch.arange(hidden)] = 1
            self.weight = weight.to(device)
            self.sources = partials[:, :, torch.argsort(perm)].to(device)
        # What a replay reads: the GEMMs' inputs (or the fused-only step's
        # partial sums) and the first call's residual, loaded before it.
        self.inputs = self.sources.new_empty((self.calls, tokens, hidden))
        self.first_residual = torch.empty_like(self.residuals[0])
        self.known_overflow = owner.known_overflow(dtype)
        self.run = self.forward
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.seconds: list[float] = []

    def set_of(self, replay: int, call: int) -> int:
        return set_index(replay, call, self.calls, len(self.sources))

    def load(self, replay: int) -> None:
        """Put replay `replay`'s input sets where the step reads them."""
        for call in range(self.calls):
            self.inputs[call].copy_(self.sources[self.set_of(replay, call)])
        self.first_residual.copy_(self.residuals[self.set_of(replay, 0)])

    def forward(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's nodes in order; returns each call's two outputs."""
        outputs = []
        residual = self.first_residual
        partial = self.inputs[0]
        for node in self.nodes:
            if node.op == "gemm":
                partial = torch.mm(self.inputs[node.number], self.weight)
            elif node.op == "fused":
                if self.fused_only:
                    partial = self.inputs[node.number]
                norm = self.norms[node.number % 2]
                normed, residual = self.owner.fused(partial, residual, norm)
                outputs.append((normed, residual))
            else:
                getattr(self.owner.traffic, node.op)(node.number)
        return outputs

    def check(
        self, replay: int, outputs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Queue the checks of one replay's outputs; nothing waits. Each
        call's reference takes the residual the call was given: the first
        call's loaded one, then the residual the call before returned."""
        stats, given = [], self.first_residual
        for call, (normed, summed) in enumerate(outputs):
            k = self.set_of(replay, call)
            gamma = self.norms[call % 2].weight
            want = reference(self.reduced32[k], given, gamma, self.eps)
            allowed = allowances(want, self.near_tie[k], gamma)
            want["allow_normed"], want["allow_residual"] = allowed
            stats.append(check_stats(normed, summed, want, self.known_overflow))
            given = summed
        self.pending.append((replay, torch.stack(stats)))

    def drain(self) -> list[dict[str, Any]]:
        """The records of the queued checks (waits for the device)."""
        found = []
        for replay, stats in self.pending:
            for call, rows in enumerate(stats.tolist()):
                for output, row in zip(("normed", "residual"), rows, strict=True):
                    bad, tokens, first, got, want, worst, zeroed = row
                    if not (bad or zeroed):
                        continue
                    found.append(
                        {
                            "replay": replay,
                            "call": f"layer {call // 2} {NORMS[call % 2]}",
                            "layer": call // 2,
                            "input_set": self.set_of(replay, call),
                            "output": output,
                            "zeroed_tokens": int(zeroed),
                            "token": int(first) // self.hidden,
                            "column": int(first) % self.hidden,
                            "got": got,
                            "want": want,
                            "worst_error": worst,
                            "bad_values": int(bad),
                            "bad_tokens": int(tokens),
                        }
                    )
        self.pending = []
        return found
