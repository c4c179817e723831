# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A group's FlashInfer all-reduce backend as a pure function of its inputs, for
start-up and explain alike; the FlashInfer bugs `auto` steers around are data."""

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
    setting: str
    node_count: int
    device_capability: int | None
    """`<major><minor>`, such as 100; None without a GPU."""
    hisparse: bool | None
    """None while unknown (no vLLM config is current)."""
    kernels: tuple[tuple[str, str], ...]
    dtype: str | None = None
    """The dtype the workspace is created for; None until one is."""
    no_fabric: tuple[int, ...] = ()


@dataclass(frozen=True)
class FiArKnownIssue:
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
    """(package, release) of flashinfer-python, a flashinfer-jit-cache shim and
    each provider it lists. Which one runs is FlashInfer's rule (flashinfer/jit/
    env.py): counting every one can only keep a workaround, never drop one."""
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
    """The oldest release, named; None (no fix counts) if none or one is unreadable."""
    parsed = []
    for package, release in kernels:
        try:
            parsed.append((Version(release), f"{package} {release}"))
        except InvalidVersion:
            return None, f"{package} {release}"
    return min(parsed, key=lambda r: r[0], default=(None, "no flashinfer-python"))


def decide_fi_ar_backend(
    inputs: FiArBackendInputs,
    known_issues: tuple[FiArKnownIssue, ...] = FI_AR_KNOWN_ISSUES,
) -> FiArBackendDecision:
    """Explicit settings are obeyed; `auto` takes the first of vLLM's
    candidates that no unfixed known issue breaks, and is off without one."""
    release, package = kernel_release(inputs.kernels)
    unfixed: dict[str, FiArKnownIssue] = {}  # the first per backend
    for entry in known_issues:
        fixed = release and entry.fixed_in and release >= Version(entry.fixed_in)
        if entry.applies(inputs) and not fixed:
            unfixed.setdefault(entry.backend, entry)
    # vLLM 0.34.0's `auto`, less its HiSparse override: the known issues replace it.
    nodes = inputs.node_count
    if inputs.setting != "auto":
        candidates = [inputs.setting]
        reason = f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly"
    elif nodes == 1:
        candidates = ["mnnvl", "trtllm"]
        reason = "auto, single node (trtllm if NVSwitch multicast is unavailable)"
    elif (inputs.device_capability or 0) >= 100:
        candidates = ["mnnvl"]
        reason = (
            f"auto, {nodes} nodes on Blackwell: mnnvl is the only backend that "
            "spans nodes"
        )
    else:
        candidates = []
        reason = (
            f"auto, {nodes} nodes: a multi-node group needs mnnvl on Blackwell (SM100+)"
        )
    safe = [b for b in candidates if inputs.setting != "auto" or b not in unfixed]
    backend = safe[0] if safe else None
    allow_fallback = backend == "mnnvl" and "trtllm" in safe
    issue = unfixed.get(candidates[0]) if candidates else None
    if issue is not None:
        fix = f"fixed in {issue.fixed_in}" if issue.fixed_in else "unfixed"
        hit = (
            f"{issue.backend} {issue.effect} on the kernels of {package} "
            f"({issue.name}, {fix})"
        )
        if inputs.setting != "auto":
            reason += f", and {hit}"
        else:
            if backend is not None:
                action = f"using {backend} on a single node"
            elif nodes > 1:
                action = f"off on {nodes} nodes (trtllm cannot span nodes)"
            else:
                action = "off (no backend is left)"
            reason = f"auto, {issue.trigger}: {action}, as {hit}"
    # Across nodes mnnvl needs an NVLink fabric on every rank (vllm#51986).
    if backend == "mnnvl" and nodes > 1 and inputs.no_fabric:
        backend = None
        reason += (
            "; but mnnvl needs an NVLink fabric across nodes, and FlashInfer's "
            f"is_mnnvl_fabric_supported is false on {some_ranks(inputs.no_fabric)}, "
            "so FlashInfer all-reduce is off"
        )
    return FiArBackendDecision(backend, allow_fallback, reason, issue)


def some_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
