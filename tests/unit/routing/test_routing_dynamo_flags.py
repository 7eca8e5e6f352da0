"""Dynamo's router flags carry over: each alias sets the kvpilot setting of the same meaning,
and each is a flag Dynamo's own frontend declares."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvpilot.routing.config_load import DYNAMO_FLAGS, add_cli_flags, flag_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    return parser


@pytest.mark.parametrize(("key", "alias"), list(DYNAMO_FLAGS.items()), ids=lambda v: str(v))
def test_a_dynamo_flag_sets_what_kvpilot_s_own_flag_sets(key, alias):
    section, name = key
    value = "64" if name == "block_size" else "0.5"
    by_alias = vars(_parser().parse_args([alias, value]))
    by_name = vars(_parser().parse_args([flag_name(section, name), value]))
    assert by_alias == by_name and by_alias[f"{section}__{name}"] is not None


def test_every_alias_is_a_flag_of_dynamo_s_frontend():
    pytest.importorskip("dynamo.frontend")
    out = subprocess.run(
        [sys.executable, "-m", "dynamo.frontend", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert all(alias in out for alias in DYNAMO_FLAGS.values()), out[-2000:]
