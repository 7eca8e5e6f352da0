"""Envoy's OpenTelemetry access log, received: the OTLP logs service
(``opentelemetry.proto.collector.logs.v1``) over the :class:`~kvpilot.routing.gateway.picker.Picker`.

Envoy sends one log record per request as it ends (``deploy/envoy_spec.py`` names the
attributes, :class:`~kvpilot.routing.gateway.contract.LogAttribute`): the request id, the status, the
microseconds to the destination's first body byte and to the last byte sent, and Envoy's
response flags (a stream the destination broke after its headers still has status 200). Each becomes
a :class:`~kvpilot.routing.gateway.picker.RequestEnd`. A record without a request id, or with a
field that is not a number, is logged and skipped; the export is still acknowledged.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as ls
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc as ls_grpc
from opentelemetry.proto.logs.v1 import logs_pb2

from kvpilot.routing.gateway.contract import LogAttribute
from kvpilot.routing.gateway.picker import Picker, RequestEnd

log = logging.getLogger(__name__)


def _microseconds(text: str) -> float | None:
    """Seconds from Envoy's ``%COMMON_DURATION(...:us)%``; ``None`` for ``-`` (it did not happen)."""
    return None if text in ("", "-") else int(text) / 1e6


def request_end(record: logs_pb2.LogRecord) -> RequestEnd:
    """The record's :class:`RequestEnd`; raises ValueError for a missing or unreadable field."""
    fields = {kv.key: kv.value.string_value for kv in record.attributes}
    request_id = fields.get(LogAttribute.REQUEST_ID.value, "")
    if not request_id or request_id == "-":
        raise ValueError("no request id")
    duration = _microseconds(fields.get(LogAttribute.DURATION_US.value, "-"))
    status = fields.get(LogAttribute.STATUS.value, "0")
    flags = fields.get(LogAttribute.RESPONSE_FLAGS.value, "-")
    return RequestEnd(
        request_id,
        int(status) if status.isdigit() else 0,
        _microseconds(fields.get(LogAttribute.FIRST_BODY_BYTE_US.value, "-")),
        duration if duration is not None else 0.0,
        frozenset() if flags in ("", "-") else frozenset(flags.split(",")),
    )


LOG_GROUPS_FIELD = LOG_RECORDS_FIELD = 2
"""``ResourceLogs.scope_logs`` and ``ScopeLogs.log_records`` in OTLP 1.x; the older copy of the
same modules that xds-protos installs names them ``instrumentation_library_logs`` and ``logs``
(the two packages own the same files under ``opentelemetry/proto``: whichever installed last
wins). The field numbers, and so the wire, are the same."""


def _by_number(message: Any, number: int) -> Any:
    """``message``'s field ``number``, whichever copy of the modules named it."""
    return getattr(message, message.DESCRIPTOR.fields_by_number[number].name)


class AccessLogReceiver(ls_grpc.LogsServiceServicer):
    """The OTLP logs service Envoy exports its access log to (see the module doc)."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Export(  # noqa: N802  # the gRPC method's name
        self, request: ls.ExportLogsServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ls.ExportLogsServiceResponse:
        for resource in request.resource_logs:
            for group in _by_number(resource, LOG_GROUPS_FIELD):
                for record in _by_number(group, LOG_RECORDS_FIELD):
                    try:
                        end = request_end(record)
                    except ValueError as exc:
                        log.warning("access log: a record skipped (%s)", exc)
                        continue
                    await self._picker.ended(end)
        return ls.ExportLogsServiceResponse()
