"""The engines' limits as the engines state them, settled against the config before the
router routes: vLLM's ``GET /v1/models`` lists each served model with its
``max_model_len`` (``ModelCard.max_model_len``), which the router reads from every engine.

- Engines that disagree are refused, naming each engine and its length: one router checks
  every request against one length.
- ``server.max_model_len`` set and equal to what the engines state is kept; set and
  different, refused (a config that disagrees with the engines is a mistake either way).
- Nothing stated (no engine reachable, or none that lists the model with a length) leaves
  ``server.max_model_len``; with that 0 as well, the length checks would be off, and the
  router refuses to start unless ``server.allow_unchecked_lengths`` says so.

vLLM 0.32 does not state ``max_logprobs`` on any endpoint: it stays ``server.max_logprobs``,
which ``kvpilot fleet up`` takes from the engines' ``--max-logprobs``. Beside Dynamo the
router asks the frontend's ``/v1/models`` the same question.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence

import aiohttp

from kvpilot.routing.config import ConfigError, ServerConfig
from kvpilot.routing.serve.engine_checks import EngineLimits

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"
PROBE_TIMEOUT_S = 5.0


class EngineLimitsError(ConfigError):
    """The engines' limits and the router's config cannot be settled (module doc)."""


def settled_max_model_len(configured: int, stated: Mapping[str, int | None], *, allow_unchecked: bool) -> int:
    """The ``max_model_len`` the router checks requests against, from ``configured``
    (``server.max_model_len``, 0: unset) and what each engine ``stated`` (by URL; ``None``:
    nothing). Raises :class:`EngineLimitsError` when engines disagree, when the config
    disagrees with them, or when nothing is known and ``allow_unchecked`` is false; returns
    0 (no length checked) only when it is true. Pure."""
    known = {url: length for url, length in stated.items() if length}
    lengths = set(known.values())
    if len(lengths) > 1:
        each = ", ".join(f"{url}: {length}" for url, length in sorted(known.items()))
        raise EngineLimitsError("server.max_model_len", f"the engines disagree on max_model_len ({each})")
    if lengths:
        (length,) = lengths
        if configured and configured != length:
            raise EngineLimitsError(
                "server.max_model_len",
                f"is {configured}, but the engines state {length} ({', '.join(sorted(known))}); "
                "set it to theirs or leave it unset",
            )
        return length
    if configured or allow_unchecked:
        return configured
    raise EngineLimitsError(
        "server.max_model_len",
        f"unknown: no engine stated it on {MODELS_PATH} ({', '.join(sorted(stated)) or 'no engines'}) and it is "
        "not set, so vLLM's length checks would be off at the router; set it to the engines' "
        "--max-model-len, or set server.allow_unchecked_lengths: true to leave lengths to the engines",
    )


def stated_max_model_len(listing: object, model_name: str) -> int | None:
    """``max_model_len`` of ``model_name`` in a ``/v1/models`` answer (``None``: not listed,
    or listed without one). Pure."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for card in data if isinstance(data, list) else ():
        if isinstance(card, dict) and card.get("id") == model_name:
            length = card.get("max_model_len")
            return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
    return None


async def read_max_model_len(
    http: aiohttp.ClientSession, url: str, headers: Mapping[str, str], model_name: str
) -> int | None:
    """What the engine at ``url`` states for ``model_name`` on ``/v1/models``; ``None`` (logged)
    when it cannot be reached, answers other than 200, or states nothing."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    try:
        async with http.get(f"{url}{MODELS_PATH}", headers=dict(headers), timeout=timeout) as resp:
            if resp.status != 200:
                log.warning("%s%s answered %d: max_model_len not learned from it", url, MODELS_PATH, resp.status)
                return None
            listing = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.warning("%s%s: %r; max_model_len not learned from it", url, MODELS_PATH, exc)
        return None
    length = stated_max_model_len(listing, model_name)
    if length is None:
        log.warning("%s%s states no max_model_len for %r", url, MODELS_PATH, model_name)
    return length


async def learned_limits(
    http: aiohttp.ClientSession,
    urls: Sequence[str],
    headers: Mapping[str, str],
    server: ServerConfig,
    limits: EngineLimits,
) -> EngineLimits:
    """``limits`` with ``max_model_len`` settled (:func:`settled_max_model_len`) from what
    the engines at ``urls`` state; raises :class:`EngineLimitsError`."""
    unique = sorted(set(urls))
    stated = await asyncio.gather(*(read_max_model_len(http, u, headers, server.model_name) for u in unique))
    length = settled_max_model_len(
        server.max_model_len, dict(zip(unique, stated, strict=True)), allow_unchecked=server.allow_unchecked_lengths
    )
    if not length:
        log.warning("max_model_len unknown: lengths are left to the engines (server.allow_unchecked_lengths)")
    return dataclasses.replace(limits, max_model_len=length)
