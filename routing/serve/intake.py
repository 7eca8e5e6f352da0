"""A request's way in, before the proxy: its body checked, its prompt's token ids computed as
the engine will compute them (:mod:`kvpilot.routing.serve.prompt`), its session taken from the
shared store, routed and held against ``server.ttft_slo_s``. The engines
are sent the client's body as it came, less the session fields the router reads.

Whatever vLLM would refuse is refused here, with vLLM's message, before P prefills
(:mod:`kvpilot.routing.serve.engine_checks`, against :class:`EngineLimits` read once from
``server`` and the model's files). A prompt is tokenized off the event loop (a 4 MiB text
took seconds to tokenize on the router's one loop), and only once its size in characters
is within what ``server.max_model_len`` or ``server.max_prompt_tokens`` tokens can hold.

:class:`RequestIntake` serves both fronts: the router's own HTTP handlers
(:mod:`kvpilot.routing.serve.app`) and Envoy's picker (:mod:`kvpilot.routing.gateway.picker`).
Every refusal is a :class:`~kvpilot.routing.refusals.BadRequest` naming the problem
(400 unless it says otherwise; counted by reason in ``kvpilot_router_rejected_total``), a
:class:`~kvpilot.routing.serve.chat.ChatError`, or a
:class:`~kvpilot.routing.serve.admission.Rejected` for a predicted TTFT over the SLO.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.routing.config import RouterConfig, ServerConfig
from kvpilot.routing.decide.rates import TTFTPrediction
from kvpilot.routing.decide.router import NoHealthyWorker, Route, Router
from kvpilot.routing.decide.sessions import SESSION_FIELDS, InvalidSessionKey, scoped, session_key
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.metrics.router_metrics import RouterMetrics
from kvpilot.routing.refusals import BadRequest, RejectReason
from kvpilot.routing.serve.admission import check_ttft_slo
from kvpilot.routing.serve.chat import ChatError
from kvpilot.routing.serve.driver import ProxyRequest
from kvpilot.routing.serve.engine_checks import EngineLimits, check_fields, check_sampling, check_text
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.request_fields import NVEXT, agent_hints, checked_body
from kvpilot.routing.serve.tokenizer import PromptError
from kvpilot.routing.serve.truncation import truncation_of
from kvpilot.routing.serve.upstream import Api, EngineRequest
from kvpilot.routing.state.sync import SessionSync


@dataclass(frozen=True, slots=True)
class Intake:
    """A request routed by :meth:`RequestIntake.take`: what the proxy serves, and the
    client's checked body (its session fields and messages as sent)."""

    request: ProxyRequest
    client_body: dict[str, Any]


class RequestIntake:
    """Checks, tokenizes and routes requests for ``router`` (module doc). ``prompts``
    computes a prompt's token ids (``None``: a router that tokenizes nothing, as the
    simulator's, which routes the token ids it is handed: a client's request is a 503);
    ``watch_events`` refreshes which workers' KV events stopped before each decision;
    ``predict`` is the proxy's predicted TTFT of a route."""

    def __init__(
        self,
        config: RouterConfig,
        router: Router,
        metrics: RouterMetrics,
        prompts: EnginePrompt | None,
        session_sync: SessionSync | None,
        watch_events: Callable[[], None],
        predict: Callable[[Route], TTFTPrediction | None],
    ) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.prompts = prompts
        self.session_sync = session_sync
        self.watch_events = watch_events
        self.predict = predict
        self.limits = engine_limits(config.server)

    def body_too_large(self) -> BadRequest:
        """The 413 for a body over ``server.max_body_bytes``, counted."""
        self.metrics.rejected.labels(RejectReason.BODY_TOO_LARGE.value).inc()
        return BadRequest(f"request body is over server.max_body_bytes ({self.config.server.max_body_bytes})", 413)

    def checked_body(self, raw: bytes, api: Api | None) -> dict[str, Any]:
        """``raw`` parsed and checked (:func:`kvpilot.routing.serve.request_fields.checked_body`);
        raises :class:`BadRequest`, a refusal with a reason counted in
        ``kvpilot_router_rejected_total``."""
        srv = self.config.server
        try:
            return checked_body(raw, api, model_name=srv.model_name, max_output_tokens=srv.max_output_tokens)
        except BadRequest as exc:
            if exc.reason is not None:
                self.metrics.rejected.labels(exc.reason.value).inc()
            raise

    def prompt(self, headers: Mapping[str, str], body: dict[str, Any], api: Api) -> tuple[list[int], SessionId | None]:
        """The prompt's token ids, as the engine computes them, and the request's session,
        once the request passes vLLM's checks (module doc); raises :class:`BadRequest`
        (counted by its reason). Blocking: a long prompt takes the tokenizer's time."""
        try:
            return self._prompt(headers, body, api)
        except BadRequest as exc:
            if exc.reason is not None:
                self.metrics.rejected.labels(exc.reason.value).inc()
            raise

    async def tokenized(
        self, headers: Mapping[str, str], body: dict[str, Any], api: Api
    ) -> tuple[list[int], SessionId | None]:
        """:meth:`prompt`, in a worker thread when it needs the tokenizer (text or a chat), so
        that no prompt holds up the event loop. Token ids are checked here, on the loop: their
        check is one numpy pass, and a thread hop per request would make the event loop and the
        worker thread contend for the GIL on every request."""
        prompt = body.get("prompt")
        if api is Api.COMPLETIONS and isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self.prompt(headers, body, api)
        return await asyncio.to_thread(self.prompt, headers, body, api)

    def _prompt(self, headers: Mapping[str, str], body: dict[str, Any], api: Api) -> tuple[list[int], SessionId | None]:
        if self.prompts is None:
            raise BadRequest("this router has no tokenizer (server.model_dir): it takes no client's prompt", 503)
        limit = self.config.server.max_prompt_tokens
        try:
            check_fields(body, api, self.limits)
            limits = self.limits
            truncation = truncation_of(
                body, api, max_model_len=limits.max_model_len, max_chars_per_token=limits.max_chars_per_token
            )
            key = session_key(body, headers)
            session = None if key is None else scoped(key, body.get("cache_salt"))
            token_ids = self.prompts.token_ids(  # a session's step tokenized from its last prompt on
                api,
                body,
                truncation=truncation,
                before_encoding=lambda text: self._check_chars(text, body),
                session=session,
            )
        except (PromptError, ChatError, InvalidSessionKey) as exc:
            raise BadRequest(str(exc)) from None
        if not token_ids:
            raise BadRequest("the prompt renders to no tokens")
        from_text = api is Api.CHAT or isinstance(body.get("prompt"), str)
        check_sampling(body, api, len(token_ids), self.limits, from_text=from_text)  # vLLM's refusal first
        if limit and len(token_ids) > limit:
            raise BadRequest(
                f"the prompt has {len(token_ids)} tokens, over server.max_prompt_tokens ({limit})",
                reason=RejectReason.PROMPT_TOO_LONG,
            )
        return token_ids, session

    def _check_chars(self, text: str, body: Mapping[str, Any]) -> None:
        """Before tokenizing: vLLM's bound on the text, then the router's own for
        ``server.max_prompt_tokens`` (as many characters as that many of the longest token);
        neither for a request that truncates its prompt (vLLM tokenizes it whole)."""
        check_text(len(text), body, self.limits)
        limit, widest = self.config.server.max_prompt_tokens, self.limits.max_chars_per_token
        truncated = body.get("truncate_prompt_tokens") is not None
        if limit and widest and not truncated and len(text) > limit * widest:
            raise BadRequest(
                f"the prompt has {len(text)} characters, more than server.max_prompt_tokens ({limit}) "
                f"tokens of at most {widest} characters can hold",
                reason=RejectReason.PROMPT_TOO_LONG,
            )

    async def pull_session(self, session: SessionId | None) -> None:
        """Take the shared store's record of ``session`` when it is newer than this router's
        view (bounded by ``sessions.store_read_timeout_s``; a store outage routes on the local view)."""
        if session is not None and self.session_sync is not None:
            await self.session_sync.pull(session)

    def route(
        self,
        headers: Mapping[str, str],
        token_ids: list[int],
        body: dict[str, Any],
        api: Api,
        session: SessionId | None,
        *,
        dry_run: bool = False,
        exclude: frozenset[WorkerId] = frozenset(),
        timed: bool = True,
    ) -> Route:
        """Decide where ``token_ids`` go (``dry_run``: see
        :meth:`~kvpilot.routing.decide.router.Router.route`), its time counted in
        ``kvpilot_router_decision_seconds`` when ``timed``; raises :class:`BadRequest`."""
        prefix = "chatcmpl" if api is Api.CHAT else "cmpl"
        request_id = headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        self.watch_events()
        started = time.perf_counter()
        try:
            route = self.router.route(
                token_ids,
                request_id,
                cache_salt=body.get("cache_salt"),
                session=session,
                dry_run=dry_run,
                now=time.time(),
                exclude=exclude,
            )
        except NoHealthyWorker as exc:
            raise BadRequest(str(exc), 503) from None
        if timed:
            self.metrics.decision.observe(time.perf_counter() - started)
        return route

    async def take(
        self, headers: Mapping[str, str], body: dict[str, Any], api: Api, started: float, client: str | None = None
    ) -> Intake:
        """A checked ``body`` (:meth:`checked_body`) sent to ``api`` by ``client`` (its address as
        the front saw it, ``None``: unknown), its token ids computed, its session taken from the
        shared store, routed once and checked against ``server.ttft_slo_s``: a session's step is
        decided on a dry run and committed only once it meets the SLO
        (:meth:`~kvpilot.routing.decide.router.Router.commit`), so that a refused step leaves the
        session as it was. Raises :class:`BadRequest` or :class:`ChatError` (400 unless they
        say otherwise), or :class:`~kvpilot.routing.serve.admission.Rejected` for a predicted
        TTFT over the SLO."""
        slo_s = self.config.server.ttft_slo_s
        token_ids, session = await self.tokenized(headers, body, api)
        await self.pull_session(session)
        checked_first = bool(slo_s) and session is not None
        route = self.route(headers, token_ids, body, api, session, dry_run=checked_first)
        prediction = self.predict(route) if slo_s else None
        if prediction is not None:
            check_ttft_slo(prediction, slo_s)
        if checked_first:
            self.router.commit(route, token_ids, session=session, now=time.time(), cache_salt=body.get("cache_salt"))
        engine_body = {k: v for k, v in body.items() if k not in SESSION_FIELDS and k != NVEXT}

        def reroute(exclude: frozenset[WorkerId]) -> Route | None:
            try:
                return self.route(headers, token_ids, body, api, session, exclude=exclude)
            except BadRequest:
                return None

        engine = EngineRequest(api, engine_body, token_ids, agent_hints(body))
        return Intake(ProxyRequest(route, engine, session, started, reroute, client), body)


def engine_limits(server: ServerConfig) -> EngineLimits:
    """The engines' limits as the router knows them: ``server.max_model_len`` and
    ``server.max_logprobs``, the vocabulary of the model's ``config.json`` (``vocab_size``,
    or its ``text_config``'s) and the longest token of its ``tokenizer.json``. A file that is
    missing or unreadable leaves its checks to the engines (0 in :class:`EngineLimits`)."""
    model_dir = Path(server.model_dir) if server.model_dir else None
    return EngineLimits(
        max_model_len=server.max_model_len,
        max_logprobs=server.max_logprobs,
        vocab_size=_vocab_size(model_dir) if model_dir else 0,
        max_chars_per_token=_max_chars_per_token(model_dir) if model_dir else 0,
    )


def _vocab_size(model_dir: Path) -> int:
    """vLLM's ``ModelConfig.get_vocab_size()``: ``config.json``'s ``vocab_size`` (a
    multimodal model's in its ``text_config``); 0 when unreadable."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else 0


def _max_chars_per_token(model_dir: Path) -> int:
    """vLLM's ``max_chars_per_token``: the longest token of the vocabulary, in characters
    (the tokenizer's own vocabulary with its added tokens); 0 when there is no tokenizer.json."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return 0
    return max(map(len, Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)), default=0)
