# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CUDA device faked below FlashInfer's Python, for its workspace creation.

`FakeCuda(...).install(monkeypatch)` replaces only what needs a GPU, so that
flashinfer-python's own `create_allreduce_fusion_workspace`, its workspaces'
`is_buffer_size_sufficient`, `checkpoint_prepare`, `checkpoint_restore` and
`destroy`, and its probes `is_multicast_supported` and
`is_mnnvl_fabric_supported` run unmodified on CPU over real gloo groups, in
0.7.2.post1 and 0.7.4 alike. What it replaces:

- the cuda-python driver module held by `flashinfer.comm.mnnvl` (`cuda`) and
  by `flashinfer.cuda_utils` (`driver`, for error names): virtual memory,
  allocation handles, multicast objects, device attributes, contexts. Types
  and enums stay cuda-python's own, which work without a driver;
- the runtime: `cudaSetDevice` of the cuda-python runtime module
  SymmDeviceMemory imports, and `flashinfer.comm.trtllm_ar.cudart` (the
  ctypes libcudart wrapper: cudaMalloc, cudaMemset, cudaMemcpy);
- NVML's fabric query as `flashinfer.comm.mnnvl` reads it (`pynvml`);
- `torch.cuda`'s current_device, device_count, set_device and synchronize;
- the kernel loaders `get_trtllm_comm_module` and
  `get_trtllm_mnnvl_comm_module`, cached as FlashInfer's are; the ops that
  creation runs (Lamport initialisation) do nothing;
- NVML's Confidential Computing query, answered "off" through FlashInfer's
  FLASHINFER_CONFIDENTIAL_COMPUTE override;
- `torch.tensor` as seen by `trtllm_ar` and `trtllm_mnnvl_ar` only, which
  put the workspace's pointer table and flags on device="cuda": torch
  refuses that without a driver, so those tensors are made on the host.

Memory is bookkeeping: virtual addresses are integers, memsets and copies do
nothing. Each allocation shared through POSIX file descriptors is a real
memfd (sparse, of the allocation's size), so FlashInfer's fd exchange passes
real descriptors between the rank processes over its AF_UNIX sockets, and an
import checks that it received a fake-cuda memfd and records its size.
FABRIC handles are 64 bytes naming the allocation. Every driver call returns
a CUresult as cuda-python does; a call the real driver would refuse (an
unknown handle, an unmapped range) fails the same way and is recorded in
`driver_errors`, and a call nothing fakes in `unfaked`.

For example, in each rank process of a two-rank gloo `group` (0.7.4):

    fake = FakeCuda(fail_alloc=rank == 1)
    fake.install(monkeypatch)
    comm = LoggingCommBackend(TorchDistBackend(group=group))
    with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        create_allreduce_fusion_workspace(
            backend="mnnvl", world_size=2, rank=rank, max_token_num=128,
            hidden_dim=4096, dtype=torch.bfloat16, comm_backend=comm,
            group=group)
    assert tuple(comm.log) == ALLOC_FAILED_CALLS["0.7.4"]["posix_fd"]
    assert fake.live()["handles"] == 0

`flashinfer_release_path` gives a flashinfer-python release to put first on
sys.path (or PYTHONPATH) in a rank process. `LoggingCommBackend` wraps a
CommBackend to record, or fail, FlashInfer's calls; `COMM_CALLS` and
`ALLOC_FAILED_CALLS` are what each release calls, which
tests/distributed/test_fake_cuda.py checks on real gloo groups.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RELEASES = ("0.7.4", "0.7.2.post1")
CACHE = Path.home() / ".cache" / "vllm-fi-ar-tests"
# The recommended granularity of allocations and multicast objects.
GRANULARITY = 2 << 20
# What FlashInfer's TRT-LLM kernel module runs while creating a workspace.
NO_OP_KERNELS = ("trtllm_lamport_initialize", "trtllm_lamport_initialize_all")
KERNEL_LOADERS = {
    "trtllm": ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
    "mnnvl": ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module"),
}
MEMFD_PREFIX = "fake-cuda:"

# The CommBackend methods FlashInfer calls, in order, on every rank of a
# group on one host or across hosts, by release, backend and handle type
# (POSIX file descriptors, or FABRIC where every rank's device supports it).
# Each allocation of 0.7.4 chooses its handle type over the group (an
# allgather), then makes one attempt: errors of creation, the handles (the fd
# exchange, or an allgather), errors of import. 0.7.2.post1 decides alone and
# only exchanges the handles. mnnvl then shares its multicast object from rank
# 0 (broadcast_fd, or a bcast). trtllm makes three allocations.
_ALLOCATE = {
    "0.7.4": {
        "posix_fd": (
            "allgather",  # choose_mnnvl_handle_type
            *("Get_rank", "Get_size", "allgather"),  # creation errors
            *("Get_rank", "Get_size", "allgather"),  # exchange_fds
            "allgather",  # import errors
        ),
        "fabric": (
            "allgather",  # choose_mnnvl_handle_type
            *("Get_rank", "Get_size", "allgather"),  # creation errors
            "allgather",  # the handles
            "allgather",  # import errors
        ),
    },
    "0.7.2.post1": {
        "posix_fd": ("Get_rank", "Get_size", "allgather"),  # exchange_fds
        "fabric": ("allgather",),  # the handles
    },
}
_SHARE_MULTICAST = {
    "posix_fd": ("Get_rank", "Get_size", "allgather"),  # broadcast_fd
    "fabric": ("bcast",),
}


def _comm_calls(release: str, backend: str, handles: str) -> dict[str, tuple]:
    allocate = _ALLOCATE[release][handles]
    if backend == "trtllm":
        create = allocate * 3 + ("barrier",)
        # A barrier as each allocation unmaps, then one when all have.
        prepare = ("barrier",) * 4
    else:
        create = allocate + _SHARE_MULTICAST[handles] + ("barrier",)
        prepare = ("barrier",) * 2
    return {
        "create": create,
        "checkpoint_prepare": prepare,
        "checkpoint_restore": create,
    }


# COMM_CALLS[release][backend][handles] maps "create" (the creation),
# "checkpoint_prepare" (on the backend of the creation) and
# "checkpoint_restore" (on the backend it is given) to their calls;
# is_buffer_size_sufficient and destroy call none.
COMM_CALLS = {
    release: {
        backend: {h: _comm_calls(release, backend, h) for h in ("posix_fd", "fabric")}
        for backend in ("trtllm", "mnnvl")
    }
    for release in RELEASES
}
# What a creation calls when cuMemCreate fails on one rank of a host. In 0.7.4
# every rank raises after the creation errors' allgather (with FABRIC handles,
# after retrying with file descriptors); in 0.7.2.post1 the failing rank raises
# before any call and the others wait in this last call until the group's
# timeout. The same for either backend: it is their first allocation.
ALLOC_FAILED_CALLS = {
    "0.7.4": {
        "posix_fd": _ALLOCATE["0.7.4"]["posix_fd"][:4],
        "fabric": (
            *_ALLOCATE["0.7.4"]["posix_fd"][:4],
            *("Get_rank", "Get_size", "allgather"),  # the retry with fds
        ),
    },
    "0.7.2.post1": _ALLOCATE["0.7.2.post1"],
}

# Handles and addresses are unique across FakeCuda instances of a process, so
# an object one instance made and another sees (a late destructor) is refused.
_handles = itertools.count(0x1000)
_addresses = itertools.count(1)


class NotFaked(RuntimeError):
    """FlashInfer called something below it that FakeCuda does not fake."""


class InjectedCommError(Exception):
    """Raised by LoggingCommBackend at the call it was told to fail."""


@dataclass
class _Handle:
    kind: str  # "memory" or "multicast"
    size: int
    handle_types: int
    fd: int | None = None  # the memfd, where shared as a file descriptor
    imported: bool = False


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


class _Module:
    """A module's stand-in: `calls` by name (each counted), anything else
    with `prefix` (a CUDA or NVML call) refused, the rest the real module's."""

    def __init__(
        self,
        real: Any,
        calls: dict[str, Callable[..., Any]],
        counter: Counter[str],
        prefix: str | None = None,
        unfaked: list[str] | None = None,
        label: str = "",
    ):
        self._real = real
        self._calls = calls
        self._counter = counter
        self._prefix = prefix
        self._unfaked = unfaked
        self._label = label

    def __getattr__(self, name: str) -> Any:
        if name in self._calls:
            self._counter[self._label + name] += 1
            return self._calls[name]
        if self._prefix is not None and name.startswith(self._prefix):
            assert self._unfaked is not None
            self._unfaked.append(self._label + name)

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise NotFaked(f"fake_cuda does not fake {self._label}{name}")

            return refuse
        return getattr(self._real, name)


class _Kernels:
    """What a fake kernel loader returns: creation's ops do nothing, any
    other (a real all-reduce) is refused."""

    def __init__(self, backend: str, counter: Counter[str]):
        self._backend = backend
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        if name in NO_OP_KERNELS:
            self._counter[f"kernel.{name}"] += 1
            return lambda *args, **kwargs: None
        raise NotFaked(f"{self._backend} kernel {name} needs a GPU")


@dataclass
class FakeCuda:
    """One rank's CUDA device, as FlashInfer's workspace creation sees it.

    Knobs: `multicast` (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED), `fabric`
    (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, with NVML reporting a
    completed fabric in `cluster_uuid`), `fail_alloc` (every cuMemCreate
    fails with CUDA_ERROR_OUT_OF_MEMORY), `load_seconds` and `load_fails`
    (each kernel loader's cold build time, and the backends whose build
    fails), `device` (this process's device index) and `device_count`.

    Records: `kernel_loads` (backends whose loader built, in order; a failed
    build is retried, as functools.cache does not keep exceptions),
    `driver_calls` (calls by name: driver `cu*`, runtime `cuda*`, `nvml*`,
    `torch.cuda.*`, `torch.tensor(device=cuda)`, `kernel.*`), `imports`
    (each imported handle: transport, kind and size), `driver_errors` (calls
    that failed, injected OOMs included) and `unfaked`. `live()` counts what
    is still allocated. Knobs may change after install().
    """

    multicast: bool = True
    fabric: bool = False
    fail_alloc: bool = False
    load_seconds: float = 0.0
    load_fails: set[str] = field(default_factory=set)
    device: int = 0
    device_count: int = 8
    cluster_uuid: bytes = bytes(range(1, 17))
    kernel_loads: list[str] = field(default_factory=list)
    driver_calls: Counter[str] = field(default_factory=Counter)
    imports: list[tuple[str, str, int]] = field(default_factory=list)
    driver_errors: list[str] = field(default_factory=list)
    unfaked: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._handles: dict[int, _Handle] = {}
        self._reserved: dict[int, int] = {}
        self._mapped: dict[int, int] = {}
        self._allocated: dict[int, int] = {}
        self._loaded: dict[str, _Kernels] = {}

    def install(self, patch: Any) -> None:
        """Install into FlashInfer's modules (imported now) with `patch`, a
        pytest.MonkeyPatch, whose undo() removes it."""
        import torch
        from flashinfer import cuda_utils, utils
        from flashinfer.comm import mnnvl, trtllm_ar, trtllm_mnnvl_ar

        driver = _Module(
            _driver(),
            self._driver_calls(),
            self.driver_calls,
            "cu",
            self.unfaked,
        )
        patch.setattr(mnnvl, "cuda", driver)
        patch.setattr(cuda_utils, "driver", driver)
        nvml = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetHandleByIndex": lambda index: ("fake-nvml", index),
            "nvmlDeviceGetGpuFabricInfoV": self._fabric_info,
        }
        patch.setattr(
            mnnvl,
            "pynvml",
            _Module(mnnvl.pynvml, nvml, self.driver_calls, "nvml", self.unfaked),
        )
        # SymmDeviceMemory imports the runtime module when it runs.
        runtime_name = (
            "cuda.cudart" if utils.has_cuda_cudart() else "cuda.bindings.runtime"
        )
        runtime = importlib.import_module(runtime_name)
        success = runtime.cudaError_t.cudaSuccess
        patch.setattr(
            runtime, "cudaSetDevice", self._counted("cudaSetDevice", self._set, success)
        )
        ctypes_cudart = {
            "cudaMalloc": self._cuda_malloc,
            "cudaFree": lambda ptr: self._allocated.pop(_address(ptr), None),
            "cudaMemset": lambda ptr, value, count: None,
            "cudaMemcpy": lambda dst, src, count: None,
            "cudaSetDevice": self._set,
            "cudaDeviceSynchronize": lambda: None,
        }
        patch.setattr(
            trtllm_ar,
            "cudart",
            _Module(None, ctypes_cudart, self.driver_calls, "cuda", self.unfaked),
        )
        for name, fn in {
            "current_device": lambda: self.device,
            "device_count": lambda: self.device_count,
            "set_device": self._set,
            "synchronize": lambda device=None: None,
        }.items():
            patch.setattr(torch.cuda, name, self._counted(f"torch.cuda.{name}", fn))
        host = _Module(torch, {"tensor": self._host_tensor}, Counter())
        for module in (trtllm_ar, trtllm_mnnvl_ar):
            patch.setattr(module, "torch", host)
        for backend, (module_name, loader) in KERNEL_LOADERS.items():
            module = importlib.import_module(module_name)
            patch.setattr(module, loader, self._loader(backend))
        # Creation asks NVML whether the GPU runs Confidential Computing
        # (flashinfer.utils.is_confidential_compute, cached) where
        # torch.cuda.is_available(), which the faked device_count makes true
        # under PYTORCH_NVML_BASED_CUDA_CHECK (vLLM sets it): FlashInfer's own
        # override gives a plain GPU's answer.
        patch.setenv("FLASHINFER_CONFIDENTIAL_COMPUTE", "0")

    def live(self) -> dict[str, int]:
        """What is still allocated: handles (this process's and imported),
        mapped ranges, reserved address ranges, cuMemAlloc/cudaMalloc
        buffers, and the handles' open memfds."""
        return {
            "handles": len(self._handles),
            "mapped": len(self._mapped),
            "reserved": len(self._reserved),
            "allocated": len(self._allocated),
            "memfds": sum(h.fd is not None for h in self._handles.values()),
        }

    # The device's state.

    def _set(self, device: Any) -> None:
        self.device = device if isinstance(device, int) else device.index

    def _counted(self, name: str, fn: Callable[..., Any], status: Any = None):
        def call(*args: Any, **kwargs: Any) -> Any:
            self.driver_calls[name] += 1
            result = fn(*args, **kwargs)
            return result if status is None else (status,)

        return call

    def _host_tensor(self, data: Any, *args: Any, device: Any = None, **kw: Any):
        import torch

        if device is not None and torch.device(device).type == "cuda":
            self.driver_calls["torch.tensor(device=cuda)"] += 1
            device = "cpu"
        return torch.tensor(data, *args, device=device, **kw)

    def _fabric_info(self, handle: Any, info: Any) -> int:
        import pynvml

        info = getattr(info, "_obj", info)  # ctypes.byref(struct)
        if self.fabric:
            info.state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
            ctypes.memmove(info.clusterUuid, self.cluster_uuid, 16)
        else:
            info.state = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
        info.status = pynvml.NVML_SUCCESS
        return pynvml.NVML_SUCCESS

    def _loader(self, backend: str) -> Callable[[], _Kernels]:
        """A kernel loader that builds once per process, as FlashInfer's."""

        def load() -> _Kernels:
            if backend not in self._loaded:
                time.sleep(self.load_seconds)
                if backend in self.load_fails:
                    raise RuntimeError(f"injected {backend} kernel build failure")
                self._loaded[backend] = _Kernels(backend, self.driver_calls)
                self.kernel_loads.append(backend)
            return self._loaded[backend]

        return load

    def _cuda_malloc(self, size: int) -> ctypes.c_void_p:
        ptr = self._new_address()
        self._allocated[ptr] = size
        return ctypes.c_void_p(ptr)

    @staticmethod
    def _new_address() -> int:
        # 1 TiB apart, so no two ranges of a process overlap.
        return next(_addresses) << 40

    # The driver: each call returns (CUresult, *values), as cuda-python's.

    def _driver_calls(self) -> dict[str, Callable[..., Any]]:
        cuda = _driver()
        ok = cuda.CUresult.CUDA_SUCCESS
        calls: dict[str, Callable[..., Any]] = {
            "cuGetErrorName": lambda err: (ok, err.name.encode()),
            "cuDeviceGet": self._device_get,
            "cuDeviceGetCount": lambda: (ok, self.device_count),
            "cuDeviceGetAttribute": self._attribute,
            "cuDevicePrimaryCtxRetain": lambda dev: (
                ok,
                cuda.CUcontext(0x100 + int(dev)),
            ),
            "cuCtxSetCurrent": self._set_context,
            "cuCtxGetCurrent": lambda: (ok, cuda.CUcontext(0x100 + self.device)),
            "cuCtxGetDevice": lambda: (ok, cuda.CUdevice(self.device)),
            "cuCtxSynchronize": lambda: (ok,),
            "cuMemGetAllocationGranularity": lambda *a, **kw: (ok, GRANULARITY),
            "cuMulticastGetGranularity": lambda *a, **kw: (ok, GRANULARITY),
            "cuMemCreate": self._create,
            "cuMulticastCreate": self._multicast_create,
            "cuMemExportToShareableHandle": self._export,
            "cuMemImportFromShareableHandle": self._import,
            "cuMemRelease": self._release,
            "cuMemAddressReserve": self._reserve,
            "cuMemAddressFree": self._free_address,
            "cuMemMap": self._map,
            "cuMemUnmap": self._unmap,
            "cuMemSetAccess": lambda ptr, size, descs, count: (ok,),
            "cuMulticastAddDevice": self._multicast_op,
            "cuMulticastBindMem": self._multicast_op,
            "cuMulticastUnbind": self._multicast_op,
            "cuMemAlloc": self._mem_alloc,
            "cuMemFree": self._mem_free,
        }
        for name in ("cuMemsetD8", "cuMemsetD16", "cuMemsetD32"):
            calls[name] = lambda ptr, value, count: (ok,)
        for name in ("cuMemcpyHtoD", "cuMemcpyDtoH"):
            calls[name] = lambda dst, src, count: (ok,)
        return {name: self._checked(name, fn) for name, fn in calls.items()}

    def _checked(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if result[0].value:
                self.driver_errors.append(f"{name}: {result[0].name}")
            return result

        return call

    @staticmethod
    def _error(name: str) -> tuple[Any, None]:
        return getattr(_driver().CUresult, name), None

    def _device_get(self, index: int) -> tuple[Any, Any]:
        if not 0 <= index < self.device_count:
            return self._error("CUDA_ERROR_INVALID_DEVICE")
        return _driver().CUresult.CUDA_SUCCESS, _driver().CUdevice(index)

    def _attribute(self, attribute: Any, device: int) -> tuple[Any, Any]:
        cuda = _driver()
        values = {
            cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: (
                self.multicast
            ),
            cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: (
                self.fabric
            ),
        }
        if attribute not in values:
            self.unfaked.append(f"cuDeviceGetAttribute({attribute.name})")
            return self._error("CUDA_ERROR_NOT_SUPPORTED")
        return cuda.CUresult.CUDA_SUCCESS, int(values[attribute])

    def _set_context(self, context: Any) -> tuple[Any]:
        self.device = int(context) - 0x100
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _new_handle(self, kind: str, size: int, handle_types: Any) -> Any:
        cuda = _driver()
        if size <= 0 or size % GRANULARITY:
            return self._error("CUDA_ERROR_INVALID_VALUE")
        handle = next(_handles)
        self._handles[handle] = _Handle(kind, size, int(handle_types))
        posix = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if int(handle_types) & int(posix):
            fd = os.memfd_create(f"{MEMFD_PREFIX}{kind}")
            os.ftruncate(fd, size)  # sparse: no memory is used
            self._handles[handle].fd = fd
        return cuda.CUresult.CUDA_SUCCESS, cuda.CUmemGenericAllocationHandle(handle)

    def _create(self, size: int, prop: Any, flags: int) -> tuple[Any, Any]:
        if self.fail_alloc:
            return self._error("CUDA_ERROR_OUT_OF_MEMORY")
        return self._new_handle("memory", size, prop.requestedHandleTypes)

    def _multicast_create(self, prop: Any) -> tuple[Any, Any]:
        if not self.multicast:
            return self._error("CUDA_ERROR_NOT_SUPPORTED")
        return self._new_handle("multicast", prop.size, prop.handleTypes)

    def _export(self, handle: Any, handle_type: Any, flags: int) -> tuple[Any, Any]:
        cuda = _driver()
        entry = self._handles.get(int(handle))
        if entry is None or not entry.handle_types & int(handle_type):
            return self._error("CUDA_ERROR_INVALID_VALUE")
        ok = cuda.CUresult.CUDA_SUCCESS
        if handle_type == cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            fabric = cuda.CUmemFabricHandle()
            name = (
                f"{MEMFD_PREFIX}{entry.kind}:{entry.size}:{os.getpid()}:{int(handle)}"
            )
            fabric.data = name.encode().ljust(64, b"\0")
            return ok, fabric
        assert entry.fd is not None
        return ok, os.dup(entry.fd)  # the caller owns, and closes, the fd

    def _import(self, shareable: Any, handle_type: Any) -> tuple[Any, Any]:
        cuda = _driver()
        types = cuda.CUmemAllocationHandleType
        fd = None
        if handle_type == types.CU_MEM_HANDLE_TYPE_FABRIC:
            data = bytes(getattr(shareable, "data", shareable)).rstrip(b"\0")
            fields = data.decode(errors="replace").split(":")
            if not data.startswith(MEMFD_PREFIX.encode()) or len(fields) != 5:
                return self._error("CUDA_ERROR_INVALID_VALUE")
            kind, size, transport = fields[1], int(fields[2]), "fabric"
        else:
            try:
                target = os.readlink(f"/proc/self/fd/{int(shareable)}")
            except OSError:
                return self._error("CUDA_ERROR_INVALID_VALUE")
            if not target.startswith(f"/memfd:{MEMFD_PREFIX}"):
                return self._error("CUDA_ERROR_INVALID_VALUE")
            kind = target.removeprefix(f"/memfd:{MEMFD_PREFIX}").split(" ")[0]
            size, transport = os.fstat(int(shareable)).st_size, "posix_fd"
            fd = os.dup(int(shareable))  # the driver's own reference
        self.imports.append((transport, kind, size))
        handle = next(_handles)
        self._handles[handle] = _Handle(kind, size, int(handle_type), fd, True)
        return cuda.CUresult.CUDA_SUCCESS, cuda.CUmemGenericAllocationHandle(handle)

    def _release(self, handle: Any) -> tuple[Any]:
        entry = self._handles.pop(int(handle), None)
        if entry is None:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        if entry.fd is not None:
            os.close(entry.fd)
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _reserve(self, size: int, alignment: int, addr: int, flags: int):
        ptr = self._new_address()
        self._reserved[ptr] = size
        return _driver().CUresult.CUDA_SUCCESS, _driver().CUdeviceptr(ptr)

    def _free_address(self, ptr: Any, size: int) -> tuple[Any]:
        if self._reserved.get(_address(ptr)) != size:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        del self._reserved[_address(ptr)]
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _within_reservation(self, ptr: int, size: int) -> bool:
        return any(
            start <= ptr and ptr + size <= start + length
            for start, length in self._reserved.items()
        )

    def _map(self, ptr: Any, size: int, offset: int, handle: Any, flags: int):
        ptr = _address(ptr)
        entry = self._handles.get(int(handle))
        if (
            entry is None
            or size > entry.size
            or ptr in self._mapped
            or not self._within_reservation(ptr, size)
        ):
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        self._mapped[ptr] = size
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _unmap(self, ptr: Any, size: int) -> tuple[Any]:
        if self._mapped.get(_address(ptr)) != size:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        del self._mapped[_address(ptr)]
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _multicast_op(self, handle: Any, *args: Any) -> tuple[Any]:
        entry = self._handles.get(int(handle))
        if entry is None or entry.kind != "multicast":
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _mem_alloc(self, size: int) -> tuple[Any, Any]:
        ptr = self._new_address()
        self._allocated[ptr] = size
        return _driver().CUresult.CUDA_SUCCESS, _driver().CUdeviceptr(ptr)

    def _mem_free(self, ptr: Any) -> tuple[Any]:
        if self._allocated.pop(_address(ptr), None) is None:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        return (_driver().CUresult.CUDA_SUCCESS,)


def _address(ptr: Any) -> int:
    """A device pointer as an integer: a CUdeviceptr, c_void_p or int."""
    value = getattr(ptr, "value", ptr)
    return int(value) if value is not None else 0


def open_memfds() -> list[str]:
    """This process's open descriptors of fake-cuda memfds (allocations and
    their exported or received copies), as /proc names them."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"/memfd:{MEMFD_PREFIX}"):
                found.append(target)
    return found


class LoggingCommBackend:
    """A FlashInfer CommBackend around another, logging each method called
    into `log` (shared with the backends Split makes) and raising
    InjectedCommError instead of making the `fail_at`-th call (1-based,
    counted over `log`)."""

    def __init__(
        self, inner: Any, log: list[str] | None = None, fail_at: int | None = None
    ):
        self.inner = inner
        self.log = [] if log is None else log
        self.fail_at = fail_at

    def _call(self, name: str, *args: Any) -> Any:
        self.log.append(name)
        if len(self.log) == self.fail_at:
            raise InjectedCommError(f"injected failure of call {self.fail_at}: {name}")
        return getattr(self.inner, name)(*args)

    def Get_rank(self) -> int:
        return self._call("Get_rank")

    def Get_size(self) -> int:
        return self._call("Get_size")

    def allgather(self, data: Any) -> Sequence[Any]:
        return self._call("allgather", data)

    def bcast(self, data: Any, root: int) -> Any:
        return self._call("bcast", data, root)

    def barrier(self) -> None:
        self._call("barrier")

    def Split(self, color: int, key: int) -> LoggingCommBackend:
        return LoggingCommBackend(
            self._call("Split", color, key), self.log, self.fail_at
        )


def flashinfer_release_path(version: str) -> Path | None:
    """A directory holding flashinfer-python `version`'s unpacked wheel (its
    `flashinfer` package and dist-info), to go first on sys.path or
    PYTHONPATH; None for the installed release.

    Downloaded once with pip into ~/.cache/vllm-fi-ar-tests/, unpacked into a
    temporary directory there and renamed into place, so concurrent test
    runs never see half a release.
    """
    if version == importlib.metadata.version("flashinfer-python"):
        return None
    target = CACHE / f"flashinfer-python-{version}"
    if (target / "flashinfer" / "__init__.py").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=".unpack-") as tmp:
        wheels = Path(tmp, "wheel")
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += ["--only-binary=:all:", f"flashinfer-python=={version}"]
        got = subprocess.run(
            [*command, "-d", str(wheels)], capture_output=True, text=True
        )
        found = sorted(wheels.glob("flashinfer_python-*.whl"))
        if got.returncode or not found:
            why = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise RuntimeError(
                f"cannot download flashinfer-python=={version} ({why}): run "
                f"`{' '.join(command)} -d DIR` where the package index is "
                f"reachable and unzip the wheel into {target}"
            )
        unpacked = Path(tmp, "release")
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(unpacked)
        try:
            os.replace(unpacked, target)
        except OSError:  # another run put it there first
            if not (target / "flashinfer" / "__init__.py").exists():
                raise
            shutil.rmtree(unpacked, ignore_errors=True)
    return target
