# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce: the backend a workspace gets, with the FlashInfer bugs
`auto` steers around as data; the ranks of a group agree on it in one gather on
vLLM's group; and each collective step (a creation, checkpoint_prepare or
checkpoint_restore) runs over the group's store, bounded as vLLM bounds its CPU
groups, and ends in ballots that every rank maps to the same outcome."""

import dataclasses
import functools
import importlib
import inspect
import weakref
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.device_communicators.store_step import (
    Outcome,
    Step,
    some_ranks,
)
from vllm.distributed.parallel_state import _node_count
from vllm.logger import init_logger
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
# The dtypes FlashInferAllReduce.should_use_fi_ar accepts.
FI_AR_DTYPES = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class FiArBackendInputs:
    setting: str
    node_count: int
    device_capability: int | None  # such as 100; None without a GPU
    hisparse: bool | None  # None while no vLLM config is current
    kernels: tuple[tuple[str, str], ...]  # (package, release) of what may load
    dtype: str | None = None  # the workspace's; None until one is created
    no_fabric: tuple[int, ...] = ()  # ranks where FlashInfer finds no fabric
    world_size: int = 2
    nvlink_connected: bool = True  # every pair of the group's GPUs, says NVML


@dataclasses.dataclass(frozen=True)
class FiArKnownIssue:
    name: str
    backend: str
    trigger: str
    applies: Callable[[FiArBackendInputs], bool]
    effect: str
    fixed_in: str | None  # the first FlashInfer release with the fix


FI_AR_KNOWN_ISSUES = (
    # include/flashinfer/comm/trtllm_mnnvl_allreduce.cuh, LamportFlags::ctaArrive():
    # one warp of one block waits in 0.7.2.post1, every thread in 0.7.4.
    FiArKnownIssue(
        name="flashinfer#7782",
        backend="mnnvl",
        trigger="HiSparse is on",
        applies=lambda inputs: inputs.hisparse is not False,
        effect="crashes with HiSparse (CUDA error: unspecified launch failure)",
        fixed_in="0.7.4",
    ),
    # The same file's oneshotAllreduceFusionKernel squares in T in 0.7.2.post1
    # (lines 1009-1010: `toFloat<T>(x * x)`), in fp32 in 0.7.4 (lines 1013-1016).
    FiArKnownIssue(
        name="mnnvl fp16 RMSNorm overflow",
        backend="mnnvl",
        trigger="the workspace is float16",
        applies=lambda inputs: inputs.dtype == "float16",
        effect="zeroes tokens above 255.94 in one-shot RMSNorm (x * x overflows fp16)",
        fixed_in="0.7.4",
    ),
    # A topology, not a bug: custom_all_reduce.py refuses the same groups.
    FiArKnownIssue(
        name="vllm#48075, vllm#48071, sglang#32330",
        backend="trtllm",
        trigger="more than two GPUs are not all NVLink-connected",
        applies=lambda i: i.world_size > 2 and not i.nvlink_connected,
        effect="runs over PCIe, up to 34 times slower than no fusion",
        fixed_in=None,
    ),
)


@dataclasses.dataclass(frozen=True)
class FiArBackendDecision:
    backend: str | None  # None: FlashInfer all-reduce is off
    allow_trtllm_fallback: bool
    reason: str
    known_issues: tuple[FiArKnownIssue, ...] = ()  # per candidate: took it, or is hit


def installed_kernels() -> tuple[tuple[str, str], ...]:
    """flashinfer-python, a flashinfer-jit-cache shim and each provider it lists.
    Which one loads is FlashInfer's rule (flashinfer/jit/env.py): counting every
    one can only keep a workaround, never drop one."""
    try:
        kernels = [("flashinfer-python", version("flashinfer-python"))]
    except PackageNotFoundError:
        return ()
    try:
        shim = importlib.import_module("flashinfer_jit_cache")
        kernels.append(("flashinfer-jit-cache", str(shim.__version__)))
        providers = list(shim.get_jit_cache_providers())
    except ImportError:
        return tuple(kernels)
    except Exception:  # unreadable: no fix counts
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
    """An explicit setting is obeyed; `auto` takes the first of vLLM 0.34.0's
    candidates (less its HiSparse override) that no unfixed known issue hits."""
    release, package = kernel_release(inputs.kernels)
    unfixed: dict[str, FiArKnownIssue] = {}  # the first per backend
    for entry in known_issues:
        fixed = release and entry.fixed_in and release >= Version(entry.fixed_in)
        if entry.applies(inputs) and not fixed:
            unfixed.setdefault(entry.backend, entry)
    nodes = inputs.node_count
    if inputs.setting != "auto":
        candidates, reason = [inputs.setting], f"{FI_AR_BACKEND_ENV}={inputs.setting}"
    elif nodes == 1:
        candidates, reason = ["mnnvl", "trtllm"], "auto, one node"
    elif (inputs.device_capability or 0) >= 100:
        candidates, reason = ["mnnvl"], f"auto, {nodes} nodes on Blackwell"
    else:
        candidates, reason = [], f"auto, {nodes} nodes below Blackwell (SM100)"
    safe = [b for b in candidates if inputs.setting != "auto" or b not in unfixed]
    backend = safe[0] if safe else None
    issues = tuple(unfixed[b] for b in candidates if b in unfixed)
    for issue in issues:
        fix = f"fixed in {issue.fixed_in}, not in {package}" if issue.fixed_in else ""
        reason += f"; {issue.trigger}: {issue.backend} {issue.effect} ({issue.name}"
        reason += f"; {fix})" if fix else ")"
    if backend == "mnnvl" and nodes > 1 and inputs.no_fabric:  # vllm#51986
        backend = None
        reason += (
            f"; FlashInfer finds no NVLink fabric on {some_ranks(inputs.no_fabric)}"
        )
    fallback = backend == "mnnvl" and "trtllm" in safe
    return FiArBackendDecision(backend, fallback, reason, issues)


class FiArGroup:
    """A group's agreed decision per workspace dtype, its bound, the backends
    given up until destroy, and FlashInfer's comm backend, which FlashInfer
    keeps for its checkpoints: exchanges run inside this group's step only."""

    def __init__(self, group: ProcessGroup, decisions: dict, nodes: int, config):
        # Not the group: _groups holds this weakly keyed by it.
        self.store = dist.PrefixStore("vllm-fi-ar", group.get_group_store())
        self.decisions, self.node_count = decisions, nodes
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank, self.config = dist.get_rank(group), config
        self.logged: set[FiArBackendDecision] = set()  # by the group's rank 0
        self.failed: set[str] = set()
        self.step: Step | None = None
        self.last = ""  # the last step's nonce
        self.speaker = -1  # the last step's first rank that answered

    def run(self, what: str, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        self.step = Step(
            self.store, self.ranks, self.rank, what, self.bound_s(), self.last
        )
        try:
            return self.step.run(body)
        finally:
            self.last, self.speaker = self.step.nonce, self.step.speaker
            self.step = None

    def bound_s(self) -> float:
        """vLLM's timeout for its CPU groups as it stands now (fault tolerance
        applies the configured one only once start-up is over), else gloo's."""
        config = self.config or get_current_vllm_config_or_none()
        timeout = config and config.parallel_config.effective_cpu_distributed_timeout
        return (timeout or dist.default_pg_timeout).total_seconds()

    def decision(self, dtype: torch.dtype | None) -> FiArBackendDecision:
        return self.decisions.get(
            str(dtype).removeprefix("torch."), self.decisions[None]
        )

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.ranks)

    def allgather(self, data: Any) -> tuple[Any, ...]:
        if self.step is None:
            raise RuntimeError("FlashInfer all-reduce exchanged outside a step")
        return tuple(self.step.exchange(data))

    def bcast(self, data: Any, root: int) -> Any:
        return self.allgather(data)[root]

    def barrier(self) -> None:
        self.allgather(None)

    def warning(self, msg: str, *args: Any) -> None:
        """Upstream's warning that its creation failed: into this rank's ballot."""
        assert self.step is not None
        self.step.failures.append(msg % args)


_groups = weakref.WeakKeyDictionary[ProcessGroup, FiArGroup]()


def _probe(what: str, probe: Callable[..., Any], *args: Any) -> Any:
    """One that fails answers no: it can only take a backend away."""
    try:
        return probe(*args)
    except Exception as e:
        logger.warning_once("FlashInfer all-reduce: the %s probe failed: %s", what, e)
        return False


def _fabric(device: int) -> bool:
    """FlashInfer's own probe, where mnnvl would span nodes."""
    mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
    return bool(mnnvl.is_mnnvl_fabric_supported(device))


def agreed(group: ProcessGroup, config: "VllmConfig | None" = None) -> FiArGroup:
    """The group's agreement, reached on first use under `config` (the vLLM
    config current then): one gather of each rank's facts, with its NVLink
    fabric across nodes and, as custom_all_reduce.py does, whether the GPUs of
    a group of more than two on one node are all NVLink-connected. Every rank
    decides for every rank; ranks that would run different backends are off."""
    if group in _groups:
        return _groups[group]
    capability = current_platform.get_device_capability()
    # vLLM sets hisparse_config for a HiSparseConnector, also in a MultiConnector.
    attention = None if config is None else config.attention_config
    inputs = FiArBackendInputs(
        setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
        node_count=_node_count(group),
        device_capability=None if capability is None else capability.to_int(),
        hisparse=None if attention is None else attention.hisparse_config is not None,
        kernels=installed_kernels(),
        world_size=dist.get_world_size(group),
    )

    def per_dtype(rank: FiArBackendInputs, **facts: Any) -> dict:
        return {  # a known issue may hit one dtype only
            dtype: decide_fi_ar_backend(dataclasses.replace(rank, dtype=dtype, **facts))
            for dtype in (None, *FI_AR_DTYPES)
        }

    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    views: list[Any] = [None] * inputs.world_size
    nvlink = inputs.node_count == 1 and inputs.world_size > 2
    if nvlink:
        physical = current_platform.visible_device_id_to_physical_device_id
        dist.all_gather_object(views, _probe("device", physical, device), group)
    ids = list(views)
    mnnvl = "mnnvl" in {d.backend for d in per_dtype(inputs).values()}
    fabric = inputs.node_count > 1 and mnnvl
    dist.all_gather_object(
        views,
        (
            inputs,
            not fabric or _probe("NVLink fabric", _fabric, device),
            not nvlink or _probe("NVLink", current_platform.is_fully_connected, ids),
        ),
        group,
    )
    ranks = dist.get_process_group_ranks(group)
    no_fabric = tuple(r for r, v in zip(ranks, views, strict=True) if not v[1])
    seen = dict(no_fabric=no_fabric, nvlink_connected=all(v[2] for v in views))
    plans = [per_dtype(v[0], **seen) for v in views]
    mine = plans[dist.get_rank(group)]
    if inputs.hisparse is None and mine != per_dtype(inputs, hisparse=False, **seen):
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash on these kernels."
        )
    runs = [[(d.backend, d.allow_trtllm_fallback) for d in p.values()] for p in plans]
    off = None
    if differ := [r for r, run in zip(ranks, runs, strict=True) if run != runs[0]]:
        if dist.get_rank(group) == 0:
            logger.error(
                "FlashInfer all-reduce is off for ranks %s: %s chose other backends "
                "than rank %d. Make these the same on every node: %s, the HiSparse "
                "config, the GPU and the FlashInfer packages.",
                ranks,
                some_ranks(differ),
                ranks[0],
                FI_AR_BACKEND_ENV,
            )
        off = FiArBackendDecision(None, False, "the ranks disagree")
        mine = dict.fromkeys(mine, off)
    fi = _groups[group] = FiArGroup(group, mine, inputs.node_count, config)
    if off is not None:
        fi.logged.add(off)  # the error said it
    return fi


def resolve_fi_ar_backend(
    group: ProcessGroup, dtype: torch.dtype | None, config: "VllmConfig | None"
) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses for a
    workspace of `dtype` (None: not yet known). The group's own rank 0 logs it,
    whatever its local rank (vLLM's *_once lines print on local rank 0): the
    first dtype's line, then one for each dtype that a known issue moves."""
    fi = agreed(group, config)
    d = fi.decision(dtype)
    if d not in fi.logged and fi.rank == 0:
        fi.logged.add(d)
        warn = any(issue.backend == d.backend for issue in d.known_issues)
        (logger.warning if warn else logger.info)(
            "FlashInfer all-reduce backend for ranks %s: %s%s (%s)%s",
            fi.ranks,
            f"{str(dtype).removeprefix('torch.')}: " * (d != fi.decisions[None]),
            d.backend or "off",
            d.reason,
            f". Unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend." * warn,
        )
    return d.backend, d.allow_trtllm_fallback


def node_count(group: ProcessGroup) -> int:
    return agreed(group).node_count


def forget_failures() -> None:
    """On destroy_fi_ar_workspace, as upstream resets its failed flags."""
    for fi in _groups.values():
        fi.failed.clear()


def on_every_rank(group: ProcessGroup, step: Callable, *args: Any) -> Any:
    """A workspace's checkpoint_prepare or checkpoint_restore: every rank
    returns, or raises: its own exception where the outcome is that a rank
    raised (such as upstream's NotImplementedError), else one saying which
    ranks did not complete (one that did not answer may be blocked for good)."""
    fi = agreed(group)
    result, why, value, raised = fi.run(step.__name__, lambda: step(*args))
    if result is Outcome.RAISE and raised is not None:
        raise raised
    if result is not Outcome.KEEP:
        what = f"FlashInfer all-reduce {step.__name__} for ranks {fi.ranks}"
        raise RuntimeError(f"{what}: {why}") from raised
    return value


def _load_kernels() -> str:
    """trtllm's creation loads its kernels (a JIT build on a cold cache) between
    two exchanges: loaded before its step, where a peer waits for it as for
    any late rank. mnnvl's loads none (0.7.4 loads them at all-reduce)."""
    try:
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as e:
        return f"could not load its kernels: {type(e).__name__}: {e}"
    return ""


def created_on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create` (upstream's _create_workspace, given the FiArGroup as
    `creation`) end the same way on every rank: all keep the workspace, give
    the backend up until destroy, turn FlashInfer all-reduce off, or raise."""
    return lambda create: functools.wraps(create)(
        functools.partial(_create_on_every_rank, registry, create)
    )


def _create_on_every_rank(registry, create: Callable, *args: Any, **kwargs: Any):
    call = inspect.signature(create).bind(*args, **kwargs).arguments
    backend, dtype, group = call["backend"], call["dtype"], call["group"]
    fi = agreed(group)
    if backend in fi.failed:
        return None
    error = _load_kernels() if backend == "trtllm" else ""
    body = functools.partial(create, *args, **kwargs, creation=fi)
    what = f"create {backend} {dtype} x{call['max_token_num']}"
    result, why, workspace, raised = fi.run(
        what, lambda: fi.warning(error) if error else body()
    )
    if result is Outcome.KEEP:
        return workspace
    if workspace is not None:
        del registry[id(workspace)]
        workspace.destroy()
    fi.failed.update(["mnnvl", "trtllm"] if result is Outcome.OFF else [backend])
    what = f"FlashInfer {backend} all-reduce workspace for ranks {fi.ranks}"
    if result is Outcome.RAISE:
        raise RuntimeError(f"{what}: {why}") from raised
    then = "FlashInfer all-reduce is off for these ranks"
    fallback = fi.decision(dtype).allow_trtllm_fallback
    if backend == "mnnvl" and fallback and "trtllm" not in fi.failed:
        then = "falls back to trtllm"
    if fi.rank == fi.speaker:  # rank 0, unless it did not answer
        logger.warning("%s: %s; every rank gave it up and %s.", what, why, then)
    return None
