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
  by `flashinfer.cuda_utils` (`driver`, for error names); types and enums
  stay cuda-python's own, which work without a driver;
- the runtime: `cudaSetDevice` of the cuda-python runtime module
  SymmDeviceMemory imports, and `flashinfer.comm.trtllm_ar.cudart` (the
  ctypes libcudart wrapper);
- NVML's fabric query as `flashinfer.comm.mnnvl` reads it (`pynvml`);
- `torch.cuda`'s current_device, device_count, set_device and synchronize;
- torch symmetric memory as `flashinfer.comm.torch_symmetric_memory` uses it
  (the Confidential Computing path: `empty`, and `rendezvous`, which
  exchanges the buffers' addresses on the group, a collective as torch's is);
- the kernel loaders `get_trtllm_comm_module` and
  `get_trtllm_mnnvl_comm_module`, cached as FlashInfer's are; the ops that
  creation runs (Lamport initialisation) do nothing;
- NVML's Confidential Computing query, through FlashInfer's own override
  (FLASHINFER_CONFIDENTIAL_COMPUTE);
- `torch.tensor` as seen by `trtllm_ar` and `trtllm_mnnvl_ar` only, whose
  device="cuda" tensors are made on the host.

Memory is bookkeeping: virtual addresses are integers, memsets and copies do
nothing. An allocation shared through POSIX file descriptors, and every
multicast object, is a real memfd (sparse), so FlashInfer's fd exchange
passes real descriptors between the rank processes over its AF_UNIX sockets.
FABRIC handles are 64 bytes naming the allocation (and a multicast object's
memfd, which an importer opens through /proc). A multicast object's memfd
holds its team: the device count it was created for and each device added,
by node (the st_dev of /dev/shm, private per simulated node) and device id.
As CUDA documents, mapping a multicast object or binding memory to it waits
until every device of the team was added: the call waits (`blocked` records
it) and, after `hold_s`, raises `Held`, a BaseException that neither
FlashInfer nor the patch catches, as the test's stand-in for killing the
process.

Every driver and runtime call returns what cuda-python's does. A call the
real driver would refuse (an unknown handle, an unmapped range, another
device's memory, a device added twice) fails the same way and is recorded in
`driver_errors`; a call nothing fakes in `unfaked`. `fail` fails any call by
name: its n-th call on this rank (0: every one), with the CUresult a real
driver returns for it (`FAILURES`).

`flashinfer_release_path` gives a flashinfer-python release to put first on
sys.path (or PYTHONPATH) in a rank process.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
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
from collections.abc import Callable
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
# The CUresult a real driver returns where each call fails for want of memory,
# permission (FABRIC handles without an IMEX channel) or a device; any other
# call fails with CUDA_ERROR_UNKNOWN. The runtime's are cudaError_t names.
_ALLOCATING = ("cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemAlloc")
_ALLOCATING += ("cuMulticastCreate", "cuMulticastBindMem", "cuDevicePrimaryCtxRetain")
FAILURES = {
    **dict.fromkeys(_ALLOCATING, "CUDA_ERROR_OUT_OF_MEMORY"),
    "cuMemExportToShareableHandle": "CUDA_ERROR_NOT_PERMITTED",
    "cuMemImportFromShareableHandle": "CUDA_ERROR_NOT_PERMITTED",
    "cuMulticastAddDevice": "CUDA_ERROR_INVALID_DEVICE",
    "cudaSetDevice": "cudaErrorInvalidDevice",
    "cudaMalloc": "cudaErrorMemoryAllocation",
}
_TEAM = 4096  # a multicast memfd's first bytes: its device count, then each device

# Handles and addresses are unique across FakeCuda instances of a process, so
# an object one instance made and another sees (a late destructor) is refused.
_handles = itertools.count(0x1000)
_addresses = itertools.count(1)


class NotFaked(RuntimeError):
    """FlashInfer called something below it that FakeCuda does not fake."""


class Held(BaseException):
    """Ends a call blocked in the driver after `hold_s`: nothing in FlashInfer
    or the patch catches it, as nothing can release a blocked driver call."""


@dataclass
class _Handle:
    kind: str  # "memory" or "multicast"
    size: int
    handle_types: int
    fd: int | None = None  # the memfd: shared as a file descriptor, or a team
    imported: bool = False


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _node() -> int:
    """This simulated node: its own /dev/shm."""
    return os.stat("/dev/shm").st_dev


class _Module:
    """A module's stand-in: `calls` by name, anything else with `prefix` (a
    CUDA or NVML call) refused, the rest the real module's."""

    def __init__(self, real: Any, calls: dict, prefix: str = "", unfaked=None):
        self._real, self._calls = real, calls
        self._prefix, self._unfaked = prefix, unfaked

    def __getattr__(self, name: str) -> Any:
        if name in self._calls:
            return self._calls[name]
        if self._prefix and name.startswith(self._prefix):
            assert self._unfaked is not None
            self._unfaked.append(name)

            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise NotFaked(f"fake_cuda does not fake {name}")

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
    completed fabric in `cluster_uuid`), `imex` (whether FABRIC handles can be
    made: without an IMEX channel, creating one is not permitted), `fail`
    (see the module), `hold_s` (how long a blocked call waits before `Held`),
    `confidential` (the GPU runs Confidential Computing), `load_seconds` and
    `load_fails` (each kernel loader's cold build time, and the backends whose
    build fails), `device` (this process's device) and `device_count`.

    Records: `kernel_loads` (backends whose loader built, in order; a failed
    build is retried, as functools.cache does not keep exceptions),
    `driver_calls` (calls by name: driver `cu*`, runtime `cuda*`, `nvml*`,
    `torch.cuda.*`, `symm_mem.*`, `torch.tensor(device=cuda)`, `kernel.*`),
    `trace` (driver and runtime calls in order), `imports` (each imported
    handle: transport, kind and size), `driver_errors` (calls that failed,
    injected ones included), `blocked` and `unfaked`. `live()` counts what is
    still allocated. Knobs may change after install().
    """

    multicast: bool = True
    fabric: bool = False
    imex: bool = True
    fail: dict[str, int] = field(default_factory=dict)
    hold_s: float = float("inf")
    confidential: bool = False
    load_seconds: float = 0.0
    load_fails: set[str] = field(default_factory=set)
    device: int = 0
    device_count: int = 8
    cluster_uuid: bytes = bytes(range(1, 17))
    kernel_loads: list[str] = field(default_factory=list)
    driver_calls: Counter[str] = field(default_factory=Counter)
    trace: list[str] = field(default_factory=list)
    imports: list[tuple[str, str, int]] = field(default_factory=list)
    driver_errors: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
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
        from flashinfer.comm import (
            mnnvl,
            torch_symmetric_memory,
            trtllm_ar,
            trtllm_mnnvl_ar,
        )

        driver = _Module(_driver(), self._driver_calls(), "cu", self.unfaked)
        patch.setattr(mnnvl, "cuda", driver)
        patch.setattr(cuda_utils, "driver", driver)
        nvml = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetHandleByIndex": lambda index: ("fake-nvml", index),
            "nvmlDeviceGetGpuFabricInfoV": self._fabric_info,
        }
        nvml = {name: self._counted(name, fn) for name, fn in nvml.items()}
        patch.setattr(
            mnnvl, "pynvml", _Module(mnnvl.pynvml, nvml, "nvml", self.unfaked)
        )
        # SymmDeviceMemory imports the runtime module when it runs.
        runtime_name = (
            "cuda.cudart" if utils.has_cuda_cudart() else "cuda.bindings.runtime"
        )
        runtime = self._runtime = importlib.import_module(runtime_name)

        def set_device(device: int) -> tuple[Any]:
            self._set(device)
            return (runtime.cudaError_t.cudaSuccess,)

        patch.setattr(runtime, "cudaSetDevice", self._call("cudaSetDevice", set_device))
        cudart = {
            "cudaMalloc": lambda size: ctypes.c_void_p(int(self._mem_alloc(size)[1])),
            "cudaFree": lambda ptr: self._allocated.pop(_address(ptr), None),
            "cudaMemset": lambda ptr, value, count: None,
            "cudaMemcpy": lambda dst, src, count: None,
            "cudaSetDevice": self._set,
            "cudaDeviceSynchronize": lambda: None,
        }
        cudart = {name: self._call(name, fn, True) for name, fn in cudart.items()}
        patch.setattr(trtllm_ar, "cudart", _Module(None, cudart, "cuda", self.unfaked))
        for name, fn in {
            "current_device": lambda: self.device,
            "device_count": lambda: self.device_count,
            "set_device": self._set,
            "synchronize": lambda device=None: None,
        }.items():
            patch.setattr(torch.cuda, name, self._counted(f"torch.cuda.{name}", fn))
        host = _Module(torch, {"tensor": self._host_tensor})
        for module in (trtllm_ar, trtllm_mnnvl_ar):
            patch.setattr(module, "torch", host)
        symm_mem = {"empty": self._symm_empty, "rendezvous": self._rendezvous}
        symm_mem = {n: self._counted(f"symm_mem.{n}", f) for n, f in symm_mem.items()}
        patch.setattr(torch_symmetric_memory, "symm_mem", _Module(None, symm_mem))
        for backend, (module_name, loader) in KERNEL_LOADERS.items():
            module = importlib.import_module(module_name)
            patch.setattr(module, loader, self._loader(backend))
        # Creation asks NVML whether the GPU runs Confidential Computing
        # (flashinfer.utils.is_confidential_compute, cached) where
        # torch.cuda.is_available(), which the faked device_count makes true
        # under PYTORCH_NVML_BASED_CUDA_CHECK (vLLM sets it).
        patch.setenv("FLASHINFER_CONFIDENTIAL_COMPUTE", str(int(self.confidential)))
        utils.is_confidential_compute.cache_clear()

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

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.driver_calls[name] += 1
            return fn(*args, **kwargs)

        return call

    def _call(self, name: str, fn: Callable, raises: bool = False) -> Callable:
        """A driver or runtime call: counted, traced, failed where `fail` says
        so, and its error recorded; `raises` for libcudart's ctypes wrapper
        (flashinfer.comm.cuda_ipc), which raises an error it returns."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.driver_calls[name] += 1
            self.trace.append(name)
            if self.fail.get(name) in (0, self.driver_calls[name]):
                result: Any = self._failure(name)
            else:
                result = fn(*args, **kwargs)
            status = result[0] if isinstance(result, tuple) else None
            if status is not None and status.value:
                self.driver_errors.append(f"{name}: {status.name}")
                if raises:
                    raise RuntimeError(f"CUDART error: {status.name}")
            return result

        return call

    def _failure(self, name: str) -> tuple[Any, ...]:
        if name.startswith("cuda"):
            errors = self._runtime.cudaError_t  # the module install() patched
            return (getattr(errors, FAILURES.get(name, "cudaErrorUnknown")),)
        return self._error(FAILURES.get(name, "CUDA_ERROR_UNKNOWN"))

    def _host_tensor(self, data: Any, *args: Any, device: Any = None, **kw: Any):
        import torch

        if device is not None and torch.device(device).type == "cuda":
            self.driver_calls["torch.tensor(device=cuda)"] += 1
            device = "cpu"
        return torch.tensor(data, *args, device=device, **kw)

    def _symm_empty(self, numel: int, dtype: Any, device: Any = None) -> Any:
        import torch

        tensor = torch.empty(numel, dtype=dtype)
        self._allocated[tensor.data_ptr()] = tensor.nbytes
        return tensor

    def _rendezvous(self, tensor: Any, group: Any) -> Any:
        """Every rank's buffer address, exchanged on the group as torch's
        rendezvous exchanges its IPC handles."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group) if isinstance(group, str) else group
        addresses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(addresses, tensor.data_ptr(), group=group)

        class Buffer:
            def __init__(self, address: int):
                self.data_ptr = lambda: address

        class Handle:
            def get_buffer(self, peer: int, *args: Any, **kwargs: Any) -> Buffer:
                return Buffer(addresses[peer])

        return Handle()

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
            "cuMemSetAccess": self._set_access,
            "cuMulticastAddDevice": self._add_device,
            "cuMulticastBindMem": self._bind,
            "cuMulticastUnbind": lambda handle, *a: (self._multicast(handle)[0],),
            "cuMemAlloc": self._mem_alloc,
            "cuMemFree": self._mem_free,
        }
        for name in ("cuMemsetD8", "cuMemsetD16", "cuMemsetD32"):
            calls[name] = lambda ptr, value, count: (ok,)
        for name in ("cuMemcpyHtoD", "cuMemcpyDtoH"):
            calls[name] = lambda dst, src, count: (ok,)
        return {name: self._call(name, fn) for name, fn in calls.items()}

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
        types = cuda.CUmemAllocationHandleType
        if size <= 0 or size % GRANULARITY:
            return self._error("CUDA_ERROR_INVALID_VALUE")
        if int(handle_types) & int(types.CU_MEM_HANDLE_TYPE_FABRIC) and not self.imex:
            return self._error("CUDA_ERROR_NOT_PERMITTED")
        handle = next(_handles)
        entry = self._handles[handle] = _Handle(kind, size, int(handle_types))
        posix = int(types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        if int(handle_types) & posix or kind == "multicast":
            entry.fd = os.memfd_create(f"{MEMFD_PREFIX}{kind}")
            os.ftruncate(entry.fd, max(size, _TEAM))  # sparse: no memory is used
        return cuda.CUresult.CUDA_SUCCESS, cuda.CUmemGenericAllocationHandle(handle)

    def _create(self, size: int, prop: Any, flags: int) -> tuple[Any, Any]:
        if prop.location.id != self.device:
            return self._error("CUDA_ERROR_INVALID_DEVICE")
        return self._new_handle("memory", size, prop.requestedHandleTypes)

    def _multicast_create(self, prop: Any) -> tuple[Any, Any]:
        if not self.multicast:
            return self._error("CUDA_ERROR_NOT_SUPPORTED")
        result = self._new_handle("multicast", prop.size, prop.handleTypes)
        if not result[0].value:
            fd = self._handles[int(result[1])].fd
            os.pwrite(fd, int(prop.numDevices).to_bytes(8, "little"), 0)
        return result

    def _export(self, handle: Any, handle_type: Any, flags: int) -> tuple[Any, Any]:
        cuda = _driver()
        entry = self._handles.get(int(handle))
        if entry is None or not entry.handle_types & int(handle_type):
            return self._error("CUDA_ERROR_INVALID_VALUE")
        ok = cuda.CUresult.CUDA_SUCCESS
        if handle_type == cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            fabric = cuda.CUmemFabricHandle()
            name = f"{MEMFD_PREFIX}{entry.kind}:{entry.size}:{os.getpid()}:{entry.fd}"
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
            if kind == "multicast":  # its team, in the exporter's memfd
                fd = os.open(f"/proc/{fields[3]}/fd/{fields[4]}", os.O_RDWR)
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
        if entry.kind == "multicast":
            self._wait_for_team("cuMemMap", entry)
        self._mapped[ptr] = size
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _unmap(self, ptr: Any, size: int) -> tuple[Any]:
        if self._mapped.get(_address(ptr)) != size:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        del self._mapped[_address(ptr)]
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _set_access(self, ptr: Any, size: int, descs: Any, count: int):
        start = _address(ptr)
        mapped = any(s <= start < s + n for s, n in self._mapped.items())
        if not mapped or any(d.location.id != self.device for d in descs[:count]):
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        return (_driver().CUresult.CUDA_SUCCESS,)

    def _multicast(self, handle: Any) -> tuple[Any, _Handle | None]:
        entry = self._handles.get(int(handle))
        if entry is None or entry.kind != "multicast":
            return self._error("CUDA_ERROR_INVALID_VALUE")
        return _driver().CUresult.CUDA_SUCCESS, entry

    def _team(self, entry: _Handle) -> tuple[int, set[bytes]]:
        """The device count a multicast object was made for, and those added."""
        assert entry.fd is not None
        data = os.pread(entry.fd, _TEAM, 0)
        added = {data[i : i + 16] for i in range(8, _TEAM - 15, 16)}
        return int.from_bytes(data[:8], "little"), added - {bytes(16)}

    def _add_device(self, handle: Any, device: Any) -> tuple[Any]:
        status, entry = self._multicast(handle)
        if entry is None:
            return (status,)
        me = _node().to_bytes(8, "little") + (int(device) + 1).to_bytes(8, "little")
        with _locked(entry.fd):
            count, added = self._team(entry)
            if int(device) != self.device or me in added or len(added) >= count:
                return (self._error("CUDA_ERROR_INVALID_DEVICE")[0],)
            os.pwrite(entry.fd, me, 8 + 16 * len(added))
        return (status,)

    def _wait_for_team(self, name: str, entry: _Handle) -> None:
        """CUDA: mapping a multicast object, or binding memory to it, waits
        until every device of its team was added."""
        count, added = self._team(entry)
        if len(added) >= count:
            return
        self.blocked.append(name)
        until = time.monotonic() + self.hold_s
        while len(self._team(entry)[1]) < count:
            if time.monotonic() > until:
                raise Held(f"{name} waited {self.hold_s} s for the multicast team")
            time.sleep(0.005)

    def _bind(self, handle: Any, offset: int, memory: Any, *args: Any):
        status, entry = self._multicast(handle)
        if entry is None or int(memory) not in self._handles:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        self._wait_for_team("cuMulticastBindMem", entry)
        return (status,)

    def _mem_alloc(self, size: int) -> tuple[Any, Any]:
        ptr = self._new_address()
        self._allocated[ptr] = size
        return _driver().CUresult.CUDA_SUCCESS, _driver().CUdeviceptr(ptr)

    def _mem_free(self, ptr: Any) -> tuple[Any]:
        if self._allocated.pop(_address(ptr), None) is None:
            return (self._error("CUDA_ERROR_INVALID_VALUE")[0],)
        return (_driver().CUresult.CUDA_SUCCESS,)


@contextlib.contextmanager
def _locked(fd: int) -> Any:
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


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
