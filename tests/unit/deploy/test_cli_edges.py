"""The ``kvpilot`` command's edges: its version, help that says each thing once, one-line
errors naming the flag, and inputs refused before anything starts."""

from __future__ import annotations

import argparse
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from kvpilot.deploy.cli import build_parser, main
from kvpilot.deploy.cli_parser import join_argument_strings


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _commands(sub)
    return found


def test_version_prints_the_installed_distribution_s(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpilot {version('kvpilot')}"


def test_no_help_says_default_twice_or_default_none() -> None:
    for command in _commands(build_parser()):
        text = " ".join(command.format_help().split())
        assert "(default: None)" not in text, command.prog
        assert not re.search(r"default[^()]*\) \(default:", text), command.prog
        assert "(default: )" not in text, command.prog


@pytest.mark.parametrize("command", ["k8s render", "dashboards render"])
def test_a_description_is_whole_sentences(command: str) -> None:
    parser = next(c for c in _commands(build_parser()) if c.prog == f"kvpilot {command}")
    assert parser.description is not None and parser.description.rstrip().endswith(".")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["router", "--server-port", "x"], "argument --server-port: invalid int value: 'x'"),
        (["fleet", "up", "--prefill", "two"], "argument --prefill: invalid int value: 'two'"),
        (["fleet", "up", "--connector-extra-config", "{bad"], "argument --connector-extra-config: not JSON"),
        (["fleet", "up", "--connector-extra-config", "[1]"], "--connector-extra-config: must be a JSON object"),
        (["fleet", "up", "--engine-args", '"open'], "argument --engine-args: No closing quotation"),
        (["fleet", "up", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert len(err.strip().splitlines()) == 1, err  # no usage block before it


def test_a_model_dir_that_is_no_model_is_refused_before_any_engine_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for given, why in ((tmp_path / "absent", "no such directory"), (tmp_path, "no config.json")):
        with pytest.raises(SystemExit):
            main(["fleet", "up", "--run-dir", str(tmp_path / "run"), "--model-dir", str(given)])
        assert f"argument --model-dir: {given}: {why}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_engine_args_may_start_with_a_dash() -> None:
    args = build_parser().parse_args(["fleet", "up", "--engine-args", "--enable-auto-tool-choice --x 'a b'"])
    assert args.engine_args == ("--enable-auto-tool-choice", "--x", "a b")
    assert build_parser().parse_args(["fleet", "up"]).engine_args == ()


@pytest.mark.parametrize(
    ("argv", "joined"),
    [
        (["--engine-args", "--x"], ["--engine-args=--x"]),
        (["--engine-args=--x", "--y"], ["--engine-args=--x", "--y"]),
        (["up", "--engine-args"], ["up", "--engine-args"]),  # nothing after it: argparse names it
        (["--prefill", "--engine-args"], ["--prefill", "--engine-args"]),
    ],
)
def test_join_argument_strings(argv: list[str], joined: list[str]) -> None:
    assert join_argument_strings(argv) == joined


def test_the_router_s_own_entry_prints_the_version_too(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpilot.routing.cli import main as router_main

    with pytest.raises(SystemExit) as done:
        router_main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpilot {version('kvpilot')}"
