# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The part of check_fused_all_reduce.py that only GPUs run.

This project has never run it: no machine of ours has two GPUs. It is kept
to what vLLM itself calls: the CUDA device of a rank, the op's own token
budget, the GPU's name and links as vLLM's platform reports them, CUDA-graph
capture (thread-local, so no other thread can break it) and replay, events,
and HiSparse's host gather (`hisparse_gather_compact` on 656-byte rows of a
pinned host pool, forked on a copy stream and joined, as
vllm/v1/hisparse/runtime.py runs it). Everything else, the check itself
included, lives in the other modules and runs in the CPU tests.
tests/benchmarks/test_check_fused_all_reduce_calls.py checks every
FlashInfer and vLLM name this file reaches against the released sources.
"""

import threading
from collections.abc import Callable
from typing import Any

import torch

import vllm._custom_ops  # noqa: F401  (loads torch.ops._C_cache_ops)
from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import _max_token_num
from vllm.platforms import current_platform
from vllm.v1.hisparse.runtime import FP8_DS_MLA_ROW_BYTES

MiB = 1024 * 1024
# How long the bulk-copy thread may take to stop.
STOP_SECONDS = 10.0


def bind_device(local_rank: int) -> torch.device:
    """The rank's GPU, made current as vLLM's GPU worker does."""
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def op_max_token_num(tp_size: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The workspace token budget `fused_allreduce_rms_norm` asks for."""
    return _max_token_num(tp_size, hidden_size, dtype) or 0


def describe(world_size: int) -> dict[str, Any]:
    """The GPU and its links, as vLLM's platform sees them."""
    capability = current_platform.get_device_capability()
    physical = [
        current_platform.device_id_to_physical_device_id(i) for i in range(world_size)
    ]
    return {
        "gpu": current_platform.get_device_name(),
        "capability": None if capability is None else capability.as_version_str(),
        "nvlink_fully_connected": current_platform.is_fully_connected(physical),
    }


def capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """Capture `fn` in one CUDA graph; return its replay and its outputs.

    `fn` has already run eagerly (the workspace and FlashInfer's kernels
    are ready), as vLLM warms up before it captures. Thread-local capture:
    a CUDA call of another thread cannot invalidate it.
    """
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = fn()
    torch.cuda.synchronize()
    return graph.replay, outputs


def synchronize() -> None:
    torch.cuda.synchronize()


def event() -> Any:
    """A timing event, recorded now on the current stream."""
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


class HiSparseGather:
    """HiSparse's swap-in of one layer: `hisparse_gather_compact` from a
    pinned host pool of 656-byte rows into a hot cache on the GPU, on a copy
    stream forked from the compute stream and joined by it, as
    `HiSparseRuntime._stage_this_layer` and `wait_for_staged_swap` do."""

    def __init__(self, pool_mib: int, rows: int, device: torch.device):
        row_bytes = FP8_DS_MLA_ROW_BYTES
        pool_rows = max(rows, pool_mib * MiB // row_bytes)
        # The host pool as the runtime binds it: pinned, (rows, row bytes).
        self.host_cache = torch.empty(
            (pool_rows, row_bytes), dtype=torch.uint8
        ).pin_memory()
        self.hot_cache = torch.empty(
            (rows, row_bytes), dtype=torch.uint8, device=device
        )
        picked = torch.randperm(pool_rows)[:rows].to(torch.int32)
        self.host_rows = picked.view(1, rows).to(device)
        self.hot_rows = torch.arange(rows, dtype=torch.int32, device=device).view(
            1, rows
        )
        self.counts = torch.full((1,), rows, dtype=torch.int32, device=device)
        self.copy_stream = torch.cuda.Stream(device)
        self.ready = torch.cuda.Event()

    def fork(self) -> None:
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            torch.ops._C_cache_ops.hisparse_gather_compact(
                self.host_cache,
                self.hot_cache,
                self.host_rows,
                self.hot_rows,
                self.counts,
            )
            self.ready.record(self.copy_stream)

    def join(self) -> None:
        torch.cuda.current_stream().wait_event(self.ready)


def start_bulk_copies(mib: int, device: torch.device) -> Callable[[], None]:
    """Copy a pinned host buffer to the GPU on a stream of another thread
    until the returned stop(), which waits STOP_SECONDS at most."""
    staging = torch.empty(mib * MiB, dtype=torch.uint8).pin_memory()
    copied = torch.empty_like(staging, device=device)
    stream = torch.cuda.Stream(device)
    stop = threading.Event()

    def copies() -> None:
        torch.cuda.set_device(device)  # the current device is per thread
        with torch.cuda.stream(stream):
            while not stop.is_set():
                copied.copy_(staging, non_blocking=True)
                stream.synchronize()

    thread = threading.Thread(target=copies, daemon=True, name="bulk-copies")
    thread.start()

    def stop_copies() -> None:
        stop.set()
        thread.join(timeout=STOP_SECONDS)

    return stop_copies
