"""KV events made to order, as an engine would send them.

The router's own event types (:mod:`kvpilot.routing.index.events`), for the index tests:
:func:`stored` and :func:`removed` name the blocks of one of :data:`PROMPTS` by a
stand-in for the engine's hash chain (:func:`block_hash`), so that a table of
events and the prompts matched against them read as block ranges.

vLLM's real publisher and event types, for the subscriber tests: :func:`vllm_kv_events`
imports them (skipping the test module where vLLM is not installed),
:func:`vllm_publisher` and :func:`vllm_block_stored` build what an engine builds.
"""

from __future__ import annotations

import hashlib
import os
import time
from types import ModuleType
from typing import Any

import pytest

from kvpilot.deploy.env import LOCAL_ONLY_ENV
from kvpilot.routing.index.events import BlockRemoved, BlockStored

BLOCK_SIZE = 2
PROMPTS = [list(range(1, 13)), [*list(range(1, 7)), 50, 51, 52, 53], [9, 9, 9, 9, 9, 9, 9, 9]]
"""Three prompts: six blocks; five blocks whose first three are the first prompt's;
four identical blocks."""
TOPIC = "kv"
"""What :func:`vllm_publisher` sends on: the router's default (``kvpilot.routing.config.Worker.topic``)."""


def block_hash(tokens: list[int], k: int, salt: str | None, as_int: bool = False) -> bytes | int:
    """The name of block ``k`` of ``tokens``: 8 bytes of sha256 over the salt and every
    token up to the block's end (so a block's name depends on its whole prefix);
    ``as_int``: the same digest as vLLM's int hashes (which may be >= 2**63)."""
    digest = hashlib.sha256(repr((salt, tuple(tokens[: (k + 1) * BLOCK_SIZE]))).encode()).digest()[:8]
    return int.from_bytes(digest, "big") if as_int else digest


def stored(
    tokens: list[int],
    a: int,
    b: int,
    salt: str | None = None,
    medium: str | None = "GPU",
    as_int: bool = False,
    **kw: Any,
) -> BlockStored:
    """Blocks ``a`` to ``b - 1`` of ``tokens`` stored, their parent block ``a - 1``; the
    salt goes into the first block's extra keys, as vLLM puts ``cache_salt``; ``kw``:
    the other :class:`BlockStored` fields (``group_idx``, ``lora_name``, ...)."""
    extra = [[salt] if (salt and i == 0) else None for i in range(a, b)]
    return BlockStored(
        [block_hash(tokens, k, salt, as_int) for k in range(a, b)],
        block_hash(tokens, a - 1, salt, as_int) if a else None,
        tokens[a * BLOCK_SIZE : b * BLOCK_SIZE],
        BLOCK_SIZE,
        medium=medium,
        extra_keys=extra if salt else None,
        **kw,
    )


def removed(tokens: list[int], ks: list[int], salt: str | None = None, medium: str | None = "GPU") -> BlockRemoved:
    """Blocks ``ks`` of ``tokens`` evicted from ``medium``."""
    return BlockRemoved([block_hash(tokens, k, salt) for k in ks], medium=medium)


def vllm_kv_events() -> ModuleType:
    """vLLM's ``vllm.distributed.kv_events`` (the router never imports vLLM; these tests
    do, for its publisher). Sets :data:`kvpilot.deploy.env.LOCAL_ONLY_ENV` where unset before
    the import; raises pytest's skip (of the calling module, at its import) without vLLM."""
    for name, value in LOCAL_ONLY_ENV.items():
        os.environ.setdefault(name, value)
    return pytest.importorskip("vllm.distributed.kv_events")


def vllm_publisher(endpoint: str, replay_endpoint: str | None) -> Any:
    """vLLM's ``ZmqEventPublisher`` as engine rank 0 configures it: connecting to
    ``endpoint`` (a ``tcp://127.0.0.1:PORT`` the router binds, or binding an ipc one)
    and serving replays on ``replay_endpoint``. The caller shuts it down."""
    return vllm_kv_events().ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint, topic=TOPIC
    )


def vllm_block_stored(name: bytes, parent: bytes | None, token_ids: list[int]) -> Any:
    """vLLM's ``BlockStored`` of one GPU block (no LoRA) named ``name``, as an engine publishes it."""
    return vllm_kv_events().BlockStored(
        block_hashes=[name],
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=len(token_ids),
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def vllm_batch(events: list[Any]) -> Any:
    """vLLM's ``KVEventBatch`` of ``events``, stamped now."""
    return vllm_kv_events().KVEventBatch(ts=time.time(), events=events)
