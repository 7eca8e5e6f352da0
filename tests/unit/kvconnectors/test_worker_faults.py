"""The data-plane fault injector acting in kvpilot's worker layer
(:class:`~kvpilot.kvconnectors.worker.KVPilotWorker`), over real CPU tensors: each fault
ends in a check that catches it or a deadline that ends the wait, never in an attach of
bytes that were not checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.kvconnectors.faults import FaultInjection, FaultInjector, FaultKind
from kvpilot.kvconnectors.kv_digest import GroupKV, digest_blocks
from kvpilot.kvconnectors.metadata import KVPilotMetadata, ReadCheck
from kvpilot.kvconnectors.stats import counter_key
from kvpilot.kvconnectors.worker import KVPilotWorker
from tests.fakes.nixl_reads import FakeNixlInner

NUM_BLOCKS = 16
LOCAL = (3, 4, 5)
DEADLINE_S = 5.0


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Reader:
    """A reader's worker layer whose read of :data:`LOCAL` has landed intact."""

    kind: FaultKind
    stall_s: float = 60.0
    clock: Clock = field(default_factory=Clock)
    inner: FakeNixlInner = field(default_factory=FakeNixlInner)

    def __post_init__(self) -> None:
        self.kv = {"l": torch.randn(NUM_BLOCKS, 32, 4)}
        spec = FaultInjection(request_ids={"r1": self.kind}, stall_s=self.stall_s)
        self.layer = KVPilotWorker(self.inner, (("l",),), NUM_BLOCKS, True, FaultInjector(spec), self.clock)
        self.layer.register_kv_caches(self.kv)
        expected = digest_blocks(GroupKV.of(self.kv, ["l"], NUM_BLOCKS), LOCAL)  # the holder's, equal bytes
        check = ReadCheck((LOCAL,), (expected,), "xxh3_64", DEADLINE_S)
        self.layer.bind(KVPilotMetadata(inner=None, reads={"cmpl-r1-0": check}))

    def report(self, *finished: str) -> tuple[set[str], set[int]]:
        done, failed = self.layer.transfer_results(set(finished), set())
        assert not failed
        return done, self.layer.take_load_errors()

    def count(self, name: str, reason: str | None = None) -> float:
        return self.layer.take_stats().counters.get(counter_key(name, reason), 0)


def test_a_corrupted_block_is_caught_by_the_check() -> None:
    reader = Reader(FaultKind.CORRUPT_BLOCK)
    done, errors = reader.report("cmpl-r1-0")
    assert done == {"cmpl-r1-0"}
    assert errors == set(LOCAL)  # the first block differs: it and all after it are recomputed
    stats = reader.layer.take_stats().counters
    assert stats[counter_key("faults_injected", "corrupt_block")] == 1
    assert stats[counter_key("digest_mismatch_blocks")] == 1


def test_a_block_reused_for_other_tokens_is_caught_by_the_check() -> None:
    """Well-formed KV of the wrong tokens (the holder freed and reused the block before the
    read): every byte plausible, the digest still tells."""
    reader = Reader(FaultKind.REUSED_BLOCK)
    done, errors = reader.report("cmpl-r1-0")
    assert done == {"cmpl-r1-0"}
    assert torch.equal(reader.kv["l"][LOCAL[0]], reader.kv["l"][LOCAL[-1]])  # the fault acted
    assert errors == set(LOCAL)
    stats = reader.layer.take_stats().counters
    assert stats[counter_key("faults_injected", "reused_block")] == 1
    assert stats[counter_key("digest_mismatch_blocks")] == 1


def test_with_digests_off_the_fault_still_acts_and_the_read_is_attached_unchecked() -> None:
    """The positive control's engine (``kv_digest: false``): the injector damages the block it
    names, and nothing checks it (tests/e2e/test_positive_control.py shows the wrong answer)."""
    kv = {"l": torch.randn(NUM_BLOCKS, 32, 4)}
    spec = FaultInjection(request_ids={"r1": FaultKind.REUSED_BLOCK})
    layer = KVPilotWorker(FakeNixlInner(), (("l",),), NUM_BLOCKS, False, FaultInjector(spec), Clock())
    layer.register_kv_caches(kv)
    layer.bind(KVPilotMetadata(inner=None, reads={"cmpl-r1-0": ReadCheck((LOCAL,), None, "", DEADLINE_S)}))
    done, failed = layer.transfer_results({"cmpl-r1-0"}, set())
    assert done == {"cmpl-r1-0"} and not failed and layer.take_load_errors() == set()
    assert torch.equal(kv["l"][LOCAL[0]], kv["l"][LOCAL[-1]])  # the fault acted
    stats = layer.take_stats().counters
    assert stats[counter_key("faults_injected", "reused_block")] == 1
    assert stats[counter_key("unchecked_reads")] == 1


def test_a_stall_shorter_than_the_deadline_is_checked_when_it_ends() -> None:
    reader = Reader(FaultKind.STALL_READ, stall_s=2.0)
    assert reader.report("cmpl-r1-0") == (set(), set())  # held
    reader.clock.now += 2.5
    assert reader.report() == ({"cmpl-r1-0"}, set())  # released, checked, clean
    assert not reader.layer.has_reads()


def test_a_stall_past_the_deadline_is_abandoned_and_its_late_end_dropped() -> None:
    reader = Reader(FaultKind.STALL_READ, stall_s=60.0)
    assert reader.report("cmpl-r1-0") == (set(), set())
    reader.clock.now += DEADLINE_S + 0.1
    assert reader.report() == ({"cmpl-r1-0"}, set(LOCAL))
    assert reader.count("abandoned_reads") == 1
    reader.clock.now += 60.0
    assert reader.report("cmpl-r1-0") == (set(), set())  # a late report of it: never attached


def test_a_dropped_completion_ends_at_the_deadline() -> None:
    reader = Reader(FaultKind.DROP_COMPLETION)
    assert reader.report("cmpl-r1-0") == (set(), set())
    reader.clock.now += DEADLINE_S / 2
    assert reader.report() == (set(), set())
    reader.clock.now += DEADLINE_S
    done, errors = reader.report()
    assert (done, errors) == ({"cmpl-r1-0"}, set(LOCAL))
    assert reader.inner.connector_worker.nixl_wrapper.released == []  # NIXL had finished it: nothing to stop


def test_a_read_not_named_gets_no_fault() -> None:
    reader = Reader(FaultKind.CORRUPT_BLOCK)
    check = ReadCheck((LOCAL,), None, "", DEADLINE_S)
    reader.layer.bind(KVPilotMetadata(inner=None, reads={"cmpl-r2-0": check}))
    assert reader.report("cmpl-r2-0") == ({"cmpl-r2-0"}, set())
    assert reader.count("unchecked_reads") == 1


def test_a_steps_digests_are_each_requests_own() -> None:
    """The holder digests every request of a step in one pass; each gets its blocks' digests."""
    kv = {"l": torch.randn(NUM_BLOCKS, 32, 4)}
    layer = KVPilotWorker(FakeNixlInner(), (("l",),), NUM_BLOCKS, True, None, Clock())
    layer.register_kv_caches(kv)
    jobs = {"a": ((1, 2, 3),), "b": ((9,),), "c": ((),), "d": ((4, 0),)}
    layer.bind(KVPilotMetadata(inner=None, digest_jobs=jobs))
    report = layer.take_report()
    assert report is not None and report.algo == "xxh3_64"
    group = GroupKV.of(kv, ["l"], NUM_BLOCKS)
    assert report.digests == {r: ((ids[0], digest_blocks(group, ids[0])),) for r, ids in jobs.items()}
    assert layer.take_report() is None


def test_a_read_posted_after_its_abandonment_is_stopped_at_once() -> None:
    """A handshake that finished late got the abandoned read posted: stopped after start_load_kv."""
    reader = Reader(FaultKind.DROP_COMPLETION)
    nixl = reader.inner.connector_worker
    nixl.post("cmpl-r1-0", 5)
    reader.clock.now += DEADLINE_S + 1
    assert reader.report() == ({"cmpl-r1-0"}, set(LOCAL))  # abandoned: handle 5 released
    nixl._ready_requests.put(("cmpl-r1-0", object()))
    nixl._ready_requests.put(("cmpl-r9-0", object()))
    reader.layer.bind(KVPilotMetadata(inner=None))  # queued behind the handshake: dropped
    assert [nixl._ready_requests.get_nowait()[0]] == ["cmpl-r9-0"]
    nixl.post("cmpl-r1-0", 6)  # posted all the same (the handshake thread won the race)
    reader.layer.after_start_load()
    assert nixl.nixl_wrapper.released == [5, 6] and "cmpl-r1-0" not in nixl._recving_transfers
