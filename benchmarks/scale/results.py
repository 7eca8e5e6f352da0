"""Quantiles of a Prometheus histogram between two scrapes: how the scale benchmark reads
both routers' decision times (kvpilot's ``kvpilot_router_decision_seconds``, Dynamo's
``dynamo_router_overhead_total_ms``). Pure.

The mean is exact (``_sum / _count``); a quantile is interpolated linearly inside the
bucket that holds it, as Prometheus' ``histogram_quantile`` does, and comes with that
bucket's bounds, since the bounds are all a histogram knows.
"""

from __future__ import annotations

from typing import Any

from kvpilot.deploy.metrics import Samples, total


def buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    """``name``'s cumulative buckets (upper bound, count), summed over label sets, by bound."""
    acc: dict[float, float] = {}
    for (sample, labels), value in samples.items():
        if sample == f"{name}_bucket":
            le = float(dict(labels)["le"])
            acc[le] = acc.get(le, 0.0) + value
    return sorted(acc.items())


def quantile(cumulative: list[tuple[float, float]], q: float) -> tuple[float, float, float]:
    """``q``'s value interpolated linearly inside its bucket, as Prometheus'
    ``histogram_quantile`` does, with that bucket's (lower, upper) bounds; NaN when empty.
    The last finite bound stands for a quantile in the +Inf bucket."""
    observations = cumulative[-1][1] if cumulative else 0.0
    if not observations:
        return (float("nan"),) * 3
    rank, lower, below = q * observations, 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == float("inf"):
                return lower, lower, lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0), lower, bound
        lower, below = bound, count
    return lower, lower, lower


def histogram_delta(after: Samples, before: Samples, name: str, scale: float = 1.0) -> dict[str, Any]:
    """Mean, p50 and p99 (with their buckets' bounds), in seconds (``scale``: the unit's),
    of what ``name`` observed between the two scrapes."""
    b, a = dict(buckets(before, name)), buckets(after, name)
    cumulative = [(bound, count - b.get(bound, 0.0)) for bound, count in a]
    count = total(after, f"{name}_count") - total(before, f"{name}_count")
    observed = total(after, f"{name}_sum") - total(before, f"{name}_sum")
    out: dict[str, Any] = {"count": count, "mean_s": observed / count * scale if count else float("nan")}
    for q, key in ((0.5, "p50"), (0.99, "p99")):
        value, lower, upper = quantile(cumulative, q)
        out[f"{key}_s"] = value * scale
        out[f"{key}_bucket_s"] = [lower * scale, upper * scale]
    return out
