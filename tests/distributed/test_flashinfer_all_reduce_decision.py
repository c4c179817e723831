# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The backend decision as data: the pure function, retirement of known
issues, the explain command and the docs table it generates."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version

import overlay
import pytest
from fi_ar_utils import ENV, EXPLAIN_MODULE, build_config, workspace_args

from vllm.config import set_current_vllm_config

DOCS = overlay.REPO_ROOT / "docs" / "configuration" / "flashinfer_all_reduce.md"
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


def _inputs(policy, **overrides):
    fields = dict(
        setting="auto",
        node_count=1,
        device_capability=100,
        hisparse=False,
        flashinfer_version="0.7.2.post1",
    )
    return policy.FiArBackendInputs(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("overrides", "backend", "fallback"),
    [
        ({}, "mnnvl", True),
        ({"multicast": False}, "trtllm", False),
        ({"hisparse": True}, "trtllm", False),
        ({"node_count": 2}, "mnnvl", False),
        ({"node_count": 2, "device_capability": 90}, None, False),
        ({"node_count": 2, "hisparse": True}, None, False),
        ({"setting": "mnnvl", "hisparse": True}, "mnnvl", False),
        ({"setting": "trtllm", "node_count": 2}, "trtllm", False),
    ],
)
def test_flashinfer_auto_backend_decision_is_a_function_of_its_inputs(
    policy, overrides, backend, fallback
):
    decision = policy.decide_fi_ar_backend(_inputs(policy, **overrides))
    assert (decision.backend, decision.allow_trtllm_fallback) == (backend, fallback)
    assert decision.reason


def _with_fix_in(policy, version: str):
    return tuple(
        dataclasses.replace(issue, fixed_in=version)
        for issue in policy.FI_AR_KNOWN_ISSUES
    )


@pytest.mark.parametrize(
    ("fixed_in", "backend"),
    [
        ("0.7.2.post1", "mnnvl"),
        ("0.7.2", "mnnvl"),
        ("0.7.3", "trtllm"),
        # Same release, later post release: 0.7.2.post1 lacks the fix.
        ("0.7.2.post2", "trtllm"),
    ],
)
def test_hisparse_override_retires_once_flashinfer_has_the_fix(
    policy, fixed_in, backend
):
    decision = policy.decide_fi_ar_backend(
        _inputs(policy, hisparse=True), _with_fix_in(policy, fixed_in)
    )
    assert decision.backend == backend
    assert ("retired" in decision.reason) is (backend == "mnnvl")
    # Retired, auto's own choice comes back whole: trtllm where multicast
    # turns out to be missing.
    assert decision.allow_trtllm_fallback is (backend == "mnnvl")


@pytest.mark.parametrize("installed", ["local-build", "0.7.2-dirty-abc", ""])
def test_hisparse_override_stays_for_an_unparseable_flashinfer_version(
    policy, installed
):
    """A version nobody can compare (explain takes free text) is not a fix."""
    decision = policy.decide_fi_ar_backend(
        _inputs(policy, hisparse=True, flashinfer_version=installed),
        _with_fix_in(policy, "0.7.2"),
    )
    assert decision.backend == "trtllm"
    assert decision.known_issue == "flashinfer#7782"


@pytest.mark.parametrize("fixed", [True, False])
def test_hisparse_override_retirement_is_logged(
    fi_ar, policy, fake_ws, cpu_group, caplog, monkeypatch, fixed
):
    installed = version("flashinfer-python")
    fixed_in = installed if fixed else "9999.0"
    monkeypatch.setattr(policy, "FI_AR_KNOWN_ISSUES", _with_fix_in(policy, fixed_in))
    caplog.set_level(logging.INFO)
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws.backend == ("mnnvl" if fixed else "trtllm")
    [line] = [r.getMessage() for r in caplog.records if "backend for" in r.getMessage()]
    assert ("retired" in line) is fixed
    if fixed:
        assert f"flashinfer-python {installed} >= {fixed_in}" in line


def test_retired_hisparse_override_still_falls_back_without_multicast(
    fi_ar, policy, fake_ws, cpu_group, monkeypatch
):
    """A node without multicast cannot create mnnvl: it must end on trtllm."""
    fixed = _with_fix_in(policy, version("flashinfer-python"))
    monkeypatch.setattr(policy, "FI_AR_KNOWN_ISSUES", fixed)
    fake_ws.multicast = False
    with set_current_vllm_config(build_config("connector")):
        ws = fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert ws is not None and ws.backend == "trtllm"
    assert fake_ws.attempts == ["mnnvl", "trtllm"]


def test_a_new_known_issue_needs_no_decision_change(policy):
    hypothetical = policy.FiArKnownIssue(
        name="flashinfer#0",
        summary="a made-up trtllm bug on SM90",
        links=(),
        trigger="the GPU is SM90",
        applies=lambda inputs: inputs.device_capability == 90,
        unsafe_backend="trtllm",
        single_node_backend=None,
        multi_node_backend=None,
        replacement_note="nothing else is safe",
        fixed_in=None,
    )
    inputs = _inputs(policy, multicast=False, device_capability=90)
    assert policy.decide_fi_ar_backend(inputs).backend == "trtllm"
    decision = policy.decide_fi_ar_backend(inputs, (hypothetical,))
    assert decision.backend is None
    assert decision.known_issue == "flashinfer#0"


def test_every_known_issue_is_checked_past_one_that_does_not_count(policy):
    """An entry that does not apply, or is retired, must not end the search."""

    def mnnvl_issue(name: str, applies=lambda inputs: True, fixed_in=None):
        return policy.FiArKnownIssue(
            name=name,
            summary=f"made-up mnnvl bug {name}",
            links=(),
            trigger="always",
            applies=applies,
            unsafe_backend="mnnvl",
            single_node_backend="trtllm",
            multi_node_backend=None,
            replacement_note="for the test",
            fixed_in=fixed_in,
        )

    issues = (
        mnnvl_issue("flashinfer#1", applies=lambda inputs: False),
        mnnvl_issue("flashinfer#2", fixed_in="0.1"),
        mnnvl_issue("flashinfer#3"),
    )
    decision = policy.decide_fi_ar_backend(_inputs(policy), issues)
    assert (decision.backend, decision.known_issue) == ("trtllm", "flashinfer#3")


# --- explain ---------------------------------------------------------------


def _explain(explain, capsys, *argv: str) -> tuple[int, str]:
    status = explain.main(list(argv))
    return status, capsys.readouterr().out


def test_explain_hisparse_one_node_is_trtllm(explain, capsys):
    status, out = _explain(explain, capsys, "--capability", "10.0", "--hisparse")
    assert status == 0
    assert out.startswith("FlashInfer all-reduce backend: trtllm\n")
    assert "flashinfer#7782" in out and f"{ENV}=mnnvl to override" in out


def test_explain_hisparse_two_nodes_is_off(explain, capsys):
    status, out = _explain(
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
    status, out = _explain(explain, capsys, "--nnodes", "2")
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


def test_docs_decision_table_matches_the_code(explain):
    page = DOCS.read_text()
    start = page.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    documented = page[start : page.index(TABLE_END, start)]
    assert documented == explain.fi_ar_decision_table(), (
        f"{DOCS.name} is out of date; regenerate its table with "
        f"`{explain.EXPLAIN_COMMAND} --table`"
    )


# Last: it starts a new interpreter, the slowest test here, and a mutation
# run (mutation/cosmic-ray.toml) stops at the first failing test.
def test_explain_runs_without_a_gpu_as_a_script():
    """What an operator runs on a laptop: no GPU, no current vLLM config."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    run = (
        "import overlay, runpy; overlay.install(); "
        f"runpy.run_module({EXPLAIN_MODULE!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run, "--nnodes", "2", "--hisparse", "--json"]
        + ["--capability", "10.0"],
        capture_output=True,
        text=True,
        env={
            **env,
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": str(overlay.REPO_ROOT / "tests"),
        },
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    explained = json.loads(proc.stdout)
    assert explained["backend"] is None
    assert explained["known_issue"] == "flashinfer#7782"
