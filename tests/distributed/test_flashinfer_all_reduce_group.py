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
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError
from typing import Any

import pytest
from fi_ar_utils import (
    ENV,
    GROUP_MODULE,
    INSTALLED_MODULE,
    CollectiveCounter,
    build_config,
    every_rank,
    namespaces_unavailable,
    pin_gpu,
    run_group,
    run_reinit,
    workspace_args,
    write_synthetic_flashinfer,
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

    installed = importlib.import_module(INSTALLED_MODULE)
    monkeypatch.setattr(installed, "version", not_installed)
    assert installed.installed_flashinfer_version() is None


VERSION_CHECK = "FLASHINFER_DISABLE_VERSION_CHECK"


def test_flashinfer_jit_cache_is_read_as_flashinfer_reads_it(
    fi_ar, installed_flashinfer, monkeypatch
):
    """The version of an importable `flashinfer_jit_cache` module, or None."""
    installed = importlib.import_module(INSTALLED_MODULE)
    assert installed.installed_flashinfer_jit_cache_version() is None
    installed_flashinfer(jit_cache="0.7.2.post1+cu129")
    assert installed.installed_flashinfer_jit_cache_version() == "0.7.2.post1+cu129"


@pytest.mark.parametrize(
    "init", ["raise RuntimeError('broken shim')\n", "VERSION = '0.7.4'\n"]
)
def test_a_flashinfer_jit_cache_flashinfer_cannot_read_counts_as_none(
    fi_ar, tmp_path, monkeypatch, init
):
    """FlashInfer's own import fails on it, so none of its kernels run."""
    installed = importlib.import_module(INSTALLED_MODULE)
    package = tmp_path / "flashinfer_jit_cache"
    package.mkdir()
    (package / "__init__.py").write_text(init)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer_jit_cache", raising=False)
    try:
        assert installed.installed_flashinfer_jit_cache_version() is None
    finally:
        sys.modules.pop("flashinfer_jit_cache", None)


@pytest.mark.parametrize(
    ("value", "check"), [(None, True), ("", True), ("1", False), ("0", False)]
)
def test_flashinfer_version_check_is_read_as_flashinfer_reads_it(
    fi_ar, monkeypatch, value, check
):
    """Any non-empty value turns FlashInfer's check off, "0" included."""
    installed = importlib.import_module(INSTALLED_MODULE)
    if value is None:
        monkeypatch.delenv(VERSION_CHECK, raising=False)
    else:
        monkeypatch.setenv(VERSION_CHECK, value)
    assert installed.flashinfer_version_check() is check


def test_jit_cache_providers_are_read_as_flashinfer_reads_them(
    fi_ar, installed_flashinfer
):
    """Each entry of the shim's `get_jit_cache_providers()`, with the fields
    FlashInfer's loader reads; what an entry does not say stays None."""
    installed = importlib.import_module(INSTALLED_MODULE)
    installed_flashinfer(
        jit_cache="0.7.4",
        providers=[
            {
                "distribution": "flashinfer-jit-cache-cu129",
                "version": "0.7.2.post1",
                "modules": ["trtllm_mnnvl_comm"],
                "cuda_architectures": ["sm100a", "sm103a"],
            },
            {"distribution": "flashinfer-jit-cache-other", "version": "0.7.4"},
        ],
    )
    policy = importlib.import_module(f"{GROUP_MODULE[: -len('_group')]}_policy")
    assert installed.installed_flashinfer_jit_cache_providers() == (
        policy.FiJitCacheProvider(
            "flashinfer-jit-cache-cu129",
            "0.7.2.post1",
            frozenset({"trtllm_mnnvl_comm"}),
            frozenset({"sm100a", "sm103a"}),
        ),
        policy.FiJitCacheProvider("flashinfer-jit-cache-other", "0.7.4"),
    )


def test_a_prebuilt_module_in_flashinfer_itself_is_found(fi_ar, tmp_path, monkeypatch):
    """flashinfer/data/aot/trtllm_mnnvl_comm/trtllm_mnnvl_comm.so, which
    FlashInfer's `get_aot_artifacts` loads first."""
    installed = importlib.import_module(INSTALLED_MODULE)
    assert installed.installed_flashinfer_aot_module() is False
    module = tmp_path / "flashinfer" / "data" / "aot" / "trtllm_mnnvl_comm"
    module.mkdir(parents=True)
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    (module / "trtllm_mnnvl_comm.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    for name in [m for m in sys.modules if m.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    assert installed.installed_flashinfer_aot_module() is True


def _startup_line(caplog) -> str:
    [line] = [r.getMessage() for r in caplog.records if "backend for" in r.getMessage()]
    return line


@pytest.mark.parametrize("release", ["0.7.4", "0.7.4.post1", "0.8.0"])
def test_hisparse_gets_mnnvl_on_an_installed_flashinfer_with_the_fix(
    fi_ar, fake_ws, cpu_group, caplog, installed_flashinfer, monkeypatch, release
):
    monkeypatch.delenv(VERSION_CHECK, raising=False)
    installed_flashinfer(flashinfer=release)
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
        quant = fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group))
    assert ws.backend == "mnnvl" and quant is ws
    assert fake_ws.attempts == ["mnnvl"]
    line = _startup_line(caplog)
    assert line.startswith("FlashInfer all-reduce backend for ranks (0,): mnnvl (auto")
    assert (
        "the flashinfer#7782 override is retired: the kernels of flashinfer-python "
        f"{release} have the fix" in line
    )


@pytest.mark.parametrize("release", ["0.7.2.post1", "0.7.3"])
def test_hisparse_on_an_installed_flashinfer_without_the_fix_names_it(
    fi_ar, fake_ws, cpu_group, caplog, installed_flashinfer, release
):
    installed_flashinfer(flashinfer=release)
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config("connector")):
        assert fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group)).backend == (
            "trtllm"
        )
    line = _startup_line(caplog)
    assert line.endswith(
        f"on the kernels of flashinfer-python {release} (flashinfer#7782, fixed in "
        "FlashInfer 0.7.4; details: python -m vllm.explain_flashinfer_all_reduce))"
    )


@pytest.mark.parametrize("version_check", ["on", "off"])
def test_hisparse_counts_the_older_jit_cache_flashinfer_would_load(
    fi_ar, fake_ws, cpu_group, caplog, installed_flashinfer, monkeypatch, version_check
):
    """0.7.4's Python, with the version check off, runs the kernels of an
    installed 0.7.2.post1 jit-cache, race included."""
    installed_flashinfer(flashinfer="0.7.4", jit_cache="0.7.2.post1+cu129")
    if version_check == "off":
        monkeypatch.setenv(VERSION_CHECK, "1")
    else:
        monkeypatch.delenv(VERSION_CHECK, raising=False)
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    line = _startup_line(caplog)
    if version_check == "on":
        assert ws.backend == "mnnvl"
        assert "retired" in line
        return
    assert ws.backend == "trtllm"
    assert fake_ws.attempts == ["trtllm"]
    assert (
        "on the kernels of flashinfer-jit-cache 0.7.2.post1+cu129 "
        f"({VERSION_CHECK} is set) (flashinfer#7782" in line
    )


@pytest.fixture(scope="module")
def fi074_two_nodes(tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    """One rank on each of two nodes, with flashinfer-python 0.7.4 and an
    older flashinfer-jit-cache installed (a synthetic one, first on
    PYTHONPATH); each case is a new group."""
    if (why := namespaces_unavailable()) is not None:
        pytest.skip(f"two nodes are simulated with mount namespaces: {why}")
    site = write_synthetic_flashinfer(
        tmp_path_factory.mktemp("fi074") / "site",
        flashinfer="0.7.4",
        jit_cache="0.7.2.post1+cu129",
    )
    cases = [
        {"name": "hisparse", "hisparse": "connector"},
        {
            "name": "hisparse-jit-cache-unchecked",
            "hisparse": "connector",
            "env": {VERSION_CHECK: "1"},
        },
    ]
    return _run_group_on(site, cases, nnodes=2, ranks_per_node=1)


def _run_group_on(site, cases, **shape) -> list[dict[str, dict[str, Any]]]:
    """`run_group` with the synthetic FlashInfer at `site` first on
    PYTHONPATH and FlashInfer's version check on unless a case says."""
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        patch.delenv(VERSION_CHECK, raising=False)
        return run_group(cases, timeout=120, **shape)


def test_hisparse_multi_node_blackwell_gets_mnnvl_on_flashinfer_0_7_4(
    fi074_two_nodes,
):
    for r in every_rank(fi074_two_nodes, "hisparse"):
        assert r["workspace"] == r["quant"] == "mnnvl"
        assert not r["standalone_disabled"]
        [line] = [m for m in r["messages"] if "all-reduce backend for" in m]
        assert ": mnnvl (auto, 2 nodes on Blackwell" in line
        assert (
            "override is retired: the kernels of flashinfer-python 0.7.4 have the fix"
            in line
        )


def test_hisparse_multi_node_stays_off_on_an_older_jit_cache(
    fi074_two_nodes,
):
    for r in every_rank(fi074_two_nodes, "hisparse-jit-cache-unchecked"):
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == [], "no workspace may be attempted"
        [line] = [m for m in r["messages"] if "all-reduce backend for" in m]
        assert ": off (auto, HiSparse is on" in line
        assert "flashinfer-jit-cache 0.7.2.post1+cu129" in line


# A 0.7.4 shim listing a 0.7.2.post1 provider of the MNNVL module for SM100.
OLDER_PROVIDER = {
    "distribution": "flashinfer-jit-cache-cu129",
    "version": "0.7.2.post1",
    "modules": ["trtllm_mnnvl_comm"],
    "cuda_architectures": ["sm100a"],
}


@pytest.fixture(scope="module")
def fi074_older_provider(tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    """Two ranks of one node with flashinfer-python 0.7.4, a 0.7.4
    jit-cache shim and a 0.7.2.post1 provider (synthetic, first on
    PYTHONPATH); each case is a new group."""
    site = write_synthetic_flashinfer(
        tmp_path_factory.mktemp("fi074-provider") / "site",
        flashinfer="0.7.4",
        jit_cache="0.7.4",
        providers=[OLDER_PROVIDER],
    )
    cases = [
        {"name": "checked", "hisparse": "connector"},
        {"name": "unchecked", "hisparse": "connector", "env": {VERSION_CHECK: "1"}},
        {
            "name": "check-differs",
            "hisparse": "connector",
            "per_rank": {"1": {"env": {VERSION_CHECK: "1"}}},
        },
    ]
    return _run_group_on(site, cases, nnodes=1, ranks_per_node=2)


def test_hisparse_counts_the_provider_whose_kernels_run(fi074_older_provider):
    """Unchecked, FlashInfer loads the 0.7.2.post1 provider's racy MNNVL
    kernel: trtllm, and the line names that provider; checked, FlashInfer
    ignores it and 0.7.4's own kernels run."""
    for r in every_rank(fi074_older_provider, "unchecked"):
        assert r["workspace"] == r["quant"] == "trtllm"
        [line] = [m for m in r["messages"] if "all-reduce backend for" in m]
        assert "retired" not in line
        assert (
            "mnnvl crashes with HiSparse on the kernels of flashinfer-jit-cache-cu129 "
            f"0.7.2.post1 ({VERSION_CHECK} is set) (flashinfer#7782" in line
        )
    for r in every_rank(fi074_older_provider, "checked"):
        assert r["workspace"] == r["quant"] == "mnnvl"


def test_disagreement_names_every_input_the_ranks_compare(fi074_older_provider):
    """Ranks apart only in FLASHINFER_DISABLE_VERSION_CHECK: off, and the
    line names each input that can set them apart."""
    for r in every_rank(fi074_older_provider, "check-differs"):
        assert r["workspace"] is None and r["quant"] is None
        [line] = [m for m in r["messages"] if m.startswith("ERROR")]
        assert line.endswith(
            f"Make these the same on every node: {ENV}, the HiSparse config, the "
            "GPU, the flashinfer-python release, the flashinfer-jit-cache release "
            f"and its providers' releases, and whether {VERSION_CHECK} is set."
        )


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
    views = line[line.index("(rank 0: ") + 1 : line.index("). Make")]
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
