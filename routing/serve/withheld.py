"""What no client reads of D's answer, and how an answer is rid of it. Pure.

D's ``kv_transfer_params`` is the router's alone: in vLLM's bidirectional mode it is D's
offer of a session's KV (the NIXL peer that holds it, its block ids, kvpilot's own
``kvpilot_*`` keys), which a client could hand another engine to read that KV. A top-level
key named ``kvpilot_*`` is kvpilot's by name and no client's either.

- A whole answer keeps ``kv_transfer_params`` as ``null``, as vLLM answers a request that
  transferred nothing, and loses every top-level ``kvpilot_*`` key (:func:`scrubbed_answer`).
- A streamed chunk loses both (:func:`scrubbed_events`), and D's offer, where a release
  streams one (vLLM 0.34 has the field in its stream classes), is handed to the router as a
  whole answer's is. A chunk whose text names neither is passed on as it came, unparsed: a
  substring test per event is the whole cost of a clean stream.
- A chunk that names one but is not a JSON object is withheld: an error event takes its place.

``kvpilot.kvconnectors.vllm_contract`` checks, on each vLLM release, that the key is a
top-level field of vLLM's whole answers; Envoy's Lua filter
(``deploy/envoy_spec.py``) applies the same rules on Envoy's path, and the compiled picker
(``routing/native/kvp_answer.h``) to the answers it routed. Key names are matched as
vLLM writes them (no JSON escapes in a key: pydantic writes none for ASCII).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TRANSFER_PARAMS_KEY = "kv_transfer_params"
"""D's transfer params: ``null`` in a whole answer, gone from a streamed chunk."""
KVPILOT_PREFIX = "kvpilot_"
"""A top-level key with this prefix is kvpilot's: gone from every answer."""
WITHHELD_CHUNK = json.dumps(
    {
        "error": {
            "message": "kvpilot: the engine's streamed chunk names kv_transfer_params but is not a JSON object; "
            "withheld",
            "type": "upstream_error",
            "code": 502,
        }
    }
)
"""The event sent instead of a chunk that names a withheld key but cannot be read."""
WITHHELD_ANSWER = json.dumps(
    {
        "error": {
            "message": "kvpilot: the engine's answer is not a JSON object; withheld",
            "type": "upstream_error",
            "code": 502,
        }
    }
)
"""Envoy's 502 body instead of a whole answer that names a withheld key but cannot be read."""


def _withheld(key: str) -> bool:
    return key == TRANSFER_PARAMS_KEY or key.startswith(KVPILOT_PREFIX)


def scrubbed_answer(payload: Mapping[str, Any]) -> tuple[dict[str, Any], object]:
    """A whole answer as the client gets it (``kv_transfer_params`` ``null`` when present, no
    top-level ``kvpilot_*`` key), and D's ``kv_transfer_params`` (``None`` when absent)."""
    offer = payload.get(TRANSFER_PARAMS_KEY)
    answer = {k: v for k, v in payload.items() if not k.startswith(KVPILOT_PREFIX)}
    if offer is not None:
        answer[TRANSFER_PARAMS_KEY] = None
    return answer, offer


def _scrubbed_event(data: str) -> tuple[str, object]:
    """One event's data as the client gets it, and the offer it carried (``None``: none)."""
    if TRANSFER_PARAMS_KEY not in data and KVPILOT_PREFIX not in data:
        return data, None
    try:
        chunk = json.loads(data)
    except ValueError:
        return WITHHELD_CHUNK, None
    if not isinstance(chunk, dict):
        return WITHHELD_CHUNK, None
    if not any(_withheld(key) for key in chunk):
        return data, None  # the text only named it (a token, a tool call's argument)
    return json.dumps({k: v for k, v in chunk.items() if not _withheld(k)}), chunk.get(TRANSFER_PARAMS_KEY)


def scrubbed_events(events: Sequence[str]) -> tuple[Sequence[str], object]:
    """The data of a batch of streamed events (each a JSON chunk or ``[DONE]``), each chunk
    without its top-level ``kv_transfer_params`` and ``kvpilot_*`` keys (``events`` itself when
    no event's text names either), and the last offer a chunk of the batch carried (``None``:
    none)."""
    if not any(TRANSFER_PARAMS_KEY in data or KVPILOT_PREFIX in data for data in events):
        return events, None
    scrubbed, offer = [], None
    for data in events:
        text, carried = _scrubbed_event(data)
        scrubbed.append(text)
        offer = carried if carried is not None else offer
    return scrubbed, offer
