# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused all-reduce check's own cost per iteration, on CPU.

Runs `check_fused_all_reduce.py --device cpu --json` for each hidden size
and reports, per replayed step (L layers), the wall time and how it splits:
the step itself (here the emulated kernel on gloo, and the GEMMs), queueing
the checks of its outputs, and the rest, which is the harness's own cost
(loading the input sets, reading the checks, the progress record). On GPUs
the same split is in the check's own --json output (`iteration_cost_us`),
with the step timed by CUDA events; read the GPU's harness share against
this one.

    python benchmarks/benchmark_check_fused_all_reduce.py [--tp 2] [--seconds 10]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parent / "check_fused_all_reduce.py"


def measure(tp: int, seconds: float, hidden: int, max_tokens: int, layers: int) -> dict:
    """One CPU run of the check; its cost per iteration."""
    proc = subprocess.run(
        [
            sys.executable,
            str(CHECK),
            "-tp",
            str(tp),
            "--device",
            "cpu",
            "--json",
            "--seconds",
            str(seconds),
            "--dtypes",
            "bf16",
            "--hidden-sizes",
            str(hidden),
            "--max-tokens",
            str(max_tokens),
            "--layers",
            str(layers),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 900,
    )
    if not proc.stdout.strip():
        raise RuntimeError(f"the check printed no result:\n{proc.stderr}")
    result = json.loads(proc.stdout)
    if result["verdict"] != "PASS":
        raise RuntimeError(f"the check failed: {result['reasons']}")
    return {"iterations": result["iterations"], **result["iteration_cost_us"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hidden-sizes", default="256,7168")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    print(
        f"{'hidden':>6} {'steps':>10} {'us/step':>12} {'step':>9} "
        f"{'checks':>9} {'harness':>9}"
    )
    for hidden in (int(h) for h in args.hidden_sizes.split(",")):
        cost = measure(args.tp, args.seconds, hidden, args.max_tokens, args.layers)
        print(
            f"{hidden:>6} {cost['iterations']:>10} {cost['total']:>12.0f} "
            f"{cost['op']:>9.0f} {cost['check']:>9.0f} {cost['harness']:>9.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
