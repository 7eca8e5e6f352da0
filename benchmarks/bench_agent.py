"""The article's coding agent on the CPU box: five ways to serve it, side by side, one run.

The workload (:mod:`agent_workload`, seeded): ``--sessions`` agent sessions of
``--steps`` steps share a ~1,000-token system + repository prefix; each step appends a
distinct ~100-token tool output to the session's history and generates a tool call
of ``--generated`` tokens (greedy, ``ignore_eos``, top-1 logprobs, non-streaming).
The last ``--editing-sessions`` sessions edit their history at 1/4, 1/2 and 3/4 of the
run (reasoning trace stripped, message re-rendered, history truncated). Sessions run
concurrently within a step and steps in lockstep, with the engines' ``/metrics``
scraped between steps, so every engine counter is attributed to one step of one arm.

Correctness: a reference trajectory is computed first on one engine of fleet N
(D, co-located use, a fresh ``cache_salt`` per request: no cache). Step k's reference
tokens feed step k+1's history in every arm, so all arms send the same prompts and
an arm's wrong output is counted, not propagated. An output is wrong when its tokens
differ from the reference beyond numeric noise: its max |logprob diff| over the tokens
up to and including the first differing one exceeds ``--tolerance`` (a greedy choice
between near-tied tokens flips on bf16 noise alone; such flips are counted apart). The
numeric noise of known-correct paths is measured in the same run and printed: a
calibration pass on that engine with its prefix cache on (a stable salt per
session: content-matched reuse, correct by construction, but other prefill splits),
and arm (a). The tiny model runs in bf16, so diffs come in steps of ~1/64: in the default
run every known-correct output (calibration and arms a, b, d, e: ~480 outputs) was
within one step (max 0.0161), while the outputs of KV attached by position after a
history edit (arm c) differed by 0.048-0.126 (3 to 8 steps). The default tolerance,
0.03 (under two steps), sits between the two (their geometric mean is 0.028).

Arms, each under its own ``cache_salt`` (no arm inherits another's cache):

Fleet N: 1 P + 1 D, plain ``NixlConnector`` with ``bidirectional_kv_xfer`` (vLLM's
defaults otherwise: ``kv_recompute_threshold`` 64, D holds its blocks 480 s), engines
in ``VLLM_SERVER_DEV_MODE``; its kvpilot router is started but unused.

* (a) no prefix cache: a fresh salt per request, through the in-benchmark P->D proxy
  (P with ``{"do_remote_decode": true}``, ``max_tokens=1``; D with P's params).
* (b) prefix only (article option 1, "P recomputes everything after the shared
  prefix"): before each step P's prefix cache is reset (``POST /reset_prefix_cache``)
  and re-warmed with the shared prefix by one uncounted request, emulating a busy
  fleet where session KV does not survive on P between steps; then the same proxy,
  without session state. D keeps its own cache (vLLM's D pulls only beyond its local hit).
* (c) vLLM's own way: the proxy in conversation-id mode, reproducing the behaviour
  of vLLM's ``examples/online_serving/disaggregated_serving/disagg_proxy_multiturn.py``
  (the NixlConnector bidirectional guide): D's returned ``kv_transfer_params`` are
  kept per conversation (single use, 450 s TTL); the next turn sends them to P with
  ``do_remote_decode=true, do_remote_prefill=false`` (a miss sends
  ``do_remote_decode=true`` with empty remote fields), P answers with ``max_tokens=1``,
  D gets P's params. Written here as in-process calls, non-streaming (vLLM 0.32
  returns kv_transfer_params only in non-streaming answers), not copied.
* (d) vllm-router 0.1.17 in PD mode in front of fleet N (``vllm_router_arm``), no
  session state.

Fleet K: 1 P + 1 D, ``KVPilotConnector`` (``bidirectional_kv_xfer``,
``kv_recompute_threshold`` 0), conditional disaggregation.

* (e) kvpilot: requests to the kvpilot router with ``conversation_id`` = the session.

Per arm: prefill tokens computed (``vllm:prompt_tokens_by_source_total``, both engines;
also the local-cache and external-KV sources), KV bytes moved
(``vllm:nixl_bytes_transferred`` histogram sum, both engines), per-step latency and
TTFT p50/p99 at steps 1, S/2, S, goodput, wrong outputs; then ratios against (e).
TTFT of a non-streaming request is estimated as its latency minus (G - 1) x D's mean
TPOT over the same lockstep step (D's own ``vllm:request_time_per_output_token_seconds``).
Each fleet gets one uncounted NIXL warm-up session (both handshakes, P->D and D->P)
before its arms. One fleet at a time; each is stopped in a ``finally``.

    python benchmarks/bench_agent.py                            # 4 x 20 steps
    python benchmarks/bench_agent.py --sessions 2 --steps 4    # a quick check

Wall time is dominated by this 2-core box's contention: the default run took 56 min
while other fleets shared the box (load average 20-70), a 2 x 4 run 10-15 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import agent_workload as aw
from vllm_router_arm import running_vllm_router

from deploy import fleet as fleet_io
from deploy.client import Completion, complete
from deploy.fleet_spec import FleetSpec
from deploy.metrics import Samples, delta, scrape
from deploy.tiny_model import ensure_tiny_model
from kvconnectors import vllm_metrics as vm
from routing.serve.tokenizer import PromptTokenizer

PROMPT_TOKENS = vm.PROMPT_TOKENS_BY_SOURCE.total
NIXL_BYTES = vm.NIXL_BYTES_TRANSFERRED
TPOT = vm.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS
ARMS = {
    "a": "(a) no prefix cache",
    "b": "(b) prefix only (P re-prefills)",
    "c": "(c) vLLM conversation_id proxy",
    "d": "(d) vllm-router PD",
    "e": "(e) kvpilot",
}
FLEET_N = {
    "connector": "NixlConnector",
    "connector_extra_config": {"bidirectional_kv_xfer": True},
    "disaggregation": "always",
    "engine_port": 9410,
    "side_channel_port": 7640,
    "events_port": 7740,
    "router_port": 9400,
    "engine_env": {"VLLM_SERVER_DEV_MODE": "1"},
}
FLEET_K = {
    "connector": "KVPilotConnector",
    "connector_extra_config": {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0},
    "disaggregation": "conditional",
    "engine_port": 9510,
    "side_channel_port": 7660,
    "events_port": 7760,
    "router_port": 9500,
}
VLLM_ROUTER_PORT = 9420
STALL_S = 25.0
"""A request this slow is counted as stalled (P's NIXL lease on blocks for D is 30 s)."""
P_SECONDS = "X-Bench-P-Seconds"
"""Set by the in-benchmark proxy on D's completion: how long P's half took."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- results ---------------------------------------------------------------------
@dataclass
class Outcome:
    """One request of one arm."""

    session: int
    step: int
    latency: float
    completion: Completion | None
    error: str | None = None
    tokens_match: bool = False
    max_diff: float = math.inf
    route: str | None = None
    ttft: float | None = None
    wrong: bool = False
    p_seconds: float | None = None
    """P's half of the latency (the in-benchmark proxy's arms only)."""
    first_mismatch: int | None = None
    """Index of the first generated token that differs from the reference (None: all equal)."""


@dataclass
class StepCounters:
    compute: dict[str, float]
    """Prompt tokens computed per engine (``local_compute``)."""
    cached: float
    external: float
    kv_bytes: float
    transfers: float
    tpot: float | None
    """D's mean time per output token over the step's requests."""
    extra: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def computed(self) -> float:
        return sum(self.compute.values())


@dataclass
class ArmResult:
    key: str
    outcomes: list[Outcome] = field(default_factory=list)
    steps: dict[int, StepCounters] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# ---- talking to engines ------------------------------------------------------------
def post_json(url: str, timeout: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.load(resp)  # type: ignore[no-any-return]


def counters(before: dict[str, Samples], after: dict[str, Samples], decode: str) -> StepCounters:
    """What the engines counted between two scrapes (``decode``: D's name)."""
    source = vm.PromptTokenSource
    compute = {n: delta(after[n], before[n], PROMPT_TOKENS, source=source.LOCAL_COMPUTE.value) for n in after}
    cached = sum(delta(after[n], before[n], PROMPT_TOKENS, source=source.LOCAL_CACHE_HIT.value) for n in after)
    external = sum(delta(after[n], before[n], PROMPT_TOKENS, source=source.EXTERNAL_KV_TRANSFER.value) for n in after)
    kv_bytes = sum(delta(after[n], before[n], NIXL_BYTES.sum) for n in after)
    transfers = sum(delta(after[n], before[n], NIXL_BYTES.count) for n in after)
    count = delta(after[decode], before[decode], TPOT.count)
    tpot = delta(after[decode], before[decode], TPOT.sum) / count if count else None
    extra = {}
    for decision in ("pull", "recompute"):
        extra[f"pull_decisions_{decision}"] = sum(
            delta(after[n], before[n], vm.KVPILOT_PULL_DECISIONS.total, decision=decision) for n in after
        )
    extra["verified_blocks"] = sum(delta(after[n], before[n], vm.KVPILOT_VERIFIED_BLOCKS.total) for n in after)
    return StepCounters(compute, cached, external, kv_bytes, transfers, tpot, extra)


def p_to_d(
    p_url: str,
    d_url: str,
    prompt: list[int],
    salt: str,
    generated: int,
    timeout: float,
    p_params: dict[str, Any] | None = None,
) -> Completion:
    """The P->D proxy: P prefills (``max_tokens=1``) with ``p_params`` (default: a plain
    handoff), D generates with P's returned params (D prefills itself if P returned none)."""
    params = p_params if p_params is not None else {"do_remote_decode": True}
    p = complete(p_url, prompt, max_tokens=1, kv_transfer_params=params, cache_salt=salt, timeout=timeout)
    extra = {"kv_transfer_params": p.kv_transfer_params} if p.kv_transfer_params else {}
    d = complete(
        d_url,
        prompt,
        max_tokens=generated,
        ignore_eos=True,
        return_token_ids=True,
        cache_salt=salt,
        timeout=timeout,
        **extra,
    )
    return dataclasses.replace(d, headers={**d.headers, P_SECONDS: f"{p.total_seconds:.6f}"})


class ConversationProxy:
    """Arm (c): the behaviour of vLLM's ``disagg_proxy_multiturn.py`` (see the module doc)."""

    TTL_S = 450.0  # the example's: below vLLM's 480 s hold of D's blocks
    MISS: ClassVar[dict[str, Any]] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }

    def __init__(self, p_url: str, d_url: str, salt: str, generated: int, timeout: float) -> None:
        self.p_url, self.d_url, self.salt, self.generated, self.timeout = p_url, d_url, salt, generated, timeout
        self._store: dict[str, tuple[dict[str, Any], float]] = {}
        self.hits = 0
        self.misses = 0

    def _take(self, conversation_id: str) -> dict[str, Any] | None:
        entry = self._store.pop(conversation_id, None)  # single use
        if entry is None or time.time() - entry[1] > self.TTL_S:
            return None
        return dict(entry[0])

    def __call__(self, conversation_id: str, prompt: list[int]) -> Completion:
        cached = self._take(conversation_id)
        if cached is not None:
            self.hits += 1
            params = {**cached, "do_remote_decode": True, "do_remote_prefill": False}
        else:
            self.misses += 1
            params = dict(self.MISS)
        out = p_to_d(self.p_url, self.d_url, prompt, self.salt, self.generated, self.timeout, params)
        if out.kv_transfer_params:
            self._store[conversation_id] = (dict(out.kv_transfer_params), time.time())
        return out


def reset_prefix_cache(p_url: str, attempts: int = 40) -> int:
    """Empty P's prefix cache (dev mode). vLLM refuses while blocks are held; a tiny
    local request makes P step and free the blocks D finished reading. Returns the
    number of attempts it took; raises after ``attempts``."""
    for attempt in range(1, attempts + 1):
        if post_json(f"{p_url}/reset_prefix_cache").get("success"):
            return attempt
        complete(p_url, [aw.FIRST_ORDINARY_ID] * 4, max_tokens=1, timeout=60)
        time.sleep(0.25)
    raise RuntimeError(f"{p_url}: /reset_prefix_cache refused {attempts} times (blocks still held)")


def nixl_warm_up(p_url: str, d_url: str, timeout: float) -> float:
    """One uncounted two-turn session that makes both NIXL handshakes (D reads P,
    then P reads D: 96 tokens beyond P's own hit, above vLLM's 64-token rule).
    Returns its seconds."""
    started = time.perf_counter()
    salt = f"nixl-warm-up-{uuid.uuid4().hex}"
    x = [aw.FIRST_ORDINARY_ID + (i * 37) % 1900 for i in range(256)]
    d1 = p_to_d(p_url, d_url, x, salt, 97, timeout)
    x2 = x + list(d1.token_ids) + [aw.FIRST_ORDINARY_ID + (i * 53) % 1900 for i in range(40)]
    offer = {**(d1.kv_transfer_params or {}), "do_remote_decode": True, "do_remote_prefill": False}
    p_to_d(p_url, d_url, x2, salt, 2, timeout, offer)
    return time.perf_counter() - started


def logged_warm_up(fleet: str, p_url: str, d_url: str, timeout: float) -> float:
    """:func:`nixl_warm_up`, logged; ``nan`` seconds if it failed (the arms still run)."""
    log(f"NIXL warm-up on fleet {fleet} (uncounted)")
    try:
        seconds = nixl_warm_up(p_url, d_url, timeout)
    except Exception as exc:  # noqa: BLE001 - a failed warm-up is reported, the run goes on
        log(f"  warm-up failed: {exc}")
        return math.nan
    log(f"  warm-up took {seconds:.1f} s")
    return seconds


@contextmanager
def running(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, progress=lambda m: log(m.strip()))
    try:
        yield started
    finally:
        log(f"stopping the fleet in {spec.run_dir}")
        fleet_io.down(spec.run_dir)


# ---- the lockstep runner -------------------------------------------------------------
Send = Callable[[int, int, list[int]], Completion]


def lockstep(
    key: str,
    send: Send,
    prompts: dict[tuple[int, int], list[int]],
    engines: dict[str, str],
    decode: str,
    args: argparse.Namespace,
    before_step: Callable[[int], None] | None = None,
    route_header: str | None = None,
) -> ArmResult:
    """All sessions' step k concurrently, scrape, step k+1, ..."""
    result = ArmResult(key)
    started = time.perf_counter()

    def one(session: int, step: int) -> Outcome:
        t0 = time.perf_counter()
        try:
            out = send(session, step, prompts[(session, step)])
            route = out.headers.get(route_header) if route_header else None
            p_s = float(out.headers[P_SECONDS]) if P_SECONDS in out.headers else None
            return Outcome(session, step, time.perf_counter() - t0, out, route=route, p_seconds=p_s)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, the arm goes on
            return Outcome(session, step, time.perf_counter() - t0, None, error=f"{type(exc).__name__}: {exc}"[:300])

    with ThreadPoolExecutor(max_workers=args.sessions) as pool:
        for step in range(1, args.steps + 1):
            if before_step is not None:
                before_step(step)
            before = {n: scrape(u) for n, u in engines.items()}
            t0 = time.perf_counter()
            outcomes = list(pool.map(one, range(args.sessions), [step] * args.sessions))
            wall = time.perf_counter() - t0
            time.sleep(args.settle)  # counters reach /metrics on the stats loop's next tick
            after = {n: scrape(u) for n, u in engines.items()}
            result.steps[step] = counters(before, after, decode)
            result.steps[step].wall = wall
            result.outcomes += outcomes
            errors = sum(o.error is not None for o in outcomes)
            c = result.steps[step]
            log(
                f"  {key} step {step:2d}: {wall:6.2f} s, computed {c.computed:6.0f}, "
                f"cached {c.cached:6.0f}, external {c.external:6.0f}, KV {c.kv_bytes / 1e6:6.2f} MB"
                + (
                    f", {errors} failed: {outcomes[[o.error is not None for o in outcomes].index(True)].error}"
                    if errors
                    else ""
                )
            )
    result.seconds = time.perf_counter() - started
    return result


def compare(out: Completion, ref: Completion) -> tuple[int | None, float]:
    """(index of the first generated token that differs from the reference or None,
    max |logprob diff| over the tokens up to and including it).

    After the first differing token the two sequences have different contexts, so
    their logprobs are not comparable. A greedy choice between two near-tied tokens
    can flip on numeric noise alone (random weights give flat distributions): then
    both chosen tokens have about the same logprob and the diff at the flip stays
    within the noise; wrong KV shows a larger diff at or before it."""
    ids = out.token_ids if out.token_ids and ref.token_ids else None
    a, b = (ids, ref.token_ids) if ids else (out.tokens, ref.tokens)
    if len(out.logprobs) != len(ref.logprobs) or len(a) != len(b):
        return 0, math.inf
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    end = len(a) if first is None else first + 1
    return first, max((abs(x - y) for x, y in zip(out.logprobs[:end], ref.logprobs[:end], strict=True)), default=0.0)


def judge(result: ArmResult, reference: dict[tuple[int, int], Completion], generated: int, tol: float) -> None:
    """Correctness against the reference and the TTFT estimate of each outcome."""
    tpots = [c.tpot for c in result.steps.values() if c.tpot is not None]
    arm_tpot = statistics.fmean(tpots) if tpots else 0.0
    for o in result.outcomes:
        if o.completion is None:
            continue
        o.first_mismatch, o.max_diff = compare(o.completion, reference[(o.session, o.step)])
        o.tokens_match = o.first_mismatch is None
        o.wrong = o.max_diff > tol
        tpot = result.steps[o.step].tpot
        o.ttft = max(0.0, o.latency - (generated - 1) * (tpot if tpot is not None else arm_tpot))


# ---- statistics and output ---------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Percentile ``q`` (0-100), linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def at_step(result: ArmResult, step: int, what: str) -> list[float]:
    return [
        getattr(o, what)
        for o in result.outcomes
        if o.step == step and o.completion is not None and getattr(o, what) is not None
    ]


def summarize(result: ArmResult, report_steps: list[int], ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    steps = result.steps.values()
    good = [
        o
        for o in result.outcomes
        if o.completion is not None
        and not o.wrong
        and o.ttft is not None
        and o.ttft <= ttft_slo
        and (result.steps[o.step].tpot or 0.0) <= tpot_slo
    ]
    tpots = [c.tpot for c in steps if c.tpot is not None]
    per_engine: dict[str, float] = {}
    for c in steps:
        for name, v in c.compute.items():
            per_engine[name] = per_engine.get(name, 0.0) + v
    routes: dict[str, int] = {}
    for o in result.outcomes:
        if o.route:
            routes[o.route] = routes.get(o.route, 0) + 1
    wrong = [o for o in result.outcomes if o.completion is not None and o.wrong]
    return {
        "arm": ARMS[result.key],
        "requests": len(result.outcomes),
        "prefill_computed": sum(c.computed for c in steps),
        "prefill_computed_by_engine": per_engine,
        "local_cache_hit": sum(c.cached for c in steps),
        "external_kv_transfer": sum(c.external for c in steps),
        "kv_bytes": sum(c.kv_bytes for c in steps),
        "nixl_transfers": sum(c.transfers for c in steps),
        "latency": {
            k: {"p50": pct(at_step(result, k, "latency"), 50), "p99": pct(at_step(result, k, "latency"), 99)}
            for k in report_steps
        },
        "ttft": {
            k: {"p50": pct(at_step(result, k, "ttft"), 50), "p99": pct(at_step(result, k, "ttft"), 99)}
            for k in report_steps
        },
        "tpot_mean": statistics.fmean(tpots) if tpots else math.nan,
        "goodput": len(good),
        "wrong": len(wrong),
        "token_flips": sum(o.completion is not None and not o.wrong and not o.tokens_match for o in result.outcomes),
        "stalled": sum(o.latency >= STALL_S for o in result.outcomes),
        "slowest": max(((o.latency, o.p_seconds) for o in result.outcomes), default=(math.nan, None)),
        "wrong_at": sorted({(o.session, o.step) for o in wrong}),
        "failed": sum(o.error is not None for o in result.outcomes),
        "errors": sorted({o.error for o in result.outcomes if o.error})[:5],
        "max_logprob_diff_correct": max(
            (o.max_diff for o in result.outcomes if o.completion is not None and not o.wrong), default=0.0
        ),
        "routes": routes,
        "extra": {k: sum(c.extra.get(k, 0.0) for c in steps) for k in next(iter(steps)).extra} if steps else {},
        "seconds": result.seconds,
        "notes": result.notes,
    }


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def fmt_s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def tables(summaries: dict[str, dict[str, Any]], report_steps: list[int], total_requests: int) -> str:
    lines = [
        (
            "| arm | prefill computed | local cache hit | external KV | KV moved MB (xfers) "
            "| wrong | near-tie flips | failed | stalled | goodput |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {s['arm']} | {s['prefill_computed']:,.0f} | {s['local_cache_hit']:,.0f} | "
        f"{s['external_kv_transfer']:,.0f} | {s['kv_bytes'] / 1e6:,.1f} ({s['nixl_transfers']:.0f}) | "
        f"{s['wrong']} | {s['token_flips']} | {s['failed']} | {s['stalled']} | "
        f"{s['goodput']}/{total_requests} |"
        for s in summaries.values()
    )
    head = (
        " | ".join(f"lat s{k} p50/p99" for k in report_steps)
        + " | "
        + " | ".join(f"TTFT s{k} p50/p99" for k in report_steps)
    )
    lines += ["", f"| arm | {head} | D TPOT ms | arm wall s |", "|---|" + "---:|" * (2 * len(report_steps) + 2)]
    for s in summaries.values():
        cells = [f"{fmt_s(s['latency'][k]['p50'])} / {fmt_s(s['latency'][k]['p99'])}" for k in report_steps]
        cells += [f"{fmt_s(s['ttft'][k]['p50'])} / {fmt_s(s['ttft'][k]['p99'])}" for k in report_steps]
        lines.append(f"| {s['arm']} | " + " | ".join(cells) + f" | {s['tpot_mean'] * 1e3:.1f} | {s['seconds']:.0f} |")
    return "\n".join(lines)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def plot(results: dict[str, ArmResult], path: Path, edited_steps: list[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    failed_label = "x: that step had failed requests (not computed)"
    for key, r in results.items():
        if not r.steps:
            continue
        xs = sorted(r.steps)
        (line,) = ax.plot(xs, [r.steps[k].computed for k in xs], marker="o", markersize=3, label=ARMS[key])
        failed = sorted({o.step for o in r.outcomes if o.error is not None})
        ax.plot(
            failed,
            [r.steps[k].computed for k in failed],
            "x",
            color=line.get_color(),
            markersize=9,
            markeredgewidth=2,
            label=failed_label if failed else None,
        )
        if failed:
            failed_label = None
    for k in edited_steps:
        ax.axvline(k, color="grey", linestyle=":", linewidth=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("agent step (dotted: a session resends an edited history)")
    ax.set_ylabel("prompt tokens computed (P + D)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the run ---------------------------------------------------------------------------
def reference_pass(d_url: str, workload: aw.Workload, args: argparse.Namespace):
    """Every session's trajectory on one engine without cache; the prompts every arm sends."""
    prompts: dict[tuple[int, int], list[int]] = {}
    reference: dict[tuple[int, int], Completion] = {}
    with ThreadPoolExecutor(max_workers=args.sessions) as pool:
        for step in range(1, args.steps + 1):
            for s in range(args.sessions):
                prompts[(s, step)] = workload.prompt(s, step)

            def ref(s: int, step: int = step) -> Completion:
                return complete(
                    d_url,
                    prompts[(s, step)],
                    max_tokens=args.generated,
                    ignore_eos=True,
                    return_token_ids=True,
                    cache_salt=f"ref-{uuid.uuid4().hex}",
                    timeout=args.request_timeout,
                )

            for s, out in enumerate(pool.map(ref, range(args.sessions))):
                if len(out.token_ids) != args.generated:
                    raise RuntimeError(f"reference step {step} session {s}: {len(out.token_ids)} tokens")
                reference[(s, step)] = out
                workload.advance(s, step, list(out.token_ids))
    return prompts, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--tool-tokens", type=int, default=100)
    parser.add_argument("--generated", type=int, default=32, help="G: tokens of each tool call")
    parser.add_argument("--editing-sessions", type=int, default=1, help="sessions that edit their history")
    parser.add_argument(
        "--edit-steps",
        type=lambda s: tuple(int(x) for x in s.split(",") if x),
        default=None,
        help="steps after which they edit (default: 1/4, 1/2, 3/4 of --steps)",
    )
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--arms", default="abcde", help="which arms to run (letters)")
    parser.add_argument(
        "--tolerance", type=float, default=0.03, help="max |logprob diff| of a correct output (see the module doc)"
    )
    parser.add_argument("--ttft-slo", type=float, default=None, help="default: 1.5 x arm (a)'s TTFT p50 at step 1")
    parser.add_argument("--tpot-slo", type=float, default=None, help="default: 1.5 x arm (a)'s median step TPOT")
    parser.add_argument("--request-timeout", type=float, default=240.0)
    parser.add_argument("--warm-up-timeout", type=float, default=300.0)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds before each after-step scrape")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvpilot-bench-agent.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/images/bench_agent_prefill.png"))
    args = parser.parse_args()
    arms = [a for a in "abcde" if a in args.arms]
    t_run = time.perf_counter()
    timings: dict[str, float] = {}

    model_dir = ensure_tiny_model()
    tokenizer = PromptTokenizer(model_dir)
    wspec = aw.WorkloadSpec(
        args.sessions,
        args.steps,
        args.prefix_tokens,
        args.tool_tokens,
        args.generated,
        args.editing_sessions,
        args.edit_steps,
        args.seed,
    )
    workload = aw.build(wspec, tokenizer)
    run_id = uuid.uuid4().hex[:8]
    root = Path(tempfile.mkdtemp(prefix="kvpilot-bench-agent-"))
    log(
        f"workload: {args.sessions} sessions x {args.steps} steps, prefix {args.prefix_tokens}, tool output "
        f"{args.tool_tokens}, G={args.generated}; editing sessions {args.editing_sessions} at {wspec.edit_plan}; "
        f"logs under {root}"
    )
    results: dict[str, ArmResult] = {}
    noise: dict[str, Any] = {}
    warm_ups: dict[str, float] = {}
    fleet_n_arms = [a for a in arms if a in "abcd"]

    # Fleet N: the reference, the calibration pass, arms a-d.
    spec_n = FleetSpec(model_dir=model_dir, run_dir=root / "fleet-n", **FLEET_N)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    log("starting fleet N (NixlConnector, 1 P + 1 D)")
    with running(spec_n) as fleet:
        timings["fleet_n_up"] = time.perf_counter() - t0
        p_url, d_url = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
        engines = {"P": p_url, "D": d_url}

        t0 = time.perf_counter()
        log(f"reference trajectory on D ({d_url}), a fresh cache_salt per request")
        prompts, reference = reference_pass(d_url, workload, args)
        timings["reference"] = time.perf_counter() - t0
        edited_steps = sorted({k + 1 for _, k, _ in workload.edits_done})
        log(
            f"reference done in {timings['reference']:.0f} s; edits {workload.edits_done}; "
            f"last prompt {max(len(p) for p in prompts.values())} tokens"
        )

        t0 = time.perf_counter()
        log("calibration: the same prompts on D with its prefix cache (a stable salt per session)")
        calib = lockstep(
            "calibration",
            lambda s, k, p: complete(
                d_url,
                p,
                max_tokens=args.generated,
                ignore_eos=True,
                return_token_ids=True,
                cache_salt=f"calib-{run_id}-{s}",
                timeout=args.request_timeout,
            ),
            prompts,
            {"D": d_url},
            "D",
            args,
        )
        judge(calib, reference, args.generated, math.inf)
        calib_diffs = [o.max_diff for o in calib.outcomes if o.completion is not None]
        noise["calibration"] = {
            "max": max(calib_diffs, default=math.nan),
            "median": statistics.median(calib_diffs) if calib_diffs else math.nan,
            "token_flips": sum(not o.tokens_match for o in calib.outcomes),
            "cached_tokens": sum(c.cached for c in calib.steps.values()),
        }
        timings["calibration"] = time.perf_counter() - t0
        log(f"calibration noise: {noise['calibration']}")

        if fleet_n_arms:
            warm_ups["N"] = logged_warm_up("N", p_url, d_url, args.warm_up_timeout)

        for key in fleet_n_arms:
            salt = f"arm-{key}-{run_id}"
            t0 = time.perf_counter()
            log(f"arm {ARMS[key]}")
            before_step = None
            with ExitStack() as stack:
                if key == "a":

                    def send(s: int, k: int, p: list[int]) -> Completion:
                        return p_to_d(p_url, d_url, p, f"a-{uuid.uuid4().hex}", args.generated, args.request_timeout)

                elif key == "b":
                    resets: list[int] = []

                    def before_step(step: int, salt: str = salt, resets: list[int] = resets) -> None:
                        resets.append(reset_prefix_cache(p_url))
                        complete(p_url, workload.prefix, max_tokens=1, cache_salt=salt, timeout=args.request_timeout)

                    def send(s: int, k: int, p: list[int], salt: str = salt) -> Completion:
                        return p_to_d(p_url, d_url, p, salt, args.generated, args.request_timeout)

                elif key == "c":
                    proxy = ConversationProxy(p_url, d_url, salt, args.generated, args.request_timeout)

                    def send(s: int, k: int, p: list[int], proxy: ConversationProxy = proxy) -> Completion:
                        return proxy(f"session-{s}", p)

                else:
                    url = stack.enter_context(
                        running_vllm_router([p_url], [d_url], VLLM_ROUTER_PORT, root / "vllm-router.log")
                    )

                    def send(s: int, k: int, p: list[int], url: str = url, salt: str = salt) -> Completion:
                        return complete(
                            url,
                            p,
                            max_tokens=args.generated,
                            ignore_eos=True,
                            return_token_ids=True,
                            cache_salt=salt,
                            timeout=args.request_timeout,
                        )

                results[key] = lockstep(key, send, prompts, engines, "D", args, before_step)
            if key == "b":
                results[key].notes.append(f"P's prefix cache reset before every step (attempts: max {max(resets)})")
            if key == "c":
                results[key].notes.append(f"proxy offers sent to P: {proxy.hits}, misses: {proxy.misses}")
            timings[f"arm_{key}"] = time.perf_counter() - t0
            for name, url in engines.items():
                if not fleet_io.is_healthy(url):
                    results[key].notes.append(f"{name} unhealthy after the arm")
                    log(f"  {name} is not healthy after arm {key}; restarting it")
                    role = "prefill" if name == "P" else "decode"
                    fleet = fleet_io.restart_engine(spec_n, fleet.by_role(role)[0].name)

    # Fleet K: arm e.
    if "e" in arms:
        spec_k = FleetSpec(model_dir=model_dir, run_dir=root / "fleet-k", **FLEET_K)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        log("starting fleet K (KVPilotConnector, 1 P + 1 D, kvpilot router)")
        with running(spec_k) as fleet:
            timings["fleet_k_up"] = time.perf_counter() - t0
            p_url, d_url, router = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url, fleet.router.url
            warm_ups["K"] = logged_warm_up("K", p_url, d_url, args.warm_up_timeout)
            salt = f"arm-e-{run_id}"
            t0 = time.perf_counter()
            log(f"arm {ARMS['e']} via {router}")

            def send(s: int, k: int, p: list[int]) -> Completion:
                return complete(
                    router,
                    p,
                    max_tokens=args.generated,
                    ignore_eos=True,
                    return_token_ids=True,
                    cache_salt=salt,
                    conversation_id=f"session-{s}",
                    timeout=args.request_timeout,
                )

            results["e"] = lockstep(
                "e", send, prompts, {"P": p_url, "D": d_url}, "D", args, route_header="X-KVPilot-Route"
            )
            timings["arm_e"] = time.perf_counter() - t0

    # Judge, summarize, print.
    for r in results.values():
        judge(r, reference, args.generated, args.tolerance)
    if "a" in results:
        a = results["a"]
        noise["arm_a"] = {
            "max": max((o.max_diff for o in a.outcomes if o.completion), default=math.nan),
            "token_flips": sum(o.completion is not None and not o.tokens_match for o in a.outcomes),
        }
    wrong_diffs = [o.max_diff for r in results.values() for o in r.outcomes if o.completion is not None and o.wrong]
    noise["smallest_diff_among_wrong"] = min(wrong_diffs, default=math.nan)
    noise["largest_diff_among_wrong"] = max(wrong_diffs, default=math.nan)
    base = results.get("a") or next(iter(results.values()), None)
    base_ttft1 = pct(at_step(base, 1, "ttft"), 50) if base else math.nan
    base_tpot = statistics.median([c.tpot for c in base.steps.values() if c.tpot]) if base else math.nan
    ttft_slo = args.ttft_slo if args.ttft_slo is not None else 1.5 * base_ttft1
    tpot_slo = args.tpot_slo if args.tpot_slo is not None else 1.5 * base_tpot
    report_steps = sorted({1, max(1, args.steps // 2), args.steps})
    summaries = {}
    for key in arms:
        r = results.get(key)
        if r is None:
            continue
        summaries[key] = summarize(r, report_steps, ttft_slo, tpot_slo)
    total_requests = args.sessions * args.steps

    def get(key: str, f: Callable[[dict[str, Any]], float]) -> float:
        return f(summaries[key]) if key in summaries else math.nan

    last = args.steps
    ratios = {
        "prefill_a_over_e": ratio(get("a", lambda s: s["prefill_computed"]), get("e", lambda s: s["prefill_computed"])),
        "prefill_b_over_e": ratio(get("b", lambda s: s["prefill_computed"]), get("e", lambda s: s["prefill_computed"])),
        f"ttft_p50_step{last}_b_over_e": ratio(
            get("b", lambda s: s["ttft"][last]["p50"]), get("e", lambda s: s["ttft"][last]["p50"])
        ),
        "goodput_e_over_c": ratio(get("e", lambda s: s["goodput"]), get("c", lambda s: s["goodput"])),
        "goodput_e_over_d": ratio(get("e", lambda s: s["goodput"]), get("d", lambda s: s["goodput"])),
    }
    timings["total"] = time.perf_counter() - t_run

    print()
    print(
        f"## Coding agent, {args.sessions} sessions x {args.steps} steps (prefix {args.prefix_tokens}, tool output "
        f"{args.tool_tokens}, G={args.generated}); session(s) {[s for s in range(args.sessions) if wspec.edits(s)]} "
        f"edit at {', '.join(f'{k} ({aw.EDIT_NAMES[v]})' for k, v in wspec.edit_plan.items())}"
    )
    print()
    print(tables(summaries, report_steps, total_requests))
    print()
    print(
        f"- prefill tokens computed (a)/(e): {ratios['prefill_a_over_e']:.2f}x, (b)/(e): "
        f"{ratios['prefill_b_over_e']:.2f}x"
    )
    print(f"- TTFT p50 at step {last}, (b)/(e): {ratios[f'ttft_p50_step{last}_b_over_e']:.2f}x")
    ge = get("e", lambda s: s["goodput"])
    print(
        f"- goodput (e) {ge:.0f} vs (c) {get('c', lambda s: s['goodput']):.0f} "
        f"({ratios['goodput_e_over_c']:.2f}x) vs (d) {get('d', lambda s: s['goodput']):.0f} "
        f"({ratios['goodput_e_over_d']:.2f}x), of {total_requests} requests"
    )
    print(
        f"- goodput = correct requests with TTFT <= {ttft_slo:.3f} s and their step's D TPOT <= "
        f"{tpot_slo * 1e3:.1f} ms (1.5x arm (a)'s TTFT p50 at step 1 and 1.5x its median step TPOT, unless "
        f"given). TTFT of a non-streaming request = latency - (G-1) x D's mean TPOT over that step "
        f"(D's {TPOT.name})"
    )
    print(
        f"- wrong = max |logprob diff| against the no-cache reference > {args.tolerance}, over the generated "
        f"tokens up to and including the first one that differs (after it the contexts differ). A token that "
        f"differs with a diff within the tolerance is a near-tie flip on numeric noise (bf16, random weights), "
        f"counted apart, not as wrong. Noise of known-correct paths: calibration (D's own prefix cache, "
        f"{noise['calibration']['token_flips']} flips) max {noise['calibration']['max']:.4f}"
        + (f", arm (a) max {noise['arm_a']['max']:.4f}" if "arm_a" in noise else "")
        + f"; wrong outputs' diffs ranged {noise['smallest_diff_among_wrong']:.3g}"
        f" .. {noise['largest_diff_among_wrong']:.3g}"
    )
    print(
        "- arm (b) emulates a busy fleet: P's prefix cache is reset before every step and re-warmed with the "
        "shared prefix only (uncounted, so its step 1 computes no shared prefix, unlike the other arms), so no "
        "session KV survives on P between steps"
    )
    print(
        f"- stalled = requests that took >= {STALL_S:.0f} s; on this 2-core box engines share cores with NIXL's "
        "busy-polling progress threads (and with whatever else runs), so a step can take tens of seconds"
    )
    for key, s in summaries.items():
        extra = []
        if s["wrong"]:
            extra.append(f"wrong at (session, step) {s['wrong_at']}")
        if s["errors"]:
            extra.append(f"errors: {s['errors']}")
        if s["stalled"]:
            lat, p_s = s["slowest"]
            extra.append(
                f"{s['stalled']} request(s) took >= {STALL_S:.0f} s (slowest {lat:.1f} s"
                + (f", of which P {p_s:.1f} s)" if p_s is not None else ")")
            )
        if s["routes"]:
            extra.append(f"routes: {s['routes']}")
        if key == "e":
            extra.append(
                f"P pull decisions {s['extra'].get('pull_decisions_pull', 0):.0f} pull / "
                f"{s['extra'].get('pull_decisions_recompute', 0):.0f} recompute"
            )
        by_engine = s["prefill_computed_by_engine"].items()
        extra.append("computed by engine " + ", ".join(f"{n} {v:,.0f}" for n, v in by_engine))
        extra += s["notes"]
        print(f"- {s['arm']}: " + "; ".join(extra))
    print(f"- NIXL warm-ups (uncounted): {', '.join(f'fleet {k} {v:.1f} s' for k, v in warm_ups.items())}")
    print(
        f"- time: total {timings['total']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items() if k != "total")
        + ")"
    )

    plot(
        results,
        args.plot,
        edited_steps,
        f"Prefill tokens computed per step, {args.sessions} sessions x {args.steps} steps (tiny model, CPU)",
    )
    out = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "edit_plan": wspec.edit_plan,
            "editing_sessions_ids": [s for s in range(args.sessions) if wspec.edits(s)],
            "run_dir": str(root),
        },
        "tolerance": args.tolerance,
        "noise": noise,
        "ttft_slo_s": ttft_slo,
        "tpot_slo_s": tpot_slo,
        "summaries": summaries,
        "ratios": ratios,
        "timings_s": timings,
        "warm_ups_s": warm_ups,
        "per_step": {
            k: {
                step: {
                    "computed": c.computed,
                    "computed_by_engine": c.compute,
                    "cached": c.cached,
                    "external": c.external,
                    "kv_bytes": c.kv_bytes,
                    "tpot": c.tpot,
                    "wall": c.wall,
                    **c.extra,
                }
                for step, c in r.steps.items()
            }
            for k, r in results.items()
        },
        "requests": {
            k: [
                {
                    "session": o.session,
                    "step": o.step,
                    "latency": o.latency,
                    "ttft": o.ttft,
                    "tokens_match": o.tokens_match,
                    "first_mismatch": o.first_mismatch,
                    "max_diff": o.max_diff,
                    "wrong": o.wrong,
                    "error": o.error,
                    "route": o.route,
                    "p_seconds": o.p_seconds,
                }
                for o in r.outcomes
            ]
            for k, r in results.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finite(out), indent=1))
    print(f"- wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
