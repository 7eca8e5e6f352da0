from __future__ import annotations

import math

import pytest

from benchmarks.scale.results import histogram_delta, quantile
from kvpilot.deploy.metrics import parse


def _histogram(name: str, bounds: list[str], counts: list[int], total: float, labels: str = "") -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels}le="{b}"}} {c}' for b, c in zip(bounds, counts, strict=True)]
    return "\n".join([*lines, f"{name}_sum{{{labels}}} {total}", f"{name}_count{{{labels}}} {counts[-1]}", ""])


def test_a_quantile_is_interpolated_inside_its_bucket_with_its_bounds():
    cumulative = [(0.1, 0.0), (0.3, 50.0), (0.9, 100.0), (math.inf, 100.0)]
    assert quantile(cumulative, 0.5) == (pytest.approx(0.3), 0.1, 0.3)
    assert quantile(cumulative, 0.25) == (pytest.approx(0.2), 0.1, 0.3)
    assert quantile(cumulative, 0.99) == (pytest.approx(0.3 + 0.6 * 49 / 50), 0.3, 0.9)
    assert quantile([(1.0, 0.0), (math.inf, 4.0)], 0.5) == (1.0, 1.0, 1.0)  # in +Inf: the last finite bound
    assert all(math.isnan(x) for x in quantile([], 0.5))


def test_only_what_was_observed_between_the_scrapes_counts_summed_over_label_sets():
    name, bounds = "dynamo_router_overhead_total_ms", ["0.09", "0.27", "0.81", "+Inf"]
    before = parse(_histogram(name, bounds, [5, 5, 5, 5], 0.2, 'router_id="1",'))
    after = parse(
        _histogram(name, bounds, [5, 45, 105, 105], 30.2, 'router_id="1",')
        + _histogram(name, bounds, [0, 0, 0, 0], 0.0, 'router_id="2",')
    )
    d = histogram_delta(after, before, name, scale=1e-3)
    assert d["count"] == 100 and d["mean_s"] == pytest.approx(0.3e-3)
    assert d["p50_s"] == pytest.approx((0.27 + 0.54 * 10 / 60) * 1e-3)
    assert d["p50_bucket_s"] == [pytest.approx(0.27e-3), pytest.approx(0.81e-3)]
    assert math.isnan(histogram_delta(before, before, name)["mean_s"])
