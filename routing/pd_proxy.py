"""The walking skeleton's router: prefill on P, then decode on D, over HTTP.

For each ``/v1/completions`` request it tokenizes the prompt once, sends the token
ids to a prefill engine with ``max_tokens=1`` and ``kv_transfer_params =
{"do_remote_decode": true}``, then sends the same token ids and P's returned
kv_transfer_params to a decode engine, whose answer (streamed or not) goes back to
the client. Engines are picked round-robin. With no prefill engines it sends each
request to a co-located engine directly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from routing.tokenizer import PromptError, PromptTokenizer

PREFILL_SECONDS_HEADER = "X-KVPilot-Prefill-Seconds"


class PDProxy:
    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], tokenizer: PromptTokenizer, model_name: str
    ) -> None:
        if not decode_urls:
            raise ValueError("at least one decode (or co-located) engine URL is required")
        self._prefill = itertools.cycle(prefill_urls) if prefill_urls else None
        self._decode = itertools.cycle(decode_urls)
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def _stop(self, _: web.Application) -> None:
        assert self._session is not None
        await self._session.close()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self._model_name, "object": "model", "owned_by": "kvpilot"}]}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise PromptError("request body must be a JSON object")
            body["prompt"] = self._tokenizer.prompt_token_ids(body.get("prompt"))
        except (PromptError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        assert self._session is not None
        prefill_seconds = 0.0
        if self._prefill is not None:
            started = time.perf_counter()
            prefill_body = {
                **body,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            prefill_body.pop("stream_options", None)
            url = next(self._prefill)
            async with self._session.post(f"{url}/v1/completions", json=prefill_body) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    return _error(502, f"prefill engine {url} answered {resp.status}: {payload}")
            body["kv_transfer_params"] = payload.get("kv_transfer_params")
            prefill_seconds = time.perf_counter() - started
        return await self._relay(request, next(self._decode), body, prefill_seconds)

    async def _relay(
        self, request: web.Request, url: str, body: dict[str, Any], prefill_seconds: float
    ) -> web.StreamResponse:
        assert self._session is not None
        async with self._session.post(f"{url}/v1/completions", json=body) as resp:
            headers = {PREFILL_SECONDS_HEADER: f"{prefill_seconds:.6f}"}
            if not body.get("stream"):
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type="application/json", headers=headers
                )
            out = web.StreamResponse(status=resp.status, headers={**headers, "Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvpilot P->D proxy")
    parser.add_argument("--prefill", action="append", default=[], help="prefill engine base URL (repeatable)")
    parser.add_argument("--decode", action="append", default=[], help="decode or co-located engine URL (repeatable)")
    parser.add_argument("--model-dir", type=Path, required=True, help="model directory holding tokenizer.json")
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    proxy = PDProxy(args.prefill, args.decode, PromptTokenizer(args.model_dir), args.model_name)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
