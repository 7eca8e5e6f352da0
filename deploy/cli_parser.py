"""The ``kvpilot`` command's argparse classes, one help format and one error format for
every subcommand (a subparser is built from its parent's class, so the top parser's class
reaches every command), and the argparse ``type`` functions its commands share.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

ARGUMENT_STRING_FLAGS = frozenset({"--engine-args"})
"""Flags whose value is itself a string of command-line arguments (``--engine-args '--x 1'``):
argparse would take a value that starts with ``-`` for a flag, so :class:`Parser` joins
such a flag to the value that follows it (``--engine-args=--x 1``) before parsing."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the defaults that say nothing: a help text that
    states its own default (``(default: the tiny model)``), an unset (``None``) or empty
    default and a switch's ``False`` get no ``(default: ...)`` appended."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        stated = "(default" in text or "default:" in text
        if stated or action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose every command formats its help with :class:`HelpFormatter`
    (a ``formatter_class`` passed in is replaced) and answers a bad flag or value with one
    line naming it and how to get the usage (exit status 2), not the whole usage."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(join_argument_strings(sys.argv[1:] if args is None else args), namespace)


def join_argument_strings(argv: Sequence[str]) -> list[str]:
    """``argv`` with each of :data:`ARGUMENT_STRING_FLAGS` joined to the value after it
    (``["--engine-args", "--x"]`` becomes ``["--engine-args=--x"]``); a flag with nothing
    after it, or already written ``--flag=value``, is left as it is. Returns a new list."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in ARGUMENT_STRING_FLAGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def json_object(text: str) -> dict[str, object]:
    """An argparse ``type``: ``text`` parsed as a JSON object; anything else is refused
    (argparse names the flag beside the reason)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}: {text!r}")
    return value


def argument_string(text: str) -> tuple[str, ...]:
    """An argparse ``type``: ``text`` split as a shell would (``'--x 1 --y "a b"'``)."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: {text!r}") from None


def model_dir(text: str) -> Path:
    """An argparse ``type``: a model's directory, which must exist and hold the model's
    ``config.json`` (refused before any engine starts)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no config.json in it (not a model's directory)")
    return path
