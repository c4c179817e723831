# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`python -m vllm.explain_flashinfer_all_reduce` answers with start-up's
decision, run as an operator runs it: a new interpreter, no GPU."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import tree_imports

MODULE = "vllm.explain_flashinfer_all_reduce"
FILE = tree_imports.REPO_ROOT / "vllm" / "explain_flashinfer_all_reduce.py"
POLICY = "vllm.distributed.device_communicators.flashinfer_all_reduce_policy"
ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
OLD, FIXED = "0.7.2.post1", "0.7.4"
FIX = "pip install -C flashinfer=0.7.4 ."
RUN = (
    "import runpy, sys, tree_imports; tree_imports.install(); "
    f"sys.argv[0] = 'explain'; runpy.run_module({MODULE!r}, run_name='__main__')"
)
# Something logs through vLLM's handler (stdout) and prints while explain works.
NOISY_RUN = RUN.replace(
    "runpy.run_module",
    f"import importlib; p = importlib.import_module({POLICY!r}); d = "
    "p.decide_fi_ar_backend; from vllm.logger import init_logger; "
    "p.decide_fi_ar_backend = lambda i: (init_logger('vllm.x').warning('noise'), "
    "print('noise'), d(i))[2]; runpy.run_module",
)


def hisparse(extra=None) -> dict:
    return {
        "kv_connector": "HiSparseConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 64} if extra is None else extra,
    }


def multi(*children) -> str:
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(children)},
        }
    )


def explain(*argv: str, code: str = RUN, env=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != ENV}
    base.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(FILE.parents[1] / "tests"))
    return subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *argv],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=300,
    )


def answer(*argv: str, env=None) -> dict:
    proc = explain(*argv, "--json", env=env)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("release", "backend", "issue"),
    [(OLD, "trtllm", "flashinfer#7782"), (FIXED, "mnnvl", None)],
)
def test_hisparse_on_one_node(release, backend, issue):
    proc = explain(
        "-tp",
        "8",
        "--capability",
        "10.0",
        "--hisparse",
        "--flashinfer-version",
        release,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines[0] == f"FlashInfer all-reduce backend: {backend}"
    assert lines[1].startswith("  why: auto")
    assert any(line.startswith("  inputs: ") for line in lines)
    if issue:
        assert f"  known issue: {issue}: mnnvl crashes with HiSparse" in proc.stdout
        assert f"  fix: FlashInfer 0.7.4; in this build's source tree: {FIX}" in lines
    else:
        assert "known issue" not in proc.stdout and "fix:" not in proc.stdout


@pytest.mark.parametrize(("release", "backend"), [(OLD, "trtllm"), (FIXED, "mnnvl")])
def test_fp16_workspace(release, backend):
    got = answer(
        "-tp",
        "8",
        "--capability",
        "10.0",
        "--dtype",
        "float16",
        "--flashinfer-version",
        release,
    )
    assert (got["backend"], got["state"]) == (backend, "on")
    assert got["inputs"]["dtype"] == "float16"
    issue = got["known_issue"]
    assert (issue and issue["name"]) == (
        "mnnvl fp16 RMSNorm overflow" if release == OLD else None
    )


def test_explicit_mnnvl_is_obeyed_and_named():
    got = answer(
        "--backend",
        "mnnvl",
        "--dtype",
        "float16",
        "-tp",
        "8",
        "--flashinfer-version",
        OLD,
    )
    assert got["backend"] == "mnnvl" and got["inputs"]["setting"] == "mnnvl"
    assert got["known_issue"]["fixed_in"] == "0.7.4"


@pytest.mark.parametrize(
    ("argv", "backend", "assumes_fabric"),
    [
        (("--hisparse", "--flashinfer-version", OLD), None, False),
        (("--hisparse", "--flashinfer-version", FIXED), "mnnvl", True),
        (("--fabric",), "mnnvl", False),
        (("--no-fabric",), None, False),
    ],
)
def test_two_nodes_on_blackwell(argv, backend, assumes_fabric):
    got = answer("--nnodes", "2", "-tp", "8", "--capability", "sm100", *argv)
    assert got["backend"] == backend and got["inputs"]["node_count"] == 2
    assert got["state"] == ("off" if backend is None else "on")
    assert any("NVLink fabric" in a for a in got["assumed"]) == assumes_fabric


def test_two_nodes_before_blackwell_are_off():
    got = answer("--nnodes", "2", "-tp", "8", "--capability", "90")
    assert got["backend"] is None and got["inputs"]["device_capability"] == 90


def test_explicit_trtllm_across_nodes_fails_start_up():
    proc = explain("--nnodes", "2", "--backend", "trtllm", "-tp", "8")
    assert proc.returncode == 1
    first = "FlashInfer all-reduce backend: trtllm (start-up fails)"
    assert proc.stdout.splitlines()[0] == first
    assert "get_fi_ar_workspace raises ValueError" in proc.stdout
    assert answer("--nnodes", "2", "-tp", "8", env={ENV: "trtllm"})["state"] == (
        "start-up fails"
    )


def test_backend_comes_from_the_environment_unless_given():
    assert answer("-tp", "8", env={ENV: "trtllm"})["inputs"]["setting"] == "trtllm"
    got = answer("-tp", "8", "--backend", "auto", env={ENV: "trtllm"})
    assert got["inputs"]["setting"] == "auto"


def test_no_multicast():
    got = answer("-tp", "8", "--capability", "10.0", "--no-multicast")
    assert (got["backend"], got["inputs"]["multicast"]) == ("trtllm", False)


@pytest.mark.parametrize(
    "config",
    [
        json.dumps(hisparse()),
        multi({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, hisparse()),
    ],
    ids=["direct", "in-multiconnector"],
)
def test_hisparse_from_the_kv_transfer_config(config):
    got = answer(
        "-tp",
        "8",
        "--capability",
        "10.0",
        "--flashinfer-version",
        OLD,
        "--kv-transfer-config",
        config,
    )
    assert got["inputs"]["hisparse"] is True and got["backend"] == "trtllm"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"kv_connector": "NoSuch", "kv_role": "kv_both"}', "NoSuch"),
        (multi({"kv_connector": "NoSuch", "kv_role": "kv_both"}), "NoSuch"),
        (json.dumps(hisparse({})), "HiSparseConnector requires host_pool_gib"),
        ("{not json", "invalid --kv-transfer-config"),
    ],
    ids=["unknown", "unknown-in-multiconnector", "no-pool", "not-json"],
)
def test_bad_kv_transfer_config_is_refused(config, message):
    proc = explain("--json", "-tp", "8", "--kv-transfer-config", config)
    assert (proc.returncode, proc.stdout) == (2, "")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_default_kernels_are_the_installed_ones():
    policy = importlib.import_module(POLICY)
    got = answer("-tp", "8")["inputs"]["kernels"]
    assert [tuple(k) for k in got] == list(policy.installed_kernels())


def test_json_is_one_document_while_vllm_logs():
    proc = explain("--json", "-tp", "8", code=NOISY_RUN)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backend"] is not None
    assert "noise" in proc.stderr


def test_choices_are_the_policys():
    policy = importlib.import_module(POLICY)
    command = importlib.import_module(MODULE)
    assert command.BACKENDS == policy.FI_AR_BACKEND_CHOICES
    assert command.DTYPES == policy.FI_AR_DTYPES


@pytest.mark.parametrize("text", ["10.0", "sm100", "sm_100", "100"])
def test_capability_forms(text):
    assert importlib.import_module(MODULE)._capability(text) == 100


def _no_heavy_imports(stderr: str) -> list[str]:
    """What `-X importtime` shows of torch or vLLM, and the other lines."""
    timed = [
        line.split("|")[-1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert not [m for m in timed if m.split(".")[0] in ("torch", "vllm")]
    return [line for line in stderr.splitlines() if not line.startswith("import time")]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--nnodes", "0"], {}, "--nnodes must be at least 1"),
        (["--flashinfer-version", "new"], {}, "invalid Version value"),
        (["--capability", "blackwell"], {}, "is not like 10.0"),
        (["--backend", "nccl"], {}, "invalid choice"),
        (["--dtype", "int8"], {}, "invalid choice"),
        (["--nnod", "2"], {}, "unrecognized arguments"),
        (["--json", "--hisparse", "x"], {}, "unrecognized arguments"),
        ([], {ENV: "nccl"}, f"{ENV}='nccl'"),
    ],
)
def test_usage_error_is_one_line_and_imports_nothing(argv, env, message):
    proc = explain("-X", "importtime", str(FILE), *argv, code="", env=env)
    assert (proc.returncode, proc.stdout) == (2, "")
    rest = _no_heavy_imports(proc.stderr)
    assert len(rest) == 1 and rest[0].startswith("error: ") and message in rest[0]


def test_help_imports_nothing():
    proc = explain("-X", "importtime", str(FILE), "--help", code="")
    assert proc.returncode == 0 and "--fabric, --no-fabric" in proc.stdout
    assert _no_heavy_imports(proc.stderr) == []
