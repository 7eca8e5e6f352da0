"""Component test: vLLM's real ZmqEventPublisher -> EngineSubscriber -> BlockIndex (127.0.0.1)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from kvpilot.routing.ids import DEFAULT_TIER, WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.ingest.subscriber import EngineSubscriber, subscriber_binds
from tests.fakes.kv_events import TOPIC, vllm_batch, vllm_block_stored, vllm_kv_events, vllm_publisher
from tests.fakes.ports import free_ports

kv_events = vllm_kv_events()

BS = 4
W = WorkerId("w1")


def _stored(i: int, parent: int | None) -> object:
    return vllm_block_stored(
        i.to_bytes(8, "big"), None if parent is None else parent.to_bytes(8, "big"), [i * 10 + k for k in range(BS)]
    )


def _publish_chain(pub: object, first: int, last: int) -> None:
    for i in range(first, last):
        pub.publish(vllm_batch([_stored(i, i - 1 if i else None)]))


def _prompt(n: int) -> list[int]:
    return [i * 10 + k for i in range(n) for k in range(BS)]


def _noop() -> object:
    return vllm_batch([kv_events.BlockRemoved(block_hashes=[b"none"], medium="GPU")])


def _publish_until(pub: object, sub: EngineSubscriber, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Publish harmless batches until ``done()`` holds.

    A PUB drops what it sends before the subscription reaches it, so the first
    batches may be lost; the gap they leave is recovered through replay.
    """
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        pub.publish(_noop())
        sub.poll(200)
    sub.poll(200)
    assert done(), "the awaited batch never arrived"


def _publish_until_seen(pub: object, sub: EngineSubscriber) -> None:
    """Publish harmless batches until one more arrives than had when called."""
    seen = sub.stats.batches
    _publish_until(pub, sub, lambda: sub.stats.batches > seen)


def _depth_reaches(sub: EngineSubscriber, index: BlockIndex, blocks: int, timeout_s: float = 20.0) -> int:
    """Poll until the index holds ``blocks`` of the test chain (batches may still be queued)."""
    deadline = time.monotonic() + timeout_s
    while True:
        depth = index.match(PromptChain(_prompt(blocks), BS)).blocks.get(W, {}).get("GPU", 0)
        if depth >= blocks or time.monotonic() > deadline:
            return depth
        sub.poll(100)


@pytest.fixture
def endpoints():
    return tuple(f"tcp://127.0.0.1:{port}" for port in free_ports(2))


def test_connecting_engine_means_binding_subscriber():
    assert subscriber_binds("tcp://127.0.0.1:5557")
    assert not subscriber_binds("tcp://*:5557")
    assert not subscriber_binds("ipc:///tmp/kv")


def test_late_subscriber_catches_up_through_replay(endpoints, tmp_path):
    _, replay = endpoints
    endpoint = f"ipc://{tmp_path}/kv.sock"  # the engine binds ipc endpoints; the router connects
    index = BlockIndex(BS)
    pub = vllm_publisher(endpoint, replay)
    sub = None
    try:
        _publish_chain(pub, 0, 20)  # nobody bound yet: the router starts after the engine
        time.sleep(0.3)
        sub = EngineSubscriber(W, endpoint, index, replay_endpoint=replay, topic=TOPIC)
        _publish_until_seen(pub, sub)
        assert sub.stats.gaps >= 1 and sub.stats.replayed >= 20
        assert sub.stats.unrecoverable_gaps == 0
        assert index.match(PromptChain(_prompt(30), BS)).blocks == {W: {"GPU": 20}}
    finally:
        pub.shutdown()
        if sub is not None:
            sub.close()


def test_a_restarted_router_catches_up_before_any_new_event(endpoints, tmp_path):
    """A router started beside a running engine (a restart mid-session) rebuilds the
    worker's entries from the replay buffer at once, with no new event to reveal a gap;
    the live copies of those batches that were queued meanwhile are not a restart."""
    _, replay = endpoints
    endpoint = f"ipc://{tmp_path}/kv.sock"
    index = BlockIndex(BS)
    pub = vllm_publisher(endpoint, replay)
    sub = None
    try:
        _publish_chain(pub, 0, 12)
        time.sleep(0.3)
        sub = EngineSubscriber(W, endpoint, index, replay_endpoint=replay, topic=TOPIC)
        assert index.block_count(W) == 0
        assert sub.catch_up() == 12
        assert (sub.stats.replayed, sub.stats.replayed_blocks, sub.stats.unrecoverable_gaps) == (12, 12, 0)
        assert index.match(PromptChain(_prompt(20), BS)).blocks == {W: {"GPU": 12}}
        assert sub.catch_up() == 0  # once
        _publish_chain(pub, 12, 14)
        assert _depth_reaches(sub, index, 14) == 14
        assert (sub.stats.restarts, sub.stats.gaps) == (0, 0)
    finally:
        pub.shutdown()
        if sub is not None:
            sub.close()


def test_a_live_copy_of_a_caught_up_batch_is_not_an_engine_restart(endpoints, tmp_path):
    """A batch published after the subscriber connected but before it caught up arrives
    twice: in the replay and queued on the live socket. The copy is skipped, not read as
    a restart (which would clear the worker)."""
    _, replay = endpoints
    endpoint = f"ipc://{tmp_path}/kv.sock"
    index = BlockIndex(BS)
    pub = vllm_publisher(endpoint, replay)
    sub = None
    try:
        _publish_chain(pub, 0, 4)
        sub = EngineSubscriber(W, endpoint, index, replay_endpoint=replay, topic=TOPIC)
        time.sleep(0.5)  # subscribed: what follows is also queued live
        _publish_chain(pub, 4, 6)
        time.sleep(0.3)
        assert sub.catch_up() == 6
        assert sub.poll(500) >= 2  # live copies: of batches 4 and 5 at least (the first ones may race the connect)
        assert (sub.stats.restarts, sub.stats.batches) == (0, 6)
        assert index.match(PromptChain(_prompt(8), BS)).blocks == {W: {"GPU": 6}}
    finally:
        pub.shutdown()
        if sub is not None:
            sub.close()


def test_catching_up_from_an_engine_without_replay_does_nothing(endpoints):
    endpoint, _ = endpoints
    sub = EngineSubscriber(W, endpoint, BlockIndex(BS), topic=TOPIC)
    try:
        assert sub.catch_up() == 0
    finally:
        sub.close()


def test_engine_restart_clears_the_worker(endpoints):
    """A restarted engine's sequence starts again at 0: the router drops everything
    it knew of that worker, then indexes what the new engine stores. (The restart is
    detected first and the new block published after, so that a PUB dropping batches
    sent before its subscriber connects cannot lose the block under test.)"""
    endpoint, replay = endpoints
    index = BlockIndex(BS)
    sub = EngineSubscriber(W, endpoint, index, replay_endpoint=replay, topic=TOPIC)
    pub = vllm_publisher(endpoint, replay)
    _publish_chain(pub, 0, 6)
    _publish_until_seen(pub, sub)
    assert _depth_reaches(sub, index, 6) == 6
    pub.shutdown()
    time.sleep(0.3)
    pub = vllm_publisher(endpoint, replay)  # a restarted engine: seq starts at 0 again
    try:
        # Not "until any batch": a harmless batch the old engine sent last may still be
        # queued on the subscriber's socket, and it is not the restart.
        _publish_until(pub, sub, lambda: sub.stats.restarts >= 1)
        assert sub.stats.restarts == 1
        assert index.block_count(W) == 0
        pub.publish(vllm_batch([_stored(0, None)]))
        assert _depth_reaches(sub, index, 1) == 1
        assert index.match(PromptChain(_prompt(6), BS)).blocks == {W: {"GPU": 1}}
    finally:
        pub.shutdown()
        sub.close()


def test_malformed_payload_is_counted_and_stream_continues(endpoints):
    endpoint, _ = endpoints
    index = BlockIndex(BS)
    sub = EngineSubscriber(W, endpoint, index, topic=TOPIC)
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.connect(endpoint)
    good = kv_events.KVEventBatch(ts=1.0, events=[_stored(0, None)])
    payload = __import__("msgspec").msgpack.encode(good)
    try:
        deadline, seq = time.monotonic() + 20, 0
        while index.block_count(W) == 0 and time.monotonic() < deadline:
            raw.send_multipart((b"kv", b"short"))
            raw.send_multipart((b"kv", seq.to_bytes(8, "big"), b"\xc1not msgpack"))
            raw.send_multipart((b"kv", (seq + 1).to_bytes(8, "big"), payload))
            seq += 2
            sub.poll(200)
        assert index.block_count(W) == 1
        assert sub.stats.bad_frames >= 1
        assert sum(sub.decoder.rejections.values()) >= 1
    finally:
        raw.close(linger=0)
        sub.close()


def test_forged_sequence_number_is_a_bad_frame_not_a_gap(endpoints):
    endpoint, replay = endpoints
    index = BlockIndex(BS)
    sub = EngineSubscriber(W, endpoint, index, replay_endpoint=replay, topic=TOPIC)
    pub = vllm_publisher(endpoint, replay)
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.connect(endpoint)
    try:
        _publish_chain(pub, 0, 3)
        _publish_until_seen(pub, sub)
        deadline = time.monotonic() + 20
        while sub.stats.bad_frames == 0 and time.monotonic() < deadline:
            raw.send_multipart((b"kv", (2**62).to_bytes(8, "big"), b"\\xc1"))
            sub.poll(200)
        assert sub.stats.bad_frames >= 1
        assert sub.stats.unrecoverable_gaps == 0 and sub.stats.restarts == 0
        assert index.match(PromptChain(_prompt(3), BS)).blocks == {W: {"GPU": 3}}
    finally:
        raw.close(linger=0)
        pub.shutdown()
        sub.close()


def test_the_index_changes_only_in_the_thread_it_is_delivered_to_never_during_a_replay_wait():
    """The router's event loop owns the index: the subscriber hands it each change (in order)
    and makes none itself, so a subscriber waiting on a replay that never comes (up to
    ``replay_timeout_s``) holds nothing the loop waits for, and the batches before the gap
    are the loop's to apply meanwhile."""
    ctx = zmq.Context.instance()
    events_port, replay_port = free_ports(2)
    silent = ctx.socket(zmq.ROUTER)  # the engine's replay socket, never answering
    silent.bind(f"tcp://127.0.0.1:{replay_port}")
    index = BlockIndex(BS)
    handed: queue.SimpleQueue[Any] = queue.SimpleQueue()
    sub = EngineSubscriber(
        W,
        f"tcp://127.0.0.1:{events_port}",
        index,
        bind=True,
        deliver=handed.put,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        replay_timeout_s=2.0,
    )
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        seq = 0
        while sub.stats.batches == 0:  # the first frames may be lost before the subscription lands
            pub.send_multipart((b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(vllm_batch([_stored(0, None)]))))
            seq += 1
            sub.poll(100)
        while silent.poll(0):  # a lost first frame made a gap: drop its replay request
            silent.recv_multipart()
        assert index.block_count(W, DEFAULT_TIER) == 0  # nothing applied in the subscriber's thread
        gaps = sub.stats.unrecoverable_gaps
        pub.send_multipart((b"", (seq + 10).to_bytes(8, "big"), b"not a batch"))  # past every seq sent: a gap
        waiting = threading.Thread(target=sub.poll, args=(5000,))
        waiting.start()
        assert silent.poll(5000), "the subscriber never asked for a replay"
        assert waiting.is_alive()  # still waiting on the replay: the owner applies what it was handed
        while not handed.empty():
            handed.get()()
        assert index.block_count(W, DEFAULT_TIER) == 1
        waiting.join()
        assert sub.stats.unrecoverable_gaps == gaps + 1 and sub.stats.batches >= 2
    finally:
        pub.close(linger=0)
        silent.close(linger=0)
        sub.close()
