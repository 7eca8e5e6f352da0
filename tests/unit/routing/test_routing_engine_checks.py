"""The router's copy of vLLM's request checks (kvpilot.routing.serve.engine_checks) against
vLLM's own: every bad field is fed to vLLM's request models, TokenizeParams,
get_max_tokens, SamplingParams and the input processor's length check, exactly as vLLM's
OpenAI server chains them, and the router must refuse it with the same message (and
accept what vLLM accepts)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.routing.refusals import BadRequest
from kvpilot.routing.serve.engine_checks import EngineLimits, check_fields, check_sampling, check_text
from kvpilot.routing.serve.upstream import Api

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.input_processor import InputProcessor

LIMITS = EngineLimits(max_model_len=128, max_logprobs=20, vocab_size=2048, max_chars_per_token=16)
C, CH = (Api.COMPLETIONS,), (Api.CHAT,)
BOTH = (Api.COMPLETIONS, Api.CHAT)
TOOL = {"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}

# (id, apis, the body's fields beside its prompt, prompt tokens, prompt characters or None)
CASES: list[tuple[str, tuple[Api, ...], dict[str, Any], int, int | None]] = [
    ("temperature-high", BOTH, {"temperature": 3}, 10, None),
    ("temperature-negative", BOTH, {"temperature": -0.5}, 10, None),
    ("top-p-zero", BOTH, {"top_p": 0}, 10, None),
    ("top-p-high", BOTH, {"top_p": 1.5}, 10, None),
    ("top-k", BOTH, {"top_k": -2}, 10, None),
    ("min-p", BOTH, {"min_p": 1.5}, 10, None),
    ("presence-penalty", BOTH, {"presence_penalty": 3}, 10, None),
    ("frequency-penalty", BOTH, {"frequency_penalty": -2.5}, 10, None),
    ("repetition-penalty", BOTH, {"repetition_penalty": 0}, 10, None),
    ("n-too-many", BOTH, {"n": 20000}, 10, None),
    ("n-greedy", BOTH, {"n": 2, "temperature": 0}, 10, None),
    ("min-tokens-negative", BOTH, {"min_tokens": -1}, 10, None),
    ("min-over-max", BOTH, {"min_tokens": 20, "max_tokens": 10}, 10, None),
    ("min-over-context-left", CH, {"min_tokens": 12}, 120, None),
    ("min-over-completions-default", C, {"min_tokens": 17}, 10, None),
    ("stop-empty", BOTH, {"stop": ["ok", ""]}, 10, None),
    ("bad-words-empty", BOTH, {"bad_words": [""]}, 10, None),
    ("logprobs-over-max", C, {"logprobs": 25}, 10, None),
    ("logprobs-negative", C, {"logprobs": -2}, 10, None),
    ("top-logprobs-over-max", CH, {"logprobs": True, "top_logprobs": 25}, 10, None),
    ("top-logprobs-without-logprobs", CH, {"top_logprobs": 3}, 10, None),
    ("top-logprobs-negative", CH, {"logprobs": True, "top_logprobs": -3}, 10, None),
    ("prompt-logprobs-over-max", BOTH, {"prompt_logprobs": 25}, 10, None),
    ("prompt-logprobs-streamed", BOTH, {"prompt_logprobs": 1, "stream": True}, 10, None),
    ("prompt-logprobs-negative", BOTH, {"prompt_logprobs": -3}, 10, None),
    ("echo-logprobs-over-max", C, {"echo": True, "logprobs": 21}, 10, None),
    ("stream-options-without-stream", BOTH, {"stream_options": {"include_usage": True}}, 10, None),
    ("cache-salt-slash", BOTH, {"cache_salt": "a/b"}, 10, None),
    ("cache-salt-long", BOTH, {"cache_salt": "s" * 129}, 10, None),
    ("json-schema-missing", BOTH, {"response_format": {"type": "json_schema"}}, 10, None),
    ("two-constraints", BOTH, {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, 10, None),
    (
        "constraint-and-named-tool",
        CH,
        {
            "structured_outputs": {"regex": "a+"},
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "grep"}},
        },
        10,
        None,
    ),
    ("tools-empty", CH, {"tools": []}, 10, None),
    ("tool-choice-without-tools", CH, {"tool_choice": "required"}, 10, None),
    ("tool-choice-unknown-mode", CH, {"tools": [TOOL], "tool_choice": "sometimes"}, 10, None),
    ("tool-choice-no-function", CH, {"tools": [TOOL], "tool_choice": {"type": "function"}}, 10, None),
    ("tool-choice-no-name", CH, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, 10, None),
    (
        "tool-choice-unknown-tool",
        CH,
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "ls"}}},
        10,
        None,
    ),
    ("both-generation-switches", CH, {"add_generation_prompt": True, "continue_final_message": True}, 10, None),
    ("logit-bias-out-of-vocab", BOTH, {"logit_bias": {"5000": 1.0}}, 10, None),
    ("logit-bias-not-an-id", BOTH, {"logit_bias": {"x": 1.0}}, 10, None),
    ("stop-token-ids-out-of-vocab", BOTH, {"stop_token_ids": [1, 4096]}, 10, None),
    ("allowed-token-ids-empty", BOTH, {"allowed_token_ids": []}, 10, None),
    ("allowed-token-ids-out-of-vocab", BOTH, {"allowed_token_ids": [1, 9999]}, 10, None),
    ("max-tokens-over-context", BOTH, {"max_tokens": 200}, 10, None),
    ("max-completion-tokens-over-context", CH, {"max_completion_tokens": 200}, 10, None),
    ("truncation-over-context", BOTH, {"truncate_prompt_tokens": 200}, 10, None),
    ("prompt-over-context", BOTH, {}, 129, None),
    ("prompt-fills-context", BOTH, {}, 128, None),
    ("prompt-characters-over-bound", BOTH, {}, 10, 128 * 16 + 1),
]
GOOD = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.1,
    "presence_penalty": 1,
    "repetition_penalty": 1.1,
    "n": 2,
    "min_tokens": 2,
    "max_tokens": 8,
    "stop": ["\n"],
    "stop_token_ids": [2],
    "logit_bias": {"7": 5},
    "allowed_token_ids": [1, 2, 3],
    "prompt_logprobs": 20,
    "cache_salt": "tenant-1",
    "stream": True,
    "stream_options": {"include_usage": True},
}
"""Every field set within vLLM's bounds (prompt_logprobs with stream aside, set per API below)."""


def _request(api: Api, fields: dict[str, Any]) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if api is Api.CHAT else {"prompt": "hi"}
    return {"model": "tiny", **prompt, **fields}


def vllm_refusal(api: Api, fields: dict[str, Any], prompt_tokens: int, chars: int | None) -> str | None:
    """vLLM's message for a request to ``api`` with ``fields`` and a prompt of
    ``prompt_tokens`` tokens (and ``chars`` characters before tokenizing), or None if vLLM
    takes it: its OpenAI server's chain, request model to input processor."""
    model_config = SimpleNamespace(
        max_model_len=LIMITS.max_model_len,
        max_logprobs=LIMITS.max_logprobs,
        get_vocab_size=lambda: LIMITS.vocab_size,
        is_diffusion=False,
        runner_type="generate",
    )
    model = ChatCompletionRequest if api is Api.CHAT else CompletionRequest
    try:
        request = model.model_validate(_request(api, fields))
        tok_params = request.build_tok_params(model_config)
        if chars is not None:
            tokenizer = SimpleNamespace(max_chars_per_token=LIMITS.max_chars_per_token)
            tok_params.apply_pre_tokenization(tokenizer, {"prompt": "x" * chars})
        ids = tok_params.apply_post_tokenization(None, {"prompt_token_ids": list(range(prompt_tokens))})
        asked = getattr(request, "max_completion_tokens", None)
        max_tokens = get_max_tokens(
            LIMITS.max_model_len,
            request.max_tokens if asked is None else asked,
            len(ids["prompt_token_ids"]),
            {},
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        request.to_sampling_params(max_tokens, {}).verify(model_config, None, None, None)
        processor = SimpleNamespace(skip_prompt_length_check=False, model_config=model_config, supports_mm_inputs=False)
        InputProcessor._validate_prompt_len(processor, len(ids["prompt_token_ids"]), "decoder")
    except (VLLMValidationError, ValueError) as exc:
        return str(exc)
    return None


def router_refusal(api: Api, fields: dict[str, Any], prompt_tokens: int, chars: int | None) -> str | None:
    """The router's message for the same request, or None if it takes it."""
    body = _request(api, fields)
    try:
        check_fields(body, api, LIMITS)
        if chars is not None:
            check_text(chars, body, LIMITS)
        check_sampling(body, api, prompt_tokens, LIMITS)
    except BadRequest as exc:
        return f"{exc}" if exc.status == 400 else f"{exc.status}: {exc}"
    return None


PARAMS = [pytest.param(api, *rest, id=f"{name}-{api.name.lower()}") for name, apis, *rest in CASES for api in apis]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's chat max_tokens
@pytest.mark.parametrize(("api", "fields", "prompt_tokens", "chars"), PARAMS)
def test_the_router_refuses_what_vllm_refuses_with_vllms_message(api, fields, prompt_tokens, chars):
    expected = vllm_refusal(api, fields, prompt_tokens, chars)
    assert expected is not None, "vLLM takes this request: the case tests nothing"
    assert router_refusal(api, fields, prompt_tokens, chars) == expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("api", list(Api))
@pytest.mark.parametrize("prompt_tokens", [1, 100, 126])
def test_the_router_takes_what_vllm_takes(api, prompt_tokens):
    fields = {**GOOD, "stream": False, "stream_options": None}
    if api is Api.CHAT:
        fields |= {"logprobs": True, "top_logprobs": 20, "tools": [TOOL], "tool_choice": "auto"}
    else:
        fields |= {"logprobs": 20, "echo": True}
    for case in (fields, {**GOOD, "prompt_logprobs": 0}, {}):
        assert vllm_refusal(api, case, prompt_tokens, 127 * 16) is None
        assert router_refusal(api, case, prompt_tokens, 127 * 16) is None


def test_without_known_limits_only_the_requests_own_contradictions_are_refused():
    """max_model_len, the vocabulary and the tokenizer unknown (0): lengths and token ids
    are left to the engines; what contradicts itself is still refused."""
    unknown = EngineLimits()
    body = {"prompt": "hi", "max_tokens": 10**6, "logit_bias": {"99999999": 1}, "truncate_prompt_tokens": 10**6}
    check_fields(body, Api.COMPLETIONS, unknown)
    check_text(10**9, body, unknown)
    check_sampling(body, Api.COMPLETIONS, 10**6, unknown)
    with pytest.raises(BadRequest, match="min_tokens must be less than or equal to max_tokens=10, got 11"):
        check_sampling({"max_tokens": 10, "min_tokens": 11}, Api.COMPLETIONS, 10**6, unknown)


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"temperature": "hot"}, "'temperature' must be a number"),
        ({"top_k": 1.5}, "'top_k' must be an integer"),
        ({"seed": 2**64}, "'seed' must be a signed 64-bit integer"),
        ({"stop_token_ids": ["a"]}, "'stop_token_ids' must be a list of integers"),
        ({"bad_words": "x"}, "'bad_words' must be a list of strings"),
        ({"logit_bias": {"1": "up"}}, "'logit_bias' must map token ids to numbers"),
        ({"response_format": "json"}, "'response_format' must be an object"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_naming_it(fields, names):
    with pytest.raises(BadRequest, match=names):
        check_fields(_request(Api.COMPLETIONS, fields), Api.COMPLETIONS, LIMITS)
