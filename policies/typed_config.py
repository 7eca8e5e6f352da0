"""One converter for every typed config: a mapping in, a frozen typed value out,
or one error that names the dotted key.

The router's YAML (:mod:`kvpilot.routing.config`), ``KVPilotConnector``'s extra config
(:mod:`kvpilot.kvconnectors.config`) and the planner's spec documents
(:mod:`kvpilot.policies.presets`) are :class:`TypedConfig` subclasses, and all of them
go through :func:`convert`. It lives in ``policies`` because that is the pure
base both other packages already import (``policies <- kvconnectors <-
routing``); in either of the others, ``policies`` would have to import upward.

What msgspec checks, msgspec says: types, unknown keys
(``forbid_unknown_fields``), missing keys, enum and literal values. :func:`convert`
only turns its ``"<message> - at `$.workers[0].url`"`` into the key
``workers[0].url`` and adds what msgspec's text leaves out: the keys a struct
knows (after an unknown one), the values an enum allows, and which key of a
mapping holds the bad value (msgspec writes ``[...]``). A type's own checks run
in its ``__post_init__`` (:func:`check_range` for the numeric ones) and raise its
:attr:`TypedConfig.error_type` naming the field; :func:`convert` puts the path
of the struct in front (``index.block_size``). So, for the router's config::

    {"cost": {"router_seed": 1.5}}      cost.router_seed: Expected `int`, got `float`
    {"index": {"block_size": 0}}        index.block_size: must be a finite number > 0, got 0
    {"index": {"tiers": {"GPU": "x"}}}  index.tiers.GPU: must be one of 'gpu', 'host', 'disk', 'shared', got 'x'
    {"workers": [{"colour": 1}]}        workers[0].colour: unknown key (known: name, role, url, ...)
"""

from __future__ import annotations

import ast
import enum
import inspect
import math
import operator
import re
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec


class TypedConfigError(ValueError):
    """A config key or value is wrong: ``key`` is its dotted path (``cost.router_seed``,
    ``workers[0].url``, ``index.tiers.GPU``; :attr:`ROOT_KEY` for the document
    itself), ``problem`` says what is wrong. The message is ``"<PREFIX><key>: <problem>"``."""

    PREFIX: ClassVar[str] = ""
    """Names the document in the message, for a subclass whose key alone would not."""
    ROOT_KEY: ClassVar[str] = "<root>"

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{self.PREFIX}{key}: {problem}")
        self.key = key
        self.problem = problem


class TypedConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The base of every config type: a frozen msgspec struct that refuses unknown keys.

    A subclass checks its own values in ``__post_init__`` (which runs on direct
    construction and on :func:`convert` alike) and raises :attr:`error_type` with the
    field's name; a package whose callers catch their own error sets its subclass here.
    """

    error_type: ClassVar[type[TypedConfigError]] = TypedConfigError


C = TypeVar("C", bound=TypedConfig)

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP = re.compile(r"\.(?P<field>[^.\[]+)|\[(?P<index>\d+)\]|(?P<value>\[\.\.\.\])")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]*)`$")
_BAD_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$", re.DOTALL)


def convert(data: object, cls: type[C]) -> C:
    """``data`` (a mapping, as parsed from YAML or JSON) as a ``cls``.

    msgspec converts it, running every struct's ``__post_init__``. Raises
    ``cls.error_type`` naming the first wrong key by its dotted path; mutates nothing.
    """
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        key, problem = _explain(exc, data, cls)
        raise cls.error_type(key, problem) from None


def _explain(exc: msgspec.ValidationError, data: object, cls: type[TypedConfig]) -> tuple[str, str]:
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches every string
    message = match["message"]
    key, kind = _walk(match["path"] or "", data, cls)
    cause = exc.__cause__
    if isinstance(cause, TypedConfigError):  # a struct's own check, about one of its fields
        return _join(key, cause.key), cause.problem
    if unknown := _UNKNOWN.match(message):
        known = ", ".join(f.name for f in _fields(kind))
        return _join(key, unknown["key"]), f"unknown key (known: {known})"
    if missing := _MISSING.match(message):
        return _join(key, missing["key"]), "missing required key"
    if (bad := _BAD_ENUM.match(message)) and (choices := _choices(kind)):
        return key or cls.error_type.ROOT_KEY, f"must be one of {choices}, got {bad['value']}"
    return key or cls.error_type.ROOT_KEY, message


def _walk(path: str, data: object, kind: Any) -> tuple[str, Any]:
    """msgspec's ``path`` (``.workers[0].url``, ``.index.tiers[...]``) as a dotted key,
    and the type found there (``Any`` past a type it cannot see into). ``[...]`` (a
    mapping's value) becomes the first key of ``data`` there whose value does not convert."""
    key = ""
    for step in _STEP.finditer(path):
        kind = _bare(kind)
        args = typing.get_args(kind)
        if step["field"] is not None:
            name = step["field"]
            key = _join(key, name)
            kind = next((f.type for f in _fields(kind) if f.name == name), Any)
            data = data.get(name) if isinstance(data, Mapping) else None
        elif step["index"] is not None:
            index = int(step["index"])
            key += f"[{index}]"
            kind = args[0] if args else Any
            data = data[index] if isinstance(data, Sequence) and index < len(data) else None
        else:
            kind = args[1] if len(args) == 2 else Any
            entries: Mapping[Any, object] = data if isinstance(data, Mapping) else {}
            bad = [k for k, v in entries.items() if not _converts(v, kind)]
            key = _join(key, str(bad[0])) if bad else key + "[...]"
            data = entries[bad[0]] if bad else None
    return key, _bare(kind)


def _fields(kind: Any) -> tuple[msgspec.structs.FieldInfo, ...]:
    """A struct type's fields; none for any other type."""
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return msgspec.structs.fields(kind)
    return ()


def _bare(kind: Any) -> Any:
    """``kind`` without ``Annotated`` metadata and without ``| None``."""
    while True:
        if typing.get_origin(kind) is typing.Annotated:
            kind = typing.get_args(kind)[0]
        elif typing.get_origin(kind) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(kind) if a is not type(None)]
            if len(options) != 1:
                return kind
            kind = options[0]
        else:
            return kind


def _converts(value: object, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return False
    return True


def _choices(kind: Any) -> str:
    """The values an enum or literal type allows, as ``'a', 'b'``; ``""`` for another type."""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values: tuple[object, ...] = tuple(member.value for member in kind)
    elif typing.get_origin(kind) is typing.Literal:
        values = typing.get_args(kind)
    else:
        return ""
    return ", ".join(repr(value) for value in values)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def check_range(
    config: TypedConfig,
    *names: str,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
) -> None:
    """Each named field of ``config`` must be a finite number (an int or a float, not
    a bool) within every bound given, or ``None`` (a nullable leaf switched off).

    Raises ``config.error_type(name, "must be a finite number >= 0, got -1")`` for
    the first that is not; reads only.
    """
    bounds = [
        (sign, bound, test)
        for sign, bound, test in (
            (">=", at_least, operator.ge),
            (">", above, operator.gt),
            ("<=", at_most, operator.le),
            ("<", below, operator.lt),
        )
        if bound is not None
    ]
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not all(test(value, bound) for _, bound, test in bounds):
            wanted = "".join(f" {'and ' if i else ''}{sign} {bound:g}" for i, (sign, bound, _) in enumerate(bounds))
            raise type(config).error_type(name, f"must be a finite number{wanted}, got {value!r}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field of the struct ``cls`` (and of its struct bases) with the docstring written
    under it in the source, whitespace collapsed: what the generated reference and each
    router flag's help say of the key. A field with none is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "msgspec") or not issubclass(klass, msgspec.Struct):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs
