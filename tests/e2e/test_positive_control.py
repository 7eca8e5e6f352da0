"""Positive control: the same scenario through vLLM's plain NixlConnector, which
attaches P's blocks by position, gives wrong output with HTTP 200. If this test
fails, the verified-attach tests prove nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleets import running_fleet
from deploy.client import complete
from deploy.fleet import Fleet
from deploy.fleet_spec import FleetSpec
from routing.tokenizer import PromptTokenizer
from scenarios import cases, common_full_blocks, colocated_reference

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def nixl_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    spec = FleetSpec(model_dir=model_dir, run_dir=tmp_path_factory.mktemp("nixl-fleet"), connector="NixlConnector",
                     engine_port=8610, side_channel_port=6010, events_port=6610, router_port=8600)  # fmt: skip
    with running_fleet(spec) as started:
        yield started


def test_plain_nixl_attaches_by_position_and_answers_wrong(nixl_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    case = cases()[0]  # a reasoning trace stripped from the middle of history
    prefill, decode = nixl_fleet.by_role("prefill")[0].url, nixl_fleet.by_role("decode")[0].url
    x, x_prime = tokenizer.prompt_token_ids(case.x), tokenizer.prompt_token_ids(case.x_prime)
    params = complete(prefill, x, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).kv_transfer_params
    out = complete(decode, x_prime, max_tokens=10, kv_transfer_params=params)
    reference = colocated_reference(decode, x, x_prime, common_full_blocks(x, x_prime))
    assert out.logprobs != reference.logprobs
