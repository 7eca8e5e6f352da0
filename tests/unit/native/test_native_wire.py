"""The compiled parsers: a body's token-id prompt, table-driven, and vLLM's KV-event batches
decoded by C exactly as routing/index/events.py's EventDecoder decodes them (the events of
the default namespace and KV group 0, in order; the bad ones skipped, the batch refused whole
when it is not msgpack)."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from kvpilot.routing import native
from kvpilot.routing.index.events import BlockRemoved, BlockStored, EventDecoder

try:
    native.load()
except native.NativeUnavailable as exc:  # pragma: no cover - make setup builds it
    pytest.skip(str(exc), allow_module_level=True)


@pytest.mark.parametrize(
    ("body", "status", "ids"),
    [
        (b'{"model": "m", "prompt": [1, 2, 4294967295], "max_tokens": 3}', "ok", [1, 2, 4294967295]),
        (b'{"x": {"prompt": "not this one"}, "prompt" : [ 7 ,8 ]}', "ok", [7, 8]),
        (b'{"prompt": []}', "ok", []),
        (b'{"prompt": "text"}', "not_token_ids", []),
        (b'{"prompt": [[1, 2], [3]]}', "not_token_ids", []),
        (b'{"prompt": [1, 4294967296]}', "not_token_ids", []),
        (b'{"prompt": [1, -2]}', "not_token_ids", []),
        (b'{"prompt": [1.5]}', "not_token_ids", []),
        (b'{"prompt": [1, 2], "cache_salt": "tenant"}', "namespaced", []),
        (b'{"prompt": [1, 2], "cache_salt": ""}', "ok", [1, 2]),
        (b'{"conversation_id": "c", "prompt": [1, 2]}', "session_field", []),
        (b'{"prompt": [1, 2], "prompt_cache_key": {"k": 1}}', "session_field", []),
        (b'{"prompt": [1, 2], "conversation_id": null}', "ok", [1, 2]),
        (b'{"messages": []}', "no_prompt", []),
        (b'{"prompt": [1, 2, 3, 4, 5]}', "too_many_ids", []),
        (b'{"prompt": [1, 2]', "malformed", []),
        (b'{"prompt": [1, 2]} trailing', "malformed", []),
        (b"[1, 2]", "malformed", []),
        (b'{"a": "\\"}", "prompt": [3]}', "ok", [3]),
        (b"{" * 100 + b"}" * 100, "malformed", []),
        (b"", "malformed", []),
    ],
)
def test_a_body_s_prompt(body: bytes, status: str, ids: list[int]) -> None:
    assert native.parse_prompt(body, 4) == (status, ids)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "tiny", "prompt": [1, 2]}', "ok"),
        (b'{"prompt": [1, 2]}', "ok"),
        (b'{"model": "tiny-lora", "prompt": [1, 2]}', "namespaced"),
        (b'{"model": "tin", "prompt": [1, 2]}', "namespaced"),
        (b'{"model": "t\\u0069ny", "prompt": [1, 2]}', "namespaced"),  # an escape: not the name as written
        (b'{"model": null, "prompt": [1, 2]}', "namespaced"),
        (b'{"model": "tiny, "prompt": [1, 2]}', "malformed"),
    ],
)
def test_only_the_served_model_is_decided(body: bytes, status: str) -> None:
    assert native.parse_prompt(body, 4, served_model="tiny")[0] == status


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 3}', "ok"),
        (b'{"prompt": [1, 2], "kv_transfer_params": {"remote_host": "10.0.0.7"}}', "refused_field"),
        (b'{"kvpilot_hold": true, "prompt": [1, 2]}', "refused_field"),
        (b'{"prompt": [1, 2], "max_t\\u006fkens": 3}', "refused_field"),  # an escape: not the name as written
        (b'{"prompt": [1, 2], "nvext": {}}', "refused_field"),
        (b'{"promp": [1, 2]}', "refused_field"),
    ],
)
def test_a_body_with_a_field_outside_the_accepted_ones_is_left_to_the_python_picker(body: bytes, status: str) -> None:
    assert native.parse_prompt(body, 4, accepted=["model", "prompt", "max_tokens"])[0] == status


def test_a_large_prompt_in_full() -> None:
    prompt = [random.Random(1).randrange(2**32) for _ in range(12_000)]
    assert native.parse_prompt(json.dumps({"prompt": prompt}).encode(), 12_000) == ("ok", prompt)


def _random_event(rng: random.Random) -> object:
    blocks, size = rng.randrange(0, 4), rng.choice([4, 4, 4, 8])
    hashes: list[object] = [rng.choice([rng.randrange(2**63), rng.randbytes(32)]) for _ in range(blocks)]
    stored = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": rng.choice([None, rng.randrange(2**20)]),
        "token_ids": [rng.randrange(2**32) for _ in range(blocks * size + rng.choice([0, 0, 0, 1]))],
        "block_size": size,
        "medium": rng.choice([None, "GPU", "CPU_PINNED"]),
        "lora_name": rng.choice([None, None, "adapter"]),
        "extra_keys": rng.choice([None, [None] * blocks, [["salt"]] + [None] * (blocks - 1) if blocks else None]),
        "group_idx": rng.choice([None, 0, 0, 1]),
    }
    return rng.choice(
        [
            stored,
            stored,
            {"type": "BlockRemoved", "block_hashes": hashes, "medium": rng.choice([None, "GPU"])},
            {"type": "AllBlocksCleared"},
            {"type": "Unknown"},
            {"type": "BlockStored", "block_hashes": "wrong"},
        ]
    )


def _expected(payload: bytes) -> tuple[bool, list[tuple[object, ...]]]:
    """EventDecoder's events as the C core is handed them (default namespace, group 0)."""
    batch = EventDecoder().decode(payload)
    out: list[tuple[object, ...]] = []
    for e in batch.events:
        if getattr(e, "group_idx", None) not in (None, 0):
            continue
        if isinstance(e, BlockStored):
            if e.lora_name or any(k is not None for k in e.extra_keys or ()):
                continue
            parent = e.parent_block_hash
            out.append(("stored", e.block_size, e.medium or "GPU", len(e.block_hashes), parent is None, e.token_ids))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", 0, e.medium or "GPU", len(e.block_hashes), True, []))
        else:
            out.append(("cleared", 0, "GPU", 0, True, []))
    return batch.ts == batch.ts, out


@pytest.mark.parametrize("seed", range(20))
def test_event_batches_decode_as_the_python_decoder_decodes_them(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        payload = msgspec.msgpack.encode([rng.random(), [_random_event(rng) for _ in range(rng.randrange(6))]])
        ok, events, _ = native.decode_batch(payload)
        decodable, expected = _expected(payload)
        assert ok == decodable
        got = [(k, size, medium, len(h), parent is None, toks) for k, h, parent, toks, size, medium in events]
        assert got == expected, payload


def test_a_batch_that_is_not_msgpack_is_refused_whole() -> None:
    good = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])
    assert native.decode_batch(good)[0]
    for bad in (good[:-1], good + b"\x00", b"\xc1", b"", b"\x92\xcb"):
        ok, events, _ = native.decode_batch(bad)
        assert not ok and not events
        assert EventDecoder().decode(bad).rejected[0].reason.name == "UNDECODABLE_BATCH"
