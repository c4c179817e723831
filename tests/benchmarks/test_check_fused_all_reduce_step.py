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


def test_every_fused_call_has_its_own_traffic_forked_before_it() -> None:
    nodes = step.step_nodes(8, traffic=True)
    compute = [n for n in nodes if n.stream == "compute"]
    for call in range(16):
        at = nodes.index(Node("compute", "fused", call))
        assert nodes[at - 3 : at] == [
            Node("h2d", "h2d", call),
            Node("d2h", "d2h", call),
            Node("compute", "gemm", call),
        ], call
        if call % 2 == 0:  # the layer's gather runs across its second call
            assert nodes[at + 1] == Node("copy", "gather", call // 2)
            wait = nodes.index(Node("compute", "wait_gather", call // 2))
            assert wait > nodes.index(Node("compute", "fused", call + 1))
    assert nodes[-1] == Node("compute", "wait_copies", 8)
    assert [n.op for n in compute if n.op in ("gemm", "fused")] == [
        "gemm",
        "fused",
    ] * 16
    assert [n.op for n in step.step_nodes(2, False)] == ["gemm", "fused"] * 4


def test_overlap_share_counts_the_union_inside_each_call() -> None:
    calls = [(0.0, 10.0), (20.0, 30.0)]
    traffic = [(-5.0, 2.0), (1.0, 4.0), (8.0, 12.0), (25.0, 26.0), (40.0, 50.0)]
    assert step.overlap_share(calls, traffic) == (4.0 + 2.0 + 1.0, 20.0)
    assert step.overlap_share(calls, []) == (0.0, 20.0)


class TwoRanks:
    """Rank 0 of a two-rank group, in one process. The kernel is the trtllm
    emulation over what the call's Lamport buffer holds: this call's
    partial sums of both ranks, or with `lag` those of `lag` calls before."""

    def __init__(self, tokens: int, hidden: int, layers: int, sets: int, lag: int):
        self.spec = {"layers": layers, "input_sets": sets}
        self.rank, self.world_size, self.device = 0, 2, torch.device("cpu")
        self.traffic: Any = None
        self.backend = "trtllm"
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

    def oneshot(self, *shape: Any) -> bool:
        return True

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
    rotation = step.Rotation(sets)
    flagged = [0] * layers
    for replay in range(replays):
        checked.check(replay, checked.load(rotation), checked.forward())
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

    def begin(self) -> None:
        self.log.append(("begin", -1))

    def timed(self, kind: str, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def __getattr__(self, op: str) -> Any:
        return lambda index: self.log.append((op, index))


def test_the_step_launches_its_nodes_in_order() -> None:
    owner = TwoRanks(4, 64, 2, 5, lag=0)
    owner.traffic = Recorder(owner.launched)
    launched = step.Step(owner, "bf16", 64, 4, _norms(64), seed=0)
    launched.load(step.Rotation(5))
    launched.forward()
    want = [(n.op, n.number) for n in launched.nodes if n.op != "gemm"]
    want = [("begin", -1)] + want
    assert owner.launched == want and ("gather", 1) in want


# TP 8, hidden 7168, bf16 on sm100: vLLM's one-shot limit for trtllm there
# (_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB, 1 MiB) and FlashInfer's for mnnvl.
ONESHOT = {
    "trtllm": lambda tokens: tokens * 7168 * 2 <= 1024 * 1024,
    "mnnvl": lambda tokens: tokens * 7168 * 8 * 2 <= cpu.MNNVL_ONE_SHOT_THRESHOLD,
}


def lamport_runs(backend: str, replays_per_sync: int = 16, rounds: int = 3):
    """A GPU rank's fused calls over one workspace, in the order they run:
    the probe, each step's warm-up, then bursts round-robin; per call its
    step, input set (from the module's Rotation), first slot and slots."""
    calls, sweep = 16, step.token_counts(2048)
    rotation = step.Rotation(step.INPUT_SETS, slots=1)
    runs = [("probe", -1, 0, 1)]
    order = list(sweep) + [n for _ in range(rounds) for n in sweep]
    for turn, tokens in enumerate(order):
        advance = step.slot_advance(backend, ONESHOT[backend](tokens))
        for _ in range(1 if turn < len(sweep) else replays_per_sync):
            for _ in range(calls):
                slot = rotation.slots
                runs.append((tokens, rotation.take(advance), slot, advance))
    return runs


def same_set_cases(runs: list) -> int:
    """Calls that read a buffer of the three slots before theirs written
    by a call of the same input set, whatever its step."""
    cases = 0
    for i, (_, k, slot, advance) in enumerate(runs):
        for _, j, start, took in reversed(runs[:i] if advance else []):
            if took and start + took <= slot - 3:
                break  # slots only grow: nothing earlier is near
            cases += bool(took and j == k)
    return cases


@pytest.mark.parametrize("backend", ["trtllm", "mnnvl"])
def test_no_call_reads_its_own_set_in_a_stale_slot(backend: str) -> None:
    """Warm-ups, step boundaries and both kernels' flag arithmetic
    included; and no set of one shape is a prefix of another's."""
    runs = lamport_runs(backend)
    assert {advance for *_, advance in runs[1:]} == (
        {0, 1} if backend == "trtllm" else {1, 2}
    )
    assert same_set_cases(runs) == 0
    small = step.input_sets(0, 4, 64, DTYPE, 0, 1)[0][0]
    large = step.input_sets(0, 8, 64, DTYPE, 0, 1)[0][0]
    assert not torch.equal(small, large[:4])
