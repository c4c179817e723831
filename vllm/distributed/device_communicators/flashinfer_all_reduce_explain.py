# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""Explain which FlashInfer all-reduce backend vLLM picks, without a GPU.

    python -m vllm.distributed.device_communicators.flashinfer_all_reduce_explain

prints the backend for a deployment (nodes, GPU, HiSparse, FlashInfer) and
why, and `--table` prints the decision table of the docs.
"""

import argparse
import dataclasses
import functools
import json
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from packaging.version import Version
from pydantic import ValidationError

import vllm.envs as envs
from vllm.config import AttentionConfig, KVTransferConfig, VllmConfig
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    device_capability,
    flashinfer_version_check,
    installed_flashinfer_jit_cache_version,
    installed_flashinfer_version,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_BACKEND_ENV,
    FI_AR_KNOWN_ISSUES,
    FLASHINFER_VERSION_CHECK_ENV,
    MNNVL_MULTI_NODE_MIN_CAPABILITY,
    FiArBackendInputs,
    backend_span_error,
    decide_fi_ar_backend,
)
from vllm.engine.arg_utils import get_kwargs
from vllm.utils.argparse_utils import FlexibleArgumentParser

EXPLAIN_COMMAND = (
    "python -m vllm.distributed.device_communicators.flashinfer_all_reduce_explain"
)
# Exit statuses, documented in --help and the docs.
EXIT_WOULD_START = 0
EXIT_START_UP_FAILS = 1
EXIT_USAGE = 2
# The vllm serve options explain reads, by their VllmConfig field name.
SERVE_OPTIONS = {
    "kv_transfer_config": "--kv-transfer-config",
    "attention_config": "--attention-config",
}
HISPARSE_CONNECTOR = "HiSparseConnector"
# CUDA 12 and newer support SM50 and up; a smaller number is a typo or an
# ambiguous form such as "10" (SM10 or 10.0?).
OLDEST_CAPABILITY = 50
_CAPABILITY = re.compile(
    r"(?:(?P<major>[1-9]\d?)\.(?P<minor>\d)|(?:sm_?)?(?P<sm>[1-9]\d{1,2}))"
)
# What stands for each side of the one capability rule in the decision,
# when the GPU is not known.
_GPU_CLASSES = {
    f"SM{MNNVL_MULTI_NODE_MIN_CAPABILITY}+": (
        MNNVL_MULTI_NODE_MIN_CAPABILITY,
        f"on Blackwell (SM{MNNVL_MULTI_NODE_MIN_CAPABILITY}+)",
    ),
    f"below SM{MNNVL_MULTI_NODE_MIN_CAPABILITY}": (
        MNNVL_MULTI_NODE_MIN_CAPABILITY - 10,
        "otherwise",
    ),
}


class UsageError(ValueError):
    """Input `vllm serve` would reject, or explain cannot read (exit 2)."""


def explain_fi_ar_backend(inputs: FiArBackendInputs) -> dict[str, Any]:
    """The decision for `inputs` and whether start-up would fail, as data.

    While multicast is unknown (as at start-up), `if_no_multicast` holds the
    decision for a node without it when that differs.
    """
    decision = decide_fi_ar_backend(inputs)
    error = backend_span_error(decision.backend, inputs.node_count)
    if_no_multicast = None
    if inputs.multicast is None and error is None:
        other = decide_fi_ar_backend(dataclasses.replace(inputs, multicast=False))
        if other.backend != decision.backend:
            if_no_multicast = {"backend": other.backend, "reason": other.reason}
    return {
        "depends_on": None,
        "backend": decision.backend,
        "allow_trtllm_fallback": decision.allow_trtllm_fallback,
        "reason": decision.reason,
        "known_issue": decision.known_issue,
        "if_no_multicast": if_no_multicast,
        "error": error,
        "inputs": dataclasses.asdict(inputs),
    }


def explain_deployment(inputs: FiArBackendInputs) -> dict[str, Any]:
    """Like `explain_fi_ar_backend`, for a GPU that may be unknown.

    Without a capability the runtime rule would read "not Blackwell", which
    is wrong for a question asked on a laptop about a GB200 cluster. When
    the answer depends on the GPU, say so and give both answers.
    """
    if inputs.device_capability is not None:
        return explain_fi_ar_backend(inputs)
    by_gpu = {
        name: explain_fi_ar_backend(
            dataclasses.replace(inputs, device_capability=capability)
        )
        for name, (capability, _) in _GPU_CLASSES.items()
    }
    if len({_outcome(answer) for answer in by_gpu.values()}) == 1:
        # Same outcome on any GPU; Blackwell's reason names every rule that
        # applies (a known issue, say), where the other may not.
        newest = next(iter(by_gpu.values()))
        return {**newest, "inputs": dataclasses.asdict(inputs)}
    answers = ", ".join(
        f"{_describe_backend(answer)} {_GPU_CLASSES[name][1]}"
        for name, answer in by_gpu.items()
    )
    errors = [answer["error"] for answer in by_gpu.values() if answer["error"]]
    return {
        "depends_on": "device_capability",
        "reason": (
            f"depends on the GPU: {answers}. No GPU here; pass --capability "
            "(e.g. 10.0) for the GPU the deployment runs on"
        ),
        "by_gpu": by_gpu,
        "error": errors[0] if errors else None,
        "inputs": dataclasses.asdict(inputs),
    }


def _outcome(explained: dict[str, Any]) -> tuple[Any, ...]:
    """What start-up does, without the words saying why."""
    return (
        explained["backend"],
        explained["allow_trtllm_fallback"],
        (explained["if_no_multicast"] or {}).get("backend", "same"),
        explained["error"],
    )


def _describe_backend(explained: dict[str, Any]) -> str:
    if explained["depends_on"] is not None:
        return "depends on the GPU"
    if explained["error"]:
        return f"error: {explained['backend']} cannot span nodes"
    backend = explained["backend"] or "off"
    if explained["if_no_multicast"] is not None:
        other = explained["if_no_multicast"]["backend"] or "off"
        return f"{backend} ({other} if no multicast)"
    return backend


def flashinfer_worlds() -> list[tuple[str, str | None]]:
    """The FlashInfer releases the known issues tell apart, for the table.

    Each is a label for a range of releases and one release in it: before
    the first fix, that release is unknown (None), which no known issue
    counts as fixed.
    """
    fixes = sorted(
        {issue.fixed_in for issue in FI_AR_KNOWN_ISSUES if issue.fixed_in},
        key=Version,
    )
    if not fixes:
        return [("any", None)]
    worlds: list[tuple[str, str | None]] = [(f"< {fixes[0]}", None)]
    for fix, later in zip(fixes, [*fixes[1:], None], strict=True):
        label = f">= {fix}" if later is None else f">= {fix}, < {later}"
        worlds.append((label, fix))
    return worlds


def fi_ar_decision_table() -> str:
    """The decision across its input matrix, as a Markdown table for docs.

    Multicast is left unknown, as it is at start-up, and there is no
    flashinfer-jit-cache. A row that FlashInfer's release changes is given
    once per release range of `flashinfer_worlds`; the others read "any".
    """
    columns = [f"`{FI_AR_BACKEND_ENV}`", "Nodes", "GPU", "HiSparse", "FlashInfer"]
    columns += ["Backend", "Why"]
    lines = [
        f"| {' | '.join(columns)} |",
        f"|{' --- |' * len(columns)}",
    ]
    worlds = flashinfer_worlds()
    for setting in FI_AR_BACKEND_CHOICES:
        for node_count in (1, 2):
            for capability in (90, 100):
                for hisparse in (False, True):
                    rows = {}
                    for label, release in worlds:
                        explained = explain_fi_ar_backend(
                            FiArBackendInputs(
                                setting=setting,
                                node_count=node_count,
                                device_capability=capability,
                                hisparse=hisparse,
                                flashinfer_version=release,
                            )
                        )
                        why = explained["error"] or explained["reason"]
                        rows[label] = f"{_describe_backend(explained)} | {why} |"
                    if len(set(rows.values())) == 1:
                        rows = {"any": next(iter(rows.values()))}
                    for label, row in rows.items():
                        lines.append(
                            f"| `{setting}` | {node_count} | SM{capability} | "
                            f"{'on' if hisparse else 'off'} | {label} | {row}"
                        )
    return "\n".join(lines) + "\n"


def parse_capability(text: str) -> int:
    """A compute capability as `<major><minor>`, from a form with one meaning.

    Accepted: MAJOR.MINOR with a one-digit minor (9.0, 10.0, 12.1) and the
    SM number, bare or after `sm`/`sm_` (90, sm90, sm_100), SM50 or newer.
    "9.10" (a two-digit minor) and "10" (SM10 or 10.0?) are refused.
    """
    match = _CAPABILITY.fullmatch(text.strip().lower())
    if match is not None:
        if match["major"] is not None:
            value = int(match["major"]) * 10 + int(match["minor"])
        else:
            value = int(match["sm"])
        if value >= OLDEST_CAPABILITY:
            return value
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a compute capability: write MAJOR.MINOR with a "
        "one-digit minor (9.0, 10.0, 12.1) or the SM number (90, sm90, sm_100), "
        f"SM{OLDEST_CAPABILITY} or newer"
    )


@functools.cache
def _serve_option_parsers() -> dict[str, Callable[[str], Any]]:
    """`vllm serve`'s own parsers for the options explain reads.

    `vllm serve` takes them from `get_kwargs(VllmConfig)`, which derives
    each parser from the field's type: JSON with "80G"-style numbers
    expanded, validated by pydantic. VllmConfig's other defaults cannot be
    built without a GPU, so the same fields, types unchanged, are handed to
    `get_kwargs` on a dataclass of their own.
    """
    vllm_fields = {f.name: f for f in dataclasses.fields(VllmConfig)}
    options = dataclasses.make_dataclass(
        "ExplainedServeOptions",
        [
            (name, vllm_fields[name].type, dataclasses.field(default=None))
            for name in SERVE_OPTIONS
        ],
    )
    kwargs = get_kwargs(options)
    return {name: kwargs[name]["type"] for name in SERVE_OPTIONS}


def _one_line(error: BaseException) -> str:
    """An option parser's complaint on one line (pydantic's spans several)."""
    cause = error if isinstance(error, ValidationError) else error.__cause__
    if isinstance(cause, ValidationError):
        return "; ".join(
            ".".join(map(str, e["loc"])) + f": {e['msg']}" if e["loc"] else e["msg"]
            for e in cause.errors()
        )
    return " ".join(str(error).split())


def _parse_serve_option(name: str, text: str | None) -> Any:
    """One option as `vllm serve` parses it; None when it is not given."""
    if text is None:
        return None
    try:
        return _serve_option_parsers()[name](text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise UsageError(f"invalid {SERVE_OPTIONS[name]}: {_one_line(e)}") from e


def _connector_names(config: KVTransferConfig) -> list[str]:
    """The registry names `config` loads, or [] for any given by module path."""
    entries: list[Any] = [
        {
            "kv_connector": config.kv_connector,
            "kv_connector_module_path": config.kv_connector_module_path,
        }
    ]
    if config.kv_connector == "MultiConnector":
        entries += config.kv_connector_extra_config.get("connectors", [])
    return [
        entry["kv_connector"]
        for entry in entries
        if entry.get("kv_connector") and not entry.get("kv_connector_module_path")
    ]


def hisparse_from_serve_options(
    kv_transfer_config: KVTransferConfig | None,
    attention_config: AttentionConfig | None,
) -> tuple[bool, list[str]]:
    """Whether `vllm serve` turns HiSparse on for these options, and warnings.

    The rule is VllmConfig's: `attention_config.hisparse_config`, which a
    HiSparseConnector (also inside a MultiConnector) sets, found with the
    same `KVTransferConfig.has_connector`. Raises UsageError for what would
    stop `vllm serve` while it builds its config.
    """
    hisparse = attention_config is not None and (
        attention_config.hisparse_config is not None
    )
    if kv_transfer_config is None:
        return hisparse, []
    try:
        hisparse |= kv_transfer_config.has_connector(HISPARSE_CONNECTOR)
        names = _connector_names(kv_transfer_config)
    except (AttributeError, TypeError) as e:
        raise UsageError(
            "invalid --kv-transfer-config: kv_connector_extra_config.connectors "
            'must be a list of connector objects such as {"kv_connector": '
            f'"{HISPARSE_CONNECTOR}", "kv_role": "kv_both", ...}} ({e})'
        ) from e
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    unknown = [name for name in names if name not in KVConnectorFactory._registry]
    warnings = [
        f"--kv-transfer-config: vLLM does not know the KV connector {name!r}; "
        "vllm serve stops unless a plugin registers it or kv_connector_module_path "
        "names its module"
        for name in unknown
    ]
    if hisparse and not unknown and not _supports_hybrid_kv_cache(kv_transfer_config):
        raise UsageError(
            "invalid --kv-transfer-config: HiSparse requires the hybrid KV cache "
            "manager, which vLLM turns off for a KV connector that does not "
            "support it; use connectors that do"
        )
    return hisparse, warnings


def _supports_hybrid_kv_cache(config: KVTransferConfig) -> bool:
    """`vllm serve`'s check of the connectors, which HiSparse needs to pass."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        return KVConnectorFactory.supports_hma_config(config)
    except ImportError:
        # A connector whose dependencies are not installed here; serve
        # machines have them, so this is no reason to refuse.
        return True
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"invalid --kv-transfer-config: {_one_line(e)}") from e


class _ExplainParser(FlexibleArgumentParser):
    """vLLM's parser (dotted JSON keys, as `vllm serve`), with plain help.

    Under --json a usage error also prints `{"usage_error": ...}` on
    stdout, so a script always has JSON to read.
    """

    json_errors = False

    def format_help(self) -> str:
        return argparse.ArgumentParser.format_help(self)

    def error(self, message: str) -> NoReturn:
        if self.json_errors:
            print(json.dumps({"usage_error": message}))
        super().error(message)


EPILOG = f"""\
exit status:
  {EXIT_WOULD_START}  vLLM would start (FlashInfer all-reduce on or off)
  {EXIT_START_UP_FAILS}  start-up would fail (explicit trtllm across nodes)
  {EXIT_USAGE}  usage error: bad option, or a config vllm serve would reject;
     one line on stderr, and with --json also {{"usage_error": ...}} on stdout

--capability takes MAJOR.MINOR with a one-digit minor (9.0, 10.0, 12.1) or
the SM number (90, sm90, sm_100). Without it and without a GPU, an answer
that depends on the GPU gives both.
"""


def _explain_parser() -> _ExplainParser:
    parser = _ExplainParser(
        prog=EXPLAIN_COMMAND,
        description="Explain which FlashInfer all-reduce backend vLLM picks for "
        "a deployment, and why. Needs no GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_json_tip=False,
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
        type=parse_capability,
        help="GPU compute capability, e.g. 9.0, 10.0 or sm100 (default: this GPU's)",
    )
    parser.add_argument(
        "--hisparse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether HiSparse is on, instead of the vllm serve options below "
        "(default: off)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        help="the --kv-transfer-config given to vllm serve, read as vllm serve "
        "reads it; HiSparse is on with a HiSparseConnector, also inside a "
        "MultiConnector",
    )
    parser.add_argument(
        "--attention-config",
        "-ac",
        metavar="JSON",
        help="the --attention-config given to vllm serve; HiSparse is on with "
        "a hisparse_config",
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
    parser.add_argument(
        "--flashinfer-jit-cache-version",
        metavar="VERSION",
        default=installed_flashinfer_jit_cache_version(),
        help="flashinfer-jit-cache version, '' for none (default: the installed "
        f"one); FlashInfer loads one of another release only while "
        f"{FLASHINFER_VERSION_CHECK_ENV} is set in the environment",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the decision table for the docs and exit",
    )
    return parser


def _hisparse(args: argparse.Namespace) -> tuple[bool, list[str]]:
    """HiSparse from --hisparse, or from the vllm serve options."""
    serve_options = args.kv_transfer_config, args.attention_config
    if args.hisparse is not None:
        if serve_options != (None, None):
            raise UsageError(
                "--hisparse/--no-hisparse cannot be combined with "
                "--kv-transfer-config or --attention-config, which decide it"
            )
        return args.hisparse, []
    return hisparse_from_serve_options(
        *(
            _parse_serve_option(name, text)
            for name, text in zip(SERVE_OPTIONS, serve_options, strict=True)
        )
    )


def _print_text(explained: dict[str, Any], inputs: FiArBackendInputs) -> None:
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
        f"{_jit_cache_input(inputs)}"
    )


def _jit_cache_input(inputs: FiArBackendInputs) -> str:
    """The flashinfer-jit-cache part of the inputs line, if there is one."""
    if inputs.flashinfer_jit_cache_version is None:
        return ""
    check = f" ({FLASHINFER_VERSION_CHECK_ENV} set)"
    if inputs.flashinfer_version_check:
        check = ""
    return f", flashinfer-jit-cache {inputs.flashinfer_jit_cache_version}{check}"


def main(argv: list[str] | None = None) -> int:
    """Print the backend choice for the given deployment; see EPILOG."""
    if argv is None:
        argv = sys.argv[1:]
    parser = _explain_parser()
    parser.json_errors = "--json" in argv
    args = parser.parse_args(argv)
    if args.table:
        print(fi_ar_decision_table(), end="")
        return EXIT_WOULD_START
    try:
        setting = args.backend or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
        if args.nnodes < 1:
            raise UsageError("--nnodes must be at least 1")
        hisparse, warnings = _hisparse(args)
    except ValueError as e:
        parser.error(str(e))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=args.nnodes,
        device_capability=(
            args.capability if args.capability is not None else device_capability()
        ),
        hisparse=hisparse,
        flashinfer_version=args.flashinfer_version,
        multicast=args.multicast,
        flashinfer_jit_cache_version=args.flashinfer_jit_cache_version or None,
        flashinfer_version_check=flashinfer_version_check(),
    )
    explained = explain_deployment(inputs)
    if args.json:
        print(json.dumps({**explained, "warnings": warnings}, indent=2))
    else:
        _print_text(explained, inputs)
    return EXIT_START_UP_FAILS if explained["error"] else EXIT_WOULD_START


if __name__ == "__main__":
    sys.exit(main())
