# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fail when a source file does not open with vLLM's two SPDX lines.

Run by pre-commit on the files it is given, or with no arguments on every
tracked Python and shell file. A shebang line may come first.
"""

import subprocess
import sys
from pathlib import Path

HEADER = (
    "# SPDX-License-Identifier: Apache-2.0",
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)
SOURCE_SUFFIXES = (".py", ".sh")
SCRIPTS = (".ci/run",)


def tracked_sources() -> list[str]:
    """Every tracked file this check applies to."""
    listed = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [f for f in listed if f.endswith(SOURCE_SUFFIXES) or f in SCRIPTS]


def has_header(path: Path) -> bool:
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    return tuple(lines[: len(HEADER)]) == HEADER


def main(argv: list[str]) -> int:
    missing = [f for f in argv or tracked_sources() if not has_header(Path(f))]
    for f in missing:
        print(f"{f}: missing SPDX header; start it with:\n  " + "\n  ".join(HEADER))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
