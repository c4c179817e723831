# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Workspace creation through the patch's wrapper, in one process.

What a creation step does on each rank (joins, exchanges, votes, bounds) is
the fault matrix's (test_step_matrix.py); these are the wrapper's own terms
on a one-rank gloo group, with FlashInfer's constructor faked at the
flashinfer_comm boundary (fi_ar_utils).
"""

import importlib
import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fi_ar_utils import (
    BACKEND_MODULE,
    HIDDEN_DIM,
    MAX_TOKENS,
    _LogCollector,
    build_config,
    workspace_args,
)


def test_a_creation_called_with_keywords_runs_as_a_step(fi_ar, fake_ws, cpu_group):
    """The wrapper binds upstream's arguments by name, however they are
    passed: a call by keyword is created and registered as a positional
    one is."""
    workspace = fi_ar._create_workspace(
        backend="mnnvl",
        world_size=1,
        rank=0,
        max_token_num=MAX_TOKENS,
        hidden_dim=HIDDEN_DIM,
        dtype=torch.bfloat16,
        group=cpu_group,
    )
    assert workspace is not None and workspace.backend == "mnnvl"
    assert fake_ws.sizes == [("mnnvl", MAX_TOKENS)]
    assert fi_ar._fi_ar_workspace_groups[id(workspace)] is cpu_group


@pytest.mark.parametrize("seconds", [None, 45])
def test_the_bound_is_vllms_cpu_group_timeout(fi_ar, cpu_group, seconds):
    """Steps are bounded as vLLM bounds its CPU groups: its
    cpu_distributed_timeout_seconds, else gloo's default."""
    config = build_config()
    config.parallel_config.cpu_distributed_timeout_seconds = seconds
    backend = importlib.import_module(BACKEND_MODULE)
    expected = timedelta(seconds=seconds) if seconds else dist.default_pg_timeout
    assert backend.agreed(cpu_group, config).bound_s() == expected.total_seconds()


def test_the_bound_is_read_at_each_step(fi_ar, cpu_group, monkeypatch):
    """Under fault tolerance vLLM applies its CPU groups' configured timeout
    only once start-up is over (activate_cpu_group_timeouts): a step after
    that is bounded by it, not by the timeout current at the first step."""
    config = build_config()
    config.parallel_config.cpu_distributed_timeout_seconds = 20
    monkeypatch.setattr(config.parallel_config, "enable_fault_tolerance", True)
    utils = importlib.import_module("vllm.distributed.utils")
    monkeypatch.setattr(utils, "_steady_state_entered", False)
    backend = importlib.import_module(BACKEND_MODULE)
    bounds = []

    class RecordedStep:
        nonce, speaker = "", 0

        def __init__(self, store, ranks, rank, what, bound_s, last=""):
            bounds.append(bound_s)

        def run(self, body):
            return backend.Outcome.KEEP, "", body(), None

    monkeypatch.setattr(backend, "Step", RecordedStep)
    fi = backend.agreed(cpu_group, config)
    fi.run("checkpoint_prepare", lambda: None)
    utils.enter_steady_state()  # what activate_cpu_group_timeouts does first
    fi.run("checkpoint_prepare", lambda: None)
    assert bounds == [dist.default_pg_timeout.total_seconds(), 20]


def test_a_trtllm_fallback_is_sized_for_trtllm(fi_ar, fake_ws, cpu_group, monkeypatch):
    """mnnvl's tuned size (a TP8-like 128 MB row at SM100) is not trtllm's:
    the fallback asks for the token count it was given, the fusion table's."""
    monkeypatch.setitem(fi_ar.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB, (100, 2, 1), 128)
    fake_ws.multicast = False
    fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    tuned = 128 * 1024 * 1024 // (HIDDEN_DIM * 2)
    assert fake_ws.sizes == [("mnnvl", tuned), ("trtllm", MAX_TOKENS)]


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


def test_a_dtype_clause_only_once_that_dtype_is_asked_for(
    fi_ar, cpu_group, installed_flashinfer
):
    """On unfixed kernels float16 gets trtllm: a bf16 deployment's start-up
    line says nothing of it; a float16 workspace gets a line of its own."""
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
