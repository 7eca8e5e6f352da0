"""Through kvpilot a request gets what the engine itself would give it: the parity table of
tests/e2e/parity.py on a 1 P + 1 D fleet behind Envoy (every prefill on P, KV over NIXL),
on the tiny model shaped like real ones (BOS, a template with tools and a thinking switch,
engines with vLLM's hermes tool-call and qwen3 reasoning parsers).

For each case: the router's token ids (:mod:`kvpilot.routing.serve.prompt`) are the engine's
own ``POST /tokenize``'s, and the answer through the fleet equals D's answer to the same
request sent to it directly (greedy tokens, logprobs within bf16 noise, content, reasoning,
tool calls, usage); first, the fleet's first request is a handoff, not a fallback. Then an
agent loop with the OpenAI SDK: tools declared, the call forced by
name, tool results fed back, each step equal to D's own answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.metrics import delta, scrape, settled, total
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.upstream import Api
from tests.e2e.parity import (
    CASES,
    NAMED,
    Case,
    agent_loop,
    answers_are_the_engine_s,
    router_ids_are_the_engine_s,
)
from tests.e2e.scenarios import BLOCK_SIZE, PROMPT_TOKENS


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> EnginePrompt:
    return EnginePrompt(PromptTokenizer(model_dir), ChatTemplate.from_model_dir(model_dir))


def _d(fleet: Fleet) -> str:
    return fleet.by_role("decode")[0].url


def test_the_first_request_after_ready_is_not_a_fallback(pd_fleet: Fleet, tokenizer: PromptTokenizer) -> None:
    """First on its fleet (``test_verified_attach``, before it in the group, sends no request
    through the router). `fleet up` handed KV from P to D once before it returned
    (kvpilot.deploy.pair_warmup: NIXL's handshake), so the first client request pays no
    handshake: it goes P -> D and D receives the prompt's KV over NIXL (issue 20: `make demo`'s
    first request went `fallback` at 38.5 s TTFT)."""
    decode = pd_fleet.by_role("decode")[0]
    before_d, before_router = scrape(decode.url), scrape(pd_fleet.router.url)
    assert total(before_router, "kvpilot_router_decisions_total") == 0  # nothing routed before this one
    assert delta(before_d, {}, PROMPT_TOKENS, source="external_kv_transfer") > 0  # the warm-up's handoff
    token_ids = tokenizer.text_token_ids(filler_text(300, 11))
    out = complete(pd_fleet.router.url, token_ids, max_tokens=4)
    after_d = settled(decode.url, before_d)
    assert out.headers.get("X-KVPilot-Route") == "remote_prefill", out.headers
    assert delta(scrape(pd_fleet.router.url), before_router, "kvpilot_router_prefill_fallbacks_total") == 0
    received = delta(after_d, before_d, PROMPT_TOKENS, source="external_kv_transfer")
    assert received >= len(token_ids) // BLOCK_SIZE * BLOCK_SIZE, received


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_router_s_token_ids_are_the_engine_s(pd_fleet: Fleet, prompts: EnginePrompt, case: Case) -> None:
    ids = router_ids_are_the_engine_s(_d(pd_fleet), prompts, case)
    if case.api is Api.COMPLETIONS and isinstance(case.body["prompt"], str):
        assert ids[0] == 0  # the tokenizer's BOS, as vLLM's completions endpoint adds it


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_answer_through_the_fleet_equals_the_engine_s_own(
    pd_fleet: Fleet, model_dir: Path, prompts: EnginePrompt, case: Case
) -> None:
    headers, through = answers_are_the_engine_s(pd_fleet.client_url, _d(pd_fleet), model_dir, prompts, case)
    several = (case.body.get("n") or 1) > 1  # vLLM fans samples out: D prefills them
    assert headers["x-kvpilot-route"] == ("local_prefill" if several else "remote_prefill"), headers
    if case.body.get("tool_choice") == NAMED:
        assert [name for name, _ in through[0]["tool_calls"]] == ["run_tests"]
        json.loads(through[0]["tool_calls"][0][1])  # the arguments are JSON, as forced


def test_an_agent_loop_with_the_openai_sdk_equals_the_engine_step_by_step(pd_fleet: Fleet, model_dir: Path) -> None:
    """Three steps of an agent through Envoy (:func:`tests.e2e.parity.agent_loop`), each
    equal to D's own answer."""
    agent_loop(pd_fleet.client_url, _d(pd_fleet), model_dir)
