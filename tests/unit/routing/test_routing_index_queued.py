"""The feeder's changes queued for the index's owner (QueuedIndex), and the feeder's reads:
woken by the sockets that hold a batch, and once a period while nobody matches."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from kvpilot.routing.config import Role, Worker
from kvpilot.routing.fleet import fleet_of
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import BlockRemoved, BlockStored
from kvpilot.routing.index.queued import QueuedIndex
from kvpilot.routing.ingest.feeder import IndexFeeder
from tests.fakes.ports import free_ports

BS = 4
W = WorkerId("w")
CHAIN = PromptChain([1, 2, 3, 4, 5, 6, 7, 8], BS)


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, medium="GPU")  # type: ignore[arg-type]


def test_queued_changes_reach_the_index_in_order_at_its_owners_next_read():
    inner = BlockIndex(BS)
    index = QueuedIndex(inner)
    index.defer(lambda: inner.apply(W, _stored([1], None, [1, 2, 3, 4])))
    index.defer(lambda: inner.apply(W, _stored([2], 1, [5, 6, 7, 8])))
    index.defer(lambda: inner.apply(W, BlockRemoved([2], medium="GPU")))  # type: ignore[arg-type]
    assert inner.block_count(W) == 0  # queued, not yet run
    assert index.match(CHAIN).blocks == {W: {"GPU": 1}}  # all three ran, in order, before the match
    assert index.matches == 1
    assert index.run_queued() == 0
    index.defer(lambda: inner.apply(W, _stored([2], 1, [5, 6, 7, 8])))
    assert index.block_count(W) == 2  # every read runs the queue first
    index.defer(lambda: inner.clear_worker(W))
    assert index.run_queued() == 1
    assert inner.block_count(W) == 0
    assert index.matches == 1  # only matches count


def _batch(seq: int) -> tuple[bytes, bytes, bytes]:
    event = {"type": "BlockStored", "block_hashes": [seq + 100], "parent_block_hash": None}
    event |= {"token_ids": [seq, seq + 1, seq + 2, seq + 3], "block_size": BS}
    return b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event]])


def _read_within(feeder: IndexFeeder, pubs: list[zmq.Socket[bytes]], index: QueuedIndex, limit_s: float) -> float:
    """Publish one more batch on every socket; seconds until the feeder read them all (at
    most ``limit_s``)."""
    before = sum(s.stats.batches for s in feeder.subscribers)
    seq = before // len(pubs)
    for pub in pubs:
        pub.send_multipart(_batch(seq))
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if sum(s.stats.batches for s in feeder.subscribers) == before + len(pubs):
            return time.monotonic() - start
        time.sleep(0.005)
    return float("inf")


def _fleet_feeder(
    poll_ms: int, idle_read_s: float = 0.0, read_now: Any = None
) -> tuple[IndexFeeder, list[zmq.Socket[bytes]], QueuedIndex, zmq.Context[Any]]:
    """Four publishers that bind, a feeder that connects to them, each worker heard once."""
    ctx: zmq.Context[Any] = zmq.Context()
    pubs, workers = [], []
    for i, port in enumerate(free_ports(4)):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(pub)
        workers.append(
            Worker(WorkerId(f"w{i}"), Role.DECODE, "http://127.0.0.1:1", f"tcp://127.0.0.1:{port}", topic="")
        )
    index = QueuedIndex(BlockIndex(BS))
    feeder = IndexFeeder(
        fleet_of(workers),
        index.inner,
        deliver=index.defer,
        context=ctx,
        bind=False,
        poll_ms=poll_ms,
        matches=lambda: index.matches,
        idle_read_s=idle_read_s,
        read_now=read_now,
    )
    feeder.start()
    assert feeder.caught_up.wait(5)
    deadline = time.monotonic() + 5  # a connecting SUB misses what came before it: publish seq 0 until heard
    while time.monotonic() < deadline and not all(s.stats.batches for s in feeder.subscribers):
        for pub, sub in zip(pubs, feeder.subscribers, strict=True):
            if not sub.stats.batches:
                pub.send_multipart(_batch(0))
        time.sleep(0.05)
    assert all(s.stats.batches == 1 for s in feeder.subscribers)
    return feeder, pubs, index, ctx


def test_the_feeder_is_woken_by_the_socket_that_holds_a_batch():
    """Its periodic sweep every 3 s cannot be what reads them: each batch is read as it arrives."""
    feeder, pubs, index, ctx = _fleet_feeder(poll_ms=3000)
    try:
        for _ in range(5):
            assert _read_within(feeder, pubs, index, 2.0) < 1.0
        assert index.run_queued() >= 4 * 6
        assert sorted(index.inner.workers()) == ["w0", "w1", "w2", "w3"]
    finally:
        feeder.stop()
        ctx.destroy(linger=0)


def test_the_feeder_reads_once_a_period_while_nobody_matches_and_at_once_while_they_do():
    """And while the index is matched, it prompts the owner to apply what it read at once
    (``read_now``), so that no decision applies them itself."""
    prompts: list[float] = []
    feeder, pubs, index, ctx = _fleet_feeder(poll_ms=20, idle_read_s=0.4, read_now=lambda: prompts.append(1.0))
    try:
        time.sleep(1.2)  # past the eager spell that follows the start
        prompted = len(prompts)
        idle = [_read_within(feeder, pubs, index, 2.0) for _ in range(4)]
        assert max(idle) < 0.4 + 0.3  # no batch waits longer than a period
        assert sum(idle) / len(idle) > 0.05  # and they do wait for it: on average half a period
        assert len(prompts) == prompted  # nobody matches: the changes wait for the owner's next read
        eager = []
        for _ in range(4):
            index.match(CHAIN)  # the router is reading: the next pass reads each batch as it comes
            time.sleep(0.45)
            eager.append(_read_within(feeder, pubs, index, 2.0))
        assert max(eager) < 0.1
        assert len(prompts) > prompted
    finally:
        feeder.stop()
        ctx.destroy(linger=0)
