# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""Explain which FlashInfer all-reduce backend vLLM picks, without a GPU.

    python -m vllm.explain_flashinfer_all_reduce

(which starts `main` here) prints the backend for a deployment (nodes, TP
size, GPU, HiSparse, FlashInfer, the switches that turn FlashInfer
all-reduce off), which of vLLM's paths use it, and why; `--table` prints the
decision table of the docs.
"""

import argparse
import ast
import dataclasses
import functools
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn, cast

from packaging.version import Version
from pydantic import ValidationError

import vllm.envs as envs
from vllm.config import (
    AttentionConfig,
    CompilationConfig,
    KVTransferConfig,
    VllmConfig,
)
from vllm.config.compilation import PassConfig
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
# vLLM 0.33.0's paths that run FlashInfer all-reduce, by their JSON key.
FI_AR_PATHS = {
    "standalone": "standalone all-reduce",
    "fusion_pass": "fusion pass",
    "model": "model's own fusion",
}
# The top-level keys of every answer (the JSON adds "warnings"), also of
# each answer in "by_gpu".
ANSWER_KEYS = (
    "backend",
    "depends_on",
    "by_gpu",
    "allow_trtllm_fallback",
    "reason",
    "known_issue",
    "if_no_multicast",
    "error",
    "used_by",
    "assumed",
    "inputs",
)
# NVLink fabric answers a multi-node row of the decision table is given for.
_FABRICS = [("yes", True), ("no", False)]
# What explain takes for a multi-node mnnvl group while fabric is unknown.
FABRIC_ASSUMED = (
    "an NVLink fabric on every node, which start-up probes (pass --no-fabric "
    "for nodes joined by InfiniBand or Ethernet only)"
)
# Where vLLM keeps FlashInfer all-reduce's size limit (MB) by GPU and TP size.
_SIZE_LIMITS_MODULE = "vllm.compilation.passes.fusion.allreduce_rms_fusion"
_SIZE_LIMITS_NAME = "FI_ALLREDUCE_FUSION_MAX_SIZE_MB"


@functools.cache
def fi_ar_size_limits() -> dict[int, dict[int, float]]:
    """vLLM's FlashInfer all-reduce size limits: {capability: {TP size: MB}}.

    A TP size without a limit for the GPU gets no FlashInfer all-reduce:
    the standalone all-reduce and the models' own fusions read this table
    and nothing else. Its module loads CUDA ops when imported, so the table
    is read from the module's source.
    """
    spec = importlib.util.find_spec(_SIZE_LIMITS_MODULE)
    assert spec is not None and spec.origin is not None, _SIZE_LIMITS_MODULE
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == _SIZE_LIMITS_NAME
            and node.value is not None
        ):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{_SIZE_LIMITS_NAME} is not in {spec.origin}")


def _fusion_pass_by_default(capability: int | None, usage: FiArUsageInputs) -> bool:
    """vLLM's default for `fuse_allreduce_rms` at -O2, vllm serve's level.

    `enable_allreduce_rms_fusion` in vllm/config/vllm.py, for a CUDA GPU
    with FlashInfer: TP > 1 on SM90 or any SM10x, unless batch-invariant.
    TP 1 never asks: it has no all-reduce (`fi_ar_paths`).
    """
    return not usage.batch_invariant and (
        capability is None or capability == 90 or capability // 10 == 10
    )


def _fusion_max_size(capability: int | None, tp: int, usage: FiArUsageInputs) -> bool:
    """Whether the fusion pass has a workspace size for `tp` on this GPU.

    `PassConfig.flashinfer_max_size` decides, from the configured size or
    else vLLM's table; it also refuses TP sizes FlashInfer does not fuse.
    """
    max_size_mb = usage.fusion_max_size_mb
    if max_size_mb is None and capability is not None:
        max_size_mb = fi_ar_size_limits().get(capability, {}).get(tp)
    if max_size_mb is None:
        return False
    pass_config = PassConfig(fi_allreduce_fusion_max_size_mb=max_size_mb)
    return pass_config.flashinfer_max_size(tp) is not None


def fi_ar_paths(
    inputs: FiArBackendInputs, usage: FiArUsageInputs
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Which of vLLM's FlashInfer all-reduce paths run, and what was assumed.

    Each path maps to {"on": True, False or None (depends on the model),
    "why": None when on}. vLLM 0.33.0's rules (the docs name the code): a TP size
    needs a size limit for the GPU; the standalone all-reduce follows
    VLLM_ALLREDUCE_USE_FLASHINFER and VLLM_BATCH_INVARIANT; the fusion pass
    (also its FP8/FP4 patterns) follows `fuse_allreduce_rms`; a model that
    fuses all-reduce + RMSNorm in its own code has no switch.
    """
    tp = usage.tensor_parallel_size
    capability = inputs.device_capability
    assumed = []
    no_size = None
    if tp == 1:
        no_size = "TP size 1 has no all-reduce"
    elif tp is None:
        assumed.append(
            "a TP size that vLLM has FlashInfer all-reduce sizes for "
            "(pass --tensor-parallel-size)"
        )
    elif capability is not None and tp not in fi_ar_size_limits().get(capability, {}):
        no_size = (
            f"vLLM has no FlashInfer all-reduce size for TP {tp} on SM{capability}"
        )

    def on(state: bool | None, why: str | None = None) -> dict[str, Any]:
        return {"on": state, "why": why}

    if not usage.standalone_all_reduce:
        standalone = on(False, "VLLM_ALLREDUCE_USE_FLASHINFER=0")
    elif usage.batch_invariant:
        standalone = on(False, "VLLM_BATCH_INVARIANT=1")
    else:
        standalone = on(False, no_size) if no_size else on(True)

    if tp is not None and not _fusion_max_size(capability, tp, usage):
        fusion_pass = on(False, no_size or f"FlashInfer fuses no TP {tp} all-reduce")
    elif usage.fuse_allreduce_rms is False:
        fusion_pass = on(False, "fuse_allreduce_rms is false")
    elif usage.fuse_allreduce_rms:
        fusion_pass = on(True)
    elif not _fusion_pass_by_default(capability, usage):
        if usage.batch_invariant:
            fusion_pass = on(False, "VLLM_BATCH_INVARIANT=1 turns it off by default")
        else:
            fusion_pass = on(False, f"off by default on SM{capability}")
    else:
        fusion_pass = on(True)
        assumed.append(
            "the fusion pass's default at -O2, vllm serve's (-O0, -O1 and "
            "--enforce-eager leave it off)"
        )

    if no_size:
        model = on(False, no_size)
    elif inputs.hisparse:
        model = on(True)
        assumed.append(
            "a DSA model, the only kind HiSparse serves, which fuses all-reduce "
            "+ RMSNorm in its own code"
        )
    else:
        model = on(
            None,
            "DeepSeek-V3.2, GLM-5.2 and MiniMax M3 fuse all-reduce + RMSNorm "
            "in their own code, which no switch turns off",
        )
    paths = {"standalone": standalone, "fusion_pass": fusion_pass, "model": model}
    return paths, assumed


def _answer(**fields: Any) -> dict[str, Any]:
    """An answer with every key of ANSWER_KEYS, None where not given."""
    unknown = set(fields) - set(ANSWER_KEYS)
    assert not unknown, unknown
    return {key: fields.get(key) for key in ANSWER_KEYS}


def _inputs(inputs: FiArBackendInputs, usage: FiArUsageInputs) -> dict[str, Any]:
    return {**dataclasses.asdict(inputs), **dataclasses.asdict(usage)}


def explain_fi_ar_backend(
    inputs: FiArBackendInputs, usage: FiArUsageInputs = DEFAULT_USAGE
) -> dict[str, Any]:
    """The decision for `inputs` and whether start-up would fail, as data.

    While multicast is unknown (as at start-up), `if_no_multicast` holds the
    decision for a node without it when that differs. Where no path runs
    FlashInfer all-reduce, the backend is off whatever the decision, and
    start-up cannot fail on it.
    """
    used_by, assumed = fi_ar_paths(inputs, usage)
    if all(path["on"] is False for path in used_by.values()):
        whys = {name: path["why"] for name, path in used_by.items()}
        if len(set(whys.values())) == 1:
            why = next(iter(whys.values()))
        else:
            why = "; ".join(f"{FI_AR_PATHS[name]}: {w}" for name, w in whys.items())
        return _answer(
            backend=None,
            allow_trtllm_fallback=False,
            reason=f"FlashInfer all-reduce is not used: {why}",
            used_by=used_by,
            assumed=assumed,
            inputs=_inputs(inputs, usage),
        )
    decision = decide_fi_ar_backend(inputs)
    error = backend_span_error(decision.backend, inputs.node_count)
    if decision.backend == "mnnvl" and inputs.node_count > 1 and inputs.fabric is None:
        assumed = [*assumed, FABRIC_ASSUMED]
    if_no_multicast = None
    if inputs.multicast is None and error is None:
        other = decide_fi_ar_backend(dataclasses.replace(inputs, multicast=False))
        if other.backend != decision.backend:
            if_no_multicast = {"backend": other.backend, "reason": other.reason}
    return _answer(
        backend=decision.backend,
        allow_trtllm_fallback=decision.allow_trtllm_fallback,
        reason=decision.reason,
        known_issue=decision.known_issue,
        if_no_multicast=if_no_multicast,
        error=error,
        used_by=used_by,
        assumed=assumed,
        inputs=_inputs(inputs, usage),
    )


def explain_deployment(
    inputs: FiArBackendInputs, usage: FiArUsageInputs = DEFAULT_USAGE
) -> dict[str, Any]:
    """Like `explain_fi_ar_backend`, for a GPU that may be unknown.

    Without a capability the runtime rule would read "not Blackwell", which
    is wrong for a question asked on a laptop about a GB200 cluster. When
    the answer depends on the GPU, say so and give both answers; the GPU is
    taken to be one vLLM has FlashInfer all-reduce sizes for.
    """
    if inputs.device_capability is not None:
        return explain_fi_ar_backend(inputs, usage)
    by_gpu = {
        name: explain_fi_ar_backend(
            dataclasses.replace(inputs, device_capability=capability), usage
        )
        for name, (capability, _) in _GPU_CLASSES.items()
    }
    gpus = ", ".join(f"SM{capability}" for capability in sorted(fi_ar_size_limits()))
    gpu_assumed = (
        f"a GPU that vLLM has FlashInfer all-reduce sizes for ({gpus}; "
        "pass --capability)"
    )
    assumed = list(
        dict.fromkeys(
            [gpu_assumed, *(a for answer in by_gpu.values() for a in answer["assumed"])]
        )
    )
    if len({_outcome(answer) for answer in by_gpu.values()}) == 1:
        # Same outcome on any GPU; Blackwell's reason names every rule that
        # applies (a known issue, say), where the other may not.
        newest = next(iter(by_gpu.values()))
        return {**newest, "assumed": assumed, "inputs": _inputs(inputs, usage)}
    answers = ", ".join(
        f"{_describe_backend(answer)} {_GPU_CLASSES[name][1]}"
        for name, answer in by_gpu.items()
    )
    errors = [answer["error"] for answer in by_gpu.values() if answer["error"]]
    return _answer(
        depends_on="device_capability",
        by_gpu=by_gpu,
        reason=(
            f"depends on the GPU: {answers}. No GPU here; pass --capability "
            "(e.g. 10.0) for the GPU the deployment runs on"
        ),
        error=errors[0] if errors else None,
        assumed=assumed,
        inputs=_inputs(inputs, usage),
    )


def _outcome(explained: dict[str, Any]) -> tuple[Any, ...]:
    """What start-up does, without the words saying why."""
    return (
        explained["backend"],
        explained["allow_trtllm_fallback"],
        (explained["if_no_multicast"] or {}).get("backend", "same"),
        explained["error"],
        tuple(path["on"] for path in explained["used_by"].values()),
    )


def _describe_backend(explained: dict[str, Any]) -> str:
    if explained["depends_on"] is not None:
        return "depends on the GPU"
    if explained["error"]:
        return f"error: {explained['backend']} cannot span nodes"
    backend = explained["backend"] or "off"
    notes = []
    if explained["if_no_multicast"] is not None:
        other = explained["if_no_multicast"]["backend"] or "off"
        notes.append(f"{other} if no multicast")
    ons = [path["on"] for path in explained["used_by"].values()]
    if explained["backend"] is not None and True not in ons:
        notes.append("only in a model that fuses all-reduce itself")
    return f"{backend} ({'; '.join(notes)})" if notes else backend


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
    A multi-node row is given with and without an NVLink fabric (start-up
    probes it there), or once as "any" when that changes nothing; one node
    is not probed ("n/a").
    """
    columns = [f"`{FI_AR_BACKEND_ENV}`", "Nodes", "Fabric", "GPU", "HiSparse"]
    columns += ["FlashInfer", "Backend", "Why"]
    lines = [
        f"| {' | '.join(columns)} |",
        f"|{' --- |' * len(columns)}",
    ]
    worlds = flashinfer_worlds()
    for setting in FI_AR_BACKEND_CHOICES:
        for node_count in (1, 2):
            fabrics = [("n/a", None)] if node_count == 1 else _FABRICS
            for capability in (90, 100):
                for hisparse in (False, True):
                    by_fabric = {
                        label: _rows_by_release(
                            FiArBackendInputs(
                                setting=setting,
                                node_count=node_count,
                                device_capability=capability,
                                hisparse=hisparse,
                                flashinfer_version=None,
                                fabric=fabric,
                            ),
                            worlds,
                        )
                        for label, fabric in fabrics
                    }
                    if len(fabrics) > 1 and all(
                        rows == by_fabric["yes"] for rows in by_fabric.values()
                    ):
                        by_fabric = {"any": by_fabric["yes"]}
                    for fabric_label, rows in by_fabric.items():
                        for label, row in rows.items():
                            lines.append(
                                f"| `{setting}` | {node_count} | {fabric_label} | "
                                f"SM{capability} | {'on' if hisparse else 'off'} | "
                                f"{label} | {row}"
                            )
    return "\n".join(lines) + "\n"


def _rows_by_release(
    inputs: FiArBackendInputs, worlds: list[tuple[str, str | None]]
) -> dict[str, str]:
    """The table's backend and why for `inputs` in each FlashInfer range,
    or once as "any" when the release changes nothing."""
    rows = {}
    for label, release in worlds:
        explained = explain_fi_ar_backend(
            dataclasses.replace(inputs, flashinfer_version=release)
        )
        why = explained["error"] or explained["reason"]
        rows[label] = f"{_describe_backend(explained)} | {why} |"
    if len(set(rows.values())) == 1:
        return {"any": next(iter(rows.values()))}
    return rows


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


def _explain_parser() -> _ExplainParser:
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


def _path_state(path: dict[str, Any]) -> str:
    if path["on"] is True:
        return "yes"
    if path["on"] is False:
        return f"no ({path['why']})"
    return f"depends on the model ({path['why']})"


def _print_text(
    explained: dict[str, Any], inputs: FiArBackendInputs, usage: FiArUsageInputs
) -> None:
    capability = inputs.device_capability
    multicast = {None: "unknown", True: "yes", False: "no"}[inputs.multicast]
    fuse = {None: "default", True: "true", False: "false"}[usage.fuse_allreduce_rms]
    print(f"FlashInfer all-reduce backend: {_describe_backend(explained)}")
    print(f"  why: {explained['error'] or explained['reason']}")
    if explained["used_by"] is not None:
        paths = "; ".join(
            f"{FI_AR_PATHS[name]}: {_path_state(path)}"
            for name, path in explained["used_by"].items()
        )
        print(f"  used by: {paths}")
    if explained["assumed"]:
        print(f"  assumed: {'; '.join(explained['assumed'])}")
    print(
        f"  inputs: {FI_AR_BACKEND_ENV}={inputs.setting}, "
        f"{inputs.node_count} node(s), "
        f"TP {usage.tensor_parallel_size or 'unknown'}, "
        f"GPU {f'SM{capability}' if capability else 'unknown'}, "
        f"HiSparse {'on' if inputs.hisparse else 'off'}, "
        f"multicast {multicast}, "
        + _fabric_input(inputs)
        + f"VLLM_ALLREDUCE_USE_FLASHINFER={int(usage.standalone_all_reduce)}, "
        f"fuse_allreduce_rms {fuse}, "
        + ("VLLM_BATCH_INVARIANT=1, " if usage.batch_invariant else "")
        + f"flashinfer-python {inputs.flashinfer_version or 'not installed'}"
        + _jit_cache_input(inputs)
    )


def _fabric_input(inputs: FiArBackendInputs) -> str:
    """The NVLink fabric part of the inputs line, once given; where it is
    unknown and counts, `assumed` says so."""
    if inputs.fabric is None:
        return ""
    return f"NVLink fabric {'yes' if inputs.fabric else 'no'}, "


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
        fabric=args.fabric,
    )
    explained = explain_deployment(inputs, usage)
    if args.json:
        print(json.dumps({**explained, "warnings": warnings}, indent=2))
    else:
        _print_text(explained, inputs, usage)
    return EXIT_START_UP_FAILS if explained["error"] else EXIT_WOULD_START


if __name__ == "__main__":
    # `python -m vllm.explain_flashinfer_all_reduce` is the documented
    # command: importing this module's package logs torch's notices first.
    sys.exit(main())
