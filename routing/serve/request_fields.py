"""Which fields of a client's request the router accepts and forwards, and the
checks a request body passes before it is routed. Pure.

The router owns the data plane: ``kv_transfer_params`` names NIXL peers and block
ids, ``request_id`` and ``priority`` steer an engine's scheduler, and so on. A
client may send only the fields of an OpenAI completions (or chat) request and
vLLM's sampling extras listed here; anything else is refused with a 400 naming
the field, so that nothing a client sends reaches an engine unless it is on this
list. docs/guides/router.md lists the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvpilot.routing.decide.sessions import SESSION_FIELDS
from kvpilot.routing.serve.refusals import BadRequest, RejectReason

COMPLETION_FIELDS = frozenset(
    {
        # OpenAI
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "logprobs",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "user",
        # vLLM sampling and output extras
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "prompt_logprobs",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "structured_outputs",
        "response_format",
        "truncate_prompt_tokens",
        "cache_salt",
    }
)
"""Forwarded to the engines as sent."""

CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"})
"""Read by the router to render a chat request as a completions one."""

ENGINE_INTERNAL = frozenset(
    {
        "kv_transfer_params",
        "ec_transfer_params",
        "request_id",
        "priority",
        "vllm_xargs",
        "mm_payload",
        "prompt_embeds",
        "routed_experts_prompt_start",
        "session_id",
        "return_mm_kwargs",
    }
)
"""vLLM request fields that steer an engine's data plane or scheduler: set by the
router (``kv_transfer_params``) or by no one."""


def refused_field(body: Mapping[str, Any], chat: bool) -> str | None:
    """Why the first field ``body`` may not carry is refused, or ``None`` if every
    field is accepted (chat requests also take :data:`CHAT_FIELDS`)."""
    accepted = COMPLETION_FIELDS | frozenset(SESSION_FIELDS) | (CHAT_FIELDS if chat else frozenset())
    for name in body:
        if name in accepted:
            continue
        if name in ENGINE_INTERNAL:
            return f"'{name}' is set by the router, not by clients"
        return f"'{name}' is not a field the router accepts (docs/guides/router.md lists them)"
    return None


def checked_body(raw: bytes, chat: bool | None, *, model_name: str, max_output_tokens: int) -> dict[str, Any]:
    """The parsed body of a completions (``chat=False``) or chat (``True``) request;
    ``None``: either, as its fields say. Raises :class:`BadRequest` naming the problem:
    not a JSON object, another model, a refused field, a value of the wrong type, or
    ``max_tokens`` over ``max_output_tokens`` (0: no limit)."""
    try:  # msgspec: 2.4x json's speed on a 14K-token prompt of ids (0.30 against 0.72 ms here)
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"'model' {model!r} is not served here (serving {model_name!r})", 404)
    refused = refused_field(body, "messages" in body if chat is None else chat)
    if refused is not None:
        raise BadRequest(refused)
    _optional(body, "stream", bool, "true or false")
    _optional(body, "cache_salt", str, "a string")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _optional(body, name, int, "a positive integer")
        if value is not None and value <= 0:
            raise BadRequest(f"'{name}' must be a positive integer")
        if value is not None and max_output_tokens and value > max_output_tokens:
            raise BadRequest(
                f"'{name}' {value} is over server.max_output_tokens ({max_output_tokens})",
                reason=RejectReason.MAX_TOKENS,
            )
    return body


def _optional(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise BadRequest(f"'{name}' must be {what}")
    return value
