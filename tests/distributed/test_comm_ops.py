# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce backend selection and workspace lifecycle.

The replaced module, through upstream's entry points: the workspace getters,
FlashInferAllReduce and the checkpoint hooks. Runs on CPU: real VllmConfig
objects, real gloo process groups on loopback, and the real module; only
FlashInfer's workspace constructor and the CUDA device facts are faked (see
fi_ar_utils). Multi-node cases (conftest's two_nodes) put each node's ranks
in their own mount namespace with a private /dev/shm.

Upstream test plan:
    pytest tests/distributed/test_comm_ops.py \
        -k "flashinfer_auto_backend or workspace_failure or standalone_workspace"
"""

import logging
from typing import Any

import pytest
from fi_ar_utils import ENV, build_config, every_rank, workspace_args

from vllm.config import set_current_vllm_config

# vLLM 0.34.0 infers `hisparse_config` from the connector and refuses it
# without one (VllmConfig.__post_init__ in vllm/config/vllm.py).
HISPARSE_ON = ("connector", "multiconnector")


def _info_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "all-reduce backend" in r.getMessage()
    ]


def _startup_lines(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "all-reduce backend for" in m]


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


@pytest.mark.usefixtures("unfixed_kernels")
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
    # One short line: the crash, the issue, and its fix.
    for needed in ("mnnvl crashes with HiSparse", "flashinfer#7782", "fixed in 0.7.4"):
        assert needed in line


@pytest.mark.parametrize("hisparse", HISPARSE_ON)
def test_flashinfer_auto_backend_hisparse_single_node_uses_mnnvl_on_fixed_kernels(
    fi_ar, fake_ws, cpu_group, caplog, hisparse
):
    """The default build's kernels have the fix: no override, no warning."""
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config(hisparse)):
        assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("mnnvl", True)
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == "mnnvl"
    assert fake_ws.attempts == ["mnnvl"]
    [line] = _info_lines(caplog)
    assert line.endswith(": mnnvl (auto, one node)")


@pytest.mark.usefixtures("unfixed_kernels")
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


@pytest.mark.usefixtures("unfixed_kernels")
def test_flashinfer_auto_backend_hisparse_explicit_mnnvl_warns(
    fi_ar, fake_ws, cpu_group, caplog, monkeypatch
):
    monkeypatch.setenv(ENV, "mnnvl")
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == "mnnvl"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"{ENV}=mnnvl; HiSparse is on: mnnvl crashes with HiSparse" in w
        and "flashinfer#7782" in w
        and f"Unset {ENV}" in w
        for w in warnings
    )


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


@pytest.mark.usefixtures("unfixed_kernels")
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


@pytest.mark.parametrize(
    ("case", "backend"),
    [
        ("auto", "mnnvl"),
        ("hisparse", "trtllm"),
        ("hisparse-fixed", "mnnvl"),
        ("no-multicast", "trtllm"),
    ],
)
def test_standalone_workspace_enabled_on_one_node(one_node, case, backend):
    for r in every_rank(one_node, case):
        assert not r["standalone_disabled"]
        assert r["standalone_ready"]
        assert r["workspace"] == r["quant"] == backend
        assert r["shared"]


def test_standalone_workspace_hisparse_one_node_never_tries_mnnvl(one_node):
    for r in every_rank(one_node, "hisparse"):
        assert "create:mnnvl" not in r["log"]


@pytest.mark.parametrize(("capability", "backend"), [(100, "mnnvl"), (90, None)])
def test_flashinfer_auto_backend_multi_node(two_nodes, capability, backend):
    for r in every_rank(two_nodes, f"auto-{capability}"):
        assert r["workspace"] == r["quant"] == backend
        assert r["standalone_disabled"] is (backend is None)


def test_flashinfer_auto_backend_explicit_mnnvl_across_nodes(two_nodes):
    for r in every_rank(two_nodes, "mnnvl"):
        assert r["workspace"] == "mnnvl"


def test_flashinfer_auto_backend_explicit_trtllm_across_nodes_raises(two_nodes):
    for r in every_rank(two_nodes, "trtllm"):
        assert r["error"].startswith("ValueError")
        assert "trtllm" in r["error"] and "mnnvl" in r["error"]
        assert r["log"] == [], "no workspace may be attempted"


@pytest.mark.parametrize("hisparse", HISPARSE_ON)
def test_flashinfer_auto_backend_hisparse_multi_node_is_off(two_nodes, hisparse):
    for r in every_rank(two_nodes, f"hisparse-{hisparse}"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        # The group's rank 0 logs its line, whatever its local rank.
        lines = [m for m in r["messages"] if "all-reduce backend" in m]
        assert len(lines) == (r["rank"] == 0)
        for line in lines:
            assert line.startswith("INFO FlashInfer all-reduce backend for ranks")
            assert ": off (auto, 2 nodes on Blackwell; HiSparse is on: " in line
            assert "flashinfer#7782" in line


def test_flashinfer_auto_backend_hisparse_multi_node_mnnvl_on_fixed_kernels(two_nodes):
    """Across Blackwell nodes, as stock 0.33.0 did before the override."""
    for r in every_rank(two_nodes, "hisparse-fixed"):
        assert r["workspace"] == r["quant"] == "mnnvl"
        assert not r["standalone_disabled"]


def test_standalone_workspace_disabled_without_backend(two_nodes):
    for r in every_rank(two_nodes, "auto-90"):
        assert r["standalone_disabled"]
        assert r["log"] == []


def test_standalone_workspace_hisparse_survives_destroy_on_one_node(one_node):
    for r in every_rank(one_node, "hisparse-reacquire"):
        assert r["reacquired"] == {
            "standalone_disabled": False,
            "standalone_ready": True,
            "quant": "trtllm",
            "workspace": "trtllm",
        }
        assert "create:mnnvl" not in r["log"]
        assert len(_startup_lines(r)) == (r["rank"] == 0)


def test_flashinfer_auto_backend_hisparse_multi_node_stays_off_after_destroy(
    two_nodes,
):
    for r in every_rank(two_nodes, "hisparse-reacquire"):
        assert r["reacquired"] == {
            "standalone_disabled": True,
            "standalone_ready": False,
            "quant": None,
            "workspace": None,
        }
        assert r["log"] == [], "no workspace may be attempted"
        assert len(_startup_lines(r)) == (r["rank"] == 0)


def test_workspace_failure_on_one_of_two_ranks_is_released_on_the_other(one_node):
    rank0, rank1 = every_rank(one_node, "hisparse-trtllm-fails-on-rank-1")
    for r in (rank0, rank1):
        assert r["workspace"] is None and r["quant"] is None
        assert not r["standalone_ready"]
    assert "destroy:trtllm" in rank0["log"]
    # The group's rank 0 logs one line naming the rank that failed: the
    # quant workspace does not try the failed backend again.
    assert not [m for m in rank1["messages"] if "every rank gave it up" in m]
    [line] = [m for m in rank0["messages"] if "every rank gave it up" in m]
    assert line.startswith(
        "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1): "
        "rank 1 failed: Failed to initialize FlashInfer All Reduce workspace: "
        "injected trtllm workspace failure.; every rank gave it up"
    )
    for r in (rank0, rank1):
        assert r["log"].count("create:trtllm") == 1
