"""Envoy's access-log records read into the picker's :class:`RequestEnd` (no I/O)."""

from __future__ import annotations

import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.logs.v1 import logs_pb2

from kvpilot.routing.gateway.access_log import request_end
from kvpilot.routing.gateway.contract import LogAttribute
from kvpilot.routing.gateway.picker import RequestEnd


def _record(**fields: str) -> logs_pb2.LogRecord:
    record = logs_pb2.LogRecord()
    for key, value in fields.items():
        record.attributes.append(common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value)))
    return record


def test_a_streamed_request_s_record() -> None:
    record = _record(request_id="r1", status="200", first_body_byte_us="12500", duration_us="80250")
    assert request_end(record) == RequestEnd("r1", 200, 0.0125, 0.08025)


def test_a_request_that_never_got_a_body_byte() -> None:
    record = _record(request_id="r2", status="503", first_body_byte_us="-", duration_us="900")
    assert request_end(record) == RequestEnd("r2", 503, None, 0.0009)
    assert request_end(_record(request_id="r3", status="0")).status == 0  # the client left first


@pytest.mark.parametrize(
    ("status", "flags", "answered", "upstream_broke"),
    [
        ("200", "-", True, False),
        ("200", "UR", False, True),  # D reset the stream after its headers: still a 200
        ("200", "UC,DC", False, True),
        ("200", "DC", False, False),  # the client left: no one's fault
        ("503", "UF", False, True),
        ("400", "-", False, False),
    ],
)
def test_the_response_flags_tell_a_broken_stream_from_an_answer(status, flags, answered, upstream_broke) -> None:
    end = request_end(_record(request_id="r", status=status, response_flags=flags))
    assert (end.answered, end.upstream_broke) == (answered, upstream_broke)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({}, "no request id"),
        ({"request_id": "-"}, "no request id"),
        ({"request_id": "r", "first_body_byte_us": "soon"}, "invalid literal"),
    ],
)
def test_an_unreadable_record_is_refused(fields: dict[str, str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        request_end(_record(**fields))


def test_the_attributes_read_are_those_envoy_is_told_to_send() -> None:
    names = {a.value for a in LogAttribute}
    assert {"request_id", "status", "first_body_byte_us", "duration_us"} <= names
