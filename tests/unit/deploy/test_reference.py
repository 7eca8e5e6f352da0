"""The generated reference (config keys, CLI, metrics, endpoints) and the CLI's one vocabulary."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvpilot.deploy import reference
from kvpilot.deploy.cli import build_parser, dynamo_fleet_spec, main
from kvpilot.policies.typed_config import TypedConfig
from kvpilot.routing.config_load import flag_name

ROOT = Path(__file__).resolve().parents[3]


def test_the_committed_reference_pages_are_what_the_code_generates() -> None:
    """``make test`` fails when a config key, flag, metric or endpoint changed and the pages
    were not regenerated (``kvpilot docs reference``)."""
    assert reference.run(ROOT, check=True, parser=build_parser()) == 0, (
        "run `kvpilot docs reference` and commit docs/reference/"
    )


def test_no_reference_page_names_this_checkout() -> None:
    """A default that is this machine's path (a package folder resolved from ``__file__``)
    makes the committed page right on one machine only: CI's clone lives elsewhere."""
    for name, text in reference.pages(build_parser()).items():
        assert str(ROOT) not in text, f"{name} names {ROOT}: give the default in words, resolve it when run"


def test_a_config_field_without_a_docstring_is_refused() -> None:
    class Undocumented(TypedConfig, frozen=True):
        documented: int = 1
        """Has one."""
        bare: int = 2

    with pytest.raises(reference.ReferenceError, match=r"Undocumented\.bare: no docstring"):
        list(reference.config_keys(Undocumented))


def test_every_router_key_has_its_type_default_and_unit() -> None:
    from kvpilot.routing.config import RouterConfig

    keys = {k.key: k for k in reference.config_keys(RouterConfig)}
    assert keys["server.port"].default == "`8000`" and keys["server.port"].unit == "TCP port"
    assert keys["server.ttft_slo_s"].unit == "seconds"
    assert keys["index.backend"].type == "`kvpilot` | `dynamo`"
    assert keys["workers[].url"].default == "required"
    assert keys["disaggregation.max_local_tokens"].type == "integer or null"


def test_every_command_and_flag_has_help_and_the_router_flags_are_named_by_their_key() -> None:
    page = reference.cli_page(build_parser())
    for flag in ("--server-port", "--index-backend", "--sessions-redis-url", "--server-ttft-slo-s"):
        assert f"`{flag}`" in page  # the same name in `kvpilot fleet` and `kvpilot router`
    assert flag_name("cost", "overlap_score_credit") == "--cost-overlap-score-credit"
    for sub in ("k8s render", "dashboards generate", "dashboards render", "docs reference", "router", "demo"):
        assert f"## `kvpilot {sub}`" in page


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--observe"], "--observe"),
        (["--connector", "NixlConnector"], "--connector"),
        (["--index-backend", "dynamo"], "--index-backend"),
        (["--on-picker-failure", "round_robin"], "--on-picker-failure"),
        (["--sessions-redis-url", "redis://127.0.0.1:1/0"], "--sessions-redis-url"),
        (["--prefill", "1", "--decode", "1", "--python-picker"], "--python-picker"),
    ],
)
def test_a_flag_the_dynamo_fleet_cannot_honour_is_refused_with_its_reason(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["fleet", "up", "--dynamo", "--run-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{named}" in err and "is refused:" in err
    assert not (tmp_path / "fleet.json").exists()  # nothing started


def test_help_shows_each_flag_s_default() -> None:
    parser = build_parser()
    fleet = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["fleet"]
    assert "(default: 8000)" in " ".join(fleet.format_help().split())
    assert msgspec  # the reference reads the structs through msgspec


@pytest.mark.parametrize(
    ("flags", "compiled"),
    [
        (["--workers", "4"], True),
        (["--workers", "4", "--python-picker"], False),
        (["--workers", "4", "--gateway-port", "0"], False),  # no Envoy: the router relays
        (["--prefill", "1", "--decode", "1"], False),
    ],
)
def test_aggregated_dynamo_workers_get_the_compiled_picker_by_default(
    flags: list[str], compiled: bool, tmp_path: Path
) -> None:
    args = build_parser().parse_args(["fleet", "up", "--dynamo", "--run-dir", str(tmp_path), *flags])
    assert dynamo_fleet_spec(args, tmp_path).native_picker is compiled
