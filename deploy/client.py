"""A small OpenAI completions and chat client for the demo, benchmarks and tests.

Greedy decoding with logprobs, so that two runs can be compared token by token and
logprob by logprob (random-weight models can keep the same greedy text on wrong KV;
their logprobs do not).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.client import HTTPResponse
from typing import Any

from multidict import CIMultiDict


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    ttft_seconds: float
    total_seconds: float
    kv_transfer_params: dict[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    """The answer's headers, looked up in any case (Envoy sends them lower-case)."""
    token_ids: tuple[int, ...] = ()
    """The generated token ids, when the request asked ``return_token_ids``."""
    token_seconds: tuple[float, ...] = ()
    """Streamed: when each token arrived, in seconds since the request was sent."""

    def same_output(self, other: Completion) -> bool:
        """Same tokens and bit-identical logprobs."""
        return self.tokens == other.tokens and self.logprobs == other.logprobs

    def max_logprob_diff(self, other: Completion) -> float:
        if len(self.logprobs) != len(other.logprobs):
            return float("inf")
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)

    def divergence(self, other: Completion) -> tuple[int | None, float]:
        """(index of the first generated token that differs from ``other``'s, or None;
        max |logprob diff| over the tokens up to and including it); ``(0, inf)`` when the
        lengths differ. Token ids are compared where both answers have them, else tokens.

        After the first differing token the two sequences have different contexts, so
        their logprobs are not comparable. A greedy choice between two near-tied tokens
        can flip on numeric noise alone (random weights give flat distributions): then
        both chosen tokens have about the same logprob and the diff at the flip stays
        within the noise; wrong KV shows a larger diff at or before it."""
        ids = self.token_ids if self.token_ids and other.token_ids else None
        a, b = (ids, other.token_ids) if ids else (self.tokens, other.tokens)
        if len(self.logprobs) != len(other.logprobs) or len(a) != len(b):
            return 0, float("inf")
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        end = len(a) if first is None else first + 1
        diffs = (abs(x - y) for x, y in zip(self.logprobs[:end], other.logprobs[:end], strict=True))
        return first, max(diffs, default=0.0)


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: str, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers: Mapping[str, str] = headers or {}
        super().__init__(f"HTTP {status}: {body[:500]}")


def _post(url: str, body: dict[str, Any], timeout: float) -> HTTPResponse:
    """The open response to a JSON POST (close it); raises :class:`HTTPStatusError` on 4xx/5xx."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        response: HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
        return response
    except urllib.error.HTTPError as exc:
        raise HTTPStatusError(exc.code, exc.read().decode(errors="replace"), CIMultiDict(exc.headers.items())) from None


def complete(
    base_url: str,
    prompt: str | list[int],
    *,
    max_tokens: int = 8,
    stream: bool = False,
    model: str = "tiny",
    timeout: float = 300.0,
    **extra: Any,
) -> Completion:
    """Greedy completion with top-1 logprobs. ``extra`` goes into the body as is."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "stream": stream,
        **extra,
    }
    started = time.perf_counter()
    tokens: list[str] = []
    logprobs: list[float] = []
    ttft = 0.0
    arrivals: list[float] = []
    with _post(f"{base_url}/v1/completions", body, timeout) as resp:
        headers = CIMultiDict(resp.headers.items())
        if not stream:
            payload = json.load(resp)
            choice = payload["choices"][0]
            ttft = time.perf_counter() - started
            tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
            text, params = choice["text"], payload.get("kv_transfer_params")
            token_ids = tuple(choice.get("token_ids") or ())
        else:
            text, params, streamed_ids = "", None, list[int]()
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    now = time.perf_counter() - started
                    if not ttft and (choice.get("text") or choice.get("token_ids") or choice.get("logprobs")):
                        ttft = now  # the first token, with logprobs or without (Dynamo's mocker sends none)
                    if choice.get("logprobs"):
                        arrivals += [now] * len(choice["logprobs"]["tokens"])
                        tokens += choice["logprobs"]["tokens"]
                        logprobs += choice["logprobs"]["token_logprobs"]
                    text += choice.get("text", "")
                    streamed_ids += choice.get("token_ids") or ()
            token_ids = tuple(streamed_ids)
    return Completion(
        text,
        tuple(tokens),
        tuple(logprobs),
        ttft,
        time.perf_counter() - started,
        params,
        headers,
        token_ids,
        tuple(arrivals),
    )


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """A whole chat completion's first choice: its content, reasoning and tool calls (each
    ``(name, arguments)``; the call ids are random), its tokens with their logprobs, the
    prompt's token count and the answer's headers."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[tuple[str, str], ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    prompt_tokens: int
    seconds: float
    headers: Mapping[str, str] = field(default_factory=dict)

    def same_output(self, other: ChatAnswer) -> bool:
        """Same content, reasoning, tool calls, tokens and bit-identical logprobs."""
        mine = (self.content, self.reasoning, self.tool_calls, self.tokens, self.logprobs)
        return mine == (other.content, other.reasoning, other.tool_calls, other.tokens, other.logprobs)

    def max_logprob_diff(self, other: ChatAnswer) -> float:
        if len(self.logprobs) != len(other.logprobs):
            return float("inf")
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)


def chat(base_url: str, body: dict[str, Any], *, timeout: float = 300.0) -> ChatAnswer:
    """``body`` sent to ``/v1/chat/completions`` as it is (greedy with top-1 logprobs unless
    it says otherwise), not streamed."""
    sent = {"model": "tiny", "temperature": 0.0, "logprobs": True, "top_logprobs": 1, **body}
    started = time.perf_counter()
    with _post(f"{base_url}/v1/chat/completions", sent, timeout) as resp:
        headers = CIMultiDict(resp.headers.items())
        payload = json.load(resp)
    seconds = time.perf_counter() - started
    choice = payload["choices"][0]
    message = choice["message"]
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ())
    content = (choice.get("logprobs") or {}).get("content") or ()
    return ChatAnswer(
        message.get("content"),
        message.get("reasoning") or message.get("reasoning_content"),
        calls,
        tuple(t["token"] for t in content),
        tuple(t["logprob"] for t in content),
        payload["usage"]["prompt_tokens"],
        seconds,
        headers,
    )


def debug_route(router_url: str, prompt: list[int], *, timeout: float = 60.0, **extra: object) -> dict[str, Any]:
    """The router's ``POST /debug/route`` answer for ``prompt`` (nothing is sent to an engine)."""
    with _post(f"{router_url}/debug/route", {"prompt": prompt, **extra}, timeout) as resp:
        route: dict[str, Any] = json.load(resp)
    return route


def gpu_overlap(route: dict[str, Any], worker: str) -> int:
    """Blocks of the prompt ``worker`` holds in GPU memory, per a :func:`debug_route` answer."""
    return int(route["overlap"].get(worker, {}).get("GPU", 0))


def wait_for_overlap(
    router_url: str, prompt: list[int], worker: str, blocks: int, timeout: float = 30.0, **extra: Any
) -> dict[str, Any]:
    """Poll :func:`debug_route` until the router's index shows ``worker`` holding ``blocks``
    of ``prompt``, or ``timeout`` passes; returns the last answer either way."""
    deadline = time.monotonic() + timeout
    while True:
        route = debug_route(router_url, prompt, **extra)
        if gpu_overlap(route, worker) >= blocks or time.monotonic() > deadline:
            return route
        time.sleep(0.3)
