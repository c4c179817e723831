# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The result of check_fused_all_reduce.py: the record `--json` prints
(`summarize`), and its summary for a person (`format_summary`)."""

from typing import Any

PROG = "check_fused_all_reduce"
BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"


def summarize(run: Any) -> dict[str, Any]:
    """The run as one record: what ran, what was checked, PASS or FAIL.
    `run` is the launcher, after the run: its args, the ranks' events, the
    faults (the first, then their aftermath), and RankStates."""
    args, events, faults, ranks = run.args, run.events, run.faults, run.ranks
    info: dict[str, Any] = next((e for e in events if e["event"] == "info"), {})
    configs = [e for e in events if e["event"] == "config" and e["rank"] == 0]
    iterations = min(s.progress["iterations"] for s in ranks)
    mismatches = sum(s.progress["mismatches"] for s in ranks)
    # The known issue outputs can show, as each rank that saw it reported it.
    zeroed = {"zeroed_tokens": sum(s.progress["findings"] for s in ranks)}
    known = [
        {k: e[k] for k in ("name", "fixed_in", "effect")} | zeroed
        for e in events
        if e["event"] == "known_issue"
    ][:1]
    reasons = [f"{mismatches} outputs out of tolerance"] if mismatches else []
    if faults:
        reasons.insert(0, "a rank faulted or stalled")
    elif not all(s.done for s in ranks):
        reasons.append("not every rank finished")
    elif iterations == 0:
        reasons.append("nothing was checked")
    reasons += [
        f"FlashInfer known issue {k['name']!r} (fixed in {k['fixed_in']}): "
        f"{k['zeroed_tokens']} tokens zeroed"
        for k in known
    ]
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
        "elapsed": round(run.elapsed, 1),
        "host_traffic_mib": args.host_traffic_mib if args.device == "cuda" else 0,
        "configs": [
            {k: c[k] for k in ("dtype", "hidden", "backend", "tokens")} for c in configs
        ],
        "layers": args.layers,
        "input_sets": configs[0]["input_sets"] if configs else None,
        # The step's launches in order, and per fused call the host traffic
        # forked before it and not yet waited for.
        "step_nodes": configs[0]["step_nodes"] if configs else [],
        "in_flight": configs[0]["in_flight"] if configs else {},
        "iterations": iterations,
        "mismatches": mismatches,
        "mismatch_details": [e for e in events if e["event"] == "mismatch"],
        "known_issues": known,
        "faults": faults,
        "aftermath": run.aftermath,
        "latency": latency_rows([e for e in events if e["event"] == "latency"]),
        # vLLM's lines about FlashInfer: the start-up line, the workspace's.
        "startup_lines": list(
            dict.fromkeys(line for e in events for line in e.get("lines", ()))
        ),
    }


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
                    name = f"{timed}_{stat}_us"
                    if value is not None:
                        row[name] = max(row.get(name, 0.0), value * 1e6)
    return list(rows.values())


def traffic_line(result: dict[str, Any]) -> str:
    """Which fused calls were launched with host traffic in flight."""
    if result["device"] == "cpu":
        return "none (CPU)"
    if not result["host_traffic_mib"]:
        return "none (--host-traffic-mib 0)"
    calls = result["in_flight"].values()
    busy = [names for names in calls if names]
    gathers = [names for names in busy if any("gather" in n for n in names)]
    return (
        f"{len(busy)} of {len(calls)} fused calls launched with host traffic in "
        f"flight, {len(gathers)} of them across a HiSparse gather "
        f"({result['host_traffic_mib']} MiB copied each way per step)"
    )


def describe_fault(fault: dict[str, Any]) -> str:
    ranks = ", ".join(map(str, fault["ranks"]))
    return f"rank {ranks} {fault['kind']}: {fault['error']}"


def describe_mismatch(m: dict[str, Any]) -> str:
    return (
        f"rank {m['rank']}: {m['dtype']} hidden {m['hidden']}, {m['tokens']} "
        f"tokens, {m['call']} (input set {m['input_set']}), {m['output']} "
        f"output, token {m['token']}: worst error {m['worst_error']:.4g}, first "
        f"bad value {m['got']:.6g} (want {m['want']:.6g}) at column {m['column']}"
    )


def format_summary(result: dict[str, Any]) -> str:
    """The result for a person."""
    fi = result["flashinfer"] or {}
    platform = result["platform"] or {}
    where = "CPU (emulated kernel on gloo; no CUDA graphs, no host traffic)"
    if result["device"] == "cuda":
        where = (
            f"{result['tp']} x {platform.get('gpu')} (sm {platform.get('capability')})"
        )
    reasons = f" ({'; '.join(result['reasons'])})" if result["reasons"] else ""
    backends = ", ".join(result["backends"]) or result["decided_backend"]
    lines = [
        f"{PROG}: {result['verdict']}{reasons}",
        (
            f"  backend     {backends} ({BACKEND_ENV}="
            f"{result['backend_setting']}, HiSparse on)"
        ),
        f"  FlashInfer  {fi.get('release')} kernels ({fi.get('package')})",
        f"  devices     {where}, {result['nodes']} node(s)",
        (
            f"  replays     {result['iterations']} per rank in "
            f"{result['elapsed']:.0f}s; steps of {result['layers']} layers, two "
            f"fused calls each; {result['input_sets']} input sets by call index"
        ),
        f"  traffic     {traffic_line(result)}",
        f"  mismatches  {result['mismatches']}",
        *(f"    {describe_mismatch(m)}" for m in result["mismatch_details"][:10]),
        f"  known issues {len(result['known_issues'])}",
        *(
            f"    {k['name']} (fixed in FlashInfer {k['fixed_in']}): "
            f"{k['zeroed_tokens']} tokens zeroed; {k['effect']}"
            for k in result["known_issues"]
        ),
        f"  faults      {len(result['faults'])}",
        *(f"    {describe_fault(f)}" for f in result["faults"]),
    ]
    timed = ("step_p50", "step_p99", "fused_call_p50", "fused_call_p99")
    if result["latency"]:
        heads = "".join(f"{t.replace('_', ' '):>15}" for t in timed)
        lines.append(f"  time (us)   dtype hidden tokens{heads}")
    for row in result["latency"]:
        cells = "".join(f"{row.get(f'{t}_us', 0):15.1f}" for t in timed)
        shape = f"{row['dtype']:5} {row['hidden']:6} {row['tokens']:6}"
        lines.append(f"              {shape}{cells}")
    return "\n".join(lines)
