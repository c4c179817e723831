# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The captured step of benchmarks/check_fused_all_reduce.py, on CPU.

Its launch order (host traffic in flight across the fused calls, a GEMM
right before each), that `forward` runs exactly that order, and that inputs
taken by call index make a kernel reading an earlier call's Lamport buffer
fail on every layer. In-process: rank 0 of a two-rank group whose peer's
partial sums are known, with the trtllm kernel's emulation.
"""

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
cpu = importlib.import_module("fused_all_reduce_cpu")
step = importlib.import_module("fused_all_reduce_step")
Node = step.Node
DTYPE = torch.bfloat16


def test_every_fused_call_runs_with_host_traffic_in_flight() -> None:
    nodes = step.step_nodes(8, traffic=True)
    flight = step.in_flight(nodes)
    assert sorted(flight) == list(range(16))
    for call, names in flight.items():
        layer = call // 2
        assert f"h2d {layer}" in names, call
        if call % 2:  # the gather forked after the layer's first call
            assert f"gather {layer}" in names, call
        if layer:
            assert f"d2h {layer - 1}" in names, call
    compute = [n for n in nodes if n.stream == "compute"]
    for before, node in zip(compute, compute[1:], strict=False):
        if node.op == "fused":  # its PDL predecessor is its GEMM
            assert before == Node("compute", "gemm", node.number), node
    assert nodes[-1] == Node("compute", "wait_copies", 8)
    # Without traffic, and in the fused-only step, only the calls.
    assert step.in_flight(step.step_nodes(2, traffic=False)) == {
        c: [] for c in range(4)
    }
    assert [n.op for n in step.step_nodes(1, False, gemm=False)] == ["fused"] * 2


class TwoRanks:
    """Rank 0 of a two-rank group, in one process. The kernel is the trtllm
    emulation over what the call's Lamport buffer holds: this call's
    partial sums of both ranks, or with `lag` those of `lag` calls before."""

    def __init__(self, tokens: int, hidden: int, layers: int, sets: int, lag: int):
        self.spec = {"layers": layers, "input_sets": sets}
        self.rank, self.world_size, self.device = 0, 2, torch.device("cpu")
        self.traffic: Any = None
        self.own = step.input_sets(0, tokens, hidden, DTYPE, 0, sets)[0]
        self.peer = step.input_sets(1, tokens, hidden, DTYPE, 0, sets)[0]
        self.lag = lag
        self.buffers: list[list[torch.Tensor]] = []
        self.launched: list[tuple[str, int]] = []

    def group_sum(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine, peer = partials.float(), self.peer.float()
        return mine + peer, mine.abs() + peer.abs()

    def known_overflow(self, dtype: str) -> bool:
        return False

    def fused(self, partial: torch.Tensor, residual: torch.Tensor, norm: Any) -> Any:
        self.launched.append(("fused", len(self.buffers)))
        k = next(k for k, own in enumerate(self.own) if torch.equal(own, partial))
        self.buffers.append([partial.clone(), self.peer[k]])
        read = self.buffers[-1 - min(self.lag, len(self.buffers) - 1)]
        normed, summed = cpu.emulate_trtllm(
            read, residual, norm.weight, norm.variance_epsilon
        )
        partial.copy_(summed)
        return normed, partial


def _norms(hidden: int) -> list[Any]:
    gammas = 1 + 0.1 * torch.randn(
        2, hidden, generator=torch.Generator().manual_seed(1)
    )
    return [SimpleNamespace(weight=g.to(DTYPE), variance_epsilon=1e-6) for g in gammas]


def flagged_calls_per_layer(
    lag: int, layers: int = 8, sets: int = 5, replays: int = 3
) -> list[int]:
    """Calls with a mismatch, per layer, over replays 1.. (replay 0 fills
    the buffers), with the step's own indexing and check."""
    owner = TwoRanks(4, 64, layers, sets, lag)
    checked = step.Step(owner, "bf16", 64, 4, _norms(64), seed=0)
    flagged = [0] * layers
    for replay in range(replays):
        checked.load(replay)
        checked.check(replay, checked.forward())
        calls = {(r["replay"], r["call"]) for r in checked.drain() if replay}
        for _, call in calls:
            flagged[int(call.split()[1])] += 1
    return flagged


def test_the_step_accepts_the_kernel_with_the_residual_chained() -> None:
    assert flagged_calls_per_layer(lag=0) == [0] * 8


@pytest.mark.parametrize("lag, sets", [(3, 4), (3, 5), (3, 7), (1, 5), (2, 4)])
def test_a_read_of_an_earlier_lamport_buffer_fails_on_every_layer(
    lag: int, sets: int
) -> None:
    """Both kernels rotate three Lamport buffers: a call that reads one
    holding an earlier call's partial sums (three calls back: a stale slot)
    must mismatch on every call of every layer, for any set count the
    check accepts (4 or more, not a multiple of 3)."""
    assert flagged_calls_per_layer(lag, sets=sets) == [2 * 2] * 8


class Recorder:
    """Host traffic that only notes what the step asks of it."""

    def __init__(self, log: list[tuple[str, int]]):
        self.log = log

    def __getattr__(self, op: str) -> Any:
        return lambda index: self.log.append((op, index))


def test_the_step_launches_its_nodes_in_order() -> None:
    owner = TwoRanks(4, 64, 2, 5, lag=0)
    owner.traffic = Recorder(owner.launched)
    launched = step.Step(owner, "bf16", 64, 4, _norms(64), seed=0)
    launched.load(0)
    launched.forward()
    want = [(n.op, n.number) for n in launched.nodes if n.op != "gemm"]
    assert owner.launched == want and ("gather", 1) in want
