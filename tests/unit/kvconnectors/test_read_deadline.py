"""The read deadline's bound (:mod:`kvpilot.kvconnectors.read_deadline`)."""

from __future__ import annotations

import pytest

from kvpilot.kvconnectors.read_deadline import DeadlineRule, measured_rate
from kvpilot.policies.recompute_vs_transfer import TransferSample


@pytest.mark.parametrize(
    ("nbytes", "rate", "bound"),
    [
        (1e9, None, 2.0),  # unmeasured: the floor
        (1e9, 0.0, 2.0),
        (1e6, 1e9, 2.0),  # a fast read: the floor
        (1e9, 1e9, 4.0),  # 1 s at the measured rate, times 4
    ],
)
def test_the_bound_is_the_floor_or_the_scaled_read_time(nbytes: float, rate: float | None, bound: float) -> None:
    assert DeadlineRule(floor_s=2.0, factor=4.0).bound_s(nbytes, rate) == pytest.approx(bound)


@pytest.mark.parametrize(("floor", "factor"), [(0.0, 4.0), (2.0, 0.0), (-1.0, 1.0)])
def test_a_rule_needs_a_positive_floor_and_factor(floor: float, factor: float) -> None:
    with pytest.raises(ValueError, match="floor_s > 0 and factor > 0"):
        DeadlineRule(floor, factor)


def test_the_measured_rate_is_bytes_over_seconds_of_all_pulls() -> None:
    assert measured_rate([]) is None
    assert measured_rate([TransferSample(1e6, 1.0), TransferSample(3e6, 1.0)]) == pytest.approx(2e6)
