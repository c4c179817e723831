# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's own workspace creation, on fake_cuda's device, on real gloo
groups: what it calls of the comm backend, and how it fails.

The production-path tests (test_flashinfer_all_reduce_flashinfer.py) fake
CUDA with fake_cuda instead of faking FlashInfer's constructor, so this
proves the fake is enough for FlashInfer's Python in flashinfer-python 0.7.4
(installed) and 0.7.2.post1 (downloaded, see flashinfer_release_path), and
pins what the patch's steps rely on: the comm backend calls of each release
and backend (COMM_CALLS), what each rank sees when an allocation fails on
one rank or the device has no multicast, that a comm backend call that
raises (a step's exchange once its rank left) propagates, and what is left
behind; and, in process, the fake's failure rule and multicast team.

Run as a script, this file is one rank: it runs the cases of its spec and
writes one JSON line per case.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import RELEASES, FakeCuda, open_memfds
from fi_ar_utils import _wait_all, free_port, namespaces_unavailable

HERE = Path(__file__).resolve()
BACKENDS = ("trtllm", "mnnvl")
MAX_TOKENS = 128
HIDDEN_DIM = 4096
# A gloo group's timeout where a rank is expected to wait for a peer that
# left: how long the waiting rank takes to give up.
HANG_S = 2
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


class InjectedCommError(Exception):
    """Raised by LoggingCommBackend at the call it was told to fail."""


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


PHASES = (
    "create",
    "is_buffer_size_sufficient",
    "checkpoint_prepare",
    "checkpoint_restore",
    "destroy",
)


class RankGroup:
    """Two ranks of a gloo group on loopback running `cases`, with `release`
    first on their PYTHONPATH, started at once so that groups run side by
    side; results() waits for them.

    With two nodes, each rank is a node of its own: a mount and UTS
    namespace with its own /dev/shm, temporary directory (FlashInfer's fd
    exchange sockets live there) and host name, which is how FlashInfer
    tells hosts apart.
    """

    def __init__(self, release: str, cases: list[dict[str, Any]], nodes: int = 1):
        from fake_cuda import flashinfer_release_path

        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        path = flashinfer_release_path(release)
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(path), env.get("PYTHONPATH")])
            )
        self.tmp = tempfile.mkdtemp(prefix="fake-cuda-group-")
        spec = Path(self.tmp, "spec.json")
        spec.write_text(
            json.dumps(
                {
                    "release": release,
                    "port": free_port(),
                    "ranks_per_node": 2 // nodes,
                    "cases": cases,
                    "out": self.tmp,
                }
            )
        )
        self.procs = []
        for rank in range(2):
            cmd = [sys.executable, str(HERE), str(spec), str(rank)]
            rank_env = env
            if nodes > 1:
                node = 'mount -t tmpfs tmpfs /dev/shm && hostname "$0" && exec "$@"'
                cmd = [
                    *("unshare", "--mount", "--uts", "--propagation", "private"),
                    *("sh", "-c", node, f"fake-node-{rank}", *cmd),
                ]
                rank_env = {**env, "TMPDIR": "/dev/shm"}
            proc = subprocess.Popen(cmd, env=rank_env, start_new_session=True)
            self.procs.append(proc)

    def results(self, timeout: float = 150) -> list[dict[str, dict[str, Any]]]:
        """Each rank's results by case name, once both ranks have exited;
        both are killed, with anything they started, on `timeout`."""
        try:
            _wait_all(self.procs, timeout)
            results = []
            for rank in range(2):
                lines = Path(self.tmp, f"rank{rank}.jsonl").read_text().splitlines()
                results.append({r["case"]: r for r in map(json.loads, lines)})
            return results
        finally:
            self.close()

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _rank_main(spec_path: str, rank: int) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=2,
    )
    import flashinfer

    assert flashinfer.__version__ == spec["release"], flashinfer.__file__
    import flashinfer.comm  # noqa: F401

    # What is loaded stays: each case's gc.collect() then only scans its own.
    gc.freeze()
    out = Path(spec["out"], f"rank{rank}.jsonl")
    for case in spec["cases"]:
        result = _run_case(rank, {**case, "ranks_per_node": spec["ranks_per_node"]})
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    # Leave together: a rank that exits early closes its connections, which
    # would end a peer's wait in a case before its group's timeout.
    dist.barrier()
    sys.stdout.flush()
    # Skip the teardown: groups whose peer left may block in their destructor.
    os._exit(0)


def _held() -> dict[str, int]:
    """What this process holds that an fd exchange or an allocation may
    leave behind: fake-cuda memfds, AF_UNIX sockets (gloo's are TCP),
    threads (the exchange's accept loop) and exchange directories."""
    with open("/proc/net/unix") as f:
        unix = {line.split()[6] for line in list(f)[1:]}
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            sockets += target.startswith("socket:[") and target[8:-1] in unix
    pattern = os.path.join(tempfile.gettempdir(), f"cuda_fd_*_{os.getpid()}_*")
    return {
        "memfds": len(open_memfds()),
        "unix_sockets": sockets,
        "threads": threading.active_count(),
        "exchange_dirs": len(glob.glob(pattern)),
    }


_shared: list[Any] = []


def _group(timeout: float | None) -> Any:
    """The case's gloo group: one of its own with `timeout`, where a rank
    may be left waiting in it, else one shared by such cases (they leave no
    collective half done: a comm backend call that raises is not made)."""
    import torch.distributed as dist

    if timeout is None and _shared:
        return _shared[0]
    # Every rank is here before the group forms: a short timeout would also
    # bound the rendezvous of a rank whose peer still waits in a previous one.
    dist.barrier()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout or 60))
    if timeout is None:
        _shared.append(group)
    return group


def _run_case(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    """Create a workspace the way vLLM does, then use it and destroy it,
    recording the comm backend calls of each phase.

    Case keys: name, backend, fake (FakeCuda's knobs), per_rank (a rank's
    own knobs), checkpoint (prepare and restore it), fail_at (the comm
    backend's call that raises, on every rank) and timeout (the group's, in
    seconds).
    """
    import torch
    from flashinfer.comm import create_allreduce_fusion_workspace
    from flashinfer.comm.mnnvl import TorchDistBackend

    knobs = {**case.get("fake", {}), **case.get("per_rank", {}).get(str(rank), {})}
    knobs["load_fails"] = set(knobs.get("load_fails", ()))
    group = _group(case.get("timeout"))
    fake = FakeCuda(device=rank % case["ranks_per_node"], **knobs)
    patch = pytest.MonkeyPatch()
    fake.install(patch)
    log: list[str] = []
    fail_at = case.get("fail_at")
    result: dict[str, Any] = {"case": case["name"], "rank": rank, "calls": {}}
    before = _held()
    start = time.monotonic()
    phase = "create"
    try:
        mark = len(log)
        try:
            ws = create_allreduce_fusion_workspace(
                backend=case["backend"],
                world_size=2,
                rank=rank,
                max_token_num=MAX_TOKENS,
                hidden_dim=HIDDEN_DIM,
                dtype=torch.bfloat16,
                comm_backend=LoggingCommBackend(
                    TorchDistBackend(group=group), log, fail_at
                ),
                group=group,
            )
        finally:
            result["calls"]["create"] = log[mark:]
        result["mc_ptr"] = bool(getattr(ws, "mc_ptr", 0))
        mark = len(log)
        result["sufficient"] = [
            ws.is_buffer_size_sufficient(
                tp_size=2,
                num_tokens=tokens,
                hidden_dim=HIDDEN_DIM,
                dtype=torch.bfloat16,
            )
            for tokens in (MAX_TOKENS, 4 * MAX_TOKENS)
        ]
        result["calls"]["is_buffer_size_sufficient"] = log[mark:]
        if case.get("checkpoint"):
            for phase in ("checkpoint_prepare", "checkpoint_restore"):
                mark = len(log)
                if phase == "checkpoint_prepare":
                    ws.checkpoint_prepare()
                    result["live_prepared"] = fake.live()
                else:
                    restore = LoggingCommBackend(TorchDistBackend(group=group), log)
                    ws.checkpoint_restore(restore)
                result["calls"][phase] = log[mark:]
        phase = "destroy"
        mark = len(log)
        ws.destroy()
        result["calls"]["destroy"] = log[mark:]
        del ws
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_phase"] = phase
        result["traceback"] = traceback.format_exc()
    result["seconds"] = round(time.monotonic() - start, 3)
    gc.collect()
    after = _held()
    result["held"] = {k: after[k] - before[k] for k in after}
    result["live"] = fake.live()
    result["imports"] = fake.imports
    result["driver_calls"] = dict(fake.driver_calls)
    result["driver_errors"] = fake.driver_errors
    result["unfaked"] = fake.unfaked
    result["kernel_loads"] = fake.kernel_loads
    patch.undo()
    return result


def _allocation(release: str) -> tuple[str, ...]:
    create = COMM_CALLS[release]["mnnvl"]["posix_fd"]["create"]
    return create[: -len(("Get_rank", "Get_size", "allgather", "barrier"))]


def _cases(release: str, nodes: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for backend in BACKENDS:
        base = {"backend": backend}
        fabric = {**base, "fake": {"fabric": True}}
        cases.append({"name": f"{backend}-fabric", "checkpoint": True, **fabric})
        if nodes > 1:
            if release == "0.7.4":  # 0.7.2.post1 waits 30 s in fd_exchange
                cases.append({"name": backend, **base})
            continue
        cases.append({"name": backend, "checkpoint": True, **base})
        cases.append(
            {"name": f"{backend}-no-multicast", **base, "fake": {"multicast": False}}
        )
        for knobs, suffix in ((base, ""), (fabric, "-fabric")):
            cases.append(
                {
                    "name": f"{backend}-alloc-fails-on-rank-1{suffix}",
                    **knobs,
                    "per_rank": {"1": {"fail": {"cuMemCreate": 0}}},
                    "timeout": HANG_S,
                }
            )
        create = COMM_CALLS[release][backend]["posix_fd"]["create"]
        failing = list(range(1, len(create) + 1))
        if backend == "trtllm":  # its three allocations call alike
            failing = [*range(1, len(_allocation(release)) + 1), len(create)]
        for k in failing:
            cases.append(
                {
                    "name": f"{backend}-call-{k}-fails-everywhere",
                    **base,
                    "fail_at": k,
                }
            )
    return cases


@pytest.fixture(scope="module")
def groups():
    """Every release's rank groups, one node and two, started together the
    first time one is needed: results(release, nodes)."""
    started: dict[tuple[str, int], RankGroup] = {}
    done: dict[tuple[str, int], list[dict[str, dict[str, Any]]]] = {}
    layouts = [1] if namespaces_unavailable() else [1, 2]

    def results(release: str, nodes: int = 1) -> list[dict[str, dict[str, Any]]]:
        if nodes not in layouts:
            pytest.skip(namespaces_unavailable() or "")
        if not started:
            for each in RELEASES:
                for n in layouts:
                    started[each, n] = RankGroup(each, _cases(each, n), n)
        if (release, nodes) not in done:
            done[release, nodes] = started[release, nodes].results()
        return done[release, nodes]

    yield results
    for group in started.values():
        group.close()


def _clean(result: dict[str, Any]) -> None:
    """Nothing below FlashInfer went unfaked or failed unasked."""
    assert result["unfaked"] == [], result
    injected = "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"
    assert {e for e in result["driver_errors"]} <= {injected}, result


def _created(result: dict[str, Any], release: str, backend: str, handles: str):
    """A creation that worked, with checkpointing, called what COMM_CALLS
    says, and exchanged real handles of the allocations' sizes."""
    assert "error" not in result, result.get("traceback")
    _clean(result)
    calls = COMM_CALLS[release][backend][handles]
    for phase in PHASES:
        assert tuple(result["calls"][phase]) == calls.get(phase, ()), phase
    assert result["sufficient"] == [True, False]
    assert result["mc_ptr"] == (backend == "mnnvl")
    # Rank 1 imports rank 0's memory, and mnnvl's multicast object.
    kinds = {kind for _, kind, _ in result["imports"]}
    assert kinds == (
        {"memory", "multicast"} if result["rank"] and backend == "mnnvl" else {"memory"}
    )
    assert {transport for transport, _, _ in result["imports"]} == {handles}
    assert all(size % (2 << 20) == 0 for _, _, size in result["imports"])
    assert result["held"]["unix_sockets"] == result["held"]["exchange_dirs"] == 0


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("handles", ["posix_fd", "fabric"])
def test_creation_and_checkpoint(groups, release, backend, handles):
    name = backend if handles == "posix_fd" else f"{backend}-fabric"
    for rank in groups(release):
        result = rank[name]
        _created(result, release, backend, handles)
        prepared = result["live_prepared"]
        # checkpoint_prepare keeps the addresses and releases the memory.
        assert prepared["handles"] == prepared["mapped"] == 0, prepared
        assert prepared["reserved"] > 0
        if backend == "mnnvl":
            assert result["live"] == dict.fromkeys(result["live"], 0)
        else:
            # destroy() leaves the three allocations (two handles each) alive:
            # trtllm_ar._symm_workspace_refs keeps them until
            # trtllm_destroy_ipc_workspace_for_all_reduce_fusion.
            assert result["live"]["handles"] == 6, result["live"]
            assert result["held"]["memfds"] == (6 if handles == "posix_fd" else 0)


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_nodes(groups, release, backend):
    """Across hosts: FABRIC handles, or (0.7.4) a clear error everywhere."""
    ranks = groups(release, nodes=2)
    for rank in ranks:
        _created(rank[f"{backend}-fabric"], release, backend, "fabric")
        if release == "0.7.4":
            result = rank[backend]
            assert result["error"].startswith(
                "RuntimeError: [MNNVL] memory shared across hosts needs FABRIC"
            )
            assert (
                "rank 1 on fake-node-1: the driver does not support" in result["error"]
            )
            assert result["calls"]["create"] == ["allgather"]


@pytest.mark.parametrize("release", RELEASES)
def test_multicast_off(groups, release):
    """Without multicast mnnvl raises on every rank before any call (mc_ptr
    is never 0), and trtllm, which does not use it, is created."""
    for rank in groups(release):
        result = rank["mnnvl-no-multicast"]
        assert result["error"] == (
            "RuntimeError: [SymmDeviceMemory] Device does not support multicasting."
        )
        assert result["calls"]["create"] == []
        assert result["live"] == dict.fromkeys(result["live"], 0)
        assert "error" not in rank["trtllm-no-multicast"]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("handles", ["posix_fd", "fabric"])
def test_alloc_fails_on_one_rank(groups, release, backend, handles):
    suffix = "" if handles == "posix_fd" else "-fabric"
    waiting, failing = (
        r[f"{backend}-alloc-fails-on-rank-1{suffix}"] for r in groups(release)
    )
    oom = "CUDA error code=2(b'CUDA_ERROR_OUT_OF_MEMORY')"
    for result in waiting, failing:
        _clean(result)
        assert result["live"] == dict.fromkeys(result["live"], 0)
    if release == "0.7.4":
        # FlashInfer gathers the error and raises it on every rank.
        for result in waiting, failing:
            assert result["error"] == (
                "RuntimeError: [MNNVL] allocating memory shared through POSIX "
                "file descriptor handles failed:\n"
                f"  rank 1: creating or exporting the allocation failed: {oom}"
            )
            assert (
                tuple(result["calls"]["create"]) == ALLOC_FAILED_CALLS[release][handles]
            )
            assert result["held"]["memfds"] == 0
        return
    # 0.7.2.post1: the rank raises alone, and its peers wait for it.
    assert failing["error"] == f"RuntimeError: {oom}"
    assert failing["calls"]["create"] == []
    assert "Timed out waiting" in waiting["error"]
    assert tuple(waiting["calls"]["create"]) == ALLOC_FAILED_CALLS[release][handles]
    assert waiting["seconds"] >= HANG_S
    # The waiting rank's exported fd is never closed.
    assert waiting["held"]["memfds"] == (1 if handles == "posix_fd" else 0)


# What a creation leaves allocated on a rank (fake_cuda handles still live,
# fake-cuda memfds still open, after gc) when its k-th comm backend call
# raised, or was the last it made; nothing else leaks (sockets, exchange
# directories, threads). By release and backend, then k, then rank (None:
# every rank); k missing: nothing.
LEFT_BEHIND: dict[tuple[str, str], dict[int, dict[int | None, tuple[int, int]]]] = {
    # The creation errors' allgather, after cuMemCreate and export: the
    # allocation and its exported fd; the import errors' allgather: this
    # rank's allocation and the one it imported (the fds are closed).
    ("0.7.4", "trtllm"): {4: {None: (1, 2)}, 8: {None: (2, 2)}, 25: {None: (6, 6)}},
    ("0.7.4", "mnnvl"): {
        4: {None: (1, 2)},
        8: {None: (2, 2)},
        # Sharing the multicast object: rank 0's (and its exported fd), as
        # SymmDeviceMemory.__del__ unmaps the unmapped mc_ptr (an error, which
        # it logs) before it would release it.
        **{k: {0: (1, 2), 1: (0, 0)} for k in (9, 10, 11)},
    },
    # 0.7.2.post1 does not close the fd it exported when the exchange fails.
    ("0.7.2.post1", "trtllm"): {
        **{k: {None: (0, 1)} for k in (1, 2, 3)},
        10: {None: (6, 6)},
    },
    ("0.7.2.post1", "mnnvl"): {
        **{k: {None: (0, 1)} for k in (1, 2, 3)},
        **{k: {0: (1, 2), 1: (0, 0)} for k in (4, 5, 6)},
    },
}
# trtllm's last call is its final barrier: trtllm_ar._symm_workspace_refs
# already holds the allocations, as after a destroy().


def _left_behind(result: dict[str, Any], release: str, backend: str) -> None:
    k = len(result["calls"]["create"])
    expected = LEFT_BEHIND[release, backend].get(k, {})
    left = expected.get(None, expected.get(result["rank"], (0, 0)))
    assert (result["live"]["handles"], result["held"]["memfds"]) == left, result
    held = {key: n for key, n in result["held"].items() if key != "memfds"}
    assert held == dict.fromkeys(held, 0), result


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_comm_call_fails_everywhere(groups, release, backend):
    """A comm backend call that raises on every rank propagates as it is,
    from any of the creation's calls."""
    create = COMM_CALLS[release][backend]["posix_fd"]["create"]
    ranks = groups(release)
    names = [n for n in ranks[0] if n.startswith(f"{backend}-call-")]
    assert len([n for n in names if n.endswith("-everywhere")]) >= len(create) // 3
    for name in (n for n in names if n.endswith("-everywhere")):
        k = int(name.split("-")[2])
        for rank in ranks:
            result = rank[name]
            assert result["error"] == (
                f"InjectedCommError: injected failure of call {k}: {create[k - 1]}"
            )
            assert tuple(result["calls"]["create"]) == create[:k]
            _left_behind(result, release, backend)


def test_release_path():
    """The installed release is used as it is; another is unpacked whole."""
    import importlib.metadata

    from fake_cuda import flashinfer_release_path

    installed = importlib.metadata.version("flashinfer-python")
    assert flashinfer_release_path(installed) is None
    path = flashinfer_release_path("0.7.2.post1")
    assert path is not None
    assert (path / "flashinfer" / "comm" / "allreduce.py").is_file()
    metadata = path / "flashinfer_python-0.7.2.post1.dist-info" / "METADATA"
    assert "Version: 0.7.2.post1" in metadata.read_text()
    assert flashinfer_release_path("0.7.2.post1") == path  # from the cache


def test_in_process(cpu_group):
    """In the test process, on the installed release: FlashInfer's probes
    read the knobs, loaders build once, a one-rank creation works, an OOM is
    CUDA's, and undo() puts everything back."""
    import torch
    from fake_cuda import NotFaked
    from flashinfer.comm import (
        create_allreduce_fusion_workspace,
        mnnvl,
        trtllm_ar,
        trtllm_mnnvl_ar,
    )
    from flashinfer.comm.mnnvl import TorchDistBackend

    real = [mnnvl.cuda, trtllm_ar.cudart, trtllm_ar.get_trtllm_comm_module]
    fake = FakeCuda(
        multicast=False, fabric=True, load_seconds=0.2, load_fails={"mnnvl"}, device=3
    )
    patch = pytest.MonkeyPatch()
    fake.install(patch)
    try:
        assert mnnvl.is_multicast_supported(3) is False
        assert mnnvl.is_mnnvl_fabric_supported(3) is True
        assert torch.cuda.current_device() == 3
        start = time.monotonic()
        kernels = trtllm_ar.get_trtllm_comm_module()
        assert trtllm_ar.get_trtllm_comm_module() is kernels
        assert 0.2 <= time.monotonic() - start < 0.4  # built once
        with pytest.raises(NotFaked, match="trtllm_allreduce_fusion"):
            kernels.trtllm_allreduce_fusion()
        for _ in range(2):  # a failed build is not kept
            with pytest.raises(RuntimeError, match="injected mnnvl kernel build"):
                trtllm_mnnvl_ar.get_trtllm_mnnvl_comm_module()
        assert fake.kernel_loads == ["trtllm"]

        def create():
            return create_allreduce_fusion_workspace(
                backend="trtllm",
                world_size=1,
                rank=0,
                max_token_num=MAX_TOKENS,
                hidden_dim=HIDDEN_DIM,
                dtype=torch.bfloat16,
                comm_backend=TorchDistBackend(group=cpu_group),
            )

        fake.fail = {"cuMemCreate": 0}
        with pytest.raises(RuntimeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            create()
        fake.fail = {}
        ws = create()
        assert ws.workspace_tensor.device.type == "cpu"
        assert fake.driver_calls["torch.tensor(device=cuda)"] == 1
        assert fake.driver_calls["kernel.trtllm_lamport_initialize"] == 1
        assert fake.imports == []  # a rank imports only its peers' memory
        ipc_handles = ws.ipc_handles
        ws.destroy()
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc_handles)
        del ws, ipc_handles
        gc.collect()
        # Only the control flags' cudaMalloc is never freed.
        assert fake.live() == {
            "handles": 0,
            "mapped": 0,
            "reserved": 0,
            "allocated": 1,
            "memfds": 0,
        }
        assert fake.unfaked == []
        assert set(fake.driver_errors) == {"cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"}
    finally:
        patch.undo()
    assert [mnnvl.cuda, trtllm_ar.cudart, trtllm_ar.get_trtllm_comm_module] == real


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))


def test_a_failure_at_any_call_and_the_multicast_team():
    """`fail` fails a call by name at its n-th call, with CUDA's own error;
    another device's memory and a device added twice are refused; mapping a
    multicast object waits until its whole team was added, then is held."""
    from cuda.bindings import driver as cuda
    from fake_cuda import GRANULARITY, Held
    from flashinfer.comm import mnnvl, trtllm_ar

    posix = cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    errors = cuda.CUresult
    fake = FakeCuda(device=1, fail={"cuMemCreate": 2, "cudaMalloc": 0}, hold_s=0.2)
    patch = pytest.MonkeyPatch()
    fake.install(patch)
    try:
        driver = mnnvl.cuda
        prop = cuda.CUmemAllocationProp()
        prop.location.id, prop.requestedHandleTypes = 1, posix
        created = [driver.cuMemCreate(GRANULARITY, prop, 0)[0] for _ in range(3)]
        ok, invalid_device = errors.CUDA_SUCCESS, errors.CUDA_ERROR_INVALID_DEVICE
        assert created == [ok, errors.CUDA_ERROR_OUT_OF_MEMORY, ok]
        prop.location.id = 0
        refused = driver.cuMemCreate(GRANULARITY, prop, 0)[0]
        assert refused == invalid_device
        with pytest.raises(RuntimeError, match="cudaErrorMemoryAllocation"):
            trtllm_ar.cudart.cudaMalloc(20)
        team = cuda.CUmulticastObjectProp()
        team.numDevices, team.size, team.handleTypes = 2, GRANULARITY, posix
        _, multicast = driver.cuMulticastCreate(team)
        added = [driver.cuMulticastAddDevice(multicast, d)[0] for d in (0, 1, 1)]
        assert added == [invalid_device, ok, invalid_device]
        _, ptr = driver.cuMemAddressReserve(GRANULARITY, 0, 0, 0)
        with pytest.raises(Held):
            driver.cuMemMap(ptr, GRANULARITY, 0, multicast, 0)
        # The peer on device 0 imports the object's fd and joins: no wait.
        peer = FakeCuda(device=0)._driver_calls()
        _, fd = driver.cuMemExportToShareableHandle(multicast, posix, 0)
        _, imported = peer["cuMemImportFromShareableHandle"](fd, posix)
        os.close(fd)
        assert peer["cuMulticastAddDevice"](imported, 0)[0] == ok
        mapped = driver.cuMemMap(ptr, GRANULARITY, 0, multicast, 0)[0]
        assert mapped == ok and fake.blocked == ["cuMemMap"]
        assert fake.trace.count("cuMemCreate") == 4
        peer["cuMemRelease"](imported)
    finally:
        patch.undo()
