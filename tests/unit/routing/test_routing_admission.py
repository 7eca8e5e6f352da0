"""Admission by predicted TTFT (kvpilot.routing.serve.admission.check_ttft_slo): pure, table-driven."""

from __future__ import annotations

import pytest

from kvpilot.routing.decide.rates import Estimate, TTFTPrediction
from kvpilot.routing.refusals import RejectReason
from kvpilot.routing.serve.admission import Rejected, check_ttft_slo


def _prediction(queue: float, prefill: float, transfer: float = 0.0, first_step: float = 0.01) -> TTFTPrediction:
    def measured(seconds: float) -> Estimate:
        return Estimate(prior_s=seconds / 100, measured_s=seconds, samples=8)  # the measured value counts

    return TTFTPrediction(measured(queue), measured(prefill), measured(transfer), measured(first_step), measured(0.0))


@pytest.mark.parametrize(
    ("prediction", "slo_s"),
    [
        (_prediction(queue=0.0, prefill=1.0), 2.0),  # under
        (_prediction(queue=0.99, prefill=1.0), 2.0),  # 2.0 s exactly: meets it
        (_prediction(queue=50.0, prefill=50.0), 0.0),  # no SLO
    ],
)
def test_a_request_that_meets_the_slo_or_no_slo_is_admitted(prediction: TTFTPrediction, slo_s: float) -> None:
    assert check_ttft_slo(prediction, slo_s) is None


@pytest.mark.parametrize(
    ("prediction", "status", "retry_after", "why"),
    [
        # alone it would take 1.01 s: the 4.2 s queued ahead is what puts it over, so come back later
        (_prediction(queue=4.2, prefill=1.0), 429, 5, "for the load ahead"),
        # even on an idle worker it takes 3.51 s: over, whatever the load
        (_prediction(queue=0.0, prefill=3.0, transfer=0.5), 503, 4, "even without a queue"),
        # queued and too long alone: not load's fault
        (_prediction(queue=9.0, prefill=2.5), 503, 12, "even without a queue"),
        # a sub-second queue still says at least 1 s
        (_prediction(queue=0.3, prefill=1.95), 429, 1, "for the load ahead"),
    ],
)
def test_a_predicted_ttft_over_the_slo_is_refused_naming_both(
    prediction: TTFTPrediction, status: int, retry_after: int, why: str
) -> None:
    with pytest.raises(Rejected) as refused:
        check_ttft_slo(prediction, 2.0)
    exc = refused.value
    assert (exc.status, exc.retry_after_s, exc.reason) == (status, retry_after, RejectReason.TTFT_SLO)
    message = str(exc)
    assert f"predicted TTFT {prediction.seconds:.3f} s is over server.ttft_slo_s (2 s)" in message
    assert why in message and f"queue {prediction.queue.seconds:.3f} s" in message


def test_the_prior_counts_where_nothing_is_measured() -> None:
    prior_only = TTFTPrediction(
        *(Estimate(prior_s=1.0, measured_s=None, samples=0) for _ in range(4)), Estimate(0.0, None, 0)
    )
    with pytest.raises(Rejected, match=r"predicted TTFT 4\.000 s"):
        check_ttft_slo(prior_only, 3.5)
    assert check_ttft_slo(prior_only, 4.0) is None
