"""The router's HTTP front (aiohttp): OpenAI-compatible, token ids to the engines.

Per request: parse and validate the body (400 naming the field), tokenize once
(chat: render the model's chat template first), route (:mod:`routing.router`),
count it in the :class:`~routing.cost.LoadLedger`, then

- remote prefill: P gets the token ids with ``max_tokens=1``, ``stream=false``
  and ``kv_transfer_params={"do_remote_decode": true}``; D gets them with P's
  returned ``kv_transfer_params``. If P errors, times out
  (``server.prefill_timeout_s``) or returns no params, D prefills locally
  (no params) and ``kvpilot_router_prefill_fallbacks_total`` counts it;
- local prefill or co-located: one engine does both.

D's answer is relayed (SSE when ``stream``); chat answers are converted back
from the completions format. An upstream failure reaches the client as a JSON
error naming the engine (the engine's 4xx status is kept, anything else is a
502); the router keeps serving. Response headers ``X-Request-Id``,
``X-KVPilot-Route``, ``X-KVPilot-Prefill-Worker``, ``X-KVPilot-Decode-Worker``
say where it went. ``POST /debug/route`` explains a decision without sending
anything. Metrics: :class:`RouterMetrics` (listed in ``docs/router.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from routing.config import RouterConfig
from routing.cost import LoadLedger
from routing.engines import Fleet, IndexFeeder, Worker
from routing.index import BlockIndex
from routing.router import Route, Router, policy_from_config
from routing.sessions import InvalidSessionKey, SessionId, SessionStore, session_key
from routing.tokenizer import PromptError, PromptTokenizer

log = logging.getLogger(__name__)
ROUTER_ONLY_KEYS = ("conversation_id", "prompt_cache_key")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class UpstreamError(Exception):
    """An engine failed; ``status`` is what the client gets."""

    def __init__(self, worker: Worker, status: int, detail: str) -> None:
        super().__init__(f"engine {worker.name} ({worker.url}): {detail}")
        self.worker = worker
        self.status = status


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise BadRequest(f"'{name}' must be {what}")
    return value


# ---- chat: template in, completions out, chat back ----------------------------
CHAT_ONLY_KEYS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs")
UNSUPPORTED_CHAT_KEYS = ("tools", "tool_choice", "functions", "function_call", "response_format")


class ChatError(ValueError):
    """A chat request the router cannot render; the message names the field."""


class ChatTemplate:
    """The model's ``chat_template`` (from ``tokenizer_config.json``), rendered with jinja2
    the way Hugging Face does (sandboxed, ``trim_blocks``, ``lstrip_blocks``)."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_chat_error
        self._template = env.from_string(template)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The template in ``model_dir/tokenizer_config.json``, or None if it has none."""
        path = model_dir / "tokenizer_config.json"
        if not path.exists():
            return None
        cfg = json.loads(path.read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            return None
        return cls(template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages: object) -> str:
        """The prompt text for OpenAI ``messages`` (generation prompt added).

        Raises :class:`ChatError` naming the bad field.
        """
        try:
            return self._template.render(
                messages=_checked_messages(messages), add_generation_prompt=True, **self._specials
            )
        except TemplateError as exc:
            raise ChatError(f"chat template failed on 'messages': {exc}") from None


def _raise_chat_error(message: str) -> None:
    raise ChatError(message)


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _checked_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"'messages[{i}]' must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ChatError(f"'messages[{i}].role' must be a non-empty string")
        if isinstance(content, list):  # text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ChatError(f"'messages[{i}].content' parts must all be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ChatError(f"'messages[{i}].content' must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def chat_to_completion_body(body: dict[str, Any]) -> dict[str, Any]:
    """The completions request for a chat request (the prompt is set by the caller)."""
    for key in UNSUPPORTED_CHAT_KEYS:
        if body.get(key) is not None:
            raise ChatError(f"'{key}' is not supported by the router")
    out = {k: v for k, v in body.items() if k not in CHAT_ONLY_KEYS}
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    if body.get("logprobs"):
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ChatError("'top_logprobs' must be a non-negative integer")
        out["logprobs"] = top
    return out


def _chat_logprobs(lp: Any) -> Any:
    if not lp:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t, x), "top_logprobs": [entry(k, v) for k, v in (top or {}).items()]}
            for t, x, top in zip(lp["tokens"], lp["token_logprobs"], tops)
        ]
    }


def chat_response(completion: dict[str, Any], request_id: str) -> dict[str, Any]:
    """An engine's ``text_completion`` as a ``chat.completion``."""
    choices = [
        {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
         "logprobs": _chat_logprobs(c.get("logprobs")), "finish_reason": c.get("finish_reason")}
        for c in completion["choices"]
    ]  # fmt: skip
    return {**_chat_head(completion, request_id, "chat.completion"), "choices": choices}


def chat_chunk(chunk: dict[str, Any], request_id: str, first: bool) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk as a ``chat.completion.chunk``."""
    choices = []
    for c in chunk.get("choices") or ():
        delta = {"role": "assistant", "content": c["text"]} if first else {"content": c["text"]}
        choices.append(
            {"index": c["index"], "delta": delta, "logprobs": _chat_logprobs(c.get("logprobs")),
             "finish_reason": c.get("finish_reason")}
        )  # fmt: skip
    return {**_chat_head(chunk, request_id, "chat.completion.chunk"), "choices": choices}


def _chat_head(completion: dict[str, Any], request_id: str, kind: str) -> dict[str, Any]:
    head = {"id": request_id, "object": kind}
    head.update(created=completion.get("created"), model=completion.get("model"))
    if completion.get("usage") is not None:
        head["usage"] = completion["usage"]
    return head


# ---- metrics --------------------------------------------------------------------
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    """The router's Prometheus families, in a registry of its own.

    Counted per decision: ``kvpilot_router_decisions_total{kind,prefill,decode}``,
    ``kvpilot_router_overlap_blocks{tier}`` (the prefilling worker's creditable
    blocks per tier class), ``kvpilot_router_prompt_blocks_total`` and
    ``kvpilot_router_cached_blocks_total{tier}`` (hit rate = cached / prompt,
    also as the gauge ``kvpilot_router_cache_hit_ratio``). TTFT by stage
    (article section 10.4): ``kvpilot_router_ttft_stage_seconds{stage}`` with
    ``route`` (parse, tokenize, queue for the index lock, decide), ``prefill``
    (P's answer), ``decode_first_token`` (D's first SSE event; streams only),
    and the client's ``kvpilot_router_ttft_seconds``. Failures:
    ``kvpilot_router_prefill_failures_total{worker,reason}``,
    ``kvpilot_router_prefill_fallbacks_total``, ``kvpilot_router_upstream_errors_total{worker}``.
    At scrape time: KV-event ingest per worker (batches, replays, gaps, restarts,
    rejected events by reason) and the index's blocks per worker and tier.
    """

    def __init__(self, server: RouterServer) -> None:
        self._server = server
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = "kvpilot_router_"
        self.decisions = Counter(p + "decisions", "Routing decisions", ["kind", "prefill", "decode"], registry=r)
        self.overlap = Histogram(
            p + "overlap_blocks", "Creditable prefix blocks of the prefilling worker, per tier class",
            ["tier"], buckets=_BLOCK_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_blocks = Counter(p + "prompt_blocks", "Full prompt blocks routed", registry=r)
        self.cached_blocks = Counter(
            p + "cached_blocks", "Prompt blocks cached on the prefilling worker, per tier class", ["tier"], registry=r
        )
        self.hit_ratio = Gauge(p + "cache_hit_ratio", "Cached over prompt blocks since start (all tiers)", registry=r)
        self.ttft_stage = Histogram(
            p + "ttft_stage_seconds", "Time to first token by stage", ["stage"], buckets=_SECONDS_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Time to first token seen by the client (streams)", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.prefill_failures = Counter(
            p + "prefill_failures", "Remote prefills that failed", ["worker", "reason"], registry=r
        )
        self.fallbacks = Counter(p + "prefill_fallbacks", "Requests prefilled locally on D after P failed", registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Engine errors returned to clients", ["worker"], registry=r)
        self._prompt, self._cached = 0, 0
        r.register(self)  # type: ignore[arg-type]  # the scrape-time collector below

    def decided(self, route: Route, route_seconds: float) -> None:
        self.decisions.labels(route.kind.value, route.prefill_worker.name, route.decode.name).inc()
        self.prompt_blocks.inc(route.prompt_blocks)
        for tier, blocks in route.overlap._asdict().items():
            self.overlap.labels(tier).observe(blocks)
            self.cached_blocks.labels(tier).inc(blocks)
        self._prompt += route.prompt_blocks
        self._cached += sum(route.overlap)
        self.hit_ratio.set(self._cached / self._prompt if self._prompt else 0.0)
        self.ttft_stage.labels("route").observe(route_seconds)

    def prefill_failed(self, worker: str, reason: str) -> None:
        self.prefill_failures.labels(worker, reason).inc()
        self.fallbacks.inc()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        server = self._server
        stats = ("batches", "replayed", "gaps", "unrecoverable_gaps", "restarts", "bad_frames")
        p = "kvpilot_router_"
        families = {
            s: CounterMetricFamily(f"{p}kv_event_{s}", f"KV-event {s} per worker", labels=["worker"]) for s in stats
        }
        rejected = CounterMetricFamily(p + "kv_events_rejected", "Malformed KV events skipped", labels=["worker", "reason"])
        blocks = GaugeMetricFamily(p + "index_blocks", "Blocks in the index", labels=["worker", "tier"])
        with server.lock:
            for sub in server.feeder.subscribers if server.feeder is not None else ():
                for s in stats:
                    families[s].add_metric([sub.worker], getattr(sub.stats, s))
                for reason, n in sub.decoder.rejections.items():
                    rejected.add_metric([sub.worker, reason.value], n)
            for worker in server.fleet.workers:
                for tier in server.config.index.tiers:
                    blocks.add_metric([worker.name, tier], server.index.block_count(worker.name, tier))
        yield from families.values()
        yield rejected
        yield blocks

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RouterServer:
    """Builds the aiohttp app around a :class:`~routing.router.Router`.

    ``feed_index`` starts one subscriber per worker with a KV-events endpoint
    at app startup (bound then) and stops them at cleanup.
    """

    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        tokenizer: PromptTokenizer,
        chat_template: ChatTemplate | None,
        *,
        feed_index: bool = True,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.lock = threading.Lock()
        self.index = BlockIndex(
            config.index.block_size, kv_group=config.index.kv_group,
            log_capacity=config.index.removal_log_capacity,
        )  # fmt: skip
        self.ledger = LoadLedger()
        policy = policy_from_config(config.disaggregation) if fleet.prefill else None
        sessions = SessionStore(config.index.block_size, config.sessions.max_sessions)
        self.router = Router(fleet, config, self.index, self.ledger, sessions, policy)
        self.feeder: IndexFeeder | None = None
        self._feed_index = feed_index
        self.metrics = RouterMetrics(self)
        self._http: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/debug/route", self._debug_route)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.server.request_timeout_s)
        self._http = aiohttp.ClientSession(timeout=timeout)
        if self._feed_index and any(w.kv_events_endpoint for w in self.fleet.workers):
            self.feeder = IndexFeeder(self.fleet, self.index, self.lock)
            self.feeder.start()

    async def _stop(self, _: web.Application) -> None:
        if self._http is not None:
            await self._http.close()
        if self.feeder is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.feeder.stop)

    # ---- small endpoints ---------------------------------------------------
    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": [w.name for w in self.fleet.workers]})

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": self.config.server.model_name, "object": "model", "owned_by": "kvpilot"}
        return web.json_response({"object": "list", "data": [model]})

    async def _metrics(self, _: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _debug_route(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            route, _, _ = self._route(request, body, "messages" in body, dry_run=True)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        return web.json_response(
            {
                "request_id": route.request_id,
                "kind": route.kind.value,
                "prefill_worker": route.prefill_worker.name,
                "decode_worker": route.decode.name,
                "prompt_tokens": route.prompt_tokens,
                "prompt_blocks": route.prompt_blocks,
                "cached_blocks": route.cached_blocks,
                "overlap": route.match.blocks,
                "explain": route.explain(),
            }
        )

    # ---- parsing and routing -------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.server.model_name:
            served = self.config.server.model_name
            raise BadRequest(f"'model' {model!r} is not served here (serving {served!r})", 404)
        _optional(body, "stream", bool, "true or false")
        _optional(body, "cache_salt", str, "a string")
        max_tokens = _optional(body, "max_tokens", int, "a positive integer")
        if max_tokens is not None and max_tokens <= 0:
            raise BadRequest("'max_tokens' must be a positive integer")
        return body

    def _route(
        self, request: web.Request, body: dict[str, Any], chat: bool, *, dry_run: bool = False
    ) -> tuple[Route, list[int], SessionId | None]:
        """Tokenize and decide (under the index lock); raises :class:`BadRequest`."""
        try:
            if chat:
                if self.chat_template is None:
                    raise BadRequest("this model has no chat template: use /v1/completions")
                token_ids = self.tokenizer.prompt_token_ids(self.chat_template.render(body.get("messages")))
            else:
                token_ids = self.tokenizer.prompt_token_ids(body.get("prompt"))
            session = session_key(body, request.headers)
        except (PromptError, ChatError, InvalidSessionKey) as exc:
            raise BadRequest(str(exc)) from None
        if not token_ids:
            raise BadRequest("the prompt renders to no tokens")
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        with self.lock:
            route = self.router.route(
                token_ids, request_id, cache_salt=body.get("cache_salt"), session=session, dry_run=dry_run
            )
        return route, token_ids, session

    # ---- the proxy ---------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            body = await self._body(request)
            engine_body = chat_to_completion_body(body) if chat else dict(body)
            route, engine_body["prompt"], session = self._route(request, body, chat)
        except (BadRequest, ChatError) as exc:
            return _error(getattr(exc, "status", 400), str(exc))
        rid, p, d = route.request_id, route.prefill_worker.name, route.decode.name
        try:
            self.ledger.dispatch(rid, p, d, route.prompt_blocks, route.cached_blocks)
        except ValueError:  # the ledger's "already active"
            return _error(409, f"X-Request-Id {rid!r} is already in flight")
        for key in ROUTER_ONLY_KEYS:
            engine_body.pop(key, None)
        self.metrics.decided(route, time.perf_counter() - started)
        try:
            kind = route.kind.value
            if route.prefill is not None:
                params = await self._prefill(route, engine_body)
                if params is None:
                    kind, p = "fallback", d
                else:
                    engine_body["kv_transfer_params"] = params
            headers = {"X-Request-Id": rid, "X-KVPilot-Route": kind,
                       "X-KVPilot-Prefill-Worker": p, "X-KVPilot-Decode-Worker": d}  # fmt: skip
            if engine_body.get("stream"):
                response = await self._stream(request, route, engine_body, chat, headers, started)
            else:
                response = await self._unary(route, engine_body, chat, headers)
            self.router.served(session, route)
            return response
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(exc.worker.name).inc()
            log.warning("request %s: %s", rid, exc)
            return _error(exc.status, str(exc), "upstream_error")
        finally:
            self.ledger.complete(rid)

    def _post(self, worker: Worker, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None) -> Any:
        """``POST {worker}/v1/completions`` (an async context manager)."""
        assert self._http is not None
        url = f"{worker.url}/v1/completions"
        return self._http.post(url, json=body, timeout=timeout or self._http.timeout)

    async def _prefill(self, route: Route, body: dict[str, Any]) -> dict[str, Any] | None:
        """P's kv_transfer_params, or None after a failure (then D prefills; counted)."""
        p = route.prefill
        assert p is not None
        pbody = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        pbody.pop("stream_options", None)
        started = time.perf_counter()
        reason = None
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.server.prefill_timeout_s)
            async with self._post(p, pbody, timeout) as resp:
                raw = await resp.read()
            if resp.status != 200:
                reason = f"status_{resp.status}"
            else:
                params = json.loads(raw).get("kv_transfer_params")
                if not isinstance(params, dict):
                    reason = "no_kv_transfer_params"
        except asyncio.TimeoutError:
            reason = "timeout"
        except aiohttp.ClientError:
            reason = "connection"
        except (ValueError, AttributeError):
            reason = "bad_response"
        if reason is not None:
            log.warning(
                "request %s: prefill on %s failed (%s); local prefill on %s",
                route.request_id, p.name, reason, route.decode.name,
            )  # fmt: skip
            self.metrics.prefill_failed(p.name, reason)
            self.ledger.fail(route.request_id)
            d = route.decode.name
            self.ledger.dispatch(route.request_id, d, d, route.prompt_blocks, route.decode_cached_blocks)
            return None
        self.ledger.first_token(route.request_id)
        self.metrics.ttft_stage.labels("prefill").observe(time.perf_counter() - started)
        return params

    async def _unary(
        self, route: Route, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> web.Response:
        d = route.decode
        try:
            async with self._post(d, body) as resp:
                raw = await resp.read()
        except asyncio.TimeoutError:
            raise UpstreamError(d, 504, "timed out") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(d, 502, f"unreachable: {exc}") from None
        if resp.status != 200:
            raise _answered(d, resp.status, raw)
        try:
            payload = json.loads(raw)
            if chat:
                payload = chat_response(payload, route.request_id)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UpstreamError(d, 502, f"sent an unreadable completion: {exc}") from None
        return web.json_response(payload, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        route: Route,
        body: dict[str, Any],
        chat: bool,
        headers: dict[str, str],
        started: float,
    ) -> web.StreamResponse:
        d = route.decode
        sent_at = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            try:
                upstream = await stack.enter_async_context(self._post(d, body))
            except asyncio.TimeoutError:
                raise UpstreamError(d, 504, "timed out") from None
            except aiohttp.ClientError as exc:
                raise UpstreamError(d, 502, f"unreachable: {exc}") from None
            if upstream.status != 200:
                raise _answered(d, upstream.status, await upstream.read())
            sse = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            out = web.StreamResponse(headers={**headers, **sse})
            await out.prepare(request)
            first = True
            try:
                async for data in _sse_data(upstream.content):
                    if first:
                        now = time.perf_counter()
                        self.metrics.ttft_stage.labels("decode_first_token").observe(now - sent_at)
                        self.metrics.ttft.observe(now - started)
                        self.ledger.first_token(route.request_id)
                    if chat and data != "[DONE]":
                        data = json.dumps(chat_chunk(json.loads(data), route.request_id, first))
                    first = False
                    await out.write(f"data: {data}\n\n".encode())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
                self.metrics.upstream_errors.labels(d.name).inc()
                message = f"engine {d.name} ({d.url}): stream broke: {exc!r}"
                error = {"error": {"message": message, "type": "upstream_error", "code": 502}}
                await out.write(f"data: {json.dumps(error)}\n\n".encode())
            await out.write_eof()
            return out


def _answered(worker: Worker, status: int, raw: bytes) -> UpstreamError:
    """An engine's non-200 answer: its 4xx kept for the client, anything else a 502."""
    detail = f"answered {status}: {raw[:500].decode(errors='replace')}"
    return UpstreamError(worker, status if 400 <= status < 500 else 502, detail)


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
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


def build_server(config: RouterConfig, fleet: Fleet, *, feed_index: bool = True) -> RouterServer:
    """A server for ``config`` reading ``server.model_dir`` (tokenizer and chat template)."""
    model_dir = Path(config.server.model_dir)
    template = ChatTemplate.from_model_dir(model_dir)
    return RouterServer(config, fleet, PromptTokenizer(model_dir), template, feed_index=feed_index)
