# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time `pip install .`'s build step against a plain unpack-and-repack build.

Both run in the same process on the real cached base wheel (a cold cache,
i.e. the download, is excluded), so the ratios hold on any machine:

- plain: verify, ``wheel unpack``, copy the tree's files, ``wheel pack
  --local-version`` and a second full compression by ``wheel tags`` to
  restore the base file name's tags: what the ``wheel`` CLI alone gives;
- the build: tools.pack.build(), twice, whose wheels must be identical.

Target: the build <= 0.6x plain.

    python benchmarks/benchmark_overlay_build.py [--base PATH]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tree_imports  # noqa: E402

from tools import check, fetch, pack  # noqa: E402
from tools.pins import load_pins  # noqa: E402

TARGET = 0.6


def plain_pipeline(base: Path, out: Path) -> None:
    """The build with the ``wheel`` CLI alone: two full compressions."""
    pins = load_pins()
    fetch.fetch_base_wheel(pins, location=str(base))  # checks its sha256
    python_tag, abi_tag, platform_tag = base.name[: -len(".whl")].split("-")[-3:]
    with tempfile.TemporaryDirectory(prefix="bench-plain-") as work:
        _wheel("unpack", "--dest", work, str(base))
        tree = next(Path(work).iterdir())
        for rel in check.collect_overlay(tree_imports.REPO_ROOT / "vllm"):
            shutil.copyfile(tree_imports.REPO_ROOT / rel, tree / rel)
        _wheel(
            "pack",
            "--dest-dir",
            str(out),
            "--local-version",
            pins.local_label,
            str(tree),
        )
        shutil.rmtree(tree)
        built = next(out.glob("*.whl"))
        _wheel(
            "tags",
            f"--python-tag={python_tag}",
            f"--abi-tag={abi_tag}",
            f"--platform-tag={platform_tag}",
            "--remove",
            str(built),
        )


def _wheel(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "wheel", *args],
        check=True,
        capture_output=True,
        timeout=1800,
    )


def timed(what: str, run: Callable[[], object]) -> float:
    started = time.monotonic()
    run()
    seconds = time.monotonic() - started
    print(f"{what:<22} {seconds:7.1f} s", flush=True)
    return seconds


def main() -> int:
    pins = load_pins()
    default = fetch.default_cache_dir() / fetch.wheel_for_platform(pins)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=default, help="base wheel")
    args = parser.parse_args()
    if not args.base.is_file():
        print(f"no base wheel at {args.base}; run `pip wheel .` once first")
        return 2
    os.environ.pop("SOURCE_DATE_EPOCH", None)
    with tempfile.TemporaryDirectory(prefix="bench-overlay-") as tmp:
        dirs = {name: Path(tmp, name) for name in ("plain", "first", "again")}
        for folder in dirs.values():
            folder.mkdir()

        def new_build(out: Path) -> Callable[[], object]:
            return lambda: pack.build(out, pins=pins, location=str(args.base))

        plain = timed(
            "plain pipeline", lambda: plain_pipeline(args.base, dirs["plain"])
        )
        first = timed("build", new_build(dirs["first"]))
        timed("build again", new_build(dirs["again"]))
        same = [
            p.read_bytes() for p in (dirs["first"], dirs["again"]) for p in p.iterdir()
        ]
    print(f"build / plain: {first / plain:.2f} (target <= {TARGET})")
    print("identical wheels:", same[0] == same[1])
    met = first / plain <= TARGET and same[0] == same[1]
    print("targets met" if met else "TARGETS MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
