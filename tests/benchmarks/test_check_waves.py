# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for benchmarks/check_waves.py, the `vllm bench serve` wave checker.

The fixtures under data/ were written by the real vllm 0.33.0 `vllm bench
serve` client against a fake server (see data/generate_check_waves_fixtures.py),
so these tests read the exact format the checker will meet on a GPU box. Run
mode is exercised with a stand-in bench command and a /health server on
127.0.0.1; nothing leaves the machine.
"""

import copy
import http.server
import importlib.util
import json
import re
import shlex
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKER_PATH = REPO_ROOT / "benchmarks" / "check_waves.py"
DATA = Path(__file__).resolve().parent / "data"
CLEAN = DATA / "wave_clean.json"
SHORT = DATA / "wave_short.json"
FAILED = DATA / "wave_failed.json"
NOT_DETAILED = DATA / "wave_not_detailed.json"
COLUMNS = ["wave", "requests", "complete", "short", "output tok/s"]


def _load_checker() -> ModuleType:
    """Import the script by path: benchmarks/ is not a package."""
    spec = importlib.util.spec_from_file_location("check_waves", CHECKER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check_waves = _load_checker()


def run_checker(
    capsys: pytest.CaptureFixture[str], *argv: str | Path
) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of one checker invocation."""
    status = check_waves.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def table_rows(out: str) -> list[list[str]]:
    """The table: header then one row per wave, cells split on runs of spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*wave\s\s", line))
    rows = []
    for line in lines[start:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(COLUMNS):
            break
        rows.append(cells)
    return rows


def verdict_line(out: str) -> str:
    """The last line is the verdict."""
    return out.strip().splitlines()[-1]


def test_clean_wave_passes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_checker(capsys, "--results", CLEAN)
    assert status == 0
    assert table_rows(out)[1][:4] == ["1", "4", "4", "0"]
    assert verdict_line(out).startswith("PASS")
    assert "short:" not in out and "failed:" not in out


def test_clean_wave_passes_with_matching_explicit_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run_checker(
        capsys, "--results", CLEAN, "--expected-output-len", "1024"
    )
    assert status == 0, out
    assert verdict_line(out).startswith("PASS")


def test_short_request_fails_and_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # The bench itself counted the cut-off request as successful.
    data = json.loads(SHORT.read_text())
    assert (data["completed"], data["failed"], data["errors"]) == (4, 0, [""] * 4)
    status, out, _ = run_checker(capsys, "--results", SHORT)
    assert status == 1
    assert "request 2 short: 37 of 1024 output tokens" in out
    assert table_rows(out)[1][:4] == ["1", "4", "4", "1"]
    assert verdict_line(out).startswith("FAIL")


def test_longer_expectation_flags_every_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run_checker(
        capsys, "--results", FAILED, "--expected-output-len", "2048"
    )
    assert status == 1
    assert "request 0 short: 1024 of 2048 output tokens" in out


def test_failed_requests_fail(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_checker(
        capsys, "--results", FAILED, "--expected-output-len", "1024"
    )
    assert status == 1
    assert "2 request(s) failed" in out
    assert "only 2 of 4 requests completed" in out
    assert "request 2 failed: Internal Server Error" in out
    assert "request 3 failed: aiohttp.client_exceptions.ClientPayloadError" in out
    assert "request 1 short: 37 of 1024 output tokens" in out
    assert table_rows(out)[1][:4] == ["1", "4", "2", "1"]
    assert verdict_line(out).startswith("FAIL")


def _edited(tmp_path: Path, edit: dict[str, Any], drop_last: bool = False) -> Path:
    """A copy of the clean wave with some fields changed, same format."""
    data = json.loads(CLEAN.read_text())
    if drop_last:
        for key, value in data.items():
            if isinstance(value, list) and len(value) == data["num_prompts"]:
                data[key] = value[:-1]
    data.update(copy.deepcopy(edit))
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_error_string_alone_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    errors = ["", "", "", "Server disconnected"]
    path = _edited(tmp_path, {"errors": errors})
    status, out, _ = run_checker(capsys, "--results", path)
    assert status == 1
    assert "request 3 failed: Server disconnected" in out


def test_fewer_requests_than_num_prompts_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _edited(tmp_path, {"completed": 3}, drop_last=True)
    status, out, _ = run_checker(capsys, "--results", path)
    assert status == 1
    assert "3 requests in the file but --num-prompts was 4" in out


def test_table_columns(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_checker(capsys, "--results", CLEAN, SHORT)
    assert status == 1
    rows = table_rows(out)
    assert rows[0] == COLUMNS
    assert len(rows) == 3
    for wave, (row, path) in enumerate(
        zip(rows[1:], (CLEAN, SHORT), strict=True), start=1
    ):
        data = json.loads(path.read_text())
        assert row == [
            str(wave),
            str(len(data["output_lens"])),
            str(data["completed"]),
            str(sum(n < 1024 for n in data["output_lens"])),
            f"{data['output_throughput']:.2f}",
        ]
    assert "1 of 2 waves failed" in verdict_line(out)


def test_file_without_detail_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_checker(
        capsys, "--results", NOT_DETAILED, "--expected-output-len", "1024"
    )
    assert status == 2
    assert "no 'output_lens' array" in err and "--save-detailed" in err


def test_unknown_requested_length_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = run_checker(capsys, "--results", FAILED)
    assert status == 2
    assert "--expected-output-len" in err


def test_length_contradicting_the_file_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, _, err = run_checker(
        capsys, "--results", CLEAN, "--expected-output-len", "512"
    )
    assert status == 2
    assert "contradicts" in err


# Run mode: a stand-in for `vllm bench serve` that records its argv and
# copies a fixture to where --result-dir/--result-filename point.
FAKE_BENCH = """
import json, shutil, sys
from pathlib import Path
args = sys.argv[1:]
source, status, log = args[0], int(args[1]), Path(args[2])
rest = args[3:]
with log.open("a") as f:
    f.write(json.dumps(rest) + "\\n")
if source != "-":
    target = Path(rest[rest.index("--result-dir") + 1])
    shutil.copy(source, target / rest[rest.index("--result-filename") + 1])
sys.exit(status)
"""


class _Health(http.server.BaseHTTPRequestHandler):
    """GET /health: 200 for the first `ok_answers` calls, then 503."""

    ok_answers = 1_000_000

    def do_GET(self) -> None:
        if self.path != "/health":
            self.send_response(404)
        elif type(self).ok_answers > 0:
            type(self).ok_answers -= 1
            self.send_response(200)
        else:
            self.send_response(503)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Keep the test output clean."""


@pytest.fixture
def health_server() -> Iterator[http.server.ThreadingHTTPServer]:
    """A /health endpoint on 127.0.0.1 that a test can make fail."""
    handler = type("Health", (_Health,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _run_mode_argv(
    tmp_path: Path,
    port: int,
    *,
    source: Path | str = CLEAN,
    bench_status: int = 0,
    waves: int = 2,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """Checker argv for run mode with the stand-in bench command."""
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    log = tmp_path / "argv.jsonl"
    bench_cmd = shlex.join(
        [sys.executable, str(script), str(source), str(bench_status), str(log)]
    )
    return [
        "--waves",
        str(waves),
        "--result-dir",
        str(tmp_path / "results"),
        "--bench-cmd",
        bench_cmd,
        "--health-timeout",
        "5",
        "--",
        "--port",
        str(port),
        "--random-output-len",
        "1024",
        "--metadata",
        "gpu=h200",
        *extra,
    ]


def _bench_argvs(tmp_path: Path) -> list[list[str]]:
    """What the stand-in bench was called with, one list per wave."""
    lines = (tmp_path / "argv.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_run_mode_clean_waves(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    health_server: http.server.ThreadingHTTPServer,
) -> None:
    port = health_server.server_address[1]
    status, out, _ = run_checker(capsys, *_run_mode_argv(tmp_path, port))
    assert status == 0, out
    assert [row[0] for row in table_rows(out)[1:]] == ["1", "2"]
    assert verdict_line(out).startswith("PASS: 2 waves")
    argvs = _bench_argvs(tmp_path)
    assert len(argvs) == 2
    for wave, argv in enumerate(argvs, start=1):
        assert "--ignore-eos" in argv
        assert "--save-result" in argv and "--save-detailed" in argv
        assert argv[argv.index("--result-filename") + 1] == f"wave-00{wave}.json"
        # The user's metadata survives next to the recorded length.
        metadata = argv[argv.index("--metadata") + 1 : argv.index("--metadata") + 3]
        assert sorted(metadata) == ["check_waves_expected_output_len=1024", "gpu=h200"]
        assert argv.count("--metadata") == 1


def test_run_mode_short_wave_fails_and_stops(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    health_server: http.server.ThreadingHTTPServer,
) -> None:
    port = health_server.server_address[1]
    status, out, _ = run_checker(capsys, *_run_mode_argv(tmp_path, port, source=SHORT))
    assert status == 1
    assert "wave 1: request 2 short: 37 of 1024 output tokens" in out
    assert len(table_rows(out)) == 2  # stopped after the failed first wave
    assert len(_bench_argvs(tmp_path)) == 1


def test_run_mode_bench_failure_fails(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    health_server: http.server.ThreadingHTTPServer,
) -> None:
    port = health_server.server_address[1]
    argv = _run_mode_argv(tmp_path, port, source="-", bench_status=3, waves=1)
    status, out, _ = run_checker(capsys, *argv)
    assert status == 1
    assert "exited with status 3" in out
    assert "wrote no" in out
    assert table_rows(out)[1] == ["1", "-", "-", "-", "-"]


@pytest.mark.parametrize("ok_answers", [0, 1])
def test_run_mode_unhealthy_server_fails(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    health_server: http.server.ThreadingHTTPServer,
    ok_answers: int,
) -> None:
    # 0: already dead before wave 1; 1: dies during wave 1 of a clean file.
    health_server.RequestHandlerClass.ok_answers = ok_answers  # type: ignore[attr-defined]
    port = health_server.server_address[1]
    status, out, _ = run_checker(capsys, *_run_mode_argv(tmp_path, port))
    assert status == 1
    assert "/health answered HTTP 503" in out
    rows = table_rows(out)
    if ok_answers:
        assert rows[1:] == [["1", "4", "4", "0", rows[1][4]]]
        assert "wave 1: http://" in out
    else:
        assert rows[1:] == [["-", "-", "-", "-", "-"]]
        assert not (tmp_path / "argv.jsonl").exists()
    assert verdict_line(out).startswith("FAIL")


def test_run_mode_unreachable_server_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on afterwards
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    status, out, _ = run_checker(capsys, *_run_mode_argv(tmp_path, port))
    assert status == 1
    assert "did not answer" in out
    assert not (tmp_path / "argv.jsonl").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--result-dir", "elsewhere"), "do not pass --result-dir"),
        (("--append_result",), "do not pass --append-result"),
        (("--random-range-ratio", "0.5"), "own output length"),
        (("--dataset-name", "sharegpt"), "pass --expected-output-len"),
        (("--output-len", "7"), None),
    ],
)
def test_run_mode_refuses_unjudgeable_bench_args(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...],
    message: str | None,
) -> None:
    argv = _run_mode_argv(tmp_path, 1, extra=extra)
    if message is None:  # --output-len 7 beats --random-output-len 1024 ...
        argv[:0] = ["--expected-output-len", "1024"]  # ... so 1024 contradicts it
        message = "contradicts"
    status, _, err = run_checker(capsys, *argv)
    assert status == 2
    assert message in err
    assert not (tmp_path / "argv.jsonl").exists()


@pytest.mark.parametrize(
    ("bench_args", "expected"),
    [
        ([], 128),
        (["--random-output-len", "1024"], 1024),
        (["--random_output_len=1024", "--output-len", "64"], 64),
        (["--random-range-ratio", '{"input": 0.5, "output": 0}'], 128),
    ],
)
def test_requested_length_from_bench_args(bench_args: list[str], expected: int) -> None:
    bench = check_waves.parse_bench_args(bench_args)
    assert check_waves.expected_len_from_bench_args(bench) == expected


def test_metadata_is_merged_not_replaced() -> None:
    merge = check_waves.with_metadata
    assert merge(["--x"], ["k=1"]) == ["--x", "--metadata", "k=1"]
    assert merge(["--metadata", "a=1", "--x"], ["k=1"]) == [
        "--metadata",
        "k=1",
        "a=1",
        "--x",
    ]
    assert merge(["--metadata=a=1"], ["k=1"]) == ["--metadata", "a=1", "k=1"]
