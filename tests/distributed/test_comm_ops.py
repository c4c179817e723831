# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce backend selection and workspace lifecycle.

Runs on CPU: real VllmConfig objects, real gloo process groups on loopback,
and the real module; only FlashInfer's workspace constructor and the CUDA
device facts are faked (see fi_ar_utils). Multi-node cases put each node's
ranks in their own mount namespace with a private /dev/shm.

Upstream test plan:
    pytest tests/distributed/test_comm_ops.py \
        -k "flashinfer_auto_backend or workspace_failure or standalone_workspace"
"""

import importlib
import logging
from importlib.metadata import PackageNotFoundError
from typing import Any

import pytest
from fi_ar_utils import (
    ENV,
    GROUP_MODULE,
    CollectiveCounter,
    build_config,
    namespaces_unavailable,
    pin_gpu,
    run_group,
    run_reinit,
    workspace_args,
)

from vllm.config import set_current_vllm_config

HISPARSE_ON = ("connector", "multiconnector", "config")


def _info_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "all-reduce backend" in r.getMessage()
    ]


# --- single node -----------------------------------------------------------


def test_flashinfer_auto_backend_single_node_uses_mnnvl(fi_ar, fake_ws, cpu_group):
    ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == "mnnvl"
    assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("mnnvl", True)
    assert fake_ws.attempts == ["mnnvl"]


def test_flashinfer_auto_backend_single_node_without_multicast_uses_trtllm(
    fi_ar, fake_ws, cpu_group
):
    fake_ws.multicast = False
    ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    quant = fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    assert ws.backend == "trtllm"
    assert quant is ws, "quant fusion must reuse the fallback, not retry mnnvl"
    assert fake_ws.attempts == ["mnnvl", "trtllm"]
    assert "destroy:mnnvl" in fake_ws.log


@pytest.mark.parametrize("setting", ["trtllm", "mnnvl"])
def test_flashinfer_auto_backend_explicit_setting_is_obeyed(
    fi_ar, fake_ws, cpu_group, monkeypatch, setting
):
    monkeypatch.setenv(ENV, setting)
    ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == setting
    assert fi_ar._resolve_fi_ar_backend(cpu_group) == (setting, False)
    assert fake_ws.attempts == [setting]


def test_flashinfer_auto_backend_explicit_mnnvl_does_not_fall_back(
    fi_ar, fake_ws, cpu_group, monkeypatch
):
    monkeypatch.setenv(ENV, "mnnvl")
    fake_ws.multicast = False
    assert fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group)) is None
    assert fake_ws.attempts == ["mnnvl"]


def test_flashinfer_auto_backend_rejects_unknown_setting(fi_ar, cpu_group, monkeypatch):
    monkeypatch.setenv(ENV, "nvlink")
    with pytest.raises(ValueError, match=r"nvlink.*VLLM_FLASHINFER_ALLREDUCE_BACKEND"):
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))


# --- HiSparse, single node -------------------------------------------------


@pytest.mark.parametrize("hisparse", HISPARSE_ON)
def test_flashinfer_auto_backend_hisparse_single_node_uses_trtllm(
    fi_ar, fake_ws, cpu_group, caplog, hisparse
):
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config(hisparse)):
        assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("trtllm", False)
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
        quant = fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    assert ws.backend == "trtllm"
    assert quant is ws
    assert fake_ws.attempts == ["trtllm"], "must never try mnnvl first"
    [line] = _info_lines(caplog)
    assert line.startswith("FlashInfer all-reduce backend for ranks (0,): trtllm (auto")
    for needed in ("race", "flashinfer#7782", ENV):
        assert needed in line


def test_flashinfer_auto_backend_hisparse_logged_once(
    fi_ar, fake_ws, cpu_group, caplog
):
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config("connector")):
        for _ in range(3):
            fi_ar._resolve_fi_ar_backend(cpu_group)
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
        fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    assert len(_info_lines(caplog)) == 1


def test_flashinfer_auto_backend_hisparse_explicit_mnnvl_warns(
    fi_ar, fake_ws, cpu_group, caplog, monkeypatch
):
    monkeypatch.setenv(ENV, "mnnvl")
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == "mnnvl"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("known to crash" in w and "flashinfer#7782" in w for w in warnings)


@pytest.mark.parametrize(
    ("setting", "hisparse"),
    [("trtllm", "off"), ("trtllm", "connector"), ("mnnvl", "off"), (None, "connector")],
)
def test_flashinfer_auto_backend_warns_only_about_a_risky_explicit_setting(
    fi_ar, fake_ws, cpu_group, caplog, monkeypatch, setting, hisparse
):
    """ "Unset the variable" is advice for one who set it into a known bug."""
    if setting is not None:
        monkeypatch.setenv(ENV, setting)
    with set_current_vllm_config(build_config(hisparse)):
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert not [r for r in caplog.records if f"Unset {ENV}" in r.getMessage()]


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


# --- workspace lifecycle ---------------------------------------------------


@pytest.mark.parametrize("getter", ["get_fi_ar_workspace", "get_fi_ar_quant_workspace"])
def test_workspace_failure_is_not_retried(
    fi_ar, fake_ws, cpu_group, monkeypatch, getter
):
    monkeypatch.setenv(ENV, "trtllm")
    fake_ws.fail = {"trtllm"}
    for _ in range(3):
        assert getattr(fi_ar, getter)(**workspace_args(cpu_group)) is None
    assert fake_ws.attempts == ["trtllm"]


def test_workspace_failure_after_fallback_is_not_retried(fi_ar, fake_ws, cpu_group):
    fake_ws.fail = {"mnnvl", "trtllm"}
    for _ in range(3):
        assert fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group)) is None
    assert fake_ws.attempts == ["mnnvl", "trtllm"]


@pytest.mark.parametrize("quant_first", [False, True])
def test_standalone_workspace_shared_with_quant_fusion(
    fi_ar, fake_ws, cpu_group, quant_first
):
    getters = [fi_ar.get_fi_ar_workspace, fi_ar.get_fi_ar_quant_workspace]
    first, second = (
        g(**workspace_args(cpu_group)) for g in getters[:: -1 if quant_first else 1]
    )
    assert first is second
    assert fake_ws.attempts == ["mnnvl"]
    fi_ar.destroy_fi_ar_workspace()
    assert fake_ws.log.count("destroy:mnnvl") == 1


def test_standalone_workspace_checkpoint_covers_shared_workspace_once(
    fi_ar, fake_ws, cpu_group
):
    fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    fi_ar.checkpoint_prepare_fi_ar_workspaces(cpu_group)
    fi_ar.checkpoint_restore_fi_ar_workspaces(cpu_group)
    assert fake_ws.log.count("checkpoint_prepare:mnnvl") == 1
    assert fake_ws.log.count("checkpoint_restore:mnnvl") == 1


@pytest.mark.parametrize("getter", ["get_fi_ar_workspace", "get_fi_ar_quant_workspace"])
def test_flashinfer_auto_backend_hisparse_survives_workspace_destroy(
    fi_ar, fake_ws, cpu_group, caplog, getter
):
    """A destroy (recompile, sleep/wake) must not send HiSparse to mnnvl.

    The workspace may be re-created with no vLLM config current, where
    HiSparse cannot be seen; the group's decision is kept instead.
    """
    caplog.set_level(logging.INFO)
    acquire = getattr(fi_ar, getter)
    with set_current_vllm_config(build_config("connector")):
        assert acquire(**workspace_args(cpu_group)).backend == "trtllm"
    fi_ar.destroy_fi_ar_workspace()
    assert acquire(**workspace_args(cpu_group)).backend == "trtllm"
    assert fake_ws.attempts == ["trtllm", "trtllm"]
    assert len(_info_lines(caplog)) == 1


@pytest.mark.parametrize("hisparse", ["off", "connector"])
def test_standalone_workspace_shared_with_quant_fusion_quietly(
    fi_ar, fake_ws, cpu_group, caplog, hisparse
):
    """Sharing the fusion workspace is not a new one: upstream logs nothing."""
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config(hisparse)):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
        caplog.clear()
        quant = fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    assert quant is ws
    assert not [r for r in caplog.records if "workspace" in r.getMessage()]


# --- real rank groups: one node with two ranks, and two nodes ---------------

requires_namespaces = pytest.mark.skipif(
    (why := namespaces_unavailable()) is not None,
    reason=f"two nodes are simulated with mount namespaces: {why}",
)


@pytest.fixture(scope="module")
def one_node() -> list[dict[str, dict[str, Any]]]:
    """Two ranks, TP=2's shape, also with ranks that see different things.

    A two-rank group must agree and vote as a larger one does. Ranks that
    create different workspaces fail the group at once (RanksDiverged); other
    mismatched collectives hang until the timeout.
    """
    return run_group(
        [
            {"name": "auto"},
            {"name": "hisparse", "hisparse": "connector"},
            {"name": "no-multicast", "multicast": False},
            {"name": "hisparse-reacquire", "hisparse": "connector", "reacquire": True},
            {"name": "env-differs", "per_rank": {"1": {"env": {ENV: "trtllm"}}}},
            {"name": "mnnvl-fails-on-rank-1", "per_rank": {"1": {"fail": ["mnnvl"]}}},
            {
                "name": "hisparse-trtllm-fails-on-rank-1",
                "hisparse": "connector",
                "per_rank": {"1": {"fail": ["trtllm"]}},
            },
        ],
        nnodes=1,
        ranks_per_node=2,
        timeout=120,
    )


@pytest.fixture(scope="module")
def two_nodes() -> list[dict[str, dict[str, Any]]]:
    cases: list[dict[str, Any]] = [
        {"name": "auto-100", "capability": 100},
        {"name": "auto-90", "capability": 90},
        {"name": "trtllm", "env": {ENV: "trtllm"}},
        {"name": "mnnvl", "env": {ENV: "mnnvl"}, "capability": 90},
    ]
    cases += [{"name": f"hisparse-{m}", "hisparse": m} for m in HISPARSE_ON]
    cases += [{"name": "hisparse-reacquire", "hisparse": "config", "reacquire": True}]
    return run_group(cases, nnodes=2, ranks_per_node=2)


def _every_rank(results, case: str) -> list[dict[str, Any]]:
    per_rank = [r[case] for r in results]
    for r in per_rank:
        assert "error" not in r or r["error"].startswith("ValueError"), r.get(
            "traceback"
        )
    return per_rank


@pytest.mark.parametrize(
    ("case", "backend"),
    [("auto", "mnnvl"), ("hisparse", "trtllm"), ("no-multicast", "trtllm")],
)
def test_standalone_workspace_enabled_on_one_node(one_node, case, backend):
    for r in _every_rank(one_node, case):
        assert not r["standalone_disabled"]
        assert r["standalone_ready"]
        assert r["workspace"] == r["quant"] == backend
        assert r["shared"]


@pytest.mark.parametrize("case", ["auto", "hisparse", "no-multicast"])
def test_standalone_workspace_acquisition_counts_nodes_once(one_node, case):
    # Counting nodes is a collective; 0.33.0 repeated it on every resolve.
    for r in _every_rank(one_node, case):
        assert r["node_probes"] == 1


def test_standalone_workspace_hisparse_one_node_never_tries_mnnvl(one_node):
    for r in _every_rank(one_node, "hisparse"):
        assert "create:mnnvl" not in r["log"]


@requires_namespaces
@pytest.mark.parametrize(("capability", "backend"), [(100, "mnnvl"), (90, None)])
def test_flashinfer_auto_backend_multi_node(two_nodes, capability, backend):
    for r in _every_rank(two_nodes, f"auto-{capability}"):
        assert r["workspace"] == r["quant"] == backend
        assert r["standalone_disabled"] is (backend is None)


@requires_namespaces
def test_flashinfer_auto_backend_explicit_mnnvl_across_nodes(two_nodes):
    for r in _every_rank(two_nodes, "mnnvl"):
        assert r["workspace"] == "mnnvl"


@requires_namespaces
def test_flashinfer_auto_backend_explicit_trtllm_across_nodes_raises(two_nodes):
    for r in _every_rank(two_nodes, "trtllm"):
        assert r["error"].startswith("ValueError")
        assert "trtllm" in r["error"] and "mnnvl" in r["error"]
        assert r["log"] == [], "no workspace may be attempted"


@requires_namespaces
@pytest.mark.parametrize("hisparse", HISPARSE_ON)
def test_flashinfer_auto_backend_hisparse_multi_node_is_off(two_nodes, hisparse):
    for r in _every_rank(two_nodes, f"hisparse-{hisparse}"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if "all-reduce backend" in m]
        assert line.startswith("INFO FlashInfer all-reduce backend for ranks")
        assert ": off (auto, HiSparse is on" in line and "flashinfer#7782" in line


@requires_namespaces
def test_standalone_workspace_disabled_without_backend(two_nodes):
    for r in _every_rank(two_nodes, "auto-90"):
        assert r["standalone_disabled"]
        assert r["log"] == []


def _startup_lines(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "all-reduce backend for" in m]


def test_standalone_workspace_hisparse_survives_destroy_on_one_node(one_node):
    for r in _every_rank(one_node, "hisparse-reacquire"):
        assert r["reacquired"] == {
            "standalone_disabled": False,
            "standalone_ready": True,
            "quant": "trtllm",
            "workspace": "trtllm",
        }
        assert "create:mnnvl" not in r["log"]
        assert len(_startup_lines(r)) == 1


@requires_namespaces
def test_flashinfer_auto_backend_hisparse_multi_node_stays_off_after_destroy(
    two_nodes,
):
    for r in _every_rank(two_nodes, "hisparse-reacquire"):
        assert r["reacquired"] == {
            "standalone_disabled": True,
            "standalone_ready": False,
            "quant": None,
            "workspace": None,
        }
        assert r["log"] == [], "no workspace may be attempted"
        assert len(_startup_lines(r)) == 1


def test_flashinfer_auto_backend_two_ranks_that_disagree_turn_it_off(one_node):
    """The error names each rank's own view, so the odd node can be found."""
    for r in _every_rank(one_node, "env-differs"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if m.startswith("ERROR")]
        assert _views(line) == ["mnnvl (may fall back to trtllm)", "trtllm"]
        assert r["resolved"] == [None, False]


def test_workspace_failure_on_one_of_two_ranks_falls_back_on_both(one_node):
    for r in _every_rank(one_node, "mnnvl-fails-on-rank-1"):
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["log"].count("create:mnnvl") == r["log"].count("create:trtllm") == 1


def test_workspace_failure_on_one_of_two_ranks_is_released_on_the_other(one_node):
    rank0, rank1 = _every_rank(one_node, "hisparse-trtllm-fails-on-rank-1")
    for r in (rank0, rank1):
        assert r["workspace"] is None and r["quant"] is None
        assert not r["standalone_ready"]
    assert "destroy:trtllm" in rank0["log"]
    [released] = [m for m in rank0["messages"] if "failed on another rank" in m]
    assert released.startswith("WARNING FlashInfer trtllm all-reduce workspace")
    assert not [m for m in rank1["messages"] if "failed on another rank" in m]


# --- ranks that see different things must still agree ----------------------


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
    results = _every_rank(uneven_ranks, "mnnvl-fails-on-rank-2")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["standalone_ready"]
        assert r["log"].count("create:mnnvl") == r["log"].count("create:trtllm") == 1
    for r in results[:2] + results[3:]:
        assert "destroy:mnnvl" in r["log"], "a workspace the group gave up on"


def test_workspace_failure_on_one_rank_with_hisparse_turns_off_every_rank(
    uneven_ranks,
):
    results = _every_rank(uneven_ranks, "hisparse-trtllm-fails-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert "create:mnnvl" not in r["log"]
        # One attempt each for the fusion and the quant workspace, as in 0.33.0.
        assert r["log"].count("create:trtllm") == 2
    for r in results[:1] + results[2:]:
        assert "destroy:trtllm" in r["log"]


@pytest.mark.parametrize("case", ["env-differs", "hisparse-differs"])
def test_flashinfer_auto_backend_ranks_that_disagree_turn_it_off(uneven_ranks, case):
    for r in _every_rank(uneven_ranks, case):
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


# --- the process outlives its engines ------------------------------------


def test_workspace_destroyed_groups_are_freed_across_reinitialisation():
    """Per-group caches must not keep destroyed groups, nor their gloo state.

    Repeated LLM() creation in one process tears the distributed state down
    and builds it again; each group kept alive leaks gloo threads and sockets.
    """
    reinit = run_reinit(cycles=3)
    assert reinit["alive"] == [False, False, False]
    first, *later = reinit["held"]
    assert all(held == first for held in later), reinit["held"]
