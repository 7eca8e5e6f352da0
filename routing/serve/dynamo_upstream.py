"""The :class:`~kvpilot.routing.serve.upstream.Upstream` of a Dynamo deployment: NVIDIA
Dynamo's frontend in direct mode (``python -m dynamo.frontend --router-mode direct``).

Every request goes to the frontend (each Dynamo worker's ``url`` is the frontend's)
with the router's choice in headers: :data:`WORKER_INSTANCE_HEADER` names the decode
(or aggregated) instance, and, for a remote prefill, :data:`PREFILL_INSTANCE_HEADER`
the prefill instance. The frontend then prefills on that instance and hands its KV to
the decode instance itself (Dynamo's bootstrap rendezvous, NIXL on GPUs), so P's step
here makes no call: it returns a deferred handoff holding P's header, which D's call
carries. The body is the client's: a completion with the router's token ids in
``nvext.token_data``, so the frontend does not tokenize again; a chat as it came, for the
frontend to render and tokenize itself. Dynamo 1.6.1's frontend renders a chat otherwise than
vLLM (the tools' JSON in the template: measured in tests/e2e/test_dynamo.py), and its own
rendering is what its workers serve; the router's ids, vLLM's, then name the chat's blocks
up to the first difference. I/O only: no routing, no ledger, no metrics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp

from kvpilot.routing.config import Worker
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.serve.completions_http import CompletionsHttp
from kvpilot.routing.serve.request_fields import AGENT_HINTS, NVEXT
from kvpilot.routing.serve.upstream import (
    Api,
    Destination,
    EngineRequest,
    PrefillFailure,
    PrefillOutcome,
    UpstreamError,
    host_port,
)

WORKER_INSTANCE_HEADER = "x-dynamo-worker-instance-id"
"""The decode (or aggregated) instance Dynamo's frontend sends the request to (Dynamo
1.6.1 also takes the unprefixed ``x-worker-instance-id``)."""
PREFILL_INSTANCE_HEADER = "x-dynamo-prefill-instance-id"
"""The prefill instance, beside :data:`WORKER_INSTANCE_HEADER`, in a disaggregated deployment."""


class DynamoUpstream:
    """Dynamo's frontend in direct mode (see the module doc). ``instance_id(worker)``
    is the worker's Dynamo instance id, ``None`` once it left the deployment."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        headers: dict[str, str],
        instance_id: Callable[[WorkerId], int | None],
    ) -> None:
        self._completions = CompletionsHttp(http, headers)
        self._engine_headers = headers
        self._instance_id = instance_id

    async def prefill(
        self, worker: Worker, request: EngineRequest, params: dict[str, Any], timeout_s: float
    ) -> PrefillOutcome:
        """P's header for D's call, deferred (no call is made; ``params`` are not used:
        Dynamo hands P's KV to D itself). A prefill worker that left: a connection
        failure, after which D prefills the prompt itself."""
        instance = self._instance_id(worker.name)
        if instance is None:
            return PrefillOutcome(None, PrefillFailure.CONNECTION)
        return PrefillOutcome({PREFILL_INSTANCE_HEADER: str(instance)}, deferred=True)

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        """The whole answer from ``worker`` (prefilled first on the instance that
        ``handoff`` names, if any), parsed; raises :class:`UpstreamError`."""
        headers = self._headers(worker, handoff)
        return await self._completions.complete(worker, request.api, with_token_data(request), headers)

    def stream(
        self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None
    ) -> AbstractAsyncContextManager[AsyncIterator[list[str]]]:
        """The stream from ``worker``, as :meth:`complete` routes it."""
        headers = self._headers(worker, handoff)
        return self._completions.stream(worker, request.api, with_token_data(request), headers)

    def destination(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> Destination:
        """The frontend, with the instance headers (a text completion's token ids: :func:`with_token_data`)."""
        headers = {**self._engine_headers, **self._headers(worker, handoff)}
        return Destination(host_port(worker.url), headers, with_token_data(request))

    def _headers(self, worker: Worker, handoff: dict[str, Any] | None) -> dict[str, str]:
        """The instance headers; raises :class:`UpstreamError` (502) for a worker that left."""
        instance = self._instance_id(worker.name)
        if instance is None:
            raise UpstreamError(worker, 502, "left the Dynamo deployment")
        return {WORKER_INSTANCE_HEADER: str(instance), **(handoff or {})}


def with_token_data(request: EngineRequest) -> dict[str, Any]:
    """The client's body, with its agent hints in ``nvext.agent_hints``; a text completion's
    with the router's token ids in ``nvext.token_data`` (a token-id prompt already is its token
    ids, and a chat is the frontend's to render: each sent as it is)."""
    nvext: dict[str, Any] = {} if request.agent_hints is None else {AGENT_HINTS: request.agent_hints}
    if request.api is Api.COMPLETIONS and request.body.get("prompt") is not request.token_ids:
        nvext["token_data"] = request.token_ids
    return {**request.body, NVEXT: nvext} if nvext else request.body
