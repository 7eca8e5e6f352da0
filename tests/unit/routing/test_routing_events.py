"""Table-driven and fuzzed tests of kvpilot.routing.index.events (vLLM's encoder produces the valid cases)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.routing.index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecoder, RejectReason

enc = msgspec.msgpack.encode
STORED = {
    "type": "BlockStored",
    "block_hashes": [b"a", b"b"],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


@pytest.mark.parametrize(
    ("events", "kinds", "reasons"),
    [
        ([STORED], [BlockStored], []),
        ([{"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}], [BlockRemoved], []),
        ([{"type": "AllBlocksCleared"}], [AllBlocksCleared], []),
        ([{"type": "Bogus"}, STORED], [BlockStored], [RejectReason.UNKNOWN_TAG]),
        ([{"no": "tag"}], [], [RejectReason.UNKNOWN_TAG]),
        ([7], [], [RejectReason.UNKNOWN_TAG]),
        ([{**STORED, "block_size": "2"}], [], [RejectReason.WRONG_TYPE]),
        ([{**STORED, "token_ids": [1, 2, 3]}], [], [RejectReason.INCONSISTENT]),
        ([{**STORED, "block_size": 0, "token_ids": []}], [], [RejectReason.INCONSISTENT]),
        ([{**STORED, "extra_keys": [None]}], [], [RejectReason.INCONSISTENT]),
        ([{**STORED, "future_field": 1}], [BlockStored], []),
    ],
)
def test_events_table(events, kinds, reasons):
    decoder = EventDecoder()
    batch = decoder.decode(enc([1.0, events, 0]))
    assert [type(e) for e in batch.events] == kinds
    assert [r.reason for r in batch.rejected] == reasons
    assert sum(decoder.rejections.values()) == len(reasons)


@pytest.mark.parametrize("payload", [b"", b"\xc1", enc({"ts": 1}), enc([1.0]), enc(["x", []]), enc([1.0, 5])])
def test_undecodable_batches(payload):
    decoder = EventDecoder()
    batch = decoder.decode(payload)
    assert batch.events == [] and batch.rejected[0].reason is RejectReason.UNDECODABLE_BATCH
    assert decoder.rejections[RejectReason.UNDECODABLE_BATCH] == 1


def test_vllm_encoding_round_trips():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv.KVEventBatch(
        ts=2.0,
        events=[
            kv.BlockStored(
                block_hashes=[b"x" * 32],
                parent_block_hash=b"p" * 32,
                token_ids=[5, 6],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("salt",)],
                group_idx=0,
            ),
            kv.BlockRemoved(block_hashes=[b"x" * 32], medium="GPU"),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    out = EventDecoder().decode(msgspec.msgpack.Encoder().encode(batch))
    assert out.rejected == [] and out.data_parallel_rank == 3
    stored = out.events[0]
    assert isinstance(stored, BlockStored) and stored.extra_keys == [["salt"]]
    assert stored.parent_block_hash == b"p" * 32 and stored.group_idx == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_bytes_never_raise(data):
    decoder = EventDecoder()
    batch = decoder.decode(data)
    # Every event in the batch is either decoded or rejected (counted), and an
    # undecodable batch is one counted rejection with no events.
    assert sum(decoder.rejections.values()) == len(batch.rejected)
    if math.isnan(batch.ts):
        assert not batch.events and [r.reason for r in batch.rejected] == [RejectReason.UNDECODABLE_BATCH]
    assert decoder.events_decoded == len(batch.events)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            json_like,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
                optional={k: json_like for k in STORED if k != "type"},
            ),
        ),
        max_size=5,
    )
)
@example([{"type": []}])  # an unhashable tag once raised in the classifier
def test_fuzzed_events_are_kept_or_counted(events):
    decoder = EventDecoder()
    batch = decoder.decode(enc([1.0, events]))
    assert len(batch.events) + len(batch.rejected) == len(events)
    assert sum(decoder.rejections.values()) == len(batch.rejected)
