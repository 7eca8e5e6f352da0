"""Component test of kvpilot's scheduler layer (:mod:`kvpilot.kvconnectors.scheduler`) inside
vLLM's real CPU ``Scheduler``, built from a real ``VllmConfig`` on the tiny model.

Each engine is a ``Scheduler`` with ``KVPilotConnector`` around vLLM's real
``NixlConnector`` scheduler side (it needs no NIXL agent), stepped by hand: the test
plays the model runner (one sampled token per scheduled request) and the NIXL worker
(pulls received or failed, transfer telemetry), and each pass's time on the clock
the scheduler layer times steps with. Offers are real too: a prefill
engine's ``request_finished`` stamps them and they reach the next engine the way the
router carries them, as JSON. Where only a record of the inner connector's calls can
show the point, the inner connector is the shared fake (:mod:`tests.fakes.inner_connector`).

Sizes: blocks of 16 tokens; the handoff prompt has 87 tokens (5 full blocks and a
7-token tail), which the prefill engine keeps in 6 blocks.
"""

from __future__ import annotations

import base64
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm.v1.core.sched.scheduler")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqMeta
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvpilot.kvconnectors.connector import KVPilotConnector
from kvpilot.kvconnectors.plugin import register
from kvpilot.kvconnectors.pull_params import PULL_DONE_KEY, handoff_request, with_hold
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.scheduler import step_chunks
from kvpilot.kvconnectors.stats import KVPilotStats, counter_key
from kvpilot.kvconnectors.step_rates import Chunk
from kvpilot.kvconnectors.transfer_params import DIGEST_BYTES, PARAMS_KEY
from tests.fakes.inner_connector import INNER_NAME, FakeInnerConnector
from tests.fakes.inner_connector import register as register_fake_inner

BS = 16
NUM_BLOCKS = 64
PROMPT = list(range(100, 187))
SAMPLED = 42  # the token the fake model runner samples, every step
OTHER = 1999  # a token id no prompt here holds

WAITING_FOR_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


def wire(params: dict[str, Any] | None) -> dict[str, Any]:
    """kv_transfer_params as the next engine receives them: through JSON (the API
    server's response, the router's request)."""
    assert params is not None
    loaded: dict[str, Any] = json.loads(json.dumps(params))
    return loaded


def diverge(tokens: list[int], at: int) -> list[int]:
    """``tokens`` with the one at ``at`` replaced: every block from there on differs."""
    return [OTHER if i == at else t for i, t in enumerate(tokens)]


def rejected(reason: Reason) -> str:
    return counter_key("rejected_blocks", reason.value)


def recomputed(reason: Reason) -> str:
    return counter_key("recomputed_tokens", reason.value)


@dataclass
class FakeClock:
    """The scheduler layer's clock: still, unless a step's pass takes time."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    """One engine's scheduler, stepped by hand, its connector timing its steps on
    ``clock``."""

    scheduler: Scheduler
    hasher: Callable[[Request], Any]
    clock: FakeClock
    counters: Counter[str] = field(default_factory=Counter)
    """kvpilot's counters, summed over the stats every step reported."""
    finished: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Finished request id -> the kv_transfer_params it returned."""

    @property
    def connector(self) -> KVPilotConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, KVPilotConnector)
        return connector

    def add(self, request_id: str, prompt: list[int], params: dict[str, Any] | None, max_tokens: int = 1) -> Request:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
        request = Request(request_id, list(prompt), sampling, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def step(
        self,
        *,
        received: Iterable[str] = (),
        failed: Iterable[str] = (),
        telemetry: KVPilotStats | None = None,
        pass_seconds: float = 0.0,
        worker: Callable[[SchedulerOutput], KVConnectorOutput] | None = None,
    ) -> SchedulerOutput:
        """Schedule once, then report what the model runner and the NIXL worker did:
        a sampled token per scheduled request, after ``pass_seconds`` on the clock; pulls
        ``received`` and ``failed`` (NIXL's worker lists a failed pull among the finished
        ones too); telemetry. A pass that ran returns connector output, as vLLM's model
        runner does with a connector; a step that ran nothing only when it has some.
        ``worker``, when given, plays the worker instead: it returns the step's connector output."""
        out = self.scheduler.schedule()
        self.clock.now += pass_seconds
        ids = list(out.num_scheduled_tokens)
        kv = None
        if worker is not None:
            kv = worker(out)
        elif received or failed or telemetry or ids:
            done = {*received, *failed}
            kv = KVConnectorOutput(finished_recving=done, failed_recving=set(failed), kv_connector_stats=telemetry)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[SAMPLED] for _ in ids],
            kv_connector_output=kv,
        )
        for outputs in self.scheduler.update_from_output(out, runner).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.counters.update(stats.kv_connector_stats["counters"])
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.kv_transfer_params
        return out


def recv(out: SchedulerOutput, request_id: str) -> ReqMeta | None:
    """The pull NIXL's scheduler asked its worker to make this step for ``request_id``
    (inside kvpilot's wrapper, :class:`~kvpilot.kvconnectors.metadata.KVPilotMetadata`)."""
    meta: Any = out.kv_connector_metadata.inner
    found: ReqMeta | None = meta.reqs_to_recv.get(request_id)
    return found


MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Any) -> ModelConfig:
    return ModelConfig(model=str(tiny_model_dir), dtype="bfloat16", seed=0, skip_tokenizer_init=True)


def build_engine(
    model_config: ModelConfig,
    engine_id: str,
    groups: list[KVCacheGroupSpec],
    *,
    num_blocks: int = NUM_BLOCKS,
    inner: str = "NixlConnector",
    extra: dict[str, Any] | None = None,
    load_failure: str = "fail",
) -> Engine:
    """A real ``Scheduler`` with KVPilotConnector around ``inner`` over the KV cache ``groups``
    (``num_blocks`` blocks of :data:`BS` tokens), its connector on a :class:`FakeClock`."""
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPilotConnector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_load_failure_policy=load_failure,
            kv_connector_extra_config={"inner_connector": inner, **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler = Scheduler(config, kv_cache, StructuredOutputManager(config), BS, log_stats=True)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)  # as vLLM's EngineCore does at start
    clock = FakeClock()
    connector = scheduler.connector
    assert isinstance(connector, KVPilotConnector)
    connector._scheduler_layer()._clock = clock  # vLLM builds the connector: no seam to pass it in
    return Engine(scheduler, get_request_block_hasher(BS, hash_fn), clock)


@pytest.fixture
def make_engine(model_config: ModelConfig) -> Iterator[MakeEngine]:
    register()
    register_fake_inner()
    built: list[Scheduler] = []

    def make(
        engine_id: str, *, inner: str = "NixlConnector", extra: dict[str, Any] | None = None, load_failure: str = "fail"
    ) -> Engine:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["layer"], spec)]
        engine = build_engine(model_config, engine_id, groups, inner=inner, extra=extra, load_failure=load_failure)
        built.append(engine.scheduler)
        return engine

    yield make
    for scheduler in built:
        scheduler.shutdown()


def hand_off(prefill: Engine, prompt: list[int] = PROMPT, request_id: str = "p-1") -> dict[str, Any]:
    """``prefill`` prefills ``prompt`` for a decode engine; the params it hands over."""
    prefill.add(request_id, prompt, handoff_request())
    prefill.step()
    return wire(prefill.finished[request_id])


def warm(decode: Engine, blocks: int) -> None:
    """Give ``decode`` a local prefix hit of ``blocks`` blocks of :data:`PROMPT`."""
    if blocks:
        decode.add("warm", [*PROMPT[: blocks * BS], OTHER], None)
        decode.step()  # prefilled and finished; its full blocks stay in the prefix cache


# ---------------------------------------------------------------------------- P -> D handoff


@pytest.mark.parametrize("hit", [0, 2], ids=["no-local-hit", "local-hit-2"])
def test_verified_handoff_attaches_every_block_beyond_the_local_hit(make_engine: MakeEngine, hit: int) -> None:
    params = hand_off(make_engine("prefill"))
    decode = make_engine("decode")
    warm(decode, hit)
    request = decode.add("d-1", PROMPT, params, max_tokens=2)

    out = decode.step()
    assert request.status == WAITING_FOR_KV
    assert request.num_computed_tokens == len(PROMPT)  # the local hit, then 87 - 16 * hit tokens loaded
    pull = recv(out, "d-1")
    assert pull is not None and pull.remote is not None
    assert pull.remote.block_ids == params["remote_block_ids"]  # all of P's 6 blocks: the inner plan stands
    assert [len(group) for group in pull.local_block_ids] == [6 - hit]  # paired with the end of P's list
    assert decode.counters["verified_blocks"] == 5 - hit
    assert not {k for k in decode.counters if k.startswith(("rejected_blocks", "recomputed_tokens"))}

    decode.step(received={"d-1"})
    assert decode.step().num_scheduled_tokens == {"d-1": 1}  # only the last prompt token, to sample from


def _tamper_first_digest(params: dict[str, Any]) -> list[int]:
    """Flip P's digest of block 0 in flight; D asks for P's own prompt."""
    offer = params[PARAMS_KEY]
    packed = bytearray(base64.b64decode(offer["block_digests"]))
    packed[0] ^= 0xFF
    assert len(packed) == 5 * DIGEST_BYTES
    offer["block_digests"] = base64.b64encode(bytes(packed)).decode("ascii")
    return PROMPT


@pytest.mark.parametrize(
    "tamper",
    [lambda params: diverge(PROMPT, 3), _tamper_first_digest],
    ids=["other-prompt", "tampered-digest"],
)
def test_offer_for_other_tokens_attaches_nothing(
    make_engine: MakeEngine, tamper: Callable[[dict[str, Any]], list[int]]
) -> None:
    params = hand_off(make_engine("prefill"))
    prompt = tamper(params)
    decode = make_engine("decode")
    request = decode.add("d-1", prompt, params, max_tokens=2)

    out = decode.step()
    assert out.num_scheduled_tokens == {"d-1": len(PROMPT)}  # prefilled here, all of it, at once
    assert request.status == RequestStatus.RUNNING
    pull = recv(out, "d-1")  # still sent, empty, so that P frees its blocks
    assert pull is not None and pull.remote is not None
    assert pull.remote.block_ids == [[]] and not any(pull.local_block_ids)
    mismatch = Reason.TOKEN_MISMATCH
    assert decode.counters[rejected(mismatch)] == 5
    assert decode.counters[recomputed(mismatch)] == len(PROMPT)
    assert decode.counters["verified_blocks"] == 0


@pytest.mark.parametrize(
    ("matching", "hit", "loaded", "local_blocks", "rejected_blocks"),
    [(3, 0, 48, 3, 2), (3, 1, 32, 2, 2), (1, 2, 0, 0, 3)],
    ids=["3-verified", "3-verified-1-local", "1-verified-2-local"],
)
def test_partial_verification_attaches_only_the_verified_run(
    make_engine: MakeEngine, matching: int, hit: int, loaded: int, local_blocks: int, rejected_blocks: int
) -> None:
    # P prefilled a prompt whose block `matching` differs from D's
    params = hand_off(make_engine("prefill"), diverge(PROMPT, matching * BS + 5))
    decode = make_engine("decode")
    warm(decode, hit)
    request = decode.add("d-1", PROMPT, params, max_tokens=2)

    out = decode.step()
    attached_to = max(matching, hit) * BS
    pull = recv(out, "d-1")
    assert pull is not None and pull.remote is not None
    assert pull.remote.block_ids == [params["remote_block_ids"][0][: max(matching, hit)]]  # P's first blocks only
    assert [len(group) for group in pull.local_block_ids] == ([local_blocks] if loaded else [])
    assert decode.counters["verified_blocks"] == loaded // BS
    assert decode.counters[rejected(Reason.TOKEN_MISMATCH)] == rejected_blocks
    assert decode.counters[recomputed(Reason.TOKEN_MISMATCH)] == len(PROMPT) - attached_to
    if loaded:
        assert request.status == WAITING_FOR_KV and request.num_computed_tokens == attached_to
        decode.step(received={"d-1"})
        out = decode.step()
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"d-1": len(PROMPT) - attached_to}  # the rest, prefilled here


# ---------------------------------------------------------------------------- session pulls (D -> P)

TURN1 = list(range(300, 370))  # 70 tokens: P caches 4 full blocks of it
DECODED = 40  # D's turn 1 ends with 110 tokens, 109 computed: it offers 6 blocks and a 13-token tail
NEW = list(range(500, 530))  # turn 2 = turn 1's 110 tokens and 30 new ones: 140 tokens
BIDIRECTIONAL = {"bidirectional_kv_xfer": True}


def session_turn(prefill: Engine, decode: Engine) -> tuple[dict[str, Any], list[int]]:
    """Turn 1 of a session, P->D, decoded on D; D's params offering its KV for turn 2,
    and turn 2's prompt."""
    decode_request = decode.add("t1", TURN1, hand_off(prefill, TURN1, "t1-p"), max_tokens=DECODED)
    decode.step(received={"t1"})
    while "t1" not in decode.finished:
        decode.step()
    return wire(decode.finished["t1"]), [*decode_request.all_token_ids, *NEW]


def slow_link() -> KVPilotStats:
    """What a NIXL worker reports after 8 transfers of 1 MB that took a second each."""
    nixl = NixlKVConnectorStats()
    nixl.data["transfer_duration"] = [1.0] * 8
    nixl.data["bytes_transferred"] = [1e6] * 8
    return KVPilotStats.wrap("NixlConnector", nixl)


def time_prefills(engine: Engine, per_token_s: float) -> None:
    """Four prefills of distinct lengths, each pass taking 10 ms + ``per_token_s`` per
    token on the engine's clock: enough samples for its measured prefill rate."""
    for i, n in enumerate((20, 45, 70, 130)):
        engine.add(f"timed-{i}", list(range(1000 + 200 * i, 1000 + 200 * i + n)), None)
        engine.step(pass_seconds=0.01 + per_token_s * n)


@pytest.mark.parametrize(
    ("extra", "measured", "per_token_s", "decision"),
    [
        ({"kv_recompute_threshold": 16}, None, None, "pull/threshold"),
        ({"kv_recompute_threshold": 64}, None, None, "recompute/threshold"),
        ({}, None, None, "pull/roofline"),  # the link prior: loopback
        ({}, slow_link, None, "recompute/roofline"),  # the link this engine measured
        ({}, None, 1e-3, "pull/measured"),  # 32 tokens at 1 ms each cost more than the loopback prior
        ({}, None, 1e-7, "recompute/measured"),  # 3.2 us
    ],
    ids=["threshold-16", "threshold-64", "roofline-prior", "roofline-slow-link", "measured-dear", "measured-cheap"],
)
def test_session_pull_follows_the_pull_policy(
    make_engine: MakeEngine,
    extra: dict[str, Any],
    measured: Callable[[], KVPilotStats] | None,
    per_token_s: float | None,
    decision: str,
) -> None:
    prefill = make_engine("prefill", extra={**BIDIRECTIONAL, **extra})
    if per_token_s is not None:
        time_prefills(prefill, per_token_s)
    params, prompt = session_turn(prefill, make_engine("decode", extra=BIDIRECTIONAL))
    if measured is not None:
        prefill.step(telemetry=measured())
    request = prefill.add("t2", prompt, params, max_tokens=2)

    out = prefill.step()
    # P has 4 blocks; D verified 6: the span is blocks 4 and 5 (32 tokens); the tail is recomputed
    assert prefill.counters[counter_key("pull_decisions", decision)] == 1
    assert prefill.counters[recomputed(Reason.PARTIAL_TAIL)] == 13
    pull = recv(out, "t2")
    assert pull is not None and pull.remote is not None
    d_blocks = params["remote_block_ids"][0]
    if decision.startswith("pull"):
        assert request.status == WAITING_FOR_KV and request.num_computed_tokens == 6 * BS
        assert pull.remote.block_ids == [d_blocks[:6]] and [len(g) for g in pull.local_block_ids] == [2]
        assert prefill.counters["verified_blocks"] == 2
        assert prefill.counters[recomputed(Reason.PULL_POLICY)] == 0
        assert prefill.connector.has_pending_push_work()  # the pull in flight keeps the engine stepping
        prefill.step(received={"t2"})
        assert not prefill.connector.has_pending_push_work()
        assert prefill.step().num_scheduled_tokens == {"t2": len(prompt) - 6 * BS}
    else:
        assert request.status == RequestStatus.RUNNING
        assert out.num_scheduled_tokens == {"t2": len(prompt) - 4 * BS}  # everything past P's own blocks
        assert pull.remote.block_ids == [d_blocks[:4]] and not any(pull.local_block_ids)
        assert prefill.counters["verified_blocks"] == 0
        assert prefill.counters[recomputed(Reason.PULL_POLICY)] == 2 * BS


@pytest.mark.parametrize("hold", [True, False], ids=["held", "released"])
def test_decode_holds_a_finished_step_only_when_the_router_asks(make_engine: MakeEngine, hold: bool) -> None:
    """Bidirectional D pins a finished step's blocks for P's pull unless its handoff says
    ``kvpilot_hold: false``: then they go back to the free pool at once and D offers none."""
    prefill, decode = make_engine("prefill", extra=BIDIRECTIONAL), make_engine("decode", extra=BIDIRECTIONAL)
    pool = decode.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    decode.add("t1", TURN1, with_hold(hand_off(prefill, TURN1, "t1-p"), hold), max_tokens=DECODED)
    decode.step(received={"t1"})
    while "t1" not in decode.finished:
        decode.step()
    offered = decode.finished["t1"] or {}
    if hold:
        assert offered["remote_block_ids"][0] and PARAMS_KEY in offered
        assert pool.get_num_free_blocks() < free_before
        assert decode.counters["holds_released"] == 0
    else:
        assert not any(offered.get("remote_block_ids") or ()) and PARAMS_KEY not in offered
        assert pool.get_num_free_blocks() == free_before  # freed, still cached: evictable
        assert decode.counters["holds_released"] == 1


def test_failed_session_pull_is_prefilled_not_pulled_again(make_engine: MakeEngine) -> None:
    """vLLM's NIXL scheduler would count a processed pull's tokens as a new load
    without starting one; the request would wait forever (PULL_DONE_KEY)."""
    extra = {**BIDIRECTIONAL, "kv_recompute_threshold": 16}
    prefill = make_engine("prefill", extra=extra, load_failure="recompute")
    params, prompt = session_turn(prefill, make_engine("decode", extra=BIDIRECTIONAL))
    request = prefill.add("t2", prompt, params, max_tokens=2)
    assert recv(prefill.step(), "t2") is not None and request.status == WAITING_FOR_KV

    prefill.step(failed={"t2"})  # the worker: the pull failed; vLLM recomputes it
    assert request.kv_transfer_params is not None and request.kv_transfer_params[PULL_DONE_KEY]
    out = prefill.step()
    assert out.num_scheduled_tokens == {"t2": len(prompt) - 4 * BS}  # prefilled past P's own blocks
    assert request.status == RequestStatus.RUNNING
    assert recv(out, "t2") is None
    assert prefill.counters[counter_key("load_failures", "recompute")] == 1
    assert prefill.counters[recomputed(Reason.LOAD_FAILED)] == 2 * BS


# ---------------------------------------------------------------------------- the inner connector's part


@pytest.mark.parametrize("case", ["whole-offer", "3-blocks", "pull-done"])
def test_inner_connector_plans_only_a_wholly_verified_offer(make_engine: MakeEngine, case: str) -> None:
    params = hand_off(make_engine("prefill", inner=INNER_NAME))
    decode = make_engine("decode", inner=INNER_NAME)
    fake = decode.connector.inner
    assert isinstance(fake, FakeInnerConnector)
    fake.matched = (23, True)  # no block arithmetic gives 23: only the inner connector's answer does
    prompt = diverge(PROMPT, 3 * BS) if case == "3-blocks" else PROMPT
    if case == "pull-done":
        params[PULL_DONE_KEY] = True
    request = decode.add("d-1", prompt, params, max_tokens=2)

    decode.step()
    asked = fake.asked("get_num_new_matched_tokens", "d-1")
    (alloc,) = fake.asked("update_state_after_alloc", "d-1")
    assert alloc.params is not None
    if case == "whole-offer":
        assert [c.num_tokens for c in asked] == [0]
        assert request.num_computed_tokens == 23 and request.status == WAITING_FOR_KV
        assert alloc.num_tokens == 23 and alloc.params["remote_block_ids"] == params["remote_block_ids"]
    elif case == "3-blocks":
        assert asked == []
        assert request.num_computed_tokens == 3 * BS and request.status == WAITING_FOR_KV
        assert alloc.num_tokens == 3 * BS and alloc.params["remote_block_ids"] == [params["remote_block_ids"][0][:3]]
    else:
        assert asked == []
        assert request.status == RequestStatus.RUNNING and alloc.num_tokens == 0


# ---------------------------------------------------------------------------- step timing


def test_each_step_is_read_with_its_contexts_and_timed_on_the_clock(make_engine: MakeEngine) -> None:
    """vLLM's scheduler output names each request's tokens before the step advances its
    count; a decode rides along the next prefill; decode-only steps are not sampled."""
    engine = make_engine("prefill")
    engine.add("a", list(range(100, 140)), None, max_tokens=3)
    first = engine.step(pass_seconds=0.05)
    assert step_chunks(first) == [Chunk(40, 0, True)]
    decode_only = engine.step(pass_seconds=0.5)
    assert step_chunks(decode_only) == [Chunk(1, 40, False)]
    engine.add("b", list(range(500, 600)), None)
    mixed = engine.step(pass_seconds=0.07)
    assert sorted(step_chunks(mixed), key=lambda c: c.tokens) == [Chunk(1, 41, False), Chunk(100, 0, True)]
    rates = engine.connector._scheduler_layer()._steps
    assert len(rates) == 2  # the prefill, the mixed step; not the decode-only one
    for i, n in enumerate((20, 60)):
        engine.add(f"c-{i}", list(range(800 + 100 * i, 800 + 100 * i + n)), None)
        engine.step(pass_seconds=0.03 + 0.001 * n)
    measured = rates.measured()
    assert measured is not None and measured.samples == 4
