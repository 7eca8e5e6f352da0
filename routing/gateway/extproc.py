"""Envoy's ``ext_proc`` protocol (``envoy.service.ext_proc.v3``) over the :class:`~routing.gateway.picker.Picker`.

One gRPC stream per HTTP request. Envoy sends the request's headers, then its whole body
(``BUFFERED``); the picker answers the headers with CONTINUE and the body with:

- the destination, GAIE's way: the header ``x-gateway-destination-endpoint`` (``host:port``)
  and the same in the dynamic metadata ``envoy.lb``, plus the destination's own headers
  (Dynamo's instance ids; the engines' API key) and the answer's ``x-kvpilot-*`` headers,
  which Envoy's route copies to the response;
- the body D is sent (token ids), its ``content-length`` set to match;
- ``clear_route_cache``, so Envoy routes on the new headers;

or an immediate response when the picker refuses (JSON error naming the problem). A request
that ends with its headers (a GET) is answered here: ``/v1/models`` and ``/health`` from the
router, anything else 404. Response headers and bodies are never sent here
(``deploy/envoy_spec.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from routing.gateway.contract import DESTINATION_HEADER, DESTINATION_METADATA_NAMESPACE
from routing.gateway.picker import Picked, Picker, Refused

log = logging.getLogger(__name__)

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


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


def _picked(picked: Picked) -> ep.ProcessingResponse:
    """The body's answer: the destination and its headers, and D's body when it is not the
    client's (a body sent back unchanged would cost a copy both ways for nothing)."""
    dest = picked.destination
    headers = {
        **dest.headers,
        **{k.lower(): v for k, v in picked.answer_headers.items()},
        DESTINATION_HEADER: dest.host_port,
    }
    mutation = None
    if picked.body is not None:
        headers |= {"content-type": "application/json", "content-length": str(len(picked.body))}
        mutation = ep.BodyMutation(body=picked.body)
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_METADATA_NAMESPACE: {DESTINATION_HEADER: dest.host_port}})
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


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service (see the module doc). ``answer_get(path, headers)`` is the
    router's answer to a GET: (status, JSON payload)."""

    def __init__(self, picker: Picker, answer_get: Any) -> None:
        self._picker = picker
        self._answer_get = answer_get

    async def Process(  # noqa: N802  # the gRPC method's name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[ep.ProcessingResponse]:
        headers: CIMultiDict[str] = CIMultiDict()
        arrived = time.perf_counter()
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                arrived = time.perf_counter()
                headers = _headers(message.request_headers)
                if message.request_headers.end_of_stream:  # no body: a GET
                    status, payload = self._answer_get(headers.get(":path", ""), headers)
                    yield _immediate(status, payload)
                    return
                yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
            elif kind == "request_body":
                body = message.request_body
                if not body.end_of_stream:  # BUFFERED sends the whole body at once
                    yield _immediate(500, {"error": {"message": "the picker needs the whole body (BUFFERED)"}})
                    return
                yield await self._pick(headers, body.body, arrived)
                return
            else:  # the processing mode sends nothing else; let anything else through
                log.warning("ext_proc: unexpected %s message; continuing", kind)
                yield ep.ProcessingResponse(**{kind: _continue_for(kind)})

    async def _pick(self, headers: CIMultiDict[str], raw: bytes, arrived: float) -> ep.ProcessingResponse:
        path = headers.get(":path", "")
        if headers.get(":method", "POST") != "POST":
            return _immediate(405, {"error": {"message": f"{headers.get(':method')} {path}: use POST"}})
        try:
            return _picked(await self._picker.pick(path, headers, raw, arrived))
        except Refused as exc:
            return _immediate(exc.status, exc.payload, exc.headers)


def _continue_for(kind: str) -> Any:
    return (
        ep.BodyResponse()
        if kind.endswith("_body")
        else (ep.TrailersResponse() if kind.endswith("_trailers") else ep.HeadersResponse())
    )
