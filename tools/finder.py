# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import vLLM modules from a source tree ahead of the installed wheel.

One mechanism for two users: the editable install (``pip install -e .``)
ships this file as ``_vllm_overlay_finder.py`` and starts it from a ``.pth``
file, and the test suite (``tests/tree_imports.py``) installs it in-process.

Lookups are done on each import, not from a list made at install time, so a
module added to the tree later (e.g. a new helper beside a replaced file) is
found without reinstalling, just as an edited one is.

This runs at start-up in every process of the environment, so it imports
nothing that start-up has not loaded already: the import system's own
frozen modules and ``os``, no ``importlib.util``, ``pathlib`` or ``typing``
(which is also why the annotations use builtins only).
"""

import os
import sys
from _frozen_importlib import ModuleSpec
from _frozen_importlib_external import PathFinder, spec_from_file_location


class OverlayFinder:
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
        hidden: tuple[str, ...] | list[str] = (),
        why_hidden: str = "",
    ):
        self.root = os.path.realpath(root)
        self.package = package
        self.hidden = frozenset(hidden)
        self.why_hidden = why_hidden

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, {self.package!r})"

    def find_spec(
        self,
        fullname: str,
        path: list[str] | None = None,
        target: object = None,
    ) -> ModuleSpec | None:
        parts = fullname.split(".")
        # A name is only ever a dotted path of identifiers: the "/tmp/x" of
        # "vllm./tmp/x" must not become a file name outside the tree.
        if parts[0] != self.package or not all(p.isidentifier() for p in parts):
            return None
        if fullname in self.hidden:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} ({self.why_hidden})", name=fullname
            )
        base = os.path.join(self.root, *parts)
        if os.path.isfile(base + ".py"):
            return spec_from_file_location(fullname, self._inside(base + ".py"))
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            # Submodules the tree lacks must still come from the wheel.
            search = [base, *_installed_dirs(parts[-1], path, base)]
            return spec_from_file_location(
                fullname, self._inside(init), submodule_search_locations=search
            )
        return self._not_in_tree(fullname, path, base)

    def _inside(self, path: str) -> str:
        """``path``, unless it resolves out of the tree.

        A symlink under ``vllm/`` must not make the hook run a file the
        checkout does not hold.
        """
        real = os.path.realpath(path)
        if not real.startswith(self.root + os.sep):
            raise ImportError(
                f"{path} resolves to {real}, outside {self.root}; the vllm "
                "import hook only loads files inside the checkout"
            )
        return path

    def _not_in_tree(
        self, fullname: str, path: list[str] | None, base: str
    ) -> ModuleSpec | None:
        """The installed module, else the tree's folder, else why there is none.

        A folder the tree adds without an ``__init__.py`` is a namespace
        package in the built wheel, so it is one here too. A module nobody
        has while the checkout is gone is most likely one of ours: say so,
        instead of a bare "No module named".
        """
        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            return spec
        if os.path.isdir(base):
            spec = spec or ModuleSpec(fullname, None, is_package=True)
            tail = spec.submodule_search_locations or ()
            spec.submodule_search_locations = [self._inside(base), *tail]
            return spec
        if spec is None and not os.path.isdir(os.path.join(self.root, self.package)):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the editable vllm install loads "
                f"it from {self.root}, which is gone; run `pip install -e .` "
                "from the checkout's new place, or `pip install .`",
                name=fullname,
            )
        return spec


def _installed_dirs(name: str, parent_path: list[str] | None, own: str) -> list:
    """The installed copies of a package folder the tree also has."""
    found = []
    for entry in parent_path if parent_path is not None else sys.path:
        candidate = os.path.join(entry or ".", name)
        if os.path.isdir(candidate) and os.path.realpath(candidate) != own:
            found.append(candidate)
    return found


def install(
    root: str | os.PathLike[str],
    package: str = "vllm",
    hidden: tuple[str, ...] | list[str] = (),
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
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]  # list, not Sequence
    return finder


def pth_line(module: str, root: str | os.PathLike[str]) -> str:
    """The ``.pth`` line that starts this file, installed as ``module``."""
    return f"import {module}; {module}.install({os.fspath(root)!r})\n"
