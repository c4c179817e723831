# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer all-reduce: the backend a workspace gets, with the FlashInfer bugs
`auto` steers around as data; the ranks of a group agree on it in one gather on
vLLM's group; and each collective step (a creation, checkpoint_prepare or
checkpoint_restore) runs over the group's store, bounded as vLLM bounds its CPU
groups, and ends in ballots that every rank maps to the same outcome."""

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
    known_issue: FiArKnownIssue | None = None  # that moved auto, or that is hit


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
    issue = next((unfixed[b] for b in candidates if b in unfixed), None)
    if issue is not None:
        fix = f"fixed in {issue.fixed_in}, not in {package}" if issue.fixed_in else ""
        reason += f"; {issue.trigger}: {issue.backend} {issue.effect} ({issue.name}"
        reason += f"; {fix})" if fix else ")"
    if backend == "mnnvl" and nodes > 1 and inputs.no_fabric:  # vllm#51986
        backend = None
        reason += (
            f"; FlashInfer finds no NVLink fabric on {some_ranks(inputs.no_fabric)}"
        )
    fallback = backend == "mnnvl" and "trtllm" in safe
    return FiArBackendDecision(backend, fallback, reason, issue)


def some_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


class Vote(enum.Enum):
    """How a rank ended a step. ABSENT is written for it by a peer."""

    DONE = "completed"
    FAILED = "failed"
    RAISED = "raised"
    LEFT = "stopped exchanging"
    ABSENT = "did not answer within the bound"


class Outcome(enum.Enum):
    KEEP = "kept"
    GIVE_UP = "gave the backend up"
    OFF = "turned FlashInfer all-reduce off"
    RAISE = "raised"


@dataclasses.dataclass(frozen=True)
class Ballot:
    vote: Vote
    step: str = ""  # what the rank ran: kind, backend, dtype, size
    detail: str = ""
    rounds: int = 0  # exchanges written, for the last rank out to delete
    by: int = -1  # who wrote an ABSENT ballot: only the writer counts it out


def outcome(ranks: Iterable[int], ballots: list[Ballot]) -> tuple[Outcome, str]:
    """The one map from a step's ballots to its outcome: KEEP only where every
    rank completed the same step."""
    by_rank = list(zip(ranks, ballots, strict=True))
    if len({b.step for _, b in by_rank if b.vote is not Vote.ABSENT}) > 1:
        ran = ", ".join(f"rank {r}: {b.step or '?'}" for r, b in by_rank)
        return Outcome.OFF, f"the ranks ran different steps ({ran})"
    rules = [(Vote.ABSENT, Outcome.OFF), (Vote.RAISED, Outcome.RAISE)]
    rules += [(Vote.FAILED, Outcome.GIVE_UP), (Vote.LEFT, Outcome.OFF)]
    for vote, result in rules:
        by_detail: dict[str, list[int]] = {}
        for r, b in by_rank:
            if b.vote is vote:
                by_detail.setdefault(b.detail, []).append(r)
        if by_detail:
            return result, "; ".join(
                f"{some_ranks(r)} {vote.value}" + f": {detail}" * bool(detail)
                for detail, r in by_detail.items()
            )
    return Outcome.KEEP, ""


class Left(Exception):
    """This rank stopped exchanging: a peer ended the step, or the bound passed."""


SLOT = "step"  # the nonce of the step being joined; freed once all joined
END = "end"  # written in place of a rank's next exchange when it ends its part
GONE = "gone"  # what compare_set(key, GONE, GONE) reads for a key not there
POLL_S = 0.1  # the longest pause between two looks at the store
GRACE_S = 0.5  # past the bound, for the ballots of ranks that left at it


class Step:
    """One collective step over `store`. Each key is written once, first
    writer wins, under the step's own nonce; the last rank out (a peer that
    wrote ABSENT for a rank counts it out) deletes them all, and a rank back
    after that deletes what it wrote."""

    def __init__(self, store, ranks, rank, what: str, bound_s: float, last=""):
        self.store, self.ranks, self.size, self.rank = store, ranks, len(ranks), rank
        self.what, self.bound_s, self.nonce = what, bound_s, last
        self.start = time.time()
        self.deadline = self.start + bound_s  # to join; then for the step
        self.early = self.deadline + GRACE_S  # before it, no peer can delete it
        self.rounds, self.failures, self.left = 0, list[str](), ""
        self.wrote: set[str] = set()
        self.speaker = -1  # the first rank that answered: it logs the outcome

    def _keys(self, name: str) -> list[str]:
        return [f"{self.nonce}/{name}/{i}" for i in range(self.size)]

    def _gone(self) -> Left:
        """Back after the last rank out deleted the step: what this rank wrote
        since (a count it made anew, its END, its ballot) goes too."""
        self._free_slot()
        for key in self.wrote:
            self.store.delete_key(key)
        self.left = "this rank came back after its step ended"
        return Left(self.left)

    def _get(self, keys: list[str]) -> list[Any]:
        """Their values, read without blocking (get and multi_get wait for a key
        the last rank out may have deleted while this one was held up)."""
        values = [self.store.compare_set(key, GONE, GONE) for key in keys]
        if GONE.encode() in values:
            raise self._gone()
        return [pickle.loads(value) for value in values]

    def _put(self, key: str, value: Any) -> Any:
        """What stands at `key` once this rank offered `value`. The rank's own
        join key, the first that the last rank out deletes, says whether the
        step is still there, where a peer may have deleted it."""
        got = pickle.loads(self.store.compare_set(key, "", pickle.dumps(value)))
        if got == value:
            self.wrote.add(key)
            mine = self._keys("j")[self.rank]
            if time.time() > self.early and not self.store.check([mine]):
                raise self._gone()
        return got

    def _wait(self, keys: list[str], until: float) -> bool:
        """Whether all `keys` are set by `until`. Polled: a store wait holds the
        store from its other users, and TCPStore logs each one that times out."""
        pause_s = 0.001
        while not self.store.check(keys):
            if time.time() >= until:
                return False
            time.sleep(min(pause_s, max(until - time.time(), 0)))
            pause_s = min(2 * pause_s, POLL_S)
        return True

    def exchange(self, data: Any) -> list[Any]:
        """An allgather, for FlashInfer's comm backend; none once this rank left,
        whatever FlashInfer made of the Left it raised."""
        if not self.left:
            self.rounds += 1
            keys = self._keys(f"r{self.rounds}")
            self._put(keys[self.rank], data)
            if not self._wait(keys, self.deadline):
                self.left = f"exchange {self.rounds} reached the bound"
            elif END in (values := self._get(keys)):
                self.left = f"a peer had ended before exchange {self.rounds}"
            else:
                return values
        raise Left(self.left)

    def run(self, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        """`body()`, then the ballots: the outcome, why, this rank's result and
        the exception it raised."""
        result = raised = None
        try:
            joined = self._join()
        except Left as e:
            return Outcome.OFF, str(e), None, None
        mine = Ballot(Vote.DONE if joined else Vote.LEFT, self.what)
        try:
            result = body() if joined else None
        except Exception as e:
            raised = e
            mine = Ballot(Vote.RAISED, self.what, f"{type(e).__name__}: {e}")
        if self.left:
            mine, raised = Ballot(Vote.LEFT, self.what, self.left), None
        elif self.failures and not raised:
            mine = Ballot(Vote.FAILED, self.what, " ".join(self.failures))
        return (
            *self._vote(dataclasses.replace(mine, rounds=self.rounds)),
            result,
            raised,
        )

    def _join(self) -> bool:
        """Whether every rank joined this same step within the bound; from when
        the last one did, the step has the bound again."""
        last, fresh = self.nonce, uuid.uuid4().hex
        # A step this rank left before all joined it holds the slot until its
        # last rank out frees it: this rank never joins it again.
        while (nonce := self.store.compare_set(SLOT, "", fresh).decode()) == last:
            if time.time() > self.deadline:
                raise self._gone()
            time.sleep(POLL_S)
        self.nonce = nonce
        joins = self._keys("j")
        self._put(joins[self.rank], (self.what, self.start))
        self.wrote.add(f"{self.nonce}/n")
        if self.store.add(f"{self.nonce}/n", 1) == self.size:
            self._free_slot()
        if not self._wait(joins, self.deadline):
            return False
        seen = self._get(joins)
        self.deadline = max(t for _, t in seen) + self.bound_s
        self.early = min(t for _, t in seen) + self.bound_s + GRACE_S
        return all(what == self.what for what, _ in seen)

    def _free_slot(self) -> None:
        """Unless a later step holds it: read, then deleted while it holds this
        step's nonce, which no rank can change (a claim needs it free)."""
        if self.store.compare_set(SLOT, GONE, GONE) == self.nonce.encode():
            self.store.delete_key(SLOT)

    def _vote(self, mine: Ballot) -> tuple[Outcome, str]:
        ballots = self._keys("v")
        try:
            self._put(self._keys(f"r{self.rounds + 1}")[self.rank], END)
            ours = [self.rank] if self._put(ballots[self.rank], mine) == mine else []
            self._wait(ballots, self.deadline + GRACE_S)
            for i, key in enumerate(ballots):
                absent = Ballot(Vote.ABSENT, by=self.rank)
                if not self.store.check([key]) and self._put(key, absent) == absent:
                    ours.append(i)
            votes = self._get(ballots)
            answered = (i for i, b in enumerate(votes) if b.vote is not Vote.ABSENT)
            self.speaker = next(answered, -1)
        except Left as e:  # counted out by a peer, so its outcome was OFF
            return Outcome.OFF, str(e)
        if ours and self.store.add(f"{self.nonce}/left", len(ours)) == self.size:
            self._free_slot()
            # A rank that joined after the rest gave up may have written one
            # exchange more than any ballot says, then its END.
            last = max(b.rounds for b in votes) + 2
            keys = self._keys("j") + [f"{self.nonce}/n", f"{self.nonce}/left"]
            for name in ["v", *(f"r{r}" for r in range(1, last + 1))]:
                keys += self._keys(name)
            for key in keys:  # the join keys first: they say the step is there
                self.store.delete_key(key)
        return outcome(self.ranks, votes)


class FiArGroup:
    """A group's agreed decision per workspace dtype, its bound, the backends
    given up until destroy, and FlashInfer's comm backend, which FlashInfer
    keeps for its checkpoints: exchanges run inside this group's step only."""

    def __init__(self, group: ProcessGroup, decisions: dict, nodes: int, bound_s):
        # Not the group: _groups holds this weakly keyed by it.
        self.store = dist.PrefixStore("vllm-fi-ar", group.get_group_store())
        self.decisions, self.node_count = decisions, nodes
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.rank, self.bound_s = dist.get_rank(group), bound_s
        self.logged: set[FiArBackendDecision] = set()  # by the group's rank 0
        self.failed: set[str] = set()
        self.step: Step | None = None
        self.last = ""  # the last step's nonce
        self.speaker = -1  # the last step's first rank that answered

    def run(self, what: str, body: Callable[[], Any]) -> tuple[Outcome, str, Any, Any]:
        self.step = Step(
            self.store, self.ranks, self.rank, what, self.bound_s, self.last
        )
        try:
            return self.step.run(body)
        finally:
            self.last, self.speaker = self.step.nonce, self.step.speaker
            self.step = None

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
    config current then): every rank decides on the facts of every rank, its
    NVLink fabric across nodes and, as custom_all_reduce.py does, whether the
    GPUs of a group of more than two on one node are all NVLink-connected.
    Ranks whose decisions still differ (a variable set on one node) are off."""
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

    def every_dtype(**facts: Any) -> dict:  # a known issue may hit one dtype only
        return {
            dtype: decide_fi_ar_backend(
                dataclasses.replace(inputs, dtype=dtype, **facts)
            )
            for dtype in (None, *FI_AR_DTYPES)
        }

    decisions = every_dtype()
    if inputs.hisparse is None and decisions != every_dtype(hisparse=False):
        logger.warning_once(
            "No vLLM config is current: FlashInfer all-reduce takes HiSparse as "
            "on, the choice that cannot crash on these kernels."
        )
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    views: list[Any] = [None] * inputs.world_size
    nvlink = inputs.node_count == 1 and inputs.world_size > 2
    if nvlink:
        physical = current_platform.visible_device_id_to_physical_device_id
        dist.all_gather_object(views, _probe("device", physical, device), group)
    ids = list(views)
    mnnvl = "mnnvl" in {d.backend for d in decisions.values()}
    fabric = inputs.node_count > 1 and mnnvl
    dist.all_gather_object(
        views,
        (
            tuple((d.backend, d.allow_trtllm_fallback) for d in decisions.values()),
            not fabric or _probe("NVLink fabric", _fabric, device),
            not nvlink or _probe("NVLink", current_platform.is_fully_connected, ids),
        ),
        group,
    )
    ranks = dist.get_process_group_ranks(group)
    no_fabric = tuple(r for r, v in zip(ranks, views, strict=True) if not v[1])
    connected = all(v[2] for v in views)
    if no_fabric or not connected:
        decisions = every_dtype(no_fabric=no_fabric, nvlink_connected=connected)
    off = None
    if differ := [r for r, v in zip(ranks, views, strict=True) if v[0] != views[0][0]]:
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
        decisions = dict.fromkeys(decisions, off)
    timeout = config and config.parallel_config.effective_cpu_distributed_timeout
    bound_s = (timeout or dist.default_pg_timeout).total_seconds()
    fi = _groups[group] = FiArGroup(group, decisions, inputs.node_count, bound_s)
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
