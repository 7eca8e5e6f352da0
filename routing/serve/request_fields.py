"""Which fields of a client's request the router accepts and forwards, and the
checks a request body passes before it is routed. Pure.

The router owns the data plane: ``kv_transfer_params`` names NIXL peers and block
ids, ``request_id`` and ``priority`` steer an engine's scheduler, and so on. A
client may send only the fields listed here for the API it calls (:data:`FIELD_GROUPS`);
anything else is refused with a 400 naming the field, so that nothing a client sends
reaches an engine unless it is on this list. What is accepted reaches the engines as it
was sent (less the session keys, which the router reads). docs/reference/request-fields.md
is generated from :data:`FIELD_GROUPS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvpilot.routing.decide.sessions import SESSION_FIELDS
from kvpilot.routing.refusals import BadRequest, RejectReason
from kvpilot.routing.serve.upstream import Api


@dataclass(frozen=True, slots=True)
class FieldGroup:
    """Request fields accepted together: their names, the APIs that take them, and what
    they are (for the generated reference)."""

    title: str
    apis: frozenset[Api]
    names: tuple[str, ...]


BOTH_APIS = frozenset(Api)
FIELD_GROUPS = (
    FieldGroup(
        "OpenAI sampling and output",
        BOTH_APIS,
        (
            *("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs", "stop"),
            *("presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "response_format"),
        ),
    ),
    FieldGroup("OpenAI completions", frozenset({Api.COMPLETIONS}), ("prompt",)),
    FieldGroup(
        "OpenAI chat completions",
        frozenset({Api.CHAT}),
        (
            *("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"),
            "reasoning_effort",
        ),
    ),
    FieldGroup(
        "vLLM's sampling and output extras",
        BOTH_APIS,
        (
            *("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids"),
            *("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"),
            *("allowed_token_ids", "bad_words", "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids"),
            *("structured_outputs", "truncate_prompt_tokens", "truncation_side", "echo", "add_special_tokens"),
            "cache_salt",
        ),
    ),
    FieldGroup(
        "vLLM's chat rendering (the router renders the same way)",
        frozenset({Api.CHAT}),
        ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents", "include_reasoning"),
    ),
    FieldGroup("session keys (read by the router, not forwarded)", BOTH_APIS, SESSION_FIELDS),
    FieldGroup(
        "Dynamo's agent hints: `nvext` with `agent_hints` alone (forwarded to Dynamo's frontend beside Dynamo, "
        "not to vLLM engines)",
        BOTH_APIS,
        ("nvext",),
    ),
)
"""Every field a client may send, by group; a field in no group is refused."""
ACCEPTED = {api: frozenset(name for g in FIELD_GROUPS if api in g.apis for name in g.names) for api in Api}
"""The fields each API accepts."""

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
        "chat_template",
        "mm_processor_kwargs",
        "media_io_kwargs",
    }
)
"""vLLM request fields that steer an engine's data plane or scheduler: set by the
router (``kv_transfer_params``) or by no one."""

NVEXT = "nvext"
"""Dynamo's request extensions: a client may send its ``agent_hints`` and nothing else."""
AGENT_HINTS = "agent_hints"
HINT_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "latency_sensitivity": ((int, float), "a number of seconds, 0 or more"),
    "osl": ((int,), "a positive integer (expected output tokens)"),
    "priority": ((int,), "an integer"),
    "speculative_prefill": ((bool,), "true or false"),
}
"""Dynamo's ``nvext.agent_hints`` fields (its router's agent-hints page), and what each must be."""


def agent_hints(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``nvext.agent_hints`` of a :func:`checked_body` (``None``: none sent)."""
    nvext = body.get(NVEXT)
    return None if nvext is None else nvext.get(AGENT_HINTS)


def _check_nvext(nvext: Any) -> None:
    """``nvext`` holds ``agent_hints`` alone, each hint of its type; raises :class:`BadRequest`
    naming the first that is not (``token_data``, ``backend_instance_id`` and the rest of
    Dynamo's extensions steer routing or the engines: the router sets them or no one does)."""
    if not isinstance(nvext, dict):
        raise BadRequest(f"'{NVEXT}' must be an object holding '{AGENT_HINTS}'")
    for name in nvext:
        if name != AGENT_HINTS:
            raise BadRequest(
                f"'{NVEXT}.{name}' is set by the router or no one; a client may send '{NVEXT}.{AGENT_HINTS}'"
            )
    hints = nvext.get(AGENT_HINTS)
    if not isinstance(hints, dict):
        raise BadRequest(f"'{NVEXT}.{AGENT_HINTS}' must be an object")
    for name, value in hints.items():
        if name not in HINT_TYPES:
            raise BadRequest(f"'{NVEXT}.{AGENT_HINTS}.{name}' is not an agent hint ({', '.join(HINT_TYPES)} are)")
        kinds, what = HINT_TYPES[name]
        bad_type = not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))
        if bad_type or (name == "osl" and value <= 0) or (name == "latency_sensitivity" and not 0 <= value < 1e9):
            raise BadRequest(f"'{NVEXT}.{AGENT_HINTS}.{name}' must be {what}")


def refused_field(body: Mapping[str, Any], api: Api) -> str | None:
    """Why the first field ``body`` may not carry for ``api`` is refused, or ``None`` if
    every field is accepted."""
    accepted = ACCEPTED[api]
    for name in body:
        if name in accepted:
            continue
        if name in ENGINE_INTERNAL:
            return f"'{name}' is set by the router or the engine's own flags, not by clients"
        other = [a for a in Api if name in ACCEPTED[a]]
        if other:
            return f"'{name}' is a field of {other[0].value}, not of {api.value}"
        return f"'{name}' is not a field the router accepts (docs/reference/request-fields.md lists them)"
    return None


def checked_body(raw: bytes, api: Api | None, *, model_name: str, max_output_tokens: int) -> dict[str, Any]:
    """The parsed body of a request to ``api`` (``None``: either, as its fields say: with
    ``messages`` a chat). Raises :class:`BadRequest` naming the problem: not a JSON
    object, another model, a refused field, a value of the wrong type, or ``max_tokens`` over
    ``max_output_tokens`` (0: no limit)."""
    try:  # msgspec, not json: a long prompt of ids is most of the body
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"'model' {model!r} is not served here (serving {model_name!r})", 404)
    if api is None:
        api = Api.CHAT if "messages" in body else Api.COMPLETIONS
    refused = refused_field(body, api)
    if refused is not None:
        raise BadRequest(refused)
    for name in ("stream", "add_special_tokens", "add_generation_prompt", "continue_final_message", "echo"):
        _optional(body, name, bool, "true or false")
    _optional(body, "cache_salt", str, "a string")
    if NVEXT in body:
        _check_nvext(body[NVEXT])
    n = _optional(body, "n", int, "a positive integer")
    if n is not None and n <= 0:
        raise BadRequest("'n' must be a positive integer")
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
