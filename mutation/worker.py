# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cosmic-ray HTTP worker that tests each mutant in a fork of itself.

    python mutation/worker.py --port PORT    (mutation/run.py starts it)

In a new interpreter, most of a mutant's test run goes on importing torch,
vLLM and FlashInfer before the first test. This worker imports those once,
then runs each `python -m pytest ...` test command in a fork of itself.
None of the tree's vllm/ modules (the mutants), its tests or the overlay
finder is imported before the fork, so each fork imports the mutant afresh,
as a new interpreter would. Any other test command runs as cosmic-ray runs it.
"""

import argparse
import gc
import importlib
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import cosmic_ray.mutating
from cosmic_ray.distribution.http import run_worker
from cosmic_ray.testing import run_tests
from cosmic_ray.work_item import TestOutcome

# The build tool is the package tools/ at the repository's root.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from tools.check import collect_overlay, module_name  # noqa: E402

# What the selected tests and the fix's modules import, and none of the
# modules this tree replaces or adds: the test framework, torch and vLLM's
# config, FlashInfer's comm package (the replaced file), the engine
# arguments and the KV connectors (HiSparse configs).
PRELOAD = (
    "pytest",
    "torch.distributed",
    "vllm.config",
    "vllm.platforms",
    "vllm.distributed.parallel_state",
    "flashinfer.comm",
    "flashinfer.comm.mnnvl",
    "vllm.engine.arg_utils",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
)
PYTEST = ["python", "-m", "pytest"]


def preload(root: Path) -> None:
    """Import PRELOAD; refuse to serve if that imported a module of the tree,
    since forks would then test the installed copy instead of the mutant."""
    for name in PRELOAD:
        importlib.import_module(name)
    tree = {module_name(path.as_posix()) for path in collect_overlay(root / "vllm")}
    stale = sorted(tree & set(sys.modules))
    if stale:
        sys.exit(f"mutation/worker.py: preloading imported {stale}; trim PRELOAD")
    if threading.active_count() > 1:
        sys.exit("mutation/worker.py: preloading started threads; forks need none")
    # The preloaded objects live as long as the worker: keep the garbage
    # collector of each fork (pytest collects at exit) from scanning them.
    gc.freeze()


def _run_pytest(args: list[str], output: int) -> None:
    """In the fork: run pytest as `python -m pytest` would, then exit."""
    code = 1
    try:
        os.setsid()
        # The worker's event loop handles these; the fork runs no loop.
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        # As cosmic-ray runs tests: each mutant must be compiled afresh.
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        # The tests need no plugin beyond pytest's own; those installed
        # (hypothesis, pytest-benchmark, ...) would only slow each run.
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        sys.dont_write_bytecode = True
        sys.path[0] = os.getcwd()
        sys.argv = ["pytest", *args]
        import pytest

        code = int(pytest.main(args))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def forked_run_tests(command: str, timeout: float) -> tuple[TestOutcome, str]:
    """cosmic-ray's run_tests, with `python -m pytest` run in a fork."""
    argv = shlex.split(command)
    if argv[: len(PYTEST)] != PYTEST:
        return run_tests(command, timeout)
    with tempfile.TemporaryFile() as output:
        pid = os.fork()
        if pid == 0:
            _run_pytest(argv[len(PYTEST) :], output.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                # The fork leads its own session: this takes its children too.
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return TestOutcome.KILLED, "timeout"
            time.sleep(0.05)
        output.seek(0)
        text = output.read().decode("utf-8", errors="replace")
    code = os.waitstatus_to_exitcode(status)
    return (TestOutcome.KILLED if code else TestOutcome.SURVIVED), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # cosmic-ray==8.7.0 (requirements/mutation.txt) runs each mutant's tests
    # through this name; another version may not.
    if getattr(cosmic_ray.mutating, "run_tests", None) is not run_tests:
        sys.exit(
            "mutation/worker.py: this cosmic-ray does not run tests through "
            "cosmic_ray.mutating.run_tests; pip install -r requirements/mutation.txt"
        )
    preload(Path.cwd())
    cosmic_ray.mutating.run_tests = forked_run_tests
    run_worker(port=args.port)


if __name__ == "__main__":
    main()
