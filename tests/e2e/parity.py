"""The request shapes of the parity tests, and how to hold one answer against another.

:data:`CASES` is the table: each request shape a client of vLLM sends (a text prompt, token
ids, chat turns, text parts, tools with a ``tool_calls`` history and tool results,
``chat_template_kwargs``, ``continue_final_message``, ``response_format``, ``n``, a stream with
usage, logprobs, a named ``tool_choice``). :func:`engine_token_ids` asks an engine's own
``POST /tokenize`` for a case's prompt; :func:`answer` sends a case and reduces the answer,
whole or streamed, to what must match (tokens, logprobs, content, reasoning, tool calls,
usage).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.deploy.demo import RUN_TESTS_TOOL
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import whitespace_logit_bias
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.upstream import Api

LOGPROB_TOLERANCE = 1e-2
"""Logprobs through the fleet may differ from the engine's own by this much: bf16 noise (a
prompt whose prefix D holds from an earlier request is prefilled in other pieces than a fresh
one, as on any vLLM engine with prefix caching; measured up to 3.2e-3 here). The tokens must
be equal: a prompt without its BOS, or wrong KV, changes them (tests/e2e/test_verified_attach.py
holds wrong KV's logprobs against a co-located run bit for bit)."""

TOOLS = [
    RUN_TESTS_TOOL,  # strict, its argument an enum: a forced call of it closes (the demo's tool)
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}},
]
HISTORY = [
    {"role": "system", "content": "You are a coding agent. " + filler_text(120, 3)},
    {"role": "user", "content": "The scheduler test fails: " + filler_text(40, 4)},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "FAILED test_scheduler: " + filler_text(60, 5)},
]
NAMED = {"type": "function", "function": {"name": "run_tests"}}
NO_THINKING = {"enable_thinking": False}
"""With a reasoning parser, vLLM applies structured outputs (a named tool call, a response
format) once the reasoning ended: the template's empty thought ends it in the prompt."""


def forcing(case: Case, model_dir: Path) -> dict[str, Any]:
    """What a case that forces a structure is sent beside its body (the random-weight model
    kept off whitespace: :func:`~kvpilot.deploy.tiny_model.whitespace_logit_bias`)."""
    forced = "tool_choice" in case.body or "response_format" in case.body
    return whitespace_logit_bias(model_dir) if forced else {}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    api: Api
    body: dict[str, Any]


def _chat(name: str, **body: Any) -> Case:
    forced = "tool_choice" in body or "response_format" in body  # long enough for the forced structure
    return Case(name, Api.CHAT, {"max_tokens": 80 if forced else 6, **body})


CASES = (
    Case("text prompt", Api.COMPLETIONS, {"prompt": "Fix the test. " + filler_text(200, 1), "max_tokens": 6}),
    Case("token-id prompt", Api.COMPLETIONS, {"prompt": list(range(40, 240)), "max_tokens": 6}),
    Case("text prompt, logprobs 2", Api.COMPLETIONS, {"prompt": filler_text(150, 2), "max_tokens": 6, "logprobs": 2}),
    _chat(
        "chat turns", messages=[*HISTORY[:2], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    ),
    _chat(
        "text parts",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two."}]}
        ],
    ),
    _chat("tools and a tool_calls history", messages=HISTORY, tools=TOOLS),
    _chat("named tool_choice", messages=HISTORY, tools=TOOLS, tool_choice=NAMED, chat_template_kwargs=NO_THINKING),
    _chat("chat_template_kwargs", messages=HISTORY[:2], chat_template_kwargs={"enable_thinking": False}),
    _chat(
        "continue_final_message",
        messages=[*HISTORY[:2], {"role": "assistant", "content": "Let me look at"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    _chat(
        "response_format",
        messages=HISTORY[:2],
        response_format={"type": "json_object"},
        chat_template_kwargs=NO_THINKING,
    ),
    _chat("n = 2, sampled with a seed", messages=HISTORY[:2], n=2, temperature=1.0, seed=7),
    _chat("stream with usage", messages=HISTORY, tools=TOOLS, stream=True, stream_options={"include_usage": True}),
    Case(
        "completions stream with usage",
        Api.COMPLETIONS,
        {"prompt": filler_text(180, 6), "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}},
    ),
)

TOKENIZE_FIELDS = ("prompt", "messages", "tools", "chat_template_kwargs", "add_generation_prompt")
TOKENIZE_FIELDS += ("continue_final_message", "add_special_tokens")
"""The fields of a request that vLLM's ``POST /tokenize`` takes, and that make its prompt."""


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[dict[str, str], bytes]:
    """The answer's headers (lower-case names) and body to a JSON POST; raises on 4xx/5xx."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def engine_token_ids(engine_url: str, case: Case) -> list[int]:
    """The prompt's token ids as the engine's own ``POST /tokenize`` computes them."""
    body = {k: v for k, v in case.body.items() if k in TOKENIZE_FIELDS}
    _, raw = post(f"{engine_url}/tokenize", {"model": "tiny", **body})
    return list(json.loads(raw)["tokens"])


def greedy(case: Case, **extra: Any) -> dict[str, Any]:
    """The case's body, greedy with top-1 logprobs (top-2 where it asks), and ``extra``."""
    body = {"model": "tiny", "temperature": 0.0, **case.body, **extra}
    if case.api is Api.CHAT:
        body.setdefault("logprobs", True)
        body.setdefault("top_logprobs", 1)
    else:
        body.setdefault("logprobs", 1)
    return body


def answer(url: str, case: Case, **extra: Any) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, Any] | None]:
    """``case`` sent to ``url``: the answer's headers, each choice reduced to what must match
    (text or content, reasoning, tool calls by name and arguments, tokens and logprobs) and
    the usage; a stream's chunks are joined first."""
    headers, raw = post(f"{url}{case.api.value}", greedy(case, **extra))
    if not case.body.get("stream"):
        payload = json.loads(raw)
        return headers, [_choice(c) for c in sorted(payload["choices"], key=lambda c: c["index"])], payload["usage"]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for line in raw.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or ():
            into = choices.setdefault(c["index"], {"text": "", "reasoning": "", "calls": {}, "tokens": [], "lp": []})
            delta = c.get("delta") or {}
            into["text"] += c.get("text") or delta.get("content") or ""
            into["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                name, args = into["calls"].get(call["index"], ("", ""))
                function = call.get("function") or {}
                into["calls"][call["index"]] = (
                    name + (function.get("name") or ""),
                    args + (function.get("arguments") or ""),
                )
            _logprobs(c.get("logprobs"), into["tokens"], into["lp"])
    reduced = [
        {
            "text": c["text"],
            "reasoning": c["reasoning"] or None,
            "tool_calls": [c["calls"][k] for k in sorted(c["calls"])],
        }
        | {"tokens": c["tokens"], "logprobs": c["lp"]}
        for _, c in sorted(choices.items())
    ]
    return headers, reduced, usage


def _choice(choice: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = []
    logprobs: list[float] = []
    _logprobs(choice.get("logprobs"), tokens, logprobs)
    message = choice.get("message")
    if message is None:
        return {"text": choice["text"], "reasoning": None, "tool_calls": [], "tokens": tokens, "logprobs": logprobs}
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    text = message.get("content") or ""
    return {"text": text, "reasoning": reasoning, "tool_calls": calls, "tokens": tokens, "logprobs": logprobs}


def _logprobs(lp: dict[str, Any] | None, tokens: list[str], logprobs: list[float]) -> None:
    if not lp:
        return
    if "content" in lp:  # chat
        for entry in lp["content"] or ():
            tokens.append(entry["token"])
            logprobs.append(entry["logprob"])
    else:  # completions
        tokens += lp["tokens"]
        logprobs += lp["token_logprobs"]


def differences(through: list[dict[str, Any]], direct: list[dict[str, Any]]) -> list[str]:
    """How the choices through the fleet differ from the engine's own: every field equal,
    logprobs within :data:`LOGPROB_TOLERANCE`; empty when they match."""
    if len(through) != len(direct):
        return [f"{len(through)} choices against {len(direct)}"]
    out = []
    for i, (a, b) in enumerate(zip(through, direct, strict=True)):
        keys = ("text", "reasoning", "tool_calls", "tokens")
        out += [f"choice {i} {k}: {a[k]!r} against {b[k]!r}" for k in keys if a[k] != b[k]]
        diff = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=False)), default=0.0)
        if len(a["logprobs"]) != len(b["logprobs"]) or diff > LOGPROB_TOLERANCE:
            out.append(f"choice {i} logprobs differ by {diff:.2e}")
    return out


def router_ids_are_the_engine_s(engine_url: str, prompts: EnginePrompt, case: Case) -> list[int]:
    """The router's token ids for ``case``, held equal to the engine's own ``/tokenize`` (a
    token-id prompt's to the prompt itself); returns them."""
    ids = prompts.token_ids(case.api, case.body)
    if isinstance(case.body.get("prompt"), list):
        assert ids == case.body["prompt"]  # token ids go as they came
    else:
        assert ids == engine_token_ids(engine_url, case)
    return ids


def answers_are_the_engine_s(
    front_url: str, engine_url: str, model_dir: Path, prompts: EnginePrompt, case: Case
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """``case`` through ``front_url`` and sent to the engine directly (a fresh ``cache_salt``):
    the same choices (:func:`differences`) and prompt tokens, the router's count among them.
    Returns the front's headers and choices."""
    extra = forcing(case, model_dir)
    headers, through, usage = answer(front_url, case, **extra)
    _, direct, direct_usage = answer(engine_url, case, cache_salt=f"parity-{uuid.uuid4().hex}", **extra)
    assert not differences(through, direct), (case.name, differences(through, direct))
    assert usage is not None and direct_usage is not None
    assert usage["prompt_tokens"] == direct_usage["prompt_tokens"] == len(prompts.token_ids(case.api, case.body))
    return headers, through


def agent_loop(fleet_url: str, engine_url: str, model_dir: Path, steps: int = 3) -> None:
    """An agent's ``steps`` steps with the OpenAI SDK through ``fleet_url``: tools declared, the
    call forced by name (thinking off, so vLLM's structured outputs apply from the first
    token; whitespace biased away, so the random-weight model closes the call), each tool's
    result fed back with its call in the history (content null); one session. Each step's tool
    call, logprobs and prompt tokens equal the engine's own answer to the same messages."""
    from openai import OpenAI

    fleet_client = OpenAI(base_url=f"{fleet_url}/v1", api_key="unused", max_retries=0)
    engine_client = OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [dict(m) for m in HISTORY]
    session = f"agent-{uuid.uuid4().hex}"
    forcing_extra = {"chat_template_kwargs": NO_THINKING, **whitespace_logit_bias(model_dir)}
    for step in range(steps):
        kwargs: dict[str, Any] = {
            "model": "tiny",
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": NAMED,
            "max_completion_tokens": 80,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 1,
        }
        got = fleet_client.chat.completions.create(**kwargs, extra_body={**forcing_extra, "conversation_id": session})
        want = engine_client.chat.completions.create(
            **kwargs, extra_body={**forcing_extra, "cache_salt": f"agent-ref-{uuid.uuid4().hex}"}
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
        function = call.function.model_dump()
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": function}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"step {step}: 3 passed, 1 failed"})
