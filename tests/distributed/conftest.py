# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-process fixtures for the FlashInfer all-reduce module."""

import importlib

import pytest
import torch.distributed as dist
from fi_ar_utils import (
    ENV,
    MODULE,
    FakeWorkspaceFactory,
    free_port,
    pin_gpu,
    reset_log_once,
)


@pytest.fixture(scope="session")
def cpu_group():
    """A one-rank gloo group: a single node without any collectives."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def fi_ar(monkeypatch):
    """The module under test on a Blackwell-like CUDA device, reset after use."""
    module = importlib.import_module(MODULE)
    pin_gpu(monkeypatch, 100)
    monkeypatch.delenv(ENV, raising=False)
    reset_log_once()
    yield module
    module.destroy_fi_ar_workspace()


@pytest.fixture
def fake_ws(fi_ar, monkeypatch) -> FakeWorkspaceFactory:
    """FlashInfer's workspace constructor, faked at the flashinfer_comm boundary."""
    factory = FakeWorkspaceFactory()
    monkeypatch.setattr(
        fi_ar.flashinfer_comm, "create_allreduce_fusion_workspace", factory
    )
    return factory
