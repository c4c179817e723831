# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The group module: ranks agree on the backend and vote on each creation.

Runs on CPU: real VllmConfig objects, real gloo process groups on loopback,
and the real module; only FlashInfer's workspace constructor and the CUDA
device facts are faked (see fi_ar_utils). What it reads from the platform,
its per-group caches, the agreement and the vote, with ranks that see
different things.
"""

import importlib
from importlib.metadata import PackageNotFoundError
from typing import Any

import pytest
from fi_ar_utils import (
    ENV,
    GROUP_MODULE,
    CollectiveCounter,
    build_config,
    every_rank,
    pin_gpu,
    run_group,
    run_reinit,
    workspace_args,
)

from vllm.config import set_current_vllm_config


def test_flashinfer_auto_backend_one_rank_group_runs_no_collective(
    fi_ar, fake_ws, cpu_group, monkeypatch
):
    """A one-rank group has nobody to agree with or vote against."""
    counter = CollectiveCounter()
    counter.install(monkeypatch)
    assert fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group)).backend == "mnnvl"
    assert counter.collectives == 0


def test_flashinfer_auto_backend_inputs_from_the_platform(fi_ar, monkeypatch):
    """The GPU and FlashInfer facts the decision reads, or None without them."""
    group = importlib.import_module(GROUP_MODULE)
    assert group.device_capability() == 100
    pin_gpu(monkeypatch, None)
    assert group.device_capability() is None

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(group, "version", not_installed)
    assert group.installed_flashinfer_version() is None


def test_flashinfer_auto_backend_hisparse_off_without_current_config(
    fi_ar, fake_ws, cpu_group
):
    with set_current_vllm_config(build_config("off")):
        assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("mnnvl", True)
    assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("mnnvl", True)


@pytest.mark.parametrize("case", ["auto", "hisparse", "no-multicast"])
def test_standalone_workspace_acquisition_counts_nodes_once(one_node, case):
    # Counting nodes is a collective; 0.33.0 repeated it on every resolve.
    for r in every_rank(one_node, case):
        assert r["node_probes"] == 1


def test_flashinfer_auto_backend_two_ranks_that_disagree_turn_it_off(one_node):
    """The error names each rank's own view, so the odd node can be found."""
    for r in every_rank(one_node, "env-differs"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if m.startswith("ERROR")]
        assert _views(line) == ["mnnvl (may fall back to trtllm)", "trtllm"]
        assert r["resolved"] == [None, False]


def test_workspace_failure_on_one_of_two_ranks_falls_back_on_both(one_node):
    for r in every_rank(one_node, "mnnvl-fails-on-rank-1"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["log"].count("create:mnnvl") == r["log"].count("create:trtllm") == 1


@pytest.fixture(scope="module")
def uneven_ranks() -> list[dict[str, dict[str, Any]]]:
    """Four ranks on one node, each case making one rank the odd one out.

    The fake constructor exchanges arguments like FlashInfer's, so ranks that
    go separate ways fail here, where on GPUs they would hang (0.33.0 does).
    """
    return run_group(
        [
            {"name": "mnnvl-fails-on-rank-2", "per_rank": {"2": {"fail": ["mnnvl"]}}},
            {
                "name": "hisparse-trtllm-fails-on-rank-1",
                "hisparse": "connector",
                "per_rank": {"1": {"fail": ["trtllm"]}},
            },
            {"name": "env-differs", "per_rank": {"1": {"env": {ENV: "trtllm"}}}},
            {
                "name": "hisparse-differs",
                "per_rank": {"0": {"hisparse": "connector"}},
            },
        ],
        nnodes=1,
        ranks_per_node=4,
        timeout=180,
    )


def test_workspace_failure_on_one_rank_falls_back_on_every_rank(uneven_ranks):
    results = every_rank(uneven_ranks, "mnnvl-fails-on-rank-2")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["standalone_ready"]
        assert r["log"].count("create:mnnvl") == r["log"].count("create:trtllm") == 1
    for r in results[:2] + results[3:]:
        assert "destroy:mnnvl" in r["log"], "a workspace the group gave up on"


def test_workspace_failure_on_one_rank_with_hisparse_turns_off_every_rank(
    uneven_ranks,
):
    results = every_rank(uneven_ranks, "hisparse-trtllm-fails-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert "create:mnnvl" not in r["log"]
        # One attempt each for the fusion and the quant workspace, as in 0.33.0.
        assert r["log"].count("create:trtllm") == 2
    for r in results[:1] + results[2:]:
        assert "destroy:trtllm" in r["log"]


@pytest.mark.parametrize("case", ["env-differs", "hisparse-differs"])
def test_flashinfer_auto_backend_ranks_that_disagree_turn_it_off(uneven_ranks, case):
    for r in every_rank(uneven_ranks, case):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if m.startswith("ERROR")]
        assert all(f"rank {rank}:" in line for rank in range(4))
        assert ENV in line
        assert (
            _views(line)
            == {
                "env-differs": ["mnnvl (may fall back to trtllm)", "trtllm"]
                + ["mnnvl (may fall back to trtllm)"] * 2,
                "hisparse-differs": ["trtllm"]
                + ["mnnvl (may fall back to trtllm)"] * 3,
            }[case]
        )


def _views(line: str) -> list[str]:
    """Each rank's view, in rank order, from the disagreement error."""
    views = line[line.index("(rank 0: ") + 1 : line.index("). Set")]
    return [view.split(": ", 1)[1] for view in views.split(", rank ")]


def test_workspace_destroyed_groups_are_freed_across_reinitialisation():
    """Per-group caches must not keep destroyed groups, nor their gloo state.

    Repeated LLM() creation in one process tears the distributed state down
    and builds it again; each group kept alive leaks gloo threads and sockets.
    """
    reinit = run_reinit(cycles=3)
    assert reinit["alive"] == [False, False, False]
    first, *later = reinit["held"]
    assert all(held == first for held in later), reinit["held"]
