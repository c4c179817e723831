# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added beside the replaced flashinfer_all_reduce.py (vllm#64327);
#  goes away with it.
"""Which FlashInfer all-reduce backend vLLM would use, and why: start-up's
own `decide_fi_ar_backend`. Nothing of torch or vLLM loads here before the
flags parse."""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from packaging.version import Version

POLICY = "vllm.distributed.device_communicators.flashinfer_all_reduce_policy"
GROUP = "vllm.distributed.device_communicators.flashinfer_all_reduce_group"
ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
# The policy's FI_AR_BACKEND_CHOICES and FI_AR_DTYPES (a test holds them
# equal): importing the policy from here would load torch before parsing.
BACKENDS = ("auto", "trtllm", "mnnvl")
DTYPES = ("float16", "bfloat16", "float32")
SIZE_TABLE = "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"


class UsageError(Exception):
    """Printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise UsageError(message)


def _capability(text: str) -> int:
    """10.0, sm100 or 100 as vLLM's `<major><minor>` integer."""
    match = re.fullmatch(r"(\d+)\.(\d)|(?:sm_?)?(\d+)", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not like 10.0, sm100 or 100")
    major, minor, whole = match.groups()
    return int(whole) if whole else int(major) * 10 + int(minor)


EPILOG = f"""\
explain assumes what start-up finds out: that the GPUs have NVSwitch
multicast and an NVLink fabric (unless --no-multicast, --no-fabric), and that
vLLM's {SIZE_TABLE} has the TP size (reading it needs CUDA ops).
Exit 1 where start-up fails, 2 on a usage error."""


def _parser() -> Parser:
    p = Parser(
        prog="python -m vllm.explain_flashinfer_all_reduce",
        description="vLLM's FlashInfer all-reduce backend for a deployment.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--nnodes", type=int, default=1, metavar="N", help="nodes the TP group spans")
    add("-tp", "--tensor-parallel-size", type=int, metavar="N", help="TP size")
    add("--capability", type=_capability, metavar="CC", help="10.0, sm100 or 100")
    add("--backend", choices=BACKENDS, help=f"default: {ENV}, else auto")
    add("--hisparse", action="store_true", help="HiSparse is on")
    add("--kv-transfer-config", metavar="JSON", help="as given to vllm serve")
    add("--flashinfer-version", type=Version, metavar="V", help="default: installed")
    add("--dtype", choices=DTYPES, default="bfloat16", help="of the workspace")
    add("--no-multicast", action="store_true", help="no NVSwitch multicast")
    add("--fabric", action=argparse.BooleanOptionalAction, help="NVLink fabric")
    add("--json", action="store_true", help="print one JSON document")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked before anything of torch or vLLM loads."""
    args = _parser().parse_args(argv)
    args.backend = args.backend or os.environ.get(ENV) or "auto"
    if args.backend not in BACKENDS:
        raise UsageError(f"{ENV}={args.backend!r}: expected one of {BACKENDS}")
    if args.nnodes < 1:
        raise UsageError("--nnodes must be at least 1")
    return args


def _kv_hisparse(text: str) -> bool:
    """Parsed by vLLM's own option parser; each connector is looked up in
    vLLM's factory, as start-up does; HiSparse as VllmConfig decides it."""
    from dataclasses import dataclass

    from vllm.config.kv_transfer import KVTransferConfig, hisparse_host_pool_gib
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import get_kwargs

    @dataclass
    class Options:
        kv_transfer_config: KVTransferConfig | None = None

    try:
        config = get_kwargs(Options)["kv_transfer_config"]["type"](text)
        children = config.kv_connector_extra_config.get("connectors", [])
        if config.kv_connector == "MultiConnector":
            for child in children:
                KVConnectorFactory.get_connector_class(KVTransferConfig(**child))
        else:
            KVConnectorFactory.get_connector_class(config)
        hisparse_host_pool_gib(config)
    except (ValueError, TypeError, AttributeError, argparse.ArgumentTypeError) as e:
        message = " ".join(str(e).split())
        raise UsageError(f"invalid --kv-transfer-config: {message}") from None
    return config.has_connector("HiSparseConnector")


def _answer(args: argparse.Namespace) -> dict[str, Any]:
    """Start-up's decision for the flags, with what explain had to assume."""
    import importlib

    policy = importlib.import_module(POLICY)
    hisparse = args.hisparse
    if args.kv_transfer_config is not None:
        hisparse = _kv_hisparse(args.kv_transfer_config) or hisparse
    capability = args.capability
    if capability is None:
        capability = importlib.import_module(GROUP).device_capability()
    kernels = policy.installed_kernels()
    if args.flashinfer_version is not None:
        kernels = (("flashinfer-python", str(args.flashinfer_version)),)
    inputs = policy.FiArBackendInputs(
        setting=args.backend,
        node_count=args.nnodes,
        device_capability=capability,
        hisparse=hisparse,
        kernels=kernels,
        dtype=args.dtype,
        multicast=False if args.no_multicast else None,
        fabric=args.fabric,
    )
    decision = policy.decide_fi_ar_backend(inputs)
    backend, reason, state = decision.backend, decision.reason, "on"
    tp = args.tensor_parallel_size
    if backend is None:
        state = "off"
    elif backend == "trtllm" and args.nnodes > 1:
        state = "start-up fails"
        reason += "; get_fi_ar_workspace raises ValueError: trtllm is single-node"
    issue = decision.known_issue
    assumed = [f"{SIZE_TABLE} has TP {tp or '(not given)'} for this GPU"]
    if backend == "mnnvl":
        fabric = " and an NVLink fabric" if args.nnodes > 1 and not args.fabric else ""
        assumed.append(f"NVSwitch multicast{fabric}, which start-up checks")
    return {
        "backend": backend,
        "state": state,
        "reason": reason,
        "known_issue": issue
        and {k: v for k, v in vars(issue).items() if not callable(v)},
        "assumed": assumed,
        "inputs": {**dataclasses.asdict(inputs), "tensor_parallel_size": tp},
    }


def _text(answer: dict[str, Any]) -> str:
    first = answer["backend"] or "off"
    if answer["state"] == "start-up fails":
        first += " (start-up fails)"
    lines = [f"FlashInfer all-reduce backend: {first}", f"  why: {answer['reason']}"]
    if (issue := answer["known_issue"]) is not None:
        links = f" ({', '.join(issue['links'])})" if issue["links"] else ""
        what = f"{issue['backend']} {issue['effect']}{links}"
        lines.append(f"  known issue: {issue['name']}: {what}")
        fixed = issue["fixed_in"]
        fix = f"in this build's source tree: pip install -C flashinfer={fixed} ."
        lines.append(
            f"  fix: FlashInfer {fixed}; {fix}" if fixed else "  fix: none yet"
        )
    lines += [f"  assumed: {what}" for what in answer["assumed"]]
    inputs = dict(answer["inputs"])
    inputs["kernels"] = ", ".join(" ".join(k) for k in inputs["kernels"]) or None
    shown = "; ".join(f"{k}={'unknown' if v is None else v}" for k, v in inputs.items())
    return "\n".join([*lines, f"  inputs: {shown}"])


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM's logger writes to stdout: keep the answer alone there."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    """0 with an answer, 1 where start-up fails, 2 on a usage error."""
    try:
        args = _parse(argv)
        with _stdout_to_stderr():
            answer = _answer(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(answer, indent=2) if args.json else _text(answer))
    return 1 if answer["state"] == "start-up fails" else 0


if __name__ == "__main__":
    sys.exit(main())
