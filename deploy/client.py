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
    """When each token arrived, in seconds since the request was sent (a whole answer's
    all at once)."""
    tool_calls: tuple[tuple[str, str], ...] = ()
    """A chat's tool calls, each ``(name, arguments)`` (their ids are random)."""
    prompt_tokens: int = 0
    """The prompt's token count, as the engine's usage says."""
    top2_margins: tuple[float, ...] = ()
    """Per generated token, how far the best of its top logprobs leads the second (>= 0:
    how near the greedy choice was to a tie), when the request asked for at least two top
    logprobs (``top_logprobs=2`` for a chat); empty otherwise."""

    def same_output(self, other: Completion) -> bool:
        """Same tokens, bit-identical logprobs, the same tool calls."""
        return (self.tokens, self.logprobs, self.tool_calls) == (other.tokens, other.logprobs, other.tool_calls)

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


Prompt = str | list[int] | list[dict[str, Any]]
"""What :func:`complete` sends: text or token ids to ``/v1/completions``, chat messages to
``/v1/chat/completions``."""


def is_chat(prompt: Prompt) -> bool:
    """Whether ``prompt`` is a list of chat messages."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def complete(
    base_url: str,
    prompt: Prompt,
    *,
    max_tokens: int = 8,
    stream: bool = False,
    model: str = "tiny",
    timeout: float = 300.0,
    **extra: Any,
) -> Completion:
    """Greedy, with top-1 logprobs: a completion of text or token ids, or a chat completion
    of messages (its content as ``text``, its tool calls, its logprobs' tokens). ``extra``
    goes into the body as is."""
    chat = is_chat(prompt)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if chat:
        body |= {"messages": prompt, "logprobs": True, "top_logprobs": 1}
    else:
        body |= {"prompt": prompt, "logprobs": 1}
    body |= extra
    path = "/v1/chat/completions" if chat else "/v1/completions"
    started = time.perf_counter()
    with _post(f"{base_url}{path}", body, timeout) as resp:
        parsed = _Parsed(CIMultiDict(resp.headers.items()))
        if not stream:
            parsed.add(json.load(resp), time.perf_counter() - started)
        else:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    parsed.add(json.loads(line[5:]), time.perf_counter() - started)
    return parsed.completion(time.perf_counter() - started)


class _Parsed:
    """A completion's or chat completion's first choice, whole or from its chunks in order."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers
        self.text = ""
        self.tokens: list[str] = []
        self.logprobs: list[float] = []
        self.arrivals: list[float] = []
        self.token_ids: list[int] = []
        self.calls: dict[int, tuple[str, str]] = {}
        self.params: dict[str, Any] | None = None
        self.prompt_tokens = 0
        self.ttft = 0.0
        self.margins: list[float] = []

    def add(self, payload: dict[str, Any], now: float) -> None:
        self.params = payload.get("kv_transfer_params") or self.params
        self.prompt_tokens = (payload.get("usage") or {}).get("prompt_tokens") or self.prompt_tokens
        for choice in payload.get("choices") or ():
            part = choice.get("message") or choice.get("delta") or {}
            text = choice.get("text") or part.get("content") or ""
            lp = choice.get("logprobs") or {}
            if "content" in lp:  # a chat's
                tokens = [t["token"] for t in lp["content"] or ()]
                logprobs = [t["logprob"] for t in lp["content"] or ()]
                tops = [[top["logprob"] for top in t.get("top_logprobs") or ()] for t in lp["content"] or ()]
            else:
                tokens, logprobs = list(lp.get("tokens") or ()), list(lp.get("token_logprobs") or ())
                tops = [list((top or {}).values()) for top in lp.get("top_logprobs") or ()]
            self.margins += [_lead(top) for top in tops if len(top) >= 2]
            if not self.ttft and (text or tokens or choice.get("token_ids")):
                self.ttft = now  # the first token, with logprobs or without (Dynamo's mocker sends none)
            self.text += text
            self.tokens += tokens
            self.logprobs += logprobs
            self.arrivals += [now] * len(tokens)
            self.token_ids += choice.get("token_ids") or ()
            for k, call in enumerate(part.get("tool_calls") or ()):
                index, function = call.get("index", k), call.get("function") or {}
                name, args = self.calls.get(index, ("", ""))
                self.calls[index] = (name + (function.get("name") or ""), args + (function.get("arguments") or ""))

    def completion(self, total: float) -> Completion:
        return Completion(
            self.text,
            tuple(self.tokens),
            tuple(self.logprobs),
            self.ttft or total,
            total,
            self.params,
            self.headers,
            tuple(self.token_ids),
            tuple(self.arrivals),
            tuple(self.calls[k] for k in sorted(self.calls)),
            self.prompt_tokens,
            tuple(self.margins) if len(self.margins) == len(self.tokens) else (),
        )


def _lead(logprobs: list[float]) -> float:
    """How far the best of ``logprobs`` (two or more) leads the second."""
    first, second = sorted(logprobs, reverse=True)[:2]
    return first - second


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
