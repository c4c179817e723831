# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation-test the fix with cosmic-ray, one session per module.

    pip install -r requirements/mutation.txt
    python mutation/run.py [MODULE ...] [--jobs N] [--list]

First the workers run each module's tests unmutated: they must pass, or
every mutant would look killed. Then, for each module in
mutation/cosmic-ray.toml (backend, replaced):
write its session config, create the mutants, skip those outside
the fix and the known equivalent ones (mutation/scope_filter.py), and run
its tests against every mutant. Prints, per module, the mutants, killed, timed out and
equivalent ones, and every survivor; exits 1 if any survived. Sessions are
kept under build/mutation/.

cosmic-ray writes each mutant over the file on disk, so the overlay finder
and the rank subprocesses all import it. It does so in copies of this tree
(build/mutation/worker-*), one per worker (mutation/worker.py, which runs
each test command in a fork of itself with torch, vLLM and FlashInfer
already imported): the checkout is never mutated, and `--jobs` workers
test mutants side by side.
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from cosmic_ray.config import ConfigDict, load_config, serialize_config
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "mutation" / "cosmic-ray.toml"
SESSIONS = REPO_ROOT / "build" / "mutation"
# Keys of [cosmic-ray.modules.*] that mutation/scope_filter.py reads.
SCOPE_KEYS = ("changed-lines-only",)
# pytest's line for a rank group that hung until its own hard timeout
# (tests/distributed/fi_ar_utils.py); tracebacks also quote the raise.
GROUP_HANG = re.compile(r"^E +\S*GroupHang: ", re.MULTILINE)
# Not part of what the tests read; build/ also holds the worker copies.
NOT_COPIED = shutil.ignore_patterns(
    ".git", "build", "dist", "__pycache__", ".*_cache", "*.egg-info"
)
# Each worker imports torch, vLLM and FlashInfer before it listens.
WORKER_START_TIMEOUT = 120


def module_config(base: ConfigDict, name: str, worker_urls: list[str]) -> ConfigDict:
    """One module's cosmic-ray config: the shared settings plus its own."""
    module = base["modules"][name]
    config = ConfigDict({k: v for k, v in base.items() if k != "modules"})
    config.update({k: v for k, v in module.items() if k not in SCOPE_KEYS})
    filters = ConfigDict(config.get("filters", {}))
    filters["scope"] = {k: module[k] for k in SCOPE_KEYS if k in module}
    config["filters"] = filters
    config["distributor"] = {"name": "http", "http": {"worker-urls": worker_urls}}
    return config


def _tool(name: str) -> str:
    """A cosmic-ray console script from the environment running this one."""
    script = Path(sys.executable).parent / name
    return str(script) if script.exists() else name


def _run(*cmd: str) -> None:
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, worker: subprocess.Popen) -> None:
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            sys.exit(f"mutation/worker.py exited with {worker.returncode}; see above")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port)),
        ):
            return
        time.sleep(0.2)
    sys.exit(f"mutation/worker.py did not listen within {WORKER_START_TIMEOUT} s")


@contextlib.contextmanager
def workers(jobs: int) -> Iterator[list[str]]:
    """Start `jobs` HTTP workers, each in its own copy of the tree.

    Each copy is fresh, so a mutant left behind by an interrupted run is
    gone. The workers and every test they started are killed on exit.
    """
    procs = []
    try:
        ports = []
        for index in range(jobs):
            copy = SESSIONS / f"worker-{index}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(REPO_ROOT, copy, ignore=NOT_COPIED)
            ports.append(_free_port())
            procs.append(
                subprocess.Popen(
                    [sys.executable, "mutation/worker.py", "--port", str(ports[-1])],
                    cwd=copy,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        for port, proc in zip(ports, procs, strict=True):
            _wait_for_port(port, proc)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _test_unmutated(url: str, command: str, timeout: float) -> tuple[bool, str]:
    """Run `command` in the worker at `url` with no mutation: passed, output."""
    request = urllib.request.Request(
        url,
        data=json.dumps(
            {"mutations": [], "test_command": command, "timeout": timeout}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout + 60) as response:
        result = json.load(response)
    passed = (
        result["worker_outcome"] == WorkerOutcome.NORMAL.value
        and result["test_outcome"] == TestOutcome.SURVIVED.value
    )
    return passed, result["output"] or ""


def check_baselines(base: ConfigDict, names: list[str], worker_urls: list[str]) -> None:
    """Exit unless each module's tests pass unmutated, run as mutants are.

    Otherwise every mutant would look killed. The commands run side by
    side, each worker taking its share.
    """
    commands = list(dict.fromkeys(base["modules"][n]["test-command"] for n in names))
    jobs = len(worker_urls)

    def share(index: int) -> list[tuple[str, bool, str]]:
        return [
            (command, *_test_unmutated(worker_urls[index], command, base["timeout"]))
            for command in commands[index::jobs]
        ]

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        results = [r for rs in pool.map(share, range(jobs)) for r in rs]
    for command, passed, output in results:
        if not passed:
            print("\n".join(output.splitlines()[-40:]), file=sys.stderr)
            sys.exit(f"unmutated, the tests fail; fix them first: {command}")


def run_module(base: ConfigDict, name: str, worker_urls: list[str]) -> Path:
    """Create and filter one module's session, then (with workers) run it."""
    config = module_config(base, name, worker_urls)
    SESSIONS.mkdir(parents=True, exist_ok=True)
    config_path = SESSIONS / f"{name}.toml"
    config_path.write_text(serialize_config(config))
    session = SESSIONS / f"{name}.sqlite"
    session.unlink(missing_ok=True)
    _run(_tool("cosmic-ray"), "init", str(config_path), str(session))
    _run(_tool("cr-filter-operators"), str(session), str(config_path))
    _run(
        sys.executable,
        str(REPO_ROOT / "mutation" / "scope_filter.py"),
        str(session),
        "--config",
        str(config_path),
    )
    if worker_urls:
        _run(_tool("cosmic-ray"), "exec", str(config_path), str(session))
    return session


def classify(result: WorkResult) -> str:
    """killed, timed out (cosmic-ray's or a test's own hang check), survived,
    equivalent, out of scope or error."""
    if result.worker_outcome == WorkerOutcome.SKIPPED:
        output = result.output or ""
        return "equivalent" if output.startswith("equivalent") else "out of scope"
    if result.worker_outcome != WorkerOutcome.NORMAL:
        return "error"
    if result.test_outcome == TestOutcome.SURVIVED:
        return "survived"
    if result.test_outcome == TestOutcome.KILLED:
        output = result.output or ""
        if output == "timeout" or GROUP_HANG.search(output):
            return "timed out"
        return "killed"
    return "error"


def report(session: Path) -> tuple[Counter, list[str]]:
    """Counts by outcome, and a line for each survivor or error."""
    counts: Counter = Counter()
    notes = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            outcome = classify(result)
            counts[outcome] += 1
            if outcome in ("survived", "error"):
                [m] = item.mutations
                line = m.start_pos[0]
                text = (REPO_ROOT / m.module_path).read_text().splitlines()[line - 1]
                notes.append(
                    f"  {outcome}: {m.module_path}:{line} {m.operator_name} "
                    f"(occurrence {m.occurrence}): {text.strip()}"
                )
    return counts, notes


COLUMNS = ("killed", "timed out", "survived", "equivalent", "error")


def print_table(rows: list[tuple[str, Counter]]) -> None:
    """Per module: mutants tested or equivalent, and what became of them."""
    print(f"\n{'module':10} {'mutants':>8}" + "".join(f"{c:>11}" for c in COLUMNS))
    for name, counts in rows:
        mutants = sum(counts[c] for c in COLUMNS)
        print(f"{name:10} {mutants:>8}" + "".join(f"{counts[c]:>11}" for c in COLUMNS))


def list_pending(name: str, session: Path) -> None:
    """Print the mutants a run of `name` would test."""
    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = [item.mutations[0] for item in db.pending_work_items]
    print(f"{name}: {len(pending)} mutants")
    for m in sorted(pending, key=lambda m: (m.start_pos, m.operator_name)):
        print(f"  {m.module_path}:{m.start_pos[0]} {m.operator_name}")


def main(argv: list[str] | None = None) -> int:
    base = load_config(str(CONFIG))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "modules",
        nargs="*",
        help=f"modules to test (default: all of {', '.join(base['modules'])})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="mutants tested side by side (default: one per CPU)",
    )
    parser.add_argument(
        "--list", action="store_true", help="only list the mutants a run would test"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modules) - set(base["modules"]))
    if unknown:
        parser.error(f"unknown modules {unknown}")
    names = args.modules or list(base["modules"])
    if args.list:
        for name in names:
            list_pending(name, run_module(base, name, []))
        return 0
    # `python` in the test commands is this interpreter.
    bin_dir = Path(sys.executable).parent
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    # A stopped run still takes its workers down (see `workers`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.monotonic()
    rows = []
    survived = 0
    with workers(args.jobs) as urls:
        check_baselines(base, names, urls)
        for name in names:
            counts, notes = report(run_module(base, name, urls))
            rows.append((name, counts))
            survived += counts["survived"]
            print("\n".join([f"{name}:", *notes]) if notes else f"{name}: all killed")
    print_table(rows)
    print(f"wall time {time.monotonic() - start:.0f} s with {args.jobs} workers")
    # An error is cosmic-ray failing to apply a mutant: listed, not a failure.
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
