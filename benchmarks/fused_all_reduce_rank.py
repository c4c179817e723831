# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank of check_fused_all_reduce.py, started by the launcher as
`python fused_all_reduce_rank.py SPEC RANK FD`, one process per rank as
`vllm serve -tp N` starts its workers. It sets up vLLM's distributed state
under a VllmConfig with HiSparse on and, per shape of a sweep, replays its
steps (fused_all_reduce_step.py), checking every output. It tells the
launcher what happens, progress included, as JSON lines on the pipe FD. On
CPU, FlashInfer's own workspace creation runs with CUDA faked below it
(tests/distributed/fake_cuda.py), and the emulated kernels of
tests/benchmarks/fused_all_reduce_cpu.py stand in for FlashInfer's, without
graphs or host traffic.
"""

import contextlib
import ctypes
import importlib
import itertools
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from fused_all_reduce_step import (
    DTYPES,
    INPUT_SETS,
    NORMS,
    Rotation,
    Step,
    largest_fitting,
    overlap_share,
    token_counts,
)

FI_AR_PACKAGE = "vllm.distributed.device_communicators"
# On CPU, test code: the emulated kernels (tests/benchmarks) and the CUDA
# faked below FlashInfer (tests/distributed), which the former imports.
TESTS = Path(__file__).resolve().parents[1] / "tests"
OP_MODULE = "vllm.models.common.ops.fused_allreduce_rms_norm"
# The known issue whose zeroed tokens are a finding of their own.
OVERFLOW_ISSUE = "mnnvl fp16 RMSNorm overflow"
PHASE_START, PHASE_WARMUP, PHASE_REPLAY, PHASE_DONE = range(4)
RMS_EPS = 1e-6
# Replays queued between synchronizes; fewer on CPU, where the emulated
# kernel is slow.
REPLAYS_PER_SYNC = {"cuda": 16, "cpu": 2}
# Mismatch records sent in full per rank; the rest are only counted.
MISMATCH_REPORTS = 20
PR_SET_PDEATHSIG = 1
INJECTED_LAUNCH_FAILURE = (
    "CUDA error: unspecified launch failure (injected by check_fused_all_reduce)"
)


class FallbackRan(RuntimeError):
    """vLLM's op ran NCCL and RMSNorm instead of FlashInfer's fused kernel."""


class Reporter:
    """The rank's line to the launcher: JSON events on a pipe. Progress goes
    before and after each replay; a rank that stops sending it has stalled,
    and in a stalled group, the rank with the least progress stalled first."""

    def __init__(self, fd: int, rank: int):
        self.rank = rank
        self._pipe = os.fdopen(fd, "w", buffering=1)
        self.phase = PHASE_START
        self.iterations = self.mismatches = self.findings = 0

    def send(self, event: str, **fields: Any) -> None:
        self._pipe.write(
            json.dumps({"event": event, "rank": self.rank, **fields}) + "\n"
        )

    def advance(self, phase: int | None = None) -> None:
        self.phase = self.phase if phase is None else phase
        counts = ("phase", "iterations", "mismatches", "findings")
        self.send("progress", **{name: getattr(self, name) for name in counts})


class FlashInferLines(logging.Handler):
    """vLLM's log lines about FlashInfer: the start-up line and its kin."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "flashinfer" in record.getMessage().lower():
            self.lines.append(f"{record.levelname} {record.getMessage()}")


def build_config(device: str) -> Any:
    """A VllmConfig with HiSparse on. On GPUs as users turn it on: a
    HiSparseConnector, from which vLLM infers `hisparse_config`. On CPU,
    where vLLM refuses HiSparse, `hisparse_config` is set as that inference
    sets it (`VllmConfig.__post_init__`)."""
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.config.attention import HiSparseConfig

    if device == "cpu":
        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        config.attention_config.hisparse_config = HiSparseConfig()
        return config
    return VllmConfig(
        device_config=DeviceConfig(device="cuda"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiSparseConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": 4},
        ),
    )


def ours(name: str) -> Any:
    """One of this build's FlashInfer all-reduce modules."""
    return importlib.import_module(f"{FI_AR_PACKAGE}.flashinfer_all_reduce{name}")


def counted_kernel_release() -> dict[str, str | None]:
    """The FlashInfer release whose all-reduce kernels run, as this build
    counts it (`kernel_release` over `installed_kernels`)."""
    backend = ours("_backend")
    release, package = backend.kernel_release(backend.installed_kernels())
    return {"release": None if release is None else str(release), "package": package}


def known_issue(name: str) -> Any:
    return next(i for i in ours("_backend").FI_AR_KNOWN_ISSUES if i.name == name)


class Rank:
    """What one rank does, on GPU or CPU; the owner of its steps."""

    def __init__(self, spec: dict[str, Any], rank: int, reporter: Reporter):
        self.spec = {**spec, "input_sets": INPUT_SETS}
        self.rank, self.world_size, self.report = rank, spec["tp"], reporter
        self.cuda = spec["device"] == "cuda"
        self.gpu: Any = (
            importlib.import_module("fused_all_reduce_gpu") if self.cuda else None
        )
        self.traffic: Any = None
        self.replays = 0
        self.backend: str | None = None
        inject = spec.get("inject")
        self.inject = inject if inject and inject["rank"] == rank else None

    def run(self) -> None:
        from vllm.config import set_current_vllm_config

        # As `vllm serve` logs: INFO, with the lines about FlashInfer kept
        # for the launcher.
        self.lines = FlashInferLines()
        logging.getLogger("vllm").setLevel(logging.INFO)
        logging.getLogger("vllm").addHandler(self.lines)
        with set_current_vllm_config(build_config(self.spec["device"])):
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
        self.fi_ar = ours("")
        kernel = counted_kernel_release()
        if not self.cuda:
            from fused_all_reduce_options import fusion_max_size

            sys.path.insert(0, str(TESTS / "benchmarks"))
            sys.path.append(str(TESTS / "distributed"))  # last: shadows nothing
            cpu = importlib.import_module("fused_all_reduce_cpu")
            self.cpu: Any = cpu.install_cpu_kernel(
                self.op_module,
                kernel["release"] or "0",
                fusion_max_size(self.spec["capability"], self.world_size),
                self.rank,
                self.world_size,
            )
        self.count_kernel_calls()
        if (self.spec.get("inject") or {}).get("kind") == "fallback":
            # Every rank's gate refuses, as on a group where FlashInfer
            # cannot serve the op; the group stays in step.
            self.op_module._can_use_flashinfer = lambda *_: (False, 0)
        self.decided_backend, _ = self.fi_ar._resolve_fi_ar_backend(
            self.tp_group.cpu_group
        )
        if self.gpu and self.spec["host_traffic_mib"]:
            self.traffic = self.gpu.HostTraffic(
                self.spec["host_traffic_mib"], self.spec["layers"], self.device
            )
        self.report.send(
            "info",
            decided_backend=self.decided_backend,
            kernel=kernel,
            nodes=ours("_backend").agreed(self.tp_group.cpu_group).node_count,
            platform=self.gpu.describe(self.device) if self.gpu else {},
            lines=list(self.lines.lines),
        )
        configs = [
            (d, h) for d in self.spec["dtypes"] for h in self.spec["hidden_sizes"]
        ]
        # --seconds bounds the run from here: each shape's share ends its
        # replays, whatever its warm-up took.
        start, share = time.monotonic(), self.spec["seconds"] / len(configs)
        for seed, (dtype, hidden) in enumerate(configs):
            self.run_config(dtype, hidden, start + share * (seed + 1), seed)
        self.report.advance(PHASE_DONE)

    def oneshot(self, tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Whether the op runs one-shot for this shape, as vLLM's op and
        FlashInfer pick on this device."""
        kernels = self.gpu or self.cpu
        return kernels.use_oneshot(self.backend, self.world_size, tokens, hidden, dtype)

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

    def count_kernel_calls(self) -> None:
        """The op falls back to NCCL plus a separate RMSNorm without a word:
        wrap the kernel it calls in its own module, to know a call that did
        not reach it (at warm-up and capture; a replay runs no Python)."""
        kernel = self.op_module.flashinfer_trtllm_fused_allreduce_norm
        self.kernel_calls = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.kernel_calls += 1
            return kernel(*args, **kwargs)

        if kernel is not None:
            self.op_module.flashinfer_trtllm_fused_allreduce_norm = counted

    def fused(self, partial: torch.Tensor, residual: torch.Tensor, norm: Any) -> Any:
        """vLLM's op; FallbackRan if it did not reach FlashInfer's kernel."""
        before = self.kernel_calls
        outputs = self.op_module.fused_allreduce_rms_norm(partial, residual, norm)
        if self.kernel_calls == before:
            raise FallbackRan(
                "fused_allreduce_rms_norm ran NCCL + RMSNorm instead of "
                f"FlashInfer's fused kernel for {partial.shape[0]} tokens, "
                f"hidden {partial.shape[1]}, {partial.dtype} (this build's "
                f"decision: {self.decided_backend or 'off'}); the rank's log "
                "says why"
            )
        return outputs

    def run_config(self, dtype: str, hidden: int, deadline: float, seed: int) -> None:
        """One model shape: a fresh workspace, a sweep, replays until time."""
        from vllm.model_executor.layers.layernorm import RMSNorm

        self.fi_ar.destroy_fi_ar_workspace()
        torch_dtype = DTYPES[dtype]
        self.report.advance(PHASE_WARMUP)
        norms = [RMSNorm(hidden, eps=RMS_EPS, dtype=torch_dtype) for _ in NORMS]
        for k, norm in enumerate(norms):
            generator = torch.Generator().manual_seed(seed * 2 + k)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=generator))
            norm.to(self.device)
        # The first call creates the workspace, as a model's first forward does.
        probe = torch.zeros(1, hidden, dtype=torch_dtype, device=self.device)
        self.fused(probe, torch.zeros_like(probe), norms[0])
        # Input sets by Lamport slot from here; the probe took the first.
        self.rotation = Rotation(INPUT_SETS, slots=1)
        ws = self.fi_ar.get_fi_ar_workspace(
            world_size=self.world_size,
            rank=self.rank,
            max_token_num=1,
            hidden_dim=hidden,
            dtype=torch_dtype,
            group=self.tp_group.cpu_group,
        )
        self.backend = ws.backend
        budget_of = (self.gpu or self.cpu).op_max_token_num
        budget = budget_of(self.world_size, hidden, torch_dtype)
        budget = min(budget, self.spec["max_tokens"] or budget)
        sweep = token_counts(
            largest_fitting(ws, self.world_size, budget, hidden, torch_dtype)
        )
        steps = [Step(self, dtype, hidden, n, norms, seed) for n in sweep]
        for step in steps:
            self.prepare(step)
        self.report.send(
            "config",
            dtype=dtype,
            hidden=hidden,
            backend=ws.backend,
            tokens=sweep,
            input_sets=INPUT_SETS,
            step_nodes=[list(node) for node in steps[0].nodes],
            lines=list(self.lines.lines),
            **({} if self.cuda else {"creation": self.creation(ws)}),
        )
        self.replay(steps, deadline)
        self.report.send(
            "overlap",
            dtype=dtype,
            hidden=hidden,
            overlap=[sum(step.overlap[i] for step in steps) for i in (0, 1)],
        )

    def creation(self, ws: Any) -> dict[str, Any]:
        """On CPU, what made the workspace: its class, and the calls so far
        to the faked CUDA below FlashInfer."""
        kind = type(ws)
        return {
            "workspace": f"{kind.__module__}.{kind.__qualname__}",
            "driver_calls": dict(self.cpu.cuda.driver_calls),
        }

    def prepare(self, step: Step) -> None:
        """An eager, checked run (a model's warm-up), then on GPUs the
        capture of the step in one CUDA graph."""
        self.report.advance()
        step.check(0, step.load(self.rotation), step.forward())
        self.take(step, step.drain())
        self.report.advance()
        if self.gpu is not None:
            replay, outputs = self.gpu.capture(step.forward)
            step.run = lambda: (replay(), outputs)[1]

    def replay(self, steps: list[Step], deadline: float) -> None:
        """Bursts of replays, a step at a time round-robin, until rank 0's
        `deadline` (each step once at least); the ranks agree on stopping
        after each burst, as they must stop together."""
        self.report.advance(PHASE_REPLAY)
        for turn in itertools.count(1):
            self.burst(steps[(turn - 1) % len(steps)])
            late = time.monotonic() >= deadline and turn >= len(steps)
            done = torch.tensor([int(self.rank == 0 and late)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.tp_group.cpu_group)
            if done.item():
                return

    def burst(self, step: Step) -> None:
        """Replays queued back to back, then the checks' records (the drain
        waits for the device) and, with traffic, the last replay's fused
        calls and traffic from the GPU's own timestamps. After its check,
        each normed output is filled with NaN: a call that writes nothing
        the next time leaves NaN, not good numbers."""
        for _ in range(REPLAYS_PER_SYNC[self.spec["device"]]):
            self.injected("before")
            self.report.advance()
            sets = step.load(self.rotation)
            outputs = step.run()
            self.injected("after", outputs)
            step.check(self.replays, sets, outputs)
            for normed, _ in outputs:
                normed.fill_(float("nan"))
            self.replays += 1
            self.report.iterations += 1
            self.report.advance()
        if self.traffic is not None:
            covered, total = overlap_share(*self.traffic.spans())
            step.overlap = [step.overlap[0] + covered, step.overlap[1] + total]
        self.take(step, step.drain())
        self.report.advance()

    def injected(self, when: str, outputs: Any = None) -> None:
        """Injects this rank's fault, once, at the configured replay."""
        if self.inject is None or self.replays < self.inject["after"]:
            return
        kind = self.inject["kind"]
        if when == "after" and kind == "wrong":
            outputs[-1][0][-1, 0] += 1000  # the last call's normed output
            self.inject = None
        elif when == "before" and kind == "die":
            raise RuntimeError(INJECTED_LAUNCH_FAILURE)
        elif when == "before" and kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while when == "before" and kind == "stall":
            time.sleep(3600)

    def take(self, step: Step, found: list[dict[str, Any]]) -> None:
        """Report a drain's records: mismatches, and the known issue (once:
        the count says the rest)."""
        shape = {"dtype": step.dtype, "hidden": step.hidden, "tokens": step.tokens}
        for record in found:
            zeroed = record.pop("zeroed_tokens")
            if zeroed and not self.report.findings:
                issue = known_issue(OVERFLOW_ISSUE)
                fields = {k: getattr(issue, k) for k in ("name", "fixed_in", "effect")}
                self.report.send("known_issue", **fields, **shape)
            self.report.findings += zeroed
            if record["bad_values"]:
                self.report.mismatches += 1
                if self.report.mismatches <= MISMATCH_REPORTS:
                    self.report.send("mismatch", **shape, **record)


def main(argv: list[str]) -> None:
    spec_path, rank_text, fd_text = argv
    # Ask Linux to kill this rank if the launcher goes, however it goes.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    spec = json.loads(Path(spec_path).read_text())
    reporter = Reporter(int(fd_text), int(rank_text))
    code = 0
    try:
        Rank(spec, int(rank_text), reporter).run()
        reporter.send("done")
    except BaseException as e:
        reporter.send(
            "fault", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
        )
        code = 1
    # No teardown, no joins: after a GPU fault NCCL's may hang, and the
    # launcher has what it needs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
