# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for benchmarks/check_waves.py, the `vllm bench serve` wave checker.

The files under data/ were written by the real vllm 0.33.0 `vllm bench
serve` client against a fake server (data/generate_check_waves_fixtures.py),
so these tests read the format the checker meets on a GPU machine. Each of
the three checks has a test that only it can fail.
"""

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CHECKER = Path(__file__).resolve().parents[2] / "benchmarks" / "check_waves.py"
DATA = Path(__file__).resolve().parent / "data"
CLEAN, SHORT = DATA / "wave_clean.json", DATA / "wave_short.json"
FAILED, NOT_DETAILED = DATA / "wave_failed.json", DATA / "wave_not_detailed.json"


def _load() -> ModuleType:
    """Import the script by path: benchmarks/ is not a package."""
    spec = importlib.util.spec_from_file_location("check_waves", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_waves = _load()


def run(capsys: pytest.CaptureFixture[str], *files: Path) -> tuple[int, list[str], str]:
    """Exit status, stdout lines and stderr of one run at 1024 tokens."""
    status = check_waves.main(["--output-len", "1024", *map(str, files)])
    out = capsys.readouterr()
    return status, out.out.splitlines(), out.err


def edited(tmp_path: Path, name: str, **changes: Any) -> Path:
    """The clean wave with `changes` made, saved as `name`."""
    data = json.loads(CLEAN.read_text())
    data.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_clean_wave_passes(capsys: pytest.CaptureFixture[str]) -> None:
    status, lines, _ = run(capsys, CLEAN, CLEAN)
    assert status == 0
    assert lines == [
        f"{CLEAN}: PASS: 4 of 4 requests complete, each with 1024 output tokens or more"
    ] * 2 + ["check_waves: PASS: 2 waves"]


def test_a_request_cut_short_without_an_error_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The client booked request 2 as successful, with 37 tokens."""
    data = json.loads(SHORT.read_text())
    assert data["completed"] == data["num_prompts"] and not any(data["errors"])
    status, lines, _ = run(capsys, CLEAN, SHORT)
    assert status == 1
    assert lines[0].startswith(f"{CLEAN}: PASS")
    assert lines[1] == (
        f"{SHORT}: FAIL: 1 short of 1024 output tokens; request 2: 37 tokens"
    )
    assert lines[2] == "check_waves: FAIL: 1 of 2 waves failed"


def test_fewer_completed_than_prompts_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, lines, _ = run(capsys, edited(tmp_path, "w.json", num_prompts=5))
    assert status == 1
    assert "FAIL: 4 of 5 prompts completed (4 requests in the file)" in lines[0]


def test_a_request_with_an_error_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Even at the full length: the last line of the error names it."""
    errors = ["", "Traceback ...\nClientPayloadError: payload not completed", "", ""]
    status, lines, _ = run(capsys, edited(tmp_path, "w.json", errors=errors))
    assert status == 1
    assert lines[0].endswith(
        "FAIL: 1 with errors; request 1: ClientPayloadError: payload not completed"
    )


def test_a_crashed_wave_names_each_problem(capsys: pytest.CaptureFixture[str]) -> None:
    status, lines, _ = run(capsys, FAILED)
    assert status == 1
    line = lines[0]
    assert "2 of 4 prompts completed" in line and "2 with errors" in line
    assert "request 2: Internal Server Error" in line
    assert "1 short of 1024 output tokens; request 1: 37 tokens" in line


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "save waves with --save-detailed"),
        ("{}\n{}\n", "save each wave on its own"),
        ('{"num_prompts": 4}', "no integer 'completed'"),
        ("[1]", "not a `vllm bench serve` result"),
    ],
    ids=["not-detailed", "appended", "no-completed", "not-an-object"],
)
def test_a_file_that_cannot_be_judged_is_exit_2(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    content: str | None,
    says: str,
) -> None:
    path = NOT_DETAILED
    if content is not None:
        path = tmp_path / "bad.json"
        path.write_text(content)
    status, lines, err = run(capsys, CLEAN, path)
    assert status == 2 and lines == []
    assert err.startswith("check_waves: error: ") and says in err
    assert len(err.splitlines()) == 1


def test_the_output_length_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        check_waves.main([str(CLEAN)])
    assert exit_.value.code == 2
    assert "--output-len" in capsys.readouterr().err


def test_it_runs_as_a_script() -> None:
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(CHECKER), "--output-len", "1024", str(SHORT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "FAIL" in proc.stdout
