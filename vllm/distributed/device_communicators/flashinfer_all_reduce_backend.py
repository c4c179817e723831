# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A workspace's FlashInfer all-reduce backend as a pure function of its inputs
(the FlashInfer bugs `auto` steers around are data); the ranks of a group agree
on it once, in one round on vLLM's group, and run each collective step (a
creation, checkpoint_prepare, checkpoint_restore) over the group's store under
one deadline (gloo's waits 30 minutes), then vote. Keys are written once, first
writer wins: all read the same values, a late rank too. No process group is
made: torch numbers them per process, so one more on some ranks hangs."""

import dataclasses
import functools
import importlib
import os
import pickle
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version
from torch.distributed import ProcessGroup

import vllm.envs as envs
from vllm.distributed.parallel_state import _node_count
from vllm.logger import init_logger
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

FI_AR_BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
FI_AR_BACKEND_CHOICES = ("auto", "trtllm", "mnnvl")
# The dtypes FlashInferAllReduce.should_use_fi_ar accepts.
FI_AR_DTYPES = ("float16", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class FiArKnownIssue:
    name: str
    backend: str
    trigger: str
    applies: Callable[[FiArBackendInputs], bool]
    effect: str
    fixed_in: str | None
    """The first FlashInfer release with the fix; None while unreleased."""


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
)


@dataclasses.dataclass(frozen=True)
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
        reason = f"auto, {nodes} nodes on Blackwell: only mnnvl spans nodes"
    else:
        candidates = []
        reason = f"auto, {nodes} nodes: only mnnvl spans nodes, on Blackwell (SM100+)"
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
        ranks = some_ranks(inputs.no_fabric)
        reason += f"; but FlashInfer finds no NVLink fabric on {ranks}: off"
    return FiArBackendDecision(backend, allow_fallback, reason, issue)


def some_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


FI_AR_CREATE_TIMEOUT_S = 300
FI_AR_CREATE_TIMEOUT_ENV = "VLLM_FLASHINFER_ALLREDUCE_CREATE_TIMEOUT_S"
# How much longer the vote waits than the rounds: ranks start apart.
VOTE_GRACE_S = 5
# What a round holds for a rank that left it, written by itself or by another.
FAILED, LATE = ("left", "failed"), ("left", "late")
_DTYPE_KEYS = (None, *FI_AR_DTYPES)


def create_timeout_s() -> int:
    """Read as vllm.envs reads its variables: upstream's envs.py lacks it."""
    value = os.getenv(FI_AR_CREATE_TIMEOUT_ENV, str(FI_AR_CREATE_TIMEOUT_S))
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{FI_AR_CREATE_TIMEOUT_ENV}={value!r}: not a number of seconds")


class Stopped(Exception):
    """This rank left the step: a round held FAILED or LATE for a rank."""


class GroupComm:
    """A group's agreed decision per workspace dtype (None: not yet known), and
    FlashInfer's CommBackend (as 0.7.2.post1 and 0.7.4 call it) inside a step
    only: FlashInfer keeps it for checkpoint_prepare, run as a step too."""

    def __init__(self, group: ProcessGroup):
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank = dist.get_rank(group)
        self.decisions: dict[str | None, FiArBackendDecision] = {}
        self.node_count = 0  # vLLM's, taken once: counting is collective
        self.logged: set[FiArBackendDecision] = set()  # by the group's rank 0
        self.failed: set[str] = set()  # given up by every rank, until destroyed
        self.steps, self.stopped = 0, False
        self.warnings: list[str] = []
        self._store: Any = None
        self._last_vote: Any = None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.ranks)

    def allgather(self, data: Any) -> tuple[Any, ...]:
        return tuple(self._round(data))

    def bcast(self, data: Any, root: int) -> Any:
        return self._round(data)[root]

    def barrier(self) -> None:
        self._round(None)

    def warning(self, msg: str, *args: Any) -> None:
        """Upstream's warning that its creation failed here: into the vote."""
        self.warnings.append(msg % args)

    def _round(self, data: Any) -> list[Any]:
        if self._store is None or self.stopped:
            raise Stopped("outside a step, or after this rank left it")
        self._rounds += 1
        values = self._exchange(f"{self._rounds}/", ("ok", data), self._deadline)
        if left := [i for i, value in enumerate(values) if value[0] == "left"]:
            self.stopped = True
            for i in left:  # a late rank's vote, so that none waits for it
                if values[i] == LATE:
                    self._store.compare_set(f"vote/{i}", "", pickle.dumps(LATE))
            raise Stopped(f"{some_ranks(self.ranks[i] for i in left)} left the step")
        return [data for _, data in values]

    def _exchange(self, prefix: str, mine: Any, deadline: float) -> list[Any]:
        keys = [f"{prefix}{i}" for i in range(len(self.ranks))]
        self._store.compare_set(keys[self.rank], "", pickle.dumps(mine))
        try:
            wait_s = max(deadline - time.monotonic(), 0.001)
            self._store.wait(keys, timedelta(seconds=wait_s))
        except dist.DistStoreError:  # the deadline: the ranks missing are late
            for key in keys:
                self._store.compare_set(key, "", pickle.dumps(LATE))
        return [pickle.loads(value) for value in self._store.multi_get(keys)]

    def run(self, group: ProcessGroup, step: Callable, *args: Any) -> tuple:
        """`step(*args)`, then the vote: this rank's result, the group's
        decision and why (see decide), and this rank's exception."""
        self.steps += 1
        key = f"vllm-fi-ar/{self.steps}/"
        self._store = dist.PrefixStore(key, group.get_group_store())
        bound = create_timeout_s()
        self._rounds, self._deadline = 0, time.monotonic() + bound
        self.warnings, self.stopped, result, raised = [], False, None, None
        try:
            result = step(*args)
        except Exception as e:
            raised = e
        mine: tuple = ("ok", None)
        if self.stopped:
            mine, raised = ("stopped", None), None
        elif raised is not None:
            mine = ("raised", f"{type(raised).__name__}: {raised}")
        elif self.warnings:
            mine = ("failed", " ".join(self.warnings))
        if mine[0] != "ok":  # release the ranks waiting for this one
            left = pickle.dumps(FAILED)
            self._store.compare_set(f"{self._rounds + 1}/{self.rank}", "", left)
        store, deadline = self._store, self._deadline + VOTE_GRACE_S
        votes, self._store = self._exchange("vote/", mine, deadline), None
        if all(vote == ("ok", None) for vote in votes):
            # Every rank voted: none reads this step's rounds again, nor the
            # last step's vote, which a late rank would have read.
            for r in range(1, self._rounds + 1):
                store.delete_key(f"{r}/{self.rank}")
            if self._last_vote is not None:
                self._last_vote.delete_key(f"vote/{self.rank}")
        self._last_vote = store
        return result, *decide(self.ranks, votes, bound), raised


# Held weakly, so that per-group state goes with its group.
_comms = weakref.WeakKeyDictionary[ProcessGroup, GroupComm]()


def group_comm(group: ProcessGroup) -> GroupComm:
    if group not in _comms:
        _comms[group] = GroupComm(group)
    return _comms[group]


def forget_failures() -> None:
    """On destroy_fi_ar_workspace, as upstream resets its failed flags."""
    for comm in _comms.values():
        comm.failed.clear()


def decide(ranks: tuple[int, ...], votes: list[tuple], bound: int) -> tuple[str, str]:
    """A rank that raised makes every rank raise; one that failed gives the
    backend up; one that did not answer, FlashInfer all-reduce (it may be dead)."""
    for kind, action in (("raised", "raise"), ("failed", "backend")):
        errors: dict[str, list[int]] = {}
        for rank, (vote_kind, detail) in zip(ranks, votes, strict=True):
            if vote_kind == kind:
                errors.setdefault(detail, []).append(rank)
        if errors:
            failed = ", ".join(f"{some_ranks(r)} ({e})" for e, r in errors.items())
            return action, f"{kind} on {failed}"
    if late := [rank for rank, vote in zip(ranks, votes, strict=True) if vote == LATE]:
        return "group", f"{some_ranks(late)} did not answer within {bound} s"
    return "keep", ""


def nvlink_fabric() -> bool:
    """FlashInfer's own probe; one that fails counts as no fabric."""
    try:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        return bool(mnnvl.is_mnnvl_fabric_supported(torch.cuda.current_device()))
    except Exception as e:
        logger.warning_once("FlashInfer's NVLink fabric probe failed: %s", e)
        return False


def gather(group: ProcessGroup, mine: Any) -> list[Any]:
    """One object from each rank of `group`, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _decide_every_dtype(inputs: FiArBackendInputs, **changes: Any) -> dict:
    """A known issue may hit one dtype only."""
    return {
        key: decide_fi_ar_backend(dataclasses.replace(inputs, dtype=key, **changes))
        for key in _DTYPE_KEYS
    }


def agreed(group: ProcessGroup, config: "VllmConfig | None" = None) -> GroupComm:
    """The group's agreement, reached on first use under `config` (the vLLM
    config current then), in one round that also carries each rank's NVLink
    fabric probe where mnnvl would span nodes. Ranks can see different inputs
    (the variable set on one node only): disagreeing, they are off."""
    comm = group_comm(group)
    if comm.decisions:
        return comm
    # vLLM sets hisparse_config for a HiSparseConnector, also in a MultiConnector.
    attention = None if config is None else config.attention_config
    capability = current_platform.get_device_capability()
    inputs = FiArBackendInputs(
        setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
        node_count=_node_count(group),
        device_capability=None if capability is None else capability.to_int(),
        hisparse=None if attention is None else attention.hisparse_config is not None,
        kernels=installed_kernels(),
    )
    decisions = _decide_every_dtype(inputs)
    unknown = inputs.hisparse is None
    if unknown and decisions != _decide_every_dtype(inputs, hisparse=False):
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash on these kernels."
        )
    choice = tuple((d.backend, d.allow_trtllm_fallback) for d in decisions.values())
    probe = inputs.node_count > 1 and "mnnvl" in {d.backend for d in decisions.values()}
    views = gather(group, (choice, nvlink_fabric() if probe else True))
    ranks = comm.ranks
    if no_fabric := tuple(r for r, (_, ok) in zip(ranks, views, strict=True) if not ok):
        decisions = _decide_every_dtype(inputs, no_fabric=no_fabric)
    if len({view for view, _ in views}) > 1:
        i = next(i for i in range(len(choice)) if len({v[i] for v, _ in views}) > 1)
        if comm.rank == 0:
            logger.error(
                "FlashInfer all-reduce is off for ranks %s: they chose different "
                "backends%s (%s). Make these the same on every node: %s, the "
                "HiSparse config, the GPU and the FlashInfer packages.",
                ranks,
                f" for {_DTYPE_KEYS[i]} workspaces" if i else "",
                ", ".join(
                    f"rank {rank}: {view[i][0] or 'off'}"
                    + " (may fall back to trtllm)" * view[i][1]
                    for rank, (view, _) in zip(ranks, views, strict=True)
                ),
                FI_AR_BACKEND_ENV,
            )
        off = FiArBackendDecision(None, False, "the ranks disagree")
        decisions = dict.fromkeys(_DTYPE_KEYS, off)
        comm.logged.add(off)
    comm.decisions, comm.node_count = decisions, inputs.node_count
    return comm


def node_count(group: ProcessGroup) -> int:
    return agreed(group).node_count


def decision(group: ProcessGroup, dtype: torch.dtype | None) -> FiArBackendDecision:
    """The group's decision for a workspace of `dtype` (None: not yet known)."""
    decisions = agreed(group).decisions
    return decisions.get(str(dtype).removeprefix("torch."), decisions[None])


def resolve_fi_ar_backend(
    group: ProcessGroup, dtype: torch.dtype | None, config: "VllmConfig | None"
) -> tuple[str | None, bool]:
    """The `(backend, allow_trtllm_fallback)` every rank of `group` uses for a
    workspace of `dtype`. The group's own rank 0 logs it, whatever its local
    rank (vLLM's *_once lines print on each node's local rank 0): the first
    dtype's line, then one for each dtype that a known issue moves."""
    comm = agreed(group, config)
    d = decision(group, dtype)
    if d not in comm.logged and comm.rank == 0:
        comm.logged.add(d)
        warn = d.known_issue is not None and d.known_issue.backend == d.backend
        (logger.warning if warn else logger.info)(
            "FlashInfer all-reduce backend for ranks %s: %s%s (%s)%s",
            comm.ranks,
            f"{str(dtype).removeprefix('torch.')}: " * (d != comm.decisions[None]),
            d.backend or "off",
            d.reason,
            f". Unset {FI_AR_BACKEND_ENV} to let vLLM pick a safe backend." * warn,
        )
    return d.backend, d.allow_trtllm_fallback


def on_every_rank(group: ProcessGroup, step: Callable, *args: Any) -> Any:
    """A workspace's checkpoint_prepare or checkpoint_restore: every rank
    returns, or raises (its own exception where it raised one, such as
    upstream's NotImplementedError)."""
    comm = group_comm(group)
    result, action, why, raised = comm.run(group, step, *args)
    if action != "keep":
        what = f"FlashInfer all-reduce {step.__name__} for ranks {comm.ranks}"
        raise RuntimeError(f"{what}: {why}") if raised is None else raised
    return result


def _load_kernels() -> str | None:
    """trtllm's creation loads its kernels (a JIT build on a cold cache) between
    two of its collectives: loaded before the deadline starts. mnnvl's loads
    none (0.7.4 calls get_trtllm_mnnvl_comm_module at all-reduce)."""
    try:
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def created_on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create` (upstream's _create_workspace, given its GroupComm as
    `creation`) end the same way on every rank within FI_AR_CREATE_TIMEOUT_S
    (or its setting) plus VOTE_GRACE_S once trtllm's kernels load: all keep the
    workspace, give it up (out of `registry`, not tried again) or raise."""
    return lambda create: functools.partial(_create_on_every_rank, registry, create)


def _create_on_every_rank(
    registry: dict[int, Any], create: Callable, backend: str, *args: Any
) -> Any:
    dtype, group = args[-2:]
    comm = group_comm(group)
    if backend in comm.failed:
        return None
    workspace = raised = None
    loads = gather(group, _load_kernels()) if backend == "trtllm" else []
    if any(loads):
        votes = [("failed", e) if e else ("ok", None) for e in loads]
        action, why = decide(comm.ranks, votes, 0)
        why = why.replace("failed on", "could not load kernels on", 1)
    else:
        workspace, action, why, raised = comm.run(group, create, backend, *args, comm)
    if action == "keep":
        return workspace
    if workspace is not None:
        del registry[id(workspace)]
        workspace.destroy()
    comm.failed.update(("mnnvl", "trtllm") if action == "group" else [backend])
    what = f"FlashInfer {backend} all-reduce workspace for ranks {comm.ranks}"
    if action == "raise":
        raise RuntimeError(f"{what}: {why}") from raised
    then = "FlashInfer all-reduce is off for these ranks"
    fallback = decision(group, dtype).allow_trtllm_fallback
    if backend == "mnnvl" and fallback and "trtllm" not in comm.failed:
        then = "falls back to trtllm"
    if comm.rank == 0:
        logger.warning("%s: %s; every rank gave it up and %s.", what, why, then)
    return None
