# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the FlashInfer all-reduce tests: GPU fakes and rank groups.

Only what needs a GPU is faked: FlashInfer's workspace constructor (at the
`flashinfer_comm` boundary) and the facts a CUDA device would report
(`is_cuda`, its compute capability, hybrid KV cache support, and the fusion
size table, which lives in a module that loads CUDA ops). Configs are real
`VllmConfig` objects and process groups are real gloo groups on loopback.

Run as a script, this file is one node of a simulated cluster: it starts the
node's ranks, each of which runs a list of cases and writes one JSON line per
case.
"""

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve()
MODULE = "vllm.distributed.device_communicators.flashinfer_all_reduce"
# The decision, the agreement and the collective steps: the backend module.
BACKEND_MODULE = f"{MODULE}_backend"
ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
HIDDEN_DIM = 4096
# A flashinfer-python release without the fixes of 0.7.4, for the cases
# where its kernels load, and the case key that installs it.
UNFIXED_FLASHINFER = "0.7.2.post1"
UNFIXED: dict[str, Any] = {"flashinfer": UNFIXED_FLASHINFER}
MAX_TOKENS = 128
# How a rank ends when ranks create workspaces with different arguments,
# which on GPUs hangs the group (see FakeWorkspaceFactory).
RANK_WOULD_HANG = 75
# Stand-in for PassConfig.default_fi_allreduce_fusion_max_size_mb(), which
# imports the CUDA-op fusion passes and so cannot run without a GPU.
FUSION_MAX_SIZE_MB = {2: 64, 4: 64, 8: 64}
# The rank groups' bound on a step (vLLM's cpu_distributed_timeout_seconds),
# well within their hard timeouts: a step that never completes fails its
# case, with the step's own words, rather than the whole group.
STEP_BOUND_S = 60


class FakeWorkspace:
    """What `create_allreduce_fusion_workspace` returns, minus the GPU."""

    def __init__(self, backend: str, multicast: bool, log: list[str], tokens: int):
        self.backend = backend
        self.mc_ptr = 1 if multicast else 0
        if backend == "trtllm":  # what vLLM reads of FlashInfer's trtllm workspace
            self.metadata = {"max_token_num": tokens}
        self.destroyed = False
        self._log = log

    def destroy(self) -> None:
        self.destroyed = True
        self._log.append(f"destroy:{self.backend}")

    def is_buffer_size_sufficient(self, **kwargs: Any) -> bool:
        return True

    def checkpoint_prepare(self) -> None:
        self._log.append(f"checkpoint_prepare:{self.backend}")

    def checkpoint_restore(self, comm_backend: Any) -> None:
        self._log.append(f"checkpoint_restore:{self.backend}")


@dataclass
class FakeWorkspaceFactory:
    """Fake `flashinfer_comm.create_allreduce_fusion_workspace`.

    Like FlashInfer's, creation is a collective: ranks exchange their
    arguments through the comm backend they are given (FlashInfer exchanges
    memory handles through it), or the group without one (stock vLLM). On
    GPUs, ranks that disagree would block in mismatched rendezvous; here the
    rank ends at once with exit status RANK_WOULD_HANG, so the group fails in
    seconds rather than at its timeout. Through a comm backend it makes two
    exchanges, as FlashInfer makes several: the arguments, then a barrier.
    `fail` lists backends whose creation fails on this rank after them,
    `fail_once` those that fail on their first creation only; `late_seconds`
    is how long this rank takes before the exchange; `multicast` is what an
    mnnvl workspace reports; `returns` is what it returns instead of a new
    workspace. `sizes` records each creation's backend and token count.
    """

    fail: set[str] = field(default_factory=set)
    fail_once: set[str] = field(default_factory=set)
    late_seconds: float = 0.0
    multicast: bool = True
    returns: Any = None
    log: list[str] = field(default_factory=list)
    sizes: list[tuple[str, int]] = field(default_factory=list)

    def __call__(
        self,
        *,
        backend: str,
        group: Any = None,
        comm_backend: Any = None,
        **kwargs: Any,
    ):
        import importlib

        import torch.distributed as dist

        self.log.append(f"create:{backend}")
        tokens = kwargs["max_token_num"]
        self.sizes.append((backend, tokens))
        time.sleep(self.late_seconds)
        if backend == "trtllm":
            # FlashInfer's trtllm creation loads its kernel module (a JIT
            # build on a cold cache) in the middle of its collectives.
            trtllm_ar = importlib.import_module("flashinfer.comm.trtllm_ar")
            trtllm_ar.get_trtllm_comm_module()
        if group is not None and dist.get_world_size(group) > 1:
            mine = (backend, tokens, kwargs.get("hidden_dim"))
            if comm_backend is not None:
                everyone = list(comm_backend.allgather(mine))
                comm_backend.barrier()
            else:
                everyone = [None] * dist.get_world_size(group)
                dist.all_gather_object(everyone, mine, group=group)
            if any(theirs != mine for theirs in everyone):
                print(f"workspace arguments differ across ranks: {everyone}")
                sys.stdout.flush()
                os._exit(RANK_WOULD_HANG)
        once = backend in self.fail_once and self.attempts.count(backend) == 1
        if backend in self.fail or once:
            raise RuntimeError(f"injected {backend} workspace failure")
        return self.returns or FakeWorkspace(backend, self.multicast, self.log, tokens)

    @property
    def attempts(self) -> list[str]:
        return [e.split(":", 1)[1] for e in self.log if e.startswith("create:")]


def workspace_args(group: Any, world_size: int = 2) -> dict[str, Any]:
    """Arguments for get_fi_ar_workspace / get_fi_ar_quant_workspace."""
    import torch

    return dict(
        world_size=world_size,
        rank=0,
        max_token_num=MAX_TOKENS,
        hidden_dim=HIDDEN_DIM,
        dtype=torch.bfloat16,
        group=group,
    )


def pin_gpu(monkeypatch: Any, capability: int | None = 100, nvlink: bool = True):
    """Make the platform report a CUDA device of `capability` (e.g. 100),
    which NVML finds NVLink-connected to the group's others or not."""
    from vllm.config.compilation import PassConfig
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cap = None if capability is None else DeviceCapability(*divmod(capability, 10))
    # Patched on the class: Platform's classmethods (has_device_capability)
    # call each other through `cls`. Each of our modules holds the platform it
    # imported; a faked torch.cuda in an earlier test may have re-resolved it.
    import importlib

    platforms = {type(current_platform)}
    for name in (MODULE, BACKEND_MODULE):
        platforms.add(type(importlib.import_module(name).current_platform))
    for platform in platforms:
        monkeypatch.setattr(platform, "is_cuda", lambda self: True)
        monkeypatch.setattr(
            platform,
            "get_device_capability",
            classmethod(lambda cls, device_id=0: cap),
        )
        fully_connected = classmethod(lambda cls, ids: nvlink)
        monkeypatch.setattr(platform, "is_fully_connected", fully_connected, False)
    monkeypatch.setattr(
        type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True)
    )
    monkeypatch.setattr(
        PassConfig,
        "default_fi_allreduce_fusion_max_size_mb",
        staticmethod(lambda: FUSION_MAX_SIZE_MB),
    )


@dataclass
class FakeFlashInferDevice:
    """FlashInfer's device-side steps before a creation, faked at its
    boundary: the NVLink fabric probe (`is_mnnvl_fabric_supported` in
    flashinfer.comm.mnnvl), the kernel-module loaders each backend calls
    (which build kernels, JIT, on a cold cache) and the CUDA device index.
    `load_fails` lists the backends whose kernels fail to load.
    """

    fabric: bool = True
    load_fails: set[str] = field(default_factory=set)
    probes: int = 0
    loads: list[str] = field(default_factory=list)

    def install(self, patch: Any) -> None:
        import importlib

        import torch

        loaders = {
            "trtllm": ("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
            "mnnvl": (
                "flashinfer.comm.trtllm_mnnvl_ar",
                "get_trtllm_mnnvl_comm_module",
            ),
        }
        for backend, (module, loader) in loaders.items():
            patch.setattr(
                importlib.import_module(module), loader, self._loader(backend)
            )
        patch.setattr(
            importlib.import_module("flashinfer.comm.mnnvl"),
            "is_mnnvl_fabric_supported",
            self._probe,
        )
        patch.setattr(torch.cuda, "current_device", lambda: 0)

    def _probe(self, device_idx: int) -> bool:
        self.probes += 1
        return self.fabric

    def _loader(self, backend: str) -> Any:
        """A loader that builds once, as FlashInfer's (functools.cache)."""

        def load() -> object:
            if backend not in self.loads:
                if backend in self.load_fails:
                    raise RuntimeError(f"injected {backend} kernel build failure")
                self.loads.append(backend)
            return object()

        return load


def reset_log_once() -> None:
    """Forget vLLM's *_once log messages, which last the process lifetime."""
    from vllm import logger as vllm_logger

    for once in ("_print_info_once", "_print_warning_once"):
        getattr(vllm_logger, once).cache_clear()


def build_config(hisparse: str = "off"):
    """A real VllmConfig with HiSparse turned on the way `hisparse` says."""
    from vllm.config import (
        DeviceConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )

    hisparse_connector = {
        "kv_connector": "HiSparseConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 4},
    }
    kwargs: dict[str, Any] = {}
    if hisparse == "connector":
        kwargs["kv_transfer_config"] = KVTransferConfig(**hisparse_connector)
    elif hisparse == "multiconnector":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "connectors": [
                    hisparse_connector,
                    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                ]
            },
        )
    elif hisparse != "off":
        raise ValueError(f"unknown HiSparse mode {hisparse!r}")
    # VllmConfig refuses HiSparse on a platform without a HiSparse runtime:
    # answer as CudaPlatform.get_hisparse_backend_cls does (vllm/platforms/
    # cuda.py, which does not import without libcuda). It imports the
    # connector's modules, which load CUDA ops where is_cuda (pin_gpu) is true.
    from vllm.platforms import current_platform

    runtime = "vllm.v1.hisparse.backend.CUDAHiSparseBackend"
    platform = type(current_platform)
    with (
        mock.patch.object(platform, "get_hisparse_backend_cls", return_value=runtime),
        mock.patch.object(platform, "is_cuda", lambda self: False),
    ):
        return VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            # HiSparse needs the hybrid KV cache manager, which GPUs enable.
            scheduler_config=SchedulerConfig.default_factory(
                disable_hybrid_kv_cache_manager=False
            ),
            **kwargs,
        )


def write_synthetic_flashinfer(
    root: Path,
    *,
    flashinfer: str | None = None,
    jit_cache: str | None = None,
    providers: list[dict[str, Any]] | None = None,
) -> Path:
    """Install a flashinfer-python and a flashinfer-jit-cache of these
    versions under `root`, for `root` to go first on sys.path or PYTHONPATH.

    Each is what the real one leaves for the readers that matter: a
    dist-info (importlib.metadata), and for the jit-cache its
    `flashinfer_jit_cache` module with the `__version__` and the
    `get_jit_cache_providers()` that FlashInfer's loader reads
    (`_get_aot_providers` in flashinfer/jit/env.py): one object per entry
    of `providers`, with its `distribution`, `version`, `modules` and
    `cuda_architectures` (none by default). No kernels.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name, release in (
        ("flashinfer_python", flashinfer),
        ("flashinfer_jit_cache", jit_cache),
    ):
        if release is None:
            continue
        info = root / f"{name}-{release}.dist-info"
        info.mkdir()
        distribution = name.replace("_", "-")
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {release}\n"
        )
    if jit_cache is not None:
        package = root / "flashinfer_jit_cache"
        package.mkdir()
        (package / "__init__.py").write_text(
            "from types import SimpleNamespace\n\n"
            f"__version__ = {jit_cache!r}\n\n\n"
            "def get_jit_cache_providers():\n"
            "    return tuple(\n"
            f"        SimpleNamespace(**provider) for provider in {providers or []!r}\n"
            "    )\n"
        )
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def namespaces_unavailable() -> str | None:
    """Why nodes cannot be simulated here, or None when they can."""
    if shutil.which("unshare") is None:
        return "util-linux `unshare` is not installed"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot create mount namespaces ({probe.stderr.strip()}); needs root"
    return None


class GroupHang(AssertionError):
    """The rank group did not finish in time (a collective hung)."""


class RanksDiverged(AssertionError):
    """Ranks created workspaces with different arguments (see RANK_WOULD_HANG)."""


def run_group(
    cases: list[dict[str, Any]],
    *,
    nnodes: int = 1,
    ranks_per_node: int = 2,
    timeout: float = 240,
    vllm_groups: bool = False,
    release: str | None = None,
) -> list[dict[str, dict[str, Any]]]:
    """Run `cases` on a gloo group; return, per rank, each case's result.

    Each node's ranks share a mount namespace with a private /dev/shm, which
    is how vLLM tells nodes apart. The whole group is killed on `timeout`.
    With `vllm_groups`, the world is vLLM's (init_distributed_environment,
    each rank's local rank its rank on its node) and a case's `tp_pp` gives
    vLLM's model-parallel groups (initialize_model_parallel). `release` is
    the flashinfer-python whose Python the ranks import (fake_cuda's
    flashinfer_release_path); by default the installed one.
    """
    world_size = nnodes * ranks_per_node
    with tempfile.TemporaryDirectory(prefix="fi-ar-group-") as tmp:
        spec = Path(tmp, "spec.json")
        spec.write_text(
            json.dumps(
                {
                    "world_size": world_size,
                    "port": free_port(),
                    "ranks_per_node": ranks_per_node,
                    "vllm_groups": vllm_groups,
                    "cases": cases,
                    "out": tmp,
                }
            )
        )
        env = dict(os.environ)
        if release is not None:
            from fake_cuda import flashinfer_release_path

            path = flashinfer_release_path(release)
            if path is not None:
                env["PYTHONPATH"] = os.pathsep.join(
                    [str(path), env.get("PYTHONPATH", "")]
                )
        nodes = []
        for node in range(nnodes):
            ranks = range(node * ranks_per_node, (node + 1) * ranks_per_node)
            cmd = [sys.executable, str(HERE), str(spec), *map(str, ranks)]
            if nnodes > 1:
                cmd = [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
                    "node",
                    *cmd,
                ]
            nodes.append(subprocess.Popen(cmd, start_new_session=True, env=env))
        _wait_all(nodes, timeout)
        results = []
        for rank in range(world_size):
            path = Path(tmp, f"rank{rank}.jsonl")
            lines = path.read_text().splitlines() if path.exists() else []
            results.append({r["case"]: r for r in map(json.loads, lines)})
        return results


def every_rank(results, case: str) -> list[dict[str, Any]]:
    per_rank = [r[case] for r in results]
    for r in per_rank:
        assert "error" not in r or r["error"].startswith("ValueError"), r.get(
            "traceback"
        )
    return per_rank


def _first_failure(procs: list[subprocess.Popen], timeout: float) -> int:
    """Wait for `procs`; the exit status of the first that fails, else 0.

    Returns as soon as one fails, as its peers may then wait for it forever.
    Raises subprocess.TimeoutExpired if they are still running on `timeout`.
    """
    deadline = time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code]
        if failed:
            return failed[0]
        if None not in codes:
            return 0
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(procs[0].args, timeout)
        time.sleep(0.1)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for `procs`, each started in a session of its own, then kill
    those sessions with everything still in them, however the wait ended."""
    try:
        code = _first_failure(procs, timeout)
    except subprocess.TimeoutExpired as e:
        raise GroupHang(f"rank group still running after {timeout}s") from e
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code == RANK_WOULD_HANG:
        raise RanksDiverged(
            "ranks created workspaces with different arguments, "
            "which hangs the group on GPUs"
        )
    if code:
        raise AssertionError(f"node process exited with {code}")


def _run_node(spec_path: str, ranks: list[str]) -> int:
    """Start this node's ranks; they share this process's mount namespace.

    The node process is killed with its ranks (they share its session) once
    the group ends.
    """
    procs = [
        subprocess.Popen([sys.executable, str(HERE), "--rank", r, spec_path])
        for r in ranks
    ]
    return _first_failure(procs, timeout=float("inf"))


class GroupCounter:
    """Counts vLLM's node probes (each one a collective) and the process
    groups made (making a gloo group is a rendezvous of its ranks too) while
    installed."""

    def __init__(self) -> None:
        self.node_probes = 0
        self.groups = 0

    def install(self, patch: Any) -> None:
        import torch.distributed as dist

        from vllm.distributed import parallel_state

        probe, new_group = parallel_state.in_the_same_node_as, dist.new_group
        patch.setattr(parallel_state, "in_the_same_node_as", self._counting(probe))
        patch.setattr(dist, "new_group", self._counting(new_group, "groups"))

    def _counting(self, fn: Any, counter: str = "node_probes") -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)
            return fn(*args, **kwargs)

        return counted


class StoreCounter:
    """Counts the requests the patch's steps make on the group's store: every
    method called on a PrefixStore made while installed (the creation's)."""

    def __init__(self) -> None:
        self.requests = 0

    def install(self, patch: Any) -> None:
        import torch.distributed as dist

        real = dist.PrefixStore
        counter = self

        class Counting:
            def __init__(self, *args: Any) -> None:
                self._store = real(*args)

            def __getattr__(self, name: str) -> Any:
                method = getattr(self._store, name)

                def counted(*args: Any, **kwargs: Any) -> Any:
                    counter.requests += 1
                    return method(*args, **kwargs)

                return counted

        patch.setattr(dist, "PrefixStore", Counting)


class _LogCollector(logging.Handler):
    """Keeps vLLM's log lines (vLLM only configures logging in its CLI)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _import_from_the_tree() -> None:
    """In a child process: the replaced modules come from this tree, as in
    the test run that started it (tests/tree_imports.py)."""
    sys.path.insert(0, str(HERE.parents[1]))
    import tree_imports

    tree_imports.install()


def _run_rank(rank: int, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _import_from_the_tree()

    import torch.distributed as dist

    logging.getLogger("vllm").setLevel(logging.INFO)

    if spec["vllm_groups"]:
        from vllm.distributed import init_distributed_environment

        init_distributed_environment(
            world_size=spec["world_size"],
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
            local_rank=rank % spec["ranks_per_node"],
            backend="gloo",
        )
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{spec['port']}",
            rank=rank,
            world_size=spec["world_size"],
        )
    out = Path(spec["out"], f"rank{rank}.jsonl")
    for case in spec["cases"]:
        # Each rank its own device, numbered on its node.
        case = {**case, "device": rank % spec["ranks_per_node"]}
        result = _run_case(rank, case, Path(spec["out"]))
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")


@dataclass
class CudaTensorStandIn:
    """What FlashInferAllReduce.should_use_fi_ar reads of a GPU tensor."""

    shape: tuple[int, int]
    dtype: Any
    is_cuda: bool = True

    def is_contiguous(self) -> bool:
        return True

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:

        return self.shape[0] * self.shape[1] * self.dtype.itemsize


def _run_case(rank: int, case: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Acquire workspaces the way a worker does, recording what happened.

    Case keys: name, env, hisparse, capability and nvlink (see pin_gpu),
    multicast, fail, fail_once and late_seconds (see FakeWorkspaceFactory),
    fabric and load_fails (see FakeFlashInferDevice), cuda (FlashInfer's own
    creation on fake_cuda's device, with these FakeCuda knobs, instead of the
    fake constructor), checkpoint (sleep mode's checkpoints after),
    reacquire (destroy, then acquire again outside the config), dtype (the
    workspaces'), world_group_after (then make a world-wide group, with this
    timeout), tuned ([capability, TP size, nodes, MB], a row added to vLLM's
    tuned mnnvl sizes), first (see _acquire), tp_pp ([TP, PP] sizes of
    vLLM's groups, see run_group) and flashinfer (the flashinfer-python
    release installed, faked as write_synthetic_flashinfer does; by default
    the real one); `per_rank` maps a rank to overrides of any of them. `tmp`
    is the group's folder, removed with it.
    Each case gets a new gloo group, as a new engine would, so per-group
    state starts cold. The result counts node probes, process groups made
    and store requests, and times the acquisition.
    """
    import importlib
    import time

    import pytest
    import torch
    import torch.distributed as dist

    from vllm.config import set_current_vllm_config

    fi_ar = importlib.import_module(MODULE)
    case = {**case, **case.get("per_rank", {}).get(str(rank), {})}
    patch = pytest.MonkeyPatch()
    for name, value in case.get("env", {}).items():
        patch.setenv(name, value)
    factory = FakeWorkspaceFactory(
        fail=set(case.get("fail", [])),
        fail_once=set(case.get("fail_once", [])),
        late_seconds=case.get("late_seconds", 0.0),
        multicast=case.get("multicast", True),
    )
    device = FakeFlashInferDevice(
        fabric=case.get("fabric", True), load_fails=set(case.get("load_fails", []))
    )
    result: dict[str, Any] = {"case": case["name"], "rank": rank}
    messages = _LogCollector()
    reset_log_once()
    logging.getLogger("vllm").addHandler(messages)
    try:
        group = _case_group(case)
        pin_gpu(patch, case.get("capability", 100), case.get("nvlink", True))
        if "cuda" in case:
            knobs = {"device": case["device"], **case["cuda"]}
            _install_cuda(patch, knobs, fi_ar, factory, result)
        else:
            device.install(patch)
            patch.setattr(
                fi_ar.flashinfer_comm, "create_allreduce_fusion_workspace", factory
            )
        if "flashinfer" in case:
            site = tmp / f"site-{rank}-{case['name']}"
            write_synthetic_flashinfer(site, flashinfer=case["flashinfer"])
            patch.syspath_prepend(str(site))
        if "tuned" in case:
            *row, size_mb = case["tuned"]
            patch.setitem(fi_ar.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB, tuple(row), size_mb)
        config = build_config(case.get("hisparse", "off"))
        config.parallel_config.cpu_distributed_timeout_seconds = STEP_BOUND_S
        args = dict(
            world_size=dist.get_world_size(group),
            rank=dist.get_rank(group),
            max_token_num=MAX_TOKENS,
            hidden_dim=HIDDEN_DIM,
            dtype=getattr(torch, case.get("dtype", "bfloat16")),
            group=group,
        )
        counter, store = GroupCounter(), StoreCounter()
        counter.install(patch)
        store.install(patch)
        start = time.perf_counter()
        try:
            with set_current_vllm_config(config):
                _acquire(fi_ar, case.get("first"), args, result, device.loads)
        finally:
            result["seconds"] = time.perf_counter() - start
            result["store_requests"] = store.requests
        if case.get("checkpoint"):
            # Sleep mode, as CudaCommunicator calls it.
            try:
                fi_ar.checkpoint_prepare_fi_ar_workspaces(group, skip_unsupported=True)
                fi_ar.checkpoint_restore_fi_ar_workspaces(group, skip_unsupported=True)
                result["checkpoint"] = "ok"
            except Exception as e:
                result["checkpoint"] = f"{type(e).__name__}: {e}"
        if case.get("reacquire"):
            # As after a recompile or sleep/wake: destroyed, then acquired
            # again with no vLLM config current.
            fi_ar.destroy_fi_ar_workspace()
            again = fi_ar.FlashInferAllReduce(group=group, device="cpu")
            result["reacquired"] = {
                "standalone_disabled": again.disabled,
                "standalone_ready": not again.disabled
                and again._ensure_workspace(HIDDEN_DIM, torch.bfloat16),
                "quant": getattr(
                    fi_ar.get_fi_ar_quant_workspace(**args), "backend", None
                ),
                "workspace": getattr(
                    fi_ar.get_fi_ar_workspace(**args), "backend", None
                ),
            }
        result["node_probes"] = counter.node_probes
        result["groups"] = counter.groups
        if "world_group_after" in case:
            # Any later world-wide group (elastic EP, a re-initialisation)
            # forms only if every process made the same number of groups.
            world = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=case["world_group_after"])
            )
            ones = torch.ones(1)
            dist.all_reduce(ones, group=world)
            result["world_group"] = int(ones.item())
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        result["log"] = factory.log
        result["sizes"] = factory.sizes
        result["fabric_probes"] = device.probes
        result.setdefault("kernel_loads", device.loads)
        result["messages"] = messages.lines
        logging.getLogger("vllm").removeHandler(messages)
        with contextlib.suppress(Exception):
            fi_ar.destroy_fi_ar_workspace()
        patch.undo()
        if "tp_pp" in case:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
    return result


def _install_cuda(
    patch: Any, knobs: dict[str, Any], fi_ar: Any, factory: Any, result: Any
) -> None:
    """FlashInfer's own creation, CUDA faked below it (fake_cuda.FakeCuda with
    `knobs`); its calls recorded in `factory`'s log and sizes as the
    constructor-level fake records them."""
    from fake_cuda import FakeCuda

    cuda = FakeCuda(**knobs)
    cuda.install(patch)
    result["kernel_loads"] = cuda.kernel_loads
    result["driver_calls"] = cuda.driver_calls
    create = fi_ar.flashinfer_comm.create_allreduce_fusion_workspace

    def recorded(**kwargs: Any) -> Any:
        factory.log.append(f"create:{kwargs['backend']}")
        factory.sizes.append((kwargs["backend"], kwargs["max_token_num"]))
        return create(**kwargs)

    patch.setattr(fi_ar.flashinfer_comm, "create_allreduce_fusion_workspace", recorded)


def _case_group(case: dict[str, Any]) -> Any:
    """This rank's TP group for `case`: vLLM's, or a gloo group of all ranks."""
    import torch.distributed as dist

    if "tp_pp" in case:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import initialize_model_parallel
        from vllm.distributed.parallel_state import get_tp_group

        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
            initialize_model_parallel(*case["tp_pp"])
        return get_tp_group().cpu_group
    return dist.new_group(backend="gloo")


def _acquire(
    fi_ar: Any,
    first: str | None,
    args: dict[str, Any],
    result: dict[str, Any],
    kernel_loads: list[str],
) -> None:
    """What a worker does: the standalone all-reduce, then the fusion pass's
    workspace and quant workspace. `first`: "standalone", the standalone
    all-reduce's first call creates the workspace, before the fusion pass;
    "fusion", the fusion pass's call is the group's first into the module
    (the standalone all-reduce is built after it)."""
    group = args["group"]

    def build_standalone() -> Any:
        standalone = fi_ar.FlashInferAllReduce(group=group, device="cpu")
        result["standalone_disabled"] = standalone.disabled
        result["constructor_loads"] = list(kernel_loads)
        return standalone

    if first != "fusion":
        standalone = build_standalone()
    if first == "standalone":
        one_token = CudaTensorStandIn((1, HIDDEN_DIM), args["dtype"])
        result["standalone_first"] = standalone.should_use_fi_ar(one_token)
    ws = fi_ar.get_fi_ar_workspace(**args)
    quant = fi_ar.get_fi_ar_quant_workspace(**args)
    if first == "fusion":
        standalone = build_standalone()
    result["resolved"] = fi_ar._resolve_fi_ar_backend(group)
    result["workspace"] = None if ws is None else ws.backend
    result["quant"] = None if quant is None else quant.backend
    result["shared"] = ws is not None and ws is quant
    result["workspace_tokens"] = getattr(ws, "metadata", {}).get("max_token_num")
    if not standalone.disabled:
        result["standalone_ready"] = standalone._ensure_workspace(
            HIDDEN_DIM, args["dtype"]
        )
        result["standalone_tokens"] = standalone.max_num_tokens


def run_reinit(cycles: int, *, timeout: float = 120) -> dict[str, Any]:
    """Create and destroy the distributed state `cycles` times in one process.

    In a child process of its own, as repeated `LLM()` creation in one
    process does, so the test run's own world is untouched; it is killed
    with its gloo threads on `timeout`.
    """
    with tempfile.TemporaryDirectory(prefix="fi-ar-reinit-") as tmp:
        out = Path(tmp, "reinit.json")
        cmd = [sys.executable, str(HERE), "--reinit", str(cycles), str(out)]
        _wait_all([subprocess.Popen(cmd, start_new_session=True)], timeout)
        return json.loads(out.read_text())


def _reinit_cycles(cycles: int, out_path: str) -> None:
    """Each cycle, in one world: a TP-like group, its workspaces, then
    vLLM's teardown of the model-parallel state: destroy the workspace, then
    the group. Records whether each cycle's group object was freed, and how
    many process groups, threads and file descriptors (gloo's are per group)
    the process holds.
    """
    import gc
    import importlib
    import weakref

    _import_from_the_tree()

    import pytest
    import torch.distributed as dist

    from vllm.config import set_current_vllm_config

    fi_ar = importlib.import_module(MODULE)
    patch = pytest.MonkeyPatch()
    pin_gpu(patch, 100)
    FakeFlashInferDevice().install(patch)
    patch.setattr(
        fi_ar.flashinfer_comm,
        "create_allreduce_fusion_workspace",
        FakeWorkspaceFactory(),
    )
    groups = []
    held = []
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    for _ in range(cycles):
        group = dist.new_group(backend="gloo")
        with set_current_vllm_config(build_config("connector")):
            fi_ar.get_fi_ar_workspace(**workspace_args(group, world_size=1))
            fi_ar.get_fi_ar_quant_workspace(**workspace_args(group, world_size=1))
        fi_ar.destroy_fi_ar_workspace()
        dist.destroy_process_group(group)
        groups.append(weakref.ref(group))
        del group
        gc.collect()
        held.append(
            {
                "process_groups": len(dist.distributed_c10d._world.pg_map),
                "threads": len(os.listdir("/proc/self/task")),
                "fds": len(os.listdir("/proc/self/fd")),
            }
        )
    Path(out_path).write_text(
        json.dumps({"alive": [g() is not None for g in groups], "held": held})
    )


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--reinit", type=int, metavar="CYCLES")
    parser.add_argument("spec")
    parser.add_argument("ranks", nargs="*")
    args = parser.parse_args()
    if args.reinit is not None:
        _reinit_cycles(args.reinit, args.spec)
        return 0
    if args.rank is None:
        return _run_node(args.spec, args.ranks)
    _run_rank(args.rank, args.spec)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
