# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A fault at every CUDA call of FlashInfer's creation and checkpoints.

The patch's own path (get_fi_ar_workspace, then sleep mode's
checkpoint_prepare and checkpoint_restore) runs FlashInfer's creation as
released, on fake_cuda's device, over two ranks of a real gloo group. For
each release and configuration (trtllm or mnnvl; memory shared through POSIX
file descriptors, FABRIC handles, FABRIC without an IMEX channel, where
0.7.4 falls back to file descriptors, or, under Confidential Computing,
torch symmetric memory) a fault-free case records every driver and runtime
call each rank makes; then one case per call fails that call on that rank
(fake_cuda.FAILURES), and one per exchange adds an extra exchange, or leaves
one out, on one rank, as a FlashInfer whose ranks disagree on their calls
would. A rank blocked in the driver (mapping a multicast object a peer never
joined) stays blocked for HOLD_S, past its peers' bound, then is abandoned
(fake_cuda.Held), as if killed.

Each case checks the step protocol's invariants: every rank that returns
ends each step the same way; a workspace (or checkpoint) is kept only where
FlashInfer's call completed on every rank; each step ends within the bound
on every rank not blocked; the warning names a blocked rank; no key is left
in the store. Run with `-s` for the sweep's size and outcomes.

Run as a script, this file is one rank of a group running its configs.
"""

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fake_cuda import RELEASES, FakeCuda, Held
from fi_ar_utils import (
    BACKEND_MODULE,
    ENV,
    HIDDEN_DIM,
    MAX_TOKENS,
    MODULE,
    _import_from_the_tree,
    _LogCollector,
    _wait_all,
    build_config,
    free_port,
    pin_gpu,
    reset_log_once,
)

HERE = Path(__file__).resolve()
BOUND_S = 2  # the step's bound (vLLM's cpu_distributed_timeout_seconds)
# Past a blocked rank's peers' bound and grace: they have ended the step.
HOLD_S = BOUND_S + 2.5
SLACK_S = 1.5  # what a loaded machine may add to a step's bound and grace
# FlashInfer's fd exchange waits 30 s for a peer's socket; shortened so a
# rank whose peer left during it comes back sooner (after its step ended).
FD_EXCHANGE_TIMEOUT_S = 3
POLL_S = 0.005  # the steps' longest pause between looks at the store
SHARING = ("posix_fd", "fabric", "no_imex", "confidential")
PHASES = ("create", "checkpoint_prepare", "checkpoint_restore")
TIMEOUT_S = 600  # the whole sweep, killed with its ranks


# (backend, how ranks share memory), in each release. FABRIC without an IMEX
# channel falls back to file descriptors in 0.7.4 and raises in 0.7.2.post1;
# FlashInfer refuses mnnvl under Confidential Computing, where trtllm's
# rendezvous and last barrier are collectives on the group itself.
CONFIGS = [(b, s) for b in ("trtllm", "mnnvl") for s in SHARING]


def _fault_cases(config: int, traces: list[list[str]], rounds: list[int]):
    """One case per call each rank made (its n-th call of that name); and on
    each rank, per exchange of the creation, one extra before it (or after
    the last) or that one left out."""
    cases = []
    for rank, trace in enumerate(traces):
        seen: Counter[str] = Counter()
        for name in trace:
            seen[name] += 1
            cases.append({"config": config, "rank": rank, "fail": [name, seen[name]]})
        last = rounds[rank]
        for kind, ks in (("extra", last + 1), ("missing", last)):
            for k in range(1, ks + 1):
                cases.append({"config": config, "rank": rank, "comm": [kind, k, last]})
    return cases


class _Completed:
    """Whether FlashInfer's call of each phase returned on this rank; with
    `extra_barrier`, the creation makes one more exchange before it returns."""

    def __init__(self, patch: Any, fi_comm: Any, extra_barrier: bool):
        self.phases: dict[str, bool | str] = {}
        create = fi_comm.create_allreduce_fusion_workspace

        def created(**kwargs: Any) -> Any:
            self.phases["create"] = False
            workspace = create(**kwargs)
            if extra_barrier:
                kwargs["comm_backend"].barrier()
            self.phases["create"] = True
            return workspace

        patch.setattr(fi_comm, "create_allreduce_fusion_workspace", created)
        for cls in (
            fi_comm.TRTLLMAllReduceFusionWorkspace,
            fi_comm.MNNVLAllReduceFusionWorkspace,
        ):
            for phase in PHASES[1:]:
                patch.setattr(cls, phase, self._recorded(phase, getattr(cls, phase)))

    def _recorded(self, phase: str, method: Any) -> Any:
        def call(workspace: Any, *args: Any) -> Any:
            self.phases[phase] = False
            try:
                result = method(workspace, *args)
            except NotImplementedError:  # torch symmetric memory stays resident
                self.phases[phase] = "unsupported"
                raise
            self.phases[phase] = True
            return result

        call.__name__ = phase
        return call


def _miscount(patch: Any, step_cls: Any, kind: str, k: int) -> None:
    """The creation's k-th exchange on this rank: one extra before it, or none
    (its own data stands in for everyone's)."""
    exchange = step_cls.exchange

    def miscounted(step: Any, data: Any) -> list[Any]:
        if step.what.startswith("create") and step.rounds + 1 == k:
            patch.setattr(step_cls, "exchange", exchange)  # once
            if kind == "missing":
                return [data] * step.size
            exchange(step, None)
        return exchange(step, data)

    patch.setattr(step_cls, "exchange", miscounted)


def _run_case(rank: int, case: dict, group: Any, config: Any) -> dict:
    """get_fi_ar_workspace, then (where kept) checkpoint_prepare and
    checkpoint_restore, as a worker and sleep mode call them."""
    import torch
    from flashinfer.comm import fd_exchange

    from vllm.config import set_current_vllm_config

    fi_ar = sys.modules[MODULE]
    backend_module = sys.modules[BACKEND_MODULE]
    backend, sharing = CONFIGS[case["config"]]
    mine = case.get("rank") == rank
    patch = pytest.MonkeyPatch()
    patch.setenv(ENV, backend)
    patch.setattr(fd_exchange, "_TIMEOUT_S", FD_EXCHANGE_TIMEOUT_S)
    pin_gpu(patch, 100)
    fail = case.get("fail") if mine else None
    fake = FakeCuda(
        device=rank,
        fabric=sharing in ("fabric", "no_imex"),
        imex=sharing != "no_imex",
        confidential=sharing == "confidential",
        fail=dict([fail]) if fail else {},
        hold_s=HOLD_S,
    )
    fake.install(patch)
    kind, k, last = case["comm"] if mine and "comm" in case else (None, 0, 0)
    completed = _Completed(patch, fi_ar.flashinfer_comm, kind == "extra" and k > last)
    if kind is not None and k <= last:
        _miscount(patch, backend_module.Step, kind, k)
    messages = _LogCollector()
    logging.getLogger("vllm").addHandler(messages)
    reset_log_once()
    result: dict[str, Any] = {"case": case, "rank": rank, "outcomes": {}}
    seconds: dict[str, float] = {}
    phase = "create"
    start = time.monotonic()
    try:
        with set_current_vllm_config(config):
            workspace = fi_ar.get_fi_ar_workspace(
                world_size=2,
                rank=rank,
                max_token_num=MAX_TOKENS,
                hidden_dim=HIDDEN_DIM,
                dtype=torch.bfloat16,
                group=group,
            )
        seconds[phase] = time.monotonic() - start
        failed = backend_module.agreed(group).failed
        result["outcomes"][phase] = (
            "keep" if workspace else "off" if len(failed) > 1 else "give_up"
        )
        for phase in PHASES[1:] if workspace else ():
            start = time.monotonic()
            try:
                # As CudaCommunicator calls them for sleep mode.
                getattr(fi_ar, f"{phase}_fi_ar_workspaces")(group, True)
                unsupported = completed.phases.get(phase) == "unsupported"
                result["outcomes"][phase] = "resident" if unsupported else "keep"
            finally:
                seconds[phase] = time.monotonic() - start
    except Held as e:
        result["held"] = f"{phase}: {e}"
    except Exception as e:
        seconds[phase] = time.monotonic() - start
        result["outcomes"][phase] = "raise"
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = seconds
    result["completed"] = completed.phases
    result["rounds"] = _ROUNDS.pop("create", 0)
    result["trace"] = list(fake.trace)  # the steps' calls, not destroy's
    with contextlib.suppress(Exception):
        fi_ar.destroy_fi_ar_workspace()
    gc.collect()
    logging.getLogger("vllm").removeHandler(messages)
    result["messages"] = messages.lines
    result["blocked"] = fake.blocked
    result["driver_errors"] = fake.driver_errors
    result["unfaked"] = fake.unfaked
    patch.undo()
    return result


_ROUNDS: dict[str, int] = {}


def _count_rounds(step_cls: Any) -> None:
    """The exchanges each creation step made on this rank."""
    run = step_cls.run

    def counted(step: Any, body: Any) -> Any:
        try:
            return run(step, body)
        finally:
            if step.what.startswith("create"):
                _ROUNDS["create"] = step.rounds

    step_cls.run = counted


def _release_main(spec_path: str) -> None:
    """One release's groups: its modules imported and the vLLM config built
    once, then two forked rank processes per config. Ends with the first rank
    that fails, killing the rest."""
    spec = json.loads(Path(spec_path).read_text())
    _import_from_the_tree()
    import importlib

    import flashinfer
    import flashinfer.comm.fd_exchange  # noqa: F401

    assert flashinfer.__version__ == spec["release"], flashinfer.__file__
    importlib.import_module(MODULE)
    backend_module = sys.modules[BACKEND_MODULE]
    _count_rounds(backend_module.Step)
    # Waits look at the store more often: a case costs what its exchanges do.
    sys.modules["vllm.distributed.device_communicators.store_step"].POLL_S = POLL_S
    logging.getLogger("vllm").setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as patch:
        pin_gpu(patch, 100)
        config = build_config()
    config.parallel_config.cpu_distributed_timeout_seconds = BOUND_S
    gc.freeze()  # what is loaded stays: each case's gc.collect() scans its own
    ranks = []
    for group in spec["groups"]:
        for rank in range(2):
            if (pid := os.fork()) == 0:
                try:
                    _rank_main(spec["release"], group, rank, config)
                finally:
                    os._exit(1)
            ranks.append(pid)
    for _ in ranks:
        _, status = os.wait()
        if status:
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            os._exit(1)
    os._exit(0)


def _rank_main(release: str, spec: dict, rank: int, config: Any) -> None:
    """A rank of a group running its config's fault-free case, then a case per
    fault; a JSON line per case."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=2
    )
    # A group per config: its backend is agreed once, on its first use. Its
    # timeout is the step's bound, as vLLM's GroupCoordinator gives its gloo
    # groups (get_cpu_distributed_timeout_or_none, parallel_state.py).
    timeout = timedelta(seconds=BOUND_S)
    groups = {
        c: dist.new_group(backend="gloo", timeout=timeout) for c in spec["configs"]
    }
    store = dist.distributed_c10d._get_default_store()
    out = Path(spec["out"], f"rank{rank}.jsonl")

    def run(case: dict[str, Any]) -> dict[str, Any]:
        dist.barrier()  # every rank has ended the last case
        keys = store.num_keys()
        dist.barrier()  # cases start together, as engines do
        result = _run_case(rank, case, groups[case["config"]], config)
        result["keys_before"] = keys
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        return result

    for c in spec["configs"]:
        clean = run({"config": c})
        views: list[Any] = [None, None]
        dist.all_gather_object(views, (clean["trace"], clean["rounds"]))
        for case in _fault_cases(c, [v[0] for v in views], [v[1] for v in views]):
            run(case)
    dist.barrier()
    with out.open("a") as f:
        f.write(json.dumps({"keys_after": store.num_keys()}) + "\n")
    dist.barrier()  # rank 0 holds the store
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown


def _start(release: str, tmp: str) -> subprocess.Popen:
    """A release's process, which forks a group of two ranks per config."""
    from fake_cuda import flashinfer_release_path

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    path = flashinfer_release_path(release)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(path), env.get("PYTHONPATH")])
        )
    groups = []
    for config in range(len(CONFIGS)):
        out = Path(tmp, str(config))
        out.mkdir()
        groups.append({"configs": [config], "port": free_port(), "out": str(out)})
    spec = Path(tmp, "spec.json")
    spec.write_text(json.dumps({"release": release, "groups": groups}))
    return subprocess.Popen(
        [sys.executable, str(HERE), str(spec)], env=env, start_new_session=True
    )


@pytest.fixture(scope="module")
def sweep() -> dict[str, Any]:
    """Every release's groups side by side: by release and config, each
    case's results as (rank 0's, rank 1's); and the sweep's run time."""
    started, results = {}, {}
    begin = time.monotonic()
    with contextlib.ExitStack() as stack:
        for release in RELEASES:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            started[release] = tmp, _start(release, tmp)
        _wait_all([proc for _, proc in started.values()], TIMEOUT_S)
        for release, (tmp, _) in started.items():
            for config in range(len(CONFIGS)):
                results[release, config] = [
                    [json.loads(line) for line in path.read_text().splitlines()]
                    for path in (
                        Path(tmp, str(config), f"rank{r}.jsonl") for r in (0, 1)
                    )
                ]
    return {"results": results, "seconds": time.monotonic() - begin}


def _cases(ranks: list[list[dict]]) -> list[tuple[dict, dict]]:
    """Each case's results, (rank 0's, rank 1's)."""
    return list(zip(*([r for r in rank if "case" in r] for rank in ranks), strict=True))


def _violations(pair: tuple[dict, dict]) -> list[str]:
    """The invariants of the step protocol that a case breaks."""
    from vllm.distributed.device_communicators.store_step import GRACE_S

    returned = [r for r in pair if "held" not in r]
    found = []
    for phase in PHASES:
        ends = [r["outcomes"].get(phase) for r in returned]
        if len(set(ends)) > 1:
            found.append(f"{phase}: the ranks ended differently: {ends}")
        if "keep" in ends and not all(r["completed"].get(phase) for r in pair):
            found.append(f"{phase}: kept where FlashInfer did not complete everywhere")
    for r in returned:
        late = {
            p: t for p, t in r["seconds"].items() if t > BOUND_S + GRACE_S + SLACK_S
        }
        if late:
            found.append(f"rank {r['rank']} ended past the bound: {late}")
    said = " ".join(m for r in returned for m in [*r["messages"], r.get("error", "")])
    for r in pair if returned else ():  # where every rank blocked, none can say
        if "held" in r and f"rank {r['rank']} did not answer" not in said:
            found.append(f"nothing names rank {r['rank']}, blocked in {r['blocked']}")
    return found


def test_every_case_keeps_the_invariants(sweep):
    broken = []
    for (release, _), ranks in sweep["results"].items():
        pairs = _cases(ranks)
        # The store's keys as each case starts, and once all have ended.
        keys = [pair[0]["keys_before"] for pair in pairs] + [ranks[0][-1]["keys_after"]]
        for i, pair in enumerate(pairs):
            found = _violations(pair)
            # Where every rank blocked, no rank is left to delete the step's keys.
            if keys[i + 1] != keys[i] and not all("held" in r for r in pair):
                found.append(f"{keys[i + 1] - keys[i]} keys left in the store")
            broken += [(release, pair[0]["case"], v) for v in found]
    assert not broken, broken[:5]


def test_nothing_below_flashinfer_went_unfaked(sweep):
    for ranks in sweep["results"].values():
        for rank in ranks:
            assert not [r["unfaked"] for r in rank if r.get("unfaked")]


def test_the_sweep_reaches_every_path(sweep):
    """Fault-free cases keep everything (0.7.4 without an IMEX channel through
    its fallback to file descriptors); mnnvl's sweep blocks ranks in the
    driver. Prints the sweep's size."""
    print(f"\nthe sweep: {sweep['seconds']:.0f} s")
    for (release, config), ranks in sweep["results"].items():
        backend, sharing = CONFIGS[config]
        clean, *faults = _cases(ranks)
        ends = Counter(
            ("every rank blocked" if "held" in a and "held" in b else "held")
            if "held" in a or "held" in b
            else json.dumps(a["outcomes"])
            for a, b in faults
        )
        calls = [len(r["trace"]) for r in clean]
        returned = [r for pair in faults for r in pair if "held" not in r]
        slowest = max(t for r in returned for t in [*r["seconds"].values(), 0])
        print(
            f"{release} {backend} {sharing}: calls {calls}, {len(faults)} cases, "
            f"slowest step of a rank not blocked {slowest:.1f} s"
        )
        print(f"  {dict(ends)}")
        refused = (backend, sharing) == ("mnnvl", "confidential")
        refused |= (release, sharing) == ("0.7.2.post1", "no_imex")
        kept = {"give_up"} if refused else {"keep"}
        if (backend, sharing) == ("trtllm", "confidential"):
            kept = {"keep", "resident"}
        assert {o for r in clean for o in r["outcomes"].values()} == kept, clean
        if backend == "mnnvl" and kept == {"keep"}:
            assert ends["held"] > 0


if __name__ == "__main__":
    _release_main(sys.argv[1])
