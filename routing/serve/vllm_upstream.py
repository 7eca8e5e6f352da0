"""The :class:`~routing.serve.upstream.Upstream` of vLLM engines reached directly:
``POST {worker}/v1/completions`` with the engines' API key, when one is configured.

P's prefill is one token, not streamed, with ``kv_transfer_params`` asking P to keep
the prompt's KV for D (vLLM's P->D protocol); D gets P's returned params as its own
``kv_transfer_params``. I/O only: no routing, no ledger, no metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiohttp

from routing.config import Worker
from routing.serve.sse import sse_data
from routing.serve.upstream import PrefillFailure, PrefillOutcome, StreamBroke, UpstreamError


class VllmUpstream:
    """vLLM's OpenAI completions endpoint on each engine (see the module doc)."""

    def __init__(self, http: aiohttp.ClientSession, headers: dict[str, str], prefill_timeout_s: float) -> None:
        self._http = http
        self._headers = headers
        self._prefill_timeout = aiohttp.ClientTimeout(total=prefill_timeout_s)

    def _post(self, worker: Worker, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None) -> Any:
        url = f"{worker.url}/v1/completions"
        return self._http.post(url, json=body, timeout=timeout or self._http.timeout, headers=self._headers)

    async def prefill(self, worker: Worker, body: dict[str, Any], params: dict[str, Any]) -> PrefillOutcome:
        """P computes ``body``'s prompt (one token, not streamed) with ``params`` as its
        ``kv_transfer_params``; within ``prefill_timeout_s``."""
        pbody = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
        pbody.pop("stream_options", None)
        try:
            async with self._post(worker, pbody, self._prefill_timeout) as resp:
                raw = await resp.read()
            if resp.status != 200:
                failure = PrefillFailure.REFUSED if 400 <= resp.status < 500 else PrefillFailure.ENGINE_ERROR
                return PrefillOutcome(None, failure, resp.status)
            returned = json.loads(raw).get("kv_transfer_params")
        except asyncio.TimeoutError:
            return PrefillOutcome(None, PrefillFailure.TIMEOUT)
        except aiohttp.ClientError:
            return PrefillOutcome(None, PrefillFailure.CONNECTION)
        except (ValueError, AttributeError):
            return PrefillOutcome(None, PrefillFailure.BAD_RESPONSE)
        if not isinstance(returned, dict):
            return PrefillOutcome(None, PrefillFailure.NO_KV_TRANSFER_PARAMS)
        return PrefillOutcome(returned)

    async def complete(self, worker: Worker, body: dict[str, Any], handoff: dict[str, Any] | None) -> dict[str, Any]:
        """D's whole completion, parsed."""
        with _reaching(worker):
            async with self._post(worker, _decode_body(body, handoff)) as resp:
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
        self, worker: Worker, body: dict[str, Any], handoff: dict[str, Any] | None
    ) -> AsyncIterator[AsyncIterator[str]]:
        """D's stream, once D answered 200: the ``data`` of each server-sent event.

        Raises :class:`UpstreamError` on entry (D unreachable, timed out, not 200);
        while iterating, :class:`StreamBroke` when the stream breaks."""
        request = self._post(worker, _decode_body(body, handoff))
        with _reaching(worker):
            upstream = await request.__aenter__()
        try:
            if upstream.status != 200:
                raise _answered(worker, upstream.status, await upstream.read())
            yield _unbroken(sse_data(upstream.content))
        finally:
            await request.__aexit__(None, None, None)


async def _unbroken(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, with aiohttp's errors and timeouts while reading raised as :class:`StreamBroke`."""
    try:
        async for data in events:
            yield data
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise StreamBroke(repr(exc)) from exc


def _decode_body(body: dict[str, Any], handoff: dict[str, Any] | None) -> dict[str, Any]:
    """D's body: P's returned params as its ``kv_transfer_params`` (none: D prefills)."""
    return body if handoff is None else {**body, "kv_transfer_params": handoff}


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
