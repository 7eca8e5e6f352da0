"""Replay trace requests against one OpenAI completions endpoint, streamed: the fleet
benchmark's client (I/O only: what to send comes from :mod:`fleet_trace`, what it
measured goes to :mod:`fleet_results`).

Request ``i`` is sent at ``arrivals[i]`` seconds after the replay starts (or as soon as
one of ``concurrency`` slots frees up, the wait recorded), with its prompt as token ids,
``max_tokens`` = its trace output length, ``ignore_eos`` (every arm generates exactly
the trace's tokens) and the usage block requested at the end of the stream. Every body
is encoded before the replay starts, so that the client's own work at send time is a
socket write (a burst of 14K-token prompts encoded on the fly delays the timers of
the requests in flight). A stream's
first and last chunk with a choice give its TTFT and decode time; its token count is the
usage block's ``completion_tokens``. A request that is a step of a session carries its
id in both routers' session headers (:func:`headers`), to every arm alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from benchmarks.fleet.results import Outcome
from kvpilot.routing.decide.sessions import SESSION_HEADERS

JSON = {"Content-Type": "application/json"}
DYNAMO_SESSION_HEADER = "x-dynamo-session-id"
"""Where Dynamo's frontend reads a request's agent session (its session affinity,
``--router-session-affinity-ttl-secs``)."""


class Connections(str, enum.Enum):
    """How the client holds its connections to the endpoint it sends to."""

    KEPT_ALIVE = "kept-alive"
    """Pooled and reused, as OpenAI's SDK (httpx) and most clients do. Against Dynamo
    1.6.1's frontend this pays its Nagle delay (dynamo#14643: ~40 ms on the first token
    of a request on a reused connection, measured here); against kvpilot's router, whose
    own connections to the frontend are fresh, it does not."""
    FRESH = "fresh"
    """A new connection per request: no arm pays the frontend's Nagle delay at the client."""


@dataclass(frozen=True, slots=True)
class Send:
    """One request to send: its trace index, arrival time and encoded body (:func:`body`)."""

    index: int
    at: float
    body: bytes
    headers: dict[str, str] = dataclasses.field(default_factory=lambda: dict(JSON))
    """:func:`headers` of the request's session."""


def headers(session_id: str | None) -> dict[str, str]:
    """The request's HTTP headers: JSON, and ``session_id`` (where the request has one)
    under kvpilot's and Dynamo's session headers."""
    if session_id is None:
        return dict(JSON)
    return {**JSON, SESSION_HEADERS[0]: session_id, DYNAMO_SESSION_HEADER: session_id}


def body(prompt: list[int], max_tokens: int, model: str = "tiny") -> bytes:
    """The JSON body of one streamed completion of exactly ``max_tokens`` tokens."""
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def _one(http: aiohttp.ClientSession, url: str, send: Send, t0: float, queued: float) -> Outcome:
    sent = time.perf_counter() - t0
    first = last = None
    tokens = prompt_tokens = cached = 0
    try:
        async with http.post(f"{url}/v1/completions", data=send.body, headers=send.headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Outcome(send.index, sent, None, None, 0, queued, error=f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices"):  # a token (its text may be empty: a partial UTF-8 character)
                    last = time.perf_counter() - t0
                    first = last if first is None else first
                usage = chunk.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        return Outcome(send.index, sent, first, last, tokens, queued, prompt_tokens, cached, error)
    missing = None if first is not None else "no token streamed"
    return Outcome(send.index, sent, first, last, tokens, queued, prompt_tokens, cached, missing)


async def replay(
    urls: Sequence[str],
    sends: Sequence[Send],
    *,
    concurrency: int = 256,
    timeout_s: float = 300.0,
    connections: Connections = Connections.KEPT_ALIVE,
) -> list[Outcome]:
    """Every request of ``sends`` (in ``at`` order), request ``i`` against ``urls[i % len(urls)]``
    (round robin over router replicas; one URL otherwise); their outcomes in the same order.
    Never raises for a failed request: its outcome holds the error."""
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=connections is Connections.FRESH)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()

        async def scheduled(send: Send) -> Outcome:
            await asyncio.sleep(max(0.0, send.at - (time.perf_counter() - t0)))
            due = time.perf_counter()
            async with limit:
                return await _one(http, urls[send.index % len(urls)], send, t0, time.perf_counter() - due)

        return list(await asyncio.gather(*(scheduled(s) for s in sends)))
