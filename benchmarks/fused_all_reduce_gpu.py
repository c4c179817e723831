# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The part of check_fused_all_reduce.py that only GPUs run.

This project has never run it: no machine of ours has two GPUs. It is kept
to what vLLM itself calls: the CUDA device of a rank, the op's own token
budget for the workspace, the GPU's name and links as vLLM's platform
reports them, CUDA-graph capture and replay, and host-memory traffic made
the way HiSparse and vLLM's UVA offload make it (pinned host memory copied
to the GPU, and read by a kernel through a GPU view of it). Everything
else, the check itself included, lives in fused_all_reduce_rank.py and runs
in the CPU tests. tests/benchmarks/test_check_fused_all_reduce.py checks
every FlashInfer and vLLM name this file reaches against the released
sources.
"""

import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm.model_executor.layers.fused_allreduce_gemma_rms_norm import _max_token_num
from vllm.platforms import current_platform
from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

MiB = 1024 * 1024
# Rows of the host pool a gather kernel reads, as HiSparse reads KV rows.
HOST_ROW_BYTES = 16 * 1024


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
    """Capture `fn` in a CUDA graph; return its replay and its outputs.

    `fn` has already run eagerly (the workspace and FlashInfer's kernels
    are ready), as vLLM warms up before it captures.
    """
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    torch.cuda.synchronize()
    return graph.replay, outputs


def timed(run: Callable[[], None]) -> float:
    """Seconds `run` takes on the GPU; waits for it to finish."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def start_host_traffic(mib: int, device: torch.device) -> Callable[[], None]:
    """Keep host memory busy on other streams until the returned stop().

    One stream copies a pinned host buffer to the GPU; another runs a gather
    kernel that reads rows of a pinned host pool through its GPU view, as
    HiSparse's host gathers do. Returns at once; stop() waits for both.
    """
    rows = max(1, mib * MiB // HOST_ROW_BYTES)
    pool = torch.empty((rows, HOST_ROW_BYTES), dtype=torch.uint8).pin_memory()
    pool_on_gpu = get_accelerator_view_from_cpu_tensor(pool)
    staging = torch.empty((rows, HOST_ROW_BYTES), dtype=torch.uint8).pin_memory()
    copied = torch.empty_like(staging, device=device)
    gathered = torch.empty(
        (rows // 2 + 1, HOST_ROW_BYTES), dtype=torch.uint8, device=device
    )
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    stop = threading.Event()

    def copies() -> None:
        torch.cuda.set_device(device)  # the current device is per thread
        with torch.cuda.stream(streams[0]):
            while not stop.is_set():
                copied.copy_(staging, non_blocking=True)
                streams[0].synchronize()

    def gathers() -> None:
        torch.cuda.set_device(device)
        with torch.cuda.stream(streams[1]):
            while not stop.is_set():
                picked = torch.randint(rows, (gathered.shape[0],), device=device)
                torch.index_select(pool_on_gpu, 0, picked, out=gathered)
                streams[1].synchronize()

    threads = [
        threading.Thread(target=work, daemon=True, name=f"host-traffic-{work.__name__}")
        for work in (copies, gathers)
    ]
    for thread in threads:
        thread.start()

    def stop_traffic() -> None:
        stop.set()
        for thread in threads:
            thread.join()

    return stop_traffic
