"""kvpilot's own CPU per request on the live path, stage by stage, from a fleet results file
(``bench_fleet.py --json`` with the arm ``dynamo_kv_envoy`` and ``kvpilot`` or ``kvpilot_native``).

The rows sum to kvpilot's whole hop: Envoy's CPU (split into what Envoy spends proxying, its
CPU in arm ``dynamo_kv_envoy`` with a fixed route on the same requests, and what the picker's
filters add: ext_proc, the Lua filters, the access log; in ``kvpilot_native``'s, the compiled
picker's decisions, its scrub of the answers it routed and its KV-event feed too) plus the router process's, split by
thread (:func:`benchmarks.fleet.bench.thread_cpu`, a living child's threads included); what no
living thread accounts for (threads and child processes that ended) is its own row. Pure."""

from __future__ import annotations

from typing import Any

from kvpilot.routing.ingest.feeder import THREAD_NAME as FEEDER_THREAD

THREAD_PREFIX = "kvpilot_router."
"""The key prefix of the router's CPU seconds per thread in ``cpu_s_per_request``:
``kvpilot_router.<thread name>``."""

ENVOY_THREAD_PREFIX = "envoy."
"""The key prefix of Envoy's CPU seconds per thread in ``cpu_s_per_request``:
``envoy.<thread name>``."""

ENVOY_WORKERS = "wrk:worker"
"""Envoy's worker threads (``wrk:worker_<n>``), which run every filter of every request."""
ENVOY_FEED_THREADS = (FEEDER_THREAD, "ZMQbg/IO/")
"""The compiled picker's threads in Envoy: its KV-event feeder (named as the router's) and
libzmq's I/O thread."""

THREADS = {
    "python": "Python's threads: the event loop (the picker's gRPC calls, intake, decision, bookings, "
    "KV-event applies) and the default executor (tokenizing text and chats)",
    FEEDER_THREAD: "the KV-event feeder (reads and decodes the engines' events)",
    "event_engine": "gRPC's event engine",
    "ZMQbg/IO/": "libzmq's I/O thread",
    "tokio-rt-worker": "Dynamo's discovery runtime",
}
"""What each of the router's threads does, by the name Linux keeps (15 characters, a pool's
number dropped); the rest are :data:`OTHER`."""
OTHER = "other library threads"
MIN_ROW_S = 1e-5
"""A thread under this CPU per request counts among :data:`OTHER`."""


ARMS = ("kvpilot", "kvpilot_native")
"""The arms whose hop is kvpilot's: the picker, and the compiled picker in Envoy."""


def stage_rows(results: dict[str, Any], name: str = "kvpilot") -> list[tuple[str, float]] | None:
    """``(stage, CPU seconds per request)`` of arm ``name``, summing to its router's and
    Envoy's CPU per request; ``None`` when the file has no per-thread CPU of its router."""
    arm = results.get(name)
    if arm is None:
        return None
    cpu: dict[str, float] = arm["cpu_s_per_request"]
    threads = {key[len(THREAD_PREFIX) :]: s for key, s in cpu.items() if key.startswith(THREAD_PREFIX)}
    if not threads:
        return None
    rows: list[tuple[str, float]] = []
    envoy = cpu.get("envoy")
    fixed_cpu = results.get("dynamo_kv_envoy", {}).get("cpu_s_per_request", {})
    fixed = fixed_cpu.get("envoy")
    if envoy is not None and fixed is not None:
        rows.append(("Envoy: proxying (its CPU with a fixed route, arm dynamo_kv_envoy)", fixed))
        rows += _picker_in_envoy(name, envoy - fixed, cpu, fixed_cpu)
    elif envoy is not None:
        rows.append(("Envoy", envoy))
    other = 0.0
    for name, seconds in sorted(threads.items(), key=lambda item: -item[1]):
        if name in THREADS and seconds >= MIN_ROW_S:
            rows.append((f"router thread {name}: {THREADS[name]}", seconds))
        else:
            other += seconds
    rows.append((f"router: {OTHER}", other))
    rows.append(("router: threads and child processes that ended", cpu["kvpilot_router"] - sum(threads.values())))
    return rows


def _picker_in_envoy(
    arm: str, added: float, cpu: dict[str, float], fixed_cpu: dict[str, float]
) -> list[tuple[str, float]]:
    """What the picker adds to Envoy's CPU (``added``), split by Envoy's threads where both
    arms have them: its worker threads' extra (the filters on each request and its answer),
    the compiled picker's KV-event feed (its feeder and libzmq's I/O thread), the rest."""
    what = "the compiled picker, ext_proc, Lua, access log" if arm == "kvpilot_native" else "ext_proc, Lua, access log"
    workers = ENVOY_THREAD_PREFIX + ENVOY_WORKERS
    if workers not in cpu or workers not in fixed_cpu:
        return [(f"Envoy: the picker's filters ({what})", added)]
    on_requests = cpu[workers] - fixed_cpu[workers]
    feed = sum(cpu.get(ENVOY_THREAD_PREFIX + thread, 0.0) for thread in ENVOY_FEED_THREADS)
    return [
        (f"Envoy: its workers' extra, the filters on each request and answer ({what})", on_requests),
        ("Envoy: the compiled picker's KV-event feed (its feeder thread, libzmq's I/O thread)", feed),
        ("Envoy: its other threads", added - on_requests - feed),
    ]


def stage_table(results: dict[str, Any]) -> str:
    """:func:`stage_rows` of each of :data:`ARMS` in ``results`` as a markdown table with its
    total; empty without them."""
    tables = []
    for name in ARMS:
        rows = stage_rows(results, name)
        if rows is None:
            continue
        lines = [f"| arm {name}: kvpilot's hop, by stage | CPU ms per request |", "|---|---:|"]
        lines += [f"| {stage} | {seconds * 1e3:.2f} |" for stage, seconds in rows]
        lines.append(f"| **total** | **{sum(s for _, s in rows) * 1e3:.2f}** |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)
