"""kvpilot's own CPU per request on the live path, stage by stage, from a fleet results file
(``bench_fleet.py --json`` with the arms ``kvpilot`` and ``dynamo_kv_envoy``).

The rows sum to kvpilot's whole hop: Envoy's CPU (split into what Envoy spends proxying, its
CPU in arm ``dynamo_kv_envoy`` with a fixed route on the same requests, and what the picker's
filters add: ext_proc, the Lua filters, the access log) plus the router process's, split by
thread (:func:`benchmarks.fleet.bench.thread_cpu`); what no live thread accounts for (threads
that ended, child processes) is its own row. Pure."""

from __future__ import annotations

from typing import Any

from kvpilot.routing.ingest.feeder import THREAD_NAME as FEEDER_THREAD

THREAD_PREFIX = "kvpilot_router."
"""The key prefix of the router's CPU seconds per thread in ``cpu_s_per_request``:
``kvpilot_router.<thread name>``."""

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


def stage_rows(results: dict[str, Any]) -> list[tuple[str, float]] | None:
    """``(stage, CPU seconds per request)`` of arm ``kvpilot``, summing to its router's and
    Envoy's CPU per request; ``None`` when the file has no per-thread CPU of the router."""
    arm = results.get("kvpilot")
    if arm is None:
        return None
    cpu: dict[str, float] = arm["cpu_s_per_request"]
    threads = {key[len(THREAD_PREFIX) :]: s for key, s in cpu.items() if key.startswith(THREAD_PREFIX)}
    if not threads:
        return None
    rows: list[tuple[str, float]] = []
    envoy = cpu.get("envoy")
    fixed = results.get("dynamo_kv_envoy", {}).get("cpu_s_per_request", {}).get("envoy")
    if envoy is not None and fixed is not None:
        rows.append(("Envoy: proxying (its CPU with a fixed route, arm dynamo_kv_envoy)", fixed))
        rows.append(("Envoy: the picker's filters (ext_proc, Lua, access log)", envoy - fixed))
    elif envoy is not None:
        rows.append(("Envoy", envoy))
    other = 0.0
    for name, seconds in sorted(threads.items(), key=lambda item: -item[1]):
        if name in THREADS and seconds >= MIN_ROW_S:
            rows.append((f"router thread {name}: {THREADS[name]}", seconds))
        else:
            other += seconds
    rows.append((f"router: {OTHER}", other))
    rows.append(("router: threads that ended, child processes", cpu["kvpilot_router"] - sum(threads.values())))
    return rows


def stage_table(results: dict[str, Any]) -> str:
    """:func:`stage_rows` as a markdown table with its total; empty without them."""
    rows = stage_rows(results)
    if rows is None:
        return ""
    lines = ["| kvpilot's hop, by stage | CPU ms per request |", "|---|---:|"]
    lines += [f"| {stage} | {seconds * 1e3:.2f} |" for stage, seconds in rows]
    lines.append(f"| **total** | **{sum(s for _, s in rows) * 1e3:.2f}** |")
    return "\n".join(lines)
