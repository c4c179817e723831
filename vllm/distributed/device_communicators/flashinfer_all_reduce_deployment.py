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
import contextlib
import copy
import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

import vllm.envs as envs
from vllm.config import (
    AttentionConfig,
    CompilationConfig,
    DeviceConfig,
    KVTransferConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.attention import HiSparseConfig
from vllm.distributed.device_communicators.flashinfer_all_reduce_group import (
    device_capability,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_installed import (
    flashinfer_version_check,
    installed_flashinfer_aot_module,
    installed_flashinfer_jit_cache_providers,
    installed_flashinfer_jit_cache_version,
    installed_flashinfer_version,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_BACKEND_ENV,
    FLASHINFER_VERSION_CHECK_ENV,
    FiArBackendInputs,
    FiJitCacheProvider,
)
from vllm.engine.arg_utils import get_kwargs
from vllm.platforms import current_platform
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


def flashinfer_release(text: str) -> str:
    """A FlashInfer release as given, refused unless PEP 440 can read it:
    a name such as "latest" says nothing about which kernels run. '' stands
    for none installed."""
    if not text:
        return text
    try:
        Version(text)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a FlashInfer release: give one such as 0.7.4"
        ) from None
    return text


def jit_cache_provider(text: str) -> FiJitCacheProvider:
    """A provider as DISTRIBUTION==VERSION (flashinfer-jit-cache-cu129==0.7.4)."""
    distribution, sep, release = text.partition("==")
    if not sep or not distribution.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not DISTRIBUTION==VERSION, e.g. "
            "flashinfer-jit-cache-cu129==0.7.4+cu129"
        )
    return FiJitCacheProvider(distribution.strip(), flashinfer_release(release))


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


def _check_connector_list(kv_transfer_config: KVTransferConfig) -> None:
    """A MultiConnector's children must be connector objects; vLLM reads
    them without checking and fails with a traceback."""
    if kv_transfer_config.kv_connector != "MultiConnector":
        return
    children = kv_transfer_config.kv_connector_extra_config.get("connectors", [])
    if not isinstance(children, list) or not all(
        isinstance(child, dict) for child in children
    ):
        raise UsageError(
            "invalid --kv-transfer-config: kv_connector_extra_config.connectors "
            'must be a list of connector objects such as {"kv_connector": '
            f'"{HISPARSE_CONNECTOR}", "kv_role": "kv_both", ...}}'
        )
    for child in children:
        try:
            KVTransferConfig(**child)
        except (ValueError, TypeError) as e:
            raise UsageError(f"invalid --kv-transfer-config: {_one_line(e)}") from e


@contextlib.contextmanager
def judged_for_a_cuda_gpu() -> Iterator[None]:
    """Let VllmConfig judge the deployment as on the CUDA machine it is for.

    explain runs where there may be no GPU, and VllmConfig refuses HiSparse
    first of all on a platform that is not CUDA, and decides the hybrid KV
    cache manager by the platform. For the time of one VllmConfig, the
    platform says what a CUDA GPU's does; nothing else runs meanwhile.
    """
    platform = type(current_platform)
    saved = {name: platform.__dict__.get(name) for name in _CUDA_ANSWERS}
    for name, answer in _CUDA_ANSWERS.items():
        setattr(platform, name, answer)
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(platform, name)
            else:
                setattr(platform, name, original)


# What a CUDA platform answers to the questions VllmConfig asks of HiSparse.
_CUDA_ANSWERS = {
    "is_cuda": lambda self: True,
    "support_hybrid_kv_cache": classmethod(lambda cls: True),
}


def _connectors_import(kv_transfer_config: KVTransferConfig) -> bool:
    """Whether the connectors' modules import on this machine.

    Imported here, on this machine's own platform, before VllmConfig asks
    for them as on a CUDA one (where some import CUDA kernels). A name vLLM
    does not know is for VllmConfig to refuse.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.supports_hma_config(kv_transfer_config)
    except ImportError:
        return False
    except (ValueError, TypeError, AttributeError):
        pass
    return True


def _vllm_words(error: BaseException) -> str:
    """vLLM's own refusal, on one line, without pydantic's wrapping."""
    if isinstance(error, ValidationError):
        return "; ".join(
            str(e["ctx"]["error"]) if "error" in e.get("ctx", {}) else e["msg"]
            for e in error.errors()
        )
    return " ".join(str(error).split())


def engine_config(
    kv_transfer_config: KVTransferConfig | None,
    attention_config: AttentionConfig | None,
    compilation_config: CompilationConfig | None,
) -> tuple[VllmConfig, list[str]]:
    """The VllmConfig `vllm serve` builds from these options, and warnings.

    Built as `vllm serve` builds it: after loading vLLM's general plugins,
    which may register KV connectors, and judged for a CUDA GPU. Raises
    UsageError with vLLM's words for what it refuses: an unknown connector,
    HiSparse with cudagraph_mode FULL, with Model Runner V2 turned off
    (`use_v2_model_runner`), or beside a connector without the hybrid KV
    cache manager (all in vllm/config/vllm.py). A connector whose module
    does not import here is taken to support that manager, with a warning.
    """
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if kv_transfer_config is not None:
        _check_connector_list(kv_transfer_config)
    options: dict[str, Any] = {
        "kv_transfer_config": kv_transfer_config,
        "attention_config": attention_config,
        "compilation_config": compilation_config,
    }
    # VllmConfig fills in what it is given: keep the parsed options as given.
    options = {k: copy.deepcopy(v) for k, v in options.items() if v is not None}
    warnings: list[str] = []
    scheduler: dict[str, Any] = {}
    if kv_transfer_config is not None and not _connectors_import(kv_transfer_config):
        warnings.append(
            "--kv-transfer-config: a KV connector's module does not import here; "
            "taken to support the hybrid KV cache manager, as vllm serve checks "
            "where it is installed"
        )
        scheduler["scheduler_config"] = SchedulerConfig.default_factory(
            disable_hybrid_kv_cache_manager=False
        )
    try:
        with judged_for_a_cuda_gpu():
            config = VllmConfig(
                device_config=DeviceConfig(device="cpu"), **scheduler, **options
            )
        if config.attention_config.hisparse_config is not None:
            # A property that refuses, read where vLLM builds its workers.
            _ = config.use_v2_model_runner
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"vllm serve refuses this deployment: {_vllm_words(e)}") from e
    return config, warnings


def check_hisparse_host_pool(
    config: VllmConfig, kv_transfer_config: KVTransferConfig | None
) -> None:
    """vLLM's own check of HiSparse's host pool (`host_pool_gib`).

    Start-up runs it when it plans the KV cache, after loading the model:
    `get_hisparse_host_pool_bytes` in vllm/v1/hisparse/layout.py, through
    `hisparse_host_pool_gib` in vllm/config/kv_transfer.py.
    """
    from vllm.v1.hisparse.layout import get_hisparse_host_pool_bytes

    try:
        get_hisparse_host_pool_bytes(config)
    except (ValueError, TypeError) as e:
        in_connector = kv_transfer_config is not None and (
            kv_transfer_config.has_connector(HISPARSE_CONNECTOR)
        )
        option = "--kv-transfer-config" if in_connector else "--attention-config"
        raise UsageError(f"invalid {option}: {_one_line(e)}") from e


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
        if message.startswith("unrecognized arguments:"):
            line += self._nearest_option(message)
        if self.json_errors:
            print(json.dumps({"usage_error": line}))
        self.exit(EXIT_USAGE, f"error: {line}\n")

    def _nearest_option(self, message: str) -> str:
        """ "; did you mean --nnodes?" for the first unknown option, if one is
        close. Abbreviations are refused (allow_abbrev=False): each option
        behaves one way, its usage errors included."""
        for word in message.split(":", 1)[1].split():
            if not word.startswith("-"):
                continue
            known = [o for a in self._actions for o in a.option_strings]
            nearest = difflib.get_close_matches(word.split("=")[0], known, n=1)
            if nearest:
                return f"; did you mean {nearest[0]}?"
        return ""


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
        allow_abbrev=False,
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
        "--fabric",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether every node's GPUs have an NVLink fabric (multi-node "
        "NVLink, as in GB200 NVL72), which mnnvl needs across nodes; "
        "FlashInfer's is_mnnvl_fabric_supported probes it at start-up "
        "(default: unknown, taken as yes)",
    )
    parser.add_argument(
        "--flashinfer-version",
        metavar="VERSION",
        type=flashinfer_release,
        help="flashinfer-python release, '' for none (default: the installed one)",
    )
    parser.add_argument(
        "--flashinfer-jit-cache-version",
        metavar="VERSION",
        type=flashinfer_release,
        help="flashinfer-jit-cache (the shim) version, '' for none (default: "
        "the installed one); FlashInfer takes one of another release only "
        f"while {FLASHINFER_VERSION_CHECK_ENV} is set in the environment",
    )
    parser.add_argument(
        "--flashinfer-jit-cache-provider",
        metavar="DISTRIBUTION==VERSION",
        action="append",
        type=jit_cache_provider,
        help="a kernel package the shim lists, taken to hold the MNNVL module "
        "for the GPU; repeat for each (default: the installed shim's)",
    )
    parser.add_argument(
        "--flashinfer-aot-module",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether flashinfer-python's flashinfer/data/aot holds a prebuilt "
        "MNNVL module (default: whether the installed one does)",
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
    """HiSparse from --hisparse or the vllm serve options, as the
    VllmConfig `vllm serve` builds from them says; UsageError for a
    deployment it refuses."""
    attention_config = options["attention_config"]
    if args.hisparse is not None:
        if (args.kv_transfer_config, args.attention_config) != (None, None):
            raise UsageError(
                "--hisparse/--no-hisparse cannot be combined with "
                "--kv-transfer-config or --attention-config, which decide it"
            )
        if args.hisparse:
            attention_config = AttentionConfig(hisparse_config=HiSparseConfig())
    config, warnings = engine_config(
        options["kv_transfer_config"], attention_config, options["compilation_config"]
    )
    hisparse = config.attention_config.hisparse_config is not None
    if hisparse and args.hisparse is None:
        check_hisparse_host_pool(config, options["kv_transfer_config"])
    return hisparse, warnings


# The vllm.envs settings explain reads, each by attribute, so that the
# rebase coupling scan (tools/couplings.py) checks them against a release.
_ENVIRONMENT_FLAGS: dict[str, Callable[[], Any]] = {
    "VLLM_ALLREDUCE_USE_FLASHINFER": lambda: envs.VLLM_ALLREDUCE_USE_FLASHINFER,
    "VLLM_BATCH_INVARIANT": lambda: envs.VLLM_BATCH_INVARIANT,
}


def _environment_flag(name: str) -> bool:
    """A 0/1 variable of vllm.envs, as `vllm serve` reads it."""
    try:
        return bool(_ENVIRONMENT_FLAGS[name]())
    except ValueError as e:
        raise UsageError(f"{name} in the environment must be 0 or 1 ({e})") from e
    except AttributeError as e:
        raise UsageError(
            f"the installed vLLM has no {name}: this build was made for another "
            "vLLM release; reinstall it (pip install .) on the vLLM it pins"
        ) from e


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
        # The switches first: VllmConfig reads some of them itself, and
        # would refuse a bad one in words that do not name it.
        usage = usage_from_serve_options(
            options["compilation_config"], args.tensor_parallel_size
        )
        hisparse, warnings = _hisparse(args, options)
    except ValueError as e:
        parser.error(str(e))
    providers = args.flashinfer_jit_cache_provider
    if providers is None:
        providers = installed_flashinfer_jit_cache_providers()
    aot_module = args.flashinfer_aot_module
    if aot_module is None:
        aot_module = installed_flashinfer_aot_module()
    inputs = FiArBackendInputs(
        setting=setting,
        node_count=args.nnodes,
        device_capability=(
            args.capability if args.capability is not None else device_capability()
        ),
        hisparse=hisparse,
        flashinfer_version=(
            installed_flashinfer_version()
            if args.flashinfer_version is None
            else args.flashinfer_version or None
        ),
        multicast=args.multicast,
        fabric=args.fabric,
        flashinfer_jit_cache_version=(
            installed_flashinfer_jit_cache_version()
            if args.flashinfer_jit_cache_version is None
            else args.flashinfer_jit_cache_version or None
        ),
        flashinfer_version_check=flashinfer_version_check(),
        flashinfer_jit_cache_providers=tuple(providers),
        flashinfer_aot_module=aot_module,
    )
    return inputs, usage, warnings
