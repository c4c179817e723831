# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank of check_fused_all_reduce.py.

Started by the launcher as `python fused_all_reduce_rank.py SPEC RANK FD`,
one process per rank, as `vllm serve -tp N` starts its workers. The rank
sets up vLLM's distributed state and a current VllmConfig (HiSparse on unless
told otherwise), runs vLLM's `fused_allreduce_rms_norm` over a sweep of token
counts, and checks every output against an fp32 reference. It tells the
launcher what happens as JSON lines on the pipe FD, and keeps a progress
record in a shared file the launcher watches for stalls.

With device "cpu" a reference implementation stands in for FlashInfer's
workspace constructor and kernel (gloo all-reduce plus an fp32 RMSNorm,
fused_all_reduce_reference.py), and there are no CUDA graphs or
host-traffic streams; everything else is the same code. What only GPUs run
is in fused_all_reduce_gpu.py.
"""

import contextlib
import ctypes
import importlib
import json
import logging
import mmap
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from fused_all_reduce_reference import (
    cpu_max_token_num,
    fused_reference,
    install_cpu_kernel,
    platform_reads_as_cuda,
)

FI_AR_MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
OP_MODULE = "vllm.models.common.ops.fused_allreduce_rms_norm"
GPU_MODULE = "fused_all_reduce_gpu"

# A rank's record in the progress file: how far it got (bumped before and
# after each call of the op), its phase, its checked iterations and
# mismatches.
PROGRESS = struct.Struct("<qqqq")
PHASE_START, PHASE_WARMUP, PHASE_REPLAY, PHASE_DONE = range(4)
PHASES = ("start-up", "warm-up", "replay", "done")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Each output against the fp32 reference: |got - want| <= atol + rtol * |want|.
# Four units in the last place of the dtype: the kernel rounds the reduced
# sum to the dtype before the residual add, and both outputs once more.
TOLERANCES = {"bf16": (2**-6, 2**-6), "fp16": (2**-9, 2**-9)}
RMS_EPS = 1e-6
# Tokens with values past fp16's old one-shot RMSNorm limit (|x| > 255.94).
LARGE_VALUE = 300.0
# Token counts either side of PDL_ADVANCE_LAUNCH_TOKENS (16) in vLLM's op.
PDL_EDGE = (15, 16, 17)
PR_SET_PDEATHSIG = 1
# Mismatches sent in full per rank; the rest are only counted.
MISMATCH_REPORTS = 20
INJECTED_LAUNCH_FAILURE = (
    "CUDA error: unspecified launch failure (injected by check_fused_all_reduce)"
)


class FallbackRan(RuntimeError):
    """The op ran NCCL plus a separate RMSNorm where FlashInfer's fused
    kernel was meant to run."""


class Reporter:
    """The rank's line to the launcher: events on a pipe, progress in a file."""

    def __init__(self, fd: int, progress_path: str, rank: int):
        self.rank = rank
        self._pipe = os.fdopen(fd, "w", buffering=1)
        self._file = open(progress_path, "r+b")  # noqa: SIM115
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._offset = rank * PROGRESS.size
        self.step = self.iterations = self.mismatches = 0
        self.phase = PHASE_START

    def send(self, event: str, **fields: Any) -> None:
        self._pipe.write(
            json.dumps({"event": event, "rank": self.rank, **fields}) + "\n"
        )

    def advance(self, phase: int | None = None) -> None:
        """Mark progress; a rank that stops calling this has stalled."""
        if phase is not None:
            self.phase = phase
        self.step += 1
        PROGRESS.pack_into(
            self._map,
            self._offset,
            self.step,
            self.phase,
            self.iterations,
            self.mismatches,
        )


class FlashInferLines(logging.Handler):
    """vLLM's log lines about FlashInfer: the start-up line and its kin."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "flashinfer" in message.lower():
            self.lines.append(f"{record.levelname} {message}")


def build_config(device: Literal["cuda", "cpu"], hisparse: bool) -> Any:
    """A VllmConfig with HiSparse turned on as users turn it on: a
    HiSparseConnector, from which vLLM infers `hisparse_config`."""
    from vllm.config import (
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )

    kwargs: dict[str, Any] = {}
    if hisparse:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiSparseConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": 4},
        )
    with platform_reads_as_cuda(device == "cpu" and hisparse):
        return VllmConfig(
            device_config=DeviceConfig(device=device),
            # HiSparse needs the hybrid KV cache manager, which GPUs enable.
            scheduler_config=SchedulerConfig.default_factory(
                disable_hybrid_kv_cache_manager=False
            ),
            **kwargs,
        )


def counted_kernel_release(group: Any) -> dict[str, str | None]:
    """The FlashInfer release whose all-reduce kernels run, as this build
    counts it (jit-cache shim, providers and flashinfer/data/aot included),
    and the package they are counted from.

    The inputs are gathered as the build's own decision gathers them
    (`_decide_for_group` in flashinfer_all_reduce_group.py), so the check
    names the release the start-up line's decision was made for.
    """
    import vllm.envs as envs
    from vllm.distributed.device_communicators import (
        flashinfer_all_reduce_group as fi_group,
    )
    from vllm.distributed.device_communicators.flashinfer_all_reduce_installed import (
        installed_kernel_inputs,
    )
    from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
        FiArBackendInputs,
        kernel_release,
    )

    release, package = kernel_release(
        FiArBackendInputs(
            setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
            node_count=fi_group.group_node_count(group),
            device_capability=fi_group.device_capability(),
            hisparse=fi_group.hisparse_enabled(),
            **installed_kernel_inputs(),
        )
    )
    return {"release": release, "package": package}


class KernelCalls:
    """Counts the op's calls of FlashInfer's fused kernel.

    The op falls back to NCCL plus a separate RMSNorm without a word; the
    kernel it calls is wrapped in the op's own module, so a call of the op
    that did not reach it is known.
    """

    def __init__(self, op_module: Any):
        self.count = 0
        kernel = op_module.flashinfer_trtllm_fused_allreduce_norm
        self.available = kernel is not None
        if kernel is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return kernel(*args, **kwargs)

        op_module.flashinfer_trtllm_fused_allreduce_norm = counted


def refuse_every_call(hidden_states: torch.Tensor, tp_size: int) -> tuple[bool, int]:
    """The op's FlashInfer gate, refusing: the op falls back."""
    return False, 0


def token_counts(top: int) -> list[int]:
    """The sweep: powers of two (either side of the one-shot/two-shot switch
    wherever it falls), the PDL edge, and the workspace's top."""
    counts = {top, *PDL_EDGE}
    power = 1
    while power <= top:
        counts.add(power)
        power *= 2
    return sorted(c for c in counts if 1 <= c <= top)


def largest_fitting(ws: Any, tp_size: int, top: int, hidden: int, dtype: Any) -> int:
    """The most tokens up to `top` that the workspace says it can take."""
    low, high = 0, top
    while low < high:
        mid = (low + high + 1) // 2
        if ws.is_buffer_size_sufficient(
            tp_size=tp_size, num_tokens=mid, hidden_dim=hidden, dtype=dtype
        ):
            low = mid
        else:
            high = mid - 1
    return low


def make_inputs(
    rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial sums and the residual, both deterministic.

    Every fifth token carries values past 256 (the residual, so the sum
    too), every seventh large partial sums.
    """
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    partial = torch.randn(tokens, hidden, generator=generator) * 0.5
    residual = torch.randn(
        tokens, hidden, generator=torch.Generator().manual_seed(seed)
    )
    residual[::5] += LARGE_VALUE
    partial[3::7] *= LARGE_VALUE
    return partial.to(dtype), residual.to(dtype)


def compare(got: torch.Tensor, want: torch.Tensor, dtype: str) -> dict | None:
    """Where `got` is out of tolerance of `want`, or None. NaN counts as bad."""
    rtol, atol = TOLERANCES[dtype]
    error = (got.float() - want).abs()
    ok = error <= atol + rtol * want.abs()
    if bool(ok.all()):
        return None
    bad = (~ok).nonzero()
    token, column = (int(i) for i in bad[0])
    return {
        "token": token,
        "column": column,
        "got": float(got[token, column]),
        "want": float(want[token, column]),
        "worst_error": float(error.nan_to_num(nan=float("inf")).max()),
        "bad_values": int(bad.shape[0]),
        "bad_tokens": int(bad[:, 0].unique().numel()),
    }


def percentiles(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p99": None}
    ordered = torch.tensor(sorted(samples), dtype=torch.float64)
    return {
        "p50": float(torch.quantile(ordered, 0.5)),
        "p99": float(torch.quantile(ordered, 0.99)),
    }


class Rank:
    """What one rank does, on GPU or CPU."""

    def __init__(self, spec: dict[str, Any], rank: int, reporter: Reporter):
        self.spec = spec
        self.rank = rank
        self.world_size = spec["tp"]
        self.report = reporter
        self.cuda = spec["device"] == "cuda"
        self.gpu = importlib.import_module(GPU_MODULE) if self.cuda else None
        self.replays = 0
        self.mismatch_reports = 0
        self.decided_backend: str | None = None
        inject = spec.get("inject")
        self.inject = inject if inject and inject["rank"] == rank else None

    def run(self) -> None:
        from vllm.config import set_current_vllm_config

        # As `vllm serve` logs: INFO, with the lines about FlashInfer kept
        # for the launcher.
        self.lines = FlashInferLines()
        logging.getLogger("vllm").setLevel(logging.INFO)
        logging.getLogger("vllm").addHandler(self.lines)
        config = build_config(self.spec["device"], self.spec["hisparse"])
        with set_current_vllm_config(config):
            self._run()

    def _run(self) -> None:
        from vllm.distributed import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.distributed.parallel_state import get_tp_group

        self.device = (
            self.gpu.bind_device(self.rank) if self.gpu else torch.device("cpu")
        )
        init_distributed_environment(
            world_size=self.world_size,
            rank=self.rank,
            distributed_init_method=f"tcp://127.0.0.1:{self.spec['port']}",
            local_rank=self.rank,
            backend="nccl" if self.cuda else "gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=self.world_size)
        self.tp_group = get_tp_group()
        # Its module globals are what the op calls; they get replaced.
        self.op_module: Any = cast(Any, importlib.import_module(OP_MODULE))
        self.fi_ar = importlib.import_module(FI_AR_MODULE)
        if not self.cuda:
            install_cpu_kernel(self.op_module)
        self.kernel = KernelCalls(self.op_module)
        if (self.spec.get("inject") or {}).get("kind") == "fallback":
            # Every rank's gate refuses, as on a group where FlashInfer
            # cannot serve the op; the group stays in step.
            self.op_module._can_use_flashinfer = refuse_every_call
        backend, _ = self.fi_ar._resolve_fi_ar_backend(self.tp_group.cpu_group)
        self.decided_backend = backend
        from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
            group_node_count,
        )

        self.report.send(
            "info",
            decided_backend=self.decided_backend,
            kernel=counted_kernel_release(self.tp_group.cpu_group),
            nodes=group_node_count(self.tp_group.cpu_group),
            platform=(
                self.gpu.describe(self.world_size) if self.gpu else {"gpu": None}
            ),
            lines=list(self.lines.lines),
        )
        stop_traffic: Callable[[], None] = lambda: None  # noqa: E731
        if self.gpu and self.spec["host_traffic_mib"]:
            stop_traffic = self.gpu.start_host_traffic(
                self.spec["host_traffic_mib"], self.device
            )
        try:
            configs = [
                (dtype, hidden)
                for dtype in self.spec["dtypes"]
                for hidden in self.spec["hidden_sizes"]
            ]
            slice_seconds = self.spec["seconds"] / len(configs)
            for seed, (dtype, hidden) in enumerate(configs):
                self.run_config(dtype, hidden, slice_seconds, seed)
        finally:
            stop_traffic()
        self.report.advance(PHASE_DONE)

    def run_config(self, dtype: str, hidden: int, seconds: float, seed: int) -> None:
        """One model shape: a fresh workspace, a sweep, replays until time."""
        from vllm.model_executor.layers.layernorm import RMSNorm

        self.fi_ar.destroy_fi_ar_workspace()
        torch_dtype = DTYPES[dtype]
        self.report.advance(PHASE_WARMUP)
        norm = RMSNorm(hidden, eps=RMS_EPS, dtype=torch_dtype).to(self.device)
        with torch.no_grad():
            gamma = torch.Generator().manual_seed(seed)
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gamma))
        # The first call creates the workspace, as a model's first forward does.
        first = Case(self, dtype, hidden, 1, norm, seed)
        first.run_eager()
        ws = self.fi_ar.get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=1,
            hidden_dim=hidden,
            dtype=torch_dtype,
            group=self.tp_group.cpu_group,
        )
        budget = (
            self.gpu.op_max_token_num(self.world_size, hidden, torch_dtype)
            if self.gpu
            else cpu_max_token_num(self.world_size, hidden, torch_dtype)
        )
        if self.spec["max_tokens"]:
            budget = min(budget, self.spec["max_tokens"])
        top = largest_fitting(ws, self.world_size, budget, hidden, torch_dtype)
        sweep = token_counts(top)
        cases = [Case(self, dtype, hidden, n, norm, seed) for n in sweep]
        for case in cases:
            case.prepare()
        self.report.send(
            "config",
            dtype=dtype,
            hidden=hidden,
            backend=ws.backend,
            tokens=sweep,
            lines=list(self.lines.lines),
        )
        iterations = self.report.iterations
        start = time.perf_counter()
        self.replay(cases, seconds)
        self.report.send(
            "latency",
            dtype=dtype,
            hidden=hidden,
            buckets=[case.latency() for case in cases],
            # For the harness's own cost per iteration: all of it, and the
            # parts that are the op and the reference.
            iterations=self.report.iterations - iterations,
            wall_seconds=time.perf_counter() - start,
            fused_seconds=sum(sum(c.fused_seconds) for c in cases),
            reference_seconds=sum(sum(c.reference_seconds) for c in cases),
        )

    def replay(self, cases: list["Case"], seconds: float) -> None:
        """Round-robin over the sweep until rank 0's time is up; the ranks
        agree on stopping after each round, as they must stop together."""
        deadline = time.monotonic() + seconds
        self.report.advance(PHASE_REPLAY)
        while True:
            for case in cases:
                case.check_replay()
            done = torch.tensor([int(self.rank == 0 and time.monotonic() >= deadline)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.tp_group.cpu_group)
            if done.item():
                return

    def injected(self, when: str, case: "Case", outputs: Any = None) -> None:
        """Injects this rank's fault, once, at the configured replay."""
        if self.inject is None or self.replays < self.inject["after"]:
            return
        kind = self.inject["kind"]
        if when == "before" and kind == "stall":
            while True:
                time.sleep(3600)
        if when == "before" and kind == "die":
            raise RuntimeError(INJECTED_LAUNCH_FAILURE)
        if when == "before" and kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if when == "after" and kind == "wrong":
            outputs[0][case.tokens - 1, 0] += 1000
            self.inject = None

    def mismatch(self, case: "Case", which: str, found: dict) -> None:
        self.report.mismatches += 1
        if self.mismatch_reports < MISMATCH_REPORTS:
            self.mismatch_reports += 1
            self.report.send(
                "mismatch",
                dtype=case.dtype,
                hidden=case.hidden,
                tokens=case.tokens,
                output=which,
                **found,
            )


class Case:
    """One shape of the sweep: its inputs, fp32 reference and runners."""

    def __init__(
        self, owner: Rank, dtype: str, hidden: int, tokens: int, norm: Any, seed: int
    ):
        self.owner = owner
        self.dtype = dtype
        self.hidden = hidden
        self.tokens = tokens
        self.norm = norm
        device = owner.device
        partial, residual = make_inputs(owner.rank, tokens, hidden, DTYPES[dtype], seed)
        self.partial = partial.to(device)
        self.residual = residual.to(device)
        # The reference: the device group's all-reduce (NCCL on GPUs) in
        # fp32, then an fp32 RMSNorm.
        self.want_norm, self.want_sum = fused_reference(
            self.partial,
            self.residual,
            norm.weight,
            RMS_EPS,
            owner.tp_group.device_group,
        )
        self.inputs = torch.empty_like(self.partial)
        self.residuals = torch.empty_like(self.residual)
        self.ref_inputs = torch.empty_like(self.partial)
        self.ref_residuals = torch.empty_like(self.residual)
        self.fused_seconds: list[float] = []
        self.reference_seconds: list[float] = []
        self.run_fused: Callable[[], Any] = self.fused
        self.run_reference: Callable[[], Any] = self.nccl_rms_norm

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's op, on fresh copies of the inputs (it writes into them)."""
        self.inputs.copy_(self.partial)
        self.residuals.copy_(self.residual)
        return self.owner.op_module.fused_allreduce_rms_norm(
            self.inputs, self.residuals, self.norm
        )

    def nccl_rms_norm(self) -> Any:
        """The unfused path for timing: the device group's all-reduce
        (NCCL on GPUs), then vLLM's RMSNorm."""
        self.ref_inputs.copy_(self.partial)
        self.ref_residuals.copy_(self.residual)
        dist.all_reduce(self.ref_inputs, group=self.owner.tp_group.device_group)
        return self.norm(self.ref_inputs, self.ref_residuals)

    def _called_kernel(self, call: Callable[[], Any]) -> Any:
        """Run `call`; raise FallbackRan if it never reached the kernel."""
        kernel = self.owner.kernel
        before = kernel.count
        outputs = call()
        if kernel.count == before:
            if not kernel.available:
                why = "vLLM's FlashInfer fusion op did not load"
            elif self.owner.decided_backend is None:
                why = "this build turned FlashInfer all-reduce off for the group"
            else:
                why = "the op's FlashInfer gate refused it"
            raise FallbackRan(
                f"fused_allreduce_rms_norm ran NCCL + RMSNorm instead of "
                f"FlashInfer's fused kernel ({why}) for {self.tokens} tokens, "
                f"hidden {self.hidden}, {self.dtype}"
            )
        return outputs

    def run_eager(self) -> None:
        """One eager call, checked, as a model's warm-up forward."""
        self.owner.report.advance()
        outputs = self._called_kernel(self.fused)
        self.owner.report.advance()
        self.check(outputs)

    def prepare(self) -> None:
        """Warm up and, on GPUs, capture both paths in CUDA graphs."""
        self.run_eager()
        gpu = self.owner.gpu
        if gpu is None:
            self.run_fused = lambda: self._called_kernel(self.fused)
            return
        replay, outputs = self._called_kernel(lambda: gpu.capture(self.fused))
        self.run_fused = lambda: (replay(), outputs)[1]
        self.nccl_rms_norm()
        replay_ref, _ = gpu.capture(self.nccl_rms_norm)
        self.run_reference = replay_ref

    def timed(self, run: Callable[[], Any]) -> tuple[float, Any]:
        gpu = self.owner.gpu
        result: list[Any] = []
        if gpu is not None:
            return gpu.timed(lambda: result.append(run())), result[0]
        start = time.perf_counter()
        value = run()
        return time.perf_counter() - start, value

    def check_replay(self) -> None:
        owner = self.owner
        owner.injected("before", self)
        owner.report.advance()
        seconds, outputs = self.timed(self.run_fused)
        owner.report.advance()
        owner.injected("after", self, outputs)
        self.fused_seconds.append(seconds)
        owner.replays += 1
        owner.report.iterations += 1
        self.check(outputs)
        reference_seconds, _ = self.timed(self.run_reference)
        self.reference_seconds.append(reference_seconds)

    def check(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        norm_out, sum_out = outputs
        for which, got, want in (
            ("normed", norm_out, self.want_norm),
            ("residual", sum_out, self.want_sum),
        ):
            found = compare(got, want, self.dtype)
            if found is not None:
                self.owner.mismatch(self, which, found)

    def latency(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "fused": percentiles(self.fused_seconds),
            "reference": percentiles(self.reference_seconds),
        }


def die_with_launcher() -> None:
    """Ask Linux to kill this rank if the launcher goes, however it goes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> None:
    spec_path, rank_text, fd_text = argv
    die_with_launcher()
    spec = json.loads(Path(spec_path).read_text())
    rank = int(rank_text)
    reporter = Reporter(int(fd_text), spec["progress"], rank)
    code = 0
    try:
        Rank(spec, rank, reporter).run()
        reporter.send("done")
    except BaseException as e:
        reporter.send(
            "fault",
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc(),
        )
        code = 1
    # No teardown: after a GPU fault NCCL's may hang, and the launcher has
    # what it needs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
