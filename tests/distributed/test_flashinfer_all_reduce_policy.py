# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The policy module: the backend decision as a pure function of its inputs,
and known FlashInfer issues as data that retires itself."""

import dataclasses
import logging
from importlib.metadata import version

import pytest
from fi_ar_utils import (
    ENV,
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


UNFIXED = ["0.7.2.post1", "0.7.3"]
FIXED = ["0.7.4", "0.7.4.post1", "0.8.0"]


@pytest.mark.parametrize("release", UNFIXED + FIXED)
@pytest.mark.parametrize("node_count", [1, 2])
def test_hisparse_override_is_retired_on_the_release_with_the_fix(
    policy, release, node_count
):
    """flashinfer-python 0.7.4 fixes flashinfer#7782: from there on, `auto`
    makes 0.33.0's own choice with HiSparse, on one node and across nodes."""
    inputs = _inputs(
        policy, hisparse=True, node_count=node_count, flashinfer_version=release
    )
    decision = policy.decide_fi_ar_backend(inputs)
    without_hisparse = policy.decide_fi_ar_backend(
        dataclasses.replace(inputs, hisparse=False)
    )
    if release in FIXED:
        assert (decision.backend, decision.allow_trtllm_fallback) == (
            without_hisparse.backend,
            without_hisparse.allow_trtllm_fallback,
        )
        assert decision.backend == "mnnvl"
        assert decision.known_issue is None
        assert decision.reason.startswith(without_hisparse.reason + "; ")
        assert decision.reason.endswith(
            "; the flashinfer#7782 override is retired: the kernels of "
            f"flashinfer-python {release} have the fix (FlashInfer 0.7.4 and newer)"
        )
    else:
        assert decision.backend == ("trtllm" if node_count == 1 else None)
        assert decision.known_issue == "flashinfer#7782"
        assert "retired" not in decision.reason


# The reason line, at most this long: one log line an operator reads.
REASON_LINE_LIMIT = 300


@pytest.mark.parametrize("setting", ["auto", "mnnvl"])
@pytest.mark.parametrize("node_count", [1, 2])
def test_hisparse_on_flashinfer_without_the_fix_is_one_short_line(
    policy, setting, node_count
):
    """The line names the package whose kernels run, the issue and the
    release that fixes it, and points to explain for the rest; it never
    offers the crashing setting as a way out."""
    decision = policy.decide_fi_ar_backend(
        _inputs(policy, setting=setting, hisparse=True, node_count=node_count)
    )
    assert decision.known_issue == "flashinfer#7782"
    assert "\n" not in decision.reason
    assert len(decision.reason) <= REASON_LINE_LIMIT
    assert decision.reason.endswith(
        "mnnvl crashes with HiSparse on the kernels of flashinfer-python "
        "0.7.2.post1 (flashinfer#7782, fixed in FlashInfer 0.7.4; details: "
        "python -m vllm.explain_flashinfer_all_reduce)"
    )
    assert "to override" not in decision.reason
    assert "source tree" not in decision.reason


@pytest.mark.parametrize("setting", ["auto", "mnnvl"])
def test_the_detail_says_how_to_get_the_fix_from_a_tree_or_an_sdist(policy, setting):
    """What the line leaves out, for explain: the fix from a source tree
    or for an image built from the sdist, and an override that says it is
    the crashing one."""
    inputs = _inputs(policy, setting=setting, hisparse=True)
    detail = policy.known_issue_detail(inputs, policy.decide_fi_ar_backend(inputs))
    assert detail["kernels"] == "flashinfer-python 0.7.2.post1"
    assert "`pip install -C flashinfer=0.7.4 .`" in detail["get_fix"]
    assert "`python -m build --sdist -C flashinfer=0.7.4`" in detail["get_fix"]
    assert "https://github.com/flashinfer-ai/flashinfer/issues/7782" in detail["links"]
    if setting == "auto":
        assert detail["override"] == (
            f"{ENV}=mnnvl forces mnnvl, the backend that crashes with HiSparse here"
        )
    else:
        assert detail["override"].startswith(f"unset {ENV}")


def test_explicit_mnnvl_with_hisparse_is_no_risk_on_the_fixed_release(policy):
    decision = policy.decide_fi_ar_backend(
        _inputs(policy, setting="mnnvl", hisparse=True, flashinfer_version="0.7.4")
    )
    assert decision.backend == "mnnvl"
    assert decision.known_issue is None
    assert "known to crash" not in decision.reason


def test_the_flashinfer_7782_entry_says_where_its_fix_is(policy):
    [issue] = [i for i in policy.FI_AR_KNOWN_ISSUES if i.name == "flashinfer#7782"]
    assert issue.fixed_in == "0.7.4"
    assert "LamportFlags::ctaArrive()" in issue.fix


UNCHECKED = "(FLASHINFER_DISABLE_VERSION_CHECK is set)"


@pytest.mark.parametrize(
    ("installed", "jit_cache", "version_check", "counted", "package"),
    [
        ("0.7.4", None, True, "0.7.4", "flashinfer-python 0.7.4"),
        ("0.7.4", None, False, "0.7.4", "flashinfer-python 0.7.4"),
        # FlashInfer ignores a jit-cache of another release...
        ("0.7.4", "0.7.2.post1+cu129", True, "0.7.4", "flashinfer-python 0.7.4"),
        # ...unless its version check is off: then the older release counts.
        (
            "0.7.4",
            "0.7.2.post1+cu129",
            False,
            "0.7.2.post1+cu129",
            f"flashinfer-jit-cache 0.7.2.post1+cu129 {UNCHECKED}",
        ),
        (
            "0.8.0",
            "0.7.4+cu130",
            False,
            "0.7.4+cu130",
            f"flashinfer-jit-cache 0.7.4+cu130 {UNCHECKED}",
        ),
        ("0.7.2.post1", "0.7.4+cu129", False, "0.7.2.post1", None),
        # Its own release, a CUDA suffix added, is the same kernels.
        ("0.7.4", "0.7.4+cu129", True, "0.7.4+cu129", None),
        ("0.7.4", "0.7.4", False, "0.7.4", None),
        # PEP 440 reads these as one release: it is not another.
        ("0.7.4", "0.7.4.0", False, "0.7.4.0", None),
        # A release nobody can read is never taken for a fix...
        ("0.7.4", "local-build", False, "local-build", None),
        ("local-build", "0.7.4+cu129", False, "local-build", None),
        (None, "0.7.4+cu129", False, None, "flashinfer-python (not installed)"),
        # ...but FlashInfer's own test still tells its own jit-cache apart.
        ("local-build", "local-build", False, "local-build", None),
        ("local-build", "local-build+cu129", False, "local-build+cu129", None),
    ],
)
def test_kernel_release_is_the_one_whose_kernels_will_run(
    policy, installed, jit_cache, version_check, counted, package
):
    inputs = _inputs(
        policy,
        flashinfer_version=installed,
        flashinfer_jit_cache_version=jit_cache,
        flashinfer_version_check=version_check,
    )
    release, named = policy.kernel_release(inputs)
    assert release == counted
    if package is not None:
        assert named == package


def test_flashinfer_checks_the_jit_cache_version_unless_told_otherwise(policy):
    """FlashInfer's own default: inputs that do not say the check is off
    count the installed release, whatever jit-cache is there."""
    inputs = _inputs(
        policy,
        hisparse=True,
        flashinfer_version="0.7.4",
        flashinfer_jit_cache_version="0.7.2.post1+cu129",
    )
    assert policy.kernel_release(inputs) == ("0.7.4", "flashinfer-python 0.7.4")
    assert policy.decide_fi_ar_backend(inputs).backend == "mnnvl"


def _provider(policy, version, modules=None, targets=None, name="fi-jit-cache-cu129"):
    return policy.FiJitCacheProvider(
        distribution=name,
        version=version,
        modules=None if modules is None else frozenset(modules),
        cuda_architectures=None if targets is None else frozenset(targets),
    )


MNNVL = "trtllm_mnnvl_comm"


@pytest.mark.parametrize(
    ("version_check", "shim", "provider", "counted"),
    [
        # The case FlashInfer loads the racy kernel in: a 0.7.4 shim lists a
        # 0.7.2.post1 provider and the check is off.
        (False, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm100a"]), "0.7.2.post1"),
        # Checked, FlashInfer ignores that provider (not the shim's version).
        (True, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm100a"]), "0.7.4"),
        # A provider without the MNNVL module, or not for this GPU, serves
        # none of its kernels.
        (False, "0.7.4", ("0.7.2.post1", ["other_module"], ["sm100a"]), "0.7.4"),
        (False, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm90a"]), "0.7.4"),
        (False, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm103a"]), "0.7.4"),
        # A family or plain target runs on later minors of its major.
        (False, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm100f"]), "0.7.2.post1"),
        (False, "0.7.4", ("0.7.2.post1", [MNNVL], ["sm100"]), "0.7.2.post1"),
        # A provider that does not say what it holds counts.
        (False, "0.7.4", ("0.7.2.post1", None, None), "0.7.2.post1"),
        # Checked, a provider of the shim's own release counts as that release.
        (True, "0.7.4+cu129", ("0.7.4+cu129", [MNNVL], ["sm100a"]), "0.7.4+cu129"),
    ],
)
def test_kernel_release_counts_the_providers_the_shim_lists(
    policy, version_check, shim, provider, counted
):
    """FlashInfer's rules (`_get_aot_providers`, `get_aot_artifacts` in
    flashinfer/jit/env.py), with the GPU an SM100."""
    inputs = _inputs(
        policy,
        hisparse=True,
        flashinfer_version="0.7.4",
        flashinfer_jit_cache_version=shim,
        flashinfer_version_check=version_check,
        flashinfer_jit_cache_providers=(_provider(policy, *provider),),
    )
    release, _ = policy.kernel_release(inputs)
    assert release == counted
    racy = counted == "0.7.2.post1"
    assert policy.decide_fi_ar_backend(inputs).backend == (
        "trtllm" if racy else "mnnvl"
    )


def test_the_reason_line_names_the_provider_whose_kernels_run(policy):
    """A 0.7.4 shim with a 0.7.2.post1 provider and the check off: not
    "retired", but the provider's kernels, named."""
    inputs = _inputs(
        policy,
        hisparse=True,
        flashinfer_version="0.7.4",
        flashinfer_jit_cache_version="0.7.4",
        flashinfer_version_check=False,
        flashinfer_jit_cache_providers=(
            _provider(policy, "0.7.4", [MNNVL], ["sm100a"], name="fi-jit-cache-a"),
            _provider(policy, "0.7.2.post1", [MNNVL], ["sm100a"]),
        ),
    )
    decision = policy.decide_fi_ar_backend(inputs)
    assert decision.backend == "trtllm"
    assert "retired" not in decision.reason
    assert (
        "mnnvl crashes with HiSparse on the kernels of fi-jit-cache-cu129 "
        f"0.7.2.post1 {UNCHECKED} (flashinfer#7782" in decision.reason
    )
    detail = policy.known_issue_detail(inputs, decision)
    assert detail["get_fix"].startswith(
        "flashinfer-python 0.7.4 has the fix, but FlashInfer loads the kernels of "
        "fi-jit-cache-cu129 0.7.2.post1"
    )
    assert "unset FLASHINFER_DISABLE_VERSION_CHECK" in detail["get_fix"]


def test_a_prebuilt_module_in_flashinfer_itself_is_never_a_fix(policy):
    """`get_aot_artifacts` loads flashinfer/data/aot first, unchecked."""
    inputs = _inputs(
        policy, hisparse=True, flashinfer_version="0.8.0", flashinfer_aot_module=True
    )
    release, package = policy.kernel_release(inputs)
    assert release is None
    assert "flashinfer/data/aot/trtllm_mnnvl_comm" in package
    decision = policy.decide_fi_ar_backend(inputs)
    assert decision.backend == "trtllm" and "retired" not in decision.reason
    detail = policy.known_issue_detail(inputs, decision)
    assert detail["get_fix"].startswith("remove flashinfer/data/aot/trtllm_mnnvl_comm")


@pytest.mark.parametrize("node_count", [1, 2])
def test_hisparse_override_stays_for_an_older_jit_cache_flashinfer_loads(
    policy, node_count
):
    """flashinfer-python 0.7.4 with the version check off runs an older
    jit-cache's kernels, which still have the race."""
    inputs = _inputs(
        policy,
        hisparse=True,
        node_count=node_count,
        flashinfer_version="0.7.4",
        flashinfer_jit_cache_version="0.7.2.post1+cu129",
        flashinfer_version_check=False,
    )
    decision = policy.decide_fi_ar_backend(inputs)
    assert decision.backend == ("trtllm" if node_count == 1 else None)
    assert decision.known_issue == "flashinfer#7782"
    package = f"flashinfer-jit-cache 0.7.2.post1+cu129 {UNCHECKED}"
    assert f"on the kernels of {package} (flashinfer#7782" in decision.reason
    assert "pip install" not in decision.reason
    explicit = policy.decide_fi_ar_backend(dataclasses.replace(inputs, setting="mnnvl"))
    assert explicit.known_issue == "flashinfer#7782"
    assert package in explicit.reason
    # The same jit-cache, checked, is ignored: 0.7.4's own kernels run.
    checked = policy.decide_fi_ar_backend(
        dataclasses.replace(inputs, flashinfer_version_check=True)
    )
    assert checked.backend == "mnnvl" and "retired" in checked.reason


def test_retired_by_a_jit_cache_says_whose_kernels_have_the_fix(policy):
    decision = policy.decide_fi_ar_backend(
        _inputs(
            policy,
            hisparse=True,
            flashinfer_version="0.8.0",
            flashinfer_jit_cache_version="0.7.4+cu130",
            flashinfer_version_check=False,
        )
    )
    assert decision.backend == "mnnvl"
    assert (
        "override is retired: the kernels of flashinfer-jit-cache 0.7.4+cu130 "
        f"{UNCHECKED} have the fix (FlashInfer 0.7.4" in decision.reason
    )


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
        assert (
            f"the kernels of flashinfer-python {installed} have the fix "
            f"(FlashInfer {fixed_in} and newer)" in line
        )


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
        effect="hangs on SM90",
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
            effect="crashes",
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


@pytest.mark.parametrize(
    ("overrides", "backend"),
    [
        ({"node_count": 2, "fabric": False}, None),
        ({"node_count": 2, "fabric": False, "setting": "mnnvl"}, None),
        ({"node_count": 2, "fabric": False, "flashinfer_version": "0.7.4"}, None),
        ({"node_count": 2, "fabric": True}, "mnnvl"),
        ({"node_count": 2, "fabric": None}, "mnnvl"),
        # One node needs no fabric.
        ({"fabric": False}, "mnnvl"),
        ({"fabric": False, "hisparse": True}, "trtllm"),
    ],
)
def test_mnnvl_across_nodes_needs_an_nvlink_fabric(policy, overrides, backend):
    decision = policy.decide_fi_ar_backend(_inputs(policy, **overrides))
    assert decision.backend == backend
    if overrides["fabric"] is False and overrides.get("node_count") == 2:
        assert decision.reason.endswith(
            "but mnnvl across nodes needs an NVLink fabric (multi-node NVLink), "
            "which not every rank has, so FlashInfer all-reduce is off"
        )
