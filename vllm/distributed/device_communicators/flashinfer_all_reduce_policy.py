# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which FlashInfer all-reduce backend a process group uses, as a pure function
of `FiArBackendInputs`, for start-up and explain alike. The FlashInfer bugs
`auto` steers around are data; each retires once the kernels carry its fix."""

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
FI_AR_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")
# The dtypes FlashInferAllReduce.should_use_fi_ar accepts.
FI_AR_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class FiArBackendInputs:
    """Everything the backend choice depends on."""

    setting: str
    node_count: int
    device_capability: int | None
    """`<major><minor>`, such as 100; None without a GPU."""
    hisparse: bool | None
    """None while unknown (no vLLM config is current)."""
    kernels: tuple[tuple[str, str], ...]
    """(package, release) of each FlashInfer package whose kernels may run."""
    dtype: str | None = None
    """The dtype the workspace is created for; None until one is."""
    no_fabric: tuple[int, ...] = ()
    """The ranks where FlashInfer's is_mnnvl_fabric_supported is false."""


@dataclass(frozen=True)
class FiArKnownIssue:
    """A FlashInfer bug in one backend's kernels, and when it bites."""

    name: str
    backend: str
    trigger: str
    applies: Callable[[FiArBackendInputs], bool]
    effect: str
    fixed_in: str | None
    """The first FlashInfer release with the fix; None while unreleased."""


FI_AR_KNOWN_ISSUES = (
    # 0.7.2.post1's LamportFlags::ctaArrive() (include/flashinfer/comm/
    # trtllm_mnnvl_allreduce.cuh) waits on one warp of one block only; in
    # 0.7.4 every thread waits at the cluster barrier.
    FiArKnownIssue(
        name="flashinfer#7782",
        backend="mnnvl",
        trigger="HiSparse is on",
        applies=lambda inputs: inputs.hisparse is not False,
        effect="crashes with HiSparse (CUDA error: unspecified launch failure)",
        fixed_in="0.7.4",
    ),
    # oneshotAllreduceFusionKernel in include/flashinfer/comm/
    # trtllm_mnnvl_allreduce.cuh squares in T in 0.7.2.post1 (lines
    # 1009-1010: `toFloat<T>(x * x)`) and in fp32 in 0.7.4 (lines 1013-1016).
    FiArKnownIssue(
        name="mnnvl fp16 RMSNorm overflow",
        backend="mnnvl",
        trigger="the workspace is float16",
        applies=lambda inputs: inputs.dtype == "float16",
        effect=(
            "zeroes every token with a value above 255.94 in its one-shot "
            "fused RMSNorm (x * x overflows fp16)"
        ),
        fixed_in="0.7.4",
    ),
)


@dataclass(frozen=True)
class FiArBackendDecision:
    backend: str | None
    """The backend to create; None turns FlashInfer all-reduce off."""
    allow_trtllm_fallback: bool
    reason: str
    known_issue: FiArKnownIssue | None = None
    """The unfixed issue that moved `auto`, or that an explicit setting hits."""


def installed_kernels() -> tuple[tuple[str, str], ...]:
    """The installed FlashInfer packages whose kernels may run: flashinfer-python,
    a flashinfer-jit-cache shim and each provider it lists. Which one FlashInfer
    loads from is its own rule (flashinfer/jit/env.py): counting every one can
    only keep a workaround, never drop one."""
    try:
        kernels = [("flashinfer-python", version("flashinfer-python"))]
    except PackageNotFoundError:
        return ()
    try:
        shim = importlib.import_module("flashinfer_jit_cache")
        kernels.append(("flashinfer-jit-cache", str(shim.__version__)))
    except Exception:
        return tuple(kernels)
    try:
        providers = list(shim.get_jit_cache_providers())
    except Exception:
        providers = [None]
    for provider in providers:
        name = getattr(provider, "distribution", "a jit-cache provider")
        kernels.append((str(name), str(getattr(provider, "version", "?"))))
    return tuple(kernels)


def kernel_release(kernels: Iterable[tuple[str, str]]) -> tuple[Version | None, str]:
    """The oldest release among `kernels` (FiArBackendInputs.kernels), and
    its package; None (no fix counts) without any or an unreadable one."""
    oldest: tuple[Version | None, str] = (None, "no flashinfer-python")
    for package, release in kernels:
        try:
            parsed = Version(release)
        except InvalidVersion:
            return None, f"{package} {release}"
        if oldest[0] is None or parsed < oldest[0]:
            oldest = (parsed, f"{package} {release}")
    return oldest


def _auto_candidates(inputs: FiArBackendInputs) -> tuple[list[str], str]:
    """vLLM 0.34.0's `auto` before its HiSparse override, which the known
    issues replace: the backends it would try, best first, and why."""
    if inputs.node_count == 1:
        return ["mnnvl", "trtllm"], (
            "auto, single node (trtllm if NVSwitch multicast is unavailable)"
        )
    if (inputs.device_capability or 0) >= 100:
        return ["mnnvl"], (
            f"auto, {inputs.node_count} nodes on Blackwell: mnnvl is the only "
            "backend that spans nodes"
        )
    return [], (
        f"auto, {inputs.node_count} nodes: a multi-node group needs mnnvl on "
        "Blackwell (SM100+)"
    )


def decide_fi_ar_backend(
    inputs: FiArBackendInputs,
    known_issues: tuple[FiArKnownIssue, ...] = FI_AR_KNOWN_ISSUES,
) -> FiArBackendDecision:
    """The backend for `inputs`: explicit settings are obeyed; `auto` takes
    the first of vLLM's candidates that no unfixed known issue breaks, and
    is off when none is left."""
    release, package = kernel_release(inputs.kernels)

    def unfixed(backend: str) -> FiArKnownIssue | None:
        for issue in known_issues:
            fixed = release and issue.fixed_in and release >= Version(issue.fixed_in)
            if issue.backend == backend and issue.applies(inputs) and not fixed:
                return issue
        return None

    if inputs.setting != "auto":
        backend: str | None = inputs.setting
        issue = unfixed(inputs.setting)
        allow_fallback = False
        reason = f"{FI_AR_BACKEND_ENV}={backend} is set explicitly"
        if issue is not None:
            reason += f", and {backend} {issue.effect} on {_see(issue, package)}"
    else:
        candidates, reason = _auto_candidates(inputs)
        safe = [backend for backend in candidates if unfixed(backend) is None]
        backend = safe[0] if safe else None
        allow_fallback = backend == "mnnvl" and "trtllm" in safe
        issue = unfixed(candidates[0]) if candidates else None
        if issue is not None:
            if backend is not None:
                action = f"using {backend} on a single node"
            elif inputs.node_count > 1:
                action = f"off on {inputs.node_count} nodes (trtllm cannot span nodes)"
            else:
                action = "off (no backend is left)"
            reason = (
                f"auto, {issue.trigger}: {action}, as {issue.backend} {issue.effect} "
                f"on {_see(issue, package)}"
            )
    # Across nodes mnnvl needs an NVLink fabric on every rank (vllm#51986).
    if backend == "mnnvl" and inputs.node_count > 1 and inputs.no_fabric:
        backend, allow_fallback = None, False
        reason += (
            "; but mnnvl needs an NVLink fabric across nodes, and FlashInfer's "
            f"is_mnnvl_fabric_supported is false on {some_ranks(inputs.no_fabric)}, "
            "so FlashInfer all-reduce is off"
        )
    return FiArBackendDecision(backend, allow_fallback, reason, issue)


def _see(issue: FiArKnownIssue, package: str) -> str:
    fixed = f"fixed in {issue.fixed_in}" if issue.fixed_in else "unfixed"
    return f"the kernels of {package} ({issue.name}, {fixed})"


def some_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
