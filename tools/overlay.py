# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 3: put the tree's files into the unpacked members of the base wheel.

A wheel gets every file under ``vllm/`` over (or beside) upstream's. An
editable wheel instead leaves the tree's Python files out and carries the
import hook (``finder.py``) with a ``.pth`` that starts it, so the modules
load from the working tree.
"""

import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .finder import pth_line
from .util import log

FINDER_SOURCE = Path(__file__).with_name("finder.py")
EDITABLE_FINDER = "_vllm_overlay_finder"
EDITABLE_PTH = "_vllm_overlay_editable.pth"


def apply_overlay(
    tree: Path, source_root: Path, files: list[Path], adds: Iterable[str] = ()
) -> None:
    """Copy the tree's files into the unpacked members, with fixed modes.

    ``check.check_base_wheel`` has already refused every file that does not
    fit; ``adds`` only counts the new ones for the log.
    """
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_root / rel, tree / rel)
        # The umask or checkout must not leak into the wheel's bytes.
        executable = (source_root / rel).stat().st_mode & stat.S_IXUSR
        (tree / rel).chmod(0o755 if executable else 0o644)
    new = len({rel.as_posix() for rel in files} & set(adds))
    log(f"replaced {len(files) - new} file(s), added {new}")


def apply_editable(tree: Path, source_root: Path, files: list[Path]) -> set[str]:
    """Leave the tree's Python files out and add the hook that imports them.

    Other files (data, if the tree ever has any) are copied in: vLLM finds
    those next to its installed modules, so they take effect on reinstall.
    Returns the members to drop from the wheel.
    """
    python = [rel for rel in files if rel.suffix == ".py"]
    for rel in python:
        (tree / rel).unlink(missing_ok=True)
    apply_overlay(tree, source_root, [rel for rel in files if rel.suffix != ".py"])
    finder = tree / f"{EDITABLE_FINDER}.py"
    shutil.copyfile(FINDER_SOURCE, finder)
    finder.chmod(0o644)
    pth = tree / EDITABLE_PTH
    pth.write_text(pth_line(EDITABLE_FINDER, source_root.resolve()))
    pth.chmod(0o644)
    log(
        f"editable: vllm modules under {source_root} load from there; edit "
        "and restart, no reinstall"
    )
    return {rel.as_posix() for rel in python}
