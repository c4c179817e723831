# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One shape of check_fused_all_reduce.py: the step a CUDA graph captures.

L layers with the two fused calls of `DeepseekV32DecoderLayer.forward`
(vllm/models/deepseek_v32/nvidia/model.py), the residual each call returns
fed to the next, a GEMM writing each call's partial sums before it, and on
GPUs HiSparse's host traffic in flight across the calls (`step_nodes`).
Input sets go by Lamport slot (`Rotation`); each call is checked against
the reference of its set and of the residual it was given. The same code
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
NORMS = ("input_layernorm", "post_attention_layernorm")
# Input sets K: 4 or more and not a multiple of 3.
INPUT_SETS = 5


class Node(NamedTuple):
    """One launch of a step: its stream, what, and for which call or layer."""

    stream: str
    op: str
    number: int


def step_nodes(layers: int, traffic: bool) -> list[Node]:
    """A step's launches in order: per fused call, [its h2d and d2h copies],
    a GEMM, the call; after each layer's first call [the gather] and after
    its second [the wait for it]; at the end [the wait for the copies]."""
    nodes = []
    for call in range(2 * layers):
        if traffic:
            nodes += [Node("h2d", "h2d", call), Node("d2h", "d2h", call)]
        nodes += [Node("compute", "gemm", call), Node("compute", "fused", call)]
        if traffic:
            after = ("copy", "gather") if call % 2 == 0 else ("compute", "wait_gather")
            nodes.append(Node(*after, call // 2))
    if traffic:
        nodes.append(Node("compute", "wait_copies", layers))
    return nodes


def token_counts(top: int) -> list[int]:
    """The sweep: powers of two (either side of the one-shot/two-shot switch
    wherever it falls) and the workspace's top."""
    return sorted({top, *(2**k for k in range(top.bit_length()))})


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
    deterministic, and seeded by token count too: no set is a prefix of
    another shape's. Every fifth token carries values past 256 (the
    residual, so the sum too), every seventh large partial sums; token 10
    has both, a large reduced sum that the residual cancels."""
    partials, residuals = [], []
    for k in range(count):
        base = ((seed * 100 + k) * 100_000 + tokens) * 1000
        generator = torch.Generator().manual_seed(base + rank)
        partials.append(torch.randn(tokens, hidden, generator=generator) * 0.5)
        generator = torch.Generator().manual_seed(base + 999)
        residuals.append(torch.randn(tokens, hidden, generator=generator))
    partial, residual = torch.stack(partials), torch.stack(residuals)
    residual[:, ::5] += LARGE_VALUE
    partial[:, 3::7] *= LARGE_VALUE
    return partial.to(dtype), residual.to(dtype)


def slot_advance(backend: str, oneshot: bool) -> int:
    """The Lamport buffer slots one fused call moves its workspace's flag
    on; each kernel rotates three buffers. trtllm: one-shot once, two-shot
    never (`LamportComm::update`, trtllm_allreduce_fusion.cuh, is one-shot
    only). mnnvl: one-shot once, two-shot twice (its all-reduce and its
    RMSNorm kernel each call `LamportFlags::waitAndUpdate`,
    trtllm_mnnvl_allreduce.cuh lines 1334 and 1546 in 0.7.2.post1)."""
    if backend == "mnnvl":
        return 1 if oneshot else 2
    return int(oneshot)


class Rotation:
    """Input sets by Lamport slot over a workspace's life, warm-ups and
    every shape's replays in the order they run: a call that moves the flag
    takes the set of its first slot, so a call reading any buffer of the
    three slots before it reads another set (sets: 4 or more, not a multiple
    of 3, and every set differs across shapes). Calls that take no slot go
    by call count."""

    def __init__(self, sets: int, slots: int = 0):
        self.sets, self.slots, self.calls = sets, slots, 0

    def take(self, advance: int) -> int:
        position = self.slots if advance else self.calls
        self.slots, self.calls = self.slots + advance, self.calls + 1
        return position % self.sets


def overlap_share(
    calls: list[tuple[float, float]], traffic: list[tuple[float, float]]
) -> tuple[float, float]:
    """Of the fused calls' (start, end) spans, the time with any traffic
    span in flight, and their whole time."""
    covered = total = 0.0
    for start, end in calls:
        total += end - start
        cuts = sorted((max(s, start), min(e, end)) for s, e in traffic if s < end)
        reach = start
        for s, e in cuts:
            covered += max(0.0, e - max(s, reach))
            reach = max(reach, e)
    return covered, total


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


class Step:
    """One shape: the step's calls, its input sets, its checks. `owner` is
    the rank: `spec`, `rank`, `device`, `traffic` (None on CPU), `backend`,
    `fused()`, `oneshot()`, `group_sum()` and `known_overflow()`."""

    def __init__(
        self, owner: Any, dtype: str, hidden: int, tokens: int, norms: list, seed: int
    ):
        self.owner, self.dtype, self.hidden, self.tokens = owner, dtype, hidden, tokens
        self.norms, self.eps = norms, norms[0].variance_epsilon
        spec, device = owner.spec, owner.device
        self.calls = 2 * spec["layers"]
        self.nodes = step_nodes(spec["layers"], owner.traffic is not None)
        torch_dtype = DTYPES[dtype]
        partials, residuals = input_sets(
            owner.rank, tokens, hidden, torch_dtype, seed, spec["input_sets"]
        )
        reduced32, magnitude = owner.group_sum(partials.to(device))
        self.reduced32 = reduced32
        self.near_tie = near_ties(reduced32, magnitude, owner.world_size, torch_dtype)
        self.residuals = residuals.to(device)
        # The GEMM multiplies by a permutation, mm(x, weight)[:, j] ==
        # x[:, perm[j]]: a sum of one product and zeros, exact in any
        # order, so its output is the set's partial sums exactly. On CPU,
        # where an fp16 GEMM takes seconds, the permutation alone.
        perm = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))
        self.perm, self.weight = perm.to(device), None
        if device.type == "cuda":
            weight = torch.zeros(hidden, hidden, dtype=torch_dtype)
            weight[perm, torch.arange(hidden)] = 1
            self.weight = weight.to(device)
        self.sources = partials[:, :, torch.argsort(perm)].to(device)
        # What a replay reads: the GEMMs' inputs and the first call's
        # residual, loaded before it.
        self.inputs = self.sources.new_empty((self.calls, tokens, hidden))
        self.first_residual = torch.empty_like(self.residuals[0])
        self.known_overflow = owner.known_overflow(dtype)
        oneshot = owner.oneshot(tokens, hidden, torch_dtype)
        self.advance = slot_advance(owner.backend, oneshot)
        self.run = self.forward
        self.pending: list[tuple[int, list[int], torch.Tensor]] = []
        self.overlap = [0.0, 0.0]  # traffic-covered and whole fused-call time

    def load(self, rotation: Rotation) -> list[int]:
        """Put the next run's input sets, taken from `rotation` in the order
        the calls run, where the step reads them; returns them."""
        sets = [rotation.take(self.advance) for _ in range(self.calls)]
        for call, k in enumerate(sets):
            self.inputs[call].copy_(self.sources[k])
        self.first_residual.copy_(self.residuals[sets[0]])
        return sets

    def forward(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's nodes in order; returns each call's two outputs. With
        traffic, each fused call is timed on the GPU."""
        outputs = []
        residual, traffic = self.first_residual, self.owner.traffic
        if traffic is not None:
            traffic.begin()
        for node in self.nodes:
            if node.op == "gemm":
                x = self.inputs[node.number]
                w = self.weight
                partial = x.index_select(1, self.perm) if w is None else torch.mm(x, w)
            elif node.op == "fused":
                norm = self.norms[node.number % 2]
                args = (partial, residual, norm)
                if traffic is not None:
                    normed, residual = traffic.timed("fused", self.owner.fused, *args)
                else:
                    normed, residual = self.owner.fused(*args)
                outputs.append((normed, residual))
            else:
                getattr(traffic, node.op)(node.number)
        return outputs

    def check(
        self, replay: int, sets: list[int], outputs: list[tuple[Any, Any]]
    ) -> None:
        """Queue the checks of one replay's outputs; nothing waits. Each
        call's reference takes the residual the call was given: the first
        call's loaded one, then the residual the call before returned."""
        stats, given = [], self.first_residual
        for call, (normed, summed) in enumerate(outputs):
            k = sets[call]
            gamma = self.norms[call % 2].weight
            want = reference(self.reduced32[k], given, gamma, self.eps)
            allowed = allowances(want, self.near_tie[k], gamma)
            want["allow_normed"], want["allow_residual"] = allowed
            stats.append(check_stats(normed, summed, want, self.known_overflow))
            given = summed
        self.pending.append((replay, sets, torch.stack(stats)))

    def drain(self) -> list[dict[str, Any]]:
        """The records of the queued checks (waits for the device)."""
        found = []
        for replay, sets, stats in self.pending:
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
                            "input_set": sets[call],
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
