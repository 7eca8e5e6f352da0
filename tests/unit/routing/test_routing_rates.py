"""The measured-rates estimator: the roofline prior until enough samples, then the fit (pure)."""

from __future__ import annotations

import json

import pytest

from kvpilot.policies.measured_fit import MIN_SAMPLES, WINDOW, attention_pairs
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.routing.config import (
    FALLBACK_MODEL_PRESET,
    ConfigError,
    DisaggregationConfig,
    Role,
    RouterConfig,
    ServerConfig,
    prior_model,
)
from kvpilot.routing.decide.rates import (
    PREFILL_TIMEOUT_FACTOR,
    Estimate,
    PrefillPath,
    Prior,
    RateEstimator,
    RolePriors,
    observe_interval,
    predict_ttft,
)
from kvpilot.routing.health.engine_load import EngineLoad, RateCounters
from kvpilot.routing.health.pair_health import TransferCounters

LOCAL, REMOTE = PrefillPath.LOCAL, PrefillPath.REMOTE
PRIOR = Prior(model_preset("llama-8b"), kv_format_preset("bf16"), hardware_preset("h100"), link_preset("rdma"))


def estimator(**kwargs: int) -> RateEstimator:
    return RateEstimator(lambda _engine: PRIOR, **kwargs)


def cpu_prefill(new: int, cached: int) -> float:
    """A made-up slow box: 20 ms fixed, 2 ms a token, 1 us per attention pair."""
    return 0.02 + 0.002 * new + 1e-6 * attention_pairs(new, cached)


@pytest.mark.parametrize(
    ("samples", "query", "expect_measured"),
    [
        ([], (100, 0), None),  # no sample: the prior
        ([(100, 0)] * (MIN_SAMPLES + 2), (200, 0), None),  # one value of n: cannot fit a rate
        ([(50, 0), (100, 0), (200, 64)], (400, 0), None),  # too few samples
        ([(50, 0), (100, 0), (200, 64), (400, 512)], (300, 1000), cpu_prefill(300, 1000)),
        ([(32, 0), (64, 32), (128, 64), (256, 0), (512, 2048), (1024, 0)], (1500, 30000), cpu_prefill(1500, 30000)),
    ],
)
def test_prefill_moves_from_the_prior_to_the_fit(samples, query, expect_measured):
    rates = estimator()
    for new, cached in samples:
        rates.observe_prefill("d", new, cached, cpu_prefill(new, cached))
    got = rates.prefill("d", *query)
    assert got.prior_s == pytest.approx(PRIOR.prefill_s(*query))
    assert got.samples == len(samples)
    if expect_measured is None:
        assert got.measured_s is None and got.seconds == got.prior_s
    else:
        assert got.measured_s == pytest.approx(expect_measured, rel=1e-6)
        assert got.seconds == got.measured_s


@pytest.mark.parametrize(
    ("truth", "expect"),
    [
        # linear in n, no attention term: the attention coefficient is not negative noise
        (lambda n, c: 0.002 * n, (0.0, 0.002, 0.0)),
        # a fixed cost falling with n would need a negative slope: the fit keeps coefficients >= 0
        (lambda n, c: 0.5 + 0.001 * n, (0.5, 0.001, 0.0)),
    ],
)
def test_prefill_coefficients_are_non_negative(truth, expect):
    rates = estimator()
    for new, cached in ((10, 0), (20, 0), (40, 0), (80, 0), (160, 0)):
        rates.observe_prefill("p", new, cached, truth(new, cached))
    learned = rates.learned()["p"]["prefill"]
    assert learned is not None
    assert tuple(learned.values()) == pytest.approx(expect, abs=1e-9)


def test_the_window_forgets_old_samples():
    """An engine that got 10x slower is predicted slow once the window holds only new samples."""
    rates = estimator()
    for i in range(WINDOW):
        rates.observe_prefill("d", 10 + i, 0, 0.001 * (10 + i))
    assert rates.prefill("d", 100, 0).seconds == pytest.approx(0.1)
    for i in range(WINDOW):
        rates.observe_prefill("d", 10 + i, 0, 0.01 * (10 + i))
    assert rates.prefill("d", 100, 0).seconds == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("samples", "streams", "expect"),
    [
        ([], 4, None),
        ([(1, 0.03), (2, 0.04), (4, 0.06), (8, 0.10)], 6, 0.08),  # 20 ms + 10 ms per stream
        ([(1, 0.03), (2, 0.04), (4, 0.06), (8, 0.10)], 0, 0.03),  # at least the new request's own stream
    ],
)
def test_decode_step_by_running_streams(samples, streams, expect):
    rates = estimator()
    for b, step in samples:
        rates.observe_decode("d", b, step)
    got = rates.decode_step("d", streams)
    assert got.prior_s == pytest.approx(PRIOR.decode_step_s(max(1, streams)))
    assert got.measured_s == (None if expect is None else pytest.approx(expect))


@pytest.mark.parametrize(
    ("rows", "tokens", "expect"),
    [
        ([], 1000, None),
        # (reads, tokens, seconds): 5 ms a read + 10 us a token
        ([(1, 100, 0.006), (2, 400, 0.014), (1, 1000, 0.015), (3, 3000, 0.045)], 2000, 0.025),
        ([(1, 100, 0.006), (2, 400, 0.014), (1, 1000, 0.015), (3, 3000, 0.045)], 0, 0.0),
    ],
)
def test_kv_read_rate_per_reader(rows, tokens, expect):
    rates = estimator()
    for reads, n, seconds in rows:
        rates.observe_transfer("d", reads, n, seconds, nbytes=n * 1000)
    got = rates.transfer("d", tokens)
    assert got.prior_s == pytest.approx(PRIOR.transfer_s(tokens))
    assert got.measured_s == (None if expect is None else pytest.approx(expect))
    borrowed = rates.transfer("p", tokens)  # a reader not yet measured: the measured one's fit
    assert borrowed.measured_s == got.measured_s and borrowed.measured_by == ("d" if expect is not None else None)


def load(at: float, running: float = 0, reads: float = 0, read_s: float = 0, **rates: float) -> EngineLoad:
    return EngineLoad(
        running, 0, 0.1, at, TransferCounters(transfer_seconds=read_s, transfers=reads), RateCounters(**rates)
    )


def test_an_interval_of_counters_becomes_samples():
    rates = estimator(min_samples=1)
    before = load(0.0)
    after = load(
        5.0,
        running=3,
        reads=2,
        read_s=0.02,
        prefill_seconds=1.0,
        prefill_requests=4,
        computed_tokens=400,
        cached_tokens=128,
        decode_step_seconds=0.5,
        decode_steps=10,
    )
    observe_interval(rates, "d", before, after)
    assert rates.decode_step("d", 3).samples == 1
    assert rates.prefill("d", 100, 32).samples == 1  # the mean request: 100 new after 32 cached, 0.25 s
    assert rates.transfer("d", 10).samples == 0  # reads but no tokens loaded: not a usable sample

    loaded = load(
        10.0,
        reads=3,
        read_s=0.03,
        prefill_seconds=2.0,
        prefill_requests=5,
        computed_tokens=400,
        cached_tokens=128,
        external_tokens=64,
        decode_step_seconds=0.5,
        decode_steps=10,
    )
    observe_interval(rates, "d", after, loaded)  # KV loaded this interval: its prefill time is not a prefill
    assert rates.prefill("d", 100, 32).samples == 1
    assert rates.transfer("d", 64).samples == 1

    observe_interval(rates, "d", loaded, load(15.0))  # counters went down: the engine restarted
    assert (rates.prefill("d", 1, 0).samples, rates.transfer("d", 1).samples) == (1, 1)


def test_prefill_false_leaves_the_prefill_to_the_routers_own_timing():
    rates = estimator()
    observe_interval(rates, "p", load(0.0), load(5.0, prefill_seconds=1.0, prefill_requests=2, computed_tokens=10))
    assert rates.prefill("p", 5, 0).samples == 1
    observe_interval(
        rates, "p", load(0.0), load(5.0, prefill_seconds=1.0, prefill_requests=2, computed_tokens=10), prefill=False
    )
    assert rates.prefill("p", 5, 0).samples == 1


def test_the_first_poll_is_a_baseline():
    rates = estimator(min_samples=1)
    rates.observe_sample("d", load(5.0, running=2, decode_step_seconds=9.0, decode_steps=100))
    assert rates.decode_step("d", 2).samples == 0  # counters since the engine started are not one interval
    rates.observe_sample("d", load(10.0, running=2, decode_step_seconds=9.5, decode_steps=110))
    rates.observe_sample("d", load(15.0, running=6, decode_step_seconds=10.2, decode_steps=120))
    assert rates.decode_step("d", 3).measured_s == pytest.approx(0.06)  # 50 ms at 2 streams, 70 ms at (2 + 6) / 2
    rates.observe_sample("d", load(20.0, running=0, decode_step_seconds=10.5, decode_steps=130))
    assert rates.decode_step("d", 3).samples == 3  # idle at the poll: 30 ms a step at 3 streams, the polls' mean


def test_role_priors_come_from_the_disaggregation_presets():
    cfg = DisaggregationConfig(p_hardware="b200", d_hardware="h100")
    priors = RolePriors.from_config(cfg, model_preset("llama-8b"))
    assert priors.of(Role.PREFILL).hardware == hardware_preset("b200")
    assert priors.of(Role.DECODE).hardware == priors.of(None).hardware == hardware_preset("h100")
    with pytest.raises(ConfigError, match="disaggregation"):
        RolePriors.from_config(DisaggregationConfig(d_hardware="abacus"), model_preset("llama-8b"))


def test_the_prior_prices_the_served_model_unless_a_preset_is_named(tmp_path):
    hf = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    served = RouterConfig(server=ServerConfig(model_dir=str(tmp_path)))
    assert prior_model(served).num_layers == 4
    named = RouterConfig(
        server=ServerConfig(model_dir=str(tmp_path)), disaggregation=DisaggregationConfig(model_preset="llama-70b")
    )
    assert prior_model(named) == model_preset("llama-70b")
    assert prior_model(RouterConfig()) == model_preset(FALLBACK_MODEL_PRESET)
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    assert prior_model(RouterConfig(server=ServerConfig(model_dir=str(tokenizer_only)))) == model_preset(
        FALLBACK_MODEL_PRESET
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"server\.model_dir.*hidden_size: missing"):
        prior_model(served)
    with pytest.raises(ConfigError, match=r"disaggregation\.model_preset"):
        prior_model(RouterConfig(disaggregation=DisaggregationConfig(model_preset="gpt-9")))


@pytest.mark.parametrize(
    ("transfer_tokens", "expect_transfer"),
    [(0, 0.0), (1000, 0.005 + 1e-5 * 1000)],  # a local prefill reads nothing
)
def test_predicted_ttft_sums_queue_prefill_transfer_and_first_step(transfer_tokens, expect_transfer):
    rates = estimator()
    for new in (10, 20, 40, 80):
        rates.observe_prefill("p", new, 0, 0.01 + 0.001 * new)
    for b in (1, 2, 3, 4):
        rates.observe_decode("d", b, 0.02 + 0.01 * b)
    for reads, n in ((1, 100), (2, 400), (1, 1000), (3, 3000)):
        rates.observe_transfer("d", reads, n, 0.005 * reads + 1e-5 * n)
    got = predict_ttft(rates, "p", "d", new=100, cached=0, queued=50, transfer_tokens=transfer_tokens, streams=2)
    assert got.queue.seconds == pytest.approx(0.06)
    assert got.prefill.seconds == pytest.approx(0.11)
    assert got.transfer.seconds == pytest.approx(expect_transfer)
    assert got.first_step.seconds == pytest.approx(0.05)  # 3 streams: the 2 running and this one
    assert got.seconds == pytest.approx(0.06 + 0.11 + expect_transfer + 0.05)
    assert got.prior_s == pytest.approx(
        PRIOR.prefill_s(50, 0) + PRIOR.prefill_s(100, 0) + PRIOR.transfer_s(transfer_tokens) + PRIOR.decode_step_s(3)
    )


@pytest.mark.parametrize(
    ("measured", "floor", "expect"),
    [
        (False, 30.0, 30.0),  # the prior of an H100 is far below the floor: today's timeout
        (True, 30.0, 3 * 17.0),  # a slow box measured: 3 x (queue 0 + prefill 17 s)
        (True, 60.0, 60.0),
    ],
)
def test_prefill_timeout_is_k_times_the_predicted_prefill_with_a_floor(measured, floor, expect):
    rates = estimator()
    if measured:
        for new in (100, 200, 400, 800):
            rates.observe_prefill("p", new, 0, 0.01 * new)
    got = predict_ttft(rates, "p", "d", new=1700, cached=0, queued=0, transfer_tokens=1700, streams=0)
    assert got.prefill_timeout_s(floor) == pytest.approx(expect)
    assert PREFILL_TIMEOUT_FACTOR == 3.0


def test_an_engine_not_yet_measured_borrows_the_most_measured_engine_s_fit():
    """P never answered in time; D's local prefills were measured: P is predicted from D's."""
    rates = estimator()
    assert rates.prefill("p", 100, 0).measured_by is None
    for new in (10, 20, 40, 80):
        rates.observe_prefill("d", new, 0, 0.01 * new)
    for new in (10, 20, 40):  # too few of its own
        rates.observe_prefill("p", new, 0, 0.002 * new)
    got = rates.prefill("p", 100, 0)
    assert (got.measured_by, got.samples) == ("d", 4) and got.measured_s == pytest.approx(1.0)
    rates.observe_prefill("p", 80, 0, 0.16)
    got = rates.prefill("p", 100, 0)
    assert (got.measured_by, got.measured_s) == ("p", pytest.approx(0.2))  # its own fit from the fourth sample


def test_decode_steps_timed_at_one_stream_count_fit_their_mean():
    """A session served one step at a time is always polled at one running stream: the
    step's measured time, not the prior's, answers at any count (no per-stream term)."""
    rates = RateEstimator(lambda _engine: PRIOR)
    for step_s in (0.008, 0.010, 0.012, 0.010):
        rates.observe_decode("d", 1, step_s)
    assert rates.decode_step("d", 1).measured_s == pytest.approx(0.010)
    assert rates.decode_step("d", 4).measured_s == pytest.approx(0.010)
    for new in (100, 100, 100, 100):
        rates.observe_prefill("p", new, 0, 0.05)
    assert rates.prefill("p", 200, 0).measured_s is None  # one prompt length says nothing of another


def test_the_overhead_is_the_median_residual_of_the_decode_worker_else_the_most_sampled():
    rates = RateEstimator(lambda _engine: PRIOR)
    assert rates.overhead("d1", REMOTE) == Estimate(0.0, None, 0)
    for residual in (0.010, 0.012, 0.5, 0.011):  # one outlier: the median ignores it
        rates.observe_overhead("d1", REMOTE, residual)
    assert rates.overhead("d1", REMOTE).measured_s == pytest.approx(0.0115)
    assert rates.overhead("d2", REMOTE).measured_by == "d1"  # d2 not yet timed: d1's
    for _ in range(MIN_SAMPLES):
        rates.observe_overhead("d2", REMOTE, -0.004)  # faster than modelled: the model is corrected
    assert rates.overhead("d2", REMOTE) == Estimate(0.0, -0.004, MIN_SAMPLES, "d2")
    prediction = predict_ttft(rates, "p", "d1", new=10, cached=0, queued=0, transfer_tokens=0, streams=0)
    assert prediction.overhead.measured_s == pytest.approx(0.0115)
    assert prediction.seconds == pytest.approx(prediction.modelled_s + 0.0115)


def test_a_local_prefill_is_never_priced_with_the_remote_path_s_overhead():
    """A remote prefill's residual holds P's call and the handoff, which a prefill on D
    does not pay: seen on an AMX box, where a 45 ms remote overhead priced 36 ms local
    steps at 2.3x."""
    rates = RateEstimator(lambda _engine: PRIOR)
    for _ in range(MIN_SAMPLES):
        rates.observe_overhead("d1", REMOTE, 0.045)
    local = predict_ttft(rates, "d1", "d1", new=10, cached=0, queued=0, transfer_tokens=0, streams=0)
    assert local.overhead == Estimate(0.0, None, 0)
    assert local.seconds == pytest.approx(local.modelled_s)
    for _ in range(MIN_SAMPLES):
        rates.observe_overhead("d1", LOCAL, 0.002)
    local = predict_ttft(rates, "d1", "d1", new=10, cached=0, queued=0, transfer_tokens=0, streams=0)
    remote = predict_ttft(rates, "p", "d1", new=10, cached=0, queued=0, transfer_tokens=10, streams=0)
    assert (local.overhead.measured_s, remote.overhead.measured_s) == pytest.approx((0.002, 0.045))
    assert PrefillPath.of("d1", "d1") is LOCAL and PrefillPath.of("p", "d1") is REMOTE


def test_a_negative_overhead_corrects_the_model_but_never_below_the_first_step():
    """A prefill on D priced by P's fit (P's call included) is overpriced: D's local
    answers teach a negative overhead, and the prediction never drops below D's first step."""
    rates = RateEstimator(lambda _engine: PRIOR)
    for new in (100, 200, 300, 400):
        rates.observe_prefill("p", new, 0, 0.2 + 0.001 * new)
    for _ in range(MIN_SAMPLES):
        rates.observe_decode("d1", 1, 0.02)
        rates.observe_overhead("d1", LOCAL, -0.15)
    local = predict_ttft(rates, "d1", "d1", new=300, cached=0, queued=0, transfer_tokens=0, streams=0)
    assert local.prefill.measured_by == "p"
    assert local.seconds == pytest.approx(local.modelled_s - 0.15)
    for _ in range(MIN_SAMPLES):
        rates.observe_overhead("d1", LOCAL, -5.0)
    local = predict_ttft(rates, "d1", "d1", new=300, cached=0, queued=0, transfer_tokens=0, streams=0)
    assert local.seconds == pytest.approx(local.first_step.seconds)


def test_the_overhead_is_learned_only_against_measured_terms():
    """Against the prior's terms a residual is the prior's error: a fresh fleet's warm-up
    would teach the whole TTFT as overhead. No work counts as measured (0 s either way)."""
    rates = RateEstimator(lambda _engine: PRIOR)
    fresh = predict_ttft(rates, "p", "d1", new=100, cached=0, queued=0, transfer_tokens=100, streams=0)
    assert not fresh.modelled_measured
    for new in (100, 200, 300, 400):
        rates.observe_prefill("p", new, 0, 0.01 * new)
    for tokens in (100, 200, 300, 400):
        rates.observe_transfer("d1", 1, tokens, 0.001 * tokens)
        rates.observe_decode("d1", 1, 0.02)
    learned = predict_ttft(rates, "p", "d1", new=100, cached=0, queued=0, transfer_tokens=100, streams=0)
    assert learned.modelled_measured and learned.queue.measured_s == 0.0
    idle = predict_ttft(
        RateEstimator(lambda _engine: PRIOR), "p", "d1", new=0, cached=0, queued=0, transfer_tokens=0, streams=0
    )
    assert idle.queue.measured and not idle.modelled_measured  # the first step still on the prior
