"""The live pull policy's parts: decisions, the prefill backlog, the link meter,
the peers whose pulls failed."""

from __future__ import annotations

import pytest

from kvpilot.kvconnectors.policy_setup import cpu_cores
from kvpilot.kvconnectors.pull_policy import (
    FailedPeers,
    LinkMeter,
    PrefillBacklog,
    RooflinePullPolicy,
    ThresholdPullPolicy,
)
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset
from kvpilot.policies.recompute_vs_transfer import (
    LinkTelemetry,
    PrefillLoad,
    RecomputeVsTransferPolicy,
    Span,
    TransferSample,
)


@pytest.mark.parametrize(("tokens", "threshold", "choice"), [(63, 64, "recompute"), (64, 64, "pull"), (1, 0, "pull")])
def test_threshold_is_vllms_rule(tokens: int, threshold: int, choice: str) -> None:
    decision = ThresholdPullPolicy(threshold).decide(Span(tokens, 1000), PrefillLoad(), LinkTelemetry(), None)
    assert decision.choice == choice
    assert decision.label == f"{choice}/threshold"
    assert str(threshold) in decision.explanation


def _roofline() -> RooflinePullPolicy:
    policy = RecomputeVsTransferPolicy(
        model_preset("llama-70b"), kv_format_preset("bf16"), hardware_preset("b200x2"), link_preset("rdma")
    )
    return RooflinePullPolicy(policy)


def test_load_turns_a_short_span_into_a_pull() -> None:
    """Section 9.3: an idle P recomputes a short span almost for free; a busy P pays full price."""
    policy, span = _roofline(), Span(tokens=32, context=2_000, new_tokens=100)
    idle = policy.decide(span, PrefillLoad(), LinkTelemetry(), None)
    busy = policy.decide(
        span, PrefillLoad(queued_prefill_tokens=16_384, running_batch_tokens=8_192), LinkTelemetry(), None
    )
    assert (idle.choice, busy.choice) == ("recompute", "pull")
    assert busy.label == "pull/roofline" and "16384 queued" in busy.explanation


def test_backlog_counts_what_the_scheduler_has_not_prefilled_yet() -> None:
    backlog = PrefillBacklog()
    backlog.add("a", 1000)
    backlog.add("b", 300)
    assert backlog.load(excluding="b") == PrefillLoad(1000, 0)
    backlog.scheduled({"a": 512}, {"a": 256}, total_scheduled=512)  # a hit 256 tokens in its prefix cache
    assert backlog.load(excluding="b") == PrefillLoad(232, 512)
    backlog.scheduled({"a": 232, "b": 300}, {"b": 0}, total_scheduled=532)
    assert backlog.load(excluding="none") == PrefillLoad(0, 532) and len(backlog) == 0
    backlog.add("c", 10)
    backlog.finished("c")
    backlog.finished("unknown")
    assert len(backlog) == 0


def test_link_meter_keeps_a_window_of_transfers_and_failures() -> None:
    meter = LinkMeter(window=4)
    assert meter.telemetry() == LinkTelemetry()
    meter.observe([0.01, 0.0, 0.02], [1000, 5, 2000], failures=1)  # a zero-time sample is dropped
    telemetry = meter.telemetry()
    assert [s.nbytes for s in telemetry.samples] == [1000, 2000]
    assert telemetry.failures == 1
    meter.observe([0.01] * 4, [10] * 4)
    assert len(meter.telemetry().samples) == 4 and meter.telemetry().failures == 0
    meter.pulled(6144, 0.2)
    meter.pulled(6144, 0.0)  # no time: dropped
    assert meter.telemetry().pulls == (TransferSample(6144, 0.2),)


def test_a_failed_peer_is_skipped_until_its_retry_time_or_a_success() -> None:
    peers = FailedPeers(retry_after_s=30.0)
    assert peers.seconds_since_failure("d-0", now=100.0) is None
    peers.failed("d-0", now=100.0)
    assert peers.seconds_since_failure("d-0", now=112.5) == 12.5
    assert peers.seconds_since_failure("d-1", now=112.5) is None
    assert peers.seconds_since_failure("d-0", now=130.0) is None  # time to try it again
    assert peers.seconds_since_failure("d-0", now=131.0) is None
    peers.failed("d-0", now=200.0)
    peers.succeeded("d-0")  # a pull already in flight got through
    assert peers.seconds_since_failure("d-0", now=201.0) is None


@pytest.mark.parametrize(("bind", "cores"), [("0", 1), ("0-3", 4), ("0,2", 2), ("0-1|2-3", 2)])
def test_cpu_cores_from_vllms_bind(bind: str, cores: int) -> None:
    assert cpu_cores(bind) == cores


def test_cpu_cores_without_a_bind_is_the_machine() -> None:
    import os

    assert cpu_cores(None) == cpu_cores("auto") == (os.cpu_count() or 1)
