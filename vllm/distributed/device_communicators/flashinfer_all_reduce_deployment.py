# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""A deployment, described by `vllm serve`'s options, as decision inputs.

explain (`python -m vllm.explain_flashinfer_all_reduce`) takes the options
an operator gives `vllm serve` and the environment it starts in. This module
parses them with vLLM's own parsers, refuses what `vllm serve` would refuse,
and turns the rest into `FiArBackendInputs` and `FiArUsageInputs`;
`flashinfer_all_reduce_report` answers for them.
"""

import argparse
import dataclasses
import functools
import json
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NoReturn, cast

from pydantic import ValidationError

import vllm.envs as envs
from vllm.config import (
    AttentionConfig,
    CompilationConfig,
    KVTransferConfig,
    VllmConfig,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    device_capability,
    flashinfer_version_check,
    installed_flashinfer_jit_cache_version,
    installed_flashinfer_version,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_BACKEND_ENV,
    FLASHINFER_VERSION_CHECK_ENV,
    FiArBackendInputs,
)
from vllm.engine.arg_utils import get_kwargs
from vllm.utils.argparse_utils import FlexibleArgumentParser

EXPLAIN_COMMAND = "python -m vllm.explain_flashinfer_all_reduce"
# Exit statuses, documented in --help and the docs.
EXIT_WOULD_START = 0
EXIT_START_UP_FAILS = 1
EXIT_USAGE = 2
# The vllm serve options explain reads, by their VllmConfig field name.
SERVE_OPTIONS = {
    "kv_transfer_config": "--kv-transfer-config",
    "attention_config": "--attention-config",
    "compilation_config": "--compilation-config",
}
HISPARSE_CONNECTOR = "HiSparseConnector"
# CUDA 12 and newer support SM50 and up; a smaller number is a typo or an
# ambiguous form such as "10" (SM10 or 10.0?).
OLDEST_CAPABILITY = 50
_CAPABILITY = re.compile(
    r"(?:(?P<major>[1-9]\d?)\.(?P<minor>\d)|(?:sm_?)?(?P<sm>[1-9]\d{1,2}))"
)


class UsageError(ValueError):
    """Input `vllm serve` would reject, or explain cannot read (exit 2)."""


@dataclasses.dataclass(frozen=True)
class FiArUsageInputs:
    """What decides whether vLLM runs FlashInfer all-reduce at all."""

    tensor_parallel_size: int | None
    """`--tensor-parallel-size`; None while unknown."""
    standalone_all_reduce: bool
    """`VLLM_ALLREDUCE_USE_FLASHINFER`, the standalone all-reduce's switch."""
    batch_invariant: bool
    """`VLLM_BATCH_INVARIANT`, which keeps vLLM off unordered reductions."""
    fuse_allreduce_rms: bool | None
    """`pass_config.fuse_allreduce_rms`; None leaves it to vLLM's default."""
    fusion_max_size_mb: float | None
    """`pass_config.fi_allreduce_fusion_max_size_mb`; None: vLLM's table."""


# vllm serve's defaults, for a deployment whose switches are not given.
DEFAULT_USAGE = FiArUsageInputs(
    tensor_parallel_size=None,
    standalone_all_reduce=True,
    batch_invariant=False,
    fuse_allreduce_rms=None,
    fusion_max_size_mb=None,
)


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
    stop `vllm serve`, checked with vLLM's own code where it runs without a
    GPU: the hybrid KV cache check and the HiSparse host pool's.
    """
    hisparse = attention_config is not None and (
        attention_config.hisparse_config is not None
    )
    warnings: list[str] = []
    if kv_transfer_config is not None:
        hisparse, warnings = _check_connectors(kv_transfer_config, hisparse)
    if hisparse:
        _check_hisparse_host_pool(kv_transfer_config)
    return hisparse, warnings


def _check_connectors(
    kv_transfer_config: KVTransferConfig, hisparse: bool
) -> tuple[bool, list[str]]:
    """HiSparse and warnings for the connectors; UsageError for bad ones."""
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


def _check_hisparse_host_pool(kv_transfer_config: KVTransferConfig | None) -> None:
    """vLLM's own check of HiSparse's host pool (`host_pool_gib`).

    Start-up runs it when it plans the KV cache, after loading the model:
    `get_hisparse_host_pool_bytes` in vllm/v1/hisparse/layout.py, through
    `hisparse_host_pool_gib` in vllm/config/kv_transfer.py. It reads only
    `kv_transfer_config`, which is all it is given here: a VllmConfig with
    HiSparse cannot be built without CUDA.
    """
    from vllm.v1.hisparse.layout import get_hisparse_host_pool_bytes

    config = cast(VllmConfig, SimpleNamespace(kv_transfer_config=kv_transfer_config))
    try:
        get_hisparse_host_pool_bytes(config)
    except (ValueError, TypeError) as e:
        in_connector = kv_transfer_config is not None and (
            kv_transfer_config.has_connector(HISPARSE_CONNECTOR)
        )
        option = "--kv-transfer-config" if in_connector else "--attention-config"
        raise UsageError(f"invalid {option}: {_one_line(e)}") from e


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

    A usage error is one line, `error: ...`, without argparse's usage block;
    under --json it also prints `{"usage_error": ...}` on stdout, so a
    script always has JSON to read.
    """

    json_errors = False

    def format_help(self) -> str:
        return argparse.ArgumentParser.format_help(self)

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        if self.json_errors:
            print(json.dumps({"usage_error": line}))
        self.exit(EXIT_USAGE, f"error: {line}\n")


EPILOG = f"""\
exit status:
  {EXIT_WOULD_START}  vLLM would start (FlashInfer all-reduce on or off)
  {EXIT_START_UP_FAILS}  start-up would fail (explicit trtllm across nodes)
  {EXIT_USAGE}  usage error: bad option, or a config vllm serve would reject;
     one line on stderr, and with --json also {{"usage_error": ...}} on stdout

FlashInfer all-reduce is off where no path of vLLM uses it: a TP size of 1,
or one vLLM has no FlashInfer size for on the GPU. The standalone all-reduce
follows VLLM_ALLREDUCE_USE_FLASHINFER, read from the environment; the fusion
pass follows --compilation-config's pass_config.fuse_allreduce_rms; a model
that fuses all-reduce + RMSNorm itself (DeepSeek-V3.2) has no switch. What
explain cannot know it takes as vllm serve's default and names under
"assumed".

--capability takes MAJOR.MINOR with a one-digit minor (9.0, 10.0, 12.1) or
the SM number (90, sm90, sm_100). Without it and without a GPU, an answer
that depends on the GPU gives both.
"""


def explain_parser() -> _ExplainParser:
    parser = _ExplainParser(
        prog=EXPLAIN_COMMAND,
        description="Explain which FlashInfer all-reduce backend vLLM picks for "
        "a deployment, which of its paths use it, and why. Needs no GPU.",
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
        "--tensor-parallel-size",
        "-tp",
        type=int,
        metavar="N",
        help="the --tensor-parallel-size given to vllm serve (default: "
        "unknown, taken to be a size vLLM has FlashInfer sizes for)",
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
        help="whether HiSparse is on, instead of --kv-transfer-config and "
        "--attention-config (default: off)",
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
        "--compilation-config",
        "-cc",
        metavar="JSON",
        help="the --compilation-config given to vllm serve; its "
        "pass_config.fuse_allreduce_rms turns the fusion pass on or off",
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


def _hisparse(
    args: argparse.Namespace, options: dict[str, Any]
) -> tuple[bool, list[str]]:
    """HiSparse from --hisparse, or from the vllm serve options."""
    if args.hisparse is not None:
        if (args.kv_transfer_config, args.attention_config) != (None, None):
            raise UsageError(
                "--hisparse/--no-hisparse cannot be combined with "
                "--kv-transfer-config or --attention-config, which decide it"
            )
        return args.hisparse, []
    return hisparse_from_serve_options(
        options["kv_transfer_config"], options["attention_config"]
    )


def _environment_flag(name: str) -> bool:
    """A 0/1 variable of vllm.envs, as `vllm serve` reads it."""
    try:
        return bool(getattr(envs, name))
    except ValueError as e:
        raise UsageError(f"{name} in the environment must be 0 or 1 ({e})") from e


def usage_from_serve_options(
    compilation_config: CompilationConfig | None, tensor_parallel_size: int | None
) -> FiArUsageInputs:
    """The switches of FlashInfer all-reduce's paths, as `vllm serve` reads them."""
    pass_config = (compilation_config or CompilationConfig()).pass_config
    return FiArUsageInputs(
        tensor_parallel_size=tensor_parallel_size,
        standalone_all_reduce=_environment_flag("VLLM_ALLREDUCE_USE_FLASHINFER"),
        batch_invariant=_environment_flag("VLLM_BATCH_INVARIANT"),
        fuse_allreduce_rms=pass_config.fuse_allreduce_rms,
        fusion_max_size_mb=pass_config.fi_allreduce_fusion_max_size_mb,
    )


def _check_group_size(args: argparse.Namespace) -> None:
    """The node count and TP size must describe one TP group."""
    if args.nnodes < 1:
        raise UsageError("--nnodes must be at least 1")
    tp = args.tensor_parallel_size
    if tp is not None and tp < 1:
        raise UsageError("--tensor-parallel-size must be at least 1")
    if tp is not None and tp < args.nnodes:
        raise UsageError(
            f"--tensor-parallel-size {tp} cannot span --nnodes {args.nnodes}: "
            "every node of the TP group holds at least one of its ranks"
        )


def read_deployment(
    parser: "_ExplainParser", args: argparse.Namespace
) -> tuple[FiArBackendInputs, FiArUsageInputs, list[str]]:
    """The decision inputs for the parsed options, and warnings.

    What `vllm serve` would refuse ends explain here, as a usage error.
    """
    try:
        setting = args.backend or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND
        _check_group_size(args)
        options = {
            name: _parse_serve_option(name, getattr(args, name))
            for name in SERVE_OPTIONS
        }
        hisparse, warnings = _hisparse(args, options)
        usage = usage_from_serve_options(
            options["compilation_config"], args.tensor_parallel_size
        )
    except ValueError as e:
        parser.error(str(e))
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
    return inputs, usage, warnings
