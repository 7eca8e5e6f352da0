"""vLLM's own checks of a request's lengths and sampling fields, made by the router before
any engine sees the request, with the messages vLLM gives. Pure.

A request vLLM would refuse must not reach P: P would prefill (or refuse it as its own
failure) and D would then refuse it anyway. So the router runs, in vLLM 0.32's order, the
checks of the fields it accepts (:mod:`kvpilot.routing.serve.request_fields`):

1. the OpenAI layer's request validators (``stream_options`` without ``stream``,
   ``logprobs``/``top_logprobs``/``prompt_logprobs``, ``tool_choice`` against ``tools``,
   more than one structured-output constraint, ``cache_salt``, a ``json_schema`` format
   without its schema) and its tokenize parameters (``max_tokens`` or
   ``truncate_prompt_tokens`` over ``max_model_len``): :func:`check_fields`;
2. the prompt's length in characters before it is tokenized (vLLM's bound: ``max_model_len``
   times the longest token's characters): :func:`check_text`;
3. the prompt's length in tokens, then ``SamplingParams``' own checks (its ``_verify_args``
   on the output length vLLM derives from the prompt, and ``verify``'s against the model:
   ``max_logprobs``, token ids in the vocabulary): :func:`check_sampling`.

The router does not import vLLM (it runs beside Dynamo, on a small box), so these are the
rules, not vLLM's functions; tests/unit/routing/test_routing_engine_checks.py feeds every
case here to vLLM's own request models, ``TokenizeParams``, ``get_max_tokens`` and
``SamplingParams`` and holds each message equal to vLLM's (``str()`` of its
``VLLMValidationError``, the text of vLLM's 400). A field of the wrong JSON type is refused
with the router's own words (vLLM's are pydantic's). What the router cannot know is left to
the engines: defaults from the model's ``generation_config.json``, structured-output
grammars, and the engines' environment (``VLLM_MAX_N_SEQUENCES`` is taken at its default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.routing.refusals import BadRequest, RejectReason
from kvpilot.routing.serve.upstream import Api

MAX_N_SEQUENCES = 16384
"""vLLM's ``VLLM_MAX_N_SEQUENCES`` default: the largest ``n``."""
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's completions default for ``max_tokens`` (chat has none: the context left)."""
NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGERS = ("top_k", "min_tokens", "truncate_prompt_tokens", "prompt_logprobs", "seed")
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engines were started with, as far as the router knows it: ``max_model_len``
    (0: unknown, no length checked), ``max_logprobs`` (-1: the vocabulary), the model's
    ``vocab_size`` (``config.json``; 0: unknown, token ids left to the engines) and its
    tokenizer's longest token in characters (0: unknown, no character bound)."""

    max_model_len: int = 0
    max_logprobs: int = 20
    vocab_size: int = 0
    max_chars_per_token: int = 0

    @property
    def max_prompt_chars(self) -> int:
        """vLLM's bound on a prompt's characters before tokenizing; 0: none."""
        return self.max_model_len * self.max_chars_per_token


def check_fields(body: Mapping[str, Any], api: Api, limits: EngineLimits) -> None:
    """vLLM's request validators and tokenize parameters (module doc, step 1) on ``body``;
    raises :class:`BadRequest` (400) with vLLM's message. Reads ``body`` only."""
    _check_types(body, api)
    _check_cache_salt(body.get("cache_salt"))
    _check_response_format(body.get("response_format"))
    _check_structured_outputs(body, api)
    if api is Api.CHAT:
        _check_chat_logprobs(body)
        _check_tool_usage(body)
    else:
        _check_completion_logprobs(body)
    if body.get("stream_options") and not body.get("stream"):
        raise BadRequest("Stream options can only be defined when `stream=True`. (parameter=stream_options)")
    if api is Api.CHAT and body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if limits.max_model_len:
        _check_tokenize_params(body, api, limits.max_model_len)


def check_text(chars: int, body: Mapping[str, Any], limits: EngineLimits) -> None:
    """vLLM's bound on a text prompt of ``chars`` characters, checked before tokenizing
    (none when the request truncates its prompt); raises :class:`BadRequest`."""
    bound = limits.max_prompt_chars
    if bound and body.get("truncate_prompt_tokens") is None and chars > bound:
        raise BadRequest(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt "
            f"contains {chars} characters (more than {bound} characters, which is the upper bound "
            f"for {limits.max_model_len} input tokens). Please reduce the length of the input prompt. "
            f"(parameter=input_text, value={chars})",
            reason=RejectReason.PROMPT_TOO_LONG,
        )


def check_sampling(
    body: Mapping[str, Any], api: Api, prompt_tokens: int, limits: EngineLimits, *, from_text: bool = False
) -> None:
    """The prompt's length in tokens and ``SamplingParams``' checks (module doc, step 3)
    for a prompt of ``prompt_tokens`` tokens once truncated as the request asks
    (:mod:`kvpilot.routing.serve.truncation`); raises :class:`BadRequest` with vLLM's message.
    ``from_text``: the prompt was text (or a chat), which vLLM tokenizes only up to one token
    past ``max_model_len`` and so reports as "at least" that many."""
    max_len = limits.max_model_len
    if from_text and max_len and body.get("truncate_prompt_tokens") is None:
        prompt_tokens = min(prompt_tokens, max_len + 1)
    if max_len and prompt_tokens > max_len:
        qualifier = "at least " if prompt_tokens == max_len + 1 else ""
        raise BadRequest(
            f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
            f"{qualifier}{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})",
            reason=RejectReason.PROMPT_TOO_LONG,
        )
    _verify_args(body, api, _max_tokens(body, api, prompt_tokens, max_len))
    _verify_against_model(body, api, limits)
    if max_len and prompt_tokens == max_len:
        raise BadRequest(
            f"The decoder prompt (length {prompt_tokens}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {max_len}. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested output tokens).",
            reason=RejectReason.PROMPT_TOO_LONG,
        )


def _check_types(body: Mapping[str, Any], api: Api) -> None:
    for name in NUMBERS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadRequest(f"'{name}' must be a number")
    for name in INTEGERS + (() if api is Api.CHAT else ("logprobs",)):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"'{name}' must be an integer")
    seed = body.get("seed")
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise BadRequest("'seed' must be a signed 64-bit integer")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and truncate < -1:
        raise BadRequest("'truncate_prompt_tokens' must be -1 or at least 0")
    if body.get("truncation_side") not in (None, "left", "right"):
        raise BadRequest("'truncation_side' must be left or right")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = body.get(name)
        if ids is not None and (not isinstance(ids, list) or not all(_is_int(t) for t in ids)):
            raise BadRequest(f"'{name}' must be a list of integers")
    for name in ("bad_words", "stop"):
        words = body.get(name)
        if isinstance(words, str) and name == "stop":
            continue
        if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) for w in words)):
            raise BadRequest(f"'{name}' must be a list of strings" + (" or a string" if name == "stop" else ""))
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or not all(_is_number(v) for v in bias.values())):
        raise BadRequest("'logit_bias' must map token ids to numbers")
    for name in ("response_format", "structured_outputs", "stream_options"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise BadRequest(f"'{name}' must be an object")


def _check_cache_salt(salt: object) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)")
    if len(salt) > MAX_CACHE_SALT_CHARS or CACHE_SALT_FORBIDDEN & set(salt):
        raise BadRequest(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
        )


def _check_response_format(response_format: Mapping[str, Any] | None) -> None:
    if (
        response_format is not None
        and response_format.get("type") == "json_schema"
        and response_format.get("json_schema") is None
    ):
        raise BadRequest(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided. "
            "(parameter=response_format)"
        )


def _check_structured_outputs(body: Mapping[str, Any], api: Api) -> None:
    constraints = body.get("structured_outputs")
    if constraints is None:
        return
    count = sum(constraints.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        where = "" if api is Api.CHAT else " (parameter=structured_outputs)"
        raise BadRequest(
            f"You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').{where}"
        )
    if api is Api.CHAT and count > 0 and body.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise BadRequest("You can only either use constraints for structured outputs or tools, not both.")


def _check_completion_logprobs(body: Mapping[str, Any]) -> None:
    _check_prompt_logprobs(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise BadRequest(f"`logprobs` must be a positive value or -1. (parameter=logprobs, value={logprobs})")


def _check_chat_logprobs(body: Mapping[str, Any]) -> None:
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, (int, float))):
        raise BadRequest(f"`top_logprobs` must be an integer. (parameter=top_logprobs, value={top})")
    _check_prompt_logprobs(body)
    if top is not None:
        if top < 0 and top != -1:
            raise BadRequest(f"`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value={top})")
        if (top == -1 or top > 0) and not body.get("logprobs"):
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)")


def _check_prompt_logprobs(body: Mapping[str, Any]) -> None:
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise BadRequest("`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)")
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        raise BadRequest(
            f"`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value={prompt_logprobs})"
        )


def _check_tool_usage(body: Mapping[str, Any]) -> None:
    tools = body.get("tools")
    if tools == []:
        raise BadRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. "
            "(parameter=tools)"
        )
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set. (parameter=tool_choice)")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise BadRequest(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
            "are supported. (parameter=tool_choice)"
        )
    if not isinstance(choice, dict):
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {usage} (parameter=tool_choice.function)"
        )
    if "name" not in function:
        raise BadRequest(
            f"Expected field `name` in `function` in `tool_choice`! {usage} (parameter=tool_choice.function.name)"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage} (parameter=tool_choice.function.name)"
        )
    named = (t.get("function") if isinstance(t, dict) else None for t in tools)
    if not any(isinstance(f, dict) and f.get("name") == name for f in named):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)"
        )


def _requested_max_tokens(body: Mapping[str, Any], api: Api) -> tuple[int | None, str]:
    """The output length the client asked for and the field that asked (vLLM's choice)."""
    if api is Api.CHAT:
        if body.get("max_completion_tokens") is not None:
            return body["max_completion_tokens"], "max_completion_tokens"
        return body.get("max_tokens"), "max_tokens"
    max_tokens = body.get("max_tokens")
    return (COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens), "max_tokens"


def _check_tokenize_params(body: Mapping[str, Any], api: Api, max_len: int) -> None:
    requested, field = _requested_max_tokens(body, api)
    if requested and requested > max_len:
        raise BadRequest(
            f"{field}={requested} cannot be greater than max_model_len={max_len}. "
            f"Please request fewer output tokens. (parameter={field}, value={requested})"
        )
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and truncate > max_len:
        raise BadRequest(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_len}. "
            f"Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value={truncate})"
        )


def _max_tokens(body: Mapping[str, Any], api: Api, prompt_tokens: int, max_len: int) -> int | None:
    """vLLM's ``get_max_tokens``: the request's output length, at most the context left."""
    requested = body.get("max_tokens") if api is Api.COMPLETIONS else _requested_max_tokens(body, api)[0]
    if api is Api.COMPLETIONS and requested is None:
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    candidates = [v for v in (requested, max_len - prompt_tokens if max_len else None) if v is not None]
    return min(candidates) if candidates else None


def _verify_args(body: Mapping[str, Any], api: Api, max_tokens: int | None) -> None:
    """``SamplingParams.__post_init__`` and ``_verify_args``, on the values vLLM's
    ``to_sampling_params`` hands it (OpenAI's defaults where the client sent none)."""
    n = 1 if body.get("n") is None else body["n"]
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise BadRequest(
            f"n must be at most {MAX_N_SEQUENCES}, got {n}. "
            "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
        )
    get = body.get
    presence, frequency = float(_or(get("presence_penalty"), 0.0)), float(_or(get("frequency_penalty"), 0.0))
    repetition, temperature = float(_or(get("repetition_penalty"), 1.0)), float(_or(get("temperature"), 1.0))
    top_p, top_k, min_p = float(_or(get("top_p"), 1.0)), _or(get("top_k"), 0), float(_or(get("min_p"), 0.0))
    if not -2.0 <= presence <= 2.0:
        raise BadRequest(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise BadRequest(f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not math.isfinite(repetition):
        raise BadRequest(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise BadRequest(f"repetition_penalty must be greater than zero, got {repetition}.")
    _check_temperature(temperature)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}. (parameter=top_p, value={top_p})")
    if top_k < -1:
        raise BadRequest(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.")
    min_tokens = _or(get("min_tokens"), 0)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})")
    if min_tokens < 0:
        raise BadRequest(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    stop = get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise BadRequest("stop cannot contain an empty string.")
    bad_words = list(dict.fromkeys(get("bad_words") or []))
    if any(not w for w in bad_words):
        raise BadRequest(f"bad_words cannot contain an empty string. Got bad_words={bad_words}")
    if temperature < 1e-5 and n > 1:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {n}.")


def _check_temperature(temperature: float) -> None:
    where = f"(parameter=temperature, value={temperature})"
    if not math.isfinite(temperature):
        raise BadRequest(f"temperature must be a finite number, got {temperature}. {where}")
    if temperature < 0.0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}. {where}")
    if temperature > 2.0:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}. {where}")


def _verify_against_model(body: Mapping[str, Any], api: Api, limits: EngineLimits) -> None:
    """``SamplingParams.verify``'s checks against the model: logprobs and token ids."""
    vocab = limits.vocab_size
    most = limits.max_logprobs if limits.max_logprobs != -1 else vocab
    if api is Api.CHAT:
        logprobs = _or(body.get("top_logprobs"), 0) if body.get("logprobs") else None
    else:
        logprobs = body.get("logprobs")
    for name, asked in (("sample", logprobs), ("prompt", _prompt_logprobs(body, api))):
        if asked and vocab and asked == -1:
            asked = vocab
        if asked and most and asked > most:
            param = "logprobs" if name == "sample" else "prompt_logprobs"
            raise BadRequest(
                f"Requested {name} logprobs of {asked}, which is greater than max allowed: {most} "
                f"(parameter={param}, value={asked})"
            )
    if not vocab:
        return
    bias = body.get("logit_bias") or {}
    try:
        bias_ids = [int(k) for k in bias]
    except ValueError:
        bad = [k for k in bias if not _is_int_text(k)]
        raise BadRequest(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r} "
            f"(parameter=logit_bias, value={bad})"
        ) from None
    _in_vocab("logit_bias", bias_ids, vocab)
    _in_vocab("stop_token_ids", list(dict.fromkeys(body.get("stop_token_ids") or [])), vocab)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not allowed:
            raise BadRequest("allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])")
        invalid = [t for t in allowed if t < 0 or t >= vocab]
        if invalid:
            raise BadRequest(
                f"allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, value={invalid})"
            )


def _prompt_logprobs(body: Mapping[str, Any], api: Api) -> int | None:
    """vLLM's prompt logprobs: the request's, else its (top) logprobs when it echoes."""
    asked = body.get("prompt_logprobs")
    if asked is None and body.get("echo"):
        return _or(body.get("top_logprobs"), 0) if api is Api.CHAT else body.get("logprobs")
    return asked


def _in_vocab(field: str, ids: list[int], vocab: int) -> None:
    invalid = [t for t in ids if t < 0 or t >= vocab]
    if invalid:
        raise BadRequest(
            f"token_id(s) {invalid} in {field} contain out-of-vocab token ids. Vocabulary size: {vocab} "
            f"(parameter={field}, value={invalid})"
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_text(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True
