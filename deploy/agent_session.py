"""Drive one agent session across a P and a D engine directly, as vLLM's
``disagg_proxy_multiturn.py`` example does (article sections 5 and 9.2-9.4).

Turn k: P prefills the history and hands it to D (P's params carry the handoff);
D generates the next tool call and returns its end-of-turn kv_transfer_params,
which in vLLM's bidirectional mode offer D's KV of the whole session. Turn k+1
starts on P with the history as the client resends it and D's params: P may pull
D's KV back. :func:`prefill_then_decode` is the P->D proxy itself, the one the
e2e tests and every benchmark use; talks HTTP only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvpilot.deploy.client import Completion, Prompt, complete
from kvpilot.kvconnectors.pull_params import handoff_request


@dataclass(frozen=True)
class DecodedTurn:
    """What D produced in one turn, and the params that offer its KV to P."""

    prompt: list[int]
    generated: list[int]
    d_params: dict[str, Any]
    d_params_at: float
    """Unix time at which D returned ``d_params``."""


@dataclass(frozen=True)
class Handoff:
    """One prompt through the P->D proxy: P's prefill answer, then D's."""

    p: Completion
    d: Completion


def prefill_then_decode(
    p_url: str,
    d_url: str,
    prompt: Prompt,
    generated: int,
    timeout: float = 300.0,
    p_params: dict[str, Any] | None = None,
    **extra: Any,
) -> Handoff:
    """The P->D proxy: P prefills ``prompt`` (token ids, or chat messages sent to both
    engines' chat endpoint; ``max_tokens=1``) with ``p_params``
    (default: vLLM's plain handoff; D's end-of-turn params let P pull D's KV first); D
    generates ``generated`` tokens (greedy, ``ignore_eos``, token ids returned) with
    the params P returned, or prefills the prompt itself if P returned none.
    ``extra`` (e.g. ``cache_salt``) goes into both requests. Raises what
    :func:`~kvpilot.deploy.client.complete` raises."""
    params = handoff_request() if p_params is None else p_params
    p = complete(p_url, prompt, max_tokens=1, kv_transfer_params=params, timeout=timeout, **extra)
    d_extra = {**extra, "kv_transfer_params": p.kv_transfer_params} if p.kv_transfer_params else extra
    d = complete(
        d_url, prompt, max_tokens=generated, ignore_eos=True, return_token_ids=True, timeout=timeout, **d_extra
    )
    return Handoff(p, d)


def decoded_turn(
    p_url: str, d_url: str, prompt: list[int], generated: int, timeout: float = 300.0, **extra: Any
) -> DecodedTurn:
    """P prefills ``prompt`` for D; D pulls it and generates ``generated`` tokens
    (:func:`prefill_then_decode`). Raises if D returns no session offer."""
    d = prefill_then_decode(p_url, d_url, prompt, generated, timeout, **extra).d
    at = time.time()
    if not (d.kv_transfer_params and d.kv_transfer_params.get("do_remote_decode")):
        raise RuntimeError(f"D returned no session offer (is bidirectional_kv_xfer on?): {d.kv_transfer_params}")
    if len(d.token_ids) != generated:
        raise RuntimeError(f"D generated {len(d.token_ids)} tokens, asked for {generated}")
    return DecodedTurn(prompt, list(d.token_ids), d.kv_transfer_params, at)


def prefill_next_turn(
    p_url: str, prompt: list[int], d_params: dict[str, Any] | None, timeout: float = 300.0, **extra: Any
) -> Completion:
    """The next turn's prefill on P: with D's params P may pull D's KV of the
    session; with ``None`` it prefills beyond its own cache. ``max_tokens=1``, so the
    completion's latency is P's time to first token."""
    params = handoff_request() if d_params is None else d_params
    return complete(p_url, prompt, max_tokens=1, kv_transfer_params=params, timeout=timeout, **extra)
