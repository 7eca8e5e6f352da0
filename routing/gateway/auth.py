"""The picker's gRPC services closed to strangers: a shared token on every call.

With ``gateway.token_env`` set, every call to the picker's port (Envoy's ext_proc stream,
the OTLP access-log export) must carry the metadata ``authorization: Bearer <token>``
(Envoy's ``grpc_service.initial_metadata``). :class:`TokenInterceptor` answers any other
call ``UNAUTHENTICATED`` before its first message reaches the picker: no route is taken, no
load booked, and no forged access-log record ends a request or counts against a worker's
circuit. The token is compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_METADATA = "authorization"
REFUSED_MESSAGE = "missing or wrong gateway token (authorization: Bearer <token>)"


async def _refuse(_: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED_MESSAGE)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with ``token`` (module doc); ``on_refused`` is called once
    per refused call (the router counts it)."""

    def __init__(self, token: str, on_refused: Callable[[], None]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

    def _carries_token(self, metadata: Any) -> bool:
        sent = next((value for key, value in metadata or () if key == TOKEN_METADATA), "")
        sent = sent if isinstance(sent, bytes) else sent.encode()
        return hmac.compare_digest(sent, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self._carries_token(handler_call_details.invocation_metadata):
            return handler
        self._on_refused()
        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(_refuse, handler.request_deserializer, handler.response_serializer)
