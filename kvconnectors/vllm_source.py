"""Read a vLLM source tree without importing it: classes, their members and
signatures, string literals, registrations, as Python's ``ast`` sees the files.

Any vLLM version can be read this way on any box (no torch, no CUDA, no compiled
extension): the installed package, or a wheel unpacked into a scratch folder.
:mod:`kvpilot.kvconnectors.vllm_contract` checks what ``KVPilotConnector`` relies on
against it. Not pure: it reads the files under ``root`` (and caches what it read); it
imports nothing from them and writes nothing.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

Kind = Literal["method", "classmethod", "staticmethod", "property", "attribute"]


@dataclass(frozen=True, slots=True)
class Member:
    """A class member as defined: its kind and, for a function, its parameters after
    ``self``/``cls`` (``*args`` and ``**kwargs`` spelled with their stars)."""

    kind: Kind
    params: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClassDef:
    """A class found in the tree: the module that defines it and its node."""

    module: str
    node: ast.ClassDef

    @property
    def name(self) -> str:
        return self.node.name


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> tuple[str, ...]:
    """``fn``'s parameter names in order; the first dropped when ``bound``."""
    args = fn.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    names = positional[1:] if bound else positional
    if args.vararg is not None:
        names.append(f"*{args.vararg.arg}")
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        names.append(f"**{args.kwarg.arg}")
    return tuple(names)


def _function_kind(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Kind | None:
    """``None`` for a property's setter or deleter (not a member of its own)."""
    kind: Kind = "method"
    for deco in fn.decorator_list:
        name = deco.id if isinstance(deco, ast.Name) else deco.attr if isinstance(deco, ast.Attribute) else ""
        if name in ("setter", "deleter"):
            return None
        if name in ("property", "cached_property"):
            kind = "property"
        elif name == "classmethod":
            kind = "classmethod"
        elif name == "staticmethod":
            kind = "staticmethod"
    return kind


def _own_members(node: ast.ClassDef) -> dict[str, Member]:
    """Members ``node``'s body defines: functions, class-level names, and every
    ``self.<name>`` its methods assign."""
    members: dict[str, Member] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = _function_kind(stmt)
            if kind is not None:
                members[stmt.name] = Member(kind, parameters(stmt, bound=kind != "staticmethod"))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            members[stmt.target.id] = Member("attribute")
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = Member("attribute")
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                members.setdefault(target.attr, Member("attribute"))
    return members


class SourceTree:
    """The ``vllm`` package under ``root`` (the folder that holds ``vllm/``)."""

    def __init__(self, root: Path) -> None:
        if not (root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"no vllm package under {root}")
        self.root = root

    def path(self, module: str) -> Path | None:
        """The file of ``module`` (a package's ``__init__.py``); ``None`` if absent."""
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def version(self) -> str:
        """The version the tree states (``vllm/_version.py``); ``"unknown"`` if none."""
        path = self.path("vllm._version")
        text = path.read_text() if path is not None else ""
        found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        return found.group(1) if found else "unknown"

    def module(self, module: str) -> ast.Module | None:
        """``module`` parsed; ``None`` if the tree has no such module."""
        return _parse(self.path(module))

    def _imported(self, module: str, name: str) -> tuple[str, str] | None:
        """Where ``module`` imports ``name`` from (``from X import Y as name``)."""
        tree = self.module(module)
        if tree is None:
            return None
        package = module if self.path(module) == self.root.joinpath(*module.split("."), "__init__.py") else None
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = node.module or ""
                    if node.level:  # relative: from the module's package
                        parts = (package or module.rpartition(".")[0]).split(".")
                        parts = parts[: len(parts) - node.level + 1]
                        source = ".".join([*parts, source] if source else parts)
                    return source, alias.name
        return None

    def find_class(self, module: str, name: str, _depth: int = 0) -> ClassDef | None:
        """The class ``module.name`` names, through re-exports and aliases
        (``NixlConnector = NixlPullConnector``); ``None`` if not found."""
        tree = self.module(module)
        if tree is None or _depth > 8:
            return None
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return ClassDef(module, stmt)
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
            ):
                return self.find_class(module, stmt.value.id, _depth + 1)
        imported = self._imported(module, name)
        return None if imported is None else self.find_class(*imported, _depth + 1)

    def mro(self, cls: ClassDef) -> list[ClassDef]:
        """``cls`` and its bases found in the tree, depth first, each once (bases
        outside the tree, such as ``ABC``, are skipped)."""
        seen: list[ClassDef] = []

        def visit(c: ClassDef) -> None:
            if any(s.node is c.node for s in seen):
                return
            seen.append(c)
            for base in c.node.bases:
                if isinstance(base, ast.Name):
                    found = self.find_class(c.module, base.id)
                    if found is not None:
                        visit(found)

        visit(cls)
        return seen

    def lookup(self, cls: ClassDef, member: str) -> tuple[ClassDef, Member] | None:
        """The first class in ``cls``'s MRO that defines ``member``, and the member."""
        for owner in self.mro(cls):
            found = _own_members(owner.node).get(member)
            if found is not None:
                return owner, found
        return None

    def members(self, cls: ClassDef) -> dict[str, tuple[ClassDef, Member]]:
        """Every member of ``cls`` over its MRO, each with the class that defines it."""
        merged: dict[str, tuple[ClassDef, Member]] = {}
        for owner in self.mro(cls):
            for name, member in _own_members(owner.node).items():
                merged.setdefault(name, (owner, member))
        return merged

    def class_keywords(self, cls: ClassDef) -> dict[str, object]:
        """Class keywords over the MRO with literal values (``msgspec.Struct``'s
        ``tag=True``, ``array_like=True``); the nearest class wins."""
        keywords: dict[str, object] = {}
        for owner in self.mro(cls):
            for kw in owner.node.keywords:
                if kw.arg is not None and isinstance(kw.value, ast.Constant):
                    keywords.setdefault(kw.arg, kw.value.value)
        return keywords

    def function(self, module: str, name: str) -> ast.FunctionDef | None:
        """The module-level function ``module.name`` (through re-exports)."""
        tree = self.module(module)
        if tree is None:
            return None
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
                return stmt
        imported = self._imported(module, name)
        return None if imported is None or imported[0] == module else self.function(*imported)

    def defines(self, module: str, name: str) -> bool:
        """Whether ``module`` binds ``name`` at its top level (any statement or import)."""
        tree = self.module(module)
        if tree is None:
            return False
        # top-level statements, and those under a top-level ``if`` (``if TYPE_CHECKING:``)
        stmts = [s for top in tree.body for s in ([top, *top.body, *top.orelse] if isinstance(top, ast.If) else [top])]
        for stmt in stmts:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == name:
                return True
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        return self._imported(module, name) is not None

    def _files(self, module: str) -> list[Path]:
        path = self.path(module)
        if path is None:
            return []
        return sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]

    def string_literals(self, module: str) -> frozenset[str]:
        """Every string constant in ``module`` (all of a package's files)."""
        found: set[str] = set()
        for path in self._files(module):
            tree = _parse(path)
            if tree is not None:
                found.update(
                    n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                )
        return frozenset(found)

    def call_literals(self, module: str, method: str) -> frozenset[str]:
        """The literal first arguments of every call to ``<anything>.method(...)`` in
        ``module`` (all of a package's files)."""
        found: set[str] = set()
        for path in self._files(module):
            tree = _parse(path)
            for node in ast.walk(tree) if tree is not None else ():
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == method
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    found.add(node.args[0].value)
        return frozenset(found)

    def registrations(self, module: str, method: str) -> dict[str, tuple[str, str]]:
        """``name -> (module path, class name)`` of every ``<x>.method("name",
        "module", "Class")`` call in ``module`` (vLLM's connector registry)."""
        tree = self.module(module)
        found: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
                args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if len(args) == 3:
                    found[args[0]] = (args[1], args[2])
        return found

    def contains_text(self, needle: str) -> bool:
        """Whether any ``.py`` file of the package holds ``needle`` verbatim."""
        return needle in _package_text(self.root)


@cache
def _parse(path: Path | None) -> ast.Module | None:
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError):
        return None


@cache
def _package_text(root: Path) -> str:
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted((root / "vllm").rglob("*.py")))
