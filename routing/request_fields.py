"""Which fields of a client's request the router accepts and forwards. Pure.

The router owns the data plane: ``kv_transfer_params`` names NIXL peers and block
ids, ``request_id`` and ``priority`` steer an engine's scheduler, and so on. A
client may send only the fields of an OpenAI completions (or chat) request and
vLLM's sampling extras listed here; anything else is refused with a 400 naming
the field, so that nothing a client sends reaches an engine unless it is on this
list. docs/router.md lists the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

SESSION_FIELDS = frozenset({"conversation_id", "prompt_cache_key"})
"""Read by the router for session affinity; never forwarded."""

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
    accepted = COMPLETION_FIELDS | SESSION_FIELDS | (CHAT_FIELDS if chat else frozenset())
    for name in body:
        if name in accepted:
            continue
        if name in ENGINE_INTERNAL:
            return f"'{name}' is set by the router, not by clients"
        return f"'{name}' is not a field the router accepts (docs/router.md lists them)"
    return None
