# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The agreement: the ranks of a group agree on the backend once, say so on
the group's own rank 0, and end each creation the same way.

Runs on CPU: real VllmConfig objects, real gloo process groups on loopback,
and the real module; only FlashInfer's workspace constructor and the CUDA
device facts are faked (see fi_ar_utils). How a step ends under faults is
test_step_matrix.py's.
"""

import ast
import importlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import tree_imports
from fi_ar_utils import (
    BACKEND_MODULE,
    ENV,
    FUSION_MAX_SIZE_MB,
    HIDDEN_DIM,
    MODULE,
    UNFIXED,
    every_rank,
    namespaces_unavailable,
    pin_gpu,
    run_group,
    run_reinit,
    write_synthetic_flashinfer,
)

from vllm.config import set_current_vllm_config

# Token counts of a 2-byte row of HIDDEN_DIM: in the fusion table's size for
# TP2, and in the tuned mnnvl row (128 MB) that the sizing cases add.
FUSION_TOKENS = FUSION_MAX_SIZE_MB[2] * 2**20 // (HIDDEN_DIM * 2)
TUNED_TOKENS = 128 * 2**20 // (HIDDEN_DIM * 2)


def _startup_lines(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "all-reduce backend for ranks" in m]


def _rank_0s(results: list[dict[str, Any]], keep: Any = _startup_lines) -> list[str]:
    """The lines `keep` picks: the group's rank 0 logs them, no other rank."""
    for r in results[1:]:
        assert not keep(r), f"rank {r['rank']} logs for the group too"
    return keep(results[0])


def _errors(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if m.startswith("ERROR")]


def _give_ups(r: dict[str, Any]) -> list[str]:
    return [m for m in r["messages"] if "every rank gave it up" in m]


def _alerts(r: dict[str, Any]) -> list[str]:
    """The FlashInfer warnings and errors of a rank's creations."""
    return [
        m
        for m in r["messages"]
        if m.startswith(("WARNING", "ERROR")) and "FlashInfer" in m
    ]


@pytest.mark.parametrize(("capability", "backend"), [(100, "mnnvl"), (None, None)])
def test_the_gpu_is_read_from_the_platform(
    fi_ar, cpu_group, monkeypatch, capability, backend
):
    """Across nodes `auto` needs Blackwell: the platform's capability decides."""
    pin_gpu(monkeypatch, capability)
    monkeypatch.setattr(
        importlib.import_module(BACKEND_MODULE), "_node_count", lambda g: 2
    )
    assert fi_ar._resolve_fi_ar_backend(cpu_group) == (backend, False)


@pytest.mark.usefixtures("unfixed_kernels")
def test_without_a_current_config_hisparse_is_unknown_and_safe(
    fi_ar, fake_ws, cpu_group, caplog
):
    """No config says whether HiSparse is on: take the choice that cannot
    crash, and say so once."""
    with set_current_vllm_config(None):  # type: ignore[arg-type]
        for _ in range(2):
            assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("trtllm", False)
    said = [r for r in caplog.records if "No vLLM config is current" in r.message]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


@pytest.mark.parametrize("case", ["auto", "hisparse", "no-multicast"])
def test_nodes_are_counted_once_per_group(one_node, case):
    # Counting nodes is collective; stock repeats it on every resolve.
    for r in every_rank(one_node, case):
        assert r["node_probes"] == 1


@pytest.mark.parametrize("case", ["auto", "hisparse", "no-multicast"])
def test_the_communicator_loads_no_kernels(one_node, case):
    """Building FlashInferAllReduce, as vLLM does for every TP group, loads
    nothing: trtllm's kernels load for its creation (a JIT build takes
    minutes), mnnvl's for none (its all-reduce calls build them), also where
    mnnvl falls back to trtllm."""
    for r in every_rank(one_node, case):
        assert not r["standalone_disabled"]
        assert r["constructor_loads"] == []
        built = [] if r["workspace"] == "mnnvl" else ["trtllm"]
        assert r["kernel_loads"] == built


def test_float16_workspaces_get_trtllm_on_unfixed_kernels(one_node):
    """The fp16 entry triggers on the workspace's dtype: the group's start-up
    line, then one for float16 as its workspace is asked for, say what each
    gets, and why."""
    results = every_rank(one_node, "fp16")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["standalone_ready"]
        assert "create:mnnvl" not in r["log"]
    group, float16 = _rank_0s(results)
    assert group == (
        "INFO FlashInfer all-reduce backend for ranks (0, 1): mnnvl (auto, one node)"
    )
    assert float16.startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1): float16: trtllm "
        "(auto, one node; the workspace is float16: mnnvl zeroes tokens"
    )
    assert float16.endswith(
        "(mnnvl fp16 RMSNorm overflow; fixed in 0.7.4, not in flashinfer-python "
        "0.7.2.post1))"
    )


def test_float16_workspaces_get_mnnvl_on_fixed_kernels(one_node):
    """The default build's kernels square in fp32: fp16 stays on mnnvl."""
    results = every_rank(one_node, "fp16-fixed")
    for r in results:
        assert r["workspace"] == r["quant"] == "mnnvl"
    [line] = _rank_0s(results)
    assert "float16" not in line


def test_float16_workspace_is_sized_for_trtllm(one_node):
    """With a tuned mnnvl size for the group (an SM100 row), a float16
    workspace that the standalone all-reduce creates first is trtllm, sized
    as stock sizes trtllm (the fusion size table), not with mnnvl's tuned
    size; should_use_fi_ar checks against the same figure."""
    for r in every_rank(one_node, "fp16-sm100-row"):
        assert r["standalone_first"]
        assert r["sizes"] == [["trtllm", FUSION_TOKENS]]
        assert r["standalone_tokens"] == r["workspace_tokens"] == FUSION_TOKENS
    # The same row sizes bfloat16's mnnvl workspace from the tuned table.
    for r in every_rank(one_node, "bf16-sm100-row"):
        assert r["sizes"] == [["mnnvl", TUNED_TOKENS]]
        assert r["standalone_tokens"] == TUNED_TOKENS


def test_a_standalone_fallback_to_trtllm_is_sized_for_trtllm(one_node):
    """The standalone all-reduce reaches the workspace first; mnnvl, created
    at its tuned size, has no multicast: the trtllm fallback is created at
    the fusion table's size, not at mnnvl's tuned one."""
    for r in every_rank(one_node, "bf16-sm100-row-no-multicast"):
        assert r["standalone_first"]
        assert r["sizes"] == [["mnnvl", TUNED_TOKENS], ["trtllm", FUSION_TOKENS]]
        # Its bound follows: no call past it reaches FlashInfer's own check,
        # which would log a warning on every such call.
        assert r["standalone_tokens"] == FUSION_TOKENS


def _after_creation(path: Path) -> list[str]:
    """The statements of FlashInferAllReduce._ensure_workspace in the file
    at `path` that a call runs once its workspace is created."""
    [method] = [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "_ensure_workspace"
    ]
    return [
        ast.unparse(
            s.test
            if isinstance(s, ast.If)
            and ast.unparse(s.test) == "self.max_num_tokens == 0"
            else s
        )
        for s in method.body
    ]


def test_after_creation_a_standalone_call_does_what_stocks_does():
    """The standalone all-reduce's first call resolves its dtype's backend,
    creates the workspace at the fusion pass's size and reads trtllm's bound;
    every later call runs upstream's statements and no others."""
    ours = Path(importlib.import_module(MODULE).__file__ or "")
    stock = tree_imports.stock_root() / f"{MODULE.replace('.', '/')}.py"
    assert _after_creation(ours) == _after_creation(stock)


@pytest.mark.parametrize(
    ("case", "backend"),
    [("auto", "mnnvl"), ("fp16", "trtllm"), ("fp16-fixed", "mnnvl"), ("fp32", "mnnvl")],
)
def test_every_dtypes_workspace_serves_the_standalone_all_reduce(
    one_node, case, backend
):
    for r in every_rank(one_node, case):
        assert r["workspace"] == r["quant"] == backend and r["shared"]
        assert r["standalone_ready"] and r["standalone_tokens"] > 0


def test_explicit_mnnvl_for_float16_is_obeyed_with_one_warning(one_node):
    results = every_rank(one_node, "fp16-explicit-mnnvl")
    for r in results:
        assert r["workspace"] == r["quant"] == "mnnvl"
    # The group's line, then the warning as the float16 workspace, which
    # runs into the issue, is asked for.
    group, warning = _rank_0s(results)
    assert group.startswith("INFO ") and "float16" not in group
    assert [warning] == [m for m in results[0]["messages"] if m.startswith("WARN")]
    assert warning.startswith(
        "WARNING FlashInfer all-reduce backend for ranks (0, 1): float16: mnnvl "
        f"({ENV}=mnnvl; the workspace is float16: mnnvl zeroes"
    )
    assert warning.endswith(f"Unset {ENV} to let vLLM pick a safe backend.")


@pytest.fixture(scope="module")
def three_gpus() -> list[dict[str, dict[str, Any]]]:
    """Three ranks on one node whose GPUs are not all NVLink-connected, with
    HiSparse on kernels without the fixes."""
    case = {"hisparse": "connector", "nvlink": False, **UNFIXED}
    rank_0 = {"0": {"env": {ENV: "trtllm"}}}
    return run_group(
        [
            {"name": "auto", **case},
            {"name": "trtllm-on-rank-0", **case, "per_rank": rank_0},
        ],
        nnodes=1,
        ranks_per_node=3,
        timeout=180,
    )


def test_the_line_names_why_each_candidate_went(three_gpus):
    """A known issue took each of auto's candidates: the line names both."""
    results = every_rank(three_gpus, "auto")
    for r in results:
        assert r["workspace"] is None and r["log"] == []
    [line] = _rank_0s(results)
    assert line.startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1, 2): off (auto, one "
        "node; HiSparse is on: mnnvl crashes with HiSparse"
    )
    assert line.endswith(
        "0.7.2.post1); more than two GPUs are not all NVLink-connected: trtllm "
        "runs over PCIe, up to 34 times slower than no fusion (vllm#48075, "
        "vllm#48071, sglang#32330))"
    )


def test_ranks_that_would_run_different_backends_are_off(three_gpus):
    """Before the NVLink probe every rank takes trtllm: rank 0 as it is set
    to, ranks 1 and 2 as HiSparse rules mnnvl out. After it, auto is off, the
    setting still trtllm: every rank is off, with the one error."""
    results = every_rank(three_gpus, "trtllm-on-rank-0")
    for r in results:
        assert r["resolved"] == [None, False]
        assert r["log"] == [], "no workspace may be attempted"
    [line] = _rank_0s(results, _errors)
    assert line == (
        "ERROR FlashInfer all-reduce is off for ranks [0, 1, 2]: ranks 1, 2 chose "
        f"other backends than rank 0. Make these the same on every node: {ENV}, "
        "the HiSparse config, the GPU and the FlashInfer packages."
    )


@pytest.mark.parametrize("case", ["env-differs", "hisparse-differs"])
def test_two_ranks_that_disagree_turn_it_off(one_node, case):
    """Rank 1 sets the backend (or HiSparse, rank 0) where rank 0 does not:
    both are off, with one error on the group's rank 0 saying what to align."""
    results = every_rank(one_node, case)
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [], "no workspace may be attempted"
        assert r["resolved"] == [None, False]
    [line] = _rank_0s(results, _errors)
    assert line == (
        "ERROR FlashInfer all-reduce is off for ranks [0, 1]: rank 1 chose other "
        f"backends than rank 0. Make these the same on every node: {ENV}, the "
        "HiSparse config, the GPU and the FlashInfer packages."
    )


def test_a_failure_on_one_of_two_ranks_falls_back_on_both(one_node):
    """Rank 0 destroys the mnnvl workspace it made; both fall back. What
    failed, where, and what the group does now is said once, by the group's
    rank 0: vLLM's own fallback line, which says less, is not said as well."""
    results = every_rank(one_node, "mnnvl-fails-on-rank-1")
    for r in results:
        assert r["workspace"] == r["quant"] == "trtllm"
        assert r["standalone_ready"]
        assert r["log"].count("create:mnnvl") == r["log"].count("create:trtllm") == 1
    assert "destroy:mnnvl" in results[0]["log"]
    [line] = _rank_0s(results, _alerts)
    assert line == (
        "WARNING FlashInfer mnnvl all-reduce workspace for ranks (0, 1): rank 1 "
        "failed: Failed to initialize FlashInfer All Reduce workspace: injected "
        "mnnvl workspace failure.; every rank gave it up and falls back to trtllm."
    )


def test_kernels_failing_to_load_on_one_rank_give_trtllm_up_on_every_rank(one_node):
    """trtllm's kernels load before its creation: a build that fails on rank
    1 ends it there before any attempt, and on rank 0 at its first exchange,
    in seconds, in the one line of the group's rank 0."""
    results = every_rank(one_node, "kernels-fail-to-load-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["seconds"] < 30
    assert results[1]["log"] == [], "never attempted where its kernels are missing"
    [line] = _rank_0s(results, _give_ups)
    assert line == (
        "WARNING FlashInfer trtllm all-reduce workspace for ranks (0, 1): rank 1 "
        "failed: could not load its kernels: RuntimeError: injected trtllm "
        "kernel build failure; every rank gave it up and FlashInfer all-reduce "
        "is off for these ranks."
    )


def test_a_multi_node_group_with_a_fabric_gets_mnnvl(two_nodes):
    for r in every_rank(two_nodes, "auto-100"):
        assert r["workspace"] == r["quant"] == "mnnvl"
        assert r["fabric_probes"] == 1, "probed once per group"


def test_auto_is_off_across_nodes_without_a_fabric_on_every_rank(two_nodes):
    results = every_rank(two_nodes, "no-fabric-on-rank-3")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["standalone_disabled"]
        assert r["log"] == [] and r["kernel_loads"] == []
    [line] = _rank_0s(results)
    assert line == (
        "INFO FlashInfer all-reduce backend for ranks (0, 1, 2, 3): off (auto, "
        "2 nodes on Blackwell; FlashInfer finds no NVLink fabric on rank 3)"
    )


def test_explicit_mnnvl_across_nodes_without_a_fabric_is_off(two_nodes):
    results = every_rank(two_nodes, "no-fabric-explicit-mnnvl")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert r["log"] == [], "no workspace may be attempted"
    [line] = _rank_0s(results)
    assert line.startswith(
        "INFO FlashInfer all-reduce backend for ranks (0, 1, 2, 3): off "
        f"({ENV}=mnnvl; FlashInfer finds no NVLink fabric on ranks 0, 1, 2, 3)"
    )


@pytest.fixture(scope="module")
def fi074_older_provider(tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    """One rank on each of two nodes with flashinfer-python 0.7.4 and a 0.7.4
    jit-cache shim listing a 0.7.2.post1 provider (synthetic, first on
    PYTHONPATH)."""
    if why := namespaces_unavailable():
        pytest.skip(f"two nodes are simulated with mount namespaces: {why}")
    site = write_synthetic_flashinfer(
        tmp_path_factory.mktemp("fi074") / "site",
        flashinfer="0.7.4",
        jit_cache="0.7.4",
        providers=[{"distribution": "fi-cu129", "version": "0.7.2.post1"}],
    )
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        return run_group(
            [{"name": "hisparse", "hisparse": "connector"}, {"name": "auto"}],
            nnodes=2,
            ranks_per_node=1,
            timeout=120,
        )


def test_hisparse_across_nodes_counts_an_older_provider(fi074_older_provider):
    """The provider's kernels may run: off, and the line names it; without
    HiSparse, mnnvl as on any release."""
    results = every_rank(fi074_older_provider, "hisparse")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
    [line] = _rank_0s(results)
    assert ": off (auto, 2 nodes on Blackwell; HiSparse is on: " in line
    assert line.endswith(
        "(flashinfer#7782; fixed in 0.7.4, not in fi-cu129 0.7.2.post1))"
    )
    for r in every_rank(fi074_older_provider, "auto"):
        assert r["workspace"] == r["quant"] == "mnnvl"


def test_destroyed_groups_are_freed_across_reinitialisation():
    """Per-group state must not keep destroyed groups, nor make process
    groups, gloo threads or sockets of its own: repeated LLM() in one
    process tears the model-parallel state down and builds it again."""
    reinit = run_reinit(cycles=3)
    assert reinit["alive"] == [False, False, False]
    first, *later = reinit["held"]
    assert all(held == first for held in later), reinit["held"]


def test_two_failures_are_two_warnings_and_no_error(one_node):
    """mnnvl, then its trtllm fallback, fail on rank 1: one line each, and the
    quant workspace tries neither again nor says more."""
    results = every_rank(one_node, "both-fail-on-rank-1")
    for r in results:
        assert r["workspace"] is None and r["quant"] is None
        assert [e for e in r["log"] if e.startswith("create:")] == [
            "create:mnnvl",
            "create:trtllm",
        ]
    mnnvl, trtllm = _rank_0s(results, _alerts)
    assert mnnvl.endswith("every rank gave it up and falls back to trtllm.")
    assert trtllm.startswith("WARNING FlashInfer trtllm all-reduce workspace")
    assert trtllm.endswith(
        "every rank gave it up and FlashInfer all-reduce is off for these ranks."
    )


def test_a_backend_that_failed_is_tried_again_after_destroy(one_node):
    """As upstream resets its failed flags: a transient failure (an OOM, say)
    does not disable mnnvl for the process's life, across sleep/wake or a
    weight reload."""
    for r in every_rank(one_node, "fails-once-then-destroyed"):
        assert r["workspace"] == "trtllm"
        assert r["reacquired"]["workspace"] == "mnnvl"
        assert r["reacquired"]["standalone_ready"]


def test_an_off_backend_is_not_resolved_on_every_call(fi_ar, cpu_group, monkeypatch):
    """The eager fused paths ask for the workspace every layer, every step:
    with FlashInfer all-reduce off, the answer is kept, as a failure's is."""
    from fi_ar_utils import workspace_args

    pin_gpu(monkeypatch, 90)  # two Hopper nodes: auto has no backend
    monkeypatch.setattr(
        importlib.import_module(BACKEND_MODULE), "_node_count", lambda group: 2
    )
    resolved: list[Any] = []
    resolve = fi_ar._resolve_fi_ar_backend
    monkeypatch.setattr(
        fi_ar, "_resolve_fi_ar_backend", lambda *a: resolved.append(a) or resolve(*a)
    )
    for _ in range(3):
        assert fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group)) is None
        assert fi_ar.get_fi_ar_quant_workspace(**workspace_args(cpu_group)) is None
    assert len(resolved) == 2


def test_the_resolved_backend_given_is_the_one_created(fi_ar, fake_ws, cpu_group):
    """The standalone all-reduce passes the backend it sized for."""
    from fi_ar_utils import workspace_args

    args = workspace_args(cpu_group, world_size=1)
    assert fi_ar.get_fi_ar_workspace(**args, resolved_backend=("trtllm", False))
    assert fake_ws.attempts == ["trtllm"]


def test_no_config_says_so_only_where_it_moves_the_backend(fi_ar, cpu_group, caplog):
    """On kernels with the fixes, HiSparse on or off gets the same backend."""
    with set_current_vllm_config(None):  # type: ignore[arg-type]
        assert fi_ar._resolve_fi_ar_backend(cpu_group) == ("mnnvl", True)
    assert not [r for r in caplog.records if "No vLLM config" in r.message]
