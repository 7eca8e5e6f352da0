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
import uuid
from pathlib import Path

import pytest

from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.metrics import delta, scrape, settled, total
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import whitespace_logit_bias
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.upstream import Api
from tests.e2e.parity import (
    CASES,
    HISTORY,
    LOGPROB_TOLERANCE,
    NAMED,
    NO_THINKING,
    TOOLS,
    Case,
    answer,
    differences,
    engine_token_ids,
    forcing,
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
    ids = prompts.token_ids(case.api, case.body)
    if isinstance(case.body.get("prompt"), list):
        assert ids == case.body["prompt"]  # token ids go as they came
    else:
        assert ids == engine_token_ids(_d(pd_fleet), case)
    if case.api is Api.COMPLETIONS and isinstance(case.body["prompt"], str):
        assert ids[0] == 0  # the tokenizer's BOS, as vLLM's completions endpoint adds it


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_an_answer_through_the_fleet_equals_the_engine_s_own(
    pd_fleet: Fleet, model_dir: Path, prompts: EnginePrompt, case: Case
) -> None:
    extra = forcing(case, model_dir)
    headers, through, usage = answer(pd_fleet.client_url, case, **extra)
    _, direct, direct_usage = answer(_d(pd_fleet), case, cache_salt=f"parity-{uuid.uuid4().hex}", **extra)
    assert not differences(through, direct), (case.name, differences(through, direct))
    assert usage is not None and direct_usage is not None
    assert usage["prompt_tokens"] == direct_usage["prompt_tokens"] == len(prompts.token_ids(case.api, case.body))
    several = (case.body.get("n") or 1) > 1  # vLLM fans samples out: D prefills them
    assert headers["x-kvpilot-route"] == ("local_prefill" if several else "remote_prefill"), headers
    if case.body.get("tool_choice") == NAMED:
        assert [name for name, _ in through[0]["tool_calls"]] == ["run_tests"]
        json.loads(through[0]["tool_calls"][0][1])  # the arguments are JSON, as forced


def test_an_agent_loop_with_the_openai_sdk_equals_the_engine_step_by_step(pd_fleet: Fleet, model_dir: Path) -> None:
    """Three steps of an agent through Envoy: tools declared, the call forced by name (thinking
    off, so vLLM's structured outputs apply from the first token; whitespace biased away, so
    the random-weight model closes the call), the tool's result fed back with the call in the
    history (content null); one session. Each step's tool call and logprobs equal D's own
    answer to the same messages."""
    from openai import OpenAI

    fleet_client = OpenAI(base_url=f"{pd_fleet.client_url}/v1", api_key="unused", max_retries=0)
    engine_client = OpenAI(base_url=f"{_d(pd_fleet)}/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, object]] = [dict(m) for m in HISTORY]
    session = f"agent-{uuid.uuid4().hex}"
    for step in range(3):
        kwargs: dict[str, object] = {
            "model": "tiny",
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": NAMED,
            "max_completion_tokens": 80,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 1,
        }
        thinking_off = {"chat_template_kwargs": NO_THINKING, **whitespace_logit_bias(model_dir)}
        got = fleet_client.chat.completions.create(**kwargs, extra_body={**thinking_off, "conversation_id": session})
        want = engine_client.chat.completions.create(
            **kwargs, extra_body={**thinking_off, "cache_salt": f"agent-ref-{uuid.uuid4().hex}"}
        )
        (call,) = got.choices[0].message.tool_calls or []
        (ref,) = want.choices[0].message.tool_calls or []
        assert (call.function.name, call.function.arguments) == (ref.function.name, ref.function.arguments), step
        assert call.function.name == "run_tests" and isinstance(json.loads(call.function.arguments), dict)
        got_lp = [t.logprob for t in got.choices[0].logprobs.content]
        want_lp = [t.logprob for t in want.choices[0].logprobs.content]
        assert len(got_lp) == len(want_lp)
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) <= LOGPROB_TOLERANCE, step
        assert got.usage.prompt_tokens == want.usage.prompt_tokens, step
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"step {step}: 3 passed, 1 failed"})
