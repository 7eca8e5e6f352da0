"""D's side of an OpenAI completions or chat completions call over HTTP, for the upstreams
that speak them (:mod:`kvpilot.routing.serve.vllm_upstream`, :mod:`kvpilot.routing.serve.dynamo_upstream`):
the whole answer or its stream, with an engine's failures mapped to
:class:`~kvpilot.routing.serve.upstream.UpstreamError` and
:class:`~kvpilot.routing.serve.upstream.StreamBroke` in this one place. I/O only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp
import msgspec

from kvpilot.routing.config import Worker
from kvpilot.routing.serve.sse import sse_batches
from kvpilot.routing.serve.upstream import Api, StreamBroke, UpstreamError


class CompletionsHttp:
    """``POST {worker.url}{api}`` (``/v1/completions`` or ``/v1/chat/completions``) with
    ``headers`` (the engines' API key, when one is configured) plus each call's own."""

    def __init__(self, http: aiohttp.ClientSession, headers: Mapping[str, str]) -> None:
        self._http = http
        self._headers = dict(headers)

    def post(
        self,
        worker: Worker,
        api: Api,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        """The request, to be entered with ``async with`` (aiohttp's errors propagate).
        The body is encoded by msgspec, not the json module aiohttp uses: the encoding runs
        on the router's one loop, and a long prompt of ids is most of the body."""
        url = f"{worker.url}{api.value}"
        sent = {**self._headers, **(headers or {}), "Content-Type": "application/json"}
        data = msgspec.json.encode(body)
        return self._http.post(url, data=data, timeout=timeout or self._http.timeout, headers=sent)

    async def complete(
        self, worker: Worker, api: Api, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """D's whole answer, parsed; raises :class:`UpstreamError`."""
        with _reaching(worker):
            async with self.post(worker, api, body, headers) as resp:
                raw = await resp.read()
        if resp.status != 200:
            raise _answered(worker, resp.status, raw)
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(worker, 502, f"sent an unreadable completion: {exc}") from None
        if not isinstance(payload, dict):
            raise UpstreamError(worker, 502, "sent an unreadable completion: not a JSON object")
        return payload

    @asynccontextmanager
    async def stream(
        self, worker: Worker, api: Api, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[AsyncIterator[list[str]]]:
        """D's stream, once D answered 200: the ``data`` of its server-sent events, in the
        batches they arrived in (:func:`~kvpilot.routing.serve.sse.sse_batches`).

        Raises :class:`UpstreamError` on entry (D unreachable, timed out, not 200);
        while iterating, :class:`StreamBroke` when the stream breaks."""
        request = self.post(worker, api, body, headers)
        with _reaching(worker):
            upstream = await request.__aenter__()
        try:
            if upstream.status != 200:
                raise _answered(worker, upstream.status, await upstream.read())
            yield _unbroken(sse_batches(upstream.content.iter_any()))
        finally:
            await request.__aexit__(None, None, None)


async def _unbroken(events: AsyncIterator[list[str]]) -> AsyncIterator[list[str]]:
    """``events``, with aiohttp's errors and timeouts while reading raised as :class:`StreamBroke`."""
    try:
        async for batch in events:
            yield batch
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise StreamBroke(repr(exc)) from exc


@contextmanager
def _reaching(worker: Worker) -> Iterator[None]:
    """D not reached in time (504) or at all (502), as :class:`UpstreamError`."""
    try:
        yield
    except asyncio.TimeoutError:
        raise UpstreamError(worker, 504, "timed out") from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(worker, 502, f"unreachable: {exc}") from None


def _answered(worker: Worker, status: int, raw: bytes) -> UpstreamError:
    """An engine's non-200 answer: its 4xx kept for the client, anything else a 502."""
    detail = f"answered {status}: {raw[:500].decode(errors='replace')}"
    return UpstreamError(worker, status if 400 <= status < 500 else 502, detail)
