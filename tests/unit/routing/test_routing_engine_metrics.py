"""Reading the engines' own load gauges from a Prometheus exposition (pure)."""

from __future__ import annotations

import asyncio
import math

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot.routing.config import Role, Worker
from kvpilot.routing.health.engine_load import RateCounters
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.ingest.engine_metrics import EngineLoadPoller, parse_engine_load, parse_samples
from tests.fakes.engine import FakeEngine

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:num_requests_running_total_bogus 99
vllm:prompt_tokens_total{model_name="tiny"} 1234.0
"""


def test_gauges_are_summed_and_kv_usage_is_the_maximum():
    load = parse_engine_load(EXPOSITION, at=7.0)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage, load.at) == (3.0, 4.0, 0.5, 7.0)


def test_unlabelled_lines_and_junk_are_handled():
    text = 'vllm:kv_cache_usage_perc 0.125\nvllm:num_requests_running nan\nvllm:num_requests_waiting{x="}"} oops\n'
    load = parse_engine_load(text, at=0.0)
    assert load is not None and (load.kv_usage, load.running, load.waiting) == (0.125, 0.0, 0.0)
    assert parse_engine_load("vllm:num_requests_running 1\n", at=0.0) is None  # no KV usage: not an engine we know
    assert parse_engine_load("", at=0.0) is None


def test_rate_counters_are_read_from_what_vllm_exports():
    """The prefill-time and inter-token histograms, prompt tokens by source and NIXL's
    bytes, as prometheus_client writes them, summed over engines; an unknown source is
    ignored."""
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "", registry=registry).set(0.1)
    prefill = Histogram("vllm:request_prefill_time_seconds", "", ["engine"], registry=registry)
    prefill.labels("0").observe(0.5)
    prefill.labels("1").observe(0.25)
    Histogram("vllm:inter_token_latency_seconds", "", registry=registry).observe(0.02)
    by_source = Counter("vllm:prompt_tokens_by_source", "", ["source"], registry=registry)
    for source, tokens in (("local_compute", 100), ("local_cache_hit", 64), ("external_kv_transfer", 32), ("x", 9)):
        by_source.labels(source).inc(tokens)
    Histogram("vllm:nixl_bytes_transferred", "", registry=registry).observe(4096)
    xfer = Histogram("vllm:nixl_xfer_time_seconds", "", registry=registry)
    xfer.observe(0.01)
    load = parse_engine_load(generate_latest(registry).decode(), at=1.0)
    assert load is not None
    assert load.rates == RateCounters(
        prefill_seconds=0.75,
        prefill_requests=2,
        computed_tokens=100,
        cached_tokens=64,
        external_tokens=32,
        decode_step_seconds=0.02,
        decode_steps=1,
        read_bytes=4096,
    )
    assert (load.transfer.transfers, load.transfer.transfer_seconds) == (1, 0.01)


def test_samples_keep_their_exposed_names_and_a_refused_line_drops_alone():
    """What prometheus_client writes reads back under the names it wrote (vLLM's ':'
    names, a counter's ``_total``, a histogram's parts); junk between lines is dropped
    without losing its neighbours or the ``# TYPE`` before it."""
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens_by_source", "", ["source"], registry=registry).labels("local_compute").inc(5)
    Gauge("vllm:kv_cache_usage_perc", "", registry=registry).set(0.25)
    Histogram("vllm:nixl_bytes_transferred", "", buckets=[10.0], registry=registry).observe(4)
    exposed = generate_latest(registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_samples(exposed)}
    assert samples[("vllm:prompt_tokens_by_source_total", (("source", "local_compute"),))] == 5
    assert samples[("vllm:kv_cache_usage_perc", ())] == 0.25
    assert samples[("vllm:nixl_bytes_transferred_sum", ())] == 4
    assert samples[("vllm:nixl_bytes_transferred_bucket", (("le", "10.0"),))] == 1

    text = '# TYPE c counter\nc 1\nc{x="}"} oops\n# TYPE broken\nvllm:g{a="b"} 2\n'
    assert [(s.name, s.labels, s.value) for s in parse_samples(text)] == [("c_total", {}, 1), ("vllm:g", {"a": "b"}, 2)]
    assert parse_samples("") == [] and parse_samples("{{{\n") == []


def test_a_stale_sample_is_not_reported():
    """A real poll of an engine's ``/metrics``, then the clock moves past 3 intervals."""

    async def main() -> None:
        async with TestServer(FakeEngine("w", metrics_text=EXPOSITION).app(), host="127.0.0.1") as server:
            worker = Worker(WorkerId("w"), Role.DECODE, str(server.make_url("")).rstrip("/"))
            now = [100.0]
            poller = EngineLoadPoller([worker], interval_s=1.0, clock=lambda: now[0])
            async with aiohttp.ClientSession() as http:
                task = asyncio.create_task(poller.run(http))
                for _ in range(500):
                    if poller.latest(WorkerId("w")) is not None:
                        break
                    await asyncio.sleep(0.01)
                task.cancel()
            assert poller.latest(WorkerId("w")) is not None
            now[0] = 103.5
            assert poller.latest(WorkerId("w")) is None and poller.latest(WorkerId("unknown")) is None
            assert math.isclose(poller.max_age_s, 3.0)

    asyncio.run(main())
