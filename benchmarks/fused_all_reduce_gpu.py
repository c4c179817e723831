# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The part of check_fused_all_reduce.py that only GPUs run; it has never
run. Kept to what vLLM itself calls: a rank's device, the op's token budget,
vLLM's platform, thread-local CUDA-graph capture, events, and HiSparse's host
traffic. tests/benchmarks/test_check_fused_all_reduce_calls.py checks what
this hands a released op (`gather_tensors`) against its contract, and the
vLLM names it calls against the installed vLLM.
"""

from collections.abc import Callable
from typing import Any

import torch

from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import _max_token_num

# On CUDA this loads vllm._C_stable_libtorch, which registers
# torch.ops._C_cache_ops.hisparse_gather_compact (vllm/platforms/cuda.py).
from vllm.platforms import current_platform
from vllm.v1.hisparse.runtime import FP8_DS_MLA_ROW_BYTES, PagedCacheView

MiB = 1024 * 1024
# Rows each layer's gather reads, all misses: DeepSeek V3.2's index_topk.
GATHER_ROWS = 2048
# DeepSeek V3.2's fp8_ds_mla KV block size (FlashMLA sparse's
# get_supported_kernel_block_sizes, vllm/v1/attention/backends/mla).
BLOCK_SIZE = 64


def bind_device(local_rank: int) -> torch.device:
    """The rank's GPU, made current as vLLM's GPU worker does."""
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def op_max_token_num(tp_size: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The workspace token budget `fused_allreduce_rms_norm` asks for."""
    return _max_token_num(tp_size, hidden_size, dtype) or 0


def describe() -> dict[str, Any]:
    """The GPU, as vLLM's platform sees it."""
    capability = current_platform.get_device_capability()
    return {
        "gpu": current_platform.get_device_name(),
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


synchronize = torch.cuda.synchronize


def event() -> Any:
    """A timing event, recorded now on the current stream."""
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def gather_tensors(
    pool_rows: int, rows: int, device: torch.device, pin: bool
) -> tuple[torch.Tensor, ...]:
    """`hisparse_gather_compact`'s five arguments, as vLLM's runtime builds
    them: the host pool a (rows, 656) uint8 matrix (`bind_source_cache`),
    the hot cache [num_blocks, block_size, 656] through `PagedCacheView.bind`
    (`bind_hot_cache`), and one row of `rows` misses: int32 host rows, hot
    rows and count (`_SharedTopKState`, sliced by `_swap_rows`)."""
    host_cache = torch.empty((pool_rows, FP8_DS_MLA_ROW_BYTES), dtype=torch.uint8)
    if pin:
        host_cache = host_cache.pin_memory()
    num_blocks = -(-rows // BLOCK_SIZE)
    block_bytes = BLOCK_SIZE * FP8_DS_MLA_ROW_BYTES
    hot = PagedCacheView.bind(
        torch.empty(num_blocks * block_bytes, dtype=torch.uint8, device=device),
        dtype=torch.uint8,
        row_width=FP8_DS_MLA_ROW_BYTES,
        byte_offset=0,
        block_stride=block_bytes,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
    )
    picked = torch.randperm(pool_rows, generator=torch.Generator().manual_seed(0))
    host_rows = picked[:rows].to(torch.int32).view(1, rows).to(device)
    hot_rows = torch.arange(rows, dtype=torch.int32, device=device).view(1, rows)
    counts = torch.full((1,), rows, dtype=torch.int32, device=device)
    return host_cache, hot.cache, host_rows, hot_rows, counts


class HostTraffic:
    """HiSparse's host traffic in a captured step, on streams forked from
    the compute stream: the swap-in gather (`HiSparseRuntime._stage_this_layer`
    and `wait_for_staged_swap`), device-to-host copies as the connector
    worker's `dma_stream` mirror writes, and host-to-device copies as its page
    restores. Step nodes name the methods."""

    def __init__(self, mib: int, layers: int, device: torch.device):
        pool_rows = max(GATHER_ROWS, mib * MiB // FP8_DS_MLA_ROW_BYTES)
        self.gather_args = gather_tensors(pool_rows, GATHER_ROWS, device, pin=True)
        chunk = pool_rows * FP8_DS_MLA_ROW_BYTES // layers
        pool = self.gather_args[0].view(-1)[: layers * chunk]
        self.h2d_from = pool.view(layers, chunk)
        self.h2d_to = torch.empty_like(self.h2d_from, device=device)
        self.d2h_from = torch.empty_like(self.h2d_from, device=device)
        self.d2h_to = torch.empty_like(self.h2d_from).pin_memory()
        self.streams = {n: torch.cuda.Stream(device) for n in ("copy", "h2d", "d2h")}
        self.gathered = torch.cuda.Event()

    def _fork(self, name: str) -> Any:
        stream = self.streams[name]
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def h2d(self, layer: int) -> None:
        with self._fork("h2d"):
            self.h2d_to[layer].copy_(self.h2d_from[layer], non_blocking=True)

    def gather(self, layer: int) -> None:
        with self._fork("copy"):
            torch.ops._C_cache_ops.hisparse_gather_compact(*self.gather_args)
            self.gathered.record(self.streams["copy"])

    def wait_gather(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.gathered)

    def d2h(self, layer: int) -> None:
        with self._fork("d2h"):
            self.d2h_to[layer].copy_(self.d2h_from[layer], non_blocking=True)

    def wait_copies(self, end: int) -> None:
        for name in ("h2d", "d2h"):
            torch.cuda.current_stream().wait_stream(self.streams[name])
