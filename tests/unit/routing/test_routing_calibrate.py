"""kvpilot.routing.serve.calibrate: the router times its engines before serving, through an
upstream whose engine takes a known time, and its first predictions are those times."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvpilot.policies.measured_fit import MIN_SAMPLES
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.routing.config import Role, ServerConfig, Worker
from kvpilot.routing.decide.rates import PrefillPath, Prior, RateEstimator
from kvpilot.routing.health.engine_load import EngineLoad, RateCounters
from kvpilot.routing.serve.calibrate import WARM_PASSES, Calibrator, chosen_workers, vocab_size
from kvpilot.routing.serve.upstream import EngineRequest, PrefillOutcome, UpstreamError

PREFILL_S_PER_TOKEN = 2e-5  # 4,096 tokens: 82 ms
PREFILL_FIXED_S = 0.004
STEP_S = 0.003
STEP_S_PER_STREAM = 0.001
HANDOFF_S = 0.02
"""From D's call with P's params to its first token (the read, D's scheduling)."""
COLD_FACTOR = 3.0
"""An engine's first prefill of a length takes this many times longer (a cold engine's)."""


class TimedEngine:
    """An upstream whose engines prefill ``PREFILL_FIXED_S + PREFILL_S_PER_TOKEN`` a new token
    (a prompt it has seen before is cached: only the rest is new) and take ``STEP_S +
    STEP_S_PER_STREAM`` per stream running for each decode step; a worker's first prefill of
    a number of new tokens takes :data:`COLD_FACTOR` times as long; D answers a handoff
    :data:`HANDOFF_S` after its call."""

    def __init__(self, broken: frozenset[str] = frozenset(), deferred: bool = False) -> None:
        self.seen: list[tuple[int, ...]] = []
        self.running = 0
        self.bodies: list[dict[str, Any]] = []
        self.broken = broken
        self.deferred = deferred
        self.held: set[tuple[int, ...]] = set()
        """Prompts whose KV a prefill worker holds for a decode worker to read."""
        self.warm: set[tuple[str, int]] = set()
        """(worker, new tokens) prefilled once already."""

    def _prefill_s(self, worker: Worker, new: int) -> float:
        cold = (worker.name, new) not in self.warm
        self.warm.add((worker.name, new))
        return (PREFILL_FIXED_S + PREFILL_S_PER_TOKEN * new) * (COLD_FACTOR if cold else 1.0)

    def _cached(self, prompt: tuple[int, ...]) -> int:
        return max((len(p) for p in self.seen if prompt[: len(p)] == p), default=0)

    @asynccontextmanager
    async def stream(
        self, worker: Worker, request: EngineRequest, handoff: object
    ) -> AsyncIterator[AsyncIterator[list[str]]]:
        if worker.name in self.broken:
            raise UpstreamError(worker, 503, "down")
        body = request.body
        self.bodies.append(body)
        prompt = tuple(body["prompt"])
        new = len(prompt) - self._cached(prompt)
        self.seen.append(prompt)
        prefill_s = self._prefill_s(worker, new)
        if handoff is not None:  # D reads P's KV of the prompt: P frees it
            assert worker.role is Role.DECODE and prompt in self.held
            self.held.discard(prompt)
            prefill_s = HANDOFF_S

        async def events() -> AsyncIterator[list[str]]:
            self.running += 1
            try:
                await asyncio.sleep(prefill_s)
                yield [json.dumps({"choices": [{"text": "a"}]})]
                for _ in range(body["max_tokens"] - 1):
                    await asyncio.sleep(STEP_S + STEP_S_PER_STREAM * self.running)
                    yield [json.dumps({"choices": [{"text": "a"}]})]
                yield ["[DONE]"]
            finally:
                self.running -= 1

        yield events()

    async def prefill(self, worker: Worker, request: EngineRequest, params: dict[str, Any], timeout_s: float) -> Any:
        """P's handoff: the prefill of what it has not seen, then params naming it for D
        (or, with ``deferred``, at once: P would prefill within D's call)."""
        body = request.body
        self.bodies.append({**body, "kv_transfer_params": params})
        if self.deferred:
            return PrefillOutcome({"prefill": worker.name}, deferred=True)
        prompt = tuple(body["prompt"])
        new = len(prompt) - self._cached(prompt)
        self.seen.append(prompt)
        await asyncio.sleep(self._prefill_s(worker, new))
        self.held.add(prompt)
        return PrefillOutcome({"held_by": worker.name, "prompt": len(prompt)})


def _rates() -> RateEstimator:
    prior = Prior(model_preset("llama-8b"), kv_format_preset("bf16"), hardware_preset("h100"), link_preset("rdma"))
    return RateEstimator(lambda _: prior)


def _worker(name: str, role: Role = Role.COLOCATED) -> Worker:
    return Worker(name=name, role=role, url=f"http://127.0.0.1:1/{name}")


def test_the_first_predictions_are_the_engines_measured_times() -> None:
    """Warm times, not a cold engine's first prefills: each probe runs once untimed first."""
    rates, engine = _rates(), TimedEngine()
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[256, 1024, 4096])
    done = asyncio.run(Calibrator(engine, rates, config, seed=1).run([_worker("w0"), _worker("w1")]))  # type: ignore[arg-type]
    assert set(done.prefill) == {"w0"}  # one per role: w1 is predicted from w0
    assert [(new, cached) for new, cached, _ in done.prefill["w0"]] == [
        (256, 0),
        (64, 256),
        (1024, 0),
        (64, 1024),
        (4096, 0),
        (64, 4096),
    ]
    assert all(b["ignore_eos"] and b["stream"] for b in engine.bodies)  # prefills timed by their first event
    for worker in ("w0", "w1"):
        estimate = rates.prefill(worker, 2048, 0)
        assert estimate.measured_s is not None and estimate.measured_by == "w0"
        want = PREFILL_FIXED_S + PREFILL_S_PER_TOKEN * 2048
        assert want / 1.5 < estimate.measured_s < want * 1.5 + 0.01  # asyncio's timer slack
    alone = [step for streams, step in done.decode["w0"] if streams == 1]
    beside = [step for streams, step in done.decode["w0"] if streams == 4]
    assert len(alone) == 1 and len(beside) == 4  # a sample per stream
    assert min(beside) > max(alone)  # four streams step slower than one
    assert rates.decode_step("w1", 2).measured_s is not None


def test_no_prompt_over_the_engines_limit_and_p_probed_by_handoffs_that_d_reads() -> None:
    """P is timed as the proxy times it, on handoffs (a plain request costs P less than
    one); D reads each, so P holds no probe's KV afterwards."""
    engine, rates = TimedEngine(), _rates()
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[256, 1024, 4096], max_prompt_tokens=2048)
    workers = [_worker("p", Role.PREFILL), _worker("d", Role.DECODE)]
    done = asyncio.run(Calibrator(engine, rates, config, seed=1).run(workers))  # type: ignore[arg-type]
    assert [new for new, _, _ in done.prefill["d"]] == [256, 64, 1024, 64]
    assert [(new, cached) for new, cached, _ in done.prefill["p"]] == [(256, 0), (64, 256), (1024, 0), (64, 1024)]
    assert "p" not in done.decode and not engine.held
    handoffs = [b for b in engine.bodies if "kv_transfer_params" in b]
    assert len(handoffs) == 4 * (WARM_PASSES + 1) and all(b["kv_transfer_params"]["do_remote_decode"] for b in handoffs)
    assert rates.prefill("p", 1500, 0).measured_by == "p"
    assert max(len(b["prompt"]) for b in engine.bodies) <= 2048


def test_each_path_s_overhead_is_calibrated_from_its_probes_first_tokens() -> None:
    """A handoff's first token comes P's call plus :data:`HANDOFF_S` after it is sent: what
    the remote path adds beyond P's prefill and D's first step is measured before the first
    request, as the traffic's residuals measure it later."""
    engine, rates = TimedEngine(), _rates()
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[256, 1024])
    workers = [_worker("p", Role.PREFILL), _worker("d", Role.DECODE)]
    done = asyncio.run(Calibrator(engine, rates, config, seed=1).run(workers))  # type: ignore[arg-type]
    assert done.overheads == 8  # four local probes on D, four handoffs
    remote, local = rates.overhead("d", PrefillPath.REMOTE), rates.overhead("d", PrefillPath.LOCAL)
    first_step = rates.decode_step("d", 1).seconds
    assert remote.measured_by == "d" and remote.measured_s is not None
    assert HANDOFF_S - first_step - 0.003 < remote.measured_s < HANDOFF_S - first_step + 0.003  # timer slack
    assert local.measured_s is not None and abs(local.measured_s) < 0.003 + first_step  # a local probe adds nothing
    for _ in range(MIN_SAMPLES):
        rates.observe_overhead("d", PrefillPath.REMOTE, 0.1)
    assert rates.overhead("d", PrefillPath.REMOTE).measured_s == pytest.approx(0.1)  # the traffic's, once it has enough


def test_a_p_that_prefills_within_d_s_call_is_not_probed() -> None:
    """Beside Dynamo's frontend P's handoff is deferred: its prefill has no time of its own."""
    engine = TimedEngine(deferred=True)
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[256])
    workers = [_worker("p", Role.PREFILL), _worker("d", Role.DECODE)]
    done = asyncio.run(Calibrator(engine, _rates(), config, seed=1).run(workers))  # type: ignore[arg-type]
    assert done.prefill["p"] == [] and len(done.prefill["d"]) == 2


def test_a_worker_that_fails_is_skipped_and_the_others_are_calibrated() -> None:
    engine = TimedEngine(broken=frozenset({"d0"}))
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[256])
    workers = [_worker("d0", Role.DECODE), _worker("c0")]
    done = asyncio.run(Calibrator(engine, _rates(), config, seed=1).run(workers))  # type: ignore[arg-type]
    assert done.prefill["d0"] == [] and len(done.prefill["c0"]) == 2


def test_chosen_workers_and_the_vocabulary(tmp_path: Path) -> None:
    workers = [_worker("p0", Role.PREFILL), _worker("p1", Role.PREFILL), _worker("d0", Role.DECODE)]
    assert [w.name for w in chosen_workers(workers, 1)] == ["p0", "d0"]
    assert chosen_workers(workers, 0) == []
    (tmp_path / "config.json").write_text('{"vocab_size": 500}')
    assert vocab_size(str(tmp_path)) == 500 and vocab_size(str(tmp_path / "none")) == 32000


@pytest.mark.parametrize("key", ["calibration_prompt_tokens", "calibration_decode_streams"])
def test_a_count_below_one_is_refused(key: str) -> None:
    from kvpilot.routing.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        ServerConfig(**{key: [4, 0]})


class MetricsEngine(TimedEngine):
    """A :class:`TimedEngine` that also counts its prefills as vLLM's ``/metrics`` do: the
    engine's own prefill time, without the HTTP around it (here: half the TTFT)."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = RateCounters()

    @asynccontextmanager
    async def stream(
        self, worker: Worker, request: EngineRequest, handoff: object
    ) -> AsyncIterator[AsyncIterator[list[str]]]:
        prompt = tuple(request.token_ids)
        new = len(prompt) - self._cached(prompt)
        async with super().stream(worker, request, handoff) as events:
            yield events
        c = self.counters
        self.counters = dataclasses.replace(
            c,
            prefill_seconds=c.prefill_seconds + (PREFILL_FIXED_S + PREFILL_S_PER_TOKEN * new) / 2,
            prefill_requests=c.prefill_requests + 1,
            computed_tokens=c.computed_tokens + new,
            cached_tokens=c.cached_tokens + len(prompt) - new,
        )

    async def read(self, worker: Worker) -> EngineLoad:
        return EngineLoad(running=0, waiting=0, kv_usage=0.0, at=0.0, rates=self.counters)


def test_a_worker_timed_by_its_metrics_is_calibrated_by_them() -> None:
    """D's traffic is timed by its ``/metrics`` (engine time, without the HTTP around it):
    so are its probes, so one fit never mixes two measures."""
    rates, engine = _rates(), MetricsEngine()
    config = ServerConfig(calibration_workers=1, calibration_prompt_tokens=[1024, 4096], calibration_decode_streams=[])
    done = asyncio.run(
        Calibrator(engine, rates, config, seed=1, read_metrics=engine.read).run([_worker("d", Role.DECODE)])
    )  # type: ignore[arg-type]
    by_metrics = {new: seconds for new, _, seconds in done.prefill["d"]}
    assert by_metrics[4096] == pytest.approx((PREFILL_FIXED_S + PREFILL_S_PER_TOKEN * 4096) / 2)
    assert by_metrics[64] == pytest.approx((PREFILL_FIXED_S + PREFILL_S_PER_TOKEN * 64) / 2)
