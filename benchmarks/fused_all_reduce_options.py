# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line of check_fused_all_reduce.py, and its refusals:
`validate` refuses bad input before anything starts, with one line
(BadInput), a deployment vLLM would not fuse included."""

import argparse
import ast
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

from fused_all_reduce_summary import BACKEND_ENV, PROG, sm

DTYPES = ("bf16", "fp16")
HIDDEN_SIZES = (7168, 6144)
CPU_MAX_TOKENS = 64
# A step's decoder layers; fewer on CPU, where the emulated kernel is slow.
GPU_LAYERS, CPU_LAYERS = 8, 2
# wrong, die and stall are --self-test's; kill (no last words) and fallback
# (the op's gate refuses every call, on every rank) are for the tests.
INJECT_KINDS = ("wrong", "die", "stall", "kill", "fallback")
# The capability whose row of vLLM's fusion table a CPU run is judged by,
# unless --capability gives another: B200's, whose figures the README cites.
CPU_CAPABILITY = 100
# A refusal lists the table's rows among these group sizes: up to GB200
# NVL72's 72 GPUs, the largest NVLink domain.
LISTED_TP_SIZES = range(2, 73)
# vLLM's sizes of fused all-reduce by capability and TP size.
FUSION = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
SIZE_TABLE = "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"


class BadInput(Exception):
    """A problem with what the user gave us; one line, exit 2."""


def parse_args(argv: list[str], description: str = "") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "-tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        required=True,
        help="ranks (GPUs) in the tensor-parallel group, as for vllm serve",
    )
    add(
        "--capability",
        metavar="CC",
        help="the GPUs' compute capability, as 10.0 or 100, whose row of vLLM's "
        "fusion table decides whether -tp is fused (default: the GPUs'; "
        f"{sm(CPU_CAPABILITY)} with --device cpu)",
    )
    add("--seconds", type=float, default=120.0, help="replay time (default 120)")
    add("--json", action="store_true", help="print the result as JSON on stdout")
    add(
        "--self-test",
        action="store_true",
        help="inject faults and check that each is reported (the positive control)",
    )
    add(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the harness on gloo with an emulated kernel (no GPU)",
    )
    add(
        "--host-traffic-mib",
        type=int,
        default=256,
        help="pinned host pool per rank that HiSparse's gathers read and each "
        "fused call's copies take 4 MiB of, each way (default 256; 0: no "
        "host traffic)",
    )
    add("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    add(
        "--hidden-sizes",
        nargs="+",
        type=int,
        default=list(HIDDEN_SIZES),
        help="default: 7168 6144, DeepSeek V3.2's and GLM-5's",
    )
    add(
        "--max-tokens",
        type=int,
        help="cap the sweep's token counts (default: the workspace's maximum "
        f"on GPUs, {CPU_MAX_TOKENS} on CPU)",
    )
    add(
        "--inject",
        metavar="KIND:RANK[:AFTER]",
        help=f"inject one fault ({', '.join(INJECT_KINDS)}) on RANK after "
        "AFTER replays (default 3); what --self-test does, one at a time",
    )
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.max_tokens is None and cpu:
        args.max_tokens = CPU_MAX_TOKENS
    args.layers = CPU_LAYERS if cpu else GPU_LAYERS
    return args


def parse_inject(text: str | None, tp: int) -> dict[str, Any] | None:
    if text is None:
        return None
    kind, _, numbers = text.partition(":")
    try:
        rank, after, *rest = [int(n) for n in numbers.split(":")] + [3]
    except ValueError:
        rank, after, rest = -1, 0, []
    if kind not in INJECT_KINDS or not 0 <= rank < tp or after < 0 or len(rest) > 1:
        raise BadInput(
            f"--inject takes KIND:RANK[:AFTER] with KIND one of "
            f"{', '.join(INJECT_KINDS)} and RANK below -tp {tp}, not {text!r}"
        )
    return {"kind": kind, "rank": rank, "after": after}


def validate(args: argparse.Namespace) -> None:
    """Refuse bad input before anything starts; cheap checks first."""
    if args.tp < 2:
        raise BadInput(
            f"-tp {args.tp}: FlashInfer's all-reduce needs a group of 2 or more "
            "ranks; give -tp 2 or more"
        )
    if args.seconds <= 0:
        raise BadInput("--seconds must be more than 0")
    if args.host_traffic_mib < 0:
        raise BadInput("--host-traffic-mib must be 0 or more")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadInput("--max-tokens must be 1 or more")
    if any(h < 1 for h in args.hidden_sizes):
        raise BadInput("--hidden-sizes must be positive")
    args.inject_spec = parse_inject(args.inject, args.tp)
    import torch  # noqa: F401 (its loggers, set up on import)

    # vLLM's import-time registrations draw torch's deprecation warnings,
    # not the user's to act on: a refusal stays one line.
    logging.getLogger("torch").setLevel(logging.ERROR)
    import vllm.envs as envs

    given = None if args.capability is None else parse_capability(args.capability)
    try:
        args.backend_setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        raise BadInput(
            f"{str(e).rstrip('.')}; unset {BACKEND_ENV} or give one of those"
        ) from None
    cpu_kernels = Path(__file__).resolve().parents[1] / "tests/benchmarks"
    if args.device == "cpu" and not (cpu_kernels / "fused_all_reduce_cpu.py").exists():
        raise BadInput(
            f"--device cpu runs the emulated kernels of {cpu_kernels}, which "
            "this copy lacks; run it from a checkout of the repository"
        )
    if args.device == "cuda":
        args.capability = gpu_capability(args.tp, given)
    else:
        args.capability = CPU_CAPABILITY if given is None else given
    check_fused(args.tp, args.capability)


def parse_capability(text: str) -> int:
    """As vLLM prints it (10.0) or its integer (100). An integer below 70
    (SM 7.0) is taken for a major without its minor, such as 10: refused."""
    if match := re.fullmatch(r"(\d+)\.(\d)", text):
        return int(match[1] + match[2])
    if text.isdigit() and int(text) >= 70:
        return int(text)
    raise BadInput(f"--capability {text!r}: give it as 10.0 or as 100")


def gpu_capability(tp: int, given: int | None) -> int:
    """The GPUs' capability, where they hold the group: the one vLLM keys
    its table on at start-up (current_platform's, as
    PassConfig.default_fi_allreduce_fusion_max_size_mb reads it). CPU runs
    have no GPUs to count: their ranks are processes."""
    import torch

    from vllm.platforms import current_platform

    found = torch.cuda.device_count()
    if found < tp:
        raise BadInput(
            f"-tp {tp} needs {tp} GPUs and this machine has {found or 'none'}; "
            "run on a machine with them, or add --device cpu to run the harness "
            "alone"
        )
    device = current_platform.get_device_capability()
    assert device is not None, "a CUDA platform reports its capability"
    if given is not None and given != device.to_int():
        raise BadInput(
            f"--capability {sm(given)}: this machine's GPUs are sm "
            f"{device.as_version_str()}, which the check runs on; drop "
            "--capability, or add --device cpu"
        )
    return device.to_int()


def check_fused(tp: int, capability: int) -> None:
    """Refuse a deployment vLLM would not fuse: nothing to check. Without a
    row for the group's size at the GPUs' capability, FlashInferAllReduce
    and the fusion pass leave FlashInfer off."""
    if fusion_max_size(capability, tp):
        return
    rows = [
        f"{n} ({size:g} MB)"
        for n in LISTED_TP_SIZES
        if (size := fusion_max_size(capability, n))
    ]
    has = f"rows for TP {', '.join(rows)}" if rows else "no rows"
    raise BadInput(
        f"-tp {tp}: vLLM would not fuse TP {tp} on sm {sm(capability)}: its "
        f"{SIZE_TABLE} ({FUSION}) has {has} there, without which "
        "FlashInferAllReduce and the fusion pass leave FlashInfer off; "
        "nothing to check"
    )


def fusion_max_size(capability: int, tp: int) -> float | None:
    """The row of vLLM's installed table, read from its source: the module
    loads CUDA ops (not on CPU)."""
    spec = importlib.util.find_spec(FUSION)
    assert spec is not None and spec.origin is not None, FUSION
    for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == SIZE_TABLE:
            assert node.value is not None
            return ast.literal_eval(node.value).get(capability, {}).get(tp)
    raise LookupError(f"no {SIZE_TABLE} in {FUSION}")
