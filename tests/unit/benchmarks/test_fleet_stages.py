"""The stage table of kvpilot's hop sums to the router's and Envoy's measured CPU per request."""

from __future__ import annotations

import pytest

from benchmarks.fleet.bench import thread_cpu
from benchmarks.fleet.stages import stage_rows, stage_table

RESULTS = {
    "dynamo_kv_envoy": {"cpu_s_per_request": {"frontend": 0.015, "envoy": 0.007}},
    "kvpilot": {
        "cpu_s_per_request": {
            "frontend": 0.013,
            "kvpilot_router": 0.008,
            "envoy": 0.0095,
            "kvpilot_router.python": 0.006,
            "kvpilot_router.kvpilot-index-f": 0.0015,
        }
    },
}


def test_the_stages_sum_to_kvpilot_s_whole_hop():
    rows = stage_rows(RESULTS)
    assert rows is not None
    assert sum(s for _, s in rows) == pytest.approx(0.008 + 0.0095)
    named = dict(rows)
    assert named["Envoy: the picker's filters (ext_proc, Lua, access log)"] == pytest.approx(0.0025)
    assert "**17.50**" in stage_table(RESULTS) and "arm kvpilot:" in stage_table(RESULTS)


def test_without_the_router_s_threads_there_is_no_stage_table():
    bare = {"kvpilot": {"cpu_s_per_request": {"kvpilot_router": 0.008, "envoy": 0.0095}}}
    assert stage_rows(bare) is None and stage_table(bare) == ""


def test_a_process_s_threads_are_read_by_name():
    import os

    threads = thread_cpu(os.getpid())
    assert threads and all(seconds >= 0 for seconds in threads.values())
    assert thread_cpu(2**22 + 7) == {}  # no such process
