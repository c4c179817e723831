# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pure backend decision: vLLM 0.34.0's `auto`, the FlashInfer bugs it
steers around as data that retires on fixed kernels, and which kernels count.

No process groups: every test is a function of `FiArBackendInputs` or of
the synthetic FlashInfer packages installed for it."""

import dataclasses

import pytest

VERSION_CHECK = "FLASHINFER_DISABLE_VERSION_CHECK"
FP16_ISSUE = "mnnvl fp16 RMSNorm overflow"
OLD = (("flashinfer-python", "0.7.2.post1"),)
UNFIXED = ["0.7.2.post1", "0.7.2.post2", "0.7.3"]
FIXED = ["0.7.4", "0.7.4.post1", "0.8.0"]


def _inputs(policy, **overrides):
    fields = dict(
        setting="auto",
        node_count=1,
        device_capability=100,
        hisparse=False,
        kernels=OLD,
        dtype="bfloat16",
    )
    return policy.FiArBackendInputs(**{**fields, **overrides})


def _kernels(release):
    return (("flashinfer-python", release),)


def _names(decision):
    return [issue.name for issue in decision.known_issues]


def _issue(policy, name, backend="mnnvl", applies=lambda inputs: True, fixed_in=None):
    """A made-up entry of the known-issue table."""
    return policy.FiArKnownIssue(
        name=name,
        backend=backend,
        trigger="always",
        applies=applies,
        effect="hangs",
        fixed_in=fixed_in,
    )


@pytest.mark.parametrize(
    ("overrides", "backend", "fallback"),
    [
        ({}, "mnnvl", True),
        ({"hisparse": True}, "trtllm", False),
        ({"node_count": 2}, "mnnvl", False),
        ({"node_count": 2, "hisparse": True}, None, False),
        ({"node_count": 2, "device_capability": 90}, None, False),
        ({"node_count": 2, "device_capability": None}, None, False),
        ({"device_capability": 90}, "mnnvl", True),
        # Across nodes mnnvl needs a fabric on every rank; one node does not.
        ({"node_count": 2, "no_fabric": (3,)}, None, False),
        ({"node_count": 2, "no_fabric": (2, 3), "setting": "mnnvl"}, None, False),
        ({"node_count": 2, "no_fabric": ()}, "mnnvl", False),
        ({"no_fabric": (1,)}, "mnnvl", True),
        # Explicit settings are obeyed, known issue or not.
        ({"setting": "mnnvl"}, "mnnvl", False),
        ({"setting": "mnnvl", "hisparse": True}, "mnnvl", False),
        ({"setting": "mnnvl", "node_count": 2, "hisparse": True}, "mnnvl", False),
        (
            {"setting": "mnnvl", "node_count": 2, "device_capability": 90},
            "mnnvl",
            False,
        ),
        ({"setting": "trtllm"}, "trtllm", False),
        ({"setting": "trtllm", "node_count": 2}, "trtllm", False),
        # trtllm over GPUs not all NVLink-connected (more than two) runs over
        # PCIe: auto keeps to mnnvl without a fallback, or is off.
        ({"world_size": 4, "nvlink_connected": False}, "mnnvl", False),
        ({"world_size": 4, "nvlink_connected": False, "hisparse": True}, None, False),
        (
            {"world_size": 2, "nvlink_connected": False, "hisparse": True},
            "trtllm",
            False,
        ),
        (
            {"world_size": 4, "nvlink_connected": False, "setting": "trtllm"},
            "trtllm",
            False,
        ),
        # HiSparse unknown (no vLLM config) takes the choice that cannot crash.
        ({"hisparse": None}, "trtllm", False),
        ({"hisparse": None, "node_count": 2}, None, False),
        ({"hisparse": None, "kernels": _kernels("0.7.4")}, "mnnvl", True),
    ],
)
def test_decision_table(policy, overrides, backend, fallback):
    decision = policy.decide_fi_ar_backend(_inputs(policy, **overrides))
    assert (decision.backend, decision.allow_trtllm_fallback) == (backend, fallback)
    assert decision.reason and "\n" not in decision.reason


@pytest.mark.parametrize("release", UNFIXED + FIXED)
@pytest.mark.parametrize("node_count", [1, 2])
def test_hisparse_override_retires_at_0_7_4(policy, release, node_count):
    """flashinfer#7782 is fixed in 0.7.4: from there `auto` makes vLLM's
    own choice with HiSparse; before, trtllm on one node and off across."""
    inputs = _inputs(
        policy, hisparse=True, node_count=node_count, kernels=_kernels(release)
    )
    decision = policy.decide_fi_ar_backend(inputs)
    without = policy.decide_fi_ar_backend(dataclasses.replace(inputs, hisparse=False))
    if release in FIXED:
        assert decision == without
        assert decision.backend == "mnnvl" and decision.known_issues == ()
    else:
        assert decision.backend == ("trtllm" if node_count == 1 else None)
        assert not decision.allow_trtllm_fallback
        assert _names(decision) == ["flashinfer#7782"]


@pytest.mark.parametrize("release", UNFIXED + FIXED)
@pytest.mark.parametrize("node_count", [1, 2])
def test_fp16_avoids_mnnvl_before_0_7_4(policy, release, node_count):
    """0.7.2.post1's one-shot fused RMSNorm squares in fp16 and zeroes
    tokens; trtllm squares in fp32. 0.7.4 fixes mnnvl."""
    inputs = _inputs(
        policy, dtype="float16", node_count=node_count, kernels=_kernels(release)
    )
    decision = policy.decide_fi_ar_backend(inputs)
    if release in FIXED:
        assert decision.backend == "mnnvl" and decision.known_issues == ()
        assert decision.allow_trtllm_fallback is (node_count == 1)
    else:
        assert decision.backend == ("trtllm" if node_count == 1 else None)
        assert not decision.allow_trtllm_fallback
        assert _names(decision) == [FP16_ISSUE]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", None])
def test_fp16_entry_leaves_other_dtypes_alone(policy, dtype):
    decision = policy.decide_fi_ar_backend(_inputs(policy, dtype=dtype))
    assert (decision.backend, decision.known_issues) == ("mnnvl", ())


def test_explicit_mnnvl_with_fp16_is_obeyed_and_names_the_issue(policy):
    decision = policy.decide_fi_ar_backend(
        _inputs(policy, setting="mnnvl", dtype="float16")
    )
    assert decision.backend == "mnnvl" and not decision.allow_trtllm_fallback
    assert _names(decision) == [FP16_ISSUE]
    assert FP16_ISSUE in decision.reason and "0.7.4" in decision.reason


ONE_NODE, TWO_NODES = "auto, one node", "auto, 2 nodes on Blackwell"
HISPARSE, FP16 = "HiSparse is on", "the workspace is float16"


@pytest.mark.parametrize(
    ("overrides", "start", "name"),
    [
        ({"hisparse": True}, f"{ONE_NODE}; {HISPARSE}", "flashinfer#7782"),
        (
            {"hisparse": True, "node_count": 2},
            f"{TWO_NODES}; {HISPARSE}",
            "flashinfer#7782",
        ),
        (
            {"hisparse": True, "setting": "mnnvl"},
            f"VLLM_FLASHINFER_ALLREDUCE_BACKEND=mnnvl; {HISPARSE}",
            "flashinfer#7782",
        ),
        ({"dtype": "float16"}, f"{ONE_NODE}; {FP16}", FP16_ISSUE),
        ({"dtype": "float16", "node_count": 2}, f"{TWO_NODES}; {FP16}", FP16_ISSUE),
    ],
)
def test_the_reason_names_setting_trigger_issue_kernels_and_fix(
    policy, overrides, start, name
):
    """One log line: what `auto` started from, what triggers which backend's
    issue, on whose kernels, and where it is fixed."""
    reason = policy.decide_fi_ar_backend(_inputs(policy, **overrides)).reason
    assert reason.startswith(f"{start}: mnnvl ")
    assert reason.endswith(
        f"({name}; fixed in 0.7.4, not in flashinfer-python 0.7.2.post1)"
    )


PCIE = (
    "more than two GPUs are not all NVLink-connected: trtllm runs over PCIe, "
    "up to 34 times slower than no fusion (vllm#48075, vllm#48071, sglang#32330)"
)


@pytest.mark.parametrize(
    ("overrides", "mnnvl"),
    [({"hisparse": True}, HISPARSE), ({"dtype": "float16"}, FP16)],
)
def test_the_reason_names_every_candidate_an_issue_took(policy, overrides, mnnvl):
    """Four GPUs of one node not all NVLink-connected, mnnvl hit too: off,
    and the line says why each candidate went, in the order auto tries them."""
    inputs = _inputs(policy, world_size=4, nvlink_connected=False, **overrides)
    decision = policy.decide_fi_ar_backend(inputs)
    assert decision.backend is None
    assert decision.reason.startswith(f"{ONE_NODE}; {mnnvl}: mnnvl ")
    assert decision.reason.endswith(f"0.7.2.post1); {PCIE}")
    assert [issue.backend for issue in decision.known_issues] == ["mnnvl", "trtllm"]


@pytest.mark.parametrize(
    ("no_fabric", "named"), [((3,), "rank 3"), ((3, 2), "ranks 2, 3")]
)
def test_the_ranks_without_a_fabric_are_named(policy, no_fabric, named):
    inputs = _inputs(policy, node_count=2, no_fabric=no_fabric)
    assert policy.decide_fi_ar_backend(inputs).reason.endswith(
        f"; FlashInfer finds no NVLink fabric on {named}"
    )


def test_every_known_issue_names_a_backend(policy):
    names = [issue.name for issue in policy.FI_AR_KNOWN_ISSUES]
    assert len(set(names)) == len(names) >= 2
    for issue in policy.FI_AR_KNOWN_ISSUES:
        assert issue.backend in ("mnnvl", "trtllm")


def test_an_entry_that_breaks_trtllm_is_checked_for_the_replacement(policy):
    """`auto` must not switch away from one known issue into another."""
    trtllm_bug = _issue(policy, "synthetic trtllm bug", backend="trtllm")
    issues = policy.FI_AR_KNOWN_ISSUES + (trtllm_bug,)
    hisparse = policy.decide_fi_ar_backend(_inputs(policy, hisparse=True), issues)
    assert (hisparse.backend, hisparse.allow_trtllm_fallback) == (None, False)
    assert _names(hisparse) == ["flashinfer#7782", "synthetic trtllm bug"]
    # Without HiSparse, mnnvl still; but it may not fall back to trtllm.
    plain = policy.decide_fi_ar_backend(_inputs(policy), issues)
    assert (plain.backend, plain.allow_trtllm_fallback) == ("mnnvl", False)
    explicit = policy.decide_fi_ar_backend(_inputs(policy, setting="trtllm"), issues)
    assert explicit.backend == "trtllm" and explicit.known_issues == (trtllm_bug,)


def test_an_entry_that_does_not_count_does_not_end_the_search(policy):
    issues = (
        _issue(policy, "not applying", applies=lambda inputs: False),
        _issue(policy, "fixed", fixed_in="0.1"),
        _issue(policy, "unfixed"),
    )
    decision = policy.decide_fi_ar_backend(_inputs(policy), issues)
    assert decision.backend == "trtllm"
    assert _names(decision) == ["unfixed"]


FI074 = ("flashinfer-python", "0.7.4")
SHIM = ("flashinfer-jit-cache", "0.7.4")
P072 = ("flashinfer-jit-cache-cu129", "0.7.2.post1")


@pytest.mark.parametrize(
    ("kernels", "oldest", "package"),
    [
        # A 0.7.4 shim listing a 0.7.2.post1 provider, loaded unchecked.
        ((FI074, SHIM, P072), "0.7.2.post1", "flashinfer-jit-cache-cu129 0.7.2.post1"),
        ((FI074, SHIM, ("p", "0.7.4")), "0.7.4", "flashinfer-python 0.7.4"),
        ((("flashinfer-python", "0.8.0"), SHIM), "0.7.4", "flashinfer-jit-cache 0.7.4"),
        # What cannot be read is never a fix, wherever it is listed.
        ((FI074, SHIM, ("a jit-cache provider", "?")), None, "a jit-cache provider ?"),
        ((("flashinfer-python", "local-build"), SHIM), None, "flashinfer-python"),
        ((), None, "no flashinfer-python"),
    ],
)
def test_the_oldest_kernels_count(policy, kernels, oldest, package):
    """Whichever of them serves MNNVL, the oldest can only keep a workaround;
    the reason names it."""
    inputs = _inputs(policy, hisparse=True, kernels=kernels)
    release, named = policy.kernel_release(kernels)
    assert release == (oldest and policy.Version(oldest))
    assert named.startswith(package)
    decision = policy.decide_fi_ar_backend(inputs)
    fixed = oldest is not None and release >= policy.Version("0.7.4")
    assert decision.backend == ("mnnvl" if fixed else "trtllm")
    assert fixed or named in decision.reason


@pytest.mark.parametrize("check_off", [False, True])
@pytest.mark.parametrize(
    ("jit_cache", "providers"),
    [
        (None, ()),
        ("0.7.4+cu129", (("p-a", "0.7.4+cu129"), ("p-b", "0.7.2.post1"))),
        # Another release counts too, whatever FlashInfer's version check
        # says: which package FlashInfer takes is its own rule, and counting
        # one more can only keep a workaround.
        ("0.7.2.post1+cu129", (("p", "0.7.2.post1+cu129"),)),
    ],
)
def test_installed_kernels(
    policy, installed_flashinfer, monkeypatch, jit_cache, providers, check_off
):
    _version_check(monkeypatch, check_off)
    installed_flashinfer(
        flashinfer="0.7.4",
        jit_cache=jit_cache,
        providers=[{"distribution": n, "version": r} for n, r in providers],
    )
    shim = (("flashinfer-jit-cache", jit_cache), *providers) if jit_cache else ()
    assert policy.installed_kernels() == (FI074, *shim)


def test_installed_kernels_a_provider_list_that_raises_is_unreadable(
    policy, installed_flashinfer, monkeypatch
):
    _version_check(monkeypatch, False)
    installed_flashinfer(flashinfer="0.7.4", jit_cache="0.7.4")
    import flashinfer_jit_cache

    def broken():
        raise RuntimeError("no providers")

    monkeypatch.setattr(flashinfer_jit_cache, "get_jit_cache_providers", broken)
    kernels = policy.installed_kernels()
    assert kernels[:2] == (FI074, SHIM) and len(kernels) == 3
    inputs = _inputs(policy, hisparse=True, kernels=kernels)
    assert policy.kernel_release(kernels)[0] is None
    assert policy.decide_fi_ar_backend(inputs).backend == "trtllm"


def test_installed_kernels_without_flashinfer_python(policy, monkeypatch):
    def missing(name):
        raise policy.PackageNotFoundError(name)

    monkeypatch.setattr(policy, "version", missing)
    assert policy.installed_kernels() == ()


def _version_check(monkeypatch, off: bool) -> None:
    if off:
        monkeypatch.setenv(VERSION_CHECK, "1")
    else:
        monkeypatch.delenv(VERSION_CHECK, raising=False)
