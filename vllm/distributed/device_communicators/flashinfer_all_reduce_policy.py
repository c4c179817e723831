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

from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
FI_AR_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")
# MNNVL spans nodes on Blackwell (SM100) and newer only.
MNNVL_MULTI_NODE_MIN_CAPABILITY = 100
# FlashInfer's own variable: set to anything non-empty, FlashInfer loads a
# flashinfer-jit-cache of another release (flashinfer/jit/env.py).
FLASHINFER_VERSION_CHECK_ENV = "FLASHINFER_DISABLE_VERSION_CHECK"
# The flashinfer-python that vllm 0.33.0 requires (its wheel's Requires-Dist)
# and was tested with.
VLLM_PINNED_FLASHINFER = "0.7.2.post1"
# Installs this build with a FlashInfer that has the MNNVL fix, run in this
# build's source tree.
FIXED_FLASHINFER_INSTALL_COMMAND = "pip install -C flashinfer=0.7.4 ."


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
    applies: Callable[[FiArBackendInputs], bool]
    """The trigger condition, on the decision inputs."""
    unsafe_backend: str
    single_node_backend: str | None
    """What `auto` uses instead on a single node (None: off)."""
    multi_node_backend: str | None
    """What `auto` uses instead on a multi-node group (None: off)."""
    replacement_note: str
    """Why those replacements, for the reason line."""
    fixed_in: str | None
    """First flashinfer-python release with the fix; None while unreleased."""
    fix: str | None = None
    """Where the fix is in that release, for the line saying it is retired."""
    get_fix: str | None = None
    """How to install this build with the fix, while it runs without."""

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
        applies=lambda inputs: inputs.hisparse,
        unsafe_backend="mnnvl",
        single_node_backend="trtllm",
        multi_node_backend=None,
        replacement_note="trtllm has no such race but cannot span nodes",
        fixed_in="0.7.4",
        # flashinfer/data/include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh
        # in the flashinfer-python 0.7.4 wheel; 0.7.2.post1 waits on warp 0
        # of block 0 only.
        fix="every thread waits at the cluster barrier in LamportFlags::ctaArrive()",
        get_fix=(
            f"`{FIXED_FLASHINFER_INSTALL_COMMAND}` in this build's source tree "
            "installs this build with it; the default stays on vLLM's tested "
            f"pin, {VLLM_PINNED_FLASHINFER}"
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


def _older(first: str, second: str) -> str:
    """The older of two releases; one that cannot be read counts as older,
    so that it is never taken for a fix."""
    for release in (first, second):
        try:
            Version(release)
        except InvalidVersion:
            return release
    return first if Version(first) < Version(second) else second


def kernel_release(inputs: FiArBackendInputs) -> tuple[str | None, str | None]:
    """The FlashInfer release whose all-reduce kernels will run, and a note
    when that is not the installed flashinfer-python's.

    FlashInfer loads its all-reduce modules (the MNNVL one is
    `trtllm_mnnvl_comm`) prebuilt from flashinfer-jit-cache when that is its
    own release, or of any release while FLASHINFER_DISABLE_VERSION_CHECK is
    set; otherwise it builds them from flashinfer-python's own source
    (`_get_aot_providers` in flashinfer/jit/env.py). A jit-cache of another
    release is used only if it has the module for this GPU, so the older of
    the two releases is the one that counts.
    """
    installed = inputs.flashinfer_version
    jit_cache = inputs.flashinfer_jit_cache_version
    if (
        installed is None
        or jit_cache is None
        or inputs.flashinfer_version_check
        or _same_release(jit_cache, installed)
        or _older(jit_cache, installed) == installed
    ):
        return installed, None
    return jit_cache, (
        f"flashinfer-python {installed} would run the kernels of "
        f"flashinfer-jit-cache {jit_cache} ({FLASHINFER_VERSION_CHECK_ENV} is set)"
    )


def _fix_hint(issue: FiArKnownIssue, inputs: FiArBackendInputs) -> str | None:
    """What gets the fix of `issue`, for a reason line; None while unreleased."""
    if issue.fixed_in is None:
        return None
    if issue.is_fixed(inputs.flashinfer_version):
        # flashinfer-python has the fix, so a jit-cache runs without it.
        _, jit_cache_note = kernel_release(inputs)
        return (
            f"{jit_cache_note}, which lack the fix of {issue.fixed_in}: unset "
            f"{FLASHINFER_VERSION_CHECK_ENV}, or run `flashinfer download-kernels` "
            "for a flashinfer-jit-cache of the same release"
        )
    hint = f"FlashInfer {issue.fixed_in} fixes it"
    return f"{hint}: {issue.get_fix}" if issue.get_fix else hint


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
    release, jit_cache_note = kernel_release(inputs)
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
                    _sentences(
                        f"{FI_AR_BACKEND_ENV}={inputs.setting} is set explicitly; "
                        f"this is known to crash when {issue.trigger}: "
                        f"{issue.summary} ({issue.name})",
                        _fix_hint(issue, inputs),
                    ),
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
            has_fix = (
                f"{jit_cache_note}, which have the fix"
                if jit_cache_note
                else f"flashinfer-python {release} has the fix"
            )
            since = f"{issue.fixed_in} and newer"
            retired.append(
                f"the {issue.name} override is retired: {has_fix} "
                f"({f'{since}: {issue.fix}' if issue.fix else since})"
            )
            continue
        backend = issue.replacement(inputs.node_count)
        where = (
            "on a single node"
            if inputs.node_count == 1
            else f"on {inputs.node_count} nodes"
        )
        action = f"using {backend}" if backend else "FlashInfer all-reduce is off"
        return FiArBackendDecision(
            backend,
            False,
            _sentences(
                f"auto, {issue.trigger}: {issue.summary} ({issue.name}); {action} "
                f"{where} ({issue.replacement_note})",
                _fix_hint(issue, inputs),
                f"Set {FI_AR_BACKEND_ENV}={issue.unsafe_backend} to override",
            ),
            known_issue=issue.name,
        )
    if retired:
        return FiArBackendDecision(
            choice.backend,
            choice.allow_trtllm_fallback,
            f"{choice.reason}; {'; '.join(retired)}",
        )
    return choice


def _sentences(*parts: str | None) -> str:
    """One reason line from its parts, leaving out those that are None."""
    return ". ".join(part for part in parts if part)
