"""checked_body: a client's request body refused before routing, with the status and reason."""

from __future__ import annotations

import json
import re

import pytest

from kvpilot.routing.serve.request_fields import ACCEPTED, FIELD_GROUPS, BadRequest, checked_body
from kvpilot.routing.serve.upstream import Api


def _check(body: object, api: Api | None = Api.COMPLETIONS) -> dict:
    return checked_body(json.dumps(body).encode(), api, model_name="tiny", max_output_tokens=64)


@pytest.mark.parametrize(
    ("body", "status", "reason", "message"),
    [
        ([1], 400, None, "must be a JSON object"),
        ({"model": "other"}, 404, None, "'model' 'other' is not served here"),
        ({"kv_transfer_params": {}}, 400, None, "'kv_transfer_params' is set by the router"),
        ({"stream": "yes"}, 400, None, "'stream' must be true or false"),
        ({"max_tokens": True}, 400, None, "'max_tokens' must be a positive integer"),
        ({"max_tokens": 0}, 400, None, "'max_tokens' must be a positive integer"),
        ({"max_tokens": 65}, 400, "max_tokens", "'max_tokens' 65 is over server.max_output_tokens (64)"),
        ({"n": 0}, 400, None, "'n' must be a positive integer"),
        ({"add_special_tokens": "no"}, 400, None, "'add_special_tokens' must be true or false"),
        ({"chat_template": "{{ x }}"}, 400, None, "'chat_template' is set by the router or the engine's own flags"),
        ({"nvext": {"token_data": [1, 2]}}, 400, None, "'nvext.token_data' is set by the router or no one"),
        ({"nvext": {"backend_instance_id": 7}}, 400, None, "'nvext.backend_instance_id' is set by the router"),
        ({"nvext": []}, 400, None, "'nvext' must be an object holding 'agent_hints'"),
        ({"nvext": {"agent_hints": 1}}, 400, None, "'nvext.agent_hints' must be an object"),
        ({"nvext": {"agent_hints": {"x": 1}}}, 400, None, "'nvext.agent_hints.x' is not an agent hint"),
        ({"nvext": {"agent_hints": {"osl": 0}}}, 400, None, "'nvext.agent_hints.osl' must be a positive integer"),
        ({"nvext": {"agent_hints": {"osl": 1.5}}}, 400, None, "'nvext.agent_hints.osl' must be a positive integer"),
        ({"nvext": {"agent_hints": {"priority": True}}}, 400, None, "'nvext.agent_hints.priority' must be an integer"),
        ({"nvext": {"agent_hints": {"latency_sensitivity": -1}}}, 400, None, "must be a number of seconds, 0 or more"),
        ({"nvext": {"agent_hints": {"speculative_prefill": 1}}}, 400, None, "must be true or false"),
    ],
)
def test_a_refused_body_says_why(body: object, status: int, reason: str | None, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)) as err:
        _check(body)
    assert (err.value.status, err.value.reason) == (status, reason)


def test_json_that_does_not_parse_is_refused() -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        checked_body(b"{", Api.COMPLETIONS, model_name="tiny", max_output_tokens=0)


def test_chat_fields_are_accepted_only_on_a_chat_request() -> None:
    body = {"messages": [], "max_completion_tokens": 8, "tools": [], "tool_choice": "none"}
    assert _check(body, api=Api.CHAT) == body
    assert _check(body, api=None) == body  # "messages" makes it a chat request
    with pytest.raises(BadRequest, match="'messages' is a field of /v1/chat/completions, not of /v1/completions"):
        _check(body, api=Api.COMPLETIONS)
    with pytest.raises(BadRequest, match="'prompt' is a field of /v1/completions"):
        _check({"messages": [], "prompt": "x"}, api=Api.CHAT)


def test_every_field_is_in_one_group_per_api() -> None:
    """A field listed twice for one API would be a second place to change it."""
    for api in Api:
        names = [n for g in FIELD_GROUPS if api in g.apis for n in g.names]
        assert len(names) == len(set(names)) == len(ACCEPTED[api]), api


def test_dynamo_s_agent_hints_are_accepted_for_both_apis() -> None:
    hints = {"latency_sensitivity": 1.2, "osl": 512, "priority": -3, "speculative_prefill": True}
    assert _check({"prompt": "hi", "nvext": {"agent_hints": hints}})["nvext"]["agent_hints"] == hints
    chat = {"messages": [{"role": "user", "content": "hi"}], "nvext": {"agent_hints": {}}}
    assert _check(chat, Api.CHAT)["nvext"] == {"agent_hints": {}}
