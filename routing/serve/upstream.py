"""What the proxy (:mod:`kvpilot.routing.serve.proxy`) needs of the engines behind it: the
:class:`Upstream` interface, and how an engine's failure reaches the proxy.

- :meth:`Upstream.prefill` never raises: P's handoff params for D, or why there are
  none (:class:`PrefillFailure`), after which D prefills the prompt itself; or, where
  the deployment does the P->D handoff itself, a *deferred* handoff that only names
  P for D's call (:attr:`PrefillOutcome.deferred`);
- :meth:`Upstream.complete` and :meth:`Upstream.stream` raise :class:`UpstreamError`
  when D fails before anything could reach the client (its 4xx kept, a timeout a
  504, anything else a 502); a stream that breaks later raises :class:`StreamBroke`
  while iterating.

Every call carries an :class:`EngineRequest`: the client's body as it was sent, for the
OpenAI API it called (:class:`Api`), with the token ids the router routed it on. The engines
render and tokenize it themselves (a chat on their own ``/v1/chat/completions``, so vLLM's
tool-call and reasoning parsers run), and their answers reach the client as they wrote them.

One implementation per kind of deployment, each a module of its own: vLLM engines
reached directly (:mod:`kvpilot.routing.serve.vllm_upstream`), and NVIDIA Dynamo's frontend in
direct mode (:mod:`kvpilot.routing.serve.dynamo_upstream`). The proxy never branches on which
one it has.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvpilot.routing.config import Worker


class Api(str, enum.Enum):
    """The OpenAI API a request called: its path on every engine (and on Dynamo's frontend)."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engines are sent: ``body``, the client's body as sent (without the session
    fields and ``nvext``, which the router reads), for ``api``; ``token_ids``, the prompt's
    token ids as the engine itself computes them (:mod:`kvpilot.routing.serve.prompt`), which
    the router routed on; ``agent_hints``, the client's ``nvext.agent_hints`` (``None``: none),
    which only Dynamo's frontend is sent."""

    api: Api
    body: dict[str, Any]
    token_ids: list[int]
    agent_hints: dict[str, Any] | None = None

    @property
    def parallel_samples(self) -> bool:
        """Whether the request asks for several samples (``n`` > 1): vLLM fans them out into
        requests that would each read one P's handoff, so D prefills such a request itself."""
        n = self.body.get("n")
        return isinstance(n, int) and n > 1


class UpstreamError(Exception):
    """An engine failed a request before anything was sent to the client."""

    def __init__(self, worker: Worker, status: int, detail: str) -> None:
        super().__init__(f"engine {worker.name} ({worker.url}): {detail}")
        self.worker = worker
        self.status = status


class StreamBroke(Exception):
    """D's stream broke after it began (the connection dropped or timed out)."""


class PrefillFailure(str, enum.Enum):
    """Why P's prefill gave D nothing to pull."""

    REFUSED = "refused"  # P answered 4xx: the router sent P something it cannot serve
    ENGINE_ERROR = "engine_error"  # P answered 5xx (or any other non-200, non-4xx)
    TIMEOUT = "timeout"  # no answer within the prefill timeout (server.prefill_timeout_s or k x predicted)
    CONNECTION = "connection"  # P could not be reached, or dropped the connection
    BAD_RESPONSE = "bad_response"  # P's 200 was not a readable completion
    NO_KV_TRANSFER_PARAMS = "no_kv_transfer_params"  # P's completion carried no handoff

    @property
    def engine_fault(self) -> bool:
        """Whether the failure is P's, and counts toward its circuit: a 4xx is the
        router's request at fault, and an answer without params is P's connector
        declining (neither means P is unwell)."""
        return self not in (PrefillFailure.REFUSED, PrefillFailure.NO_KV_TRANSFER_PARAMS)


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """P's answer: the params D pulls P's KV with, or why there are none."""

    params: dict[str, Any] | None
    failure: PrefillFailure | None = None
    status: int | None = None
    """P's HTTP status when it answered with anything but 200."""
    detail: str = ""
    """The start of P's answer when it answered with anything but 200."""
    deferred: bool = False
    """P has not prefilled yet: ``params`` only name P for D's call, in which the
    deployment prefills on P and hands the KV to D itself (Dynamo's frontend does). P's
    prefill then ends with D's first token, not with this answer."""

    @property
    def engine_fault(self) -> bool:
        return self.failure is not None and self.failure.engine_fault

    @property
    def reason(self) -> str:
        """The ``reason`` label of ``kvpilot_router_prefill_failures_total``:
        ``status_<code>`` when P answered, else the failure's value."""
        assert self.failure is not None
        return f"status_{self.status}" if self.status is not None else self.failure.value


@dataclass(frozen=True, slots=True)
class Destination:
    """Where D's request goes when something other than the proxy sends it (Envoy, with
    kvpilot's endpoint picker): the ``host:port`` to connect to, the headers to set, and
    the body to send (to the path the client called)."""

    host_port: str
    headers: dict[str, str]
    body: dict[str, Any]


def host_port(url: str) -> str:
    """``host:port`` of an ``http(s)://host:port`` URL (the scheme's port when none is written)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class Upstream(Protocol):
    """The engines a routed request is sent to (its :class:`EngineRequest`); ``handoff`` is
    what P's prefill returned for D (``None``: D prefills the prompt itself)."""

    async def prefill(
        self, worker: Worker, request: EngineRequest, params: dict[str, Any], timeout_s: float
    ) -> PrefillOutcome:
        """P computes ``request``'s prompt for a peer to pull, with ``params`` as its
        ``kv_transfer_params`` (a fresh handoff request, or D's offer of the session's
        KV for P to pull first), within ``timeout_s``, or a deferred outcome naming P
        for D's call (an upstream whose deployment hands P's KV to D itself may ignore
        ``params`` and ``timeout_s``); never raises."""
        ...

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        """D's whole answer, parsed, as D wrote it; raises :class:`UpstreamError`."""
        ...

    def stream(
        self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None
    ) -> AbstractAsyncContextManager[AsyncIterator[list[str]]]:
        """D's stream, entered once D answered: the ``data`` of its server-sent events, in
        batches (each batch what one read delivered, never empty).
        Raises :class:`UpstreamError` on entry, :class:`StreamBroke` while iterating."""
        ...

    def destination(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> Destination:
        """D's request for a sender other than the proxy. Raises :class:`UpstreamError`
        (502) for a worker that can no longer be reached."""
        ...
