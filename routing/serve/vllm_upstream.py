"""The :class:`~kvpilot.routing.serve.upstream.Upstream` of vLLM engines reached directly:
``POST {worker}/v1/completions`` or ``/v1/chat/completions`` (the API the client called) with
the engines' API key, when one is configured.

P's prefill is the client's request cut to one token, not streamed, with
``kv_transfer_params`` asking P to keep the prompt's KV for D (vLLM's P->D protocol); D gets
the client's request with P's returned params as its own ``kv_transfer_params``
(:mod:`kvpilot.routing.serve.completions_http` makes D's call). Both engines render and
tokenize the request themselves, from the same model files. I/O only: no routing, no
ledger, no metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp

from kvpilot.routing.config import Worker
from kvpilot.routing.serve.completions_http import CompletionsHttp
from kvpilot.routing.serve.upstream import (
    Destination,
    EngineRequest,
    PrefillFailure,
    PrefillOutcome,
    host_port,
)

NOT_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens", "n")
"""Client fields P's one-token prefill must not carry: vLLM refuses ``min_tokens`` above
``max_tokens`` (400), a chat's ``max_completion_tokens`` would override P's ``max_tokens``,
P computes one sample, and P's answer is not streamed. D gets them as sent."""


class VllmUpstream:
    """vLLM's OpenAI completions endpoint on each engine (see the module doc)."""

    def __init__(self, http: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self._completions = CompletionsHttp(http, headers)
        self._headers = headers

    async def prefill(
        self, worker: Worker, request: EngineRequest, params: dict[str, Any], timeout_s: float
    ) -> PrefillOutcome:
        """P computes ``request``'s prompt (one token, not streamed) with ``params`` as its
        ``kv_transfer_params``; within ``timeout_s``."""
        pbody = {k: v for k, v in request.body.items() if k not in NOT_FOR_PREFILL}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params=params)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._completions.post(worker, request.api, pbody, timeout=timeout) as resp:
                raw = await resp.read()
            if resp.status != 200:
                failure = PrefillFailure.REFUSED if 400 <= resp.status < 500 else PrefillFailure.ENGINE_ERROR
                return PrefillOutcome(None, failure, resp.status, raw[:300].decode(errors="replace"))
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

    async def complete(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> dict[str, Any]:
        """D's whole answer, parsed."""
        return await self._completions.complete(worker, request.api, _decode_body(request.body, handoff))

    def stream(
        self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None
    ) -> AbstractAsyncContextManager[AsyncIterator[list[str]]]:
        """D's stream, once D answered 200: its events' ``data``, in batches."""
        return self._completions.stream(worker, request.api, _decode_body(request.body, handoff))

    def destination(self, worker: Worker, request: EngineRequest, handoff: dict[str, Any] | None) -> Destination:
        """The engine itself, with the engines' API key and P's params in the body."""
        return Destination(host_port(worker.url), dict(self._headers), _decode_body(request.body, handoff))


def _decode_body(body: dict[str, Any], handoff: dict[str, Any] | None) -> dict[str, Any]:
    """D's body: P's returned params as its ``kv_transfer_params`` (none: D prefills)."""
    return body if handoff is None else {**body, "kv_transfer_params": handoff}
