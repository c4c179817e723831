# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch's creations and checkpoints through FlashInfer's own code.

FlashInfer's create_allreduce_fusion_workspace, its workspaces, its handle
exchange (file descriptors over its own sockets) and its checkpoints run as
released, with only CUDA faked below them (fake_cuda.py), on real gloo
groups: every path here makes FlashInfer's own comm-backend calls on the
patch's GroupComm.
"""

import concurrent.futures
from typing import Any

import pytest
from fi_ar_utils import ENV, every_rank, namespaces_unavailable, run_group

BOUND = 3
MARGIN = 12
LATE = BOUND + 4
# FlashInfer 0.7.4's mnnvl creation on one node: five allgathers, a barrier
# (fake_cuda.COMM_CALLS).
MNNVL_ROUNDS = 6


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    """Two ranks on one node; the last case leaves rank 1 dead."""
    return run_group(
        [
            {"name": "clean", "cuda": {}, "checkpoint": True},
            {"name": "no-multicast", "cuda": {"multicast": False}},
            {
                "name": "oom-on-rank-1",
                "cuda": {},
                "per_rank": {"1": {"cuda": {"fail_alloc": True}}},
            },
            {
                "name": "late-rank",
                "cuda": {},
                "bound": BOUND,
                "per_rank": {"1": {"comm_late": [1, LATE]}},
            },
            {
                "name": "destroyed-and-created-again",
                "cuda": {},
                "env": {ENV: "trtllm"},
                "reacquire": True,
            },
            {
                "name": "dies-before-checkpoint",
                "cuda": {},
                "bound": BOUND,
                "checkpoint": True,
                "per_rank": {"1": {"exit_before_checkpoint": True}},
            },
        ],
        nnodes=1,
        ranks_per_node=2,
        timeout=300,
    )


def _warnings(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "every rank gave it up" in m]


def test_a_creation_and_a_checkpoint_round_trip(two_ranks):
    for r in every_rank(two_ranks, "clean"):
        assert r["workspace"] == r["quant"] == "mnnvl" and r["shared"]
        assert r["standalone_ready"]
        assert r["checkpoint"] == "ok"
        assert r["kernel_loads"] == []


def test_no_multicast_falls_back_to_trtllm(two_ranks):
    results = every_rank(two_ranks, "no-multicast")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["kernel_loads"] == ["trtllm"]
    [line] = _warnings(results[0])
    assert "Device does not support multicasting" in line
    assert line.endswith("falls back to trtllm.") and not _warnings(results[1])


def test_an_out_of_memory_on_one_rank_ends_the_same_on_both(two_ranks):
    """FlashInfer's own allocation-error exchange tells every rank; each
    backend fails once, with one line naming rank 1's error."""
    results = every_rank(two_ranks, "oom-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == ["create:mnnvl", "create:trtllm"]
    mnnvl, trtllm = _warnings(results[0])
    assert "rank 1: creating or exporting the allocation failed" in mnnvl
    assert trtllm.endswith("FlashInfer all-reduce is off for these ranks.")


def test_a_late_rank_is_named_and_follows(two_ranks):
    results = every_rank(two_ranks, "late-rank")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["seconds"] < LATE + MARGIN
    [line] = _warnings(results[0])
    assert f"rank 1 did not answer within {BOUND} s" in line


def test_destroy_and_create_again(two_ranks):
    for r in every_rank(two_ranks, "destroyed-and-created-again"):
        assert r["workspace"] == r["reacquired"]["workspace"] == "trtllm"
        assert r["reacquired"]["standalone_ready"]


def test_sleep_with_a_dead_rank_raises_within_the_bound(two_ranks):
    """checkpoint_prepare's barrier waits on the store, not on vLLM's group:
    rank 0 raises at the bound, naming rank 1."""
    r = two_ranks[0]["dies-before-checkpoint"]
    assert r["workspace"] == "mnnvl"
    assert r["checkpoint"].startswith("RuntimeError: FlashInfer all-reduce ")
    assert f"rank 1 did not answer within {BOUND} s" in r["checkpoint"]
    assert r["checkpoint_seconds"] < BOUND + MARGIN


@pytest.fixture(scope="module")
def deaths() -> dict[int, list[dict[str, dict[str, Any]]]]:
    """Rank 1 exits at each of FlashInfer's exchanges, one group each."""

    def die_at(k: int) -> list[dict[str, dict[str, Any]]]:
        case = {"name": "dies", "cuda": {}, "bound": BOUND}
        case["per_rank"] = {"1": {"comm_exit_at": k}}
        return run_group([case], nnodes=1, ranks_per_node=2, timeout=300)

    rounds = range(1, MNNVL_ROUNDS + 1)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return dict(zip(rounds, pool.map(die_at, rounds), strict=True))


@pytest.mark.parametrize("k", range(1, MNNVL_ROUNDS + 1))
def test_a_rank_that_dies_at_each_exchange_ends_it_on_the_other(deaths, k):
    r = deaths[k][0]["dies"]
    assert "error" not in r, r.get("traceback")
    assert r["workspace"] is None and r["quant"] is None
    assert BOUND <= r["seconds"] < BOUND + MARGIN
    [line] = _warnings(r)
    assert f"rank 1 did not answer within {BOUND} s" in line


@pytest.mark.skipif(
    bool(namespaces_unavailable()), reason=str(namespaces_unavailable())
)
@pytest.mark.parametrize("release", ["0.7.4", "0.7.2.post1"])
def test_two_nodes_share_fabric_handles(release):
    """One rank a node, each with an NVLink fabric: mnnvl spans them with
    FABRIC handles, in each release's own creation."""
    case = {"name": "fabric", "cuda": {"fabric": True}, "checkpoint": True}
    results = run_group([case], nnodes=2, ranks_per_node=1, release=release)
    for r in every_rank(results, "fabric"):
        assert r["workspace"] == "mnnvl"
        assert r["checkpoint"] == "ok"


@pytest.fixture(scope="module")
def vllm_groups() -> list[dict[str, dict[str, Any]]]:
    """Four ranks on one node in vLLM's own groups, each with its local rank."""
    return run_group(
        [
            {
                "name": "second-tp-group-oom",
                "cuda": {},
                "tp_pp": [2, 2],
                "per_rank": {"3": {"cuda": {"fail_alloc": True}}},
            },
            {
                "name": "raises-on-rank-1",
                "cuda": {},
                "tp_pp": [4, 1],
                "bound": 60,
                "per_rank": {"1": {"foreign_workspace": True}},
            },
        ],
        nnodes=1,
        ranks_per_node=4,
        timeout=300,
        vllm_groups=True,
    )


def test_a_tp_group_without_local_rank_0_warns_from_its_own_rank_0(vllm_groups):
    """TP2 x PP2: rank 3 runs out of memory in group (2, 3), whose rank 0 is
    local rank 2; it alone says so, once per backend, and group (0, 1)
    keeps mnnvl without a word. FlashInfer's allocation-error exchange fails
    both ranks, naming rank 3 by its rank in the group."""
    results = [r["second-tp-group-oom"] for r in vllm_groups]
    assert [r["workspace"] for r in results] == ["mnnvl", "mnnvl", None, None]
    assert [len(_warnings(r)) for r in results] == [0, 0, 2, 0]
    mnnvl, trtllm = _warnings(results[2])
    assert "workspace for ranks (2, 3): failed on ranks 2, 3 (" in mnnvl
    assert "rank 1: creating or exporting the allocation failed" in mnnvl
    assert trtllm.endswith("FlashInfer all-reduce is off for these ranks.")


def test_an_exception_on_one_rank_after_flashinfers_creation_is_raised_on_all(
    vllm_groups,
):
    """FlashInfer's creation completes everywhere; upstream's own check then
    raises on rank 1 only: every rank raises that error, none falls back."""
    for r in (r["raises-on-rank-1"] for r in vllm_groups):
        assert r["error"] == (
            "RuntimeError: FlashInfer mnnvl all-reduce workspace for ranks "
            "(0, 1, 2, 3): raised on rank 1 (RuntimeError: FlashInfer returned an "
            "all-reduce workspace already associated with a different process group)"
        )
        assert r["log"] == ["create:mnnvl"]
        assert r["seconds"] < MARGIN
