# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start-up cost of the editable install's `.pth` import hook.

`pip install -e .` puts a `.pth` file in site-packages that starts the import
hook (tools/finder.py) in every Python process of that environment, vLLM or
not. This builds the same thing in a scratch venv (the finder copied in as
the editable wheel ships it, and its `.pth` line, pointing at a tiny tree),
then starts fresh interpreters with and without the `.pth`, and reports:

- the modules the `.pth` adds to `sys.modules` at start-up (the target is at
  most 5);
- the `site` import time from `-X importtime` (median of `--repeats` runs),
  which includes running every `.pth`.

`--finder` measures another copy of the hook, e.g. an older one from git:

    python benchmarks/benchmark_editable_startup.py
    git show REV:tools/finder.py > /tmp/old_finder.py
    python benchmarks/benchmark_editable_startup.py --finder /tmp/old_finder.py
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tools import finder  # noqa: E402

# The names the editable wheel gives the hook and its `.pth` file.
MODULE = "_vllm_overlay_finder"
PTH = "_vllm_overlay_editable.pth"


def make_editable_venv(where: Path, finder_source: Path) -> tuple[Path, Path]:
    """A bare venv with the hook installed as `pip install -e` installs it.

    Returns the venv's python and its `.pth` file.
    """
    venv.create(where / "venv", with_pip=False)
    python = where / "venv" / "bin" / "python"
    site = next((where / "venv").glob("lib/python*/site-packages"))
    tree = where / "checkout"
    (tree / "vllm").mkdir(parents=True)
    shutil.copyfile(finder_source, site / f"{MODULE}.py")
    (site / PTH).write_text(finder.pth_line(MODULE, tree))
    # pip compiles what it installs; without a .pyc each start-up would.
    _run(python, "-m", "py_compile", str(site / f"{MODULE}.py"))
    return python, site / PTH


def _run(python: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(python), *args], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return proc


def loaded_modules(python: Path) -> set[str]:
    """The modules in `sys.modules` once the interpreter has started."""
    return set(_run(python, "-c", "import sys; print(*sys.modules)").stdout.split())


def site_import_us(python: Path, repeats: int) -> float:
    """Median cumulative import time of `site` (all `.pth` files), in us."""
    times = []
    for _ in range(repeats):
        for line in _run(python, "-X", "importtime", "-c", "pass").stderr.splitlines():
            fields = line.split("|")
            if len(fields) == 3 and fields[2].strip() == "site":
                times.append(int(fields[1]))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finder", type=Path, default=Path(finder.__file__))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="editable-startup-") as tmp:
        python, pth = make_editable_venv(Path(tmp), args.finder)
        with_hook = loaded_modules(python)
        with_time = site_import_us(python, args.repeats)
        pth.unlink()
        without = loaded_modules(python)
        without_time = site_import_us(python, args.repeats)
    added = sorted(with_hook - without)
    print(f"hook: {args.finder}")
    print(f"modules added at start-up: {len(added)} ({', '.join(added)})")
    print(
        f"site import (median of {args.repeats}): {with_time / 1000:.1f} ms with "
        f"the .pth, {without_time / 1000:.1f} ms without"
    )


if __name__ == "__main__":
    main()
