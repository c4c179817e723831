# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce: the backend a workspace gets, and its collective steps.

The backend is a pure function of its inputs, the FlashInfer bugs `auto` steers
around being data. The ranks of a group agree on it once, in one gather on
vLLM's group. Each collective step (a creation, checkpoint_prepare or
checkpoint_restore) runs over the group's store, bounded as vLLM bounds its CPU
groups, and ends in a vote that every rank maps to the same outcome. No process
group is made: torch numbers them per process.
"""

import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
import pickle
import time
import uuid
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


class Vote(enum.Enum):
    """How a rank ended a step. ABSENT is written for it by a peer."""

    DONE = "completed it"
    FAILED = "failed"
    RAISED = "raised"
    LEFT = "stopped exchanging"
    ABSENT = "did not answer"


class Outcome(enum.Enum):
    KEEP = "kept"
    GIVE_UP = "gave the backend up"
    OFF = "turned FlashInfer all-reduce off"
    RAISE = "raised"


@dataclasses.dataclass(frozen=True)
class Ballot:
    vote: Vote
    step: str = ""
    """What the rank ran: the kind of step, backend, dtype and size."""
    detail: str = ""
    rounds: int = 0
    """The exchanges it wrote, so that the last rank out deletes them all."""


def outcome(ranks: Iterable[int], ballots: list[Ballot]) -> tuple[Outcome, str]:
    """The one map from a step's ballots to its outcome: KEEP only where every
    rank completed the same step."""
    by_rank = list(zip(ranks, ballots, strict=True))
    if absent := [r for r, b in by_rank if b.vote is Vote.ABSENT]:
        return Outcome.OFF, f"{some_ranks(absent)} did not answer within the bound"
    if len({b.step for _, b in by_rank}) > 1:
        ran = ", ".join(f"rank {r} {b.step}" for r, b in by_rank)
        return Outcome.OFF, f"the ranks ran different steps ({ran})"
    for vote, result in ((Vote.RAISED, Outcome.RAISE), (Vote.FAILED, Outcome.GIVE_UP)):
        if hit := [f"rank {r}: {b.detail}" for r, b in by_rank if b.vote is vote]:
            return result, f"{vote.value} on " + "; ".join(hit)
    if left := [r for r, b in by_rank if b.vote is Vote.LEFT]:
        return Outcome.OFF, f"{some_ranks(left)} stopped exchanging before the rest"
    return Outcome.KEEP, ""


class Left(Exception):
    """This rank stopped exchanging: a peer ended the step, or the bound passed."""


SLOT = "step"  # the nonce of the step being joined, freed once all have joined
END = "end"  # written in place of a rank's next exchange when it ends the step
SLICE_S = 1.0  # the longest that one wait holds the store from its other users
GRACE_S = 0.5  # after the bound, for the ballots of ranks that left at it


class Step:
    """One collective step of `size` ranks over `store`: join, exchanges, ballot.
    Each key is written once, first writer wins, under the step's own nonce;
    the last rank out deletes them, so a rank that comes back after the bound
    writes only where no one reads."""

    def __init__(
        self,
        store: Any,
        ranks: tuple[int, ...],
        rank: int,
        what: str,
        bound_s: float,
        last: str = "",
    ):
        self.store, self.ranks, self.size, self.rank = store, ranks, len(ranks), rank
        self.what, self.bound_s, self.nonce = what, bound_s, last
        self.deadline = time.time() + bound_s  # for joining; then for the step
        self.rounds, self.failures, self.left = 0, list[str](), ""

    def _keys(self, name: str) -> list[str]:
        return [f"{self.nonce}/{name}/{i}" for i in range(self.size)]

    def _put(self, key: str, value: Any) -> Any:
        """What stands at `key` once this rank offered `value` there."""
        got = pickle.loads(self.store.compare_set(key, "", pickle.dumps(value)))
        late = time.time() > self.deadline + GRACE_S
        if late and got == value and not self.store.check([f"{self.nonce}/n"]):
            self.store.delete_key(key)  # the step is gone: no one reads this
            raise Left("this rank came back after the step ended")
        return got

    def _wait(self, keys: list[str], until: float) -> bool:
        """Whether all `keys` are set by `until`, waiting a slice at a time."""
        while not self.store.check(keys):
            left_s = until - time.time()
            if left_s <= 0.001:  # torch reads a wait of 0 ms as its default
                return False
            with contextlib.suppress(RuntimeError):  # a timeout, on every torch store
                self.store.wait(keys, timedelta(seconds=min(left_s, SLICE_S)))
        return True

    def _get(self, keys: list[str]) -> list[Any]:
        return [pickle.loads(value) for value in self.store.multi_get(keys)]

    def exchange(self, data: Any) -> list[Any]:
        """One allgather, for FlashInfer's comm backend. Once this rank has
        left, FlashInfer's own exception handling cannot make it exchange."""
        if not self.left:
            self.rounds += 1
            keys = self._keys(f"r{self.rounds}")
            self._put(keys[self.rank], data)
            if not self._wait(keys, self.deadline):
                self.left = f"exchange {self.rounds} reached the bound"
            elif END in (values := self._get(keys)):
                self.left = f"a peer ended the step before exchange {self.rounds}"
            else:
                return values
        raise Left(self.left)

    def run(self, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        """`body()` on every rank, then the vote: the outcome, why, this rank's
        result and the exception it raised."""
        result = raised = None
        try:
            joined = self._join()
        except Left as e:  # it came back after the bound, to a step gone
            return Outcome.OFF, str(e), None, None
        mine = Ballot(Vote.DONE if joined else Vote.LEFT, self.what)
        try:
            result = body() if joined else None
        except Exception as e:
            raised = e
            mine = Ballot(Vote.RAISED, self.what, f"{type(e).__name__}: {e}")
        if self.left:  # whatever FlashInfer made of the Left it raised
            mine, raised = Ballot(Vote.LEFT, self.what, self.left), None
        elif self.failures and not raised:
            mine = Ballot(Vote.FAILED, self.what, " ".join(self.failures))
        mine = dataclasses.replace(mine, rounds=self.rounds)
        return (*self._vote(mine), result, raised)

    def _join(self) -> bool:
        """Whether every rank joined this same step within the bound."""
        last, fresh = self.nonce, uuid.uuid4().hex
        self.nonce = self.store.compare_set(SLOT, "", fresh).decode()
        if self.nonce == last:  # a step this rank left, not all joined: never again
            self.store.delete_key(SLOT)
            self.nonce = self.store.compare_set(SLOT, "", fresh).decode()
        joins = self._keys("j")
        self._put(joins[self.rank], (self.what, time.time()))
        if self.store.add(f"{self.nonce}/n", 1) == self.size:
            self.store.delete_key(SLOT)
        if not self._wait(joins, self.deadline):
            return False
        seen = self._get(joins)
        self.deadline = max(t for _, t in seen) + self.bound_s
        return all(what == self.what for what, _ in seen)

    def _vote(self, mine: Ballot) -> tuple[Outcome, str]:
        ballots = self._keys("v")
        try:
            self._put(self._keys(f"r{self.rounds + 1}")[self.rank], END)
            ours = [self.rank] if self._put(ballots[self.rank], mine) == mine else []
        except Left:
            return Outcome.OFF, "this rank did not answer within the bound"
        self._wait(ballots, self.deadline + GRACE_S)
        for i, key in enumerate(ballots):
            absent = Ballot(Vote.ABSENT)
            if not self.store.check([key]) and self._put(key, absent) == absent:
                ours.append(i)
        votes = self._get(ballots)
        if ours and self.store.add(f"{self.nonce}/left", len(ours)) == self.size:
            self._delete(max(b.rounds for b in votes) + 1)
        return outcome(self.ranks, votes)

    def _delete(self, rounds: int) -> None:
        if self.store.compare_set(SLOT, self.nonce, self.nonce) == self.nonce.encode():
            self.store.delete_key(SLOT)
        for name in ("n", "left"):
            self.store.delete_key(f"{self.nonce}/{name}")
        for name in ("j", "v", *(f"r{r}" for r in range(1, rounds + 1))):
            for key in self._keys(name):
                self.store.delete_key(key)


class FiArGroup:
    """A group's agreed decision per workspace dtype, the backends its ranks gave
    up until destroy, and FlashInfer's comm backend: FlashInfer keeps it for
    its checkpoints, which run as steps too."""

    def __init__(self, group: ProcessGroup, decisions: dict, nodes: int, bound: float):
        self.group, self.decisions, self.node_count = group, decisions, nodes
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank, self.bound_s = dist.get_rank(group), bound
        self.logged: set[FiArBackendDecision] = set()  # by the group's rank 0
        self.failed: set[str] = set()
        self.step: Step | None = None
        self.last_nonce = ""

    def run(self, what: str, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        store = dist.PrefixStore("vllm-fi-ar", self.group.get_group_store())
        self.step = Step(
            store, self.ranks, self.rank, what, self.bound_s, self.last_nonce
        )
        try:
            return self.step.run(body)
        finally:
            self.last_nonce, self.step = self.step.nonce, None

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
        """Upstream's warning that its creation failed here: into the ballot."""
        assert self.step is not None
        self.step.failures.append(msg % args)


_groups = weakref.WeakKeyDictionary[ProcessGroup, FiArGroup]()
_DTYPE_KEYS = (None, *FI_AR_DTYPES)


def nvlink_fabric() -> bool:
    """FlashInfer's own probe; one that fails counts as no fabric."""
    try:
        mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
        return bool(mnnvl.is_mnnvl_fabric_supported(torch.cuda.current_device()))
    except Exception as e:
        logger.warning_once("FlashInfer's NVLink fabric probe failed: %s", e)
        return False


def _decide_every_dtype(inputs: FiArBackendInputs, **changes: Any) -> dict:
    """A known issue may hit one dtype only."""
    return {
        key: decide_fi_ar_backend(dataclasses.replace(inputs, dtype=key, **changes))
        for key in _DTYPE_KEYS
    }


def agreed(group: ProcessGroup, config: "VllmConfig | None" = None) -> FiArGroup:
    """The group's agreement, reached on first use under `config` (the vLLM
    config current then) in one gather that also carries each rank's NVLink
    fabric probe where mnnvl would span nodes. Ranks that see different inputs
    (a variable set on one node only) are off."""
    if group in _groups:
        return _groups[group]
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
    if inputs.hisparse is None and decisions != _decide_every_dtype(
        inputs, hisparse=False
    ):
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash on these kernels."
        )
    choice = tuple((d.backend, d.allow_trtllm_fallback) for d in decisions.values())
    probe = inputs.node_count > 1 and "mnnvl" in {d.backend for d in decisions.values()}
    views: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (choice, nvlink_fabric() if probe else True), group)
    ranks = dist.get_process_group_ranks(group)
    if no_fabric := tuple(r for r, (_, ok) in zip(ranks, views, strict=True) if not ok):
        decisions = _decide_every_dtype(inputs, no_fabric=no_fabric)
    if len({view for view, _ in views}) > 1:
        if dist.get_rank(group) == 0:
            logger.error(
                "FlashInfer all-reduce is off for ranks %s: they chose different "
                "backends (%s). Make these the same on every node: %s, the "
                "HiSparse config, the GPU and the FlashInfer packages.",
                ranks,
                ", ".join(
                    f"rank {r}: {v[0][0] or 'off'}"
                    for r, v in zip(ranks, views, strict=True)
                ),
                FI_AR_BACKEND_ENV,
            )
        decisions = dict.fromkeys(
            _DTYPE_KEYS, FiArBackendDecision(None, False, "the ranks disagree")
        )
    parallel = None if config is None else config.parallel_config
    timeout = parallel and parallel.effective_cpu_distributed_timeout
    bound_s = (timeout or dist.default_pg_timeout).total_seconds()
    _groups[group] = FiArGroup(group, decisions, inputs.node_count, bound_s)
    return _groups[group]


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
    fi = agreed(group, config)
    d = decision(group, dtype)
    if d not in fi.logged and fi.rank == 0:
        fi.logged.add(d)
        warn = d.known_issue is not None and d.known_issue.backend == d.backend
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
    returns, or raises (its own exception where it raised one, such as
    upstream's NotImplementedError)."""
    fi = agreed(group)
    result_, why, result, raised = fi.run(step.__name__, lambda: step(*args))
    if result_ is not Outcome.KEEP:
        what = f"FlashInfer all-reduce {step.__name__} for ranks {fi.ranks}"
        raise RuntimeError(f"{what}: {why}") if raised is None else raised
    return result


def _load_kernels() -> str:
    """trtllm's creation loads its kernels (a JIT build on a cold cache) between
    two of its exchanges: loaded before the bound starts. mnnvl's loads none
    (0.7.4 calls get_trtllm_mnnvl_comm_module at all-reduce)."""
    try:
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()
    except Exception as e:
        return f"could not load its kernels: {type(e).__name__}: {e}"
    return ""


def created_on_every_rank(registry: dict[int, Any]) -> Callable[[Callable], Callable]:
    """Makes `create` (upstream's _create_workspace, given the group's
    FiArGroup as `creation`) end the same way on every rank: all keep the
    workspace, give the backend up (not tried again until destroy), turn
    FlashInfer all-reduce off, or raise."""

    def wrap(create: Callable) -> Callable:
        signature = inspect.signature(create)

        @functools.wraps(create)
        def create_on_every_rank(*args: Any, **kwargs: Any) -> Any:
            call = signature.bind(*args, **kwargs).arguments
            backend, dtype, group = call["backend"], call["dtype"], call["group"]
            fi = agreed(group)
            if backend in fi.failed:
                return None
            error = _load_kernels() if backend == "trtllm" else ""

            def body() -> Any:
                if error:
                    return fi.warning(error)
                return create(*args, **kwargs, creation=fi)

            what = f"create {backend} {dtype} x {call['max_token_num']} tokens"
            result, why, workspace, raised = fi.run(what, body)
            if result is Outcome.KEEP:
                return workspace
            if workspace is not None:
                del registry[id(workspace)]
                workspace.destroy()
            off = result is Outcome.OFF
            fi.failed.update(["mnnvl", "trtllm"] if off else [backend])
            what = f"FlashInfer {backend} all-reduce workspace for ranks {fi.ranks}"
            if result is Outcome.RAISE:
                raise RuntimeError(f"{what}: {why}") from raised
            then = "FlashInfer all-reduce is off for these ranks"
            fallback = decision(group, dtype).allow_trtllm_fallback
            if backend == "mnnvl" and fallback and "trtllm" not in fi.failed:
                then = "falls back to trtllm"
            if fi.rank == 0:
                logger.warning("%s: %s; every rank gave it up and %s.", what, why, then)
            return None

        return create_on_every_rank

    return wrap
