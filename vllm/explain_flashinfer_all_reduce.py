# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start-up's FlashInfer all-reduce backend for a deployment, and why, without a
GPU. Exit 1 where start-up fails, 2 on a usage error."""

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path
from typing import NoReturn

from packaging.version import Version

import vllm.envs as envs
from vllm.distributed.device_communicators.flashinfer_all_reduce_backend import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_DTYPES,
    FiArBackendInputs,
    decide_fi_ar_backend,
    installed_kernels,
)

RUNTIME = "vllm.distributed.device_communicators.flashinfer_all_reduce"
FUSION = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
SIZE_TABLE = "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One stderr line, without argparse's usage block; exit status 2."""
        self.exit(2, f"error: {message}\n")


def _capability(text: str) -> int:
    """As vLLM prints it (10.0) or its integer (100). An integer below 70
    (SM 7.0) is taken for a major without its minor, such as 10: refused."""
    if match := re.fullmatch(r"(\d+)\.(\d)", text):
        return int(match[1] + match[2])
    if text.isdigit() and int(text) >= 70:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give it as 10.0 or as 100")


def _parser() -> Parser:
    p = Parser(prog="python -m vllm.explain_flashinfer_all_reduce", allow_abbrev=False)
    add = p.add_argument
    add("-tp", "--tensor-parallel-size", type=int, required=True, metavar="N")
    add("--nnodes", type=int, default=1, metavar="N", help="nodes the TP group spans")
    add("--capability", type=_capability, required=True, metavar="CC", help="10.0")
    add("--backend", choices=FI_AR_BACKEND_CHOICES, help="overrides the env")
    add("--hisparse", action="store_true", help="a HiSparseConnector is configured")
    add("--flashinfer-version", type=Version, metavar="V", help="default: installed")
    add("--dtype", choices=FI_AR_DTYPES, default="bfloat16", help="of the workspace")
    return p


def _source(module: str) -> ast.Module:
    """vLLM's installed source of `module`, read where running it needs GPUs."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return ast.parse(Path(spec.origin).read_text())


def _fusion_max_size(capability: int, tp: int) -> float | None:
    """vLLM's SIZE_TABLE entry: without one, FlashInferAllReduce and fusion are off."""
    for node in ast.walk(_source(FUSION)):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == SIZE_TABLE:
            assert node.value is not None
            return ast.literal_eval(node.value).get(capability, {}).get(tp)
    raise LookupError(f"no {SIZE_TABLE} in {FUSION}")


def _startup_error() -> str:
    """What get_fi_ar_workspace raises for trtllm across nodes, its words."""
    fn = next(
        node
        for node in ast.walk(_source(RUNTIME))
        if isinstance(node, ast.FunctionDef) and node.name == "get_fi_ar_workspace"
    )
    error = next(node.exc for node in ast.walk(fn) if isinstance(node, ast.Raise))
    assert isinstance(error, ast.Call)
    return f"{ast.unparse(error.func)}: {ast.literal_eval(error.args[0])}"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.nnodes < 1 or args.tensor_parallel_size < 1:
        parser.error("--nnodes and -tp must be at least 1")
    try:
        setting = args.backend or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        print(f"FlashInfer all-reduce: start-up fails: ValueError: {e}")
        return 1
    version = args.flashinfer_version
    kernels = (("flashinfer-python", str(version)),) if version else installed_kernels()
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=args.nnodes,
        device_capability=args.capability,
        hisparse=args.hisparse,
        kernels=kernels,
        dtype=args.dtype,
    )
    decision = decide_fi_ar_backend(inputs)
    backend, why, issue = decision.backend, decision.reason, decision.known_issue
    tp = args.tensor_parallel_size
    if not _fusion_max_size(args.capability, tp):
        backend, why, issue = None, f"vLLM's {SIZE_TABLE} has no TP {tp} here", None
    fails = backend == "trtllm" and args.nnodes > 1
    lines = [f"FlashInfer all-reduce backend: {backend or 'off'}", f"  why: {why}"]
    if fails:
        lines.append(f"  start-up fails: {_startup_error()}")
    if issue is not None:
        fix = f"flashinfer-python {issue.fixed_in}, which this build pins"
        lines.append(f"  fix: {fix if issue.fixed_in else 'none released yet'}")
    if backend == "mnnvl":
        probes = "multicast" if args.nnodes == 1 else "multicast and an NVLink fabric"
        lines.append(f"  assumed: NVSwitch {probes}, which start-up probes")
    shown = {**vars(inputs), "kernels": ", ".join(map(" ".join, kernels)) or None}
    lines.append("  inputs: " + "; ".join(f"{k}={v}" for k, v in shown.items()))
    print("\n".join(lines))
    return int(fails)


if __name__ == "__main__":
    sys.exit(main())
