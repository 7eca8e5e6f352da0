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


def test_envoy_s_share_is_split_by_its_threads_where_both_arms_have_them():
    results = {
        "dynamo_kv_envoy": {"cpu_s_per_request": {"envoy": 0.007, "envoy.wrk:worker": 0.0068, "envoy.envoy": 0.0002}},
        "kvpilot_native": {
            "cpu_s_per_request": {
                "kvpilot_router": 0.002,
                "kvpilot_router.python": 0.002,
                "envoy": 0.0115,
                "envoy.wrk:worker": 0.0105,
                "envoy.kvpilot-feeder": 0.0003,
                "envoy.ZMQbg/IO/": 0.0002,
                "envoy.envoy": 0.0005,
            }
        },
    }
    rows = stage_rows(results, "kvpilot_native")
    assert rows is not None and sum(s for _, s in rows) == pytest.approx(0.002 + 0.0115)
    named = {stage.split(" (")[0].split(",")[0]: s for stage, s in rows}
    assert named["Envoy: its workers' extra"] == pytest.approx(0.0037)
    assert named["Envoy: the compiled picker's KV-event feed"] == pytest.approx(0.0005)
    assert named["Envoy: its other threads"] == pytest.approx(0.0003)


def test_without_the_router_s_threads_there_is_no_stage_table():
    bare = {"kvpilot": {"cpu_s_per_request": {"kvpilot_router": 0.008, "envoy": 0.0095}}}
    assert stage_rows(bare) is None and stage_table(bare) == ""


def test_a_process_s_threads_and_its_children_s_are_read_by_name():
    import os
    import subprocess

    threads = thread_cpu(os.getpid())
    assert threads and all(seconds >= 0 for seconds in threads.values())
    assert thread_cpu(2**22 + 7) == {}  # no such process
    assert "sleep" not in threads
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert "sleep" in thread_cpu(os.getpid())  # the child's thread, by its name
    finally:
        child.kill()
        child.wait()
