# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check that every request of saved `vllm bench serve` waves really finished.

`vllm bench serve` counts a streamed request as successful once one chunk
arrived, and exits 0 even when requests failed. When the engine dies
mid-stream, vLLM's server ends each open stream with an error event and
`data: [DONE]`: the client books those requests as successful with however
many tokens they got, and `errors` stays empty for them.

Save each wave with `--save-result --save-detailed --ignore-eos`, then:

    python benchmarks/check_waves.py --output-len 1024 wave-1.json wave-2.json

Three checks per file (one wave), on the fields vllm 0.33.0's
`vllm/benchmarks/serve.py` saves: `completed` equals `num_prompts` and the
requests in the file, no request has an error, and each request's
`output_lens` reaches `--output-len`. One line per wave, then the verdict;
exit 0 when every wave passed, 1 when one failed, 2 for bad usage or a file
that cannot be judged.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROG = "check_waves"
# Problems listed in full per wave; the rest are counted.
LISTED = 3


class Unjudgeable(Exception):
    """A file this script cannot judge; one line, exit 2."""


def load(path: Path) -> dict[str, Any]:
    """One saved result, with the fields the checks read, or Unjudgeable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise Unjudgeable(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise Unjudgeable(
            f"{path}: not one `vllm bench serve` result ({e}); a file written "
            "with --append-result holds several, save each wave on its own"
        ) from None
    if not isinstance(data, dict):
        raise Unjudgeable(f"{path}: not a `vllm bench serve` result")
    for key in ("num_prompts", "completed"):
        if not _is_int(data.get(key)):
            raise Unjudgeable(f"{path}: no integer {key!r}; not a result file")
    for key, kind in (("output_lens", int), ("errors", str)):
        values = data.get(key)
        if values is None:
            raise Unjudgeable(
                f"{path}: no {key!r}; save waves with --save-detailed so each "
                "request's output length and error are kept"
            )
        if not isinstance(values, list) or not all(
            _is_int(v) if kind is int else isinstance(v, str) for v in values
        ):
            raise Unjudgeable(f"{path}: {key!r} is not a list of {kind.__name__}s")
    if len(data["output_lens"]) != len(data["errors"]):
        raise Unjudgeable(f"{path}: 'output_lens' and 'errors' differ in length")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def problems(data: dict[str, Any], output_len: int) -> list[str]:
    """Why a wave failed, most telling first; empty when it passed."""
    found = []
    requests = len(data["output_lens"])
    if data["completed"] != data["num_prompts"] or requests != data["num_prompts"]:
        found.append(
            f"{data['completed']} of {data['num_prompts']} prompts completed "
            f"({requests} requests in the file)"
        )
    errors = [(i, e) for i, e in enumerate(data["errors"]) if e]
    if errors:
        found.append(f"{len(errors)} with errors")
        # The last line of a client traceback names the exception.
        found += [
            f"request {i}: {(e.strip().splitlines() or [''])[-1][:120]}"
            for i, e in errors[:LISTED]
        ]
    short = [
        (i, n)
        for i, (n, e) in enumerate(
            zip(data["output_lens"], data["errors"], strict=True)
        )
        if not e and n < output_len
    ]
    if short:
        found.append(f"{len(short)} short of {output_len} output tokens")
        found += [f"request {i}: {n} tokens" for i, n in short[:LISTED]]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output-len",
        type=int,
        required=True,
        metavar="N",
        help="the output tokens every request asked for "
        "(--random-output-len, or --output-len, of the bench)",
    )
    parser.add_argument(
        "results",
        type=Path,
        nargs="+",
        metavar="RESULT",
        help="a --save-detailed result file of one wave",
    )
    args = parser.parse_args(argv)
    if args.output_len < 1:
        parser.error("--output-len must be 1 or more")
    try:
        waves = [(path, load(path)) for path in args.results]
    except Unjudgeable as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    failed = 0
    for path, data in waves:
        found = problems(data, args.output_len)
        failed += bool(found)
        requests = len(data["output_lens"])
        print(
            f"{path}: FAIL: {'; '.join(found)}"
            if found
            else f"{path}: PASS: {requests} of {requests} requests complete, "
            f"each with {args.output_len} output tokens or more"
        )
    if failed:
        print(f"{PROG}: FAIL: {failed} of {len(waves)} waves failed")
        return 1
    print(f"{PROG}: PASS: {len(waves)} wave{'s' * (len(waves) != 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
