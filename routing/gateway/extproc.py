"""Envoy's ``ext_proc`` protocol (``envoy.service.ext_proc.v3``) over the
:class:`~kvpilot.routing.gateway.picker.Picker`.

One gRPC stream per HTTP request, in one of two styles, told by the processing mode Envoy
announces on its first message (``protocol_config``):

**kvpilot's** (``deploy/envoy_spec.py``): the request body ``BUFFERED``, no response
phase. Envoy sends the request's headers, then its whole body; the picker answers the
headers with CONTINUE and the body with:

- the destination, GAIE's way: the header ``x-gateway-destination-endpoint`` (``host:port``)
  and the same in the dynamic metadata ``envoy.lb``, plus the destination's own headers
  (Dynamo's instance ids; the engines' API key) and the answer's ``x-kvpilot-*`` headers,
  which Envoy's route copies to the response;
- the body D is sent (token ids), its ``content-length`` set to match;
- ``clear_route_cache``, so Envoy routes on the new headers;

the client's address, for ``sessions.max_sessions_per_client``, comes with the headers as
the ``source.address`` attribute (:func:`client_address`; Envoy's config says why it is the
TCP peer's);

or an immediate response when the picker refuses (JSON error naming the problem). Response
headers and bodies are never sent here; the request's end comes from Envoy's access log.

**GAIE's** (how Gateway API Inference Extension gateways configure their endpoint picker):
both bodies ``FULL_DUPLEX_STREAMED``. The picker holds its answer to the headers until the
body's last chunk, then answers the headers with the destination and the body with D's body
(``StreamedBodyResponse``); it adds the ``x-kvpilot-*`` headers to the response headers and
sends every response chunk back as it came. That relays every streamed token through this
process, which is what GAIE's protocol asks; the request's end and first-token time are
read from the response body here, not from an access log. A body is buffered only up to
``max_body_bytes`` (``server.max_body_bytes``): past it the stream is answered 413 at once,
as the router's HTTP front answers, and the rest of the body is never held.

A request that ends with its headers (a GET) is answered here in both styles:
``/v1/models`` and ``/health`` from the router, anything else 404.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from kvpilot.routing.gateway.contract import CLIENT_ATTRIBUTE, DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE
from kvpilot.routing.gateway.picker import Picked, Picker, Refused, RequestEnd
from kvpilot.routing.serve.driver import error_reply

log = logging.getLogger(__name__)

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _headers(message: ep.HttpHeaders) -> CIMultiDict[str]:
    """The request's headers, looked up in any case (Envoy sends ``raw_value``; older builds ``value``)."""
    return CIMultiDict((h.key, h.raw_value.decode(errors="replace") or h.value) for h in message.headers.headers)


def _mutation(headers: Mapping[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE
            )
            for k, v in headers.items()
        ]
    )


def client_address(message: ep.ProcessingRequest) -> str | None:
    """The client's IP address from the ``source.address`` attribute (``IP:port``, ``[v6]:port``)
    that Envoy sends with a request's headers when its ext_proc filter asks for it
    (``request_attributes``), under the filter's name; ``None`` when it sent none."""
    for attributes in message.attributes.values():
        value = attributes.fields.get(CLIENT_ATTRIBUTE)
        address = "" if value is None else str(value.string_value)
        if address:
            return address.rpartition(":")[0].strip("[]") or address
    return None


def _immediate(
    status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation({"content-type": "application/json", **(headers or {})}),
            body=json.dumps(payload).encode(),
            details=f"kvpilot_picker_{status}",
        )
    )


def _destination(picked: Picked) -> tuple[dict[str, str], struct_pb2.Struct]:
    """The headers D's request gets (the destination's, the answer's ``x-kvpilot-*``, GAIE's
    destination header; the body's length when it is replaced) and ``envoy.lb``'s metadata."""
    dest = picked.destination
    headers = {
        **dest.headers,
        **{k.lower(): v for k, v in picked.answer_headers.items()},
        DESTINATION_HEADER: dest.host_port,
    }
    if picked.body is not None:
        headers |= {"content-type": "application/json", "content-length": str(len(picked.body))}
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_METADATA_NAMESPACE: {DESTINATION_HEADER: dest.host_port}})
    return headers, metadata


def _picked(picked: Picked) -> ep.ProcessingResponse:
    """kvpilot's style: the body's answer carries the destination and its headers, and D's
    body when it is not the client's (a body sent back unchanged would cost a copy both
    ways for nothing)."""
    headers, metadata = _destination(picked)
    mutation = None if picked.body is None else ep.BodyMutation(body=picked.body)
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                status=ep.CommonResponse.CONTINUE_AND_REPLACE if mutation is not None else ep.CommonResponse.CONTINUE,
                header_mutation=_mutation(headers),
                body_mutation=mutation,
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=metadata,
    )


def _picked_duplex(picked: Picked, raw: bytes) -> list[ep.ProcessingResponse]:
    """GAIE's style: the headers' answer (the destination), then the body's (D's body, or
    the client's as it came, in one streamed chunk)."""
    headers, metadata = _destination(picked)
    headers_answer = ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=_mutation(headers), clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )
    body = raw if picked.body is None else picked.body
    return [headers_answer, _streamed("request_body", body, end=True)]


def _streamed(kind: str, chunk: bytes, *, end: bool) -> ep.ProcessingResponse:
    """A body chunk sent back in full-duplex streaming (``kind``: request_body or response_body)."""
    streamed = ep.StreamedBodyResponse(body=chunk, end_of_stream=end)
    answer = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed)))
    return ep.ProcessingResponse(**{kind: answer})


@dataclass(slots=True)
class _Stream:
    """One request's ext_proc stream, as its messages come."""

    duplex: bool = False
    """GAIE's style (both bodies ``FULL_DUPLEX_STREAMED``)."""
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    arrived: float = 0.0
    client: str | None = None
    """The client's address (:func:`client_address`)."""
    body: bytearray = field(default_factory=bytearray)
    request_id: str | None = None
    """The picked request's id, in GAIE's style (its end is read here)."""
    answer_headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    first_body: float | None = None
    ended: bool = False
    done: bool = False


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service (see the module doc). ``answer_get(path, headers)`` is the
    router's answer to a GET: (status, JSON payload). ``max_body_bytes``: the largest
    request body buffered (``server.max_body_bytes``)."""

    def __init__(self, picker: Picker, answer_get: Any, max_body_bytes: int) -> None:
        self._picker = picker
        self._answer_get = answer_get
        self._max_body_bytes = max_body_bytes

    async def Process(  # noqa: N802  # the gRPC method's name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[ep.ProcessingResponse]:
        state = _Stream()
        try:
            async for message in request_iterator:
                if message.HasField("protocol_config"):
                    state.duplex = message.protocol_config.request_body_mode == FULL_DUPLEX_STREAMED
                for answer in await self._on(message, state):
                    yield answer
                if state.done:
                    return
        finally:
            if state.request_id is not None and not state.ended:  # the client or Envoy left first
                await self._picker.ended(RequestEnd(state.request_id, 0, None, time.perf_counter() - state.arrived))

    async def _on(self, message: ep.ProcessingRequest, state: _Stream) -> list[ep.ProcessingResponse]:
        """The answers to one of Envoy's messages (none while a GAIE-style body is coming)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            state.arrived = time.perf_counter()
            state.headers = _headers(message.request_headers)
            state.client = client_address(message)
            if message.request_headers.end_of_stream:  # no body: a GET
                state.done = True
                return [_immediate(*self._answer_get(state.headers.get(":path", ""), state.headers))]
            return [] if state.duplex else [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if kind == "request_body":
            if len(state.body) + len(message.request_body.body) > self._max_body_bytes:
                state.done = True
                limit = f"request body is over server.max_body_bytes ({self._max_body_bytes})"
                return [_immediate(413, error_reply(413, limit).payload)]
            state.body += message.request_body.body
            if not message.request_body.end_of_stream:
                if state.duplex:
                    return []
                state.done = True  # BUFFERED sends the whole body at once
                return [_immediate(500, error_reply(500, "the picker needs the whole body (BUFFERED)").payload)]
            return await self._pick(state)
        if kind == "response_headers":
            state.status = int(_headers(message.response_headers).get(":status", "0"))
            return [
                ep.ProcessingResponse(
                    response_headers=ep.HeadersResponse(
                        response=ep.CommonResponse(header_mutation=_mutation(state.answer_headers))
                    )
                )
            ]
        if kind == "response_body":
            chunk = message.response_body
            now = time.perf_counter()
            if state.first_body is None and chunk.body:
                state.first_body = now - state.arrived
            if chunk.end_of_stream and state.request_id is not None:
                state.ended = True
                await self._picker.ended(
                    RequestEnd(state.request_id, state.status, state.first_body, now - state.arrived)
                )
            return [_streamed("response_body", bytes(chunk.body), end=chunk.end_of_stream)]
        if kind in ("request_trailers", "response_trailers"):
            return [ep.ProcessingResponse(**{kind: ep.TrailersResponse()})]
        log.warning("ext_proc: unexpected %s message; continuing", kind)
        return [ep.ProcessingResponse(**{kind: ep.HeadersResponse()})]

    async def _pick(self, state: _Stream) -> list[ep.ProcessingResponse]:
        """The picker's answer for the whole body: the destination, or a refusal."""
        headers, path = state.headers, state.headers.get(":path", "")
        state.done = not state.duplex  # a GAIE-style stream goes on with the response
        if headers.get(":method", "POST") != "POST":
            state.done = True
            return [_immediate(405, error_reply(405, f"{headers.get(':method')} {path}: use POST").payload)]
        raw = bytes(state.body)
        try:
            picked = await self._picker.pick(path, headers, raw, state.arrived, state.client)
        except Refused as exc:
            state.done = True
            return [_immediate(exc.status, exc.payload, exc.headers)]
        if not state.duplex:
            return [_picked(picked)]
        state.request_id = picked.request_id
        state.answer_headers = {k.lower(): v for k, v in picked.answer_headers.items()}
        return _picked_duplex(picked, raw)
