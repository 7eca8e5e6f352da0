"""The one fake vLLM engine of the unit tests (vLLM itself is tested end to end in
tests/e2e; these tests need engines that fail, hang or answer thousands at once on
demand): an OpenAI completions and chat completions server with knobs that records every
body it gets and counts its scrapes, :func:`serving` to run it beside blocking callers, and a
word-level tokenizer directory for the router."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers

PROMPT_WORDS = [
    "[UNK]",
    "<|",
    "|>",
    "user",
    "assistant",
    "system",
    "end",
    "hello",
    "world",
    "the",
    "repo",
    "fix",
    "bug",
]
VOCAB_SIZE = 2048
"""Every token id below this is in :func:`word_model_dir`'s vocabulary: :data:`PROMPT_WORDS`
first, then filler words ``w13`` ... ``w2047``, so that prompts of raw token ids fit too."""
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def word_model_dir(path: Path) -> Path:
    """Write a word-level tokenizer.json (:data:`VOCAB_SIZE` ids, :data:`PROMPT_WORDS`
    first) and a tokenizer_config.json with a chat template into ``path``; returns it."""
    words = [*PROMPT_WORDS, *(f"w{i}" for i in range(len(PROMPT_WORDS), VOCAB_SIZE))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "hello"}))
    return path


@dataclass
class FakeEngine:
    """An OpenAI completions server with knobs; ``bodies`` records what it got and
    ``scrapes`` counts the GETs of its ``/metrics``."""

    name: str
    status: int = 200
    delay_s: float = 0.0
    token_delay_s: float = 0.0
    """Pause after each streamed chunk (a decode step)."""
    kv_params: bool = True
    metrics_text: str | Callable[[int], str] | None = None
    """What ``/metrics`` answers, or a function of the scrape's number (1, 2, ...)
    for counters that move; ``None``: 404."""
    session_offer: dict[str, Any] | None = None
    """What a decode answer returns as kv_transfer_params (vLLM's bidirectional mode)."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    """Top-level keys added to every answer and streamed chunk."""
    split_at: str | None = None
    """Each streamed event that names this text is written in two pieces, split inside it, 50 ms
    apart: an event that reaches the next hop in two reads."""
    api_key: str | None = None
    """Like vLLM's ``--api-key``: ``/v1`` requests without ``Bearer <key>`` get a 401."""
    max_model_len: int | None = 4096
    """What ``/v1/models`` states for every model it lists, as vLLM's ``ModelCard`` does;
    ``None``: the card carries none."""
    models: tuple[str, ...] = ("tiny",)
    """The model names ``/v1/models`` lists."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    scrapes: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    """The headers of each completions request, in order."""
    paths: list[str] = field(default_factory=list)
    """The path of each completions request, in order."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        cards = [{"id": name, "object": "model", "max_model_len": self.max_model_len} for name in self.models]
        return web.json_response({"object": "list", "data": cards})

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.metrics_text is None:
            return web.Response(status=404)
        text = self.metrics_text if isinstance(self.metrics_text, str) else self.metrics_text(self.scrapes)
        return web.Response(text=text)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.paths.append(request.path)
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} is broken"}}, status=self.status)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"] if chat else body["prompt"]
        text = f"{self.name}:{len(prompt.split()) if isinstance(prompt, str) else len(prompt)}"
        lp = {
            "tokens": [" a"],
            "token_logprobs": [-0.5],
            "top_logprobs": [{" a": -0.5, " b": -1.0}],
            "text_offset": [0],
        }
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": lp if body.get("logprobs") else None,
            "finish_reason": "length",
            **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
        }
        payload: dict[str, Any] = {
            "id": "chatcmpl-x" if chat else "cmpl-x",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": "tiny",
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt)},
            **self.extra_fields,
        }
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and self.kv_params:
            payload["kv_transfer_params"] = {"remote_engine_id": self.name, "remote_block_ids": [1, 2]}
        elif self.session_offer is not None:
            payload["kv_transfer_params"] = self.session_offer
        if not body.get("stream"):
            return web.json_response(payload)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in ("x", "y"):
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            chunk = {**payload, "choices": [{**choice, **delta, "finish_reason": None}]}
            event = f"data: {json.dumps(chunk)}\n\n".encode()
            at = -1 if self.split_at is None else event.find(self.split_at.encode())
            if at >= 0:
                at += len(self.split_at or "") // 2
                await out.write(event[:at])
                await asyncio.sleep(0.05)
                event = event[at:]
            await out.write(event)
            await asyncio.sleep(self.token_delay_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@contextmanager
def serving(engine: FakeEngine) -> Iterator[str]:
    """Serve ``engine`` on a free 127.0.0.1 port from an event loop in a thread of its
    own, for callers that block (urllib); yields its URL and stops it on exit."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(engine.app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, name=f"fake-engine-{engine.name}", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
