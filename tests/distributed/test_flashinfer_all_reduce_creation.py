# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace creation ends the same way on every rank, within a bound.

Real gloo groups whose timeout is vLLM's default (30 minutes for gloo), with
FlashInfer's constructor faked at the flashinfer_comm boundary: it exchanges
its arguments through the comm backend it is given, as FlashInfer exchanges
memory handles, so ranks really wait in it for one that is not there. The
bound is set short (BOUND), so a hang shows as the group missing its deadline.
"""

import importlib
from typing import Any

import pytest
import torch.distributed as dist
from fi_ar_utils import CREATION_MODULE, every_rank, run_group, workspace_args

# The bound in these tests, in seconds, and what a rank may take beyond it
# (votes, the fallback creation, logging) on a loaded two-core machine.
BOUND = 3
MARGIN = 12
# Longer than the bound: a cold JIT build of the kernels, say.
SLOW_LOAD = 2 * BOUND
# How late a rank comes to FlashInfer's first collective.
LATE = BOUND + 4


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, dict[str, Any]]]:
    """Three ranks on one node, one of them the odd one in each case (three
    ranks have no standalone all-reduce: only the fusion workspaces)."""
    return run_group(
        [
            {
                "name": "fails-before-rendezvous",
                "bound": BOUND,
                "per_rank": {"2": {"fail_before": ["mnnvl"]}},
            },
            {
                "name": "hisparse-fails-before-rendezvous",
                "hisparse": "connector",
                "bound": BOUND,
                "per_rank": {"2": {"fail_before": ["trtllm"]}},
            },
            {
                "name": "fails-after-rendezvous",
                "bound": BOUND,
                "per_rank": {"1": {"fail": ["mnnvl"]}},
            },
            {
                "name": "slow-kernel-build",
                "hisparse": "connector",
                "bound": BOUND,
                "per_rank": {"1": {"load_seconds": SLOW_LOAD}},
            },
            {
                "name": "kernels-fail-to-load",
                "bound": BOUND,
                "per_rank": {"0": {"load_fails": ["mnnvl"]}},
            },
        ],
        nnodes=1,
        ranks_per_node=3,
        timeout=150,
    )


def _failure_lines(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "every rank gave it up" in m]


def test_a_rank_failing_before_the_rendezvous_falls_back_on_every_rank(
    three_ranks,
):
    """The others leave FlashInfer's rendezvous at the bound, not at the
    group's 30 minutes, and all take the trtllm fallback together."""
    for r in every_rank(three_ranks, "fails-before-rendezvous"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
        [line] = _failure_lines(r)
        assert line == (
            "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2): "
            "failed on rank 2 (Failed to initialize FlashInfer All Reduce "
            "workspace: injected mnnvl workspace failure before exchange.); every "
            "rank gave it up."
        )


def test_a_failed_creation_is_not_tried_again_for_the_quant_workspace(
    three_ranks,
):
    """With HiSparse, trtllm has no fallback: every rank is off after one
    bound, not one per workspace."""
    for r in every_rank(three_ranks, "hisparse-fails-before-rendezvous"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"].count("create:trtllm") == 1
        assert r["seconds"] < BOUND + MARGIN
        assert len(_failure_lines(r)) == 1


def test_a_rank_failing_after_the_rendezvous_falls_back_on_every_rank(
    three_ranks,
):
    results = every_rank(three_ranks, "fails-after-rendezvous")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
        [line] = _failure_lines(r)
        assert (
            "failed on rank 1 (Failed to initialize FlashInfer All Reduce "
            "workspace: injected mnnvl workspace failure.)"
        ) in line
    for r in (results[0], results[2]):
        assert "destroy:mnnvl" in r["log"], "a workspace the group gave up on"


def test_a_kernel_build_longer_than_the_bound_is_not_cut(three_ranks):
    """Kernels load before the bounded part: a slow build delays every rank
    but fails none."""
    results = every_rank(three_ranks, "slow-kernel-build")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert not _failure_lines(r)
        assert r["kernel_loads"] == ["trtllm"]
    assert results[1]["seconds"] >= SLOW_LOAD


def test_kernels_failing_to_load_on_one_rank_fall_back_before_any_attempt(
    three_ranks,
):
    for r in every_rank(three_ranks, "kernels-fail-to-load"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert "create:mnnvl" not in r["log"], "mnnvl is never attempted"
        [line] = _failure_lines(r)
        assert line.startswith(
            "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2): "
            "could not load kernels on rank 0 (RuntimeError: injected mnnvl kernel "
            "build failure); every rank gave it up."
        )


@pytest.fixture(scope="module")
def two_tp_groups() -> list[dict[str, dict[str, Any]]]:
    """Four ranks in TP groups {0, 1} and {2, 3}: only {0, 1} lacks
    multicast, so only it falls back from mnnvl to trtllm; or only {0, 1}
    reaches the workspace (as the fusion pass or a model's own fused op
    reach it, at different times per TP group)."""
    no_multicast = {"multicast": False}
    idle = {"idle": True}
    return run_group(
        [
            {
                "name": "one-falls-back",
                "tp": [[0, 1], [2, 3]],
                "world_group_after": 30,
                "per_rank": {"0": no_multicast, "1": no_multicast},
            },
            {
                "name": "one-group-acquires",
                "tp": [[0, 1], [2, 3]],
                "world_group_after": 30,
                "per_rank": {"2": idle, "3": idle},
            },
        ],
        nnodes=1,
        ranks_per_node=4,
        timeout=150,
    )


@pytest.mark.slow_rank_group
def test_a_world_group_forms_after_one_tp_group_fell_back(two_tp_groups):
    """The groups a process makes never depend on how its creations went:
    torch names groups by a per-process counter, so a world-wide new_group
    after start-up would otherwise hang."""
    results = every_rank(two_tp_groups, "one-falls-back")
    assert [r["workspace"] for r in results] == ["trtllm"] * 2 + ["mnnvl"] * 2
    assert [r["groups"] for r in results] == [0] * 4
    assert [r["world_group"] for r in results] == [4] * 4


@pytest.mark.slow_rank_group
def test_a_world_group_forms_after_only_one_tp_group_agreed(two_tp_groups):
    """The agreement and the creation make no process group: a world-wide
    new_group forms after only one TP group reached them."""
    results = every_rank(two_tp_groups, "one-group-acquires")
    assert [r.get("workspace") for r in results] == ["mnnvl"] * 2 + [None] * 2
    assert [r["groups"] for r in results] == [0] * 4
    assert [r["world_group"] for r in results] == [4] * 4


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    """Two ranks on one node, rank 1 the odd one out in each case."""
    return run_group(
        [
            {
                "name": "late-rank",
                "hisparse": "connector",
                "bound": BOUND,
                "per_rank": {"1": {"late_seconds": LATE}},
            },
            {
                "name": "fails-on-local-rank-1",
                "per_rank": {"1": {"env": {"LOCAL_RANK": "1"}, "fail": ["mnnvl"]}},
            },
            {
                "name": "raises-on-rank-1",
                "hisparse": "connector",
                "bound": BOUND,
                "per_rank": {"1": {"foreign_workspace": True}},
            },
        ],
        nnodes=1,
        ranks_per_node=2,
        timeout=120,
    )


def test_the_late_rank_is_the_one_named(two_ranks):
    """Rank 0 gives up waiting at the bound; rank 1 comes later and finds
    rank 0's part there. Both name rank 1."""
    for r in every_rank(two_ranks, "late-rank"):
        assert r["workspace"] is None and r["quant"] is None
        [line] = _failure_lines(r)
        assert line == (
            "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1): "
            f"rank 1 did not answer within {BOUND} s; every rank gave it up."
        )
        assert r["seconds"] < LATE + MARGIN


def test_a_failure_on_a_rank_that_is_not_local_rank_0_reaches_the_log(two_ranks):
    """vLLM's *_once lines print on local rank 0 only: rank 1's error comes
    to rank 0's log in the vote."""
    rank0, rank1 = every_rank(two_ranks, "fails-on-local-rank-1")
    for r in (rank0, rank1):
        assert r["workspace"] == r["quant"] == "trtllm"
    [line] = _failure_lines(rank0)
    assert (
        "failed on rank 1 (Failed to initialize FlashInfer All Reduce workspace: "
        "injected mnnvl workspace failure.)"
    ) in line
    assert not [m for m in rank1["messages"] if m.startswith("WARNING")]


def test_an_exception_inside_the_creation_goes_through_the_vote(two_ranks):
    """Upstream's own RuntimeError on rank 1 is raised there after the vote;
    rank 0 gives its workspace up at once, not at vLLM's 30-minute timeout."""
    rank0, rank1 = (r["raises-on-rank-1"] for r in two_ranks)
    assert rank1["error"] == (
        "RuntimeError: FlashInfer returned an all-reduce workspace already "
        "associated with a different process group"
    )
    assert "error" not in rank0, rank0.get("traceback")
    assert rank0["workspace"] is None and rank0["quant"] is None
    assert "destroy:trtllm" in rank0["log"]
    [line] = _failure_lines(rank0)
    assert line == (
        "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1): failed on "
        "rank 1 (RuntimeError: FlashInfer returned an all-reduce workspace already "
        "associated with a different process group); every rank gave it up."
    )
    assert rank0["seconds"] < MARGIN


def test_flashinfer_keeps_using_vllm_group_after_creation(fi_ar, cpu_group):
    """FlashInfer keeps the comm backend (checkpoint_prepare's barrier):
    after the creation it runs on vLLM's group, not over the store."""
    from flashinfer.comm.mnnvl import TorchDistBackend

    creation = importlib.import_module(CREATION_MODULE)
    kept: list[Any] = []

    @creation.on_every_rank(release=lambda _: None)
    def create(backend: str, group: Any) -> object:
        kept.append(creation.creation_comm_backend(TorchDistBackend(group=group)))
        kept[0].barrier()
        return object()

    assert create("trtllm", cpu_group) is not None
    assert kept[0].steps == 1
    kept[0].barrier()
    assert kept[0].steps == 1, "after the creation, collectives run on vLLM's group"
    assert kept[0].after._group is cpu_group
    assert dist.get_world_size(cpu_group) == 1


def test_upstreams_own_errors_propagate(fi_ar, fake_ws, cpu_group, monkeypatch):
    """A workspace FlashInfer ties to another group is upstream's
    RuntimeError, not a failed creation."""
    other = dist.new_group(ranks=[0], backend="gloo")
    ws = fi_ar.get_fi_ar_workspace(**workspace_args(other, world_size=1))
    # The fixture destroys what is left; monkeypatch would restore `ws` after.
    fi_ar._fi_ar_workspace = None
    monkeypatch.setattr(
        fi_ar.flashinfer_comm, "create_allreduce_fusion_workspace", lambda **_: ws
    )
    with pytest.raises(RuntimeError, match="different process group"):
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group, world_size=1))
