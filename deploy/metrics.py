"""Read an engine's (or the router's) Prometheus ``/metrics`` for the demo, the
benchmarks and the tests, with ``prometheus_client``'s parser."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Mapping

from kvpilot.kvconnectors import vllm_metrics
from kvpilot.routing.ingest.engine_metrics import parse_samples

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Samples by (name, labels), names as exposed (a counter's ``_total``).

    A line the parser refuses is skipped (see :func:`kvpilot.routing.ingest.engine_metrics.parse_samples`):
    never raises; empty text gives ``{}``.
    """
    return {(s.name, frozenset(s.labels.items())): float(s.value) for s in parse_samples(text)}


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


def wait_for_metric(
    base_url: str,
    name: str,
    predicate: Callable[[float], bool],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    **labels: str,
) -> Samples:
    """Scrape ``base_url`` until ``predicate(total(samples, name, **labels))`` holds.

    Returns the scrape on which it held or, once ``timeout`` seconds have passed,
    the last scrape, so that the caller's assertions report what was there. Scrapes
    at least once; raises only what :func:`scrape` raises (the endpoint is down).
    """
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base_url)
        if predicate(total(samples, name, **labels)) or time.monotonic() >= deadline:
            return samples
        time.sleep(interval)


def settled(base_url: str, before: Samples, finished: int = 1, *, timeout: float = 10.0) -> Samples:
    """An engine's metrics once vLLM counts ``finished`` more finished requests
    (:data:`~kvpilot.kvconnectors.vllm_metrics.REQUEST_SUCCESS`) than in ``before`` (a scrape
    from before the requests).

    vLLM answers a request before its stats loop publishes the batch that finished
    it, so a scrape right after the answer can miss that batch's counts; it counts a
    finished request with the counts of every batch up to it.
    """
    finished_requests = vllm_metrics.REQUEST_SUCCESS.total
    start = total(before, finished_requests)
    return wait_for_metric(base_url, finished_requests, lambda n: n >= start + finished, timeout=timeout)
