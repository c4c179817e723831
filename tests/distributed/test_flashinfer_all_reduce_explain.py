# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`python -m vllm.explain_flashinfer_all_reduce` answers with start-up's
decision, without a GPU: most cases call its `main` here, and one runs the
command as an operator does, in a new interpreter."""

import importlib
import os
import subprocess
import sys

import pytest
import tree_imports
from fi_ar_utils import BACKEND_MODULE, ENV, workspace_args

MODULE = "vllm.explain_flashinfer_all_reduce"
OLD, FIXED = "0.7.2.post1", "0.7.4"
FIX = "  fix: flashinfer-python 0.7.4, which this build pins"
B200 = ("-tp", "8", "--capability", "10.0")


@pytest.fixture
def explain(capsys, monkeypatch):
    """Run the command's main; its exit status, stdout lines and stderr."""
    monkeypatch.delenv(ENV, raising=False)
    command = importlib.import_module(MODULE)

    def run(*argv: str) -> tuple[int, list[str], str]:
        try:
            status = command.main(list(argv))
        except SystemExit as e:  # a usage error, as argparse exits
            status = e.code
        out, err = capsys.readouterr()
        return status, out.splitlines(), err

    return run


@pytest.mark.parametrize(("release", "backend"), [(OLD, "trtllm"), (FIXED, "mnnvl")])
def test_hisparse_on_one_node(explain, release, backend):
    status, lines, _ = explain(*B200, "--hisparse", "--flashinfer-version", release)
    assert status == 0
    assert lines[0] == f"FlashInfer all-reduce backend: {backend}"
    assert lines[1].startswith("  why: auto")
    assumed = "  assumed: NVSwitch multicast, which start-up probes"
    assert (assumed in lines) == (backend == "mnnvl")
    assert f"; kernels=flashinfer-python {release};" in lines[-1]
    if release == OLD:
        assert (
            "mnnvl crashes with HiSparse" in lines[1] and "flashinfer#7782" in lines[1]
        )
        assert FIX in lines
    else:
        assert not [
            line for line in lines if "flashinfer#7782" in line or "fix:" in line
        ]
    assert lines[-1].startswith("  inputs: setting=auto; node_count=1;")


@pytest.mark.parametrize(("release", "backend"), [(OLD, "trtllm"), (FIXED, "mnnvl")])
def test_fp16_workspace(explain, release, backend):
    status, lines, _ = explain(
        *B200, "--dtype", "float16", "--flashinfer-version", release
    )
    assert (status, lines[0]) == (0, f"FlashInfer all-reduce backend: {backend}")
    named = "mnnvl fp16 RMSNorm overflow" in lines[1]
    assert named == (release == OLD)


def test_explicit_mnnvl_is_obeyed_and_names_the_issue(explain):
    argv = ("--backend", "mnnvl", "--dtype", "float16", "--flashinfer-version", OLD)
    status, lines, _ = explain(*B200, *argv)
    assert (status, lines[0]) == (0, "FlashInfer all-reduce backend: mnnvl")
    assert f"{ENV}=mnnvl is set explicitly" in lines[1] and FIX in lines


@pytest.mark.parametrize(
    ("release", "first"),
    [(OLD, "off"), (FIXED, "mnnvl")],
)
def test_hisparse_on_two_blackwell_nodes(explain, release, first):
    argv = ("--nnodes", "2", "--hisparse", "--flashinfer-version", release)
    status, lines, _ = explain(*B200, *argv)
    assert (status, lines[0]) == (0, f"FlashInfer all-reduce backend: {first}")
    assumed = (
        "  assumed: NVSwitch multicast and an NVLink fabric, which start-up probes"
    )
    assert (assumed in lines) == (first == "mnnvl")


def test_two_nodes_before_blackwell_are_off(explain):
    _, lines, _ = explain("--nnodes", "2", "-tp", "8", "--capability", "9.0")
    assert lines[0] == "FlashInfer all-reduce backend: off"


@pytest.mark.parametrize(
    ("tp", "capability", "first"),
    [
        ("3", "10.0", "off"),
        ("16", "9.0", "off"),
        ("4", "9.0", "mnnvl"),
        ("1", "10.0", "off"),
    ],
)
def test_a_tp_size_without_a_fusion_size_is_off_as_at_start_up(
    explain, tp, capability, first
):
    """vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB (SM 9.0: TP 2, 4, 8; SM 10.0:
    2, 4, 8, 16): without a size, FlashInferAllReduce is disabled."""
    status, lines, _ = explain("-tp", tp, "--capability", capability)
    assert (status, lines[0]) == (0, f"FlashInfer all-reduce backend: {first}")
    if first == "off":
        assert (
            lines[1]
            == f"  why: vLLM's FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no TP {tp} here"
        )


def test_explicit_trtllm_across_nodes_fails_with_vllms_own_words(
    explain, fi_ar, fake_ws, cpu_group, monkeypatch
):
    """The line is what the runtime's get_fi_ar_workspace raises, word for word."""
    status, lines, _ = explain(*B200, "--nnodes", "2", "--backend", "trtllm")
    assert (status, lines[0]) == (1, "FlashInfer all-reduce backend: trtllm")
    [failure] = [line for line in lines if line.startswith("  start-up fails: ")]
    monkeypatch.setenv(ENV, "trtllm")
    monkeypatch.setattr(
        importlib.import_module(BACKEND_MODULE), "_node_count", lambda g: 2
    )
    with pytest.raises(ValueError) as raised:
        fi_ar.get_fi_ar_workspace(**workspace_args(cpu_group))
    assert failure == f"  start-up fails: ValueError: {raised.value}"


def test_the_backend_comes_from_the_environment_unless_given(explain, monkeypatch):
    monkeypatch.setenv(ENV, "trtllm")
    assert explain(*B200)[1][-1].startswith("  inputs: setting=trtllm;")
    assert explain(*B200, "--backend", "auto")[1][-1].startswith(
        "  inputs: setting=auto;"
    )


def test_an_invalid_environment_fails_with_vllms_own_words(explain, monkeypatch):
    monkeypatch.setenv(ENV, "nccl")
    status, lines, _ = explain(*B200)
    assert status == 1
    [line] = lines
    assert line == (
        "FlashInfer all-reduce: start-up fails: ValueError: Invalid value 'nccl' for "
        f"{ENV}. Valid options: ['auto', 'trtllm', 'mnnvl']."
    )


def test_no_answer_refers_to_explain(explain):
    for argv in (
        ("--hisparse",),
        ("--nnodes", "2", "--hisparse"),
        ("--dtype", "float16"),
    ):
        _, lines, _ = explain(*B200, *argv, "--flashinfer-version", OLD)
        assert not [line for line in lines if "explain" in line]


@pytest.mark.parametrize(
    ("text", "value"),
    [("10.0", 100), ("100", 100), ("9.0", 90), ("12.1", 121), ("70", 70)],
)
def test_capability_as_vllm_prints_it_or_its_integer(text, value):
    assert importlib.import_module(MODULE)._capability(text) == value


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("-tp", "8", "--capability", "10"), "'10': give it as 10.0 or as 100"),
        (("-tp", "8", "--capability", "sm100"), "give it as 10.0 or as 100"),
        (("-tp", "8", "--capability", "10.00"), "give it as 10.0 or as 100"),
        (("--capability", "10.0"), "the following arguments are required: -tp"),
        (("-tp", "8"), "the following arguments are required: --capability"),
        ((*B200, "--nnodes", "0"), "--nnodes and -tp must be at least 1"),
        (("-tp", "0", "--capability", "10.0"), "--nnodes and -tp must be at least 1"),
        (("-tp", "8", "--capability", "69"), "'69': give it as 10.0 or as 100"),
        ((*B200, "--flashinfer-version", "new"), "invalid Version value"),
        ((*B200, "--backend", "nccl"), "invalid choice"),
        ((*B200, "--dtype", "int8"), "invalid choice"),
        ((*B200, "--nnod", "2"), "unrecognized arguments"),
    ],
)
def test_a_usage_error_is_one_line(explain, argv, message):
    status, lines, err = explain(*argv)
    assert (status, lines) == (2, [])
    [line] = err.splitlines()
    assert line.startswith("error: ") and message in line


def test_the_command_as_an_operator_runs_it():
    """A new interpreter, as `python -m`; the answer alone on stdout."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(
        PYTHONPATH=str(tree_imports.REPO_ROOT / "tests"), CUDA_VISIBLE_DEVICES=""
    )
    code = (
        "import runpy, sys, tree_imports; tree_imports.install(); sys.argv[0] = "
        f"'explain'; runpy.run_module({MODULE!r}, run_name='__main__')"
    )
    argv = [*B200, "--hisparse", "--flashinfer-version", OLD]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "FlashInfer all-reduce backend: trtllm"
    assert proc.stdout.splitlines()[-1].startswith("  inputs: ")
