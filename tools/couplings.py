# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream names the tree's files use, checked against a release.

``git merge-file`` sees only the text of the replaced files. A release that
renames something the tree uses (``vllm.distributed.parallel_state._node_count``,
say) rebases cleanly and builds, then fails at import on the user's machine.
So ``rebase`` reads the new release's sources with ``ast`` (from the wheel,
nothing is installed or imported) and checks that each of these still
exists, naming the file and the name that is missing:

* modules the tree imports (``import vllm.a.b``, ``from vllm.a import b``);
* names taken from them: module-level functions, classes and assignments,
  names a module re-exports with ``from ... import``, and names a module
  with a module-level ``__getattr__`` spells as a string (how ``vllm.envs``
  and ``vllm.platforms`` serve theirs);
* attributes read on an imported module or class (``envs.VLLM_X``,
  ``KVConnectorFactory._registry``): a class's own body or, through bases
  the scan can follow, its ancestors' bodies;
* keyword arguments of calls to upstream functions and classes, also
  through a tree class that inherits its ``__init__`` from upstream: each
  must be a parameter of the def (a class's ``__init__``), or the def must
  take ``**kwargs``, which accepts any;
* each tuple that ``[tool.vllm-overlay.env-choices]`` declares, against the
  choices ``vllm/envs.py`` gives that environment variable.

Names from the tree's own modules are checked against the tree. What the
scan cannot see is accepted, never guessed at: modules outside ``vllm``,
attributes of objects (instances, call results), extension modules, classes
with a base it cannot follow, and classes whose ``__init__`` is generated
(dataclasses, pydantic).
"""

import ast
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .check import (
    ENV_CHOICES,
    assigned_value,
    import_names,
    module_name,
    split_declared_name,
)
from .pins import Pins

# The module of vLLM's environment variables, relative to the package.
ENVS_FILE = "envs.py"
# Bases that add no attribute a class-level read of ours could want.
_PLAIN_BASES = frozenset({"object", "ABC", "Generic", "Protocol"})
_BLOCKS = ("body", "orelse", "finalbody", "handlers")


@dataclass(frozen=True)
class Coupling:
    """One upstream name a tree file relies on, and what kind of name it is."""

    path: str
    name: str
    kind: str


@dataclass
class Scan:
    """What a scan found: the couplings it checked, and one line per problem."""

    couplings: list[Coupling] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Sources:
    """A release's files by their path in the wheel (``vllm/...``)."""

    def __init__(
        self, label: str, members: Iterable[str], read: Callable[[str], bytes]
    ) -> None:
        self.label = label
        self.members = set(members)
        self.read = read

    @classmethod
    def of_wheel(cls, zf: zipfile.ZipFile, label: str) -> "Sources":
        return cls(label, zf.namelist(), zf.read)

    @classmethod
    def of_folder(cls, root: Path, package: str, label: str) -> "Sources":
        """An installed copy: ``root`` holds the package folder, as site-packages."""
        members = (
            p.relative_to(root).as_posix()
            for p in (root / package).rglob("*")
            if p.is_file()
        )
        return cls(label, members, lambda member: (root / member).read_bytes())


@dataclass
class _Module:
    """What one module defines at its top level, read from its source."""

    name: str
    where: str
    upstream: bool
    is_package: bool
    defs: dict[str, ast.AST | tuple[str, str | None] | None]
    star: list[str]
    getattr_names: frozenset[str] | None


# What a name or an attribute chain resolves to.
@dataclass(frozen=True)
class _ModuleRef:
    name: str


@dataclass(frozen=True)
class _Def:
    module: _Module
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    qualname: str


class _Opaque:
    """Something the scan cannot look into, so it accepts whatever follows."""


OPAQUE = _Opaque()
_Found = _ModuleRef | _Def | _Opaque


class _Missing:
    """A lookup that found nothing: ``where`` says where it looked."""

    def __init__(self, where: str) -> None:
        self.where = where


class _Modules:
    """The tree's modules over a release's, parsed on demand."""

    def __init__(self, package: str, tree: Mapping[str, bytes], release: Sources):
        self.package = package
        self.release = release
        self.tree = {
            name: path for path in tree if (name := module_name(path)) is not None
        }
        self.tree_sources = tree
        self.shipped = import_names(release.members)
        self._parsed: dict[str, _Module | None] = {}

    def is_ours(self, module: str) -> bool:
        """Whether a module name is the package's (``vllm`` or below)."""
        return module == self.package or module.startswith(self.package + ".")

    def exists(self, module: str) -> bool:
        return module in self.tree or module in self.shipped

    def where(self, module: str) -> str:
        return self.tree.get(module, self.release.label)

    def get(self, module: str) -> _Module | None:
        """The parsed module; None for one that cannot be read (an extension)."""
        if module not in self._parsed:
            self._parsed[module] = self._parse(module)
        return self._parsed[module]

    def _parse(self, module: str) -> _Module | None:
        if module in self.tree:
            path = self.tree[module]
            source, upstream = self.tree_sources[path], False
        else:
            path = self.shipped.get(module, "")
            if not path.endswith(".py"):
                return None
            source, upstream = self.release.read(path), True
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return None
        is_package = path.endswith("/__init__.py")
        info = _Module(module, self.where(module), upstream, is_package, {}, [], None)
        for stmt in _top_level(tree.body):
            _bind(info, stmt)
        if isinstance(info.defs.get("__getattr__"), ast.FunctionDef):
            info.getattr_names = frozenset(
                node.value
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
            )
        return info


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, also inside ``if``/``try``/``with`` blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.Try | ast.TryStar | ast.With):
            for block in _BLOCKS:
                for sub in getattr(stmt, block, []):
                    inner = sub.body if isinstance(sub, ast.ExceptHandler) else [sub]
                    yield from _top_level(inner)


def _targets(stmt: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]


def _absolute(module: _Module, node: ast.ImportFrom) -> str:
    """The absolute module name of a (possibly relative) ``from`` import."""
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _bind(module: _Module, stmt: ast.stmt) -> None:
    """Record what one top-level statement defines; a def wins over the rest."""
    found: dict[str, ast.AST | tuple[str, str | None] | None] = {}
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        found[stmt.name] = stmt
    elif isinstance(stmt, ast.Assign | ast.AnnAssign):
        for target in _targets(stmt):
            for node in ast.walk(target):
                if isinstance(node, ast.Name):
                    found[node.id] = None
    elif isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.asname:
                found[alias.asname] = (alias.name, None)
            else:
                top = alias.name.split(".")[0]
                found[top] = (top, None)
    elif isinstance(stmt, ast.ImportFrom):
        source = _absolute(module, stmt)
        for alias in stmt.names:
            if alias.name == "*":
                module.star.append(source)
            else:
                found[alias.asname or alias.name] = (source, alias.name)
    for name, value in found.items():
        if not isinstance(module.defs.get(name), ast.AST):
            module.defs[name] = value


class _FileScan:
    """The checks of one tree file against the modules of one release."""

    def __init__(self, path: str, modules: _Modules, scan: Scan) -> None:
        self.path = path
        self.modules = modules
        self.scan = scan
        self.bound: dict[str, _Found] = {}
        self.own = modules.get(module_name(path) or "")

    def problem(self, text: str) -> None:
        line = f"{self.path}: {text}"
        if line not in self.scan.problems:
            self.scan.problems.append(line)

    def coupling(self, name: str, kind: str, upstream: bool) -> None:
        entry = Coupling(self.path, name, kind)
        if upstream and entry not in self.scan.couplings:
            self.scan.couplings.append(entry)

    def run(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                self.check_import(node)
        self.visit(tree)

    def check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        """Check what an import names, and bind its names for later reads."""
        modules = self.modules
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not modules.is_ours(alias.name):
                    continue
                if self.check_module(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else local
                    self.bound[local] = _ModuleRef(target)
            return
        source = _absolute(self.own, node) if self.own else node.module or ""
        if not modules.is_ours(source) or not self.check_module(source):
            return
        for alias in node.names:
            if alias.name == "*":
                continue
            found = self.member(_ModuleRef(source), alias.name)
            if not isinstance(found, _Missing):
                self.bound[alias.asname or alias.name] = found

    def check_module(self, module: str) -> bool:
        if not self.modules.exists(module):
            self.problem(f"{module} is not in {self.modules.where(module)}")
            return False
        self.coupling(module, "module", module not in self.modules.tree)
        return True

    def member(self, of: _Found, attr: str) -> _Found | _Missing:
        """``of.attr``, checked: a problem line for each name that is missing."""
        if isinstance(of, _Opaque):
            return OPAQUE
        if isinstance(of, _ModuleRef):
            found = self.lookup(of.name, attr, set())
            name, of_class = f"{of.name}.{attr}", False
            upstream = of.name not in self.modules.tree
        elif isinstance(of.node, ast.ClassDef):
            found = self.class_member(of, attr, set())
            name, of_class = f"{of.qualname}.{attr}", True
            upstream = of.module.upstream
        else:
            return OPAQUE
        if isinstance(found, _Missing):
            self.problem(f"{name} is not in {found.where}")
        else:
            self.coupling(name, _kind(found, of_class), upstream)
        return found

    def lookup(self, module: str, name: str, seen: set) -> _Found | _Missing:
        """What ``module.name`` is: a def, a module, or something opaque."""
        if (module, name) in seen:
            return OPAQUE
        seen.add((module, name))
        info = self.modules.get(module)
        if info is None:
            if self.modules.exists(module):
                return OPAQUE
            return _Missing(self.modules.where(module))
        if name in info.defs:
            value = info.defs[name]
            if isinstance(value, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                return _Def(info, value, f"{module}.{name}")
            if isinstance(value, tuple):
                return self.follow(value, seen)
            return OPAQUE
        if self.modules.exists(f"{module}.{name}"):
            return _ModuleRef(f"{module}.{name}")
        for star in info.star:
            if self.modules.is_ours(star):
                found = self.lookup(star, name, seen)
                if not isinstance(found, _Missing):
                    return found
        if info.getattr_names is not None and name in info.getattr_names:
            return OPAQUE
        return _Missing(info.where)

    def follow(self, target: tuple[str, str | None], seen: set) -> _Found | _Missing:
        """Where an upstream module's own import binding leads."""
        module, attr = target
        if not self.modules.is_ours(module):
            return OPAQUE
        if attr is None:
            return _ModuleRef(module)
        return self.lookup(module, attr, seen)

    def class_member(self, cls: _Def, attr: str, seen: set) -> _Found | _Missing:
        """A class-level attribute: its body, then the bases the scan can follow."""
        node = cls.node
        if node in seen or not isinstance(node, ast.ClassDef):
            return OPAQUE
        seen.add(node)
        for stmt in _top_level(node.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if stmt.name == attr:
                    return _Def(cls.module, stmt, f"{cls.qualname}.{attr}")
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                names = (n for t in _targets(stmt) for n in ast.walk(t))
                if any(isinstance(n, ast.Name) and n.id == attr for n in names):
                    return OPAQUE
        for base in node.bases:
            if _plain_base(base):
                continue
            found = self.resolve_in(cls.module, base)
            if not (isinstance(found, _Def) and isinstance(found.node, ast.ClassDef)):
                return OPAQUE  # a base the scan cannot read may define it
            inherited = self.class_member(found, attr, seen)
            if not isinstance(inherited, _Missing):
                return inherited
        return _Missing(cls.module.where)

    def resolve_in(self, module: _Module, expr: ast.expr) -> _Found | _Missing:
        """A base-class expression, read in the module that defines the class."""
        chain = _chain(expr)
        if chain is None:
            return OPAQUE
        found: _Found | _Missing = self.lookup(module.name, chain[0], set())
        for attr in chain[1:]:
            if isinstance(found, _Missing):
                break
            found = self.quiet_member(found, attr)
        return found

    def quiet_member(self, of: _Found, attr: str) -> _Found | _Missing:
        """``of.attr`` inside upstream, where a missing name is not ours to report."""
        if isinstance(of, _ModuleRef):
            return self.lookup(of.name, attr, set())
        if isinstance(of, _Def) and isinstance(of.node, ast.ClassDef):
            return self.class_member(of, attr, set())
        return OPAQUE

    def resolve(self, expr: ast.expr) -> _Found | None:
        """A tree expression's upstream meaning, checking each attribute read."""
        chain = _chain(expr)
        if chain is None:
            return None
        root = chain[0]
        found: _Found | _Missing
        if root in self.bound:
            found = self.bound[root]
        elif self.own is not None and isinstance(
            self.own.defs.get(root), ast.ClassDef | ast.FunctionDef
        ):
            found = self.lookup(self.own.name, root, set())
        else:
            return None
        for attr in chain[1:]:
            if isinstance(found, _Missing):
                return None
            found = self.member(found, attr)
        return None if isinstance(found, _Missing) else found

    def visit(self, node: ast.AST) -> None:
        """Walk the file, checking attribute chains and call keywords."""
        if isinstance(node, ast.Call):
            callee = self.resolve(node.func)
            if isinstance(callee, _Def):
                self.check_keywords(callee, node)
            inner: Iterable[ast.AST] = [*node.args, *node.keywords]
            if _chain(node.func) is None:
                inner = [node.func, *inner]
        elif isinstance(node, ast.Attribute) and _chain(node) is not None:
            self.resolve(node)
            return
        else:
            inner = ast.iter_child_nodes(node)
        for child in inner:
            self.visit(child)

    def check_keywords(self, callee: _Def, call: ast.Call) -> None:
        """Each keyword of a call: a parameter of the def, or taken by **kwargs."""
        keywords = [k.arg for k in call.keywords if k.arg]
        if not keywords:
            return
        owner, fn = callee, callee.node
        if isinstance(fn, ast.ClassDef):
            init = self.class_member(callee, "__init__", set())
            if not isinstance(init, _Def) or isinstance(init.node, ast.ClassDef):
                return  # generated (dataclass, pydantic) or out of sight
            owner, fn = init, init.node
        args = fn.args
        params = {a.arg for a in [*args.args, *args.kwonlyargs]}
        shown = owner.qualname.removesuffix(".__init__")
        for keyword in keywords:
            if keyword in params:
                self.coupling(f"{shown}({keyword}=)", "keyword", owner.module.upstream)
            elif args.kwarg is not None:
                self.coupling(
                    f"{shown}({keyword}=)",
                    f"keyword, taken by **{args.kwarg.arg}",
                    owner.module.upstream,
                )
            else:
                self.problem(
                    f"{shown}() takes no keyword argument {keyword} in "
                    f"{owner.module.where}"
                )


def _kind(found: _Found, of_class: bool) -> str:
    """What a found name is, for the list of couplings."""
    if isinstance(found, _ModuleRef):
        return "module"
    if isinstance(found, _Def):
        if isinstance(found.node, ast.ClassDef):
            return "nested class" if of_class else "class"
        return "method" if of_class else "function"
    return "class attribute" if of_class else "name"


def _chain(expr: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return [expr.id, *reversed(parts)]


def _plain_base(expr: ast.expr) -> bool:
    """``object``, ``ABC``, ``Generic[T]`` and the like: nothing to inherit."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    chain = _chain(expr)
    return chain is not None and chain[-1] in _PLAIN_BASES


def env_choices(source: bytes, variable: str) -> list[str] | None:
    """The choices ``vllm/envs.py`` declares for ``variable``, read statically.

    vLLM declares them with ``env_with_choices(NAME, default, [choices])``
    (or another ``*_with_choices`` helper); its ``TYPE_CHECKING`` block
    repeats them as ``NAME: Literal[...]``, read when there is no such call.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and (chain := _chain(node.func)) is not None
            and chain[-1].endswith("with_choices")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == variable
        ):
            given = {k.arg: k.value for k in node.keywords}
            choices = node.args[2] if len(node.args) > 2 else given.get("choices")
            return _strings(choices)
    for stmt in _top_level(tree.body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.target.id == variable
            and isinstance(stmt.annotation, ast.Subscript)
            and (chain := _chain(stmt.annotation.value)) is not None
            and chain[-1] == "Literal"
        ):
            inner = stmt.annotation.slice
            return _strings(
                inner if isinstance(inner, ast.Tuple) else ast.List([inner])
            )
    return None


def _strings(node: ast.expr | None) -> list[str] | None:
    """A literal list or tuple of strings; None for anything else."""
    try:
        value = ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def check_env_choices(
    pins: Pins, tree: Mapping[str, bytes], release: Sources, scan: Scan
) -> None:
    """Each declared tuple of the tree against the choices of its variable."""
    envs = f"{pins.name}/{ENVS_FILE}"
    for variable, declared in sorted(pins.env_choices.items()):
        found = split_declared_name(declared)
        if found is None or found[0] not in tree:
            continue  # tree_problems names a bad entry
        path, name = found
        ours = _strings(assigned_value(tree[path], name))
        if ours is None:
            scan.problems.append(
                f"{path}: {name} is not a literal tuple of strings at module "
                f"level, which {ENV_CHOICES} needs to compare it with {envs}"
            )
            continue
        source = release.read(envs) if envs in release.members else b""
        if variable.encode() not in source:
            scan.problems.append(
                f"{path}: {name} lists the choices of {variable}, which is not "
                f"in {envs} of {release.label}"
            )
            continue
        theirs = env_choices(source, variable)
        if theirs is None:
            scan.problems.append(
                f"{path}: {name} lists the choices of {variable}, which {envs} "
                f"of {release.label} declares in a form this check cannot read; "
                f"compare them by hand, then drop the entry from {ENV_CHOICES}"
            )
        elif theirs != ours:
            scan.problems.append(
                f"{path}: {name} is {tuple(ours)!r}, but {envs} of "
                f"{release.label} declares {theirs!r} for {variable}"
            )
        else:
            scan.couplings.append(Coupling(path, f"{envs}: {variable}", "choices"))


def scan_tree(pins: Pins, tree: Mapping[str, bytes], release: Sources) -> Scan:
    """Every coupling of the tree's Python files to ``release``, and the problems.

    ``tree`` maps each declared file (``vllm/...``) to its contents, which
    for a rebase may be a merge not yet written.
    """
    scan = Scan()
    modules = _Modules(pins.name, tree, release)
    for path, data in sorted(tree.items()):
        if not path.endswith(".py"):
            continue
        try:
            parsed = ast.parse(data)
        except (SyntaxError, ValueError) as err:
            scan.problems.append(
                f"{path}: does not compile, so it cannot be checked ({err})"
            )
            continue
        _FileScan(path, modules, scan).run(parsed)
    check_env_choices(pins, tree, release, scan)
    return scan


def coupling_problems(
    pins: Pins, tree: Mapping[str, bytes], wheels: Iterable[Path], label: str
) -> list[str]:
    """The problems of ``tree`` on each wheel of a release, each line once."""
    problems: list[str] = []
    for wheel in sorted(wheels):
        with zipfile.ZipFile(wheel) as zf:
            found = scan_tree(pins, tree, Sources.of_wheel(zf, label)).problems
        problems += [p for p in found if p not in problems]
    return problems
