"""The router's config from its YAML file and command-line flags (:func:`load_config`):
defaults, then the file, then each flag given, converted once into the frozen structs of
:mod:`kvpilot.routing.config`.

Every scalar leaf of a mapping section has a flag named by its key (:func:`flag_name`:
``--cost-overlap-score-credit 0.5``, ``--disaggregation-compare-costs true``,
``--disaggregation-max-local-tokens none``, ``--index-backend dynamo``: an enum leaf's
flag takes only its values); its help is the field's docstring.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvpilot.policies.typed_config import TypedConfig, convert, field_docs
from kvpilot.routing.config import ConfigError, RouterConfig

_FLAG_KINDS = (int, float, str, bool)
_NULL = object()
"""A flag's ``none``: the leaf set to null (distinct from a flag not given)."""


def _scalar(annotation: Any) -> tuple[type, bool] | None:
    """(type, nullable) of a scalar leaf's annotation (a bool, number, string or
    enum, maybe ``| None``), or None for anything else."""
    nullable = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (annotation,) = [a for a in args if a is not type(None)]
        nullable = True
    if annotation in _FLAG_KINDS or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        return annotation, nullable
    return None


def _leaves() -> list[tuple[str, str, type, bool]]:
    """(section, field, type, nullable) of every scalar leaf of the mapping sections."""
    out = []
    for section in msgspec.structs.fields(RouterConfig):
        if not (isinstance(section.type, type) and issubclass(section.type, TypedConfig)):
            continue
        for leaf in msgspec.structs.fields(section.type):
            scalar = _scalar(leaf.type)
            if scalar is not None:
                out.append((section.name, leaf.name, *scalar))
    return out


def _flag_parser(kind: type[Any], nullable: bool) -> Any:
    """argparse's ``type=`` for a leaf: ``true``/``false`` for a bool, ``none`` for
    null, the text itself for an enum (its ``choices`` check it)."""

    def parse(text: str) -> Any:
        if nullable and text.lower() in ("none", "null"):
            return _NULL
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() == "true"
        return text if issubclass(kind, enum.Enum) else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def flag_name(section: str, name: str) -> str:
    """The flag of the YAML key ``section.name``: ``--section-name``, ``_`` as ``-``
    (``server.port``: ``--server-port``; ``index.backend``: ``--index-backend``). The one
    name of that setting in every ``kvpilot`` command."""
    return "--" + f"{section}_{name}".replace("_", "-")


DYNAMO_FLAGS = {
    ("cost", "overlap_score_credit"): "--router-kv-overlap-score-credit",
    ("cost", "overlap_score_credit_decay"): "--router-kv-overlap-score-credit-decay",
    ("cost", "host_cache_hit_weight"): "--router-host-cache-hit-weight",
    ("cost", "disk_cache_hit_weight"): "--router-disk-cache-hit-weight",
    ("cost", "prefill_load_scale"): "--router-prefill-load-scale",
    ("cost", "decode_active_request_weight"): "--router-decode-active-request-weight",
    ("cost", "router_temperature"): "--router-temperature",
    ("index", "block_size"): "--kv-cache-block-size",
}
"""Dynamo's frontend flags (``python -m dynamo.frontend --help``, 1.6.1) for the settings that mean
the same in kvpilot, accepted as aliases of :func:`flag_name`'s, so that a Dynamo router's
command line carries over without renaming."""


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add :func:`flag_name` for every scalar leaf (default None = not given, the YAML's
    or the struct's value stands); a nullable leaf takes ``none``, a boolean ``true`` or
    ``false``, an enum one of its values (argparse's ``choices``). Each flag's help is its
    field's docstring, with the key and its default."""
    group = parser.add_argument_group("router config (each flag overrides the YAML key it names)")
    sections = {f.name: f.type for f in msgspec.structs.fields(RouterConfig)}
    docs = {section: field_docs(struct) for section, struct in sections.items() if isinstance(struct, type)}
    for section, name, kind, nullable in _leaves():
        choices: list[object] | None = None
        metavar = kind.__name__.upper()
        if issubclass(kind, enum.Enum):
            values = [member.value for member in kind]
            choices, metavar = [*values, *([_NULL] if nullable else [])], "{" + ",".join(values) + "}"
        struct = sections[section]
        default = next(f.default for f in msgspec.structs.fields(struct) if f.name == name)
        shown = default.value if isinstance(default, enum.Enum) else default
        meaning = docs[section].get(name, "")
        alias = DYNAMO_FLAGS.get((section, name))
        group.add_argument(
            flag_name(section, name),
            *([alias] if alias else []),
            dest=f"{section}__{name}",
            type=_flag_parser(kind, nullable),
            choices=choices,
            default=None,
            metavar=metavar + ("|none" if nullable else ""),
            help=f"{meaning} (YAML: {section}.{name}; default: {json.dumps(shown)})".replace("%", "%%"),
        )


def load_config(path: str | Path | None, args: argparse.Namespace | None = None) -> RouterConfig:
    """Defaults, then the YAML file at ``path`` (if any), then flags set in ``args``,
    converted by :func:`kvpilot.policies.typed_config.convert`. Raises :class:`ConfigError`
    naming the first wrong key and where it came from (the file, or the flag that set it),
    or the file and the line of a YAML syntax error; :class:`OSError` (naming the file)
    when the file cannot be read."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = _read_yaml(Path(path))
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(ConfigError.ROOT_KEY, f"must be a mapping, got {type(loaded).__name__} ({path})")
        data = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (loaded or {}).items()}
    flags: dict[str, str] = {}
    if args is not None:
        for section, name, _, _ in _leaves():
            value = getattr(args, f"{section}__{name}", None)
            if value is not None:
                target = data.setdefault(section, {})
                if not isinstance(target, dict):
                    raise ConfigError(section, f"must be a mapping ({path})")
                target[name] = None if value is _NULL else value
                flags[f"{section}.{name}"] = flag_name(section, name)
    try:
        return convert(data, RouterConfig)
    except ConfigError as exc:
        if exc.key in flags:
            raise ConfigError(exc.key, f"{exc.problem} (flag {flags[exc.key]})") from None
        if path is not None:
            raise ConfigError(exc.key, f"{exc.problem} ({path})") from None
        raise


def _read_yaml(path: Path) -> Any:
    """The YAML document at ``path``; a syntax error is a :class:`ConfigError` naming the
    file, the line and the column (yaml's own names the text ``<unicode string>``)."""
    text = path.read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(ConfigError.ROOT_KEY, f"{path}{where} is not valid YAML: {problem}") from None
