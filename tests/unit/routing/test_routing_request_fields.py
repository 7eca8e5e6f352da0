"""checked_body: a client's request body refused before routing, with the status and reason."""

from __future__ import annotations

import json
import re

import pytest

from kvpilot.routing.serve.request_fields import BadRequest, checked_body


def _check(body: object, chat: bool | None = False) -> dict:
    return checked_body(json.dumps(body).encode(), chat, model_name="tiny", max_output_tokens=64)


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
    ],
)
def test_a_refused_body_says_why(body: object, status: int, reason: str | None, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)) as err:
        _check(body)
    assert (err.value.status, err.value.reason) == (status, reason)


def test_json_that_does_not_parse_is_refused() -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        checked_body(b"{", False, model_name="tiny", max_output_tokens=0)


def test_chat_fields_are_accepted_only_on_a_chat_request() -> None:
    body = {"messages": [], "max_completion_tokens": 8}
    assert _check(body, chat=True) == body
    assert _check(body, chat=None) == body  # "messages" makes it a chat request
    with pytest.raises(BadRequest, match="'messages' is not a field"):
        _check(body, chat=False)
