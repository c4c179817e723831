# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Patch: added by the downstream HiSparse fix (vllm#64327), beside the replaced
#  flashinfer_all_reduce.py. Goes away with that file.
"""The answer for a deployment: backend, the paths that use it, and why.

`python -m vllm.explain_flashinfer_all_reduce` starts `main` here: it reads
the deployment (`flashinfer_all_reduce_deployment`), answers with the
decision of `flashinfer_all_reduce_policy` and vLLM's own rules for which of
its paths run FlashInfer all-reduce, and prints the answer as text or JSON;
`--table` prints the decision table of the docs.
"""

import ast
import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from packaging.version import Version

from vllm.config.compilation import PassConfig
from vllm.distributed.device_communicators.flashinfer_all_reduce_deployment import (
    DEFAULT_USAGE,
    EXIT_START_UP_FAILS,
    EXIT_WOULD_START,
    FiArUsageInputs,
    explain_parser,
    read_deployment,
)
from vllm.distributed.device_communicators.flashinfer_all_reduce_policy import (
    FI_AR_BACKEND_CHOICES,
    FI_AR_BACKEND_ENV,
    FI_AR_KNOWN_ISSUES,
    FLASHINFER_VERSION_CHECK_ENV,
    MNNVL_KERNEL_MODULE,
    MNNVL_MULTI_NODE_MIN_CAPABILITY,
    NO_FLASHINFER,
    FiArBackendInputs,
    backend_span_error,
    decide_fi_ar_backend,
    known_issue_detail,
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
# vLLM 0.33.0's paths that run FlashInfer all-reduce, by their JSON key.
FI_AR_PATHS = {
    "standalone": "standalone all-reduce",
    "fusion_pass": "fusion pass",
    "model": "model's own fusion",
}
# The top-level keys of every answer (the JSON adds "warnings"), also of
# each answer in "by_gpu".
ANSWER_KEYS = (
    "state",
    "backend",
    "depends_on",
    "by_gpu",
    "allow_trtllm_fallback",
    "reason",
    "known_issue",
    "known_issue_detail",
    "if_no_multicast",
    "error",
    "used_by",
    "assumed",
    "inputs",
)
# What "state" says of an answer, for a script: FlashInfer all-reduce runs,
# is off, start-up fails on it, or it depends on what explain was not told
# ("depends_on" names it).
STATES = ("on", "off", "start-up fails", "unknown")
# Why a path that would run FlashInfer all-reduce does not, when the backend
# chosen for the group is none.
BACKEND_OFF = "the group's backend is off"
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
    """An answer with every key of ANSWER_KEYS, None where not given, and
    its state."""
    unknown = set(fields) - set(ANSWER_KEYS)
    assert not unknown, unknown
    answer = {key: fields.get(key) for key in ANSWER_KEYS}
    if answer["depends_on"] is not None:
        answer["state"] = "unknown"
    elif answer["error"] is not None:
        answer["state"] = "start-up fails"
    else:
        answer["state"] = "off" if answer["backend"] is None else "on"
    return answer


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: sets as sorted lists."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value


def _inputs(inputs: FiArBackendInputs, usage: FiArUsageInputs) -> dict[str, Any]:
    return _plain({**dataclasses.asdict(inputs), **dataclasses.asdict(usage)})


def _with_backend_off(used_by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The paths of a group whose backend is off: none runs FlashInfer
    all-reduce; a path already off keeps its own reason."""
    return {
        name: path if path["on"] is False else {"on": False, "why": BACKEND_OFF}
        for name, path in used_by.items()
    }


def explain_fi_ar_backend(
    inputs: FiArBackendInputs, usage: FiArUsageInputs = DEFAULT_USAGE
) -> dict[str, Any]:
    """The decision for `inputs` and whether start-up would fail, as data.

    While multicast is unknown (as at start-up), `if_no_multicast` holds the
    decision for a node without it when that differs. Where no path runs
    FlashInfer all-reduce, the backend is off whatever the decision, and
    start-up cannot fail on it; where the backend is off, no path runs it.
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
    if decision.backend is None:
        used_by = _with_backend_off(used_by)
    return _answer(
        backend=decision.backend,
        allow_trtllm_fallback=decision.allow_trtllm_fallback,
        reason=decision.reason,
        known_issue=decision.known_issue,
        known_issue_detail=known_issue_detail(inputs, decision),
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
        # A range of releases stands for the one release.
        why = why.replace(NO_FLASHINFER, f"flashinfer-python {label}")
        rows[label] = f"{_describe_backend(explained)} | {why} |"
    if len(set(rows.values())) == 1:
        return {"any": next(iter(rows.values()))}
    return rows


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
    _print_known_issue(explained["known_issue_detail"])
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


def _print_known_issue(detail: dict[str, Any] | None) -> None:
    """What the log line leaves out: the issue, whose kernels, the fix."""
    if detail is None:
        return
    print(
        f"  known issue: {detail['name']}: {detail['summary']} "
        f"({', '.join(detail['links'])})"
    )
    print(f"  MNNVL kernels: {detail['kernels']}")
    if detail["fixed_in"]:
        print(f"  fixed in: {detail['fixed_in']}")
    if detail["get_fix"]:
        print(f"  to get the fix: {detail['get_fix']}")
    print(f"  override: {detail['override']}")


def _fabric_input(inputs: FiArBackendInputs) -> str:
    """The NVLink fabric part of the inputs line, once given; where it is
    unknown and counts, `assumed` says so."""
    if inputs.fabric is None:
        return ""
    return f"NVLink fabric {'yes' if inputs.fabric else 'no'}, "


def _jit_cache_input(inputs: FiArBackendInputs) -> str:
    """The jit-cache part of the inputs line, if there is one."""
    parts = []
    if inputs.flashinfer_aot_module:
        parts.append(f"flashinfer/data/aot/{MNNVL_KERNEL_MODULE}")
    if inputs.flashinfer_jit_cache_version is not None:
        parts.append(f"flashinfer-jit-cache {inputs.flashinfer_jit_cache_version}")
        parts += [
            f"{provider.distribution} {provider.version}"
            for provider in inputs.flashinfer_jit_cache_providers
        ]
    if parts and not inputs.flashinfer_version_check:
        parts.append(f"{FLASHINFER_VERSION_CHECK_ENV} set")
    return "".join(f", {part}" for part in parts)


def main(argv: list[str] | None = None) -> int:
    """Print the backend choice for the given deployment; see EPILOG."""
    if argv is None:
        argv = sys.argv[1:]
    parser = explain_parser()
    parser.json_errors = "--json" in argv
    args = parser.parse_args(argv)
    if args.table:
        print(fi_ar_decision_table(), end="")
        return EXIT_WOULD_START
    inputs, usage, warnings = read_deployment(parser, args)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
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
