# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The part of check_fused_all_reduce.py that only GPUs run; it has never
run. Kept to what vLLM itself calls: a rank's device, the op's token budget
and one-shot choice, vLLM's platform, thread-local CUDA-graph capture,
events, and HiSparse's host traffic. tests/benchmarks/
test_check_fused_all_reduce_calls.py checks what this hands a released op
(`gather_tensors`, `replan`) against its contract, and the vLLM and
FlashInfer names it calls against the releases.
"""

from collections.abc import Callable
from typing import Any

import torch
from flashinfer.comm.trtllm_mnnvl_ar import MNNVLAllreduceFusionStrategy

from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import _max_token_num

# On CUDA this loads vllm._C_stable_libtorch, which registers
# torch.ops._C_cache_ops.hisparse_gather_compact (vllm/platforms/cuda.py).
from vllm.platforms import current_platform
from vllm.v1.hisparse.runtime import PagedCacheView

MiB = 1024 * 1024
# HiSparse's gather at batch 8: per decode token a row of DeepSeek V3.2's
# index_topk (2048) slots, half of them misses, scattered over the pool.
GATHER_TOKENS, TOP_K, MISSES = 8, 2048, 1024
# fp8_ds_mla's KV row (MLAAttentionImpl.get_fp8_ds_mla_row_bytes) and block
# size (FlashMLA sparse's get_supported_kernel_block_sizes).
ROW_BYTES, BLOCK_SIZE = 656, 64
# Each fused call's copies, each way: about what PCIe Gen5 moves in a
# layer's compute time.
COPY_MIB = 4
# How far each gather's misses move over the pool from the last one's.
PLAN_STRIDE = 100_003


def bind_device(local_rank: int) -> torch.device:
    """The rank's GPU, made current as vLLM's GPU worker does."""
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def op_max_token_num(tp_size: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The workspace token budget `fused_allreduce_rms_norm` asks for."""
    return _max_token_num(tp_size, hidden_size, dtype) or 0


def use_oneshot(
    backend: str, tp_size: int, tokens: int, hidden: int, dtype: torch.dtype
) -> bool:
    """One-shot or two-shot, as vLLM's op picks for trtllm and FlashInfer's
    AUTO for mnnvl (vLLM passes it None)."""
    if backend == "mnnvl":
        pick = MNNVLAllreduceFusionStrategy.select_strategy(
            tp_size, tokens, hidden, dtype
        )
        return pick == MNNVLAllreduceFusionStrategy.ONESHOT
    # Imports CUDA ops: GPUs only.
    from vllm.compilation.passes.fusion.allreduce_rms_fusion import (
        _select_flashinfer_allreduce_use_oneshot,
    )

    capability = current_platform.get_device_capability()
    size = tokens * hidden * dtype.itemsize
    version = None if capability is None else capability.to_int()
    return bool(
        _select_flashinfer_allreduce_use_oneshot(backend, version, tp_size, size)
    )


def describe(device: torch.device) -> dict[str, Any]:
    """The rank's GPU, as vLLM's platform sees it."""
    capability = current_platform.get_device_capability(device.index)
    return {
        "device": str(device),
        "gpu": current_platform.get_device_name(device.index),
        "capability": None if capability is None else capability.as_version_str(),
    }


def capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """Capture `fn`, which has run eagerly (as vLLM warms up first), in one
    CUDA graph: its replay and its outputs. Thread-local: a CUDA call of
    another thread cannot invalidate it."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn()
    torch.cuda.synchronize()
    return graph.replay, outputs


def gather_tensors(
    pool_rows: int, tokens: int, device: torch.device, pin: bool
) -> tuple[torch.Tensor, ...]:
    """`hisparse_gather_compact`'s five arguments, as vLLM's runtime builds
    them: the host pool a (rows, 656) uint8 matrix (`bind_source_cache`),
    the hot cache [num_blocks, block_size, 656] through `PagedCacheView.bind`
    (`bind_hot_cache`), and the miss plan `_SharedTopKState` holds: int32
    host rows and hot rows [tokens, top_k], MISSES of each row counted."""
    host_cache = torch.empty((pool_rows, ROW_BYTES), dtype=torch.uint8)
    if pin:
        host_cache = host_cache.pin_memory()
    num_blocks = -(-tokens * TOP_K // BLOCK_SIZE)
    block_bytes = BLOCK_SIZE * ROW_BYTES
    hot = PagedCacheView.bind(
        torch.empty(num_blocks * block_bytes, dtype=torch.uint8, device=device),
        dtype=torch.uint8,
        row_width=ROW_BYTES,
        byte_offset=0,
        block_stride=block_bytes,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
    )
    generator = torch.Generator().manual_seed(0)
    host_rows = torch.randint(pool_rows, (tokens, TOP_K), generator=generator)
    hot_rows = torch.arange(tokens * TOP_K).view(tokens, TOP_K)
    counts = torch.full((tokens,), MISSES)
    plan = [t.to(torch.int32).to(device) for t in (host_rows, hot_rows, counts)]
    return host_cache, hot.cache, *plan


def replan(host_rows: torch.Tensor, pool_rows: int) -> None:
    """A new miss plan in place, on the current stream, as the residency
    kernel writes one before each gather: every miss moves PLAN_STRIDE rows
    over the pool."""
    host_rows.add_(PLAN_STRIDE).remainder_(pool_rows)


class HostTraffic:
    """HiSparse's host traffic in a captured step, on streams forked from
    the compute stream: the swap-in gather (`HiSparseRuntime._stage_this_layer`
    and `wait_for_staged_swap`) after a new plan, device-to-host copies as
    the connector worker's `dma_stream` mirror writes, and host-to-device
    copies as its page restores, one of each per fused call. Every launch
    and fused call is timed with events the graph records."""

    def __init__(self, mib: int, layers: int, device: torch.device):
        pool_rows = max(GATHER_TOKENS * TOP_K, mib * MiB // ROW_BYTES)
        self.gather_args = gather_tensors(pool_rows, GATHER_TOKENS, device, pin=True)
        self.pool_rows, calls = pool_rows, 2 * layers
        chunk = min(COPY_MIB * MiB, pool_rows * ROW_BYTES // calls)
        pool = self.gather_args[0].view(-1)[: calls * chunk]
        self.h2d_from = pool.view(calls, chunk)
        self.h2d_to = torch.empty_like(self.h2d_from, device=device)
        self.d2h_from = torch.empty_like(self.h2d_from, device=device)
        self.d2h_to = torch.empty_like(self.h2d_from).pin_memory()
        self.streams = {n: torch.cuda.Stream(device) for n in ("copy", "h2d", "d2h")}
        self.gathered = torch.cuda.Event()
        self.marks: list[tuple[str, Any, Any]] = []
        self.base = torch.cuda.Event(enable_timing=True, external=True)
        self.next_mark = 0

    def begin(self) -> None:
        self.base.record()
        self.next_mark = 0

    def timed(self, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """`fn(*args, **kw)` between two events on the current stream."""
        if self.next_mark == len(self.marks):
            made = [torch.cuda.Event(enable_timing=True, external=True) for _ in "se"]
            self.marks.append((kind, made[0], made[1]))
        _, start, end = self.marks[self.next_mark]
        self.next_mark += 1
        start.record()
        result = fn(*args, **kw)
        end.record()
        return result

    def spans(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """The last run's fused calls and traffic, (start, end) in ms."""
        torch.cuda.synchronize()
        found: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for kind, start, end in self.marks[: self.next_mark]:
            span = (self.base.elapsed_time(start), self.base.elapsed_time(end))
            found[kind == "fused"].append(span)
        return found[True], found[False]

    def _fork(self, name: str) -> Any:
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def h2d(self, call: int) -> None:
        with self._fork("h2d"):
            to, source = self.h2d_to[call], self.h2d_from[call]
            self.timed("h2d", to.copy_, source, non_blocking=True)

    def gather(self, layer: int) -> None:
        with self._fork("copy"):
            self.timed("gather", self._gather)
            self.gathered.record(self.streams["copy"])

    def _gather(self) -> None:
        replan(self.gather_args[2], self.pool_rows)
        torch.ops._C_cache_ops.hisparse_gather_compact(*self.gather_args)

    def wait_gather(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.gathered)

    def d2h(self, call: int) -> None:
        with self._fork("d2h"):
            to, source = self.d2h_to[call], self.d2h_from[call]
            self.timed("d2h", to.copy_, source, non_blocking=True)

    def wait_copies(self, end: int) -> None:
        for name in ("h2d", "d2h"):
            torch.cuda.current_stream().wait_stream(self.streams[name])
