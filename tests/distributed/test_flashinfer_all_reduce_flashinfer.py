# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch's creations and checkpoints through FlashInfer's own code.

FlashInfer's create_allreduce_fusion_workspace, its workspaces, its handle
exchange (file descriptors over its own sockets) and its checkpoints run as
released, with only CUDA faked below them (fake_cuda.py), on real gloo
groups: every path here makes FlashInfer's own comm-backend calls on the
patch's FiArGroup, inside its steps.
"""

from typing import Any

import pytest
from fi_ar_utils import ENV, MAX_TOKENS, every_rank, namespaces_unavailable, run_group


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    """Two ranks on one node."""
    return run_group(
        [
            {"name": "clean", "cuda": {}, "checkpoint": True},
            {"name": "no-multicast", "cuda": {"multicast": False}},
            {
                "name": "oom-on-rank-1",
                "cuda": {},
                "per_rank": {"1": {"cuda": {"fail": {"cuMemCreate": 0}}}},
            },
            {
                "name": "confidential",
                "cuda": {"confidential": True},
                "checkpoint": True,
            },
            {
                "name": "trtllm-fusion-first",
                "cuda": {},
                "env": {ENV: "trtllm"},
                "first": "fusion",
                "checkpoint": True,
                "reacquire": True,
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
    backend fails once, with one line on the group's rank 0 naming rank 1's
    error."""
    results = every_rank(two_ranks, "oom-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == ["create:mnnvl", "create:trtllm"]
    mnnvl, trtllm = _warnings(results[0])
    assert "rank 1: creating or exporting the allocation failed" in mnnvl
    assert trtllm.endswith("FlashInfer all-reduce is off for these ranks.")
    assert not _warnings(results[1])


def test_confidential_computing_falls_back_to_trtllm_on_symmetric_memory(two_ranks):
    """Under Confidential Computing FlashInfer refuses mnnvl on every rank, and
    trtllm's creation takes torch symmetric memory: its rendezvous and last
    barrier are collectives on vLLM's group itself, outside the step's
    exchanges; sleep mode leaves it resident."""
    results = every_rank(two_ranks, "confidential")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm" and r["checkpoint"] == "ok"
        calls = r["driver_calls"]
        assert calls["symm_mem.empty"] == calls["symm_mem.rendezvous"] == 3
        assert "cuMemCreate" not in calls
    [line] = _warnings(results[0])
    assert "Confidential Computing is not supported" in line
    assert line.endswith("falls back to trtllm.") and not _warnings(results[1])


def test_the_fusion_pass_creates_first_and_checkpoints(two_ranks):
    """The fusion pass's call is the group's first: it agrees and creates;
    the standalone all-reduce built after uses that workspace, and sleep
    mode's checkpoints and a destroy and re-creation go through."""
    results = every_rank(two_ranks, "trtllm-fusion-first")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm" and r["shared"]
        assert r["sizes"][0] == ["trtllm", MAX_TOKENS]
        assert r["standalone_ready"] and r["checkpoint"] == "ok"
        assert r["reacquired"]["workspace"] == "trtllm"
        assert r["reacquired"]["standalone_ready"]
    startup = [[m for m in r["messages"] if "backend for ranks" in m] for r in results]
    assert [len(lines) for lines in startup] == [1, 0]


def test_the_standalone_bound_is_the_trtllm_workspaces_own(two_ranks):
    """The fusion pass created the trtllm workspace for fewer tokens than the
    standalone all-reduce would have: its bound is the workspace's own
    max_token_num, so no call past it reaches FlashInfer's check."""
    for r in every_rank(two_ranks, "trtllm-fusion-first"):
        assert r["workspace_tokens"] == MAX_TOKENS
        assert r["standalone_tokens"] == MAX_TOKENS


@pytest.mark.skipif(
    bool(namespaces_unavailable()), reason=str(namespaces_unavailable())
)
@pytest.mark.parametrize("release", ["0.7.4", "0.7.2.post1"])
def test_two_nodes_share_fabric_handles(release):
    """One rank a node, each with an NVLink fabric: mnnvl spans them with
    FABRIC handles, in each release's own creation and checkpoints."""
    case = {"name": "fabric", "cuda": {"fabric": True}, "checkpoint": True}
    results = run_group([case], nnodes=2, ranks_per_node=1, release=release)
    for r in every_rank(results, "fabric"):
        assert r["workspace"] == "mnnvl"
        assert r["checkpoint"] == "ok"


@pytest.fixture(scope="module")
def vllm_groups() -> list[dict[str, dict[str, Any]]]:
    """Four ranks on one node in vLLM's own groups, each with its local rank;
    then a world-wide group."""
    return run_group(
        [
            {
                "name": "second-tp-group-oom",
                "cuda": {},
                "tp_pp": [2, 2],
                "world_group_after": 30,
                "per_rank": {"3": {"cuda": {"fail": {"cuMemCreate": 0}}}},
            },
            {
                "name": "tp4-not-all-nvlink",
                "cuda": {"multicast": False},
                "tp_pp": [4, 1],
                "per_rank": {"2": {"nvlink": False}},
            },
            {"name": "tp4-nvlink", "cuda": {"multicast": False}, "tp_pp": [4, 1]},
            {
                "name": "tp4-explicit-trtllm-no-nvlink",
                "cuda": {},
                "tp_pp": [4, 1],
                "env": {ENV: "trtllm"},
                "nvlink": False,
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
    keeps mnnvl without a word. Each group's start-up line comes from its
    own rank 0. FlashInfer's allocation-error exchange fails both ranks,
    naming rank 3 by its rank in the group."""
    results = [r["second-tp-group-oom"] for r in vllm_groups]
    for r in results:
        assert "error" not in r, r.get("traceback")
    assert [r["workspace"] for r in results] == ["mnnvl", "mnnvl", None, None]
    assert [len(_warnings(r)) for r in results] == [0, 0, 2, 0]
    mnnvl, trtllm = _warnings(results[2])
    assert "workspace for ranks (2, 3): ranks 2, 3 failed: " in mnnvl
    assert "rank 1: creating or exporting the allocation failed" in mnnvl
    assert trtllm.endswith("FlashInfer all-reduce is off for these ranks.")
    startup = [[m for m in r["messages"] if "backend for ranks" in m] for r in results]
    assert [len(lines) for lines in startup] == [1, 0, 1, 0]
    assert startup[0][0].startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1): mnnvl"
    )
    assert startup[2][0].startswith(
        "INFO FlashInfer all-reduce backend for ranks (2, 3): mnnvl"
    )


def test_a_world_group_forms_after_one_tp_group_gave_up(vllm_groups):
    """The agreement and the steps make no process group (torch numbers
    groups per process): a world-wide new_group after start-up forms."""
    results = [r["second-tp-group-oom"] for r in vllm_groups]
    assert [r["groups"] for r in results] == [0] * 4
    assert [r["world_group"] for r in results] == [4] * 4


def test_trtllm_is_no_fallback_where_one_rank_lacks_nvlink(vllm_groups):
    """TP4 on one node, rank 2's GPU not NVLink-connected to the others (as
    NVML says on that rank): every rank takes it into account, so mnnvl,
    without multicast here, is given up with no trtllm fallback over PCIe."""
    results = [r["tp4-not-all-nvlink"] for r in vllm_groups]
    for r in results:
        assert "error" not in r, r.get("traceback")
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == ["create:mnnvl"]
        assert r["standalone_ready"] is False, "vLLM's own all-reduce takes over"
    [startup] = [m for m in results[0]["messages"] if "backend for ranks" in m]
    assert startup.startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1, 2, 3): mnnvl (auto, "
        "one node; more than two GPUs are not all NVLink-connected: trtllm runs "
        "over PCIe"
    )
    [line] = _warnings(results[0])
    assert line.endswith(
        "every rank gave it up and FlashInfer all-reduce is off for these ranks."
    )
    assert not any(_warnings(r) for r in results[1:])


def test_tp4_all_nvlink_connected_falls_back_to_trtllm(vllm_groups):
    """The same group with NVLink between every pair keeps today's fallback."""
    for r in (r["tp4-nvlink"] for r in vllm_groups):
        assert "error" not in r, r.get("traceback")
        assert r["workspace"] == r["quant"] == "trtllm"


def test_explicit_trtllm_without_nvlink_is_obeyed_with_a_warning(vllm_groups):
    results = [r["tp4-explicit-trtllm-no-nvlink"] for r in vllm_groups]
    for r in results:
        assert "error" not in r, r.get("traceback")
        assert r["workspace"] == r["quant"] == "trtllm"
    [startup] = [m for m in results[0]["messages"] if "backend for ranks" in m]
    assert startup.startswith("WARNING FlashInfer all-reduce backend for ranks")
    assert "(vllm#48075, vllm#48071, sglang#32330)" in startup
    assert startup.endswith(f"Unset {ENV} to let vLLM pick a safe backend.")
