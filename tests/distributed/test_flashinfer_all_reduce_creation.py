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
from fi_ar_utils import (
    BACKEND_MODULE,
    ENV,
    HIDDEN_DIM,
    MAX_TOKENS,
    creation_keys_left,
    every_rank,
    run_group,
    workspace_args,
)

# The bound in these tests, in seconds, and what a rank may take beyond it
# (votes, the fallback creation, logging) on a loaded two-core machine.
BOUND = 3
MARGIN = 12
# Longer than the bound: a cold JIT build of the kernels, say.
SLOW_LOAD = 2 * BOUND
# How late a rank comes to FlashInfer's first collective.
LATE = BOUND + 4
# Later than the bound and the vote's grace (VOTE_GRACE_S), after the rounds.
LATE_VOTE = BOUND + 9
# How long a rank is slow within the bound.
SLOW = 2
# Store requests per rank a creation may make, however long a rank waits:
# three per round (FlashInfer's two exchanges here, and the vote) and the
# clean-up of its keys.
STORE_REQUESTS = 3 * 3 + 3


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
                "name": "trtllm-fails-before-rendezvous",
                "env": {ENV: "trtllm"},
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
                "env": {ENV: "trtllm"},
                "bound": BOUND,
                "per_rank": {"1": {"load_seconds": SLOW_LOAD}},
            },
            {
                "name": "kernels-fail-to-load",
                "env": {ENV: "trtllm"},
                "bound": BOUND,
                "per_rank": {"0": {"load_fails": ["trtllm"]}},
            },
            {"name": "no-multicast", "bound": BOUND, "multicast": False},
        ],
        nnodes=1,
        ranks_per_node=3,
        timeout=150,
    )


def _votes(step: int, ranks: int) -> set[str]:
    """The vote's keys of a group's `step`-th step, as the patch names them."""
    return {f"vllm-fi-ar/{step}/vote/{i}" for i in range(ranks)}


def _failure_lines(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "every rank gave it up" in m]


def _the_failure_line(results: list[dict[str, Any]]) -> str:
    """The group's rank 0 logs the give-up line, once; no other rank does."""
    [line] = _failure_lines(results[0])
    assert not [m for r in results[1:] for m in _failure_lines(r)]
    return line


def test_a_rank_failing_before_the_rendezvous_falls_back_on_every_rank(
    three_ranks,
):
    """The others leave FlashInfer's rendezvous at the bound, not at the
    group's 30 minutes, and all take the trtllm fallback together."""
    results = every_rank(three_ranks, "fails-before-rendezvous")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
    assert _the_failure_line(results) == (
        "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2): "
        "failed on rank 2 (Failed to initialize FlashInfer All Reduce "
        "workspace: injected mnnvl workspace failure before exchange.); every "
        "rank gave it up and falls back to trtllm."
    )


def test_a_failed_creation_is_not_tried_again_for_the_quant_workspace(
    three_ranks,
):
    """An explicit trtllm has no fallback: every rank is off after one
    bound, not one per workspace."""
    results = every_rank(three_ranks, "trtllm-fails-before-rendezvous")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"].count("create:trtllm") == 1
        assert r["seconds"] < BOUND + MARGIN
    _the_failure_line(results)


def test_a_rank_failing_after_the_rendezvous_falls_back_on_every_rank(
    three_ranks,
):
    results = every_rank(three_ranks, "fails-after-rendezvous")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < BOUND + MARGIN
    assert (
        "failed on rank 1 (Failed to initialize FlashInfer All Reduce "
        "workspace: injected mnnvl workspace failure.)"
    ) in _the_failure_line(results)
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


def test_kernels_failing_to_load_on_one_rank_end_it_before_any_attempt(three_ranks):
    results = every_rank(three_ranks, "kernels-fail-to-load")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert "create:trtllm" not in r["log"], "trtllm is never attempted"
    assert _the_failure_line(results) == (
        "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1, 2): "
        "could not load kernels on rank 0 (RuntimeError: injected trtllm kernel "
        "build failure); every rank gave it up and FlashInfer all-reduce is off "
        "for these ranks."
    )


def test_mnnvl_kernels_are_not_built_for_its_creation(three_ranks):
    """FlashInfer's mnnvl creation loads no kernels (its all-reduce calls
    get_trtllm_mnnvl_comm_module): a node without multicast builds trtllm's
    alone, then falls back."""
    for r in every_rank(three_ranks, "no-multicast"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["kernel_loads"] == ["trtllm"]


@pytest.mark.slow_rank_group
def test_a_world_group_forms_after_one_tp_group_fell_back(vllm_groups):
    """The groups a process makes never depend on how its creations went:
    torch names groups by a per-process counter, so a world-wide new_group
    after start-up would otherwise hang."""
    results = every_rank(vllm_groups, "one-falls-back")
    assert [r["workspace"] for r in results] == ["trtllm"] * 2 + ["mnnvl"] * 2
    assert [r["groups"] for r in results] == [0] * 4
    assert [r["world_group"] for r in results] == [4] * 4


@pytest.mark.slow_rank_group
def test_a_world_group_forms_after_only_one_tp_group_agreed(vllm_groups):
    """The agreement and the creation make no process group: a world-wide
    new_group forms after only one TP group reached them."""
    results = every_rank(vllm_groups, "one-group-acquires")
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
                "env": {ENV: "trtllm"},
                "bound": BOUND,
                "keys_left": True,
                "per_rank": {"1": {"late_seconds": LATE}},
            },
            {
                "name": "late-after-its-exchanges-then-fails",
                "bound": BOUND,
                "per_rank": {"1": {"late_after_seconds": LATE_VOTE, "fail": ["mnnvl"]}},
            },
            {
                "name": "waits-for-a-slow-rank",
                "per_rank": {"1": {"late_seconds": SLOW}},
            },
            {
                "name": "fails-on-local-rank-1",
                "per_rank": {"1": {"env": {"LOCAL_RANK": "1"}, "fail": ["mnnvl"]}},
            },
            {
                "name": "raises-on-rank-1",
                "env": {ENV: "trtllm"},
                "bound": BOUND,
                "per_rank": {"1": {"foreign_workspace": True}},
            },
        ],
        nnodes=1,
        ranks_per_node=2,
        timeout=120,
    )


def test_the_late_rank_is_the_one_named(two_ranks):
    """Rank 0 gives up waiting at the bound and names rank 1; rank 1 comes
    after the bound and reads the group's decision, which stays in the store,
    instead of deciding alone."""
    results = every_rank(two_ranks, "late-rank")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["seconds"] < LATE + MARGIN
        assert _votes(1, 2) <= set(r["keys_left"])
    assert _the_failure_line(results) == (
        "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1): "
        f"rank 1 did not answer within {BOUND} s; every rank gave it up and "
        "FlashInfer all-reduce is off for these ranks."
    )


def test_a_rank_late_after_flashinfers_exchanges_follows_the_group(two_ranks):
    """Rank 1 is slow after FlashInfer's last exchange, past the bound and
    its vote's grace, then fails: it reads the decision rank 0 took without
    it (rank 1 did not answer) instead of deciding alone to fall back."""
    results = every_rank(two_ranks, "late-after-its-exchanges-then-fails")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert "create:trtllm" not in r["log"], "no rank enters it alone"
        assert r["seconds"] < LATE_VOTE + MARGIN
    assert _the_failure_line(results) == (
        "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1): "
        f"rank 1 did not answer within {BOUND} s; every rank gave it up and "
        "FlashInfer all-reduce is off for these ranks."
    )


def test_waiting_for_a_rank_costs_the_store_no_requests(two_ranks):
    """A rank waits in one bounded request, not by polling the store."""
    for r in every_rank(two_ranks, "waits-for-a-slow-rank"):
        assert r["workspace"] == "mnnvl"
        assert r["store_requests"] <= STORE_REQUESTS


def test_a_failure_on_a_rank_that_is_not_local_rank_0_reaches_the_log(two_ranks):
    """vLLM's *_once lines print on local rank 0 only: rank 1's error comes
    to rank 0's log in the vote."""
    results = every_rank(two_ranks, "fails-on-local-rank-1")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
    assert (
        "failed on rank 1 (Failed to initialize FlashInfer All Reduce workspace: "
        "injected mnnvl workspace failure.)"
    ) in _the_failure_line(results)
    assert not [m for m in results[1]["messages"] if m.startswith("WARNING")]


def test_an_exception_inside_the_creation_goes_through_the_vote(two_ranks):
    """Upstream's own RuntimeError on rank 1 is raised on every rank after
    the vote, in seconds, not at vLLM's 30-minute timeout."""
    results = [r["raises-on-rank-1"] for r in two_ranks]
    for r in results:
        assert r["error"] == (
            "RuntimeError: FlashInfer trtllm all-reduce workspace for ranks (0, 1): "
            "raised on rank 1 (RuntimeError: FlashInfer returned an all-reduce "
            "workspace already associated with a different process group)"
        )
        assert r["seconds"] < MARGIN
    assert "destroy:trtllm" in results[0]["log"]


# The bound where a rank dies in the creation, and where a rank fails at
# once (the others must not wait it out).
DEATH_BOUND = 6
LONG_BOUND = 60


@pytest.fixture(scope="module")
def vllm_groups() -> list[dict[str, dict[str, Any]]]:
    """Four ranks on one node in vLLM's own groups (init_distributed_environment
    with each rank's local rank, initialize_model_parallel), FlashInfer faked
    at its boundary. In TP2 x PP2, only TP group (0, 1) lacks multicast, so
    only it falls back from mnnvl to trtllm; or only (0, 1) reaches the
    workspace (as the fusion pass or a model's own fused op reach it, at
    different times per TP group). Rank 2 exits in the last case."""
    no_multicast = {"multicast": False}
    idle = {"idle": True}
    return run_group(
        [
            {
                "name": "one-falls-back",
                "tp_pp": [2, 2],
                "world_group_after": 30,
                "per_rank": {"0": no_multicast, "1": no_multicast},
            },
            {
                "name": "one-group-acquires",
                "tp_pp": [2, 2],
                "world_group_after": 30,
                "per_rank": {"2": idle, "3": idle},
            },
            {
                "name": "tp2-pp2-second-group-fails",
                "tp_pp": [2, 2],
                "per_rank": {"3": {"fail": ["mnnvl"]}},
            },
            {
                "name": "raises-on-rank-1",
                "tp_pp": [4, 1],
                "bound": LONG_BOUND,
                "keys_left": True,
                "per_rank": {"1": {"foreign_workspace": True}},
            },
            {
                "name": "fails-before-first-exchange",
                "tp_pp": [4, 1],
                "bound": LONG_BOUND,
                "keys_left": True,
                "per_rank": {"2": {"fail_before": ["mnnvl"]}},
            },
            {
                "name": "dies-in-creation",
                "tp_pp": [4, 1],
                "bound": DEATH_BOUND,
                "keys_left": True,
                "per_rank": {"2": {"exit_at": 1}},
            },
        ],
        nnodes=1,
        ranks_per_node=4,
        timeout=600,
        vllm_groups=True,
    )


@pytest.mark.slow_rank_group
def test_a_rank_that_dies_in_the_creation_ends_it_on_every_other_rank(vllm_groups):
    """Rank 2 exits at FlashInfer's second exchange: ranks 0, 1 and 3 end
    at the bound, the same way (FlashInfer all-reduce off for the group: no
    more collectives with a rank that may be dead), rank 0 names rank 2
    without blaming multicast; the vote stays for rank 2, were it only late."""
    survivors = [vllm_groups[rank]["dies-in-creation"] for rank in (0, 1, 3)]
    assert "dies-in-creation" not in vllm_groups[2]
    for r in survivors:
        assert "error" not in r, r.get("traceback")
        assert r["workspace"] is None and r["quant"] is None
        assert DEATH_BOUND <= r["seconds"] < DEATH_BOUND + 4
        assert _votes(1, 4) <= set(r["keys_left"])
    assert _the_failure_line(survivors) == (
        "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1, 2, 3): "
        f"rank 2 did not answer within {DEATH_BOUND} s; every rank gave it up "
        "and FlashInfer all-reduce is off for these ranks."
    )
    warnings = [m for m in survivors[0]["messages"] if m.startswith("WARNING")]
    assert not [m for m in warnings if "multicast" in m]


@pytest.mark.slow_rank_group
def test_a_tp_group_without_local_rank_0_logs_from_its_own_rank_0(vllm_groups):
    """TP2 x PP2 on one node: group (2, 3) falls back to trtllm, and its own
    rank 0, local rank 2, logs its failure and its backend; each group's
    lines come from that group's rank 0 alone."""
    results = [r["tp2-pp2-second-group-fails"] for r in vllm_groups]
    assert [r["workspace"] for r in results] == ["mnnvl"] * 2 + ["trtllm"] * 2
    assert not _failure_lines(results[0]) and not _failure_lines(results[1])
    assert _the_failure_line(results[2:]) == (
        "WARNING FlashInfer mnnvl all-reduce workspace for ranks (2, 3): failed "
        "on rank 3 (Failed to initialize FlashInfer All Reduce workspace: "
        "injected mnnvl workspace failure.); every rank gave it up and falls back "
        "to trtllm."
    )
    startup = [[m for m in r["messages"] if "backend for ranks" in m] for r in results]
    assert [len(lines) for lines in startup] == [1, 0, 1, 0]
    assert startup[0][0].startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1): mnnvl"
    )
    assert startup[2][0].startswith(
        "INFO FlashInfer all-reduce backend for ranks (2, 3): mnnvl"
    )


@pytest.mark.slow_rank_group
def test_an_exception_on_one_rank_is_raised_on_every_rank(vllm_groups):
    """Upstream's RuntimeError on rank 1, where auto may fall back: no rank
    falls back alone; every rank raises the same error, in seconds."""
    results = [r["raises-on-rank-1"] for r in vllm_groups]
    for r in results:
        assert r["error"] == (
            "RuntimeError: FlashInfer mnnvl all-reduce workspace for ranks "
            "(0, 1, 2, 3): raised on rank 1 (RuntimeError: FlashInfer returned an "
            "all-reduce workspace already associated with a different process group)"
        )
        assert "create:trtllm" not in r["log"]
        assert r["seconds"] < MARGIN
        assert _votes(1, 4) <= set(r["keys_left"])


@pytest.mark.slow_rank_group
def test_a_rank_failing_before_its_first_exchange_stops_the_others_at_once(
    vllm_groups,
):
    """Rank 2 fails before FlashInfer's first exchange and says so: the
    others end in seconds, not at the bound, and all fall back together. The
    fallback went cleanly: of its keys only its vote is left."""
    results = [r["fails-before-first-exchange"] for r in vllm_groups]
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["seconds"] < MARGIN < LONG_BOUND
        fallback = [k for k in r["keys_left"] if k.startswith("vllm-fi-ar/2/")]
        assert fallback == sorted(_votes(2, 4))
    assert "failed on rank 2 (" in _the_failure_line(results)


def test_a_trtllm_fallback_is_sized_for_trtllm(fi_ar, fake_ws, cpu_group, monkeypatch):
    """mnnvl's tuned size (a TP8-like 128 MB row at SM100) is not trtllm's:
    the fallback asks for the token count it was given, the fusion table's."""
    monkeypatch.setitem(fi_ar.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB, (100, 2, 1), 128)
    fake_ws.multicast = False
    fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    tuned = 128 * 1024 * 1024 // (HIDDEN_DIM * 2)
    assert fake_ws.sizes == [("mnnvl", tuned), ("trtllm", MAX_TOKENS)]


def test_the_kept_comm_backend_is_bounded_in_every_step(fi_ar, cpu_group):
    """FlashInfer keeps the comm backend for checkpoint_prepare's barrier: it
    runs inside a bounded step, and refuses outside one rather than wait on
    its own. A clean step leaves only its vote, until the next one."""
    creation = importlib.import_module(BACKEND_MODULE)
    kept: list[Any] = []

    @creation.created_on_every_rank(registry={})
    def create(backend: str, dtype: Any, group: Any, creation: Any = None) -> object:
        kept.append(creation)
        creation.barrier()
        return object()

    assert create("mnnvl", None, cpu_group) is not None
    with pytest.raises(creation.Stopped, match="outside a step"):
        kept[0].barrier()
    creation.on_every_rank(cpu_group, kept[0].barrier)
    assert kept[0].steps == 2
    assert creation_keys_left(cpu_group) == sorted(_votes(2, 1))


def test_the_comm_backend_answers_flashinfers_calls(fi_ar, cpu_group):
    """What FlashInfer's handle exchange calls: rank, size, allgather and
    bcast, each answered in the group's order."""
    creation = importlib.import_module(BACKEND_MODULE)
    seen: list[Any] = []

    @creation.created_on_every_rank(registry={})
    def create(backend: str, dtype: Any, group: Any, creation: Any = None) -> object:
        calls = (creation.Get_rank(), creation.Get_size(), creation.allgather("a"))
        seen.append((*calls, creation.bcast("b", root=0)))
        return object()

    assert create("mnnvl", None, cpu_group) is not None
    assert seen == [(0, 1, ("a",), "b")]
    assert creation_keys_left(cpu_group) == sorted(_votes(1, 1))


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


def test_the_bound_is_a_setting(monkeypatch):
    """Read as vllm.envs reads its variables: the default, a whole number of
    seconds, or a one-line error naming the variable."""
    creation = importlib.import_module(BACKEND_MODULE)
    monkeypatch.delenv(creation.FI_AR_CREATE_TIMEOUT_ENV, raising=False)
    assert creation.create_timeout_s() == creation.FI_AR_CREATE_TIMEOUT_S == 300
    monkeypatch.setenv(creation.FI_AR_CREATE_TIMEOUT_ENV, "45")
    assert creation.create_timeout_s() == 45
    for bad in ("0", "-5", "1.5", "soon"):
        monkeypatch.setenv(creation.FI_AR_CREATE_TIMEOUT_ENV, bad)
        with pytest.raises(
            ValueError, match=f"FLASHINFER_ALLREDUCE_CREATE_TIMEOUT_S={bad!r}"
        ):
            creation.create_timeout_s()


def test_a_dtype_clause_only_once_that_dtype_is_asked_for(
    fi_ar, cpu_group, installed_flashinfer
):
    """On unfixed kernels float16 gets trtllm: a bf16 deployment's start-up
    line says nothing of it; a float16 workspace gets a line of its own."""
    import logging

    import torch
    from fi_ar_utils import _LogCollector

    installed_flashinfer(flashinfer="0.7.2.post1")
    lines, vllm_logger = _LogCollector(), logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(lines)
    vllm_logger.setLevel(logging.INFO)
    try:
        for dtype in (None, torch.bfloat16, torch.float16, torch.float16):
            fi_ar._resolve_fi_ar_backend(cpu_group, dtype)
    finally:
        vllm_logger.removeHandler(lines)
        vllm_logger.setLevel(level)
    first, fp16 = [m for m in lines.lines if "backend for ranks" in m]
    assert first.startswith("INFO FlashInfer all-reduce backend for ranks (0,): mnnvl")
    assert "float16" not in first
    assert fp16.startswith(
        "INFO FlashInfer all-reduce backend for ranks (0,): float16: trtllm"
    )
