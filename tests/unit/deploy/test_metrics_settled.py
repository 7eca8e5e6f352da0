"""kvpilot.deploy.metrics.settled: waits on vLLM's finished-request count, not a fixed sleep."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpilot.deploy.metrics import parse, settled, total
from kvpilot.kvconnectors.vllm_metrics import REQUEST_SUCCESS
from tests.fakes.engine import FakeEngine, serving


@pytest.fixture
def engine() -> FakeEngine:
    """/metrics whose finished count grows by one on every scrape."""
    return FakeEngine(
        "d", metrics_text=lambda scrape: f'{REQUEST_SUCCESS.total}{{finished_reason="length"}} {scrape}\n'
    )


@pytest.fixture
def url(engine: FakeEngine) -> Iterator[str]:
    with serving(engine) as url:
        yield url


def test_it_returns_the_first_scrape_that_counts_the_requests(engine: FakeEngine, url: str) -> None:
    before = parse(f"{REQUEST_SUCCESS.total} 0\n")
    after = settled(url, before, finished=3)
    assert total(after, REQUEST_SUCCESS.total) == 3 and engine.scrapes == 3


def test_past_its_timeout_it_returns_the_last_scrape_for_the_caller_to_assert_on(url: str) -> None:
    before = parse(f"{REQUEST_SUCCESS.total} 0\n")
    after = settled(url, before, finished=10**9, timeout=0.2)
    assert 0 < total(after, REQUEST_SUCCESS.total) < 10**9
