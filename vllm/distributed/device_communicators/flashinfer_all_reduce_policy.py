# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""Which FlashInfer all-reduce backend to use, as a pure function.

`decide_fi_ar_backend` sees only `FiArBackendInputs`, so the choice can be
tested and explained without GPUs or process groups. FlashInfer bugs that
`auto` steers around are data (`FI_AR_KNOWN_ISSUES`), each retiring itself
once the FlashInfer kernels that will run carry its fix (`kernel_release`).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
FI_AR_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")
# MNNVL spans nodes on Blackwell (SM100) and newer only.
MNNVL_MULTI_NODE_MIN_CAPABILITY = 100
# FlashInfer's own variable: set to anything non-empty, FlashInfer loads a
# flashinfer-jit-cache of another release (flashinfer/jit/env.py).
FLASHINFER_VERSION_CHECK_ENV = "FLASHINFER_DISABLE_VERSION_CHECK"
# FlashInfer's module of the MNNVL all-reduce kernels
# (`gen_trtllm_mnnvl_comm_module` in flashinfer/jit/comm.py).
MNNVL_KERNEL_MODULE = "trtllm_mnnvl_comm"
# The version a flashinfer-python installed from a source checkout reports;
# FlashInfer checks no jit-cache against it (flashinfer/jit/env.py).
FLASHINFER_SOURCE_VERSION = "0.0.0+unknown"
# The kernels' package where flashinfer-python is not installed.
NO_FLASHINFER = "flashinfer-python (not installed)"
# The command that explains the choice in full, named by the reason line.
EXPLAIN_COMMAND = "python -m vllm.explain_flashinfer_all_reduce"
# The flashinfer-python that vllm 0.33.0 requires (its wheel's Requires-Dist)
# and was tested with.
VLLM_PINNED_FLASHINFER = "0.7.2.post1"
# Installs this build with a FlashInfer that has the MNNVL fix, run in this
# build's source tree.
FIXED_FLASHINFER_INSTALL_COMMAND = "pip install -C flashinfer=0.7.4 ."
# Makes the sdist of that build, for an image built from the sdist (README).
FIXED_FLASHINFER_SDIST_COMMAND = "python -m build --sdist -C flashinfer=0.7.4"


@dataclass(frozen=True)
class FiJitCacheProvider:
    """A package of FlashInfer's prebuilt kernels, as the jit-cache shim
    lists it (`get_jit_cache_providers()`, read by `_get_aot_providers` in
    flashinfer/jit/env.py)."""

    distribution: str
    version: str
    modules: frozenset[str] | None = None
    """The kernel modules it holds; None where the shim does not say."""
    cuda_architectures: frozenset[str] | None = None
    """The CUDA targets it was built for (sm90a, sm100f, ...); None where
    the shim does not say."""

    def holds(self, module: str, device_capability: int | None) -> bool:
        """Whether FlashInfer could load `module` from here on this GPU.

        What the provider does not say, and a GPU that is not known, count
        as held: a provider is never left out of the count on a guess.
        """
        if self.modules is not None and module not in self.modules:
            return False
        if self.cuda_architectures is None or device_capability is None:
            return True
        return any(
            _runs_on(target, device_capability) for target in self.cuda_architectures
        )


_CUDA_TARGET = re.compile(r"sm(\d{1,2})(\d)([af]?)")


def _runs_on(target: str, device_capability: int) -> bool:
    """Whether kernels built for CUDA `target` run on this GPU.

    FlashInfer's rule (`cuda_binary_target_compatibility_score` in
    flashinfer/jit/_cuda_architecture.py): an `a` target needs the exact
    compute capability; a plain or `f` target runs on the same major at
    the same or a later minor. A target it cannot read is kept.
    """
    match = _CUDA_TARGET.fullmatch(target)
    if match is None:
        return True
    major, minor, suffix = int(match[1]), int(match[2]), match[3]
    device_major, device_minor = divmod(device_capability, 10)
    if suffix == "a":
        return (major, minor) == (device_major, device_minor)
    return major == device_major and minor <= device_minor


@dataclass(frozen=True)
class FiArBackendInputs:
    """Everything the FlashInfer all-reduce backend choice depends on."""

    setting: str
    """`VLLM_FLASHINFER_ALLREDUCE_BACKEND`: auto, trtllm or mnnvl."""
    node_count: int
    """Number of nodes the all-reduce process group spans."""
    device_capability: int | None
    """CUDA compute capability as `<major><minor>` (90, 100, ...)."""
    hisparse: bool
    """Whether HiSparse sparse-MLA KV offload is on."""
    flashinfer_version: str | None
    """Installed flashinfer-python version, if known."""
    multicast: bool | None = None
    """NVSwitch multicast availability; None while unknown (at start-up it is
    only learned by trying to create an mnnvl workspace)."""
    flashinfer_jit_cache_version: str | None = None
    """Installed flashinfer-jit-cache version (FlashInfer's prebuilt
    kernels), if any."""
    flashinfer_version_check: bool = True
    """Whether FlashInfer refuses a flashinfer-jit-cache of another release;
    False while FLASHINFER_DISABLE_VERSION_CHECK is set."""
    flashinfer_jit_cache_providers: tuple[FiJitCacheProvider, ...] = ()
    """The kernel packages the jit-cache shim lists."""
    flashinfer_aot_module: bool = False
    """Whether flashinfer-python's own flashinfer/data/aot holds a prebuilt
    MNNVL module, which FlashInfer loads before any other, unchecked."""
    fabric: bool | None = None
    """Whether every rank of a multi-node group has an NVLink fabric
    (FlashInfer's `is_mnnvl_fabric_supported`); None while unknown. Start-up
    probes it on every rank of a group that spans nodes."""


@dataclass(frozen=True)
class FiArBackendDecision:
    """The outcome of `decide_fi_ar_backend`."""

    backend: str | None
    """The backend to create, or None to turn FlashInfer all-reduce off."""
    allow_trtllm_fallback: bool
    """Whether a failed mnnvl workspace may be retried as trtllm."""
    reason: str
    """One line saying why, for logs and `explain`."""
    known_issue: str | None = None
    """The FI_AR_KNOWN_ISSUES entry that changed or flagged the choice."""


@dataclass(frozen=True)
class FiArKnownIssue:
    """A FlashInfer bug that makes `auto` steer clear of a backend.

    An entry retires itself: once the FlashInfer release whose kernels will
    run (`kernel_release`) is at or above `fixed_in`, `auto` makes its normal
    choice again. Adding an entry needs no change to the decision logic.
    """

    name: str
    summary: str
    links: tuple[str, ...]
    trigger: str
    """When it fires, in words."""
    effect: str
    """What the unsafe backend does then, in a few words for a log line."""
    applies: Callable[[FiArBackendInputs], bool]
    """The trigger condition, on the decision inputs."""
    unsafe_backend: str
    single_node_backend: str | None
    """What `auto` uses instead on a single node (None: off)."""
    multi_node_backend: str | None
    """What `auto` uses instead on a multi-node group (None: off)."""
    replacement_note: str
    """Why a group gets no replacement, for the reason line."""
    fixed_in: str | None
    """First flashinfer-python release with the fix; None while unreleased."""
    fix: str | None = None
    """Where the fix is in that release, for the line saying it is retired."""
    get_fix: str | None = None
    """How to install this build with the fix, while it runs without, in
    full: explain and the docs show it, the log line points to them."""

    def is_fixed(self, flashinfer_version: str | None) -> bool:
        """Whether FlashInfer `flashinfer_version` already carries the fix."""
        if self.fixed_in is None or flashinfer_version is None:
            return False
        try:
            return Version(flashinfer_version) >= Version(self.fixed_in)
        except InvalidVersion:
            return False

    def replacement(self, node_count: int) -> str | None:
        """The backend `auto` uses instead of the unsafe one."""
        if node_count == 1:
            return self.single_node_backend
        return self.multi_node_backend


FI_AR_KNOWN_ISSUES: tuple[FiArKnownIssue, ...] = (
    FiArKnownIssue(
        name="flashinfer#7782",
        summary=(
            "FlashInfer's MNNVL all-reduce has a cluster-barrier race that "
            "HiSparse host gathers set off (CUDA error: unspecified launch "
            "failure)"
        ),
        links=(
            "https://github.com/flashinfer-ai/flashinfer/issues/7782",
            "https://github.com/vllm-project/vllm/issues/64327",
        ),
        trigger="HiSparse is on",
        effect="crashes with HiSparse",
        applies=lambda inputs: inputs.hisparse,
        unsafe_backend="mnnvl",
        single_node_backend="trtllm",
        multi_node_backend=None,
        replacement_note="trtllm cannot span nodes",
        fixed_in="0.7.4",
        # flashinfer/data/include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh
        # in the flashinfer-python 0.7.4 wheel; 0.7.2.post1 waits on warp 0
        # of block 0 only.
        fix="every thread waits at the cluster barrier in LamportFlags::ctaArrive()",
        get_fix=(
            f"install this build on FlashInfer 0.7.4: from its source tree, "
            f"`{FIXED_FLASHINFER_INSTALL_COMMAND}`; for an image built from its "
            f"sdist, make the sdist with `{FIXED_FLASHINFER_SDIST_COMMAND}` in "
            "the source tree and build the image from the .fi074 sdist it makes "
            "(README: FlashInfer 0.7.4, the release with the fix). The default "
            f"stays on vLLM's tested pin, {VLLM_PINNED_FLASHINFER}"
        ),
    ),
)


def _same_release(jit_cache_version: str, flashinfer_version: str) -> bool:
    """FlashInfer's test that a flashinfer-jit-cache is of its own release.

    Only a CUDA local suffix may differ (0.7.4+cu129 for 0.7.4); see
    `_check_jit_cache_version` in flashinfer/jit/env.py.
    """
    return jit_cache_version == flashinfer_version or jit_cache_version.startswith(
        f"{flashinfer_version}+"
    )


def _same_kernels(first: str, second: str) -> bool:
    """Whether two packages' versions name one release: PEP 440 equal but
    for a local suffix (0.7.4+cu129, 0.7.4.0), or FlashInfer's own test."""
    try:
        return Version(first).public == Version(second).public
    except InvalidVersion:
        return _same_release(first, second) or _same_release(second, first)


def _older(first: str, second: str) -> str:
    """The older of two releases; one that cannot be read counts as older,
    so that it is never taken for a fix."""
    for release in (first, second):
        try:
            Version(release)
        except InvalidVersion:
            return release
    return first if Version(first) < Version(second) else second


def _accepted(inputs: FiArBackendInputs) -> list[tuple[str, str]]:
    """The jit-cache packages FlashInfer would take MNNVL kernels from, as
    (release, package) pairs, providers first; [] when it builds its own.

    FlashInfer's rules (`_get_aot_providers` and
    `_check_jit_cache_provider_version` in flashinfer/jit/env.py): the shim
    must be of flashinfer-python's release, and each provider of the shim's
    own version, unless FLASHINFER_DISABLE_VERSION_CHECK is set; a provider
    serves the module only where it holds it for this GPU
    (`get_aot_artifacts`). An accepted shim counts whatever it lists: this
    build takes no package FlashInfer loads for a fix on a guess.
    """
    installed, shim = inputs.flashinfer_version, inputs.flashinfer_jit_cache_version
    if installed is None or shim is None:
        return []
    check = inputs.flashinfer_version_check and installed != FLASHINFER_SOURCE_VERSION
    if check and not _same_release(shim, installed):
        return []
    providers = [
        (provider.version, f"{provider.distribution} {provider.version}")
        for provider in inputs.flashinfer_jit_cache_providers
        if not (
            check
            and (
                not _same_release(provider.version, installed)
                or provider.version != shim
            )
        )
        and provider.holds(MNNVL_KERNEL_MODULE, inputs.device_capability)
    ]
    return [*providers, (shim, f"flashinfer-jit-cache {shim}")]


def kernel_release(inputs: FiArBackendInputs) -> tuple[str | None, str]:
    """The FlashInfer release whose MNNVL all-reduce kernels will run, and
    the package they are counted from, for the reason line.

    The release is the oldest of flashinfer-python and every jit-cache
    package FlashInfer would load the module from (`_accepted`). A module
    under flashinfer/data/aot is loaded first and unchecked
    (`get_aot_artifacts` in flashinfer/jit/env.py); no release of it can be
    read, so the release is None, which no known issue counts as fixed.
    """
    installed = inputs.flashinfer_version
    if installed is None:
        return None, NO_FLASHINFER
    if inputs.flashinfer_aot_module:
        return None, (
            f"flashinfer-python {installed}'s flashinfer/data/aot/"
            f"{MNNVL_KERNEL_MODULE} (prebuilt, of no known release)"
        )
    own = (installed, f"flashinfer-python {installed}")
    accepted = _accepted(inputs)
    release, package = (accepted or [own])[0]
    for other, name in [*accepted[1:], own]:
        if not _same_kernels(other, release) and _older(other, release) == other:
            release, package = other, name
    if accepted and not inputs.flashinfer_version_check:
        package += f" ({FLASHINFER_VERSION_CHECK_ENV} is set)"
    return release, package


def fix_hint(issue: FiArKnownIssue, inputs: FiArBackendInputs) -> str | None:
    """How to get the fix of `issue`, in full, for explain and the docs;
    None while FlashInfer has not released it."""
    if issue.fixed_in is None:
        return None
    release, package = kernel_release(inputs)
    if inputs.flashinfer_aot_module:
        return (
            f"remove flashinfer/data/aot/{MNNVL_KERNEL_MODULE} from the "
            "flashinfer-python install: FlashInfer loads it before any other "
            "kernels and checks no version"
        )
    if issue.is_fixed(inputs.flashinfer_version) and not issue.is_fixed(release):
        return (
            f"flashinfer-python {inputs.flashinfer_version} has the fix, but "
            f"FlashInfer loads the kernels of {package}: unset "
            f"{FLASHINFER_VERSION_CHECK_ENV}, or run `flashinfer download-kernels` "
            "for jit-cache packages of flashinfer-python's release"
        )
    return issue.get_fix


# What start-up raises for trtllm on a multi-node group: upstream's
# ValueError in get_fi_ar_workspace (flashinfer_all_reduce.py), which every
# path that uses FlashInfer all-reduce calls first.
TRTLLM_MULTI_NODE_ERROR = (
    "Flashinfer allreduce is not supported for multi-node allreduce with "
    "'trtllm' backend. Please use 'mnnvl' backend instead."
)


def backend_span_error(backend: str | None, node_count: int) -> str | None:
    """The error start-up raises for `backend` on `node_count` nodes, if any.

    trtllm is single-node only. Start-up raises upstream's ValueError for
    it; this returns the same words (TRTLLM_MULTI_NODE_ERROR), so that
    `explain` and the docs show what the operator will see.
    """
    if backend != "trtllm" or node_count == 1:
        return None
    return TRTLLM_MULTI_NODE_ERROR


def _auto_choice(inputs: FiArBackendInputs) -> FiArBackendDecision:
    """What `auto` picks when no known issue applies (vllm 0.33.0's rule)."""
    if inputs.node_count == 1:
        if inputs.multicast is False:
            return FiArBackendDecision(
                "trtllm", False, "auto, single node without NVSwitch multicast"
            )
        # MNNVL decodes faster than TRTLLM on single-node NVSwitch systems
        # (about 3% at TP8 on 8xB200 in the measurements on vllm#64327);
        # TRTLLM is the fallback where the node lacks the multicast that
        # MNNVL needs.
        return FiArBackendDecision(
            "mnnvl",
            True,
            "auto, single node (trtllm if NVSwitch multicast is unavailable)",
        )
    if (
        inputs.device_capability is not None
        and inputs.device_capability >= MNNVL_MULTI_NODE_MIN_CAPABILITY
    ):
        return FiArBackendDecision(
            "mnnvl",
            False,
            f"auto, {inputs.node_count} nodes on Blackwell: mnnvl is the only "
            "backend that spans nodes",
        )
    return FiArBackendDecision(
        None,
        False,
        f"auto, {inputs.node_count} nodes: a multi-node group needs MNNVL on "
        "Blackwell (SM100+), so FlashInfer all-reduce is off",
    )


def _without_multicast(
    inputs: FiArBackendInputs, decision: FiArBackendDecision
) -> FiArBackendDecision:
    """What becomes of `decision` on a node known to lack NVSwitch multicast.

    An mnnvl workspace cannot be created there. Only `auto` on one node may
    fall back to trtllm (`_auto_choice` already picks it when multicast is
    known to be missing); an explicit mnnvl and a multi-node mnnvl end with
    FlashInfer all-reduce off, as start-up does when the creation fails.
    """
    if decision.backend != "mnnvl" or inputs.multicast is not False:
        return decision
    return FiArBackendDecision(
        None,
        False,
        f"{decision.reason}; but mnnvl needs NVSwitch multicast, which this "
        "node lacks, so its workspace cannot be created and FlashInfer "
        "all-reduce is off",
        known_issue=decision.known_issue,
    )


def _without_fabric(
    inputs: FiArBackendInputs, decision: FiArBackendDecision
) -> FiArBackendDecision:
    """What becomes of `decision` on a multi-node group without an NVLink fabric.

    mnnvl spans nodes only over an NVLink fabric (GB200 NVL72 and the like),
    where FlashInfer shares its memory as fabric handles. Without one,
    FlashInfer 0.7.2.post1 falls back to POSIX file descriptors over a local
    socket, which cannot reach another node (`make_handle_exchanger` in
    flashinfer/comm/mnnvl.py), and times out (vllm#51986); 0.7.4 raises
    (`choose_mnnvl_handle_type`). So the choice is off, for `auto` and an
    explicit mnnvl alike. One node needs no fabric.
    """
    if (
        decision.backend != "mnnvl"
        or inputs.node_count == 1
        or inputs.fabric is not False
    ):
        return decision
    return FiArBackendDecision(
        None,
        False,
        f"{decision.reason}; but mnnvl across nodes needs an NVLink fabric "
        "(multi-node NVLink), which not every rank has, so FlashInfer "
        "all-reduce is off",
        known_issue=decision.known_issue,
    )


def decide_fi_ar_backend(
    inputs: FiArBackendInputs,
    known_issues: tuple[FiArKnownIssue, ...] | None = None,
) -> FiArBackendDecision:
    """Choose the FlashInfer all-reduce backend; a pure function of `inputs`.

    An explicit setting is obeyed (a known issue only adds a warning to the
    reason). `auto` takes vllm 0.33.0's choice, then steers around any
    unfixed known issue that applies to it. `known_issues` defaults to
    FI_AR_KNOWN_ISSUES. Multicast known to be missing turns an mnnvl choice
    off, as its failed workspace does at start-up; so does a multi-node
    group known to lack an NVLink fabric, where mnnvl cannot work.
    """
    decision = _decide(inputs, known_issues)
    return _without_fabric(inputs, _without_multicast(inputs, decision))


def _decide(
    inputs: FiArBackendInputs,
    known_issues: tuple[FiArKnownIssue, ...] | None,
) -> FiArBackendDecision:
    """`decide_fi_ar_backend` before a known lack of multicast is applied."""
    if known_issues is None:
        known_issues = FI_AR_KNOWN_ISSUES
    if inputs.setting not in FI_AR_BACKEND_CHOICES:
        raise ValueError(
            f"Invalid value {inputs.setting!r} for {FI_AR_BACKEND_ENV}. "
            f"Valid options: {list(FI_AR_BACKEND_CHOICES)}."
        )
    release, package = kernel_release(inputs)
    if inputs.setting != "auto":
        for issue in known_issues:
            if (
                issue.unsafe_backend == inputs.setting
                and issue.applies(inputs)
                and not issue.is_fixed(release)
            ):
                return FiArBackendDecision(
                    inputs.setting,
                    False,
                    f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly, and "
                    f"{issue.unsafe_backend} {issue.effect} on the kernels of "
                    f"{package} {_see(issue)}",
                    known_issue=issue.name,
                )
        return FiArBackendDecision(
            inputs.setting,
            False,
            f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly",
        )

    choice = _auto_choice(inputs)
    retired = []
    for issue in known_issues:
        if choice.backend != issue.unsafe_backend or not issue.applies(inputs):
            continue
        if issue.is_fixed(release):
            retired.append(
                f"the {issue.name} override is retired: the kernels of {package} "
                f"have the fix (FlashInfer {issue.fixed_in} and newer)"
            )
            continue
        backend = issue.replacement(inputs.node_count)
        if backend:
            action = f"using {backend} on a single node"
        else:
            action = (
                f"FlashInfer all-reduce is off on {inputs.node_count} nodes "
                f"({issue.replacement_note})"
            )
        return FiArBackendDecision(
            backend,
            False,
            f"auto, {issue.trigger}: {action}, as {issue.unsafe_backend} "
            f"{issue.effect} on the kernels of {package} {_see(issue)}",
            known_issue=issue.name,
        )
    if retired:
        return FiArBackendDecision(
            choice.backend,
            choice.allow_trtllm_fallback,
            f"{choice.reason}; {'; '.join(retired)}",
        )
    return choice


def _see(issue: FiArKnownIssue) -> str:
    """The end of a reason line: the issue, its fix, where the details are."""
    fixed = f"fixed in FlashInfer {issue.fixed_in}" if issue.fixed_in else "unfixed"
    return f"({issue.name}, {fixed}; details: {EXPLAIN_COMMAND})"


def known_issue_detail(
    inputs: FiArBackendInputs, decision: FiArBackendDecision
) -> dict[str, Any] | None:
    """What the reason line of `decision` leaves out, for explain: the
    issue in full, whose kernels run, how to get the fix, the override."""
    issue = next(
        (i for i in FI_AR_KNOWN_ISSUES if i.name == decision.known_issue), None
    )
    if issue is None:
        return None
    _, package = kernel_release(inputs)
    if inputs.setting == "auto":
        override = (
            f"{FI_AR_BACKEND_ENV}={issue.unsafe_backend} forces "
            f"{issue.unsafe_backend}, the backend that {issue.effect} here"
        )
    else:
        override = f"unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend"
    fix = f"FlashInfer {issue.fixed_in}" if issue.fixed_in else None
    if fix and issue.fix:
        fix += f": {issue.fix}"
    return {
        "name": issue.name,
        "summary": issue.summary,
        "links": list(issue.links),
        "kernels": package,
        "fixed_in": fix,
        "get_fix": fix_hint(issue, inputs),
        "override": override,
    }
