# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import this tree's vLLM modules instead of the installed copies.

`pip install .` puts our files into site-packages, but a test run must
exercise the working tree, never a stale installed copy. This installs the
same meta-path finder as the editable install (tools/overlay_finder.py): each
module under the repo's `vllm/`, replaced or added, comes from its file here;
the rest of vLLM still comes from the installed wheel.

With source "stock", the replaced modules come from the pinned vllm 0.33.0
base wheel instead, and the modules we add are not importable at all, as in
upstream, so a test can be shown to fail against upstream.
"""

import importlib.util
import os
import sys
import zipfile
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = REPO_ROOT / "tools"
BACKEND_NAME = "precompiled_overlay"
BACKEND_PATH = TOOLS_DIR / f"{BACKEND_NAME}.py"
# tools/ is the PEP 517 backend-path, not a package; its modules import their
# siblings by plain name, as they do inside a build.
if str(TOOLS_DIR) not in sys.path:
    sys.path.append(str(TOOLS_DIR))

import overlay_finder  # noqa: E402

SOURCE_ENV = "VLLM_PATCH_TEST_SOURCE"
SOURCES = ("tree", "stock")


def replaced_files(root: Path = REPO_ROOT) -> list[Path]:
    """The Python files under `root/vllm` (replaced or added), relative to `root`."""
    return sorted(
        path.relative_to(root)
        for path in (root / "vllm").rglob("*.py")
        if "__pycache__" not in path.parts
    )


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build_backend() -> ModuleType:
    """tools/precompiled_overlay.py, which knows the pinned base wheel.

    Imported by path: tools/ is a PEP 517 backend-path, not a package.
    """
    loaded = sys.modules.get(BACKEND_NAME)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(BACKEND_NAME, BACKEND_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[BACKEND_NAME] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def _upstream_split() -> tuple[Path, list[Path], list[Path]]:
    """The base wheel, and the tree's files it ships and those it lacks."""
    base = build_backend().fetch_base_wheel()
    with zipfile.ZipFile(base) as zf:
        upstream = set(zf.namelist())
    files = replaced_files()
    shipped = [rel for rel in files if rel.as_posix() in upstream]
    return base, shipped, [rel for rel in files if rel not in shipped]


def added_files() -> list[Path]:
    """The tree's files that upstream does not ship (relative to the repo)."""
    return _upstream_split()[2]


def stock_root() -> Path:
    """A folder holding the base wheel's originals of our replaced files."""
    base, shipped, _ = _upstream_split()
    return build_backend().extract_base_files(shipped, base_wheel=base)


def install(source: str | None = None) -> dict[str, Path]:
    """Route imports of the replaced modules to `source` ("tree" or "stock").

    Returns the module name -> file map. Fails if one of the modules was
    already imported, since that copy would be the installed one.
    """
    source = source or os.environ.get(SOURCE_ENV, "tree")
    if source not in SOURCES:
        raise ValueError(f"{SOURCE_ENV}={source!r}: expected one of {SOURCES}")
    files = replaced_files()
    stale = sorted(_module_name(r) for r in files if _module_name(r) in sys.modules)
    if stale:
        raise RuntimeError(
            f"{stale} were imported before the test overlay was installed; "
            "they would be the installed copies, not this tree's files"
        )
    if source == "tree":
        root, hidden = REPO_ROOT, []
    else:
        root, added = stock_root(), added_files()
        hidden = [_module_name(rel) for rel in added]
        files = [rel for rel in files if rel not in added]
    modules = {_module_name(rel): root / rel for rel in files}
    overlay_finder.install(
        root, hidden=hidden, why_hidden="added by this patch; stock vLLM lacks it"
    )
    os.environ[SOURCE_ENV] = source
    return modules
