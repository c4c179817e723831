# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import vLLM modules from a source tree ahead of the installed wheel.

One mechanism for two users: the editable install (``pip install -e .``)
ships this file as ``_vllm_overlay_finder.py`` and starts it from a ``.pth``
file, and the test suite (``tests/overlay.py``) installs it in-process.

Lookups are done on each import, not from a list made at install time, so a
module added to the tree later (e.g. a new helper beside a replaced file) is
found without reinstalling, just as an edited one is. Only the standard
library is used: this runs at interpreter start-up in every vLLM process.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Serve ``package`` modules found under ``root`` before anything else.

    ``root`` mirrors the wheel layout (``root/vllm/a/b.py`` is ``vllm.a.b``).
    A module absent from ``root`` falls through to the installed wheel. Names
    in ``hidden`` raise ModuleNotFoundError, so a stock run cannot import a
    module that upstream does not ship from a newer install.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        package: str = "vllm",
        hidden: Iterable[str] = (),
        why_hidden: str = "",
    ):
        self.root = Path(root).resolve()
        self.package = package
        self.hidden = frozenset(hidden)
        self.why_hidden = why_hidden

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, {self.package!r})"

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: object = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        if fullname in self.hidden:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} ({self.why_hidden})", name=fullname
            )
        parts = fullname.split(".")
        # A name is only ever a dotted path of identifiers: "vllm./tmp/x"
        # must not become a file name outside the tree.
        if not all(p.isidentifier() for p in parts):
            return None
        folder = self.root.joinpath(*parts[:-1])
        module = folder / f"{parts[-1]}.py"
        if module.is_file():
            return importlib.util.spec_from_file_location(
                fullname, self._inside(module)
            )
        package_dir = folder / parts[-1]
        init = package_dir / "__init__.py"
        if init.is_file():
            # Submodules the tree lacks must still come from the wheel.
            search = [str(package_dir)] + _installed_dirs(parts[-1], path, package_dir)
            return importlib.util.spec_from_file_location(
                fullname, self._inside(init), submodule_search_locations=search
            )
        return None

    def _inside(self, path: Path) -> Path:
        """``path``, unless it resolves out of the tree.

        A symlink under ``vllm/`` must not make the hook run a file the
        checkout does not hold.
        """
        real = path.resolve()
        if not real.is_relative_to(self.root):
            raise ImportError(
                f"{path} resolves to {real}, outside {self.root}; the vllm "
                "import hook only loads files inside the checkout"
            )
        return path


def _installed_dirs(name: str, parent_path: Sequence[str] | None, own: Path) -> list:
    """The installed copies of a package folder the tree also has."""
    found = []
    for entry in parent_path if parent_path is not None else sys.path:
        candidate = os.path.join(entry or ".", name)
        if os.path.isdir(candidate) and Path(candidate) != own:
            found.append(candidate)
    return found


def install(
    root: str | os.PathLike[str],
    package: str = "vllm",
    hidden: Iterable[str] = (),
    why_hidden: str = "",
) -> OverlayFinder:
    """Put a finder for ``root`` first on ``sys.meta_path`` and return it.

    Installing the same root twice (a ``.pth`` read by a nested interpreter
    set-up, say) leaves one finder, so the lookup cost stays constant.
    """
    finder = OverlayFinder(root, package, hidden, why_hidden)
    sys.meta_path[:] = [
        f
        for f in sys.meta_path
        if not (
            isinstance(f, OverlayFinder)
            and f.root == finder.root
            and f.package == finder.package
        )
    ]
    sys.meta_path.insert(0, finder)
    return finder
