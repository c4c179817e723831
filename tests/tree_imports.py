# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import this tree's vLLM modules instead of the installed copies.

`pip install .` puts our files into site-packages, but a test run must
exercise the working tree, never a stale installed copy. This installs a
meta-path finder (overlay_finder.py): each module under the repo's `vllm/`,
replaced or added, comes from its file here; the rest of vLLM still comes
from the installed wheel.

With source "stock", the replaced modules come from the pinned vllm
base wheel instead, and the modules we add are not importable at all, as in
upstream, so a test can be shown to fail against upstream.
"""

import os
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import overlay_finder

REPO_ROOT = Path(__file__).resolve().parents[1]
# The build tool is the package tools/ at the repository's root, as the
# build frontend's backend-path puts it.
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from tools import check, fetch, pins, util  # noqa: E402

SOURCE_ENV = "VLLM_PATCH_TEST_SOURCE"
SOURCES = ("tree", "stock")


def tree_files(root: Path = REPO_ROOT) -> list[Path]:
    """The Python files under `root/vllm`, relative to `root`."""
    return sorted(
        path.relative_to(root)
        for path in (root / "vllm").rglob("*.py")
        if "__pycache__" not in path.parts
    )


def replaced_files() -> list[Path]:
    """The tree's files that replace upstream's, as pyproject.toml declares."""
    return sorted(map(Path, pins.load_pins().replaces))


def added_files() -> list[Path]:
    """The tree's files that upstream lacks, as pyproject.toml declares."""
    return sorted(map(Path, pins.load_pins().adds))


def _module_name(relative: Path) -> str:
    name = check.module_name(relative.as_posix())
    assert name is not None, relative
    return name


def run_in_session(
    cmd: list[str], *, timeout: float, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session, its output captured as text.

    A hung run is killed with every child it started (pip, a shell's
    commands), and the test fails instead of hanging.
    """
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    with subprocess.Popen(cmd, text=True, start_new_session=True, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_tool(
    root: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tools ARGS`` in ``root``, in its own session."""
    return run_in_session(
        [sys.executable, "-m", "tools", *args], cwd=root, timeout=timeout
    )


def stock_root() -> Path:
    """A folder holding the base wheel's originals of our replaced files."""
    loaded = pins.load_pins()
    base = fetch.fetch_base_wheel(loaded)
    dest = fetch.default_cache_dir() / "stock-files" / base.name.removesuffix(".whl")
    return extract_base_files(loaded.replaces, dest, base)


def extract_base_files(files: Iterable[str], dest: Path, base_wheel: Path) -> Path:
    """Copy upstream's originals of ``files`` (``vllm/...``) out of the base wheel.

    Each file lands by atomic rename, so concurrent test workers never see
    half a file. Returns ``dest``, which mirrors the wheel's layout.
    """
    with zipfile.ZipFile(base_wheel) as zf:
        missing = sorted(set(files) - set(zf.namelist()))
        if missing:
            raise util.OverlayError(f"not in {base_wheel.name}: {', '.join(missing)}")
        for member in files:
            (dest / member).parent.mkdir(parents=True, exist_ok=True)
            partial = dest / f"{member}.{os.getpid()}"
            partial.write_bytes(zf.read(member))
            os.replace(partial, dest / member)
    return dest


def install(source: str | None = None) -> dict[str, Path]:
    """Route imports of the replaced modules to `source` ("tree" or "stock",
    or the root of another checkout, such as an earlier commit's, whose
    `vllm/` files then stand in for this tree's).

    Returns the module name -> file map. Fails if one of the modules was
    already imported, since that copy would be the installed one.
    """
    source = source or os.environ.get(SOURCE_ENV, "tree")
    other = source not in SOURCES and Path(source, "vllm").is_dir()
    if source not in SOURCES and not other:
        raise ValueError(
            f"{SOURCE_ENV}={source!r}: expected one of {SOURCES} or a checkout"
        )
    files = tree_files(Path(source) if other else REPO_ROOT)
    stale = sorted(_module_name(r) for r in files if _module_name(r) in sys.modules)
    if stale:
        raise RuntimeError(
            f"{stale} were imported before the test overlay was installed; "
            "they would be the installed copies, not this tree's files"
        )
    if source == "tree" or other:
        root, hidden = Path(source) if other else REPO_ROOT, []
    else:
        root, files = stock_root(), replaced_files()
        hidden = [_module_name(rel) for rel in added_files()]
    modules = {_module_name(rel): root / rel for rel in files}
    overlay_finder.install(
        root, hidden=hidden, why_hidden="added by this patch; stock vLLM lacks it"
    )
    os.environ[SOURCE_ENV] = source
    return modules
