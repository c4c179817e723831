# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One shape of check_fused_all_reduce.py: the step a CUDA graph captures.

A step is L layers with the fused calls of `DeepseekV32DecoderLayer.forward`
(vllm/models/deepseek_v32/nvidia/model.py): vLLM's `fused_allreduce_rms_norm`
for input_layernorm and post_attention_layernorm, the residual each call
returns fed to the next. Before each call a GEMM writes the call's partial
sums, so a GEMM is the fused kernel's PDL predecessor, as at serve time. The
GEMM multiplies a loaded input by a permutation matrix: its output is exactly
the call's input set (a sum of one product and zeros rounds the same in any
order), so the check knows what every rank gave. It does not compute
attention or an MLP from the normed output.

With host traffic (GPUs only), each layer forks a host-to-device copy at its
start, HiSparse's gather after its first fused call (joined after the
second, so it is in flight across that call) and a device-to-host copy after
its second; the copies are joined at the end of the step. `step_nodes` is
that launch order and `forward` runs it, so the report's node list is what
was captured. A fused-only step holds the fused calls alone, for timing.

Inputs go by call index: call c of replay r takes set (r * 2L + c) mod K.
Both kernels rotate three Lamport buffers, so with K not a multiple of 3 a
call reading any of the last three calls' data reads another set's. Each
call is checked against the reference of its set's group sum and of the
residual it was actually given; the counts wait on the device until the
next synchronize. The same code runs on CPU, without graphs or traffic.
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
# A check's record on the device, per call and output: bad values, bad
# tokens, first bad (flat index), its value, the wanted value, the worst
# error; and, for the normed output, the tokens zeroed as by the known
# fp16 overflow (not counted as bad).
STAT_FIELDS = ("bad", "tokens", "first", "got", "want", "worst", "zeroed")


class Node(NamedTuple):
    """One launch of a step: on which stream, what, and for which call or
    layer."""

    stream: str
    op: str
    index: int


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
            found[node.index] = [name for names in forked.values() for name in names]
        elif node.op in joins:
            for stream in joins[node.op]:
                forked.pop(stream, None)
        elif node.stream != "compute":
            forked.setdefault(node.stream, []).append(f"{node.op} {node.index}")
    return found


def call_name(call: int) -> str:
    return f"layer {call // 2} {NORMS[call % 2]}"


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


def input_sets(
    rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K sets of this rank's partial sums and residuals, stacked."""
    sets = [
        make_inputs(rank, tokens, hidden, dtype, seed * 100 + k) for k in range(count)
    ]
    return torch.stack([p for p, _ in sets]), torch.stack([r for _, r in sets])


def set_index(replay: int, call: int, calls: int, sets: int) -> int:
    """The input set of `call` in `replay`: by the call's index since the
    first replay."""
    return (replay * calls + call) % sets


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
        worst = torch.where(bad, error.nan_to_num(nan=float("inf")), 0).amax()
        count = zeroed.sum() if which == "normed" else zeroed.new_zeros(())
        row = [flat.sum(), bad.any(-1).sum(), first, got.flatten()[first]]
        row += [want[which].flatten()[first], worst, count]
        rows.append(torch.stack([value.float() for value in row]))
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


class Step:
    """One shape: the step's calls, its input sets, its checks.

    `owner` is the rank: `spec`, `rank`, `device`, `traffic` (None on CPU),
    `fused(partial, residual, norm)`, `group_sum(partials)` (the group's
    fp32 sum and sum of magnitudes) and `known_overflow(dtype)`.
    """

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
            # mm(x, weight)[:, j] == x[:, perm[j]]: the inputs are the
            # partial sums with their columns put where the GEMM takes them.
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
                partial = torch.mm(self.inputs[node.index], self.weight)
            elif node.op == "fused":
                if self.fused_only:
                    partial = self.inputs[node.index]
                norm = self.norms[node.index % 2]
                normed, residual = self.owner.fused(partial, residual, norm)
                outputs.append((normed, residual))
            else:
                getattr(self.owner.traffic, node.op)(node.index)
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
                for which, row in zip(("normed", "residual"), rows, strict=True):
                    if row[0] or row[6]:
                        found.append(
                            {
                                "replay": replay,
                                "call": call_name(call),
                                "layer": call // 2,
                                "input_set": self.set_of(replay, call),
                                "output": which,
                                "zeroed_tokens": int(row[6]),
                                **describe_stats(row, self.hidden),
                            }
                        )
        self.pending = []
        return found
