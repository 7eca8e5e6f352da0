from __future__ import annotations

import json

from benchmarks.fleet.replay import DYNAMO_SESSION_HEADER, JSON, body, headers
from kvpilot.routing.decide.sessions import SESSION_HEADERS


def test_a_request_body_streams_exactly_the_trace_s_output_with_usage_at_the_end():
    sent = json.loads(body([7, 8, 9], 42))
    assert sent["prompt"] == [7, 8, 9] and sent["max_tokens"] == 42
    assert sent["ignore_eos"] is True  # every arm generates the same tokens
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_a_session_s_step_names_its_session_to_both_routers_and_a_lone_request_names_none():
    assert headers(None) == JSON
    named = headers("agent-7")
    assert named[SESSION_HEADERS[0]] == named[DYNAMO_SESSION_HEADER] == "agent-7"
    assert named["Content-Type"] == JSON["Content-Type"]
