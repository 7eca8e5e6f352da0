"""Fleet benchmark (issue 19, part 3): kvpilot's router against Dynamo's own routers on
the same Dynamo mocker fleet and the same Mooncake trace requests, in one run.

Five arms (:mod:`fleet_arms`), one at a time, each on a fresh fleet (the same
``dynamo.mocker`` workers restarted: no arm inherits another's cache, launched by
:mod:`kvpilot.deploy.dynamo_fleet`): (a) Dynamo round robin, (b) Dynamo's KV router with its
defaults, (c) Dynamo's KV router tuned, (d) Envoy in front of Dynamo's frontend in direct
mode, kvpilot's picker deciding (``kvpilot fleet up --dynamo``), (e) kvpilot's router
relaying the streams to the same frontend (the layout before the picker).

Requests (:mod:`fleet_trace`): the first ``--max-requests`` of ``--trace`` (Mooncake
JSONL), each hash id a fixed seeded run of ``--tokens-per-hash`` token ids (512: no
scaling by default) below the tiny model's vocabulary, the mockers' block size
``--block-size`` dividing it; sent at the trace's timestamps divided by ``--rate-scale``,
at most ``--concurrency`` in flight, every one streamed (:mod:`fleet_replay`). Prompts
are not cut to the tiny model's 16,384 positions: neither the mocker (no
``--max-model-len``) nor the frontend (``context_window`` 0) limits them, and 20,000
tokens were served here; the JSON counts those longer (``prompts_over_model_positions``).

Per arm (:mod:`fleet_results`): TTFT mean, p50, p99 at the client; the frontend's own
TTFT (``dynamo_frontend_time_to_first_token_seconds``: the same stage in every arm, after
kvpilot's hop in its arm); ITL; throughput; prefix reuse from the workers' own counts
against the trace's ceiling: the ``cached_tokens`` the serving worker reports in each
request's usage block (aggregated fleets), or the prompt blocks the workers computed by
their own KV events (:mod:`fleet_events`; disaggregated fleets, where the usage block is
D's and P did the prefill; both are in the JSON); each process's CPU seconds per request
(the frontend's, the kvpilot router's, Envoy's, all workers'); for kvpilot, the router's own TTFT
stages (:func:`router_stages`).

The run's TTFT floor (:mod:`fleet_floor`; skipped with ``--no-floor``): before the arms,
on a fleet of its own (round robin, so each calibration request finds an idle worker),
calibration requests one at a time fit the serving path's TTFT against prompt length;
each trace request's floor is that fit's price of the tokens no cache could have held
for it. The floor's mean is the mean TTFT no router can beat on this workload, and the
report says whether 20% below each Dynamo KV arm (the issue's target) lies above it.

Each arm's SLO attainment (:mod:`fleet_goodput`): by default scale-free on the floor (TTFT at
most 5x each request's floor, ITL at most 2x the calibration's, each request alone on an
idle worker), as the simulator's goodput judges its runs, so that ``sim_live.py`` compares
like with like; ``--ttft-slo`` and ``--itl-slo`` set absolute ones. ``--rate-sweep`` runs
every arm at more rates and gives each arm's goodput.

    python -m benchmarks.bench_fleet --workers 4 --max-requests 200
    python -m benchmarks.bench_fleet --prefill 16 --decode 48 --rate-scale 4 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # ships no stubs; its types are not installed here
import yaml

from benchmarks.agent.output import finite
from benchmarks.fleet import floor as fleet_floor
from benchmarks.fleet.arms import TUNED_DISAGG_FLAGS, TUNED_FLAGS, Arm, ArmName, arms
from benchmarks.fleet.events import EventTap, StoredPromptBlocks
from benchmarks.fleet.goodput import ATTAINMENT, ITL_SLO_X, TTFT_SLO_X, Slo, SweepPoint, attainment, goodput
from benchmarks.fleet.replay import Connections, Send, body, headers, replay
from benchmarks.fleet.results import Outcome, ReuseCounts, reuse_from_computed, summarize
from benchmarks.fleet.stages import ENVOY_THREAD_PREFIX, THREAD_PREFIX, stage_table
from benchmarks.fleet.trace import (
    TRACES_DIR,
    PromptShape,
    PromptSynth,
    TraceRequest,
    arrivals,
    ideal_hits,
    load_trace,
    prompt_block_digests,
    reuse_ceiling,
)
from benchmarks.provenance import describe, provenance, recorded_argv
from kvpilot.deploy import dynamo_fleet
from kvpilot.deploy.dynamo_spec import DynamoFleetSpec, FrontendRouting, router_plan
from kvpilot.deploy.fleet import Fleet, RunningProcess, down, start_replica, stop_group
from kvpilot.deploy.fleet_spec import HOST
from kvpilot.deploy.metrics import Samples, scrape, total
from kvpilot.deploy.tiny_model import TINY_MODEL_SPEC, ensure_tiny_model

DEFAULT_TRACE = TRACES_DIR / "mooncake_conversation_trace.jsonl"
PORTS = {"worker_port": 24000, "port_stride": 500, "frontend_port": 23990, "router_port": 23980}
"""This benchmark's ports (no e2e test or other benchmark uses 23980-25999)."""
EVENTS_PORT = 1
"""A worker's vLLM-format KV-event port among its recorded side ports (request plane, events, ...)."""
SUBSCRIBE_S = 1.0
"""Wait after subscribing to the workers' events (a SUB misses what comes before), and
after the last answer (its events)."""
STAGE = "kvpilot_router_ttft_stage_seconds"
ROUTER_TTFT = "kvpilot_router_ttft_seconds"
FRONTEND_TTFT = "dynamo_frontend_time_to_first_token_seconds"
"""Dynamo's frontend's own TTFT, from its receiving a request to its first token out: the
same stage in every arm (in kvpilot's, after the router's hop)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def running(spec: DynamoFleetSpec) -> Iterator[Fleet]:
    started = dynamo_fleet.up(spec, timeout=600, progress=lambda m: log(m.strip()))
    try:
        yield started
    finally:
        down(spec.run_dir)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children so far (0 if gone)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    used = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        used += times.user + times.system
    return used


@contextmanager
def replicas(spec: DynamoFleetSpec, count: int, workers: int) -> Iterator[list[RunningProcess]]:
    """``count - 1`` more kvpilot routers on the fleet (the fleet's router config, ports
    ``router_port + k``), each reading every worker's KV events and sharing nothing with the
    others (no session store: a session's steps, sent round robin over the replicas, are
    known to each replica only for those it routed; in-flight load is each replica's own);
    stopped on exit."""
    started: list[RunningProcess] = []
    try:
        for k in range(1, count):
            started.append(start_replica(router_plan(spec), spec.run_dir / "logs", f"router-{k}", spec.router_port + k))
            dynamo_fleet.wait_for_workers(started[-1].url, lambda names: len(names) == workers, 60.0)
        if started:
            log(f"  {len(started)} more router replicas on ports {[r.port for r in started]}")
        yield started
    finally:
        for router in started:
            stop_group(router.pid)


def thread_cpu(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of each thread of process ``pid`` and its children by
    its name (as Linux keeps it, 15 characters; threads of one name, a pool's numbered ones
    included, added together). Empty where the process is gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        proc = psutil.Process(pid)
        pids = [pid, *(child.pid for child in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return out
    for task in (t for p in pids for t in _tasks(p)):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"[_-]?\d+$", "", name) or name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []


def fleet_cpu(fleet: Fleet, spec: DynamoFleetSpec, extra_routers: Sequence[RunningProcess] = ()) -> dict[str, float]:
    """CPU seconds so far of the frontend, the kvpilot routers (if they run: all replicas
    together, and the first one's by thread, :data:`~benchmarks.fleet.stages.THREAD_PREFIX`), Envoy (if it runs; also by
    thread, :data:`~benchmarks.fleet.stages.ENVOY_THREAD_PREFIX`) and all workers."""
    workers = [e for e in fleet.engines if e.role]
    frontend = fleet.router if not spec.kvpilot_routes else next(e for e in fleet.engines if not e.role)
    out = {"frontend": cpu_seconds(frontend.pid), "workers": sum(cpu_seconds(w.pid) for w in workers)}
    if spec.kvpilot_routes:
        out["kvpilot_router"] = sum(cpu_seconds(r.pid) for r in (fleet.router, *extra_routers))
        out |= {THREAD_PREFIX + name: s for name, s in thread_cpu(fleet.router.pid).items()}
    if fleet.gateway is not None:
        out["envoy"] = cpu_seconds(fleet.gateway.pid)
        out |= {ENVOY_THREAD_PREFIX + name: s for name, s in thread_cpu(fleet.gateway.pid).items()}
    return out


def serving_path(fleet: Fleet, spec: DynamoFleetSpec) -> list[int]:
    """Pids on the requests' path that are not workers: the frontend, and kvpilot's router
    and Envoy if they run."""
    gateway = [fleet.gateway.pid] if fleet.gateway is not None else []
    return [e.pid for e in fleet.engines if not e.role] + ([fleet.router.pid] if spec.kvpilot_routes else []) + gateway


def renice(pids: list[int], niceness: int) -> None:
    """Every thread of ``pids`` (and their children) at ``niceness``: on Linux a nice value
    is a thread's, and the frontend's and the router's threads exist by now."""
    for pid in pids:
        proc = psutil.Process(pid)
        for p in (proc, *proc.children(recursive=True)):
            for thread in p.threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, niceness)


def usage_reuse(outcomes: list[Outcome]) -> ReuseCounts:
    """Prompt tokens and cached prompt tokens, as the serving workers reported them per
    request (the usage block: in a disaggregated fleet, D's count, not P's)."""
    return ReuseCounts(float(sum(o.prompt_tokens for o in outcomes)), float(sum(o.cached_tokens for o in outcomes)))


def histogram_mean(samples: Samples, name: str, **labels: str) -> float:
    """``name``'s mean observation (``_sum / _count``); NaN without one."""
    count = total(samples, f"{name}_count", **labels)
    return total(samples, f"{name}_sum", **labels) / count if count else math.nan


def router_stages(router_url: str) -> dict[str, float]:
    """kvpilot's router's own TTFT by stage, as its ``/metrics`` counts them (means, seconds):
    its route stage (parse, tokenize, decide), the frontend's first token as the router
    waits for it, and the router's TTFT (from reading the request to that first token)."""
    samples = scrape(router_url)
    stages = {
        "route_mean_s": histogram_mean(samples, STAGE, stage="route"),
        "frontend_first_token_mean_s": histogram_mean(samples, STAGE, stage="decode_first_token"),
        "router_ttft_mean_s": histogram_mean(samples, ROUTER_TTFT),
    }
    stages["router_added_ttft_mean_s"] = stages["router_ttft_mean_s"] - stages["frontend_first_token_mean_s"]
    return stages


@dataclass(frozen=True)
class Workload:
    """What every arm is sent, and what its reuse is judged against."""

    sends: list[Send]
    input_tokens: list[int]
    """Each request's prompt length, by trace index."""
    full_blocks: list[int]
    """Each request's full engine blocks, by trace index."""
    prompt_digests: set[int]

    @property
    def offered_rps(self) -> float:
        """Requests over their arrival span (NaN for fewer than two)."""
        span = self.sends[-1].at - self.sends[0].at if len(self.sends) > 1 else 0.0
        return len(self.sends) / span if span > 0 else math.nan


def run_arm(
    arm: Arm, base: DynamoFleetSpec, workload: Workload, slo: Slo | None, args: argparse.Namespace
) -> dict[str, Any]:
    """One arm on a fresh fleet: its summary, with its SLO attainment where ``slo`` is given."""
    spec = arm.spec(base)
    log(f"arm {arm.name.value}: {arm.title} {' '.join(arm.frontend_flags)}")
    started = time.perf_counter()
    with running(spec) as fleet:
        up_s = time.perf_counter() - started
        workers = [e for e in fleet.engines if e.role]
        stored = StoredPromptBlocks(workload.prompt_digests, spec.block_size)
        tap = EventTap({w.name: f"tcp://{HOST}:{w.side_ports[EVENTS_PORT]}" for w in workers}, stored)
        tap.start()
        if args.serving_niceness:
            renice(serving_path(fleet, spec), args.serving_niceness)
        relaying = spec.kvpilot_routes and spec.gateway is None
        with replicas(spec, args.kvpilot_replicas if relaying else 1, len(workers)) as extra_routers:
            time.sleep(SUBSCRIBE_S)
            clients = [spec.client_url, *(r.url for r in extra_routers)]
            cpu_before = fleet_cpu(fleet, spec, extra_routers)
            outcomes = asyncio.run(
                replay(
                    clients,
                    workload.sends,
                    concurrency=args.concurrency,
                    connections=args.client_connections,
                )
            )
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in fleet_cpu(fleet, spec, extra_routers).items()}
        time.sleep(SUBSCRIBE_S)  # the last requests' events
        tap.stop()
        extra: dict[str, Any] = {
            "arm": arm.title,
            "frontend_flags": list(arm.frontend_flags),
            "fleet_up_s": up_s,
            "frontend_ttft_mean_s": histogram_mean(scrape(spec.frontend_url), FRONTEND_TTFT),
        }
        if spec.kvpilot_routes:
            extra["kvpilot_router_stages"] = router_stages(fleet.router.url)
    done = [o.index for o in outcomes if o.ok]  # a failed request's prompt may never have reached a worker
    events = reuse_from_computed(
        sum(workload.input_tokens[i] for i in done),
        sum(workload.full_blocks[i] for i in done),
        stored.total,
        spec.block_size,
    )
    usage = usage_reuse(outcomes)
    extra |= {
        "prefix_reuse_kv_events": events.reuse,
        "prefix_reuse_usage": usage.reuse,
        "prefix_reuse_source": "kv_events" if spec.prefill else "usage",
        "computed_prompt_blocks_by_worker": dict(stored.prompt_blocks),
        "kv_event_rejections": tap.rejected,
    }
    extra["offered_rps"] = workload.offered_rps
    if slo is not None:
        extra["slo_attainment"] = attainment(outcomes, slo)
    summary = summarize(outcomes, events if spec.prefill else usage, cpu, extra)
    log(
        f"  {summary['completed']} completed, {summary['failed']} failed, TTFT mean {summary['ttft_mean_s']:.3f} s, "
        f"reuse {summary['prefix_reuse']:.3f} (KV events {events.reuse:.3f}, usage {usage.reuse:.3f})"
    )
    return summary


TARGET_MARGIN = 0.2
"""Issue 19's target: kvpilot's mean TTFT this share below each Dynamo KV arm's."""
CALIBRATION_GAP_S = 0.2
"""Between calibration requests, one at a time: each finds its worker idle."""


def measure_floor(base: DynamoFleetSpec, new_tokens: list[int], args: argparse.Namespace) -> fleet_floor.Floor:
    """:mod:`fleet_floor`'s calibration on a fleet of its own (``base`` under round robin),
    then the floor of requests with ``new_tokens`` uncached tokens each."""
    spec = replace(base, run_dir=base.run_dir / "floor", frontend_routing=FrontendRouting.ROUND_ROBIN)
    lengths = [*[min(new_tokens)] * fleet_floor.WARMUP, *fleet_floor.calibration_lengths(new_tokens, args.block_size)]
    vocab = TINY_MODEL_SPEC.vocab_size
    sends = [
        Send(
            i,
            i * CALIBRATION_GAP_S,
            body(fleet_floor.calibration_prompt(n, i, vocab, args.seed), fleet_floor.OUTPUT_TOKENS),
        )
        for i, n in enumerate(lengths)
    ]
    log(f"floor: {len(sends)} calibration requests of {sorted(set(lengths))} tokens, one at a time")
    with running(spec):
        outcomes = asyncio.run(replay([spec.client_url], sends, concurrency=1, connections=Connections.FRESH))
    failed = [o.error for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} calibration requests failed, the first: {failed[0]}")
    timed = outcomes[fleet_floor.WARMUP :]
    samples = [(lengths[o.index], o.ttft) for o in timed if o.ttft is not None]
    floor = fleet_floor.measure(samples, new_tokens, [itl for o in timed if (itl := o.itl) is not None])
    fixed, per_token, per_pair = floor.coefficients
    log(
        f"  floor: mean {floor.mean_s * 1e3:.1f} ms (fit: {fixed * 1e3:.2f} ms + {per_token * 1e6:.3f} us/token "
        f"+ {per_pair * 1e12:.3f} ps/attention pair); idle ITL {floor.idle_itl_s * 1e3:.2f} ms"
    )
    return floor


def run_slo(args: argparse.Namespace, floor: fleet_floor.Floor | None) -> Slo | None:
    """The SLOs every arm is judged by: ``--ttft-slo`` and ``--itl-slo`` where given, else
    scale-free on the measured floor (:meth:`Slo.scale_free`); none without either."""
    if args.ttft_slo is not None:
        return Slo(args.ttft_slo, args.itl_slo)
    return None if floor is None else Slo.scale_free(floor.request_ttft_s, floor.idle_itl_s)


def slo_text(slo: Slo, floor: fleet_floor.Floor | None) -> str:
    """The SLOs in words."""
    if slo.per_request and floor is not None:
        return (
            f"TTFT at most {TTFT_SLO_X:g}x each request's floor (mean {floor.mean_s * 1e3:.1f} ms), ITL at most "
            f"{ITL_SLO_X:g}x an idle worker's ({slo.itl_s * 1e3:.2f} ms)"
        )
    return f"TTFT {slo.ttft_limit(0) * 1e3:g} ms, ITL {slo.itl_s * 1e3:g} ms"


def floor_lines(results: dict[str, dict[str, Any]], floor: fleet_floor.Floor) -> list[str]:
    """Each arm's mean TTFT against the floor, and whether the target below each Dynamo KV
    arm is within any router's reach."""
    lines = [f"TTFT floor (no router can beat its mean on this workload): {floor.mean_s * 1e3:.1f} ms"]
    for key, s in results.items():
        lines.append(
            f"  {key}: mean TTFT {s['ttft_mean_s'] * 1e3:.1f} ms = {s['ttft_mean_s'] / floor.mean_s:.2f}x the floor"
        )
    for key in (ArmName.DYNAMO_KV.value, ArmName.DYNAMO_KV_TUNED.value):
        if key in results:
            mean = results[key]["ttft_mean_s"]
            reach = (
                "within reach"
                if fleet_floor.reachable(mean, TARGET_MARGIN, floor)
                else "below the floor: no router can"
            )
            lines.append(f"  {TARGET_MARGIN:.0%} below {key} ({(1 - TARGET_MARGIN) * mean * 1e3:.1f} ms): {reach}")
    return lines


SWEEP_KEYS = (
    "offered_rps",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_mean_s",
    "throughput_rps",
    "slo_attainment",
)


def sweep_point(summary: dict[str, Any]) -> dict[str, Any]:
    """What the sweep keeps of one run's summary."""
    return {key: summary[key] for key in (*SWEEP_KEYS, "prefix_reuse", "completed", "failed")}


def plot_ttft_vs_rate(results: dict[str, dict[str, Any]], path: Path, slo: Slo) -> None:
    """Mean and p99 TTFT against the offered rate, one line per arm, an absolute TTFT SLO drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, summary in results.items():
        points = summary["sweep"]
        rates = [p["offered_rps"] for p in points]
        (line,) = ax.plot(rates, [p["ttft_mean_s"] * 1e3 for p in points], marker="o", label=f"{name} mean")
        ax.plot(rates, [p["ttft_p99_s"] * 1e3 for p in points], ls="--", color=line.get_color(), alpha=0.6)
    if not slo.per_request:
        limit_ms = slo.ttft_limit(0) * 1e3
        ax.axhline(limit_ms, color="grey", lw=0.8, ls=":", label=f"TTFT SLO {limit_ms:g} ms")
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("TTFT ms (solid: mean, dashed: p99)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_table(results: dict[str, dict[str, Any]]) -> str:
    """Each arm's sweep (offered rate: TTFT mean / p99 ms, SLO attainment) and its goodput."""
    lines = ["| arm | goodput req/s | offered req/s: TTFT mean / p99 ms, SLO attainment |", "|---|---:|---|"]
    for key, s in results.items():
        points = "; ".join(
            f"{p['offered_rps']:.1f}: {p['ttft_mean_s'] * 1e3:.0f} / {p['ttft_p99_s'] * 1e3:.0f}, "
            f"{p['slo_attainment']:.2f}"
            for p in s["sweep"]
        )
        lines.append(f"| {key} | {s['goodput_rps']:.1f} | {points} |")
    return "\n".join(lines)


def table(results: dict[str, dict[str, Any]], ceiling: float) -> str:
    head = (
        "| arm | TTFT mean s | p50 | p99 | frontend's TTFT mean s | ITL mean ms | req/s | prefix reuse (ceiling) "
        "| completed | failed | frontend CPU ms/req | kvpilot router CPU ms/req | Envoy CPU ms/req |"
    )
    lines = [head, "|---|" + "---:|" * 12]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    for key, s in results.items():
        cpu = s["cpu_s_per_request"]
        lines.append(
            f"| {key} | {s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} "
            f"| {s['frontend_ttft_mean_s']:.3f} "
            f"| {s['itl_mean_s'] * 1e3:.2f} | {s['throughput_rps']:.2f} | {s['prefix_reuse']:.3f} ({ceiling:.3f}) "
            f"| {s['completed']} | {s['failed']} | {ms(cpu['frontend'])} | {ms(cpu.get('kvpilot_router'))} "
            f"| {ms(cpu.get('envoy'))} |"
        )
    return "\n".join(lines)


def cost_overrides(text: str) -> tuple[tuple[str, object], ...]:
    """``key=value,...`` as (key, value) pairs, each value read as YAML (``1000`` a number,
    ``predicted_ttft`` a string); the router's config checks them when it starts."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        pairs.append((key.strip(), yaml.safe_load(value)))
    return tuple(pairs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    parser.add_argument("--workers", type=int, default=0, help="aggregated workers (default 4 without --prefill)")
    parser.add_argument("--prefill", type=int, default=0)
    parser.add_argument("--decode", type=int, default=0)
    parser.add_argument("--speedup", type=float, default=10.0, help="the mocker's --speedup-ratio")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate over the trace's")
    parser.add_argument("--max-requests", type=int, default=200)
    parser.add_argument("--json", type=Path, default=Path("/tmp/kvpilot-bench-fleet.json"))
    parser.add_argument("--tokens-per-hash", type=int, default=512, help="prompt tokens per trace hash id")
    parser.add_argument("--block-size", type=int, default=32, help="the mockers' KV block size")
    parser.add_argument(
        "--max-input-tokens", type=int, default=None, help="cap each prompt to its first N tokens (default: none)"
    )
    parser.add_argument("--concurrency", type=int, default=256, help="most requests in flight")
    parser.add_argument(
        "--rate-sweep",
        default="",
        help="comma-separated --rate-scale values to run every arm at as well (goodput and the plot), e.g. 1,2,4,8",
    )
    parser.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        help="an absolute TTFT SLO in seconds (with --itl-slo; default: scale-free, on the measured floor)",
    )
    parser.add_argument("--itl-slo", type=float, default=None, help="an absolute ITL SLO in seconds (with --ttft-slo)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG: TTFT against the offered rate (--rate-sweep)")
    parser.add_argument(
        "--kvpilot-replicas",
        type=int,
        default=1,
        help="kvpilot router replicas in arm kvpilot_relay, the client round-robins over them (issue 21)",
    )
    parser.add_argument(
        "--serving-niceness",
        type=int,
        default=0,
        help="nice value for the frontend and kvpilot's router (e.g. -10, as root): the serving path ahead of "
        "the simulated workers, which on this box share its cores and on a real deployment do not",
    )
    parser.add_argument(
        "--client-connections",
        type=Connections,
        choices=list(Connections),
        default=Connections.KEPT_ALIVE,
        help="the client's connections: pooled (kept-alive) or one per request (fresh)",
    )
    parser.add_argument(
        "--envoy-upstream-http2",
        action="store_true",
        help="every Envoy arm reaches the frontend over HTTP/2 on kept-alive connections, not one HTTP/1.1 "
        "connection per request",
    )
    parser.add_argument("--arms", default=",".join(a.value for a in ArmName), help="comma-separated arm names")
    parser.add_argument(
        "--tuned-flags",
        default=None,
        help=f"Dynamo KV router flags of arm dynamo_kv_tuned (default: {' '.join(TUNED_FLAGS)}; "
        f"disaggregated: {' '.join(TUNED_DISAGG_FLAGS)})",
    )
    parser.add_argument("--mocker-flags", default="", help="more flags for every mocker worker")
    parser.add_argument(
        "--kvpilot-cost",
        type=cost_overrides,
        default=None,
        help="kvpilot's cost section over its defaults (default: none), comma-separated key=value "
        "(e.g. objective=predicted_ttft,session_affinity_credit=1000; see docs/guides/router.md)",
    )
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument(
        "--no-floor", dest="floor", action="store_false", help="skip the TTFT floor's calibration (a fleet start)"
    )
    args = parser.parse_args(argv)
    if not args.workers and not (args.prefill and args.decode):
        if args.prefill or args.decode:
            parser.error("--prefill and --decode go together")
        args.workers = 4
    if (args.ttft_slo is None) != (args.itl_slo is None):
        parser.error("--ttft-slo and --itl-slo go together")
    if args.rate_sweep and not args.floor and args.ttft_slo is None:
        parser.error("--rate-sweep needs SLOs: the measured floor's (drop --no-floor) or --ttft-slo and --itl-slo")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests: list[TraceRequest] = load_trace(args.trace, args.max_requests)
    vocab = TINY_MODEL_SPEC.vocab_size
    shape = PromptShape(args.tokens_per_hash, args.block_size, vocab, args.max_input_tokens, args.seed)
    synth = PromptSynth(shape)
    ceiling = reuse_ceiling(shape, requests)
    hits, _ = ideal_hits(shape, requests)
    times = arrivals(requests, args.rate_scale)
    bodies = [body(synth.prompt(r), r.output_length) for r in requests]
    digests = prompt_block_digests(synth, requests)
    lengths = [shape.input_tokens(r) for r in requests]

    def at_rate(rate_scale: float) -> Workload:
        timed = enumerate(zip(bodies, arrivals(requests, rate_scale), strict=True))
        sends = [Send(i, t, b, headers(requests[i].session_id)) for i, (b, t) in timed]
        return Workload(sends, lengths, [n // shape.block_size for n in lengths], digests)

    workload = at_rate(args.rate_scale)
    counts = {"workers": args.workers} if args.workers else {"prefill": args.prefill, "decode": args.decode}
    base = DynamoFleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-fleet-")),
        block_size=args.block_size,
        speedup_ratio=args.speedup,
        mocker_flags=tuple(args.mocker_flags.split()),
        envoy_upstream_http2=args.envoy_upstream_http2,
        **PORTS,  # type: ignore[arg-type]
        **counts,
    )
    sessions = len({r.session_id for r in requests if r.session_id is not None})
    described = {
        "trace": str(args.trace),
        "requests": len(requests),
        "arrival_span_s": times[-1] if times else 0.0,
        "tokens_per_hash": shape.tokens_per_hash,
        "prompts_scaled": shape.tokens_per_hash != 512,
        "prompts_capped": sum(shape.capped(r) for r in requests),
        "prompts_over_model_positions": sum(n > TINY_MODEL_SPEC.max_position_embeddings for n in lengths),
        "input_tokens": ceiling.input_tokens,
        "mean_input_tokens": ceiling.input_tokens / max(1, len(requests)),
        "output_tokens": sum(r.output_length for r in requests),
        "reuse_ceiling": ceiling.reuse,
        "block_size": shape.block_size,
        "sessions": sessions,
    }
    log(f"workload: {json.dumps(described)}")
    tuned = None if args.tuned_flags is None else tuple(args.tuned_flags.split())
    wanted = {name.strip() for name in args.arms.split(",")}
    chosen = [a for a in arms(bool(args.prefill), tuned, sessions > 0, args.kvpilot_cost) if a.name.value in wanted]
    floor = measure_floor(base, [n - hit for n, hit in zip(lengths, hits, strict=True)], args) if args.floor else None
    slo = run_slo(args, floor)
    results: dict[str, dict[str, Any]] = {}
    for arm in chosen:
        results[arm.name.value] = run_arm(
            arm, replace(base, run_dir=base.run_dir / arm.name.value), workload, slo, args
        )
    sweep_rates = sorted({float(x) for x in args.rate_sweep.split(",") if x.strip()} - {args.rate_scale})
    for rate_scale in sweep_rates:  # rate by rate, every arm at one rate before the next rate
        for arm in chosen:
            run_dir = base.run_dir / f"{arm.name.value}-x{rate_scale:g}"
            point = run_arm(arm, replace(base, run_dir=run_dir), at_rate(rate_scale), slo, args)
            results[arm.name.value].setdefault("sweep", []).append({"rate_scale": rate_scale, **sweep_point(point)})
    if sweep_rates and slo is not None:
        for summary in results.values():
            main_point = {"rate_scale": args.rate_scale, **sweep_point(summary)}
            summary["sweep"] = sorted([main_point, *summary["sweep"]], key=lambda p: p["offered_rps"])
            points = [SweepPoint(p["offered_rps"], p["slo_attainment"]) for p in summary["sweep"]]
            summary["goodput_rps"] = goodput(points)
        if args.plot:
            plot_ttft_vs_rate(results, args.plot, slo)
    out = {
        **results,
        "run": {
            "argv": recorded_argv(),
            "workload": described,
            "fleet": counts,
            "speedup": args.speedup,
            "client_connections": args.client_connections.value,
            "envoy_upstream": "http2" if args.envoy_upstream_http2 else "http1.1, one request per connection",
            "serving_niceness": args.serving_niceness,
            "kvpilot_replicas": args.kvpilot_replicas,
            "kvpilot_cost": {a.name.value: dict(a.router_cost) for a in chosen if a.router_cost},
            "ttft_floor": None
            if floor is None
            else {
                "mean_s": floor.mean_s,
                "coefficients": floor.coefficients,
                "samples": floor.samples,
                "request_ttft_s": floor.request_ttft_s,
                "idle_itl_s": floor.idle_itl_s,
            },
            "slo": None
            if slo is None
            else {
                "ttft_s": None if slo.per_request else slo.ttft_limit(0),
                "ttft_x_floor": TTFT_SLO_X if slo.per_request else None,
                "itl_s": slo.itl_s,
                "attainment": ATTAINMENT,
            },
        },
    }
    out["provenance"] = run = provenance()
    args.json.write_text(json.dumps(finite(out), indent=2))
    print()
    print(describe(run))
    print(
        f"{counts}, speedup {args.speedup}, rate x{args.rate_scale}, {len(requests)} requests of {args.trace.name}, "
        f"client connections {args.client_connections.value}, serving niceness {args.serving_niceness}, "
        f"kvpilot cost {next((dict(a.router_cost) for a in chosen if a.router_cost), 'defaults')}"
    )
    print(table(results, ceiling.reuse))
    stages = stage_table(results)
    if stages:
        print("\n" + stages)
    for key, summary in results.items():
        if "kvpilot_router_stages" in summary:
            stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in summary["kvpilot_router_stages"].items())
            print(f"\n{key}: the router's own TTFT stages: {stages}")
    if floor is not None:
        print("\n" + "\n".join(floor_lines(results, floor)))
    if slo is not None:
        print(f"\nSLOs: {slo_text(slo, floor)}, met by {ATTAINMENT:.0%} of requests")
    if sweep_rates and slo is not None:
        print(sweep_table(results))
    print(f"\nJSON: {args.json}")
    return 0
