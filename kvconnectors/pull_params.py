"""vLLM's NIXL pull fields in kv_transfer_params: when a request asks for a remote
pull, and whether the fields the pull would use are well-formed.

vLLM's NixlConnector trusts these fields: a string where a port belongs, or
``do_remote_prefill`` without block ids, fails deep in its worker or trips an
assertion that stops the engine. kvpilot checks them first and serves a malformed
request by local prefill instead. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

_REQUIRED_STR = ("remote_engine_id", "remote_request_id", "remote_host")
_PULL_FIELDS = ("remote_block_ids", *_REQUIRED_STR, "remote_port")
_OPTIONAL_POSITIVE_INT = ("tp_size", "dcp_size", "pp_size", "remote_block_size")
_OPTIONAL_NON_NEGATIVE_INT = ("remote_num_tokens",)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


PULL_DONE_KEY = "_remote_blocks_processed"
"""Set by vLLM's NIXL scheduler once it has planned a request's pull (the first time
the request is allocated blocks); later passes over the request pull nothing."""


def handoff_request() -> dict[str, Any]:
    """The kv_transfer_params a router sends P with its one-token prefill so that P
    keeps the prompt's KV for D (vLLM's P->D protocol); P answers with the params
    D pulls with. A fresh dict each call: callers add to it."""
    return {"do_remote_decode": True}


def offers_blocks(params: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether an engine's returned kv_transfer_params offer blocks to a peer: D's
    end-of-turn offer of a session's KV in bidirectional mode, or P's handoff."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode")) and bool(params.get("remote_block_ids"))


def wants_remote_pull(params: Mapping[str, Any] | None) -> bool:
    """Whether the inner connector would try to load blocks from a peer for these
    params: a P->D handoff (``do_remote_prefill``), or a pull of the peer's blocks
    on the prefill side in bidirectional mode (``do_remote_decode`` with
    ``remote_block_ids``, not yet processed)."""
    if not isinstance(params, Mapping):
        return False
    if params.get("do_remote_prefill"):
        return True
    return bool(params.get("do_remote_decode") and params.get("remote_block_ids") and not params.get(PULL_DONE_KEY))


def pull_fields_error(params: Mapping[str, Any]) -> str | None:
    """The name of the first malformed pull field, with what is wrong; ``None`` if
    every field the pull uses is well-formed."""
    block_ids = params.get("remote_block_ids")
    # Lists once they crossed a process in JSON; tuples as NixlConnector builds them in-process.
    if not isinstance(block_ids, (list, tuple)) or not block_ids:
        return "remote_block_ids (expected a non-empty list of per-group block id lists)"
    for group in block_ids:
        if not isinstance(group, (list, tuple)) or not all(_is_int(b) and b >= 0 for b in group):
            return "remote_block_ids (each group must be a list of non-negative ints)"
    if not any(block_ids):
        return "remote_block_ids (every group is empty)"
    for name in _REQUIRED_STR:
        value = params.get(name)
        if not isinstance(value, str) or not value:
            return f"{name} (expected a non-empty string)"
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        return "remote_port (expected an int in 1..65535)"
    for name in _OPTIONAL_POSITIVE_INT:
        value = params.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            return f"{name} (expected a positive int)"
    for name in _OPTIONAL_NON_NEGATIVE_INT:
        value = params.get(name)
        if value is not None and (not _is_int(value) or value < 0):
            return f"{name} (expected a non-negative int)"
    return None


def strip_pull_fields(params: dict[str, Any]) -> None:
    """Turn a malformed pull request into a plain local one, in place: no remote
    prefill, no peer to pull from. The peer's lease on its blocks expires on its own."""
    params["do_remote_prefill"] = False
    for name in _PULL_FIELDS:
        params.pop(name, None)


EXPIRES_AT_KEY = "kvpilot_expires_at"
"""Unix time (seconds) until which the peer holds the offered blocks. vLLM's own
``remote_blocks_expiry_time`` is the holder's ``time.perf_counter()``, which means
nothing to another process; a router or another host reads this one."""

LEASE_MARGIN_S = 5.0
"""A lease with less than this left is treated as expired: the pull would race the
holder freeing its blocks (vLLM's worker uses the same 5 s margin)."""


def stamp_wall_clock_expiry(params: dict[str, Any], perf_now: float, wall_now: float) -> None:
    """Add :data:`EXPIRES_AT_KEY` when ``params`` carry a ``remote_blocks_expiry_time``
    stamped against ``perf_now`` (the holder's clock); in place."""
    expiry = params.get("remote_blocks_expiry_time")
    if isinstance(expiry, (int, float)) and not isinstance(expiry, bool):
        params[EXPIRES_AT_KEY] = round(wall_now + (expiry - perf_now), 3)


HOLD_KEY = "kvpilot_hold"
"""In D's kv_transfer_params, set by the router: ``false`` asks D not to hold the request's
blocks for a peer once it finishes (vLLM's bidirectional mode holds every finished request's
for ``decoder_kv_blocks_ttl``); absent or ``true``, D holds them as vLLM does
(:mod:`kvpilot.policies.session_hold` decides)."""


def with_hold(handoff: dict[str, Any], hold: bool) -> dict[str, Any]:
    """P's ``handoff`` for D, asking D to hold the finished request's blocks or not (:data:`HOLD_KEY`)."""
    return {**handoff, HOLD_KEY: hold}


def declines_hold(params: Mapping[str, Any] | None) -> bool:
    """Whether a finished request's params ask this engine, as its decode side, not to hold
    its blocks (:data:`HOLD_KEY` is ``false``; a P's own handoff, ``do_remote_decode``, is
    never declined: D pulls it)."""
    return isinstance(params, Mapping) and params.get(HOLD_KEY) is False and not params.get("do_remote_decode")


def lease_expires_at(params: Mapping[str, Any]) -> float | None:
    """The Unix time until which the peer holds the offered blocks (:data:`EXPIRES_AT_KEY`);
    ``None`` if the params state no wall-clock expiry (a P->D handoff, held by
    heartbeats instead)."""
    expires_at = params.get(EXPIRES_AT_KEY)
    if not isinstance(expires_at, (int, float)) or isinstance(expires_at, bool):
        return None
    return float(expires_at)


def lease_seconds_left(params: Mapping[str, Any], wall_now: float) -> float | None:
    """Seconds left on the peer's hold of its blocks; ``None`` as :func:`lease_expires_at`."""
    expires_at = lease_expires_at(params)
    return None if expires_at is None else expires_at - wall_now
