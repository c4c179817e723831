# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The result of check_fused_all_reduce.py: the record `--json` prints
(`summarize`), and its summary for a person (`format_summary`)."""

from typing import Any

PROG = "check_fused_all_reduce"
BACKEND_ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"


def sm(capability: int) -> str:
    """A capability as vLLM prints it: 10.0 for 100."""
    return f"{capability // 10}.{capability % 10}"


def summarize(run: Any) -> dict[str, Any]:
    """The run as one record: what ran, what was checked, PASS or FAIL.
    `run` is the launcher, after the run: its args, the ranks' events, the
    faults (the first, then their aftermath), and RankStates."""
    args, events, faults, ranks = run.args, run.events, run.faults, run.ranks
    infos = sorted((e for e in events if e["event"] == "info"), key=lambda e: e["rank"])
    info: dict[str, Any] = infos[0] if infos else {}
    overlaps = [e["overlap"] for e in events if e["event"] == "overlap"]
    covered, total = (sum(o[i] for o in overlaps) for i in (0, 1))
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
        # Each rank's own device, as it reported it.
        "devices": [(e.get("platform") or {}).get("device") for e in infos],
        "nodes": info.get("nodes"),
        "tp": args.tp,
        "device": args.device,
        # Whose row of vLLM's fusion table served -tp: the GPUs' on GPUs.
        "capability": args.capability,
        "elapsed": round(run.elapsed, 1),
        "host_traffic_mib": args.host_traffic_mib if args.device == "cuda" else 0,
        "configs": [
            {k: c[k] for k in ("dtype", "hidden", "backend", "tokens")} for c in configs
        ],
        "layers": args.layers,
        "input_sets": configs[0]["input_sets"] if configs else None,
        # On CPU, what made rank 0's workspace for each shape: FlashInfer's
        # own creation, and the calls to the CUDA faked below it.
        "creation": [c["creation"] for c in configs if "creation" in c],
        # The step's launches in order: (stream, op, call or layer).
        "step_nodes": configs[0]["step_nodes"] if configs else [],
        # Of the fused calls' time in the last replay of each burst, the
        # share with traffic in flight, from the GPU's event timestamps.
        "traffic_overlap": round(covered / total, 3) if total else None,
        "iterations": iterations,
        "mismatches": mismatches,
        "mismatch_details": [e for e in events if e["event"] == "mismatch"],
        "known_issues": known,
        "faults": faults,
        "aftermath": run.aftermath,
        # vLLM's lines about FlashInfer: the start-up line, the workspace's.
        "startup_lines": list(
            dict.fromkeys(line for e in events for line in e.get("lines", ()))
        ),
    }


def traffic_line(result: dict[str, Any]) -> str:
    """How much of the fused calls' time had host traffic in flight."""
    if result["device"] == "cpu":
        return "none (CPU)"
    if not result["host_traffic_mib"]:
        return "none (--host-traffic-mib 0)"
    share = result["traffic_overlap"]
    measured = "not measured" if share is None else f"{100 * share:.0f}%"
    return (
        f"in flight for {measured} of fused-call time (GPU event timestamps, "
        "each burst's last replay); per call 4 MiB copied each way, per layer "
        "a gather of 8 x 1024 misses over the "
        f"{result['host_traffic_mib']} MiB pool"
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


def creation_line(creation: list[dict[str, Any]]) -> list[str]:
    """On CPU: FlashInfer's own creation ran, with CUDA faked below it, and
    an emulated kernel stood in for FlashInfer's."""
    if not creation:
        return []
    calls, kind = creation[-1]["driver_calls"], creation[-1]["workspace"]
    line = (
        f"  creation    FlashInfer's own, {len(creation)} time(s) "
        f"({kind.rpartition('.')[2]}), CUDA faked below it "
        f"(tests/distributed/fake_cuda.py: {calls.get('cuMemCreate', 0)} "
        f"cuMemCreate, {sum(calls.values())} calls on rank 0); kernel emulated"
    )
    return [line]


def format_summary(result: dict[str, Any]) -> str:
    """The result for a person."""
    fi = result["flashinfer"] or {}
    platform = result["platform"] or {}
    where = (
        f"CPU, vLLM's fusion table read for sm {sm(result['capability'])} "
        "(emulated kernel on gloo; no CUDA graphs, no host traffic)"
    )
    if result["device"] == "cuda":
        where = (
            f"{result['tp']} x {platform.get('gpu')} (sm {platform.get('capability')}"
            f"; {', '.join(map(str, result['devices']))})"
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
        *creation_line(result["creation"]),
        (
            f"  replays     {result['iterations']} per rank in "
            f"{result['elapsed']:.0f}s; steps of {result['layers']} layers, two "
            f"fused calls each; {result['input_sets']} input sets by Lamport slot"
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
    return "\n".join(lines)
