"""Each (P, D) pair's first KV handoff, done by ``fleet up`` before it reports ready.

vLLM's NixlConnector connects a pair on its first transfer: D's worker fetches P's
NIXL agent metadata over P's side channel and loads it while D's request waits
(vLLM 0.32's ``nixl/pull_worker.py`` starts ``_background_nixl_handshake``). On a fresh fleet that cost
landed on the first client request (issue 20: ``make demo``'s first request went
``fallback`` at 38.5 s TTFT). :func:`warm_up_pair` does one handoff per pair with
vLLM's own P->D protocol, straight to the engines (the router is not up yet, and
it picks pairs by cost, not one of each): P prefills a prompt of
:data:`PROMPT_BLOCKS` full blocks with ``max_tokens=1`` and
:func:`~kvpilot.kvconnectors.pull_params.handoff_request`, D completes the same prompt with
P's returned params. It has succeeded when D counts prompt tokens received over
the transfer (``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``);
a handoff that D recomputed instead (the pull failed) is tried again under a new
``cache_salt``, until the deadline. Each try's prompt is salted afresh, so it
reuses nothing either engine holds; its blocks do reach the router's index (the
engines publish them as KV events), under a salt no client sends.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from kvpilot.deploy.metrics import delta, scrape, settled
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.vllm_metrics import PROMPT_TOKENS_BY_SOURCE, PromptTokenSource

PROMPT_BLOCKS = 2
"""Full blocks in the warm-up prompt: KVPilotConnector moves verified full blocks only
(a partial last block is recomputed), so a prompt under one block moves nothing."""
RETRY_PAUSE_S = 1.0


class PairWarmUpError(RuntimeError):
    """A pair's handoff did not move KV before the deadline; the message says what the
    last try saw."""


def _post(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} from {url}: {exc.read()[:300].decode(errors='replace')}") from None
    return answer


def _handoff(prefill_url: str, decode_url: str, model: str, block_size: int, api_key: str | None) -> str | None:
    """One P->D handoff; ``None`` when D received KV over the transfer, else what went
    wrong. Raises ``OSError`` when an engine does not answer."""
    prompt = [100 + i % 100 for i in range(PROMPT_BLOCKS * block_size + 1)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "cache_salt": uuid.uuid4().hex}
    timeout = 120.0
    answer = _post(prefill_url, {**body, "kv_transfer_params": handoff_request()}, api_key, timeout)
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        return f"P answered without kv_transfer_params: {json.dumps(answer)[:200]}"
    before = scrape(decode_url)
    _post(decode_url, {**body, "kv_transfer_params": params}, api_key, timeout)
    received = delta(
        settled(decode_url, before),
        before,
        PROMPT_TOKENS_BY_SOURCE.total,
        source=PromptTokenSource.EXTERNAL_KV_TRANSFER.value,
    )
    if received <= 0:
        return "D recomputed the prompt: no token's KV came over the transfer (see D's log)"
    return None


def warm_up_pair(
    prefill: str,
    prefill_url: str,
    decode: str,
    decode_url: str,
    *,
    model: str,
    block_size: int,
    deadline: float,
    api_key: str | None = None,
) -> int:
    """Hand a prompt from ``prefill`` to ``decode`` until D receives its KV over NIXL
    (the module doc says how), trying again until ``deadline`` (``time.monotonic()``).
    Returns how many tries it took; raises :class:`PairWarmUpError` naming the pair and
    the last try's failure when none succeeded by then."""
    tries, failure = 0, "no try before the deadline"
    while True:
        tries += 1
        try:
            outcome = _handoff(prefill_url, decode_url, model, block_size, api_key)
        except OSError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        if outcome is None:
            return tries
        failure = outcome
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            raise PairWarmUpError(
                f"the first KV handoff {prefill} -> {decode} did not succeed in {tries} tries: {failure}"
            )
        time.sleep(RETRY_PAUSE_S)
