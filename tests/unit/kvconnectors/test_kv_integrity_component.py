"""The KV digest and the read deadline inside vLLM's real CPU ``Scheduler``
(:mod:`kvpilot.kvconnectors.integrity`, :mod:`kvpilot.kvconnectors.worker`).

Engines are the component test's (:mod:`tests.unit.kvconnectors.test_scheduler_component`):
a real ``Scheduler`` with ``KVPilotConnector`` around vLLM's real ``NixlConnector``
scheduler side. Each engine's worker is played by kvpilot's real worker layer
(:class:`KVPilotWorker`) over real CPU tensors; the NIXL read is played by copying the
holder's blocks into the blocks NIXL's scheduler told the reader's worker to fill, paired
as NIXL pairs them (the end of the holder's list). The inner NIXL worker's books are the
shared fake (:mod:`tests.fakes.nixl_reads`), where a deadline must stop a read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm.config import ModelConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpilot.kvconnectors.kv_digest import GroupKV, digest_blocks
from kvpilot.kvconnectors.metadata import KVPilotMetadata
from kvpilot.kvconnectors.plugin import register
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.stats import counter_key
from kvpilot.kvconnectors.transfer_params import PARAMS_KEY, decode_offer
from kvpilot.kvconnectors.worker import KVPilotWorker
from tests.fakes.nixl_reads import FakeNixlInner
from tests.unit.kvconnectors.test_scheduler_component import (
    BS,
    NUM_BLOCKS,
    PROMPT,
    WAITING_FOR_KV,
    Engine,
    FakeClock,
    build_engine,
    model_config,  # noqa: F401 - the fixture build_engine's configs come from
    recv,
    wire,
)

FLOOR_S = 2.0


@dataclass
class PlayedWorker:
    """kvpilot's worker layer over this engine's KV cache (``[blocks, BS, 2]`` float32, random
    per seed: what a forward pass wrote), playing the worker of :meth:`Engine.step`."""

    seed: int
    clock: FakeClock = field(default_factory=FakeClock)
    inner: FakeNixlInner = field(default_factory=FakeNixlInner)
    kv: dict[str, torch.Tensor] = field(init=False)
    layer: KVPilotWorker = field(init=False)
    landed: set[str] = field(default_factory=set)
    """Reads whose bytes have landed: the inner connector reports them finished next step."""
    engine: Engine | None = None
    """Set: each step writes new KV into the slots of the tokens it scheduled, as a forward pass does."""

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.kv = {"layer": torch.randn(NUM_BLOCKS, BS, 2, generator=gen)}
        self.layer = KVPilotWorker(self.inner, (("layer",),), NUM_BLOCKS, True, None, self.clock)
        self.layer.register_kv_caches(self.kv)

    def __call__(self, out: SchedulerOutput) -> KVConnectorOutput:
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVPilotMetadata)
        if self.engine is not None:
            self._forward(out, self.engine)
        self.layer.bind(meta)
        self.layer.after_forward()
        finished, failed = self.layer.transfer_results(self.landed, set())
        self.landed = set()
        stats = self.layer.take_stats()
        return KVConnectorOutput(
            finished_recving=finished,
            failed_recving=failed,
            invalid_block_ids=self.layer.take_load_errors(),
            kv_connector_worker_meta=self.layer.take_report(),
            kv_connector_stats=None if stats.is_empty() else stats,
        )

    def _forward(self, out: SchedulerOutput, engine: Engine) -> None:
        cached = out.scheduled_cached_reqs
        steps = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        steps += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, computed in steps:
            (blocks,) = engine.scheduler.kv_cache_manager.get_block_ids(request_id)
            for position in range(computed, computed + out.num_scheduled_tokens[request_id]):
                self.kv["layer"][blocks[position // BS], position % BS] = torch.randn(2)

    def land(self, out: SchedulerOutput, request_id: str, holder: PlayedWorker) -> list[int]:
        """Copy the holder's blocks into the ones NIXL's scheduler asked this worker to fill
        for ``request_id`` (its read lands); returns those local block ids."""
        pull = recv(out, request_id)
        assert pull is not None and pull.remote is not None
        (local,), (remote,) = pull.local_block_ids, pull.remote.block_ids
        remote = remote[len(remote) - len(local) :]
        self.kv["layer"][list(local)] = holder.kv["layer"][list(remote)]
        self.landed.add(request_id)
        return list(local)


@pytest.fixture
def engines(model_config: ModelConfig) -> Iterator[Any]:  # noqa: F811 - the imported fixture
    register()
    built: list[Engine] = []

    def make(engine_id: str, extra: dict[str, Any] | None = None) -> Engine:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        extra = {"read_deadline_floor_s": FLOOR_S, **(extra or {})}
        engine = build_engine(
            model_config, engine_id, [KVCacheGroupSpec(["layer"], spec)], extra=extra, load_failure="recompute"
        )
        built.append(engine)
        return engine

    yield make
    for engine in built:
        engine.scheduler.shutdown()


def prefill(engine: Engine, worker: PlayedWorker, request_id: str = "p-1") -> dict[str, Any]:
    engine.add(request_id, PROMPT, handoff_request())
    engine.step(worker=worker)
    return wire(engine.finished[request_id])


def counters(engine: Engine, name: str, reason: str | None = None) -> float:
    return engine.counters[counter_key(name, reason)]


def test_the_offer_carries_the_digests_of_the_holders_blocks(engines: Any) -> None:
    holder = PlayedWorker(seed=1)
    params = prefill(engines("prefill"), holder)
    offer = decode_offer(params[PARAMS_KEY])
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == 6  # 87 tokens: 5 full blocks and the tail's
    assert offer.kv_digest_algo == "xxh3_64"
    assert offer.kv_digests == (digest_blocks(GroupKV.of(holder.kv, ["layer"], NUM_BLOCKS), blocks),)


def test_digests_off_the_offer_carries_none(engines: Any) -> None:
    params = prefill(engines("prefill", {"kv_digest": False}), PlayedWorker(seed=1))
    offer = decode_offer(params[PARAMS_KEY])
    assert offer.kv_digests == () and offer.kv_digest_algo == ""


Read = tuple[Engine, PlayedWorker, PlayedWorker, Request]


def _read(engines: Any, decode_extra: dict[str, Any] | None = None) -> Read:
    holder = PlayedWorker(seed=1)
    params = prefill(engines("prefill"), holder)
    decode = engines("decode", decode_extra)
    reader = PlayedWorker(seed=2)
    request = decode.add("d-1", PROMPT, params, max_tokens=2)
    return decode, reader, holder, request


def test_a_clean_read_is_checked_and_attached(engines: Any) -> None:
    decode, reader, holder, request = _read(engines)
    out = decode.step(worker=reader)  # the read begins; its bytes land
    reader.land(out, "d-1", holder)
    decode.step(worker=reader)  # reported finished, checked
    assert decode.step(worker=reader).num_scheduled_tokens == {"d-1": 1}  # only the last prompt token
    assert counters(decode, "checked_blocks") == 6
    assert not counters(decode, "digest_mismatch_blocks")
    assert not counters(decode, "load_failures", "recompute")
    assert request.num_computed_tokens == len(PROMPT)


@pytest.mark.parametrize("bad", [0, 3, 5])
def test_a_corrupted_block_is_never_attached_and_recomputed_from_it(engines: Any, bad: int) -> None:
    decode, reader, holder, request = _read(engines)
    out = decode.step(worker=reader)
    local = reader.land(out, "d-1", holder)
    reader.kv["layer"][local[bad]].view(-1).view(torch.uint8)[5] ^= 0x10  # one flipped bit on the way
    decode.step(worker=reader)
    assert counters(decode, "digest_mismatch_blocks") == 1
    assert counters(decode, "integrity_failed_blocks", "digest_mismatch") == 6 - bad
    assert counters(decode, "load_failures", "recompute") == 1
    assert request.num_computed_tokens == bad * BS  # vLLM recomputes from the first bad block
    assert decode.step(worker=reader).num_scheduled_tokens == {"d-1": len(PROMPT) - bad * BS}


def test_with_digests_off_the_same_corruption_is_attached(engines: Any) -> None:
    """The positive control: the token check alone passes a block whose bytes changed."""
    decode, reader, holder, request = _read(engines, {"kv_digest": False})
    out = decode.step(worker=reader)
    local = reader.land(out, "d-1", holder)
    reader.kv["layer"][local[3]].view(-1).view(torch.uint8)[5] ^= 0x10
    decode.step(worker=reader)
    assert counters(decode, "unchecked_reads") == 1
    assert not counters(decode, "load_failures", "recompute")
    assert request.num_computed_tokens == len(PROMPT)


def test_a_read_past_its_deadline_is_stopped_recomputed_and_never_attached(engines: Any) -> None:
    decode, reader, holder, request = _read(engines)
    out = decode.step(worker=reader)
    reader.inner.connector_worker.post("d-1", 7, 8)  # NIXL's read in flight, never done
    assert request.status == WAITING_FOR_KV
    reader.clock.now += FLOOR_S / 2
    decode.step(worker=reader)
    assert request.status == WAITING_FOR_KV and not counters(decode, "abandoned_reads")
    reader.clock.now += FLOOR_S
    decode.step(worker=reader)
    assert reader.inner.connector_worker.nixl_wrapper.released == [7, 8]
    assert "d-1" not in reader.inner.connector_worker._recving_transfers
    assert counters(decode, "abandoned_reads") == 1
    assert counters(decode, "integrity_failed_blocks", "deadline") == 6
    assert counters(decode, "load_failures", "recompute") == 1
    assert request.num_computed_tokens == 0
    assert decode.step(worker=reader).num_scheduled_tokens == {"d-1": len(PROMPT)}  # prefilled here
    reader.land(out, "d-1", holder)  # a late completion of the abandoned read
    decode.step(worker=reader)
    assert counters(decode, "load_failures", "recompute") == 1  # dropped: never reported again


def test_a_read_nixl_cannot_stop_is_left_to_finish(engines: Any) -> None:
    decode, reader, _, request = _read(engines)
    decode.step(worker=reader)
    reader.inner.connector_worker.post("d-1", 7)
    reader.inner.connector_worker.nixl_wrapper.refuse = True
    reader.clock.now += 2 * FLOOR_S
    decode.step(worker=reader)
    decode.step(worker=reader)
    assert request.status == WAITING_FOR_KV
    assert counters(decode, "unabortable_reads") == 1 and not counters(decode, "abandoned_reads")


def test_a_decoders_session_offer_carries_digests_of_every_block_it_holds(engines: Any) -> None:
    """Bidirectional mode: D offers its session's KV at the end of a decode; the digests cover
    the blocks it read from P and those its decode steps wrote, the last step's included."""
    holder = PlayedWorker(seed=1)
    params = prefill(engines("prefill", {"bidirectional_kv_xfer": True}), holder)
    decode = engines("decode", {"bidirectional_kv_xfer": True})
    reader = PlayedWorker(seed=2, engine=decode)
    decode.add("d-1", PROMPT, params, max_tokens=12)  # 87 + 12 tokens: the decode fills block 5 and opens 6
    out = decode.step(worker=reader)
    reader.land(out, "d-1", holder)
    while "d-1" not in decode.finished:
        decode.step(worker=reader)
    offered = wire(decode.finished["d-1"])
    offer = decode_offer(offered[PARAMS_KEY])
    (blocks,) = offered["remote_block_ids"]
    assert len(blocks) == 7
    assert offer.kv_digests == (digest_blocks(GroupKV.of(reader.kv, ["layer"], NUM_BLOCKS), blocks),)
