"""kvpilot.deploy.pair_warmup against fake engines (tests.fakes.engine): what P and D are sent,
when a handoff counts as done, and what a pair that never hands off says."""

from __future__ import annotations

import time

import pytest

from kvpilot.deploy.pair_warmup import PROMPT_BLOCKS, PairWarmUpError, warm_up_pair
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, REQUEST_SUCCESS
from tests.fakes.engine import FakeEngine, serving

BS = 32


def _d_metrics(received_per_request: int):
    """D's /metrics: one more finished request per scrape, and ``received_per_request``
    more tokens received over the transfer with each."""

    def text(scrape: int) -> str:
        return (
            f'{REQUEST_SUCCESS.total}{{finished_reason="length"}} {scrape}\n'
            f'{PROMPT_TOKENS_BY_SOURCE.total}{{source="external_kv_transfer"}} {scrape * received_per_request}\n'
        )

    return text


def _warm_up(p_url: str, d_url: str, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    return warm_up_pair("prefill-0", p_url, "decode-0", d_url, model="tiny", block_size=BS, deadline=deadline)


def test_a_handoff_that_moves_kv_is_done_in_one_try_with_p_params_and_the_same_salted_prompt() -> None:
    p, d = FakeEngine("prefill-0"), FakeEngine("decode-0", metrics_text=_d_metrics(2 * BS))
    with serving(p) as p_url, serving(d) as d_url:
        assert _warm_up(p_url, d_url, 30.0) == 1
    (to_p,), (to_d,) = p.bodies, d.bodies
    assert to_p["kv_transfer_params"] == handoff_request() and to_p["max_tokens"] == 1
    assert len(to_p["prompt"]) > PROMPT_BLOCKS * BS  # whole blocks to move
    assert to_d["kv_transfer_params"] == {"remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
    assert to_d["prompt"] == to_p["prompt"] and to_d["cache_salt"] == to_p["cache_salt"]


def test_a_pair_whose_d_recomputes_is_tried_again_under_new_salts_then_named() -> None:
    p, d = FakeEngine("prefill-0"), FakeEngine("decode-0", metrics_text=_d_metrics(0))
    with serving(p) as p_url, serving(d) as d_url, pytest.raises(PairWarmUpError) as failed:
        _warm_up(p_url, d_url, 2.5)
    message = str(failed.value)
    assert message.startswith("the first KV handoff prefill-0 -> decode-0 did not succeed in ")
    assert "D recomputed the prompt" in message
    assert len(p.bodies) >= 2 and len({b["cache_salt"] for b in p.bodies}) == len(p.bodies)


def test_a_p_that_offers_nothing_is_named() -> None:
    p, d = FakeEngine("prefill-0", kv_params=False), FakeEngine("decode-0", metrics_text=_d_metrics(BS))
    with serving(p) as p_url, serving(d) as d_url, pytest.raises(PairWarmUpError, match="without kv_transfer_params"):
        _warm_up(p_url, d_url, 0.5)
    assert not d.bodies
