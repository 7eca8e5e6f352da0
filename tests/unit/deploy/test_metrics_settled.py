"""deploy.metrics.settled: waits on vLLM's finished-request count, not a fixed sleep."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.metrics import parse, settled, total
from kvconnectors.vllm_metrics import REQUEST_SUCCESS


class _Engine(BaseHTTPRequestHandler):
    """/metrics whose finished count grows by one on every scrape."""

    scrapes = 0

    def do_GET(self) -> None:  # http.server's name
        type(self).scrapes += 1
        body = f'{REQUEST_SUCCESS.total}{{finished_reason="length"}} {type(self).scrapes}\n'.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[str]:
    _Engine.scrapes = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_it_returns_the_first_scrape_that_counts_the_requests(engine: str) -> None:
    before = parse(f"{REQUEST_SUCCESS.total} 0\n")
    after = settled(engine, before, finished=3)
    assert total(after, REQUEST_SUCCESS.total) == 3 and _Engine.scrapes == 3


def test_past_its_timeout_it_returns_the_last_scrape_for_the_caller_to_assert_on(engine: str) -> None:
    before = parse(f"{REQUEST_SUCCESS.total} 0\n")
    after = settled(engine, before, finished=10**9, timeout=0.2)
    assert 0 < total(after, REQUEST_SUCCESS.total) < 10**9
