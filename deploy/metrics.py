"""Read an engine's Prometheus ``/metrics``: a tiny text-format reader for the demo,
the benchmarks and the tests (no client library needed)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Samples by (name, labels). Comment lines are skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = frozenset(_LABEL.findall(match["labels"] or ""))
        samples[(match["name"], labels)] = float(match["value"])
    return samples


def scrape(base_url: str, timeout: float = 60.0) -> Samples:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    want: Mapping[str, str] = labels
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and all((k, v) in sample_labels for k, v in want.items())
    )


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)
