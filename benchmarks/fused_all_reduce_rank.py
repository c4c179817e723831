# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank of check_fused_all_reduce.py.

Started by the launcher as `python fused_all_reduce_rank.py SPEC RANK FD`,
one process per rank, as `vllm serve -tp N` starts its workers. The rank
sets up vLLM's distributed state and a current VllmConfig (HiSparse on unless
told otherwise), and for each shape of a sweep of token counts replays two
steps (fused_all_reduce_step.py) back to back: the layers with their GEMMs
and host traffic, timed per replay, and the fused calls alone, timed per
call; every output of both is checked against the kernels' own arithmetic.
It tells the launcher what happens as JSON lines on the pipe FD, and keeps a
progress record in a shared file the launcher watches for stalls.

With device "cpu" an emulation of the decided backend's kernel stands in for
FlashInfer's (fused_all_reduce_reference.py), and there are no CUDA graphs
and no host traffic; everything else is the same code. What only GPUs run is
in fused_all_reduce_gpu.py.
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
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from fused_all_reduce_reference import (
    cpu_max_token_num,
    install_cpu_kernel,
    platform_reads_as_cuda,
)
from fused_all_reduce_step import (
    DTYPES,
    NORMS,
    Step,
    in_flight,
    largest_fitting,
    percentiles,
    token_counts,
)

FI_AR_MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
FI_AR_PACKAGE = "vllm.distributed.device_communicators"
OP_MODULE = "vllm.models.common.ops.fused_allreduce_rms_norm"
GPU_MODULE = "fused_all_reduce_gpu"
# The known issue whose zeroed tokens are a finding of their own.
OVERFLOW_ISSUE = "mnnvl fp16 RMSNorm overflow"

# A rank's record in the progress file: how far it got (bumped before and
# after each replay), its phase, its replays, mismatches and known-issue
# tokens.
PROGRESS = struct.Struct("<qqqqq")
PHASE_START, PHASE_WARMUP, PHASE_REPLAY, PHASE_DONE = range(4)

RMS_EPS = 1e-6
PR_SET_PDEATHSIG = 1
# Records sent in full per rank; the rest are only counted.
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
        self.step = self.iterations = self.mismatches = self.findings = 0
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
            self.findings,
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
    counts it (the policy's `kernel_release` over `installed_kernels`),
    with the group's inputs as the build's own decision reads them."""
    import vllm.envs as envs

    fi_group = importlib.import_module(f"{FI_AR_PACKAGE}.flashinfer_all_reduce_group")
    policy = importlib.import_module(f"{FI_AR_PACKAGE}.flashinfer_all_reduce_policy")
    release, package = policy.kernel_release(
        policy.FiArBackendInputs(
            setting=envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND,
            node_count=fi_group.group_node_count(group),
            device_capability=fi_group.device_capability(),
            hisparse=fi_group.hisparse_enabled(),
            kernels=policy.installed_kernels(),
        )
    )
    return {"release": None if release is None else str(release), "package": package}


def known_issue(name: str) -> Any:
    policy = importlib.import_module(f"{FI_AR_PACKAGE}.flashinfer_all_reduce_policy")
    return next(issue for issue in policy.FI_AR_KNOWN_ISSUES if issue.name == name)


class KernelCalls:
    """Counts the op's calls of FlashInfer's fused kernel.

    The op falls back to NCCL plus a separate RMSNorm without a word; the
    kernel it calls is wrapped in the op's own module, so a call of the op
    that did not reach it is known (at warm-up and capture: a replay runs
    no Python).
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


class Clock:
    """Times replays without waiting: CUDA events on GPUs, read at a drain."""

    def __init__(self, gpu: Any):
        self.gpu = gpu
        self.marks: list[Any] = []

    def time(self, run: Any) -> Any:
        start = self.gpu.event() if self.gpu else time.perf_counter()
        value = run()
        end = self.gpu.event() if self.gpu else time.perf_counter()
        self.marks.append((start, end))
        return value

    def read(self) -> list[float]:
        """The times marked since the last read (after a synchronize)."""
        marks, self.marks = self.marks, []
        if self.gpu is None:
            return [end - start for start, end in marks]
        return [start.elapsed_time(end) / 1e3 for start, end in marks]


class Rank:
    """What one rank does, on GPU or CPU; the owner of its steps."""

    def __init__(self, spec: dict[str, Any], rank: int, reporter: Reporter):
        self.spec = spec
        self.rank = rank
        self.world_size = spec["tp"]
        self.report = reporter
        self.cuda = spec["device"] == "cuda"
        self.gpu: Any = importlib.import_module(GPU_MODULE) if self.cuda else None
        self.traffic: Any = None
        self.replays = 0
        self.sent = 0
        self.decided_backend: str | None = None
        self.backend: str | None = None
        inject = spec.get("inject")
        self.inject = inject if inject and inject["rank"] == rank else None
        self.clock = Clock(self.gpu)
        self.issue_shapes: set[tuple[str, int, int]] = set()

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
        kernel = counted_kernel_release(self.tp_group.cpu_group)
        if not self.cuda:
            install_cpu_kernel(self.op_module, kernel["release"] or "0")
        self.kernel = KernelCalls(self.op_module)
        if (self.spec.get("inject") or {}).get("kind") == "fallback":
            # Every rank's gate refuses, as on a group where FlashInfer
            # cannot serve the op; the group stays in step.
            self.op_module._can_use_flashinfer = refuse_every_call
        backend, _ = self.fi_ar._resolve_fi_ar_backend(self.tp_group.cpu_group)
        self.decided_backend = backend
        fi_group = importlib.import_module(
            f"{FI_AR_PACKAGE}.flashinfer_all_reduce_group"
        )
        if self.gpu and self.spec["host_traffic_mib"]:
            self.traffic = self.gpu.HostTraffic(
                self.spec["host_traffic_mib"],
                self.spec["gather_rows"],
                self.spec["layers"],
                self.device,
            )
        self.report.send(
            "info",
            decided_backend=self.decided_backend,
            kernel=kernel,
            nodes=fi_group.group_node_count(self.tp_group.cpu_group),
            platform=(
                self.gpu.describe(self.world_size) if self.gpu else {"gpu": None}
            ),
            lines=list(self.lines.lines),
        )
        configs = [
            (dtype, hidden)
            for dtype in self.spec["dtypes"]
            for hidden in self.spec["hidden_sizes"]
        ]
        slice_seconds = self.spec["seconds"] / len(configs)
        for seed, (dtype, hidden) in enumerate(configs):
            self.run_config(dtype, hidden, slice_seconds, seed)
        self.report.advance(PHASE_DONE)

    def known_overflow(self, dtype: str) -> bool:
        """Whether zeroed tokens here are the known fp16 overflow."""
        return dtype == "fp16" and self.backend == known_issue(OVERFLOW_ISSUE).backend

    def group_sum(self, partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's fp32 sum of `partials` and of their magnitudes (NCCL
        on GPUs, gloo on CPU)."""
        sums = [partials.float(), partials.float().abs()]
        for total in sums:
            dist.all_reduce(total, group=self.tp_group.device_group)
        return sums[0], sums[1]

    def fused(self, partial: torch.Tensor, residual: torch.Tensor, norm: Any) -> Any:
        """vLLM's op; FallbackRan if it did not reach FlashInfer's kernel."""
        before = self.kernel.count
        outputs = self.op_module.fused_allreduce_rms_norm(partial, residual, norm)
        if self.kernel.count == before:
            if not self.kernel.available:
                why = "vLLM's FlashInfer fusion op did not load"
            elif self.decided_backend is None:
                why = "this build turned FlashInfer all-reduce off for the group"
            else:
                why = "the op's FlashInfer gate refused it"
            raise FallbackRan(
                f"fused_allreduce_rms_norm ran NCCL + RMSNorm instead of "
                f"FlashInfer's fused kernel ({why}) for {partial.shape[0]} "
                f"tokens, hidden {partial.shape[1]}, {partial.dtype}"
            )
        return outputs

    def run_config(self, dtype: str, hidden: int, seconds: float, seed: int) -> None:
        """One model shape: a fresh workspace, a sweep, replays until time."""
        from vllm.model_executor.layers.layernorm import RMSNorm

        self.fi_ar.destroy_fi_ar_workspace()
        torch_dtype = DTYPES[dtype]
        self.report.advance(PHASE_WARMUP)
        norms = []
        for k in range(len(NORMS)):
            norm = RMSNorm(hidden, eps=RMS_EPS, dtype=torch_dtype).to(self.device)
            with torch.no_grad():
                gamma = torch.Generator().manual_seed(seed * 10 + k)
                norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gamma))
            norms.append(norm)
        # The first call creates the workspace, as a model's first forward does.
        probe = torch.zeros(1, hidden, dtype=torch_dtype, device=self.device)
        self.fused(probe, torch.zeros_like(probe), norms[0])
        ws = self.fi_ar.get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=1,
            hidden_dim=hidden,
            dtype=torch_dtype,
            group=self.tp_group.cpu_group,
        )
        self.backend = ws.backend
        budget = (
            self.gpu.op_max_token_num(self.world_size, hidden, torch_dtype)
            if self.gpu
            else cpu_max_token_num(self.world_size, hidden, torch_dtype)
        )
        if self.spec["max_tokens"]:
            budget = min(budget, self.spec["max_tokens"])
        top = largest_fitting(ws, self.world_size, budget, hidden, torch_dtype)
        sweep = token_counts(top)
        steps = [
            Step(self, dtype, hidden, n, norms, seed, fused_only)
            for n in sweep
            for fused_only in (False, True)
        ]
        for step in steps:
            self.prepare(step)
        self.report.send(
            "config",
            dtype=dtype,
            hidden=hidden,
            backend=ws.backend,
            tokens=sweep,
            layers=self.spec["layers"],
            input_sets=self.spec["input_sets"],
            step_nodes=[list(node) for node in steps[0].nodes],
            in_flight=in_flight(steps[0].nodes),
            lines=list(self.lines.lines),
        )
        self.replay(steps, seconds)
        self.report.send(
            "latency",
            dtype=dtype,
            hidden=hidden,
            buckets=[
                {
                    "tokens": step.tokens,
                    "step": percentiles(step.seconds),
                    "fused_call": percentiles([t / fused.calls for t in fused.seconds]),
                }
                for step, fused in zip(steps[::2], steps[1::2], strict=True)
            ],
        )

    def prepare(self, step: Step) -> None:
        """An eager, checked run (a model's warm-up), then on GPUs the
        capture of the step in one CUDA graph."""
        self.report.advance()
        step.load(0)
        step.check(0, step.forward())
        self.report.advance()
        self.take(step, step.drain())
        if self.gpu is None:
            return
        replay, outputs = self.gpu.capture(step.forward)
        step.run = lambda: (replay(), outputs)[1]

    def replay(self, steps: list[Step], seconds: float) -> None:
        """Bursts of replays per step, round-robin until rank 0's time is up;
        the ranks agree on stopping after each round, as they must stop
        together."""
        deadline = time.monotonic() + seconds
        self.report.advance(PHASE_REPLAY)
        while True:
            for step in steps:
                self.burst(step)
            done = torch.tensor([int(self.rank == 0 and time.monotonic() >= deadline)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.tp_group.cpu_group)
            if done.item():
                return

    def burst(self, step: Step) -> None:
        """`replays_per_sync` replays queued back to back, then one
        synchronize, and the checks' records. After its check, each normed
        output is filled with NaN: a call that writes nothing the next time
        leaves NaN, not good numbers."""
        for _ in range(self.spec["replays_per_sync"]):
            self.injected("before")
            self.report.advance()
            step.load(self.replays)
            outputs = self.clock.time(step.run)
            self.injected("after", outputs)
            step.check(self.replays, outputs)
            for normed, _ in outputs:
                normed.fill_(float("nan"))
            self.replays += 1
            self.report.iterations += 1
            self.report.advance()
        if self.gpu is not None:
            self.gpu.synchronize()
        self.take(step, step.drain())
        step.seconds += self.clock.read()
        self.report.advance()

    def injected(self, when: str, outputs: Any = None) -> None:
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
            normed = outputs[-1][0]
            normed[normed.shape[0] - 1, 0] += 1000
            self.inject = None

    def take(self, step: Step, found: list[dict[str, Any]]) -> None:
        """Report a drain's records: mismatches, and the known issue."""
        for record in found:
            zeroed = record.pop("zeroed_tokens")
            shape = {"dtype": step.dtype, "hidden": step.hidden, "tokens": step.tokens}
            key = (step.dtype, step.hidden, step.tokens)
            if zeroed:
                self.report.findings += zeroed
            if zeroed and key not in self.issue_shapes:
                # Once per shape: the count says the rest.
                self.issue_shapes.add(key)
                issue = known_issue(OVERFLOW_ISSUE)
                self.report.send(
                    "known_issue",
                    name=issue.name,
                    fixed_in=issue.fixed_in,
                    effect=issue.effect,
                    zeroed_tokens=zeroed,
                    replay=record["replay"],
                    layer=record["layer"],
                    **shape,
                )
            if record["bad_values"]:
                self.report.mismatches += 1
                self.send_capped("mismatch", **shape, **record)

    def send_capped(self, event: str, **fields: Any) -> None:
        if self.sent < MISMATCH_REPORTS:
            self.sent += 1
            self.report.send(event, **fields)


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
    # No teardown, no joins: after a GPU fault NCCL's may hang, and the
    # launcher has what it needs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
