# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line of check_fused_all_reduce.py, and its refusals:
`validate` refuses bad input before anything starts, with one line
(BadInput)."""

import argparse
from pathlib import Path
from typing import Any

from fused_all_reduce_summary import BACKEND_ENV, PROG

DTYPES = ("bf16", "fp16")
HIDDEN_SIZES = (7168, 6144)
CPU_MAX_TOKENS = 64
# A step's decoder layers; fewer on CPU, where the emulated kernel is slow.
GPU_LAYERS, CPU_LAYERS = 8, 2
# wrong, die and stall are --self-test's; kill (no last words) and fallback
# (the op's gate refuses every call, on every rank) are for the tests.
INJECT_KINDS = ("wrong", "die", "stall", "kill", "fallback")


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
    import vllm.envs as envs

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
        import torch

        found = torch.cuda.device_count()
        if found < args.tp:
            raise BadInput(
                f"-tp {args.tp} needs {args.tp} GPUs and this machine has "
                f"{found or 'none'}; run on a machine with them, or add "
                "--device cpu to run the harness alone"
            )
        from vllm.config.compilation import PassConfig

        served = sorted(PassConfig.default_fi_allreduce_fusion_max_size_mb())
        if args.tp not in served:
            raise BadInput(
                f"-tp {args.tp}: vLLM 0.34.0 has no FlashInfer all-reduce size "
                f"for TP {args.tp} on this GPU (PassConfig."
                "default_fi_allreduce_fusion_max_size_mb serves TP "
                f"{', '.join(map(str, served)) or 'none'}), so FlashInferAllReduce "
                "and the fusion pass leave it off; give one of those"
            )
