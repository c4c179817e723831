# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""Explain which FlashInfer all-reduce backend vLLM picks, without a GPU.

    python -m vllm.distributed.device_communicators.flashinfer_all_reduce_explain

prints the backend for a deployment (nodes, GPU, HiSparse) and why, and
`--table` prints the decision table of the docs.
"""

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

import vllm.envs as envs
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    device_capability,
    installed_flashinfer_version,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_BACKEND_ENV,
    FiArBackendInputs,
    backend_span_error,
    decide_fi_ar_backend,
)

EXPLAIN_COMMAND = (
    "python -m vllm.distributed.device_communicators.flashinfer_all_reduce_explain"
)


def explain_fi_ar_backend(inputs: FiArBackendInputs) -> dict[str, Any]:
    """The decision for `inputs` and whether start-up would fail, as data."""
    decision = decide_fi_ar_backend(inputs)
    error = backend_span_error(decision.backend, inputs.node_count)
    return {
        "backend": decision.backend,
        "allow_trtllm_fallback": decision.allow_trtllm_fallback,
        "reason": decision.reason,
        "known_issue": decision.known_issue,
        "error": error,
        "inputs": asdict(inputs),
    }


def _describe_backend(explained: dict[str, Any]) -> str:
    if explained["error"]:
        return f"error: {explained['backend']} cannot span nodes"
    if explained["backend"] is None:
        return "off"
    if explained["allow_trtllm_fallback"]:
        return f"{explained['backend']} (trtllm if no multicast)"
    return explained["backend"]


def fi_ar_decision_table() -> str:
    """The decision across its input matrix, as a Markdown table for docs.

    Multicast is left unknown, as it is at start-up, and FlashInfer is
    taken to be a release without the fixes in FI_AR_KNOWN_ISSUES.
    """
    lines = [
        f"| `{FI_AR_BACKEND_ENV}` | Nodes | GPU | HiSparse | Backend | Why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for setting in FI_AR_BACKEND_CHOICES:
        for node_count in (1, 2):
            for capability in (90, 100):
                for hisparse in (False, True):
                    explained = explain_fi_ar_backend(
                        FiArBackendInputs(
                            setting=setting,
                            node_count=node_count,
                            device_capability=capability,
                            hisparse=hisparse,
                            flashinfer_version=None,
                        )
                    )
                    why = explained["error"] or explained["reason"]
                    lines.append(
                        f"| `{setting}` | {node_count} | SM{capability} | "
                        f"{'on' if hisparse else 'off'} | "
                        f"{_describe_backend(explained)} | {why} |"
                    )
    return "\n".join(lines) + "\n"


def _parse_capability(text: str) -> int:
    """Accept 10.0, 100 or sm100 for a compute capability."""
    value = text.lower().removeprefix("sm").removeprefix("_")
    try:
        if "." in value:
            major, minor = value.split(".", 1)
            return int(major) * 10 + int(minor)
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability; use e.g. 9.0, 10.0 or 100"
        ) from None


def _hisparse_in_kv_transfer_config(text: str) -> bool:
    """HiSparse as `vllm serve --kv-transfer-config` would turn it on."""
    from vllm.config import KVTransferConfig

    try:
        config = KVTransferConfig(**json.loads(text))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"invalid --kv-transfer-config: {e}") from e
    return config.has_connector("HiSparseConnector")


def _explain_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=EXPLAIN_COMMAND,
        description="Explain which FlashInfer all-reduce backend vLLM picks for "
        "a deployment, and why. Needs no GPU.",
    )
    parser.add_argument(
        "--backend",
        choices=FI_AR_BACKEND_CHOICES,
        help=f"the {FI_AR_BACKEND_ENV} setting (default: the environment's)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the tensor-parallel group spans (default: 1)",
    )
    parser.add_argument(
        "--capability",
        type=_parse_capability,
        help="GPU compute capability, e.g. 9.0 or 10.0 (default: this GPU's)",
    )
    hisparse = parser.add_mutually_exclusive_group()
    hisparse.add_argument(
        "--hisparse",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="whether HiSparse is on (default: off)",
    )
    hisparse.add_argument(
        "--kv-transfer-config",
        type=_hisparse_in_kv_transfer_config,
        dest="hisparse",
        metavar="JSON",
        help="the --kv-transfer-config given to vllm serve; HiSparse is on if "
        "it has a HiSparseConnector, also inside a MultiConnector",
    )
    parser.add_argument(
        "--multicast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether the node has NVSwitch multicast (default: unknown, as "
        "at start-up)",
    )
    parser.add_argument(
        "--flashinfer-version",
        default=installed_flashinfer_version(),
        help="flashinfer-python version (default: the installed one)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the decision table for the docs and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the backend choice for the given deployment; 1 if it would fail."""
    parser = _explain_parser()
    args = parser.parse_args(argv)
    if args.table:
        print(fi_ar_decision_table(), end="")
        return 0
    try:
        setting = args.backend or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
    except ValueError as e:
        parser.error(str(e))
    if args.nnodes < 1:
        parser.error("--nnodes must be at least 1")
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=args.nnodes,
        device_capability=(
            args.capability if args.capability is not None else device_capability()
        ),
        hisparse=args.hisparse,
        flashinfer_version=args.flashinfer_version,
        multicast=args.multicast,
    )
    explained = explain_fi_ar_backend(inputs)
    if args.json:
        print(json.dumps(explained, indent=2))
    else:
        capability = inputs.device_capability
        multicast = {None: "unknown", True: "yes", False: "no"}[inputs.multicast]
        print(f"FlashInfer all-reduce backend: {_describe_backend(explained)}")
        print(f"  why: {explained['error'] or explained['reason']}")
        print(
            f"  inputs: {FI_AR_BACKEND_ENV}={inputs.setting}, "
            f"{inputs.node_count} node(s), "
            f"GPU {f'SM{capability}' if capability else 'unknown'}, "
            f"HiSparse {'on' if inputs.hisparse else 'off'}, "
            f"multicast {multicast}, "
            f"flashinfer-python {inputs.flashinfer_version or 'not installed'}"
        )
    return 1 if explained["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
