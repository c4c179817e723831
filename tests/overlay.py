# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import this tree's replaced vLLM modules instead of the installed copies.

`pip install .` puts our files into site-packages, but a test run must
exercise the working tree, never a stale installed copy. This installs a
meta-path finder that maps each module under the repo's `vllm/` to its file
here; the rest of vLLM still comes from the installed wheel.

With source "stock", the same modules come from the pinned vllm 0.33.0 base
wheel instead, so a test can be shown to fail against upstream.
"""

import importlib.abc
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKEND_NAME = "precompiled_overlay"
BACKEND_PATH = REPO_ROOT / "tools" / f"{BACKEND_NAME}.py"
SOURCE_ENV = "VLLM_PATCH_TEST_SOURCE"
SOURCES = ("tree", "stock")


def replaced_files(root: Path = REPO_ROOT) -> list[Path]:
    """The files under `root/vllm`, relative to `root`."""
    return sorted(
        path.relative_to(root)
        for path in (root / "vllm").rglob("*.py")
        if "__pycache__" not in path.parts
    )


def _module_name(relative: Path) -> str:
    if relative.name == "__init__.py":
        raise NotImplementedError(
            f"{relative}: replacing a package __init__ is not supported"
        )
    return ".".join(relative.with_suffix("").parts)


def build_backend() -> ModuleType:
    """tools/precompiled_overlay.py, which knows the pinned base wheel.

    tools/ is a PEP 517 backend-path, not a package: put it on sys.path as a
    build frontend does, so the backend's helper modules there import too.
    """
    tools = str(BACKEND_PATH.parent)
    if tools not in sys.path:
        sys.path.append(tools)
    return importlib.import_module(BACKEND_NAME)


def run_tool(
    root: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python tools/precompiled_overlay.py ARGS`` in ``root``.

    In its own session, so a hung run is killed with every child (pip) it
    started, and the test fails instead of hanging.
    """
    cmd = [sys.executable, "tools/precompiled_overlay.py", *args]
    with subprocess.Popen(
        cmd,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stock_root() -> Path:
    """A folder holding the base wheel's originals of our replaced files."""
    return build_backend().extract_base_files(replaced_files())


class _OverlayFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: dict[str, Path]):
        self.modules = modules

    def find_spec(self, fullname, path, target=None):
        location = self.modules.get(fullname)
        if location is None:
            return None
        return importlib.util.spec_from_file_location(fullname, location)


def install(source: str | None = None) -> dict[str, Path]:
    """Route imports of the replaced modules to `source` ("tree" or "stock").

    Returns the module name -> file map. Fails if one of the modules was
    already imported, since that copy would be the installed one.
    """
    source = source or os.environ.get(SOURCE_ENV, "tree")
    if source not in SOURCES:
        raise ValueError(f"{SOURCE_ENV}={source!r}: expected one of {SOURCES}")
    root = REPO_ROOT if source == "tree" else stock_root()
    modules = {_module_name(rel): root / rel for rel in replaced_files()}
    stale = sorted(name for name in modules if name in sys.modules)
    if stale:
        raise RuntimeError(
            f"{stale} were imported before the test overlay was installed; "
            "they would be the installed copies, not this tree's files"
        )
    sys.meta_path.insert(0, _OverlayFinder(modules))
    os.environ[SOURCE_ENV] = source
    return modules
