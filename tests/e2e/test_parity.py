"""Through kvpilot a request gets what the engine itself would give it: the parity table of
tests/e2e/parity.py on a 1 P + 1 D fleet behind Envoy (every prefill on P, KV over NIXL),
on the tiny model shaped like real ones (BOS, a template with tools and a thinking switch,
engines with vLLM's hermes tool-call and qwen3 reasoning parsers).

For each case: the router's token ids (:mod:`kvpilot.routing.serve.prompt`) are the engine's
own ``POST /tokenize``'s, and the answer through the fleet equals D's answer to the same
request sent to it directly (greedy tokens, logprobs within bf16 noise, content, reasoning,
tool calls, usage); first, the fleet's first request is a handoff, not a fallback. Then an
agent loop with the OpenAI SDK: tools declared, the call forced by
name, tool results fed back, each step equal to D's own answer; and an agent's session
tokenized step by step from its last prompt, each step's ids the engine's own.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet import Fleet
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape, settled, total
from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.truncation import truncation_of
from kvpilot.routing.serve.upstream import Api
from tests.e2e.conftest import PD_MAX_LOGPROBS
from tests.e2e.parity import (
    CASES,
    HISTORY,
    NAMED,
    TOOLS,
    Case,
    agent_loop,
    answer,
    answers_are_the_engine_s,
    differences,
    engine_token_ids,
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


def test_a_session_s_steps_tokenized_from_its_last_prompt_are_the_engine_s(
    pd_fleet: Fleet, prompts: EnginePrompt
) -> None:
    """An agent's session, step by step (:mod:`kvpilot.routing.serve.incremental_tokens`):
    each step's ids, tokenized from the session's last prompt on, are D's own ``/tokenize``;
    from the second step on the ids before the new turn are kept, not tokenized again; an
    edit to an earlier turn, and thinking switched off, still give D's ids."""
    session = f"parity-{uuid.uuid4().hex}"
    messages: list[dict[str, Any]] = json.loads(json.dumps(HISTORY))
    bodies: list[dict[str, Any]] = []
    for step in range(4):
        bodies.append({"messages": [*messages], "tools": TOOLS})
        call = {"id": f"s{step}", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"s{step}", "content": f"step {step}: " + filler_text(80, 20 + step)},
        ]
    edited = [{**messages[0], "content": "You are a careful coding agent."}, *messages[1:]]
    bodies += [
        {"messages": edited, "tools": TOOLS},
        {"messages": edited, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
    ]
    reused, sizes = [], []
    for k, body in enumerate(bodies):
        before = prompts.sessions.stats.reused_tokens
        ids = prompts.token_ids(Api.CHAT, body, session=session)
        assert ids == engine_token_ids(_d(pd_fleet), Case(f"step {k}", Api.CHAT, body)), k
        reused.append(prompts.sessions.stats.reused_tokens - before)
        sizes.append(len(ids))
    assert reused[0] == 0, reused
    kept_all_but_the_last_turn_s_end = all(sizes[k - 1] - 10 <= reused[k] < sizes[k - 1] for k in (1, 2, 3))
    assert kept_all_but_the_last_turn_s_end, (reused, sizes)
    assert reused[4] <= 2, reused  # the system turn edited: BOS and <|system|> kept, no more


def test_a_truncated_prompt_is_routed_on_the_ids_the_engine_keeps(
    pd_fleet: Fleet, pd_spec: FleetSpec, prompts: EnginePrompt
) -> None:
    """``truncate_prompt_tokens``: the answer through the fleet is D's own, and the router's
    ids (BOS and the prompt's last tokens, as vLLM's tokenizer truncates) are as many as D
    says it read."""
    case = Case(
        "truncated", Api.COMPLETIONS, {"prompt": filler_text(300, 8), "max_tokens": 6, "truncate_prompt_tokens": 50}
    )
    headers, through, usage = answer(pd_fleet.client_url, case)
    _, direct, direct_usage = answer(_d(pd_fleet), case, cache_salt=f"parity-{uuid.uuid4().hex}")
    assert not differences(through, direct), differences(through, direct)
    truncation = truncation_of(case.body, case.api, max_model_len=pd_spec.max_model_len, max_chars_per_token=0)
    ids = prompts.token_ids(case.api, case.body, truncation=truncation)
    assert usage is not None and direct_usage is not None
    assert usage["prompt_tokens"] == direct_usage["prompt_tokens"] == len(ids) == 50
    assert ids[0] == 0 and headers["x-kvpilot-route"] == "remote_prefill", (ids[:3], headers)


def test_a_prompt_over_the_model_s_length_is_refused_as_the_engine_refuses_it(
    pd_fleet: Fleet, pd_spec: FleetSpec
) -> None:
    """One token-id prompt longer than the engines' --max-model-len: the router's 400 and
    message are D's own (the router learned the length from the fleet and D's /v1/models)."""
    body = {"model": "tiny", "prompt": [40 + i % 200 for i in range(pd_spec.max_model_len + 8)], "max_tokens": 4}
    through, direct = _refusal(pd_fleet.client_url, body), _refusal(_d(pd_fleet), body)
    assert through == direct and through[0] == 400, (through, direct)


def test_logprobs_over_vllm_s_default_pass_where_the_engines_allow_them(
    pd_fleet: Fleet, model_dir: Path, prompts: EnginePrompt
) -> None:
    """The engines run with ``--max-logprobs 30``: 25 logprobs (over vLLM's default 20) get
    D's own answer through the fleet; 31 are refused with D's own message."""
    case = Case("logprobs 25", Api.COMPLETIONS, {"prompt": filler_text(120, 9), "max_tokens": 4, "logprobs": 25})
    answers_are_the_engine_s(pd_fleet.client_url, _d(pd_fleet), model_dir, prompts, case)
    over = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "logprobs": PD_MAX_LOGPROBS + 1}
    through, direct = _refusal(pd_fleet.client_url, over), _refusal(_d(pd_fleet), over)
    assert through == direct and through[0] == 400, (through, direct)


def _refusal(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """The status and error message of a completion ``url`` refuses."""
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()[:200]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"]
