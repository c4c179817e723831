# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The policy module: the backend decision as a pure function of its inputs,
and known FlashInfer issues as data that retires itself."""

import dataclasses
import logging
from importlib.metadata import version

import pytest
from fi_ar_utils import (
    build_config,
    workspace_args,
)

from vllm.config import set_current_vllm_config


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


def test_policy_turns_explicit_mnnvl_off_without_multicast(policy):
    inputs = policy.FiArBackendInputs(
        setting="mnnvl",
        node_count=1,
        device_capability=100,
        hisparse=False,
        flashinfer_version=None,
        multicast=False,
    )
    assert policy.decide_fi_ar_backend(inputs).backend is None
