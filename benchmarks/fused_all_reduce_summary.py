# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The result of check_fused_all_reduce.py: one record, and its summary.

`summarize` turns what the ranks reported into the record `--json` prints;
`format_summary` writes it for a person.
"""

import argparse
from typing import Any

PROG = "check_fused_all_reduce"
BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"


def summarize(
    args: argparse.Namespace,
    seconds: float,
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    aftermath: list[dict[str, Any]],
    ranks: list[Any],
    elapsed: float,
) -> dict[str, Any]:
    """The run as one record: what ran, what was checked, PASS or FAIL.

    `ranks` are the launcher's RankStates: each rank's iterations,
    mismatches and whether it finished.
    """
    info = next((e for e in events if e["event"] == "info"), {})
    # vLLM's lines about FlashInfer (the start-up line, the workspace's), as
    # printed while it ran.
    lines = list(dict.fromkeys(line for e in events for line in e.get("lines", ())))
    configs = [e for e in events if e["event"] == "config" and e["rank"] == 0]
    mismatches = [e for e in events if e["event"] == "mismatch"]
    known = known_issues(events, ranks)
    latency = latency_rows([e for e in events if e["event"] == "latency"])
    iterations = min(s.iterations for s in ranks)
    mismatch_count = sum(s.mismatches for s in ranks)
    reasons = []
    if faults:
        reasons.append("a rank faulted or stalled")
    if mismatch_count:
        reasons.append(f"{mismatch_count} outputs out of tolerance")
    for issue in known:
        reasons.append(
            f"FlashInfer known issue {issue['name']!r} (fixed in "
            f"{issue['fixed_in']}): {issue['zeroed_tokens']} tokens zeroed"
        )
    if not faults and not all(s.done for s in ranks):
        reasons.append("not every rank finished")
    if not faults and iterations == 0:
        reasons.append("nothing was checked")
    return {
        "verdict": "FAIL" if reasons else "PASS",
        "reasons": reasons,
        "backend_setting": getattr(args, "backend_setting", None),
        "decided_backend": info.get("decided_backend"),
        "backends": sorted({c["backend"] for c in configs}),
        "flashinfer": info.get("kernel"),
        "platform": info.get("platform"),
        "nodes": info.get("nodes"),
        "tp": args.tp,
        "device": args.device,
        "hisparse": args.hisparse,
        "seconds": seconds,
        "elapsed": round(elapsed, 1),
        "host_traffic_mib": args.host_traffic_mib if args.device == "cuda" else 0,
        # Per fused call of the step: the host traffic forked before it and
        # not yet waited for, and the step's launches in order.
        "in_flight": configs[0]["in_flight"] if configs else {},
        "step_nodes": configs[0]["step_nodes"] if configs else [],
        "configs": [
            {k: c[k] for k in ("dtype", "hidden", "backend", "tokens")} for c in configs
        ],
        "layers": getattr(args, "layers", None),
        "input_sets": getattr(args, "input_sets", None),
        "iterations": iterations,
        "mismatches": mismatch_count,
        "mismatch_details": mismatches,
        "known_issues": known,
        "faults": faults,
        "aftermath": aftermath,
        "latency": latency,
        "startup_lines": lines,
    }


def known_issues(events: list[dict[str, Any]], ranks: list[Any]) -> list[dict]:
    """The known FlashInfer issues the outputs showed, apart from
    mismatches: each with its fixing release and the tokens it zeroed."""
    found: dict[str, dict[str, Any]] = {}
    for event in (e for e in events if e["event"] == "known_issue"):
        entry = found.setdefault(
            event["name"],
            {k: event[k] for k in ("name", "fixed_in", "effect")} | {"shapes": []},
        )
        shape = {k: event[k] for k in ("rank", "dtype", "hidden", "tokens")}
        if shape not in entry["shapes"]:
            entry["shapes"].append(shape)
    for entry in found.values():
        # Every zeroed token counts, also those past the events sent in full.
        entry["zeroed_tokens"] = sum(s.findings for s in ranks)
    return list(found.values())


def latency_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape, the slowest rank's: the step's time per replay (its GEMMs,
    fused calls and host traffic), and the time per fused call of the
    graph that holds the fused calls alone."""
    rows: dict[tuple, dict[str, Any]] = {}
    for event in events:
        for bucket in event["buckets"]:
            key = (event["dtype"], event["hidden"], bucket["tokens"])
            row = rows.setdefault(
                key, {"dtype": key[0], "hidden": key[1], "tokens": key[2]}
            )
            for timed in ("step", "fused_call"):
                for stat, value in bucket[timed].items():
                    if value is not None:
                        name = f"{timed}_{stat}_us"
                        row[name] = max(row.get(name, 0.0), value * 1e6)
    return list(rows.values())


def traffic_line(result: dict[str, Any]) -> str:
    """Which fused calls were launched with host traffic in flight."""
    if result["device"] == "cpu":
        return "none (CPU)"
    if not result["host_traffic_mib"]:
        return "none (--host-traffic-mib 0)"
    in_flight = result["in_flight"]
    busy = [c for c, names in in_flight.items() if names]
    gathers = [c for c, names in in_flight.items() if any("gather" in n for n in names)]
    return (
        f"{len(busy)} of {len(in_flight)} fused calls launched with host traffic "
        f"in flight, {len(gathers)} of them with a HiSparse gather "
        f"({result['host_traffic_mib']} MiB copied each way per step)"
    )


def describe_fault(fault: dict[str, Any]) -> str:
    ranks = ", ".join(map(str, fault["ranks"]))
    return f"rank {ranks} {fault['kind']}: {fault['error']}"


def describe_mismatch(m: dict[str, Any]) -> str:
    return (
        f"rank {m['rank']}: {m['dtype']} hidden {m['hidden']}, {m['tokens']} "
        f"tokens, {m['call']} (input set {m['input_set']}), "
        f"{m['output']} output, token {m['token']}: worst error "
        f"{m['worst_error']:.4g}, first bad value {m['got']:.6g} "
        f"(want {m['want']:.6g}) at column {m['column']}"
    )


def format_summary(result: dict[str, Any]) -> str:
    """The result for a person."""
    fi = result["flashinfer"] or {}
    platform = result["platform"] or {}
    if result["device"] == "cpu":
        where = "CPU (emulated kernel on gloo; no CUDA graphs, no host traffic)"
    else:
        where = (
            f"{result['tp']} x {platform.get('gpu')} "
            f"(sm {platform.get('capability')}), NVLink fully connected: "
            f"{platform.get('nvlink_fully_connected')}"
        )
    backends = ", ".join(result["backends"]) or result["decided_backend"] or "off"
    hisparse = "on" if result["hisparse"] else "off"
    lines = [
        f"{PROG}: {result['verdict']}"
        + (f" ({'; '.join(result['reasons'])})" if result["reasons"] else ""),
        (
            f"  backend     {backends} ({BACKEND_ENV}="
            f"{result['backend_setting']}, HiSparse {hisparse})"
        ),
        f"  FlashInfer  {fi.get('release')} kernels"
        + (f" ({fi['package']})" if fi.get("package") else ""),
        f"  devices     {where}, {result['nodes']} node(s)",
        (
            f"  replays     {result['iterations']} per rank in "
            f"{result['elapsed']:.0f}s; steps of {result['layers']} layers, two "
            f"fused calls each; {result['input_sets']} input sets"
        ),
        f"  traffic     {traffic_line(result)}",
        f"  mismatches  {result['mismatches']}",
    ]
    lines += [f"    {describe_mismatch(m)}" for m in result["mismatch_details"][:10]]
    lines.append(f"  known issues {len(result['known_issues'])}")
    lines += [
        f"    {k['name']} (fixed in FlashInfer {k['fixed_in']}): "
        f"{k['zeroed_tokens']} tokens zeroed; {k['effect']}"
        for k in result["known_issues"]
    ]
    lines.append(f"  faults      {len(result['faults'])}")
    lines += [f"    {describe_fault(f)}" for f in result["faults"]]
    if result["latency"]:
        lines.append(
            "  time (us)   dtype hidden tokens  step p50  step p99  fused call p50  p99"
        )
        for row in result["latency"]:
            lines.append(
                f"              {row['dtype']:5} {row['hidden']:6} {row['tokens']:6} "
                f"{row.get('step_p50_us', 0):9.1f} {row.get('step_p99_us', 0):9.1f} "
                f"{row.get('fused_call_p50_us', 0):15.1f} "
                f"{row.get('fused_call_p99_us', 0):5.1f}"
            )
    return "\n".join(lines)
