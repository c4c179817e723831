# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
r"""Check that every request of every `vllm bench serve` wave really finished.

Why this exists: `vllm bench serve` marks a streamed request as successful as
soon as one chunk arrived. When the engine dies mid-stream, the vLLM server
ends each open stream with an error event and `data: [DONE]`, so the client
books those requests as *successful* with however many tokens they got (no
usage chunk came, so their length is counted by re-tokenizing the text), and
`errors` stays empty for them. A crashed run can therefore look clean. This
script runs or reads waves and fails unless every request produced the full
requested output length and the server kept answering.

Run mode (against an already running server; everything after `--` goes to
`vllm bench serve` unchanged)::

    python benchmarks/check_waves.py --waves 3 -- \
        --model M --dataset-name random --random-input-len 2048 \
        --random-output-len 1024 --num-prompts 64 --max-concurrency 64

Each wave adds `--ignore-eos --save-result --save-detailed --result-dir DIR
--result-filename wave-NNN.json` and `--metadata check_waves_expected_output_len=N`
(merged into the user's own `--metadata`, since the last `--metadata` wins),
writes the bench output to `wave-NNN.log`, and then asks `GET /health`.

Read mode (already saved files, one wave per file; they must have been saved
with `--save-detailed`)::

    python benchmarks/check_waves.py --results a.json b.json \
        --expected-output-len 1024

How "asked for" is known: vLLM 0.33.0 does not save the requested length of
each request, nor `ignore_eos`, nor `--random-output-len`, in the result file
(`vllm/benchmarks/serve.py:main_async` saves `num_prompts`, the `--metadata`
pairs and what `benchmark()` returns). So every request of a wave is taken to
have asked for one length N, taken from, in this order of authority:

1. `--expected-output-len N` (must agree with the sources below if present);
2. the `check_waves_expected_output_len` metadata key, which run mode stores
   in each result file;
3. run mode only: the bench args, for `--dataset-name random` (the default)
   with an output range ratio of 0: `--output-len`, else
   `--random-output-len`, else 128 (the dataset default), as
   `serve.py:main_async` resolves them. Other datasets, and args kept in a
   `--config` file, need `--expected-output-len`.

Request i is *failed* when `errors[i]` is not empty, and *short* when it is
not failed and `output_lens[i]` < N. Short only means something under
`--ignore-eos`, which run mode always passes and read mode assumes (the
random dataset also turns it on by itself for OpenAI-compatible backends).

A wave fails when a request is short or failed; when `failed` > 0; when
`completed` is not the number of requests in the file, or that number is not
`num_prompts`; and in run mode when the bench command exits non-zero, times
out or writes no readable file, or `GET /health` does not answer 200 after
the wave (or before the first one). Run mode stops at the first failed wave
unless `--keep-going`. Note that `vllm bench serve` itself exits 0 even when
requests failed.

Exit status: 0 every wave passed, 1 a wave failed, 2 bad usage or a result
file this script cannot judge.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXPECTED_LEN_KEY = "check_waves_expected_output_len"
RANDOM_DATASET_DEFAULT_OUTPUT_LEN = 128
# Flags this script sets for every wave; a user value would change where the
# result goes or its format (`--append-result` writes several JSON documents).
RESERVED_BENCH_FLAGS = ("--result-dir", "--result-filename", "--append-result")
TABLE_COLUMNS = ("wave", "requests", "complete", "short", "output tok/s")
NO_WAVE = "-"  # the row for a server that was down before the first wave


class UsageError(Exception):
    """Bad arguments or an unusable result file: the waves cannot be judged."""


@dataclass
class WaveReport:
    """What one wave did, and every reason it failed (none when it passed)."""

    wave: str
    source: str = ""
    requests: int | None = None
    complete: int | None = None
    short: int | None = None
    output_throughput: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """A wave passes only if nothing at all was found wrong with it."""
        return not self.problems

    @property
    def name(self) -> str:
        """How problem lines name the wave: its number and, if read, its file."""
        if self.wave == NO_WAVE:
            return "server"
        if self.source:
            return f"wave {self.wave} ({self.source})"
        return f"wave {self.wave}"


def load_result(path: Path) -> dict[str, Any]:
    """Read one result file; a wrong shape is a usage error, not a pass."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UsageError(
            f"{path}: not a single `vllm bench serve` result JSON ({e}); "
            "files written with --append-result hold several, split them"
        ) from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int_list(data: dict[str, Any], key: str, path: Path) -> list[int]:
    """Per-request counts; missing means the file cannot prove anything."""
    values = data.get(key)
    if values is None:
        raise UsageError(
            f"{path}: no '{key}' array; save results with --save-detailed "
            "so each request's output length and error are kept"
        )
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise UsageError(f"{path}: '{key}' is not a list of integers")
    return values


def _str_list(data: dict[str, Any], key: str, path: Path) -> list[str]:
    """Per-request error strings; see `_int_list` for why missing is fatal."""
    values = data.get(key)
    if values is None:
        raise UsageError(f"{path}: no '{key}' array; save with --save-detailed")
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise UsageError(f"{path}: '{key}' is not a list of strings")
    return values


def _count(data: dict[str, Any], key: str, path: Path) -> int:
    """A top-level request count that every generation result file has."""
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{path}: '{key}' is missing or not an integer")
    return value


def expected_len_from_file(
    data: dict[str, Any], path: Path, explicit: int | None
) -> int:
    """The length every request asked for; conflicting sources are refused."""
    stored = data.get(EXPECTED_LEN_KEY)
    if stored is None:
        if explicit is None:
            raise UsageError(
                f"{path}: the file does not record the requested output length; "
                "pass --expected-output-len"
            )
        return explicit
    try:
        recorded = int(stored)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: bad {EXPECTED_LEN_KEY}={stored!r}") from e
    if explicit is not None and explicit != recorded:
        raise UsageError(
            f"{path}: --expected-output-len {explicit} contradicts "
            f"{EXPECTED_LEN_KEY}={recorded} recorded in the file"
        )
    return recorded


def _last_line(text: str, limit: int = 160) -> str:
    """The last line of a client traceback names the exception; keep it short."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else text.strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check_result(
    data: dict[str, Any], path: Path, wave: str, expected: int
) -> WaveReport:
    """Judge one saved wave from its per-request arrays, not its summary."""
    output_lens = _int_list(data, "output_lens", path)
    errors = _str_list(data, "errors", path)
    completed = _count(data, "completed", path)
    failed = _count(data, "failed", path)
    num_prompts = _count(data, "num_prompts", path)
    throughput = data.get("output_throughput")
    if len(errors) != len(output_lens):
        raise UsageError(
            f"{path}: {len(output_lens)} output_lens but {len(errors)} errors"
        )
    report = WaveReport(
        wave=wave,
        requests=len(output_lens),
        complete=completed,
        output_throughput=float(throughput)
        if isinstance(throughput, (int, float))
        else None,
    )
    short = [
        (i, n)
        for i, (n, err) in enumerate(zip(output_lens, errors, strict=True))
        if not err and n < expected
    ]
    report.short = len(short)
    if num_prompts != len(output_lens):
        report.problems.append(
            f"{len(output_lens)} requests in the file but --num-prompts was "
            f"{num_prompts}"
        )
    if failed:
        report.problems.append(f"{failed} request(s) failed")
    if completed != len(output_lens):
        report.problems.append(
            f"only {completed} of {len(output_lens)} requests completed"
        )
    for i, err in enumerate(errors):
        if err:
            report.problems.append(f"request {i} failed: {_last_line(err)}")
    for i, n in short:
        report.problems.append(f"request {i} short: {n} of {expected} output tokens")
    return report


def check_files(paths: Sequence[Path], explicit: int | None) -> list[WaveReport]:
    """Read mode: one wave per file, in the order given."""
    reports = []
    for wave, path in enumerate(paths, start=1):
        data = load_result(path)
        expected = expected_len_from_file(data, path, explicit)
        report = check_result(data, path, str(wave), expected)
        report.source = str(path)
        reports.append(report)
    return reports


def _normalize_flag(token: str) -> str:
    """The bench parser accepts `--a_b` for `--a-b`; match it so no flag hides."""
    if not token.startswith("--"):
        return token
    key, sep, value = token.partition("=")
    return key.replace("_", "-") + sep + value


def parse_bench_args(bench_args: Sequence[str]) -> argparse.Namespace:
    """Pick out the few `vllm bench serve` flags this script must know about.

    Defaults mirror vllm 0.33.0 (`benchmarks/serve.py:add_cli_args` and
    `benchmarks/datasets/datasets.py:add_dataset_parser`).
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--dataset-name", default="random")
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument(
        "--random-output-len", type=int, default=RANDOM_DATASET_DEFAULT_OUTPUT_LEN
    )
    parser.add_argument("--random-range-ratio", default="0.0")
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", default=None)
    try:
        known, _ = parser.parse_known_args([_normalize_flag(t) for t in bench_args])
    except SystemExit as e:
        raise UsageError(f"cannot read the bench args {list(bench_args)}") from e
    return known


def _output_range_ratio(value: str) -> float:
    """`--random-range-ratio` is a float or a JSON {"input": x, "output": y}."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = json.loads(value)
        return float(parsed["output"])
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"cannot read --random-range-ratio {value!r}") from e


def expected_len_from_bench_args(bench: argparse.Namespace) -> int | None:
    """What the random dataset asks of every request, or None if unknowable."""
    if bench.config is not None or bench.dataset_name != "random":
        return None
    if _output_range_ratio(bench.random_range_ratio) != 0.0:
        raise UsageError(
            "--random-range-ratio gives each request its own output length, "
            "which the result file does not record; use an output ratio of 0"
        )
    if bench.output_len is not None:
        return int(bench.output_len)
    return int(bench.random_output_len)


def resolve_run_expected_len(bench: argparse.Namespace, explicit: int | None) -> int:
    """Run mode: one trusted length, or stop before spending GPU time."""
    derived = expected_len_from_bench_args(bench)
    if derived is None and explicit is None:
        raise UsageError(
            "cannot tell the requested output length from the bench args "
            f"(--dataset-name {bench.dataset_name}); pass --expected-output-len"
        )
    if derived is not None and explicit is not None and derived != explicit:
        raise UsageError(
            f"--expected-output-len {explicit} contradicts the bench args, "
            f"which ask for {derived} tokens per request"
        )
    return explicit if explicit is not None else int(derived or 0)


def check_reserved_flags(bench_args: Sequence[str]) -> None:
    """Refuse flags that would send the result somewhere this script won't read."""
    for token in bench_args:
        key = _normalize_flag(token).partition("=")[0]
        if key in RESERVED_BENCH_FLAGS:
            raise UsageError(
                f"do not pass {key} to the bench; check_waves sets the result "
                "file itself (see --result-dir)"
            )


def with_metadata(bench_args: Sequence[str], pairs: Sequence[str]) -> list[str]:
    """Add KEY=VALUE pairs to `--metadata` without dropping the user's own.

    `--metadata` takes `nargs="*"` and the last occurrence wins, so a second
    `--metadata` would silently replace the user's pairs.
    """
    args = list(bench_args)
    last = None
    for i, token in enumerate(args):
        key = _normalize_flag(token).partition("=")[0]
        if key == "--metadata":
            last = i
    if last is None:
        return [*args, "--metadata", *pairs]
    key, sep, value = args[last].partition("=")
    head = [key, value] if sep else [key]
    return [*args[:last], *head, *pairs, *args[last + 1 :]]


def base_url_of(bench: argparse.Namespace) -> str:
    """Where the bench sends requests, as `vllm bench serve` computes it."""
    if bench.base_url:
        return str(bench.base_url).rstrip("/")
    host = str(bench.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{bench.port}"


def health_problem(base_url: str, timeout: float) -> str | None:
    """Whether the server still answers; a dead engine makes /health fail."""
    url = f"{base_url}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        return f"{url} did not answer: {e}"
    if status != 200:
        return f"{url} answered HTTP {status}"
    return None


def run_wave(
    wave: int,
    *,
    bench_cmd: Sequence[str],
    bench_args: Sequence[str],
    result_dir: Path,
    expected: int,
    timeout: float | None,
) -> tuple[WaveReport, Path]:
    """Run one bench wave and judge the file it wrote plus its exit status."""
    name = f"wave-{wave:03d}"
    result = result_dir / f"{name}.json"
    log = result_dir / f"{name}.log"
    cmd = [
        *bench_cmd,
        *with_metadata(bench_args, [f"{EXPECTED_LEN_KEY}={expected}"]),
        "--ignore-eos",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result.name,
    ]
    report = WaveReport(wave=str(wave))
    with log.open("w", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        try:
            returncode = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            report.problems.append(f"vllm bench serve ran over {timeout:g} s")
            return report, log
        except OSError as e:
            raise UsageError(f"cannot start {shlex.join(bench_cmd)}: {e}") from e
    if result.exists():
        try:
            report = check_result(load_result(result), result, str(wave), expected)
        except UsageError as e:  # e.g. cut short while writing: a failed wave
            report.problems.append(f"cannot judge the result: {e}")
    else:
        report.problems.append(f"vllm bench serve wrote no {result}")
    if returncode != 0:
        report.problems.append(f"vllm bench serve exited with status {returncode}")
    return report, log


def run_waves(args: argparse.Namespace, bench_args: list[str]) -> list[WaveReport]:
    """Run mode: waves back to back, checking the server after each one."""
    check_reserved_flags(bench_args)
    bench = parse_bench_args(bench_args)
    expected = resolve_run_expected_len(bench, args.expected_output_len)
    base_url = base_url_of(bench)
    result_dir = Path(args.result_dir or time.strftime("check-waves-%Y%m%d-%H%M%S"))
    result_dir.mkdir(parents=True, exist_ok=True)
    stale = [
        result_dir / f"wave-{wave:03d}.json"
        for wave in range(1, args.waves + 1)
        if (result_dir / f"wave-{wave:03d}.json").exists()
    ]
    if stale:
        raise UsageError(
            f"{stale[0]} already exists; a stale file could pass for a new wave, "
            "use an empty --result-dir"
        )
    bench_cmd = shlex.split(args.bench_cmd)
    timeout = args.wave_timeout or None
    reports: list[WaveReport] = []
    before = health_problem(base_url, args.health_timeout)
    if before is not None:
        reports.append(WaveReport(wave=NO_WAVE, problems=[f"before wave 1: {before}"]))
        return reports
    for wave in range(1, args.waves + 1):
        print(
            f"wave {wave}/{args.waves}: vllm bench serve, {expected} output tokens "
            f"per request (log: {result_dir / f'wave-{wave:03d}.log'})",
            flush=True,
        )
        report, log = run_wave(
            wave,
            bench_cmd=bench_cmd,
            bench_args=bench_args,
            result_dir=result_dir,
            expected=expected,
            timeout=timeout,
        )
        after = health_problem(base_url, args.health_timeout)
        if after is not None:
            report.problems.append(after)
        reports.append(report)
        if not report.passed:
            print(f"wave {wave} failed; bench output is in {log}", flush=True)
            if not args.keep_going:
                break
    return reports


def _cell(value: int | float | None, digits: int = 0) -> str:
    """Table cell; '-' where a wave left nothing to count."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_table(reports: Sequence[WaveReport]) -> str:
    """One row per wave, so a bad wave stands out next to the good ones."""
    rows = [TABLE_COLUMNS] + [
        (
            r.wave,
            _cell(r.requests),
            _cell(r.complete),
            _cell(r.short),
            _cell(r.output_throughput, 2),
        )
        for r in reports
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(TABLE_COLUMNS))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    )


def _plural(count: int, noun: str) -> str:
    """`1 wave`, `2 waves`: the verdict is read by people first."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def verdict(reports: Sequence[WaveReport], waves_asked: int | None) -> str:
    """One line that a script or a person can grep for PASS or FAIL."""
    bad = [r for r in reports if not r.passed]
    requests = sum(r.requests or 0 for r in reports)
    ran = [r for r in reports if r.wave != NO_WAVE]
    stopped = waves_asked is not None and len(ran) < waves_asked
    if bad:
        short = sum(r.short or 0 for r in reports)
        incomplete = sum(
            (r.requests or 0) - (r.complete or 0)
            for r in reports
            if r.requests is not None and r.complete is not None
        )
        return (
            f"FAIL: {len(bad)} of {_plural(len(reports), 'wave')} failed, "
            f"{_plural(short, 'short request')}, "
            f"{_plural(incomplete, 'incomplete request')}"
            + (f", ran {len(ran)} of {waves_asked} waves" if stopped else "")
            + f" (first problem: {bad[0].name}: {bad[0].problems[0]})"
        )
    if not ran or stopped:
        return f"FAIL: only {len(ran)} of {waves_asked} waves ran"
    return (
        f"PASS: {_plural(len(reports), 'wave')}, all {requests} requests "
        "complete with the full output length"
    )


def print_report(reports: Sequence[WaveReport], waves_asked: int | None) -> bool:
    """Table, then every problem, then the verdict; True when it passed."""
    print(format_table(reports))
    for r in reports:
        for problem in r.problems:
            print(f"{r.name}: {problem}")
    line = verdict(reports, waves_asked)
    print(line)
    return line.startswith("PASS")


def make_parser() -> argparse.ArgumentParser:
    """The CLI; bench args follow `--` so they never clash with ours."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=(
            "%(prog)s (--waves N [options] -- BENCH_ARGS... | "
            "--results FILE [FILE ...] [--expected-output-len N])"
        ),
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--waves", type=int, metavar="N", help="run N waves of vllm bench serve"
    )
    mode.add_argument(
        "--results",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="check saved --save-detailed result files, one wave per file",
    )
    parser.add_argument(
        "--expected-output-len",
        type=int,
        default=None,
        metavar="N",
        help='output tokens every request asked for (see How "asked for" is known)',
    )
    parser.add_argument(
        "--result-dir",
        default=None,
        metavar="DIR",
        help="run mode: where wave-NNN.json/.log go (default: check-waves-<time>)",
    )
    parser.add_argument(
        "--bench-cmd",
        default="vllm bench serve",
        metavar="CMD",
        help="run mode: the command that runs one wave (default: %(default)s)",
    )
    parser.add_argument(
        "--wave-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="run mode: seconds one wave may take; 0 for no limit "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--health-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="run mode: seconds to wait for GET /health (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="run mode: run the remaining waves after a failed one",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Split our args from the bench args, run or read, print, and exit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ours, bench_args = argv[:split], argv[split + 1 :]
    parser = make_parser()
    args = parser.parse_args(ours)
    if args.expected_output_len is not None and args.expected_output_len < 1:
        parser.error("--expected-output-len must be at least 1")
    try:
        if args.results is not None:
            if bench_args:
                parser.error("bench args after -- only make sense with --waves")
            reports = check_files(args.results, args.expected_output_len)
            waves_asked = None
        else:
            if args.waves < 1:
                parser.error("--waves must be at least 1")
            reports = run_waves(args, bench_args)
            waves_asked = args.waves
    except UsageError as e:
        print(f"check_waves: error: {e}", file=sys.stderr)
        return 2
    return 0 if print_report(reports, waves_asked) else 1


if __name__ == "__main__":
    sys.exit(main())
