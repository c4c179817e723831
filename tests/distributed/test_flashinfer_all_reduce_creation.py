# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace creation ends the same way on every rank, within a bound.

Real gloo groups whose timeout is vLLM's default (PyTorch's 30 minutes for
gloo), with FlashInfer's constructor faked at the flashinfer_comm boundary:
it exchanges its arguments through the comm backend it is given, as
FlashInfer exchanges memory handles, so ranks really wait in it for one that
is not there. The creation's bound is set short (BOUND) so a hang shows as
the group running into its deadline.
"""

import importlib
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from fi_ar_utils import (
    CREATION_MODULE,
    ENV,
    every_rank,
    namespaces_unavailable,
    run_group,
)

# The creation's bound in these tests, in seconds, and what a rank may take
# beyond it (vote, fallback creation, log) on a loaded two-core machine.
BOUND = 3
MARGIN = 12
# Longer than the bound: a cold JIT build of the kernels, say.
SLOW_LOAD = 2 * BOUND


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, dict[str, Any]]]:
    """Three ranks on one node, one of them the odd one in each case.

    (Three ranks have no standalone all-reduce in vLLM's size table, so
    only the fusion pass's workspaces are acquired.)
    """
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
    group's 30-minute timeout, and all take the trtllm fallback together."""
    for r in every_rank(three_ranks, "fails-before-rendezvous"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
        [line] = _failure_lines(r)
        assert line.startswith(
            "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2) "
            "failed on rank 2 (RuntimeError: injected mnnvl workspace failure "
            "before exchange); every rank gave it up"
        )


def test_a_rank_failing_before_the_rendezvous_turns_every_rank_off(three_ranks):
    """Where `auto` allows no fallback (HiSparse: trtllm only), every rank is
    off, once for the fusion workspace and once for the quant one."""
    for r in every_rank(three_ranks, "hisparse-fails-before-rendezvous"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["seconds"] < 2 * BOUND + MARGIN
        assert r["log"].count("create:trtllm") == 2
        assert (
            "failed on rank 2 (RuntimeError: injected trtllm" in (_failure_lines(r)[0])
        )


def test_a_rank_failing_after_the_rendezvous_falls_back_on_every_rank(
    three_ranks,
):
    results = every_rank(three_ranks, "fails-after-rendezvous")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
        [line] = _failure_lines(r)
        assert "failed on rank 1 (RuntimeError: injected mnnvl workspace failure)" in (
            line
        )
    for r in results[:1] + results[2:]:
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
        assert "create:mnnvl" not in r["log"]
        [line] = [m for m in r["messages"] if "failed to load" in m]
        assert line == (
            "WARNING FlashInfer's mnnvl all-reduce kernels failed to load (rank 0: "
            "RuntimeError: injected mnnvl kernel build failure); FlashInfer "
            "all-reduce for ranks (0, 1, 2): trtllm instead."
        )


def test_one_node_groups_are_not_probed_for_a_fabric(three_ranks):
    for r in every_rank(three_ranks, "slow-kernel-build"):
        assert r["fabric_probes"] == 0


@pytest.fixture(scope="module")
def two_nodes_of_two() -> list[dict[str, dict[str, Any]]]:
    """Two ranks on each of two nodes (a private /dev/shm per node)."""
    if (why := namespaces_unavailable()) is not None:
        pytest.skip(f"two nodes are simulated with mount namespaces: {why}")
    second_node_fails = {"fail_before": ["mnnvl"]}
    return run_group(
        [
            {
                "name": "second-node-fails",
                "bound": BOUND,
                "per_rank": {"2": second_node_fails, "3": second_node_fails},
            },
            {"name": "fabric"},
            {"name": "no-fabric-on-rank-3", "per_rank": {"3": {"fabric": False}}},
            {"name": "no-fabric", "fabric": False},
            {
                "name": "no-fabric-explicit-mnnvl",
                "fabric": False,
                "env": {ENV: "mnnvl"},
            },
        ],
        nnodes=2,
        ranks_per_node=2,
        timeout=180,
    )


def test_one_node_of_two_failing_turns_every_rank_off(two_nodes_of_two):
    for r in every_rank(two_nodes_of_two, "second-node-fails"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["seconds"] < 2 * BOUND + MARGIN
        [line, *_] = _failure_lines(r)
        assert line.startswith(
            "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2, 3) "
            "failed on rank 2 (RuntimeError: injected mnnvl workspace failure "
            "before exchange), rank 3 (RuntimeError: injected"
        )


def test_a_multi_node_group_with_a_fabric_gets_mnnvl(two_nodes_of_two):
    for r in every_rank(two_nodes_of_two, "fabric"):
        assert r["workspace"] == r["quant"] == "mnnvl"
        assert r["fabric_probes"] == 1, "probed once per group"


@pytest.mark.parametrize("case", ["no-fabric-on-rank-3", "no-fabric"])
def test_auto_is_off_across_nodes_without_a_fabric_on_every_rank(
    two_nodes_of_two, case
):
    for r in every_rank(two_nodes_of_two, case):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        assert r["kernel_loads"] == [] or case == "no-fabric-on-rank-3"
        [line] = [m for m in r["messages"] if "backend for ranks" in m]
        assert line.startswith(
            "INFO FlashInfer all-reduce backend for ranks (0, 1, 2, 3): off (auto, "
            "2 nodes on Blackwell: mnnvl is the only backend that spans nodes; but "
            "mnnvl across nodes needs an NVLink fabric"
        )
        ranks = "3" if case == "no-fabric-on-rank-3" else "0, 1, 2, 3"
        assert line.endswith(f"is_mnnvl_fabric_supported is false on ranks {ranks})")


def test_explicit_mnnvl_across_nodes_without_a_fabric_says_it_cannot_work(
    two_nodes_of_two,
):
    for r in every_rank(two_nodes_of_two, "no-fabric-explicit-mnnvl"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if "backend for ranks" in m]
        assert line.startswith(
            f"WARNING FlashInfer all-reduce backend for ranks (0, 1, 2, 3): off "
            f"({ENV}=mnnvl is set explicitly; but mnnvl across nodes needs an "
            "NVLink fabric"
        )


def test_flashinfer_keeps_using_vllm_group_after_creation(fi_ar, cpu_group):
    """FlashInfer keeps the comm backend it was created with for later
    collectives (checkpoint_prepare's barrier): after the creation they run
    on vLLM's group, as upstream's did, not on the destroyed bounded one."""
    from flashinfer.comm.mnnvl import TorchDistBackend

    creation = importlib.import_module(CREATION_MODULE)
    bounded = dist.new_group(
        [0],
        backend="gloo",
        timeout=timedelta(seconds=5),
        use_local_synchronization=True,
    )
    comm = creation.CreationCommBackend(TorchDistBackend, bounded, cpu_group)
    assert comm.allgather("handle") == ("handle",)
    assert comm.steps == 1
    comm.release()
    dist.destroy_process_group(bounded)
    comm.barrier()
    assert comm.bcast("later", root=0) == "later"
    assert comm.steps == 1, "only the creation's collectives count"
