# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import vLLM modules from a source tree ahead of the installed wheel.

``tree_imports.install`` puts it first on ``sys.meta_path``. It looks on each
import, so a module added to the tree later is found without reinstalling.
"""

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder
from importlib.util import spec_from_file_location


class OverlayFinder:
    """Serve ``package`` modules under ``root`` (the wheel's layout) first;
    the rest come from the installed wheel. Names in ``hidden`` are refused,
    so a stock run cannot import a module upstream does not ship."""

    package = "vllm"

    def __init__(
        self,
        root: str | os.PathLike[str],
        hidden: tuple[str, ...] | list[str],
        why_hidden: str,
    ):
        self.root = os.path.realpath(root)
        self.hidden = frozenset(hidden)
        self.why_hidden = why_hidden

    def find_spec(
        self, fullname: str, path: list[str] | None = None, target: object = None
    ) -> ModuleSpec | None:
        parts = fullname.split(".")
        # Only dotted identifiers: "vllm./tmp/x" must not name a file outside.
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
        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            return spec
        if os.path.isdir(base):
            # A folder the tree adds without an __init__.py is a namespace
            # package in the built wheel, so it is one here too.
            spec = spec or ModuleSpec(fullname, None, is_package=True)
            tail = spec.submodule_search_locations or ()
            spec.submodule_search_locations = [self._inside(base), *tail]
        return spec

    def _inside(self, path: str) -> str:
        """``path``, unless a symlink takes it out of the checkout."""
        real = os.path.realpath(path)
        if not real.startswith(self.root + os.sep):
            raise ImportError(
                f"{path} resolves to {real}, outside {self.root}; the tests' "
                "import hook only loads files inside the checkout"
            )
        return path


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
    hidden: tuple[str, ...] | list[str] = (),
    why_hidden: str = "",
) -> OverlayFinder:
    """Put a finder for ``root`` first on ``sys.meta_path`` and return it."""
    finder = OverlayFinder(root, hidden, why_hidden)
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]  # list, not Sequence
    return finder
