from __future__ import annotations

import json

from fleet_replay import body


def test_a_request_body_streams_exactly_the_trace_s_output_with_usage_at_the_end():
    sent = json.loads(body([7, 8, 9], 42))
    assert sent["prompt"] == [7, 8, 9] and sent["max_tokens"] == 42
    assert sent["ignore_eos"] is True  # every arm generates the same tokens
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
