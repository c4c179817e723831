# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line of check_fused_all_reduce.py, and its refusals.

`parse_args` reads the options; `validate` refuses bad input before anything
starts, with one line (BadInput), cheap checks first: the options, the
backend setting, the GPUs, a TP size vLLM's FlashInfer all-reduce serves,
and a FlashInfer with the fused all-reduce.
"""

import argparse
from pathlib import Path
from typing import Any

from fused_all_reduce_summary import BACKEND_ENV, PROG

DTYPES = ("bf16", "fp16")
# The hidden sizes of the models HiSparse serves (DeepSeek V3.2, GLM-5).
HIDDEN_SIZES = (7168, 6144)
CPU_MAX_TOKENS = 64
# A step's layers, and replays between synchronizes; fewer on CPU, where
# the emulated kernel is slow.
GPU_LAYERS, CPU_LAYERS = 8, 2
GPU_REPLAYS_PER_SYNC, CPU_REPLAYS_PER_SYNC = 16, 2
# wrong, die and stall are --self-test's; kill (no last words) and fallback
# (the op's gate refuses every call, on every rank) are for the tests.
INJECT_KINDS = ("wrong", "die", "stall", "kill", "fallback")
# vLLM's table of FlashInfer all-reduce sizes per GPU and TP size.
SIZE_TABLE = (
    "vllm/compilation/passes/fusion/allreduce_rms_fusion.py",
    "FI_ALLREDUCE_FUSION_MAX_SIZE_MB",
)


class BadInput(Exception):
    """A problem with what the user gave us; one line, exit 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        required=True,
        help="ranks (GPUs) in the tensor-parallel group, as for vllm serve",
    )
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="replay time (default 120)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument(
        "--self-test",
        action="store_true",
        help="inject faults and check that each is reported (the positive control)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the harness on gloo with a reference kernel (no GPU)",
    )
    parser.add_argument(
        "--no-hisparse",
        dest="hisparse",
        action="store_false",
        help="check with HiSparse off in the vLLM config",
    )
    parser.add_argument(
        "--host-traffic-mib",
        type=int,
        default=256,
        help="pinned host memory per rank that each step copies to and from "
        "the GPU and HiSparse's gathers read (GPU only; 0: no host traffic)",
    )
    parser.add_argument(
        "--gather-rows",
        type=int,
        default=2048,
        help="656-byte rows each layer's HiSparse gather reads (default 2048)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="decoder layers, two fused calls each, in one captured step "
        f"(default {GPU_LAYERS}; cpu {CPU_LAYERS})",
    )
    parser.add_argument(
        "--input-sets",
        type=int,
        default=5,
        help="input sets, taken by call index; not a multiple of 3 (default 5)",
    )
    parser.add_argument(
        "--replays-per-sync",
        type=int,
        help="replays queued back to back between synchronizes "
        f"(default {GPU_REPLAYS_PER_SYNC}; cpu {CPU_REPLAYS_PER_SYNC})",
    )
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="comma-separated: bf16,fp16"
    )
    parser.add_argument(
        "--hidden-sizes",
        default=",".join(map(str, HIDDEN_SIZES)),
        help="comma-separated hidden sizes (default: 7168,6144)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"cap the sweep's token counts (default: the workspace's "
        f"maximum on GPUs, {CPU_MAX_TOKENS} on CPU)",
    )
    parser.add_argument(
        "--stall-seconds",
        type=float,
        help="no progress for this long while replaying is a stall "
        "(default 60; cpu 30)",
    )
    parser.add_argument(
        "--startup-seconds",
        type=float,
        help="limit on start-up and warm-up, FlashInfer's JIT builds included "
        "(default 1200; cpu 300)",
    )
    parser.add_argument(
        "--inject",
        metavar="KIND:RANK[:AFTER]",
        help=f"inject one fault ({', '.join(INJECT_KINDS)}) on RANK after "
        "AFTER replays (default 3); what --self-test does, one at a time",
    )
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.stall_seconds is None:
        args.stall_seconds = 30.0 if cpu else 60.0
    if args.startup_seconds is None:
        args.startup_seconds = 300.0 if cpu else 1200.0
    if args.max_tokens is None and cpu:
        args.max_tokens = CPU_MAX_TOKENS
    if args.layers is None:
        args.layers = CPU_LAYERS if cpu else GPU_LAYERS
    if args.replays_per_sync is None:
        args.replays_per_sync = CPU_REPLAYS_PER_SYNC if cpu else GPU_REPLAYS_PER_SYNC
    return args


def parse_list(text: str, what: str, convert: Any, allowed: Any = None) -> list:
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        choices = f" from {', '.join(allowed)}" if allowed else ""
        raise BadInput(f"--{what} takes a comma-separated list{choices}, not {text!r}")
    return values


def parse_inject(text: str | None, tp: int) -> dict[str, Any] | None:
    if text is None:
        return None
    parts = text.split(":")
    try:
        kind, rank, after = (
            parts[0],
            int(parts[1]),
            int(parts[2]) if len(parts) > 2 else 3,
        )
    except (IndexError, ValueError):
        kind, rank, after = "", -1, 0
    if kind not in INJECT_KINDS or not 0 <= rank < tp or after < 0 or len(parts) > 3:
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
    if args.seconds <= 0 or args.stall_seconds <= 0 or args.startup_seconds <= 0:
        raise BadInput("--seconds, --stall-seconds and --startup-seconds must be > 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadInput("--max-tokens must be 1 or more")
    if args.host_traffic_mib < 0:
        raise BadInput("--host-traffic-mib must be 0 or more")
    for name in ("gather_rows", "layers", "replays_per_sync"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be 1 or more")
    if args.input_sets < 4 or args.input_sets % 3 == 0:
        raise BadInput(
            f"--input-sets {args.input_sets}: give 4 or more, not a multiple of "
            "3, so a call reading one of the last three calls' Lamport buffers "
            "reads another set"
        )
    args.dtype_list = parse_list(args.dtypes, "dtypes", str.strip, DTYPES)
    args.hidden_list = parse_list(args.hidden_sizes, "hidden-sizes", int)
    if any(h < 1 for h in args.hidden_list):
        raise BadInput("--hidden-sizes must be positive")
    args.inject_spec = parse_inject(args.inject, args.tp)
    import vllm.envs as envs

    try:
        args.backend_setting = envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        raise BadInput(
            f"{str(e).rstrip('.')}; unset {BACKEND_ENV} or give one of those"
        ) from None
    capability = None
    if args.device == "cuda":
        import torch

        found = torch.cuda.device_count()
        if found < args.tp:
            raise BadInput(
                f"-tp {args.tp} needs {args.tp} GPUs and this machine has "
                f"{found or 'none'}; run on a machine with them, or add "
                "--device cpu to run the harness alone"
            )
        major, minor = torch.cuda.get_device_capability(0)
        capability = major * 10 + minor
    check_tp_is_served(args.tp, capability)
    try:
        import flashinfer.comm as flashinfer_comm
    except ImportError as e:
        raise BadInput(
            f"FlashInfer does not import ({e}); install this build with its "
            "FlashInfer (pip install .)"
        ) from None
    missing = [
        name
        for name in ("allreduce_fusion", "create_allreduce_fusion_workspace")
        if not hasattr(flashinfer_comm, name)
    ]
    if missing:
        raise BadInput(
            f"this FlashInfer has no fused all-reduce (flashinfer.comm lacks "
            f"{', '.join(missing)}); install this build with its FlashInfer "
            "(pip install .)"
        )


def size_table() -> dict[int, dict[int, float]]:
    """vLLM's FlashInfer all-reduce sizes per GPU and TP size, read from
    its source: the module imports CUDA ops, so it cannot load on CPU."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.parent / SIZE_TABLE[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == SIZE_TABLE[1] for t in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise BadInput(f"vLLM has no {SIZE_TABLE[1]} in {path}; reinstall this build")


def check_tp_is_served(tp: int, capability: int | None) -> None:
    """A TP size with no FlashInfer all-reduce size is off in vLLM: nothing
    to check. On CPU, a size no GPU in the table has."""
    table = size_table()
    if capability is None:
        served = sorted({size for sizes in table.values() for size in sizes})
        where = "on any GPU"
    else:
        served = sorted(table.get(capability, {}))
        where = f"on this GPU (sm {capability})"
    if tp not in served:
        listed = ", ".join(map(str, served)) or "none"
        raise BadInput(
            f"-tp {tp}: vLLM 0.33.0 has no FlashInfer all-reduce size for TP "
            f"{tp} {where} ({SIZE_TABLE[1]} serves TP {listed}), so "
            "FlashInferAllReduce and the fusion pass leave it off there; give "
            "one of those"
        )
