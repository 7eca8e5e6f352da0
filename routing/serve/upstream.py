"""The router's HTTP calls to its engines: P's one-token prefill, D's answer, D's
stream. I/O only: no routing, no ledger, no metrics (the server keeps those), so
what an engine's failure looks like to the server is decided here, once.

- :meth:`EngineClient.prefill` never raises: P's ``kv_transfer_params``, or the
  reason P failed (``status_<code>``, ``timeout``, ``connection``,
  ``bad_response``, ``no_kv_transfer_params``);
- :meth:`EngineClient.complete` and :meth:`EngineClient.stream` raise
  :class:`UpstreamError` when D fails before anything could reach the client
  (its 4xx kept, a timeout a 504, anything else a 502).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from routing.config import Worker


class UpstreamError(Exception):
    """An engine failed a request before anything was sent to the client."""

    def __init__(self, worker: Worker, status: int, detail: str) -> None:
        super().__init__(f"engine {worker.name} ({worker.url}): {detail}")
        self.worker = worker
        self.status = status


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """P's answer: its ``kv_transfer_params``, or why there are none."""

    params: dict[str, Any] | None
    failure: str | None = None

    @property
    def engine_fault(self) -> bool:
        """Whether the failure is P's (no answer, a timeout, a 5xx, garbage), which
        counts toward its circuit; a 4xx or an answer without params is not."""
        f = self.failure
        return f is not None and f != "no_kv_transfer_params" and not f.startswith("status_4")


class EngineClient:
    """``POST {worker}/v1/completions`` with the engines' API key, when one is configured."""

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
                return PrefillOutcome(None, f"status_{resp.status}")
            returned = json.loads(raw).get("kv_transfer_params")
        except asyncio.TimeoutError:
            return PrefillOutcome(None, "timeout")
        except aiohttp.ClientError:
            return PrefillOutcome(None, "connection")
        except (ValueError, AttributeError):
            return PrefillOutcome(None, "bad_response")
        if not isinstance(returned, dict):
            return PrefillOutcome(None, "no_kv_transfer_params")
        return PrefillOutcome(returned)

    async def complete(self, worker: Worker, body: dict[str, Any]) -> dict[str, Any]:
        """D's whole completion, parsed."""
        with _reaching(worker):
            async with self._post(worker, body) as resp:
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
    async def stream(self, worker: Worker, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        """D's stream, once D answered 200: the ``data`` of each server-sent event.

        Raises :class:`UpstreamError` on entry (D unreachable, timed out, not 200);
        while iterating, a broken stream raises what aiohttp raises."""
        request = self._post(worker, body)
        with _reaching(worker):
            upstream = await request.__aenter__()
        try:
            if upstream.status != 200:
                raise _answered(worker, upstream.status, await upstream.read())
            yield sse_data(upstream.content)
        finally:
            await request.__aexit__(None, None, None)


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


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines).

    Parsed here: no SSE library is installed and the maintained one (httpx-sse) reads
    httpx responses, not aiohttp's.
    """
    lines: list[str] = []
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)
