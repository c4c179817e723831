# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The explain module answers as `vllm serve` and start-up would.

It reads the serve options with vLLM's parsers, mirrors what a missing
multicast or an unknown GPU does, runs as a script without a GPU, and
generates the docs' decision table.
"""

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tree_imports
from fi_ar_utils import (
    ENV,
    GROUP_MODULE,
    pin_gpu,
    workspace_args,
)

# What users run; it starts the explain module's main.
EXPLAIN_COMMAND_MODULE = "vllm.explain_flashinfer_all_reduce"
STANDALONE_ENV = "VLLM_ALLREDUCE_USE_FLASHINFER"
# The documented JSON answer (docs/configuration/flashinfer_all_reduce.md).
ANSWER_KEYS = {
    "state",
    "known_issue_detail",
    "backend",
    "depends_on",
    "by_gpu",
    "allow_trtllm_fallback",
    "reason",
    "known_issue",
    "if_no_multicast",
    "error",
    "used_by",
    "assumed",
    "inputs",
    "warnings",
}

HISPARSE = {
    "kv_connector": "HiSparseConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"host_pool_gib": 64},
}


# How explain words a refusal of vLLM's config; vLLM's own words follow.
REFUSES = "vllm serve refuses this deployment: "
# VllmConfig's refusals of a HiSparse deployment (vllm/config/vllm.py in
# vllm 0.33.0) and what explain does with each. Written out, so that a
# release that adds, drops or rewords one fails
# test_explain_knows_every_hisparse_refusal_of_vllm_config.
VLLM_REFUSALS = {
    "full-cudagraph": (
        "HiSparse does not support cudagraph_mode=FULL; use FULL_AND_PIECEWISE "
        "(the default), which captures FULL graphs for decode batches."
    ),
    "model-runner-v1": (
        "HiSparse requires Model Runner V2; remove VLLM_USE_V2_MODEL_RUNNER=0."
    ),
    "hma": (
        "HiSparse requires the hybrid KV cache manager; remove "
        "--disable-hybrid-kv-cache-manager or use connectors that support HMA."
    ),
}
# The ones that depend on what explain is not given (docs: "What explain
# cannot know"), each with the option vllm serve takes for it.
VLLM_REFUSALS_EXPLAIN_CANNOT_SEE = {
    "HiSparse currently requires NVIDIA CUDA.": "the platform",
    "HiSparse does not support pipeline parallelism.": "--pipeline-parallel-size",
    "HiSparse does not support decode context parallelism.": (
        "--decode-context-parallel-size"
    ),
    "HiSparse requires --scheduler-reserve-full-isl; remove "
    "--no-scheduler-reserve-full-isl.": "--no-scheduler-reserve-full-isl",
    "HiSparse is only supported for DSA models with index_topk.": "the model",
}


def _multi(*connectors) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(connectors)},
    }


def _run(explain, capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of one explain run."""
    try:
        status = explain.main(list(argv))
    except SystemExit as e:
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _errors(err: str) -> list[str]:
    """explain's error lines, without what torch logs the first time a test
    in this process imports its extension helpers (the command holds it)."""
    return [line for line in err.splitlines() if line.startswith("error:")]


def _json(explain, capsys, *argv: str) -> dict:
    status, out, err = _run(explain, capsys, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def _serve_options_and_engine(kv_transfer_config, attention_config):
    """explain's arguments for these configs, and the VllmConfig vLLM builds
    from them (on CPU, with the hybrid KV cache manager HiSparse needs)."""
    from vllm.config import (
        AttentionConfig,
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )

    argv = []
    kwargs = {}
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    if attention_config is not None:
        argv += ["--attention-config", json.dumps(attention_config)]
        kwargs["attention_config"] = AttentionConfig(**attention_config)
    engine = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig.default_factory(
            disable_hybrid_kv_cache_manager=False
        ),
        **kwargs,
    )
    return argv, engine


def test_explain_expands_human_readable_numbers_as_vllm_serve_does(explain, capsys):
    """HiSparse's own number: 4K rows (4096), bare, which JSON alone refuses."""
    explained = _json(
        explain,
        capsys,
        *("--kv-transfer-config", json.dumps(HISPARSE)),
        *("--attention-config", '{"hisparse_config": {"device_buffer_size": 4K}}'),
    )
    assert explained["inputs"]["hisparse"] is True


def test_explain_takes_dotted_serve_options(explain, capsys):
    explained = _json(
        explain,
        capsys,
        *("--kv-transfer-config.kv_connector", "HiSparseConnector"),
        *("--kv-transfer-config.kv_role", "kv_both"),
        *("--kv-transfer-config.kv_connector_extra_config.host_pool_gib", "64"),
    )
    assert explained["inputs"]["hisparse"] is True


@pytest.mark.parametrize(
    ("kv_transfer_config", "attention_config"),
    [
        (None, None),
        (HISPARSE, None),
        (
            _multi(
                HISPARSE, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
            ),
            None,
        ),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, None),
        (HISPARSE, {"hisparse_config": {"device_buffer_size": 4096}}),
        (None, {"backend": "FLASHINFER"}),
    ],
)
def test_explain_and_the_engine_agree_on_hisparse(
    explain, capsys, kv_transfer_config, attention_config
):
    argv, engine = _serve_options_and_engine(kv_transfer_config, attention_config)
    explained = _json(explain, capsys, *argv)
    engine_hisparse = engine.attention_config.hisparse_config is not None
    assert explained["inputs"]["hisparse"] is engine_hisparse


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(_multi("HiSparseConnector")),
        json.dumps({**_multi(), "kv_connector_extra_config": {"connectors": None}}),
        json.dumps(_multi({"kv_connector": "HiSparseConnector"})),
        json.dumps({"kv_connector": "HiSparseConnector"}),
        "{not json",
    ],
    ids=[
        "connector-name-string",
        "connectors-null",
        "child-without-role",
        "without-role",
        "not-json",
    ],
)
def test_explain_rejects_what_vllm_serve_rejects_in_one_line(explain, capsys, text):
    status, out, err = _run(explain, capsys, "--kv-transfer-config", text)
    assert status == 2
    assert out == ""
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1
    assert "error: invalid --kv-transfer-config: " in error_lines[0]
    assert "Traceback" not in err and "_hisparse_in" not in err


def test_explain_rejects_hisparse_beside_a_connector_without_hma(
    explain, capsys, monkeypatch
):
    """vllm serve turns the hybrid KV cache manager off for such a
    connector, and HiSparse then refuses to start."""
    from vllm.platforms import current_platform

    # Connector modules import CUDA kernels on a CUDA platform; explain
    # runs where there is none.
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    status, _, err = _run(
        explain, capsys, "--kv-transfer-config", json.dumps(_multi(HISPARSE, example))
    )
    assert status == 2
    assert _errors(err) == [f"error: {REFUSES}{VLLM_REFUSALS['hma']}"]
    status, _, _ = _run(
        explain, capsys, "--kv-transfer-config", json.dumps(_multi(example))
    )
    assert status == 0
    # explain's stand-in for a CUDA platform is gone once it has judged.
    assert current_platform.is_cuda() is False


def test_explain_rejects_a_bad_attention_config_in_one_line(explain, capsys):
    status, _, err = _run(
        explain, capsys, "--attention-config", '{"hisparse_config": {"bogus": 1}}'
    )
    assert status == 2
    assert "error: invalid --attention-config: hisparse_config.bogus" in err


@pytest.mark.parametrize("inside_multi", [False, True])
@pytest.mark.parametrize("name", ["NoSuchConnector", "HiSparseConector"])
def test_explain_refuses_a_connector_vllm_does_not_know(
    explain, capsys, inside_multi, name
):
    """A misspelt connector stops vllm serve; it gets no answer, least of
    all mnnvl, the backend that crashes with HiSparse."""
    unknown = {**HISPARSE, "kv_connector": name}
    config = json.dumps(_multi(unknown) if inside_multi else unknown)
    for argv in (("--capability", "10.0"), ("--capability", "10.0", "--json")):
        status, out, err = _run(explain, capsys, "--kv-transfer-config", config, *argv)
        assert status == 2
        assert _errors(err) == [f"error: {REFUSES}Unsupported connector type: {name}"]
        assert "mnnvl" not in out


def test_explain_loads_vllms_plugins_before_judging_a_connector(
    explain, capsys, monkeypatch
):
    """A general plugin may register a connector, as under vllm serve."""
    import vllm.plugins

    loaded = []
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(
        vllm.plugins,
        "load_plugins_by_group",
        lambda group: {"site": lambda: loaded.append(group)},
    )
    _json(explain, capsys, "--capability", "10.0")
    assert loaded == [vllm.plugins.DEFAULT_PLUGINS_GROUP]


def test_explain_trusts_a_plugin_connector_it_cannot_import(explain, capsys):
    """A connector named by module path loads on the serve machine, not here."""
    plugin = {
        "kv_connector": "SiteConnector",
        "kv_connector_module_path": "site_kv_plugin.connector",
        "kv_role": "kv_both",
    }
    explained = _json(
        explain, capsys, "--kv-transfer-config", json.dumps(_multi(HISPARSE, plugin))
    )
    assert explained["inputs"]["hisparse"] is True
    [warning] = explained["warnings"]
    assert warning.startswith(
        "--kv-transfer-config: a KV connector's module does not import here"
    )


def test_explain_hisparse_flag_does_not_contradict_the_serve_options(explain, capsys):
    status, _, err = _run(
        explain, capsys, "--no-hisparse", "--kv-transfer-config", json.dumps(HISPARSE)
    )
    assert status == 2
    assert "cannot be combined" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("--backend", "mnnvl", "--no-multicast"),
        ("--nnodes", "2", "--capability", "10.0", "--no-multicast"),
        ("--backend", "mnnvl", "--hisparse", "--no-multicast"),
    ],
)
def test_explain_mnnvl_without_multicast_is_off(explain, capsys, monkeypatch, argv):
    """Start-up cannot create the mnnvl workspace and does not fall back."""
    monkeypatch.delenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", raising=False)
    status, out, _ = _run(explain, capsys, *argv)
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: off\n")
    assert "multicast" in out.splitlines()[1]


def test_explain_mnnvl_without_multicast_keeps_the_known_issue(explain, capsys):
    """Turned off for multicast, the choice still names the bug it risked."""
    explained = _json(
        explain, capsys, "--backend", "mnnvl", "--hisparse", "--no-multicast"
    )
    assert explained["backend"] is None
    assert explained["allow_trtllm_fallback"] is False
    assert explained["known_issue"] == "flashinfer#7782"


def test_explain_says_what_a_missing_multicast_would_do(explain, capsys):
    status, out, _ = _run(explain, capsys, "--backend", "mnnvl")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: mnnvl (off if no multicast)")


def test_explain_with_known_multicast_gives_one_answer(explain, capsys):
    """The what-if for a missing multicast is only for when it is unknown."""
    status, out, _ = _run(explain, capsys, "--backend", "auto", "--multicast")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: mnnvl\n")
    explained = _json(explain, capsys, "--backend", "auto", "--multicast")
    assert explained["if_no_multicast"] is None


@pytest.mark.parametrize(
    ("text", "capability"),
    [
        ("9.0", 90),
        ("10.0", 100),
        ("12.1", 121),
        ("90", 90),
        ("100", 100),
        ("sm90", 90),
        ("sm_100", 100),
        ("SM120", 120),
        # SM50 is the oldest that CUDA 12 supports.
        ("5.0", 50),
        ("sm50", 50),
    ],
)
def test_explain_capability_forms(explain, capsys, text, capability):
    explained = _json(explain, capsys, "--capability", text)
    assert explained["inputs"]["device_capability"] == capability


@pytest.mark.parametrize(
    "text", ["9.10", "10", "9", "1.0", "sm_90a", "1000", "09.0", "4.9", "sm49"]
)
def test_explain_refuses_ambiguous_capabilities(explain, capsys, text):
    status, out, err = _run(explain, capsys, "--capability", text)
    assert status == 2
    assert out == ""
    assert "is not a compute capability" in err


def test_explain_without_a_gpu_says_the_answer_depends_on_it(
    explain, capsys, monkeypatch
):
    monkeypatch.delenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", raising=False)
    pin_gpu(monkeypatch, None)
    status, out, _ = _run(explain, capsys, "--nnodes", "2")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: depends on the GPU\n")
    assert "--capability" in out
    assert "on Blackwell (SM100+), off otherwise" in out
    explained = _json(explain, capsys, "--nnodes", "2")
    assert explained["depends_on"] == "device_capability"
    assert explained["by_gpu"]["SM100+"]["backend"] == "mnnvl"
    assert explained["by_gpu"]["below SM100"]["backend"] is None
    # Where the GPU does not matter, the answer stays definite.
    explained = _json(explain, capsys, "--nnodes", "2", "--hisparse")
    assert explained["depends_on"] is None and explained["backend"] is None
    assert explained["known_issue"] == "flashinfer#7782"


def test_explain_without_a_gpu_reports_no_capability(explain, capsys, monkeypatch):
    """The GPU classes tried are stand-ins; the inputs say there is no GPU."""
    pin_gpu(monkeypatch, None)
    for argv in (("--hisparse",), ("--nnodes", "2", "--hisparse")):
        explained = _json(explain, capsys, *argv)
        assert explained["depends_on"] is None
        assert explained["inputs"]["device_capability"] is None


@pytest.mark.parametrize("nnodes", ["0", "-1"])
def test_explain_refuses_fewer_than_one_node(explain, capsys, nnodes):
    status, out, err = _run(explain, capsys, "--nnodes", nnodes)
    assert status == 2
    assert out == ""
    assert "--nnodes must be at least 1" in err


def test_explain_usage_error_under_json_still_prints_json(explain, capsys):
    status, out, err = _run(explain, capsys, "--json", "--capability", "9.10")
    assert status == 2
    assert "is not a compute capability" in json.loads(out)["usage_error"]
    assert "error: argument --capability" in err


def test_explain_documents_its_exit_statuses(explain, capsys):
    status, out, _ = _run(explain, capsys, "--help")
    assert status == 0
    assert "exit status:" in out
    # The numbers main() and argparse return.
    for line in (
        "  0  vLLM would start",
        "  1  start-up would fail",
        "  2  usage error",
    ):
        assert line in out


def _text_line(out: str, label: str) -> str:
    """The line of explain's text answer that starts with `label`."""
    (line,) = [line for line in out.splitlines() if line.startswith(f"  {label}: ")]
    return line


def test_explain_text_names_every_input(explain, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("VLLM_ALLREDUCE_USE_FLASHINFER", raising=False)
    _, out, _ = _run(
        explain,
        capsys,
        *("--nnodes", "2", "--capability", "10.0", "--hisparse", "--multicast"),
        *("--flashinfer-version", "0.7.2.post1", "-tp", "16", "--no-fabric"),
    )
    assert _text_line(out, "inputs") == (
        f"  inputs: {ENV}=auto, 2 node(s), TP 16, GPU SM100, HiSparse on, "
        "multicast yes, NVLink fabric no, VLLM_ALLREDUCE_USE_FLASHINFER=1, "
        "fuse_allreduce_rms default, flashinfer-python 0.7.2.post1"
    )
    pin_gpu(monkeypatch, None)
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    _, out, _ = _run(
        explain,
        capsys,
        *("--no-multicast", "--flashinfer-version", ""),
        *("-cc", '{"pass_config": {"fuse_allreduce_rms": false}}'),
    )
    assert _text_line(out, "inputs") == (
        f"  inputs: {ENV}=auto, 1 node(s), TP unknown, GPU unknown, HiSparse off, "
        "multicast no, VLLM_ALLREDUCE_USE_FLASHINFER=0, fuse_allreduce_rms false, "
        "VLLM_BATCH_INVARIANT=1, flashinfer-python not installed"
    )


VERSION_CHECK = "FLASHINFER_DISABLE_VERSION_CHECK"


@pytest.mark.parametrize("nnodes", ["1", "2"])
def test_explain_hisparse_with_and_without_the_flashinfer_fix(
    explain, capsys, monkeypatch, nnodes
):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(VERSION_CHECK, raising=False)
    argv = ("--nnodes", nnodes, "--capability", "10.0", "--hisparse")
    _, unfixed, _ = _run(explain, capsys, *argv, "--flashinfer-version", "0.7.2.post1")
    status, fixed, _ = _run(explain, capsys, *argv, "--flashinfer-version", "0.7.4")
    assert status == 0
    assert unfixed.startswith(
        f"FlashInfer all-reduce backend: {'trtllm' if nnodes == '1' else 'off'}\n"
    )
    assert _text_line(unfixed, "to get the fix").startswith(
        "  to get the fix: install this build on FlashInfer 0.7.4: from its "
        "source tree, `pip install -C flashinfer=0.7.4 .`; for an image built "
        "from its sdist, make the sdist with "
        "`python -m build --sdist -C flashinfer=0.7.4`"
    )
    assert "The default stays on vLLM's tested pin, 0.7.2.post1" in unfixed
    assert _text_line(unfixed, "override") == (
        f"  override: {ENV}=mnnvl forces mnnvl, the backend that crashes with "
        "HiSparse here"
    )
    assert fixed.startswith("FlashInfer all-reduce backend: mnnvl")
    assert (
        "flashinfer#7782 override is retired: the kernels of flashinfer-python "
        "0.7.4 have the fix" in fixed
    )
    assert "to get the fix" not in fixed


def test_explain_counts_an_older_jit_cache_only_without_the_version_check(
    explain, capsys, monkeypatch
):
    """As FlashInfer: a jit-cache of another release is ignored unless
    FLASHINFER_DISABLE_VERSION_CHECK is set in the environment."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(VERSION_CHECK, raising=False)
    argv = ("--capability", "10.0", "--hisparse", "--flashinfer-version", "0.7.4")
    argv += ("--flashinfer-jit-cache-version", "0.7.2.post1+cu129")
    _, checked, _ = _run(explain, capsys, *argv)
    assert checked.startswith("FlashInfer all-reduce backend: mnnvl")
    assert checked.splitlines()[-1].endswith(
        "flashinfer-python 0.7.4, flashinfer-jit-cache 0.7.2.post1+cu129"
    )
    monkeypatch.setenv(VERSION_CHECK, "1")
    _, unchecked, _ = _run(explain, capsys, *argv)
    assert unchecked.startswith("FlashInfer all-reduce backend: trtllm\n")
    assert (
        "mnnvl crashes with HiSparse on the kernels of flashinfer-jit-cache "
        f"0.7.2.post1+cu129 ({VERSION_CHECK} is set)" in unchecked
    )
    assert unchecked.splitlines()[-1].endswith(
        f"flashinfer-jit-cache 0.7.2.post1+cu129, {VERSION_CHECK} set"
    )
    explained = _json(explain, capsys, *argv)
    assert explained["inputs"]["flashinfer_jit_cache_version"] == "0.7.2.post1+cu129"
    assert explained["inputs"]["flashinfer_version_check"] is False


def test_explain_takes_the_installed_jit_cache_by_default(
    explain, capsys, installed_flashinfer
):
    installed_flashinfer(jit_cache="0.7.4+cu129")
    explained = _json(explain, capsys)
    assert explained["inputs"]["flashinfer_jit_cache_version"] == "0.7.4+cu129"
    explained = _json(explain, capsys, "--flashinfer-jit-cache-version", "")
    assert explained["inputs"]["flashinfer_jit_cache_version"] is None


def test_decision_table_shows_auto_with_and_without_the_fix(explain):
    table = explain.fi_ar_decision_table()
    rows = [line.split(" | ")[:7] for line in table.splitlines()[2:]]
    auto_hisparse_two_nodes = [
        (row[5], row[6])
        for row in rows
        if row[:5] == ["| `auto`", "2", "yes", "SM100", "on"]
    ]
    assert auto_hisparse_two_nodes == [
        ("< 0.7.4", "off"),
        (">= 0.7.4", "mnnvl (off if no multicast)"),
    ]
    assert ["| `auto`", "1", "n/a", "SM100", "off", "any"] in [row[:6] for row in rows]


def test_decision_table_shows_multi_node_mnnvl_without_a_fabric_off(explain):
    table = explain.fi_ar_decision_table()
    rows = [line.split(" | ")[:7] for line in table.splitlines()[2:]]
    assert table.splitlines()[0].startswith(
        "| `VLLM_FLASHINFER_ALLREDUCE_BACKEND` | Nodes | Fabric | GPU |"
    )
    by_fabric = {
        row[2]: row[6]
        for row in rows
        if row[:2] == ["| `auto`", "2"] and row[3:6] == ["SM100", "off", "any"]
    }
    assert by_fabric == {"yes": "mnnvl (off if no multicast)", "no": "off"}
    # Where fabric changes nothing, one row says so.
    assert ["| `auto`", "2", "any", "SM90", "off", "any", "off"] in rows


@pytest.mark.parametrize(
    ("argv", "backend", "fabric"),
    [
        ([], "mnnvl", None),
        (["--fabric"], "mnnvl", True),
        (["--no-fabric"], None, False),
    ],
)
def test_explain_takes_fabric_support_unknown_by_default(
    explain, capsys, argv, backend, fabric
):
    explained = _json(explain, capsys, "--nnodes", "2", "--capability", "10.0", *argv)
    assert explained["backend"] == backend
    assert explained["inputs"]["fabric"] is fabric
    assert (explain.FABRIC_ASSUMED in explained["assumed"]) is (fabric is None)
    if fabric is False:
        assert "needs an NVLink fabric" in explained["reason"]


@pytest.mark.parametrize(
    ("fixed_in", "worlds"),
    [
        ((None,), [("any", None)]),
        (("0.7.4", None), [("< 0.7.4", None), (">= 0.7.4", "0.7.4")]),
        (
            ("0.10.0", "0.7.4", None, "0.7.4"),
            [
                ("< 0.7.4", None),
                (">= 0.7.4, < 0.10.0", "0.7.4"),
                (">= 0.10.0", "0.10.0"),
            ],
        ),
    ],
)
def test_decision_table_has_one_flashinfer_range_per_fix(
    explain, policy, monkeypatch, fixed_in, worlds
):
    """Each fix release starts a range of releases, in release order."""
    [issue] = policy.FI_AR_KNOWN_ISSUES
    issues = tuple(dataclasses.replace(issue, fixed_in=v) for v in fixed_in)
    monkeypatch.setattr(explain, "FI_AR_KNOWN_ISSUES", issues)
    assert explain.flashinfer_worlds() == worlds


DOCS = tree_imports.REPO_ROOT / "docs" / "configuration" / "flashinfer_all_reduce.md"


TABLE_BEGIN = "<!-- decision-table:begin -->\n"


TABLE_END = "<!-- decision-table:end -->"


HISPARSE_MULTI_CONNECTOR = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "HiSparseConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"host_pool_gib": 64},
                }
            ]
        },
    }
)


def test_explain_hisparse_one_node_is_trtllm(explain, capsys):
    status, out, _ = _run(explain, capsys, "--capability", "10.0", "--hisparse")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: trtllm\n")
    assert "flashinfer#7782" in _text_line(out, "why")
    assert f"  override: {ENV}=mnnvl forces mnnvl, the backend that crashes" in out


def test_explain_hisparse_two_nodes_is_off(explain, capsys):
    status, out, _ = _run(
        explain,
        capsys,
        *("--nnodes", "2", "--capability", "10.0"),
        *("--kv-transfer-config", HISPARSE_MULTI_CONNECTOR, "--json"),
    )
    explained = json.loads(out)
    assert status == 0
    assert explained["backend"] is None
    assert explained["known_issue"] == "flashinfer#7782"
    assert explained["inputs"]["hisparse"] is True


def test_explain_uses_the_environment_and_flags_a_failing_start(
    explain, capsys, monkeypatch
):
    monkeypatch.setenv(ENV, "trtllm")
    status, out, _ = _run(explain, capsys, "--nnodes", "2")
    assert status == 1
    assert "cannot span nodes" in out


def test_explain_rejects_bad_input(explain, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        explain.main(["--kv-transfer-config", "{not json"])
    assert "invalid --kv-transfer-config" in capsys.readouterr().err
    monkeypatch.setenv(ENV, "nvlink")
    with pytest.raises(SystemExit):
        explain.main([])
    assert "Valid options" in capsys.readouterr().err


def test_docs_decision_table_matches_the_code(explain, deployment):
    page = DOCS.read_text()
    start = page.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    documented = page[start : page.index(TABLE_END, start)]
    assert documented == explain.fi_ar_decision_table(), (
        f"{DOCS.name} is out of date; regenerate its table with "
        f"`{deployment.EXPLAIN_COMMAND} --table`"
    )


def _hisparse_connector(extra_config: dict) -> dict:
    return {
        "kv_connector": "HiSparseConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ("--capability", "10.0"),
        ("--nnodes", "2"),
        ("-tp", "1"),
        ("--backend", "trtllm", "--nnodes", "2", "--capability", "9.0"),
    ],
    ids=["plain", "depends-on-the-gpu", "not-used", "start-up-fails"],
)
def test_explain_json_has_the_same_keys_in_every_answer(
    explain, capsys, monkeypatch, argv
):
    monkeypatch.delenv(ENV, raising=False)
    pin_gpu(monkeypatch, None)
    _, out, _ = _run(explain, capsys, *argv, "--json")
    answer = json.loads(out)
    assert set(answer) == ANSWER_KEYS
    if answer["depends_on"] is None:
        assert answer["by_gpu"] is None
    else:
        assert answer["backend"] is None and answer["used_by"] is None
        for per_gpu in answer["by_gpu"].values():
            assert set(per_gpu) == ANSWER_KEYS - {"warnings"}


@pytest.mark.parametrize(
    "argv",
    [
        ("--nnodes", "0"),
        ("--capability", "9.10"),
        ("--no-such-option",),
        ("--kv-transfer-config", "{not json"),
        ("--attention-config", '{"hisparse_config": {"bogus": 1}}'),
        ("-cc", '{"pass_config": {"fuse_allreduce_rms": 3}}'),
        ("-tp", "1", "--nnodes", "2"),
        ("-tp", "0"),
    ],
)
def test_explain_usage_error_is_one_line(explain, capsys, argv):
    """No usage block: the one line says what is wrong; JSON says the same."""
    status, out, err = _run(explain, capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    status, out, json_err = _run(explain, capsys, *argv, "--json")
    assert status == 2 and json_err == err
    assert json.loads(out) == {"usage_error": err.removeprefix("error: ").rstrip()}


@pytest.mark.parametrize("name", [STANDALONE_ENV, "VLLM_BATCH_INVARIANT"])
def test_explain_refuses_a_switch_vllm_cannot_read(explain, capsys, monkeypatch, name):
    monkeypatch.setenv(name, "yes")
    status, out, err = _run(explain, capsys)
    assert status == 2 and out == ""
    assert err.startswith(f"error: {name} in the environment must be 0 or 1")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("kv_transfer_config", "attention_config"),
    [
        (_hisparse_connector({}), None),
        (_hisparse_connector({"host_pool_gib": -1}), None),
        (_hisparse_connector({"host_pool_gib": 0}), None),
        (_hisparse_connector({"host_pool_gib": "plenty"}), None),
        (_multi(HISPARSE, HISPARSE), None),
        (_multi(_hisparse_connector({})), None),
        (None, {"hisparse_config": {}}),
    ],
    ids=[
        "no-host-pool",
        "negative",
        "zero",
        "not-a-number",
        "two-connectors",
        "child-without-host-pool",
        "no-connector",
    ],
)
def test_explain_refuses_the_host_pools_vllm_refuses(
    explain, capsys, kv_transfer_config, attention_config
):
    """Start-up's own check, on the engine's own config, says why."""
    from vllm.v1.hisparse.layout import get_hisparse_host_pool_bytes

    argv, engine = _serve_options_and_engine(kv_transfer_config, attention_config)
    with pytest.raises(ValueError) as refused:
        get_hisparse_host_pool_bytes(engine)
    status, out, err = _run(explain, capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("error: invalid --") and err.count("\n") == 1
    assert err.endswith(f": {refused.value}\n")


def test_explain_prints_the_error_start_up_raises(
    fi_ar, explain, capsys, cpu_group, fake_ws, monkeypatch
):
    """Explicit trtllm across nodes: explain and the docs say what start-up
    raises, in the same words."""
    group = importlib.import_module(GROUP_MODULE)
    monkeypatch.setattr(group, "_node_count", lambda pg: 2)
    monkeypatch.setenv(ENV, "trtllm")
    with pytest.raises(ValueError) as raised:
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert fake_ws.attempts == []
    status, out, _ = _run(explain, capsys, "--nnodes", "2")
    assert status == 1
    assert _text_line(out, "why") == f"  why: {raised.value}"
    assert _json_any(explain, capsys, "--nnodes", "2")["error"] == str(raised.value)
    assert f" | {raised.value} |\n" in DOCS.read_text()


def _json_any(explain, capsys, *argv: str) -> dict:
    """The JSON answer whatever the exit status."""
    _, out, _ = _run(explain, capsys, *argv, "--json")
    return json.loads(out)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (("-tp", "1"), "TP size 1 has no all-reduce"),
        (("-tp", "6"), "vLLM has no FlashInfer all-reduce size for TP 6 on SM100"),
        (
            ("-tp", "8", "--capability", "12.0"),
            "vLLM has no FlashInfer all-reduce size for TP 8 on SM120",
        ),
        (
            ("-tp", "16", "--nnodes", "2", "--capability", "9.0", "--backend", "mnnvl"),
            "vLLM has no FlashInfer all-reduce size for TP 16 on SM90",
        ),
        (
            ("-tp", "6", "--nnodes", "2", "--backend", "trtllm"),
            "vLLM has no FlashInfer all-reduce size for TP 6 on SM100",
        ),
    ],
    ids=["tp1", "tp6", "sm120", "tp16-on-hopper", "trtllm-unused"],
)
def test_explain_is_off_where_no_path_runs(explain, capsys, argv, why):
    """Nothing creates a workspace, so nothing fails either."""
    status, out, _ = _run(explain, capsys, *argv, "--hisparse")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: off\n")
    assert _text_line(out, "why") == f"  why: FlashInfer all-reduce is not used: {why}"
    answer = _json(explain, capsys, *argv, "--hisparse")
    assert answer["backend"] is None and answer["error"] is None
    assert {path["on"] for path in answer["used_by"].values()} == {False}


def test_explain_trtllm_across_nodes_fails_only_where_a_path_runs(
    explain, capsys, monkeypatch
):
    """TP 16 has FlashInfer sizes on Blackwell only: elsewhere nothing
    creates a workspace, so nothing raises."""
    monkeypatch.delenv(ENV, raising=False)
    pin_gpu(monkeypatch, None)
    argv = ("--backend", "trtllm", "--nnodes", "2", "-tp", "16")
    status, out, _ = _run(explain, capsys, *argv, "--json")
    answer = json.loads(out)
    assert status == 1
    assert answer["depends_on"] == "device_capability"
    assert answer["by_gpu"]["below SM100"]["backend"] is None
    assert answer["by_gpu"]["below SM100"]["error"] is None
    assert answer["error"] == answer["by_gpu"]["SM100+"]["error"]
    assert answer["error"].startswith("Flashinfer allreduce is not supported")


def test_explain_reads_the_switch_of_each_path(explain, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    both_off = ("-tp", "8", "-cc", '{"pass_config": {"fuse_allreduce_rms": false}}')
    monkeypatch.setenv(STANDALONE_ENV, "0")
    answer = _json(explain, capsys, *both_off)
    assert answer["used_by"]["standalone"] == {
        "on": False,
        "why": f"{STANDALONE_ENV}=0",
    }
    assert answer["used_by"]["fusion_pass"] == {
        "on": False,
        "why": "fuse_allreduce_rms is false",
    }
    # A model that fuses all-reduce itself still uses it, with no switch.
    assert answer["used_by"]["model"]["on"] is None
    assert answer["backend"] == "mnnvl"
    _, out, _ = _run(explain, capsys, *both_off)
    assert out.startswith(
        "FlashInfer all-reduce backend: mnnvl (trtllm if no multicast; only in a "
        "model that fuses all-reduce itself)\n"
    )
    # HiSparse serves DSA models, which do.
    answer = _json(explain, capsys, *both_off, "--hisparse")
    assert answer["used_by"]["model"]["on"] is True
    assert answer["backend"] == "trtllm"
    monkeypatch.setenv(STANDALONE_ENV, "1")
    answer = _json(
        explain,
        capsys,
        *("-tp", "8", "--compilation-config.pass_config.fuse_allreduce_rms", "false"),
    )
    assert answer["used_by"]["standalone"]["on"] is True
    assert answer["used_by"]["fusion_pass"]["on"] is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    answer = _json(explain, capsys, "-tp", "8")
    assert answer["used_by"]["standalone"]["on"] is False
    assert answer["used_by"]["fusion_pass"]["on"] is False


@pytest.mark.parametrize("capability", [80, 89, 90, 100, 103, 110, 120])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_explain_takes_vllms_default_for_the_fusion_pass(
    explain, capsys, monkeypatch, capability, tp
):
    """What VllmConfig sets `fuse_allreduce_rms` to at vllm serve's -O2."""
    import vllm.utils.flashinfer
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.platforms import current_platform

    pin_gpu(monkeypatch, capability)
    # A node with a GPU per rank, and FlashInfer's kernels usable.
    monkeypatch.setattr(
        type(current_platform),
        "device_count",
        classmethod(lambda cls: tp),
        raising=False,
    )
    monkeypatch.setattr(vllm.utils.flashinfer, "has_flashinfer", lambda: True)
    engine = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    answer = _json(explain, capsys, "-tp", str(tp), "--capability", str(capability))
    fused = answer["used_by"]["fusion_pass"]["on"]
    assert fused is engine.compilation_config.pass_config.fuse_allreduce_rms


def test_explain_defaults_are_vllm_serves(deployment, monkeypatch):
    """What explain takes for switches nobody gave: vllm serve's own."""
    monkeypatch.delenv(STANDALONE_ENV, raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert deployment.usage_from_serve_options(None, None) == deployment.DEFAULT_USAGE


def test_explain_prints_each_paths_state_and_only_what_it_assumed(
    explain, capsys, monkeypatch
):
    monkeypatch.setenv(STANDALONE_ENV, "0")
    argv = ["-tp", "8", "--capability", "10.0"]
    argv += ["-cc", json.dumps({"pass_config": {"fuse_allreduce_rms": True}})]
    status, out, _ = _run(explain, capsys, *argv)
    assert status == 0
    assert _text_line(out, "used by") == (
        "  used by: standalone all-reduce: no (VLLM_ALLREDUCE_USE_FLASHINFER=0); "
        "fusion pass: yes; model's own fusion: depends on the model "
        "(DeepSeek-V3.2, GLM-5.2 and MiniMax M3 fuse all-reduce + RMSNorm in "
        "their own code, which no switch turns off)"
    )
    # Every switch, the TP size and the GPU were given: nothing is assumed.
    assert "  assumed:" not in out
    _, out, _ = _run(explain, capsys, *argv, "--hisparse")
    assert _text_line(out, "assumed").startswith("  assumed: a DSA model")


def test_explain_fusion_pass_is_off_by_default_beyond_vllms_gpus(explain, capsys):
    """vLLM fuses by default on SM90 and SM10x only, also where a size is set."""
    size = json.dumps({"pass_config": {"fi_allreduce_fusion_max_size_mb": 64}})
    answer = _json(explain, capsys, "-tp", "8", "--capability", "12.0", "-cc", size)
    assert answer["used_by"]["fusion_pass"] == {
        "on": False,
        "why": "off by default on SM120",
    }


def test_explain_answer_where_no_path_runs_has_no_fallback(explain, capsys):
    answer = _json(explain, capsys, "-tp", "1", "--capability", "10.0")
    assert answer["backend"] is None
    assert answer["allow_trtllm_fallback"] is False


def test_explain_refuses_a_tp_size_below_one(explain, capsys):
    status, out, err = _run(explain, capsys, "-tp", "0")
    assert (status, out) == (2, "")
    assert err == "error: --tensor-parallel-size must be at least 1\n"


def test_explain_without_a_gpu_takes_the_fusion_pass_default_as_on(explain):
    """Asked directly, with no GPU known: vLLM's default on its own GPUs."""
    from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
        FiArBackendInputs,
    )

    inputs = FiArBackendInputs("auto", 1, None, False, "0.7.2.post1")
    used_by = explain.explain_fi_ar_backend(inputs)["used_by"]
    assert used_by["fusion_pass"] == {"on": True, "why": None}
    assert used_by["standalone"] == {"on": True, "why": None}


def _vllm_config_refusal(monkeypatch, case: str) -> str:
    """What the real VllmConfig raises for `case`, built as on a CUDA GPU."""
    from pydantic import ValidationError

    from vllm.config import (
        AttentionConfig,
        CompilationConfig,
        DeviceConfig,
        KVTransferConfig,
        VllmConfig,
    )
    from vllm.config.attention import HiSparseConfig

    pin_gpu(monkeypatch, 100)
    kwargs: dict = {
        "attention_config": AttentionConfig(hisparse_config=HiSparseConfig())
    }
    if case == "full-cudagraph":
        kwargs["compilation_config"] = CompilationConfig(cudagraph_mode="FULL")
    if case == "hma":
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )
        from vllm.platforms import current_platform

        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
        # Connector modules import CUDA kernels on a CUDA platform: import it
        # as on this machine first, as explain does.
        with monkeypatch.context() as here:
            here.setattr(type(current_platform), "is_cuda", lambda self: False)
            multi = KVTransferConfig(**_multi(HISPARSE, example))
            KVConnectorFactory.supports_hma_config(multi)
        kwargs = {"kv_transfer_config": multi}
    if case == "model-runner-v1":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    try:
        config = VllmConfig(device_config=DeviceConfig(device="cpu"), **kwargs)
        _ = config.use_v2_model_runner
    except ValidationError as e:
        [error] = e.errors()
        return str(error["ctx"]["error"])
    except ValueError as e:
        return str(e)
    raise AssertionError(f"VllmConfig took {case}")


REFUSAL_ARGV = {
    "full-cudagraph": ("--hisparse", "-cc", '{"cudagraph_mode": "FULL"}'),
    "model-runner-v1": ("--hisparse",),
    "hma": (
        "--kv-transfer-config",
        json.dumps(
            _multi(HISPARSE, {"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(VLLM_REFUSALS))
def test_explain_refuses_what_vllm_config_refuses_in_its_words(
    explain, capsys, monkeypatch, case
):
    """One line, exit 2, vLLM's text; with --json, the same as JSON."""
    from vllm.platforms import current_platform

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert _vllm_config_refusal(monkeypatch, case) == VLLM_REFUSALS[case]
    monkeypatch.undo()
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    if case == "model-runner-v1":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    argv = ("--capability", "10.0", *REFUSAL_ARGV[case])
    status, out, err = _run(explain, capsys, *argv)
    assert (status, out) == (2, "")
    assert _errors(err) == [f"error: {REFUSES}{VLLM_REFUSALS[case]}"]
    status, out, _ = _run(explain, capsys, *argv, "--json")
    assert status == 2
    assert json.loads(out) == {"usage_error": f"{REFUSES}{VLLM_REFUSALS[case]}"}


def _hisparse_refusals_in(source: str) -> set[str]:
    """The messages VllmConfig raises under a test of `hisparse_config`."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.If) and "hisparse_config" in ast.unparse(node.test)
        ):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Raise) and isinstance(inner.exc, ast.Call):
                parts = [a for a in inner.exc.args if isinstance(a, ast.Constant)]
                found |= {p.value for p in parts if isinstance(p.value, str)}
    return found


def test_explain_knows_every_hisparse_refusal_of_vllm_config():
    """A rebase onto a release that adds, drops or rewords a refusal of a
    HiSparse deployment fails here: explain refuses it or the docs say why
    it cannot (VLLM_REFUSALS, VLLM_REFUSALS_EXPLAIN_CANNOT_SEE)."""
    import vllm.config.vllm as vllm_config

    source = importlib.util.find_spec(vllm_config.__name__).origin
    found = _hisparse_refusals_in(Path(source).read_text())
    known = set(VLLM_REFUSALS.values()) | set(VLLM_REFUSALS_EXPLAIN_CANNOT_SEE)
    assert found == known
    docs = DOCS.read_text()
    for option in VLLM_REFUSALS_EXPLAIN_CANNOT_SEE.values():
        assert option in docs


@pytest.mark.parametrize(
    "option", ["--flashinfer-version", "--flashinfer-jit-cache-version"]
)
def test_explain_refuses_a_flashinfer_version_that_is_no_release(
    explain, capsys, option
):
    status, out, err = _run(explain, capsys, option, "latest")
    assert (status, out) == (2, "")
    assert err == (
        f"error: argument {option}: 'latest' is not a FlashInfer "
        "release: give one such as 0.7.4\n"
    )


@pytest.mark.parametrize(
    ("argv", "nearest"),
    [(("--jso",), "--json"), (("--nodes", "2"), "--nnodes"), (("--hisparce",), None)],
)
def test_explain_refuses_abbreviations_and_suggests_the_nearest_option(
    explain, capsys, argv, nearest
):
    """An abbreviation is an unknown option, under --json or not."""
    status, out, err = _run(explain, capsys, *argv)
    assert (status, out) == (2, "")
    assert err.startswith(f"error: unrecognized arguments: {argv[0]}")
    if nearest:
        assert err.endswith(f"; did you mean {nearest}?\n")
    status, out, _ = _run(explain, capsys, "--json", *argv)
    assert status == 2
    assert json.loads(out)["usage_error"].startswith("unrecognized arguments:")


def test_explain_says_so_when_vllm_lacks_a_setting_it_reads(
    explain, deployment, capsys, monkeypatch
):
    """A release that renames a setting: one line, no traceback."""

    def renamed():
        raise AttributeError(
            "module 'vllm.envs' has no attribute 'VLLM_BATCH_INVARIANT'"
        )

    monkeypatch.setitem(deployment._ENVIRONMENT_FLAGS, "VLLM_BATCH_INVARIANT", renamed)
    status, out, err = _run(explain, capsys)
    assert (status, out) == (2, "")
    assert err.startswith("error: the installed vLLM has no VLLM_BATCH_INVARIANT")
    assert err.count("\n") == 1


def test_explain_off_backend_is_used_by_no_path(explain, capsys, monkeypatch):
    """Two GB200 nodes with HiSparse on 0.7.2.post1: off, and no path says
    it runs FlashInfer all-reduce; the JSON tells "off" apart from "unknown"."""
    monkeypatch.delenv(ENV, raising=False)
    argv = ("--nnodes", "2", "-tp", "8", "--capability", "10.0", "--hisparse")
    argv += ("--flashinfer-version", "0.7.2.post1")
    status, out, _ = _run(explain, capsys, *argv)
    assert status == 0
    assert _text_line(out, "used by") == (
        "  used by: standalone all-reduce: no (the group's backend is off); "
        "fusion pass: no (the group's backend is off); model's own fusion: no "
        "(the group's backend is off)"
    )
    explained = _json(explain, capsys, *argv)
    assert explained["state"] == "off"
    assert all(path["on"] is False for path in explained["used_by"].values())
    pin_gpu(monkeypatch, None)
    unknown = _json(
        explain, capsys, "--nnodes", "2", "--hisparse", "--flashinfer-version", "0.7.4"
    )
    assert (
        unknown["state"] == "unknown" and unknown["depends_on"] == "device_capability"
    )


def _run_script(
    argv: list[str], run: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The command as an operator runs it on a laptop: no GPU, no config.

    A new interpreter with this tree's modules, running `run` (default: the
    command's module); subprocess.run kills it at the hard timeout.
    """
    env = {k: v for k, v in os.environ.items() if k not in (ENV, STANDALONE_ENV)}
    if run is None:
        run = (
            "import tree_imports, runpy; tree_imports.install(); "
            f"runpy.run_module({EXPLAIN_COMMAND_MODULE!r}, run_name='__main__')"
        )
    return subprocess.run(
        [sys.executable, "-c", run, *argv],
        capture_output=True,
        text=True,
        env={
            **env,
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": str(tree_imports.REPO_ROOT / "tests"),
        },
        timeout=300,
    )


# Runs the command with vLLM's own logging set up first (its handler writes
# to stdout), and an error record logged while explain runs.
FORCED_ERROR_RUN = """
import importlib, sys
import tree_imports
tree_imports.install()
from vllm.logger import _configure_vllm_root_logger, init_logger
_configure_vllm_root_logger()
launcher = importlib.import_module(sys.argv[1])
held = launcher.ErrorsOnly.__enter__
def enter(self):
    entered = held(self)
    init_logger("vllm.forced").error("forced error record")
    return entered
launcher.ErrorsOnly.__enter__ = enter
sys.exit(launcher.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("argv", [("--capability", "10.0"), ("--nnodes", "0")])
def test_explain_json_is_one_document_with_a_held_error_record(argv):
    """stdout holds the answer (or the usage error) as one JSON document;
    the held error record goes to stderr."""
    proc = _run_script([EXPLAIN_COMMAND_MODULE, "--json", *argv], FORCED_ERROR_RUN)
    assert isinstance(json.loads(proc.stdout), dict), proc.stdout
    assert "forced error record" in proc.stderr
    assert "forced error record" not in proc.stdout


def test_explain_usage_error_is_one_line_as_a_script():
    """On the real stderr: nothing from torch, vLLM or argparse's usage."""
    proc = _run_script(["--nnodes", "0"])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "error: --nnodes must be at least 1\n"
    # This one imports the KV connectors, which log at import on a CPU.
    without_pool = json.dumps(_hisparse_connector({}))
    proc = _run_script(["--json", "--kv-transfer-config", without_pool])
    assert proc.returncode == 2
    message = "invalid --kv-transfer-config: HiSparseConnector requires host_pool_gib"
    assert proc.stderr == f"error: {message}\n"
    assert json.loads(proc.stdout) == {"usage_error": message}


# Last: it starts a new interpreter, the slowest test here, and a mutation
# run (mutation/cosmic-ray.toml) stops at the first failing test.
def test_explain_runs_without_a_gpu_as_a_script():
    """What an operator runs on a laptop: no GPU, no current vLLM config."""
    proc = _run_script(
        ["--nnodes", "2", "--hisparse", "--json", "--capability", "10.0"]
    )
    assert proc.returncode == 0, proc.stderr
    explained = json.loads(proc.stdout)
    assert explained["backend"] is None
    assert explained["known_issue"] == "flashinfer#7782"
