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

* (a) no prefix cache: a fresh salt per request, through the P->D proxy
  (:func:`deploy.agent_session.prefill_then_decode`: P with ``{"do_remote_decode": true}``,
  ``max_tokens=1``; D with P's params).
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
  D gets P's params. Written in :mod:`agent_arms` as in-process calls, non-streaming
  (vLLM 0.32 returns kv_transfer_params only in non-streaming answers), not copied.
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

The arms are the classes of :mod:`agent_arms`; what a run measured, judged and
summarized is :mod:`agent_results`; the report, plot and JSON are :mod:`agent_output`.

    python benchmarks/bench_agent.py                            # 4 x 20 steps
    python benchmarks/bench_agent.py --sessions 2 --steps 4    # a quick check

Wall time is dominated by this 2-core box's contention: the default run took 56 min
while other fleets shared the box (load average 20-70), a 2 x 4 run 10-15 min.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import agent_workload as aw
from agent_arms import ARMS, Arm, ArmSetup, FleetName, Served
from agent_output import print_report, write_outputs
from agent_results import ArmResult, BenchConfig, Outcome, Run, counters, judge, judge_run

from deploy import fleet as fleet_io
from deploy.agent_session import prefill_then_decode
from deploy.client import Completion, complete
from deploy.fleet_spec import FleetSpec
from deploy.metrics import scrape
from deploy.tiny_model import ensure_tiny_model
from routing.serve.tokenizer import PromptTokenizer

FLEET_DESCRIPTIONS = {
    FleetName.N: "NixlConnector, 1 P + 1 D",
    FleetName.K: "KVPilotConnector, 1 P + 1 D, kvpilot router",
}


def fleet_spec(fleet: FleetName, model_dir: Path, run_dir: Path) -> FleetSpec:
    """Fleet N or K (see the module doc); each on its own ports."""
    if fleet is FleetName.N:
        return FleetSpec(
            model_dir=model_dir,
            run_dir=run_dir,
            connector="NixlConnector",
            connector_extra_config={"bidirectional_kv_xfer": True},
            disaggregation="always",
            engine_port=9410,
            side_channel_port=7640,
            events_port=7740,
            router_port=9400,
            engine_env={"VLLM_SERVER_DEV_MODE": "1"},
        )
    return FleetSpec(
        model_dir=model_dir,
        run_dir=run_dir,
        connector="KVPilotConnector",
        connector_extra_config={"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0},
        disaggregation="conditional",
        engine_port=9510,
        side_channel_port=7660,
        events_port=7760,
        router_port=9500,
    )


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def timed(run: Run, what: str) -> Iterator[None]:
    """Record the seconds the block took as ``run.timings[what]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        run.timings[what] = time.perf_counter() - started


@contextmanager
def running(spec: FleetSpec) -> Iterator[fleet_io.Fleet]:
    started = fleet_io.up(spec, progress=lambda m: log(m.strip()))
    try:
        yield started
    finally:
        log(f"stopping the fleet in {spec.run_dir}")
        fleet_io.down(spec.run_dir)


# ---- engines --------------------------------------------------------------------------
def nixl_warm_up(p_url: str, d_url: str, timeout: float) -> float:
    """One uncounted two-turn session that makes both NIXL handshakes (D reads P,
    then P reads D: 96 tokens beyond P's own hit, above vLLM's 64-token rule).
    Returns its seconds."""
    started = time.perf_counter()
    salt = f"nixl-warm-up-{uuid.uuid4().hex}"
    x = [aw.FIRST_ORDINARY_ID + (i * 37) % 1900 for i in range(256)]
    d1 = prefill_then_decode(p_url, d_url, x, 97, timeout, cache_salt=salt).d
    x2 = x + list(d1.token_ids) + [aw.FIRST_ORDINARY_ID + (i * 53) % 1900 for i in range(40)]
    offer = {**(d1.kv_transfer_params or {}), "do_remote_decode": True, "do_remote_prefill": False}
    prefill_then_decode(p_url, d_url, x2, 2, timeout, offer, cache_salt=salt)
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


# ---- the lockstep runner -------------------------------------------------------------
Serve = Callable[[int, list[int]], Served]
"""``serve(session, prompt)``: one request of the current step."""


def lockstep(
    run: Run,
    key: str,
    title: str,
    serve: Serve,
    engines: dict[str, str],
    before_step: Callable[[int], None] | None = None,
) -> ArmResult:
    """All sessions' step k concurrently, scrape, step k+1, ... (``engines``: name ->
    URL, scraped around each step; ``"D"`` is the decoding engine)."""
    config = run.config
    result = ArmResult(key, title)
    started = time.perf_counter()

    def one(session: int, step: int) -> Outcome:
        t0 = time.perf_counter()
        try:
            served = serve(session, run.prompts[(session, step)])
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, the arm goes on
            return Outcome(session, step, time.perf_counter() - t0, None, error=f"{type(exc).__name__}: {exc}"[:300])
        latency = time.perf_counter() - t0
        return Outcome(session, step, latency, served.completion, route=served.route, p_seconds=served.p_seconds)

    with ThreadPoolExecutor(max_workers=config.sessions) as pool:
        for step in range(1, config.steps + 1):
            if before_step is not None:
                before_step(step)
            before = {n: scrape(u) for n, u in engines.items()}
            t0 = time.perf_counter()
            outcomes = list(pool.map(one, range(config.sessions), [step] * config.sessions))
            wall = time.perf_counter() - t0
            time.sleep(config.settle)  # counters reach /metrics on the stats loop's next tick
            after = {n: scrape(u) for n, u in engines.items()}
            c = result.steps[step] = counters(before, after, "D")
            c.wall = wall
            result.outcomes += outcomes
            failed = [o.error for o in outcomes if o.error is not None]
            log(
                f"  {key} step {step:2d}: {wall:6.2f} s, computed {c.computed:6.0f}, "
                f"cached {c.cached:6.0f}, external {c.external:6.0f}, KV {c.kv_bytes / 1e6:6.2f} MB"
                + (f", {len(failed)} failed: {failed[0]}" if failed else "")
            )
    result.seconds = time.perf_counter() - started
    return result


# ---- the run ---------------------------------------------------------------------------
def reference_pass(run: Run, d_url: str, workload: aw.Workload) -> None:
    """Every session's trajectory on one engine without cache: ``run.reference``, and
    ``run.prompts``, the prompts every arm sends."""
    config = run.config
    with ThreadPoolExecutor(max_workers=config.sessions) as pool:
        for step in range(1, config.steps + 1):
            for s in range(config.sessions):
                run.prompts[(s, step)] = workload.prompt(s, step)

            def ref(s: int, step: int = step) -> Completion:
                return complete(
                    d_url,
                    run.prompts[(s, step)],
                    max_tokens=config.generated,
                    ignore_eos=True,
                    return_token_ids=True,
                    cache_salt=f"ref-{uuid.uuid4().hex}",
                    timeout=config.request_timeout,
                )

            for s, out in enumerate(pool.map(ref, range(config.sessions))):
                if len(out.token_ids) != config.generated:
                    raise RuntimeError(f"reference step {step} session {s}: {len(out.token_ids)} tokens")
                run.reference[(s, step)] = out
                workload.advance(s, step, list(out.token_ids))


def calibrate(run: Run, d_url: str) -> None:
    """The noise of a known-correct path: the same prompts on D with its prefix cache
    (a stable salt per session), into ``run.noise["calibration"]``."""
    config = run.config

    def serve(session: int, prompt: list[int]) -> Served:
        out = complete(
            d_url,
            prompt,
            max_tokens=config.generated,
            ignore_eos=True,
            return_token_ids=True,
            cache_salt=f"calib-{run.run_id}-{session}",
            timeout=config.request_timeout,
        )
        return Served(out)

    calib = lockstep(run, "calibration", "calibration", serve, {"D": d_url})
    judge(calib, run.reference, config.generated, math.inf)
    diffs = [o.max_diff for o in calib.outcomes if o.completion is not None]
    run.noise["calibration"] = {
        "max": max(diffs, default=math.nan),
        "median": statistics.median(diffs) if diffs else math.nan,
        "token_flips": sum(not o.tokens_match for o in calib.outcomes),
        "cached_tokens": sum(c.cached for c in calib.steps.values()),
    }


def run_arm(run: Run, arm: Arm, spec: FleetSpec, fleet: fleet_io.Fleet) -> fleet_io.Fleet:
    """Arm ``arm`` in lockstep, its handicaps noted; an engine found unhealthy after
    it is restarted (and noted). Returns the fleet as it then runs."""
    engines = {"P": arm.setup.p_url, "D": arm.setup.d_url}
    with timed(run, f"arm_{arm.key}"):
        log(f"arm {arm.describe()}")
        with arm.running():
            result = run.results[arm.key] = lockstep(run, arm.key, arm.title, arm.serve, engines, arm.before_step)
        result.notes += arm.handicaps()
    for name, url in engines.items():
        if not fleet_io.is_healthy(url):
            result.notes.append(f"{name} unhealthy after the arm")
            log(f"  {name} is not healthy after arm {arm.key}; restarting it")
            role = "prefill" if name == "P" else "decode"
            fleet = fleet_io.restart_engine(spec, fleet.by_role(role)[0].name)
    return fleet


def run_fleet(run: Run, name: FleetName, arms: list[type[Arm]], model_dir: Path, workload: aw.Workload) -> None:
    """Start fleet ``name``; on fleet N first the reference and the calibration;
    then, after a NIXL warm-up, each of ``arms``. Stops the fleet however it ends."""
    config, fleet_id = run.config, name.value.lower()
    spec = fleet_spec(name, model_dir, run.root / f"fleet-{fleet_id}")
    started = time.perf_counter()
    log(f"starting fleet {name.value} ({FLEET_DESCRIPTIONS[name]})")
    with running(spec) as fleet:
        run.timings[f"fleet_{fleet_id}_up"] = time.perf_counter() - started
        p_url, d_url = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
        if name is FleetName.N:
            with timed(run, "reference"):
                log(f"reference trajectory on D ({d_url}), a fresh cache_salt per request")
                reference_pass(run, d_url, workload)
            run.edited_steps = sorted({k + 1 for _, k, _ in workload.edits_done})
            log(
                f"reference done in {run.timings['reference']:.0f} s; edits {workload.edits_done}; "
                f"last prompt {max(len(p) for p in run.prompts.values())} tokens"
            )
            with timed(run, "calibration"):
                log("calibration: the same prompts on D with its prefix cache (a stable salt per session)")
                calibrate(run, d_url)
            log(f"calibration noise: {run.noise['calibration']}")
        if arms:
            run.warm_ups[name.value] = logged_warm_up(name.value, p_url, d_url, config.warm_up_timeout)
        for arm_class in arms:
            setup = ArmSetup(
                p_url,
                d_url,
                fleet.router.url,
                f"arm-{arm_class.key}-{run.run_id}",
                config.generated,
                config.request_timeout,
                workload.prefix,
                run.root,
            )
            fleet = run_arm(run, arm_class(setup), spec, fleet)


def parse_args() -> BenchConfig:
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
    return BenchConfig(**vars(parser.parse_args()))


def main() -> None:
    config = parse_args()
    started = time.perf_counter()
    model_dir = ensure_tiny_model()
    workload = aw.build(config.workload, PromptTokenizer(model_dir))
    run = Run(config, Path(tempfile.mkdtemp(prefix="kvpilot-bench-agent-")), uuid.uuid4().hex[:8])
    log(
        f"workload: {config.sessions} sessions x {config.steps} steps, prefix {config.prefix_tokens}, tool output "
        f"{config.tool_tokens}, G={config.generated}; editing sessions {config.editing_sessions} at "
        f"{config.workload.edit_plan}; logs under {run.root}"
    )
    for name in FleetName:  # fleet N always: it runs the reference
        arms = [arm for arm in ARMS if arm.fleet is name and arm.key in config.arms]
        if name is FleetName.N or arms:
            run_fleet(run, name, arms, model_dir, workload)
    judged = judge_run(run)
    run.timings["total"] = time.perf_counter() - started
    print_report(run, judged)
    write_outputs(run, judged)


if __name__ == "__main__":
    main()
