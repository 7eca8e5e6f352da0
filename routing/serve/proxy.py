"""The relay's half of a routed request: D's call through an
:class:`~kvpilot.routing.serve.upstream.Upstream`, whole or streamed to the client, with the
retry on another decode worker. Everything around D's call (the session's claim, the
booking, P's prefill and its recovery, the first token, the end) is the
:class:`~kvpilot.routing.serve.driver.RequestDriver`'s, which Envoy's picker drives too.

A request for several samples
(:attr:`~kvpilot.routing.serve.upstream.EngineRequest.parallel_samples`) routed to a remote
prefill is prefilled on D instead (the lifecycle's dispatch; counted as a local prefill):
vLLM would fan its samples out into requests that each read P's one handoff.

D's answer reaches the client as D wrote it (tool calls, reasoning, usage, logprobs), but
for what :mod:`kvpilot.routing.serve.withheld` withholds, whole or streamed: D's offer of the
session's KV (``kv_transfer_params``: ``null`` in a whole answer, gone from a streamed chunk)
and any top-level ``kvpilot_*`` key. The offer is handed to the driver's end, for the
session's next step.

A decode worker that fails before anything reached the client is left out and the
request routed again, up to ``server.max_retries`` times (counted in
``kvpilot_router_retries_total``); a 4xx is the request's fault and is not retried.

No aiohttp.web here: the HTTP front hands in a :class:`ClientStream` for streamed
answers and turns the returned :class:`~kvpilot.routing.serve.driver.Reply` into its response.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvpilot.routing.decide.router import Route
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.serve.driver import Begun, ProxyRequest, Reply, RequestDriver, error_reply
from kvpilot.routing.serve.upstream import StreamBroke, UpstreamError
from kvpilot.routing.serve.withheld import scrubbed_answer, scrubbed_events

log = logging.getLogger(__name__)


class ClientStream(Protocol):
    """The client's side of a streamed answer, written in order: ``open`` once, then
    ``send`` per batch of events (each batch one write), then ``close`` once."""

    async def open(self, headers: Mapping[str, str]) -> None: ...
    async def send(self, events: Sequence[str]) -> None: ...
    async def close(self) -> None: ...


class Proxy:
    """Serves :class:`~kvpilot.routing.serve.driver.ProxyRequest` s (see the module doc):
    D's call through the ``driver``'s upstream, each step around it driven by ``driver``."""

    def __init__(self, driver: RequestDriver, max_retries: int) -> None:
        self.driver = driver
        self.max_retries = max_retries

    async def serve(self, request: ProxyRequest, client: ClientStream) -> Reply | None:
        """Serve ``request``, retrying on another decode worker as the module doc says.
        Returns the answer, or ``None`` when it was streamed to ``client``."""
        route, failed = request.route, set[WorkerId]()
        while True:
            try:
                return await self._attempt(request, route, client)
            except UpstreamError as exc:
                log.warning("request %s: %s", route.request_id, exc)
                if exc.status < 500 or len(failed) >= self.max_retries:
                    return error_reply(exc.status, str(exc), "upstream_error")
                failed.add(exc.worker.name)
                rerouted = request.reroute(frozenset(failed))
                if rerouted is None:  # no other decode worker: the failure stands
                    return error_reply(exc.status, str(exc), "upstream_error")
                route = rerouted
                self.driver.metrics.retries.labels(exc.worker.name).inc()

    async def _attempt(self, request: ProxyRequest, route: Route, client: ClientStream) -> Reply | None:
        """Serve ``route`` once; raises :class:`UpstreamError` when D fails before
        anything was sent to the client (a stream that breaks later ends with an
        error event instead)."""
        driver = self.driver
        begun = await driver.begin(request, route)
        if isinstance(begun, Reply):
            return begun
        ticket = begun.ticket
        try:
            reply: Reply | None
            if request.engine.body.get("stream"):
                answered, decode_params = await self._stream(request, begun, client)
                reply = None
            else:
                reply, decode_params = await self._unary(request, begun)
                answered = True
        except UpstreamError as exc:
            driver.decode_failed(ticket, engine_fault=exc.status >= 500)
            raise
        except BaseException:
            driver.failed(ticket)
            raise
        await driver.finish(ticket, answered=answered, decode_params=decode_params)
        return reply

    async def _unary(self, request: ProxyRequest, begun: Begun) -> tuple[Reply, object]:
        """D's answer as D wrote it but for what :func:`~kvpilot.routing.serve.withheld.scrubbed_answer`
        withholds, and D's ``kv_transfer_params`` (its offer of the session's KV in bidirectional
        mode; ``None`` when absent). The offer names where the session's KV lives and how to read
        it: it is the router's, never a client's."""
        payload = await self.driver.upstream.complete(begun.ticket.route.decode, request.engine, begun.handoff)
        answer, offer = scrubbed_answer(payload)
        return Reply(200, answer, begun.headers), offer

    async def _stream(self, request: ProxyRequest, begun: Begun, client: ClientStream) -> tuple[bool, object]:
        """D's stream relayed to ``client``, each batch of events as it comes, less what
        :func:`~kvpilot.routing.serve.withheld.scrubbed_events` withholds; whether it ended
        normally (a break is sent to the client as an error event and counted against D), and
        D's offer where a chunk carried one (``None``: none, or the stream broke)."""
        ticket = begun.ticket
        d = ticket.route.decode
        sent_at = time.perf_counter()
        async with self.driver.upstream.stream(d, request.engine, begun.handoff) as events:
            await client.open(begun.headers)
            first = True
            offer: object = None
            try:
                async for batch in events:
                    if first:
                        now = time.perf_counter()
                        self.driver.first_token(ticket, now - sent_at, now - request.started)
                    first = False
                    scrubbed, carried = scrubbed_events(batch)
                    offer = carried if carried is not None else offer
                    await client.send(scrubbed)
            except StreamBroke as exc:
                self.driver.decode_failed(ticket, engine_fault=True)
                message = f"engine {d.name} ({d.url}): stream broke: {exc}"
                await client.send([json.dumps(error_reply(502, message, "upstream_error").payload)])
                await client.close()
                return False, None
            await client.close()
            return True, offer
