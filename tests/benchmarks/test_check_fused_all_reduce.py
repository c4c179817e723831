# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for benchmarks/check_fused_all_reduce.py, the fused all-reduce check.

The harness runs for real with `--device cpu`: its launcher starts real rank
processes that set up vLLM's distributed state on gloo, with a real
VllmConfig and this tree's get_fi_ar_workspace; only FlashInfer's
constructor and kernel are replaced by a reference (what needs a GPU). Each
run has a hard timeout, and the test checks that no rank outlives it.

The GPU-only module cannot run here; its FlashInfer and vLLM calls are
checked statically against the released sources instead
(test_check_fused_all_reduce_calls.py).
"""

import getpass
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tree_imports

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "check_fused_all_reduce.py"
RANK = BENCHMARKS / "fused_all_reduce_rank.py"
STEP = BENCHMARKS / "fused_all_reduce_step.py"
REFERENCE = BENCHMARKS / "fused_all_reduce_reference.py"
OPTIONS = BENCHMARKS / "fused_all_reduce_options.py"
PROG = "check_fused_all_reduce"
# Small shapes keep a CPU run short; the sweep and its checks are the same.
SMALL = ["--dtypes", "bf16", "fp16", "--hidden-sizes", "256"]
ONE_SHAPE = ["--dtypes", "bf16", "--hidden-sizes", "256"]
RUN_TIMEOUT = 420
# vLLM's table of FlashInfer all-reduce sizes, by capability and TP size.
TABLE = (
    "FI_ALLREDUCE_FUSION_MAX_SIZE_MB "
    "(vllm.compilation.passes.fusion.allreduce_rms_fusion)"
)


def load(path: Path) -> ModuleType:
    """Import a benchmarks/ script by path: benchmarks/ is not a package."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(path.stem)


@pytest.fixture
def run_env(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """The harness's environment: this tree's vLLM modules in every process
    it starts (a sitecustomize, as tests/tree_imports.py routes the test
    run's own imports), and a TMPDIR of its own to find leftovers in."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})\n"
        "import tree_imports\n"
        "tree_imports.install()\n"
    )
    # Short, under /tmp: vLLM's IPC socket paths must fit in 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="cfar-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["TMPDIR"] = str(scratch)
    # 0.7.2.post1 kernels, as this build counts them: a jit-cache shim of
    # that release (the oldest installed kernels count).
    shim = tmp_path / "kernels" / "flashinfer_jit_cache"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "__version__ = '0.7.2.post1'\ndef get_jit_cache_providers():\n    return []\n"
    )
    env["OLD_KERNELS"] = str(shim.parent)
    env.pop("VLLM_FLASHINFER_ALLREDUCE_BACKEND", None)
    return env


def harness(
    env: dict[str, str], *args: str, timeout: float = RUN_TIMEOUT, script: Path = SCRIPT
) -> subprocess.CompletedProcess[str]:
    """Run the harness in a session of its own; kill it all on `timeout`."""
    try:
        return tree_imports.run_in_session(
            [sys.executable, str(script), *args], timeout=timeout, env=env
        )
    finally:
        assert_nothing_left(Path(env["TMPDIR"]))


def assert_nothing_left(scratch: Path) -> None:
    """No rank process still runs, and nothing of the run is left behind.

    Importing vLLM and FlashInfer makes their caches in the temporary
    folder (torchinductor_USER, USER/cutlass_python_cache), as any
    `import vllm` does; those are not the run's.
    """
    alive = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(scratch) in cmdline:
            alive.append(proc.name)
    assert not alive, f"rank processes left running: {alive}"
    user = getpass.getuser()
    caches = {f"torchinductor_{user}", user}
    left = [p for p in scratch.iterdir() if p.name not in caches]
    assert not left, left


def run_json(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    proc = harness(env, "-tp", "2", "--device", "cpu", "--json", *args)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


# Runs on CPU ---------------------------------------------------------------


def old_kernels(env: dict[str, str], **more: str) -> dict[str, str]:
    path = os.pathsep.join([env["OLD_KERNELS"], env["PYTHONPATH"]])
    return {**env, "PYTHONPATH": path, **more}


def test_cpu_run_passes_and_reports_what_ran(run_env: dict[str, str]) -> None:
    code, result, stderr = run_json(old_kernels(run_env), "--seconds", "2", *SMALL)
    assert code == 0, stderr
    assert result["verdict"] == "PASS", result
    # HiSparse on and auto on one node: this build's decision is trtllm.
    assert result["backends"] == ["trtllm"]
    assert any("HiSparse is on" in line for line in result["startup_lines"])
    assert result["flashinfer"]["release"] == "0.7.2.post1"
    assert result["iterations"] > 0 and result["mismatches"] == 0
    assert not result["faults"]
    tokens = result["configs"][0]["tokens"]
    assert tokens == [1, 2, 4, 8, 16, 32, 64], tokens
    assert [(c["dtype"], c["hidden"]) for c in result["configs"]] == [
        ("bf16", 256),
        ("fp16", 256),
    ]
    assert result["layers"] == 2 and result["input_sets"] == 5
    # The step's launches; no host traffic on CPU.
    assert [n[1] for n in result["step_nodes"]] == ["gemm", "fused"] * 4
    assert result["traffic_overlap"] is None and result["devices"] == [None, None]
    assert result["known_issues"] == []
    # FlashInfer's own creation made the workspace, on the suite's fake CUDA.
    (made, *_) = result["creation"]
    assert made["workspace"].startswith("flashinfer.comm."), made
    assert sum(made["driver_calls"].values()) > 0, made
    # The start-up line of this build's decision and the workspace's.
    assert any(
        "FlashInfer all-reduce backend for ranks" in line
        for line in (result["startup_lines"])
    ), result["startup_lines"]
    assert "FlashInfer all-reduce backend for ranks" in stderr
    assert "replays per rank" in stderr  # the progress line


def test_self_test_catches_each_fault_on_its_rank(run_env: dict[str, str]) -> None:
    """With mnnvl on 0.7.2.post1 kernels in fp16, where the known overflow
    zeroes tokens too: the wrong token is still caught."""
    proc = harness(
        old_kernels(run_env, VLLM_FLASHINFER_ALLREDUCE_BACKEND="mnnvl"),
        "-tp",
        "2",
        "--device",
        "cpu",
        "--self-test",
        "--json",
        "--seconds",
        "4",
        "--dtypes",
        "fp16",
        "--hidden-sizes",
        "256",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["self_test"] == "PASS"
    by_fault = {o["fault"]: o for o in report["faults"]}
    assert set(by_fault) == {
        "one wrong token",
        "a rank that dies",
        "a rank that stalls",
    }
    wrong = by_fault["one wrong token"]["result"]
    assert wrong["verdict"] == "FAIL" and wrong["backends"] == ["mnnvl"]
    assert wrong["known_issues"][0]["zeroed_tokens"] > 0
    details = wrong["mismatch_details"]
    assert details and {m["rank"] for m in details} == {1}
    assert details[0]["token"] == details[0]["tokens"] - 1
    assert details[0]["worst_error"] > 100
    died = by_fault["a rank that dies"]["result"]
    assert died["faults"][0]["ranks"] == [0]
    assert "unspecified launch failure" in died["faults"][0]["error"]
    stalled = by_fault["a rank that stalls"]["result"]
    assert stalled["faults"][0]["ranks"] == [1]
    assert stalled["faults"][0]["kind"] == "stalled"


def test_the_default_sizes_pass_on_cpu_within_seconds(run_env: dict[str, str]) -> None:
    """Both model shapes in both dtypes: the fp16 GEMM alone once took a
    CPU replay past the stall limit, and a round of every shape past
    --seconds."""
    code, result, stderr = run_json(run_env, "--seconds", "5")
    assert code == 0 and result["verdict"] == "PASS", stderr
    assert len(result["configs"]) == 4
    assert result["elapsed"] < 150, result["elapsed"]


def test_a_rank_killed_without_a_word_is_a_fault(run_env: dict[str, str]) -> None:
    code, result, _ = run_json(
        run_env,
        "--inject",
        "kill:1:2",
        "--seconds",
        "30",
        *ONE_SHAPE,
    )
    assert code == 1
    assert result["verdict"] == "FAIL"
    fault = result["faults"][0]
    assert fault["ranks"] == [1] and fault["kind"] == "died", result["faults"]
    assert "SIGKILL" in fault["error"]
    # Found at once, not when the survivor's wait runs out.
    assert result["elapsed"] < 60


def test_the_fp16_overflow_is_its_own_finding(run_env: dict[str, str]) -> None:
    """mnnvl on 0.7.2.post1 in fp16: the emulated one-shot zeroes the tokens
    past 255.94; the run names the bug and its fix, with no mismatches."""
    code, result, stderr = run_json(
        old_kernels(run_env, VLLM_FLASHINFER_ALLREDUCE_BACKEND="mnnvl"),
        "--seconds",
        "2",
        "--dtypes",
        "fp16",
        "--hidden-sizes",
        "256",
        "--max-tokens",
        "8",
    )
    assert code == 1, stderr
    assert result["backends"] == ["mnnvl"]
    assert result["mismatches"] == 0 and not result["faults"]
    (issue,) = result["known_issues"]
    assert issue["name"] == "mnnvl fp16 RMSNorm overflow"
    assert issue["fixed_in"] == "0.7.4" and issue["zeroed_tokens"] > 0
    assert any("known issue" in r and "0.7.4" in r for r in result["reasons"])


def test_a_call_that_fell_back_to_nccl_is_a_fail(run_env: dict[str, str]) -> None:
    """The op's silent fallback gives correct numbers; it must still FAIL."""
    code, result, _ = run_json(
        run_env, "--inject", "fallback:0", "--seconds", "2", *ONE_SHAPE
    )
    assert code == 1
    assert result["mismatches"] == 0
    fault = result["faults"][0]
    assert "ran NCCL + RMSNorm instead of FlashInfer's fused kernel" in fault["error"]


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["-tp", "1", "--device", "cpu"], {}, "-tp 1"),
        (
            ["-tp", "2", "--device", "cpu"],
            {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "nvls"},
            "VLLM_FLASHINFER_ALLREDUCE_BACKEND",
        ),
        (["-tp", "2"], {}, "needs 2 GPUs"),
        (["-tp", "2", "--device", "cpu", "--max-tokens", "0"], {}, "--max-tokens"),
        (["-tp", "2", "--device", "cpu"], {"copy": "1"}, "lacks"),
        # vLLM 0.34.0's FI_ALLREDUCE_FUSION_MAX_SIZE_MB: no TP 3 row on any
        # GPU, no TP 16 row on SM90; a CPU run is judged as on SM100.
        (
            ["-tp", "3", "--device", "cpu", "--seconds", "2"],
            {},
            (
                f"-tp 3: vLLM would not fuse TP 3 on sm 10.0: its {TABLE} has rows "
                "for TP 2 (64 MB), 4 (32 MB), 8 (1 MB), 16 (64 MB) there,"
            ),
        ),
        (
            ["-tp", "16", "--capability", "9.0", "--device", "cpu", "--seconds", "2"],
            {},
            (
                f"-tp 16: vLLM would not fuse TP 16 on sm 9.0: its {TABLE} has rows "
                "for TP 2 (64 MB), 4 (2 MB), 8 (0.5 MB) there,"
            ),
        ),
        (["-tp", "2", "--device", "cpu", "--capability", "10"], {}, "as 10.0 or"),
    ],
    ids=[
        "tp1",
        "unknown-backend",
        "no-gpu",
        "no-tokens",
        "cpu-without-emulation",
        "tp3-not-fused",
        "tp16-not-fused-on-sm90",
        "capability-without-minor",
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_started(
    run_env: dict[str, str],
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    says: str,
) -> None:
    env, script = dict(env), SCRIPT
    if env.pop("copy", None):
        # The scripts alone, without the tests' emulated kernels.
        (tmp_path / "benchmarks").mkdir()
        for path in BENCHMARKS.glob("*.py"):
            shutil.copy(path, tmp_path / "benchmarks")
        script = tmp_path / "benchmarks" / SCRIPT.name
    proc = harness({**run_env, **env}, *args, timeout=120, script=script)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{PROG}: error: ") and says in lines[0], lines


def test_tp8_runs_on_cpu_as_on_sm100(run_env: dict[str, str]) -> None:
    """A group vLLM fuses still runs: TP 8 has a row on every GPU."""
    proc = harness(
        run_env,
        *("-tp", "8", "--device", "cpu", "--seconds", "2", "--max-tokens", "4"),
        *ONE_SHAPE,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{PROG}: PASS\n"), proc.stdout
    assert "CPU, vLLM's fusion table read for sm 10.0 (" in proc.stdout
    assert "creation    FlashInfer's own" in proc.stdout, proc.stdout
    assert "(MNNVLAllReduceFusionWorkspace), CUDA faked" in proc.stdout


# The launcher's and the checker's parts, in-process -----------------------


@pytest.fixture
def options() -> ModuleType:
    return load(OPTIONS)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, major: int) -> None:
    """A machine with `count` GPUs of capability `major`.0, where the check
    asks: torch for the count, vLLM's platform for the capability."""
    import torch

    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    # On the class: monkeypatch would leave an instance attribute behind,
    # shadowing what later tests patch on the class.
    monkeypatch.setattr(
        type(current_platform),
        "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(major, 0)),
    )


@pytest.mark.parametrize(
    "argv, gpus, capability",
    [
        (["-tp", "8"], (8, 10), 100),
        (["-tp", "16"], (16, 10), 100),
        (["-tp", "4", "--capability", "10.0"], (4, 10), 100),
        # CPU runs have no GPUs to count: the table alone bounds -tp.
        (["-tp", "16", "--device", "cpu"], None, 100),
        (["-tp", "8", "--device", "cpu", "--capability", "90"], None, 90),
    ],
    ids=["8-of-8", "16-of-16", "capability-given", "cpu-tp16", "cpu-sm90"],
)
def test_a_group_vllm_fuses_is_taken(
    options: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    gpus: tuple[int, int] | None,
    capability: int,
) -> None:
    if gpus:
        _gpus(monkeypatch, *gpus)
    args = options.parse_args(argv)
    options.validate(args)
    assert args.capability == capability


@pytest.mark.parametrize(
    "argv, gpus, says",
    [
        (["-tp", "8"], (4, 10), "-tp 8 needs 8 GPUs and this machine has 4"),
        (["-tp", "16"], (16, 9), "vLLM would not fuse TP 16 on sm 9.0"),
        (["-tp", "3"], (4, 10), "vLLM would not fuse TP 3 on sm 10.0"),
        (
            ["-tp", "4", "--capability", "9.0"],
            (4, 10),
            "--capability 9.0: this machine's GPUs are sm 10.0",
        ),
        (
            ["-tp", "8", "--device", "cpu", "--capability", "8.0"],
            None,
            f"vLLM would not fuse TP 8 on sm 8.0: its {TABLE} has no rows there",
        ),
    ],
    ids=["8-of-4", "tp16-sm90", "tp3", "capability-not-the-gpus", "cpu-sm80"],
)
def test_a_group_vllm_would_not_fuse_is_refused(
    options: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    gpus: tuple[int, int] | None,
    says: str,
) -> None:
    if gpus:
        _gpus(monkeypatch, *gpus)
    with pytest.raises(options.BadInput) as refused:
        options.validate(options.parse_args(argv))
    assert says in str(refused.value)


@pytest.fixture
def launcher_module() -> ModuleType:
    return load(SCRIPT)


@pytest.fixture
def step_module() -> ModuleType:
    return load(STEP)


class _Proc:
    def __init__(self, code: int | None):
        self.code = code

    def poll(self) -> int | None:
        return self.code


def _launcher(launcher_module: ModuleType, steps: list[int], phase: int = 2) -> Any:
    args = launcher_module.parse_args(["-tp", str(len(steps)), "--device", "cpu"])
    launcher = launcher_module.Launcher(args, None, 1.0)
    launcher.ranks = [
        launcher_module.RankState(proc=_Proc(None), pipe=-1, log=Path("/dev/null"))
        for _ in steps
    ]
    for state, step in zip(launcher.ranks, steps, strict=True):
        state.step, state.changed = step, 0.0
        state.progress = {**state.progress, "phase": phase}
    return launcher


def test_a_stall_blames_the_rank_behind(launcher_module: ModuleType) -> None:
    launcher = _launcher(launcher_module, [7, 6, 7, 7])
    launcher.check_stall(now=10.0)
    assert not launcher.faults  # not yet past the stall limit
    launcher.check_stall(now=31.0)
    assert launcher.faults[0]["ranks"] == [1]
    assert launcher.faults[0]["kind"] == "stalled"


def test_a_stall_of_all_ranks_blames_them_all(launcher_module: ModuleType) -> None:
    launcher = _launcher(launcher_module, [5, 5])
    launcher.check_stall(now=31.0)
    assert launcher.faults[0]["ranks"] == [0, 1]


def test_start_up_has_its_own_limit(launcher_module: ModuleType) -> None:
    launcher = _launcher(launcher_module, [1, 1], phase=1)
    launcher.check_stall(now=60.0)
    assert not launcher.faults
    launcher.check_stall(now=301.0)
    assert launcher.faults


def test_fp16_inputs_go_past_256(step_module: ModuleType) -> None:
    import torch

    partial, residual = step_module.input_sets(0, 16, 64, torch.float16, 0, 2)
    assert residual.abs().max() > 256 and partial.abs().max() > 256
    assert torch.isfinite(residual).all() and torch.isfinite(partial).all()


def test_the_sweep_takes_powers_of_two_and_the_top(
    step_module: ModuleType,
) -> None:
    assert step_module.token_counts(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert step_module.token_counts(1) == [1]


def test_self_test_wants_the_right_rank(launcher_module: ModuleType) -> None:
    result = {
        "verdict": "FAIL",
        "mismatch_details": [],
        "faults": [
            {"ranks": [1], "kind": "error", "error": "unspecified launch failure"}
        ],
    }
    assert launcher_module.caught("die", 0, result) is None
    result["faults"][0]["ranks"] = [0]
    assert launcher_module.caught("die", 0, result)


class _Unreaped(_Proc):
    """A rank stuck in the driver: SIGKILL does not reap it."""

    pid = 2**22 + 1  # above pid_max: killpg finds nothing

    def wait(self, timeout: float | None = None) -> int:
        assert timeout is not None, "every wait has a deadline"
        raise subprocess.TimeoutExpired("rank", timeout)


def test_stopping_a_rank_that_will_not_die_does_not_hang(
    launcher_module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher = _launcher(launcher_module, [1, 1])
    for state in launcher.ranks:
        state.proc, state.closed = _Unreaped(None), True
    launcher.stop_all()
    assert "did not exit" in capsys.readouterr().err
