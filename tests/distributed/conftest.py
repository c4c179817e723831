# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-process fixtures for the FlashInfer all-reduce module."""

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from fi_ar_utils import (
    BACKEND_MODULE,
    ENV,
    MODULE,
    UNFIXED,
    UNFIXED_FLASHINFER,
    FakeFlashInferDevice,
    FakeWorkspaceFactory,
    build_config,
    free_port,
    namespaces_unavailable,
    pin_gpu,
    reset_log_once,
    run_group,
    write_synthetic_flashinfer,
)

from vllm.config import set_current_vllm_config

# The three- and four-rank group fixtures (about a minute each on 2
# cores). Mutation runs (mutation/cosmic-ray.toml) leave them out with
# `-m "not slow_rank_group"` and rely on the two-rank `one_node` group.
SLOW_RANK_GROUPS = {"two_nodes", "vllm_groups", "three_gpus"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow_rank_group: uses a three- or four-rank group",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_RANK_GROUPS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow_rank_group)


@pytest.fixture(scope="session")
def _cpu_world():
    """A one-rank gloo world for the in-process tests."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def cpu_group(_cpu_world):
    """A new one-rank gloo group: a single node without any collectives.

    New for each test, as for a new engine: the backend is decided once per
    group for the life of the process.
    """
    return dist.new_group(ranks=[0], backend="gloo")


@pytest.fixture
def fi_ar(monkeypatch):
    """The module under test on a Blackwell-like CUDA device, reset after use."""
    module = importlib.import_module(MODULE)
    pin_gpu(monkeypatch, 100)
    FakeFlashInferDevice().install(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    reset_log_once()
    # Workers build communicators inside their vLLM config; HiSparse is off.
    with set_current_vllm_config(build_config()):
        yield module
    module.destroy_fi_ar_workspace()


@pytest.fixture
def policy():
    """The pure backend decision and its known-issue registry."""
    return importlib.import_module(BACKEND_MODULE)


@pytest.fixture
def fake_ws(fi_ar, monkeypatch) -> FakeWorkspaceFactory:
    """FlashInfer's workspace constructor, faked at the flashinfer_comm boundary."""
    factory = FakeWorkspaceFactory()
    monkeypatch.setattr(
        fi_ar.flashinfer_comm, "create_allreduce_fusion_workspace", factory
    )
    return factory


@pytest.fixture
def installed_flashinfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Path]]:
    """Install a synthetic flashinfer-python and/or flashinfer-jit-cache of
    the given versions in front of the real ones, for this test only."""

    def install(**versions: str | None) -> Path:
        root = write_synthetic_flashinfer(tmp_path / "site", **versions)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield install
    sys.modules.pop("flashinfer_jit_cache", None)


@pytest.fixture
def unfixed_kernels(installed_flashinfer: Callable[..., Path]) -> None:
    """flashinfer-python 0.7.2.post1 installed: kernels without the fixes of
    0.7.4, as where an older release is installed over this build."""
    installed_flashinfer(flashinfer=UNFIXED_FLASHINFER)


@pytest.fixture(scope="session")
def one_node() -> list[dict[str, dict[str, Any]]]:
    """Two ranks, TP=2's shape, also with ranks that see different things.

    A two-rank group must agree as a larger one does. Ranks that create
    different workspaces fail the group at once (RanksDiverged); other
    mismatched collectives hang until the timeout.
    """
    sm100_row = {"tuned": [100, 2, 1, 128], "first": "standalone"}
    return run_group(
        [
            {"name": "auto"},
            {"name": "hisparse", "hisparse": "connector", **UNFIXED},
            {"name": "hisparse-fixed", "hisparse": "connector"},
            {"name": "no-multicast", "multicast": False},
            {
                "name": "hisparse-reacquire",
                "hisparse": "connector",
                "reacquire": True,
                **UNFIXED,
            },
            {"name": "env-differs", "per_rank": {"1": {"env": {ENV: "trtllm"}}}},
            {
                "name": "hisparse-differs",
                "per_rank": {"0": {"hisparse": "connector"}},
                **UNFIXED,
            },
            {"name": "fp16", "dtype": "float16", **UNFIXED},
            {"name": "fp16-fixed", "dtype": "float16"},
            {"name": "fp32", "dtype": "float32", "first": "standalone"},
            {"name": "fp16-sm100-row", "dtype": "float16", **UNFIXED, **sm100_row},
            {"name": "bf16-sm100-row", **sm100_row},
            {"name": "bf16-sm100-row-no-multicast", "multicast": False, **sm100_row},
            {
                "name": "fp16-explicit-mnnvl",
                "dtype": "float16",
                "env": {ENV: "mnnvl"},
                **UNFIXED,
            },
            {"name": "mnnvl-fails-on-rank-1", "per_rank": {"1": {"fail": ["mnnvl"]}}},
            {
                "name": "both-fail-on-rank-1",
                "per_rank": {"1": {"fail": ["mnnvl", "trtllm"]}},
            },
            {
                "name": "fails-once-then-destroyed",
                "reacquire": True,
                "per_rank": {"1": {"fail_once": ["mnnvl"]}},
            },
            {
                "name": "hisparse-trtllm-fails-on-rank-1",
                "hisparse": "connector",
                **UNFIXED,
                "per_rank": {"1": {"fail": ["trtllm"]}},
            },
            {
                "name": "kernels-fail-to-load-on-rank-1",
                "env": {ENV: "trtllm"},
                "per_rank": {"1": {"load_fails": ["trtllm"]}},
            },
        ],
        nnodes=1,
        ranks_per_node=2,
        timeout=240,
    )


@pytest.fixture(scope="session")
def two_nodes() -> list[dict[str, dict[str, Any]]]:
    """Two ranks on each of two nodes (a private /dev/shm per node)."""
    if why := namespaces_unavailable():
        pytest.skip(f"two nodes are simulated with mount namespaces: {why}")
    cases: list[dict[str, Any]] = [
        {"name": "auto-100", "capability": 100},
        {"name": "auto-90", "capability": 90},
        {"name": "trtllm", "env": {ENV: "trtllm"}},
        {"name": "mnnvl", "env": {ENV: "mnnvl"}, "capability": 90},
        {"name": "no-fabric-on-rank-3", "per_rank": {"3": {"fabric": False}}},
        {"name": "no-fabric-explicit-mnnvl", "fabric": False, "env": {ENV: "mnnvl"}},
        {"name": "hisparse-fixed", "hisparse": "connector"},
        {"name": "hisparse-reacquire", "hisparse": "connector", "reacquire": True},
    ]
    cases[-1] |= UNFIXED
    cases += [
        {"name": f"hisparse-{m}", "hisparse": m, **UNFIXED}
        for m in ("connector", "multiconnector")
    ]
    return run_group(cases, nnodes=2, ranks_per_node=2)
