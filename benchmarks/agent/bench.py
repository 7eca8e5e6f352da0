"""The article's coding agent on the CPU box: five ways to serve it, each alone, in shuffled repeats.

The workload (:mod:`agent_workload`, seeded), sent as an agent client sends it: chat
requests to ``/v1/chat/completions`` with a tool declared and the history's tool calls
and tool results. ``--sessions`` agent sessions of ``--steps`` steps share a system prompt
(~1,000 words of instructions and repository files, ~1,270 tokens with the tool); each step
resends the session's messages plus a distinct ~100-word tool output and generates
``--generated`` tokens (greedy, ``ignore_eos``, logprobs, non-streaming), which the
next step resends as the reasoning before the step's tool call. The last
``--editing-sessions`` sessions edit their history at 1/4, 1/2 and 3/4 of the run
(reasoning stripped, message re-rendered, history truncated). Sessions run
concurrently within a step and steps in lockstep, with the engines' ``/metrics``
scraped between steps, so every engine counter is attributed to one step of one arm.

Correctness: a reference trajectory is computed first on one engine of fleet N
(D, co-located use, a fresh ``cache_salt`` per request: no cache). Step k's reference
tokens feed step k+1's history in every arm, so all arms send the same prompts and
an arm's wrong output is counted, not propagated. Correctness is decided on tokens
(:mod:`benchmarks.agent.correctness`): an output is wrong where its first greedy token that differs
from the reference's sits where the reference's top-2 margin (its chosen token's lead
over the runner-up; the reference asks for two top logprobs) exceeds the measured
noise; a flip where that margin is within the noise is a tie, counted apart. The noise
is measured in the same run, before any arm: a calibration pass on the reference's
engine with its prefix cache on (a stable salt per session: content-matched reuse,
correct by construction, but other prefill splits); its largest max |logprob diff|
against the reference is the noise. The report and the JSON give the calibration's
distribution of that diff (quantiles and max) and each arm's, beside the counts.

Arms, each repeat of each under its own ``cache_salt`` (no arm, and no repeat,
inherits another's cache):

Fleet N: 1 P + 1 D, plain ``NixlConnector`` with ``bidirectional_kv_xfer`` (vLLM's
defaults otherwise: ``kv_recompute_threshold`` 64, D holds its blocks 480 s), engines
in ``VLLM_SERVER_DEV_MODE``; its kvpilot router is started but unused.

* (a) no prefix cache: a fresh salt per request, through the P->D proxy
  (:func:`kvpilot.deploy.agent_session.prefill_then_decode`: P with ``{"do_remote_decode": true}``,
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

Fleet K: 1 P + 1 D, ``KVPilotConnector`` with fleet N's keys only
(``bidirectional_kv_xfer``): no pinned ``kv_recompute_threshold``, so P's pull policy
decides each D->P pull live from its measured rates (``recompute_policy`` "roofline",
the default), and the router prices each choice from the engines' measured rates (its
defaults); conditional disaggregation.

* (e) kvpilot: requests to the kvpilot router with ``conversation_id`` = the session.
  The router refuses a request whose predicted TTFT is over the fleet's SLO
  (:data:`kvpilot.deploy.fleet_spec.FLEET_TTFT_SLO_S`); a refusal counts as a failed request.

The handicap only arms (a)-(d) carry: vLLM 0.32's NIXL worker on CPU moves the engine's
model thread to the box's last core (:mod:`kvpilot.kvconnectors.thread_binding`), so fleet N's
P and D compute on one core beside NIXL's progress threads; ``KVPilotConnector``
restores the binding. ``--handicap-arm`` measures how much of the gap that explains,
without touching vLLM:

Fleet B: 1 P + 1 D, ``KVPilotConnector`` as a drop-in for fleet N's ``NixlConnector``
(the same keys at the top level, ``recompute_policy`` "threshold": vLLM's own
64-token pull rule), dev mode, as fleet N.

* (f) arm (c)'s proxy logic, unchanged, on fleet B. Its engines differ from (c)'s by
  the thread binding and by kvpilot's scheduler-side layers: D's block verification
  refuses offered blocks whose digests differ from its own, which after a history edit
  is exactly the KV that makes (c) wrong, so (c) - (f) in wrong outputs and in the
  tokens an edited step computes is the verification, not the binding. On steps
  without edits every offer verifies and the layers change nothing (the proxy sends
  the same params, the pull rule is vLLM's): ``--editing-sessions 0`` isolates the
  binding. The report gives, per headline figure, (c) - (f) and its share of (c) - (e).

Run order (:mod:`agent_schedule`): the reference and the calibration run on a start
of fleet N of their own, stopped before any arm. Then ``--repeats`` repeats; each
starts every fleet it needs afresh, one fleet at a time (no arm shares the box with
another arm, no repeat inherits another's cache), and runs that fleet's arms one after
the other. Within each repeat the fleets' order and each fleet's arm order are
shuffled from ``--seed``; the order is printed and kept in the JSON. Each fleet start
gets one uncounted NIXL warm-up session (both handshakes, P->D and D->P) before its
arms; each is stopped in a ``finally``.

Per arm and repeat: prefill tokens computed (``vllm:prompt_tokens_by_source_total``,
both engines; also the local-cache and external-KV sources), KV bytes moved
(``vllm:nixl_bytes_transferred`` histogram sum, both engines), per-step latency and
TTFT p50/p99 at steps 1, S/2, S, SLO-met requests, wrong outputs. The report gives,
per arm, the median over its repeats of the headline figures (prefill tokens
computed, KV bytes moved, TTFT p50 at steps 1, S/2, S, wrong outputs, SLO-met
requests) with their range (min-max), then each repeat's full tables; the ratios
against (e) are taken on the medians. TTFT of a non-streaming request is estimated as
its latency minus (G - 1) x D's mean TPOT over the same lockstep step (D's own
``vllm:request_time_per_output_token_seconds``).

SLO-met requests are a count at the lockstep's one load (correct, TTFT and the step's
D TPOT within the SLOs). DistServe's goodput, the highest request rate at which both
SLOs hold, comes from a sweep of the load: ``--sessions-sweep 1,2,4`` runs the whole
benchmark (reference, arms, repeats) once per session count, each judged by the same
``--ttft-slo`` and ``--tpot-slo`` (required with a sweep), and reports each arm's
achieved rate and SLO attainment per load and its goodput (:mod:`agent_goodput`); each
load's full results go to ``--out`` with ``-sN`` before the suffix, the sweep's to ``--out``.

The arms are the classes of :mod:`agent_arms`; what a run measured, judged and
summarized is :mod:`agent_results`; the report, plot and JSON are :mod:`agent_output`.

    python -m benchmarks.bench_agent                            # 4 x 20 steps, 1 repeat
    python -m benchmarks.bench_agent --sessions 2 --steps 4    # a quick check
    python -m benchmarks.bench_agent --repeats 3 --handicap-arm # medians of 3, and (f)
    python -m benchmarks.bench_agent --steps 6 --arms ce --sessions-sweep 1,2,4 --ttft-slo 2 --tpot-slo 0.5

``--repeats`` defaults to 1 (a quick run: no spread). The README's table was measured
with one repeat, in the fixed order a-d then e and with fleet K's threshold pinned at
0, before these rules. Wall time is dominated by this 2-core box's contention: the
default run took 56 min while other fleets shared the box (load average 20-70), a
2 x 4 run 10-15 min; each repeat adds a start of every fleet it needs.

The fleets are :mod:`benchmarks.agent.fleets`', the lockstep runner
:mod:`benchmarks.agent.lockstep`'s; this module runs the reference, the calibration and
every repeat of every arm, and the sweep over loads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.agent import goodput as agent_goodput
from benchmarks.agent import schedule as agent_schedule
from benchmarks.agent import workload as aw
from benchmarks.agent.arms import ARMS, Arm, ArmSetup, FleetName, Served
from benchmarks.agent.fleets import FLEET_DESCRIPTIONS, fleet_spec, logged_warm_up, restart_unhealthy, running
from benchmarks.agent.lockstep import lockstep
from benchmarks.agent.output import print_report, write_outputs
from benchmarks.agent.progress import log, timed
from benchmarks.agent.results import (
    HANDICAP_ARM,
    BenchConfig,
    Run,
    RunSummary,
    calibration_noise,
    judge_run,
)
from benchmarks.fleet.goodput import ATTAINMENT
from benchmarks.provenance import provenance
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import Completion, complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import ensure_tiny_model


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
                    tools=aw.TOOLS,
                    top_logprobs=2,  # each token's top-2 margin: agent.correctness
                )

            for s, out in enumerate(pool.map(ref, range(config.sessions))):
                if len(out.token_ids) != config.generated:
                    raise RuntimeError(f"reference step {step} session {s}: {len(out.token_ids)} tokens")
                run.reference[(s, step)] = out
                workload.advance(s, step, out.text)


def calibrate(run: Run, d_url: str) -> None:
    """The noise of a known-correct path: the same prompts on D with its prefix cache
    (a stable salt per session), into ``run.noise["calibration"]``."""
    config = run.config

    def serve(session: int, prompt: list[aw.Message]) -> Served:
        out = complete(
            d_url,
            prompt,
            max_tokens=config.generated,
            ignore_eos=True,
            return_token_ids=True,
            cache_salt=f"calib-{run.run_id}-{session}",
            timeout=config.request_timeout,
            tools=aw.TOOLS,
        )
        return Served(out)

    calib = lockstep(run, "calibration", "calibration", serve, {"D": d_url})
    run.noise["calibration"] = calibration_noise(calib, run.reference) | {
        "cached_tokens": sum(c.cached for c in calib.steps.values())
    }


def run_arm(run: Run, arm: Arm, spec: FleetSpec, fleet: fleet_io.Fleet, repeat: int) -> fleet_io.Fleet:
    """Arm ``arm``'s repeat ``repeat`` in lockstep, its handicaps noted; an engine found
    unhealthy after it is restarted (and noted). Returns the fleet as it then runs."""
    engines = {"P": arm.setup.p_url, "D": arm.setup.d_url}
    with timed(run, f"arm_{arm.key}_r{repeat}"):
        log(f"arm {arm.describe()}, repeat {repeat}")
        with arm.running():
            result = lockstep(run, arm.key, arm.title, arm.serve, engines, arm.before_step)
        result.notes += arm.handicaps()
    run.results.setdefault(arm.key, []).append(result)
    return restart_unhealthy(spec, fleet, f"arm {arm.key}", result.notes)


def reference_fleet(run: Run, model_dir: Path, workload: aw.Workload) -> None:
    """Fleet N started for the reference and the calibration alone, then stopped: the
    repeats' fleet order stays free and no arm runs on the fleet that computed them."""
    spec = fleet_spec(FleetName.N, model_dir, run.root / "fleet-n-reference")
    log(f"starting fleet N ({FLEET_DESCRIPTIONS[FleetName.N]}) for the reference")
    with timed(run, "reference_fleet"), running(spec) as fleet:
        d_url = fleet.by_role("decode")[0].url
        with timed(run, "reference"):
            log(f"reference trajectory on D ({d_url}), a fresh cache_salt per request")
            reference_pass(run, d_url, workload)
        run.edited_steps = sorted({k + 1 for _, k, _ in workload.edits_done})
        log(
            f"reference done in {run.timings['reference']:.0f} s; edits {workload.edits_done}; "
            f"last prompt {max(c.prompt_tokens for c in run.reference.values())} tokens"
        )
        with timed(run, "calibration"):
            log("calibration: the same prompts on D with its prefix cache (a stable salt per session)")
            calibrate(run, d_url)
        log(f"calibration noise: {run.noise['calibration']}")


def run_fleet(run: Run, planned: agent_schedule.FleetRun, repeat: int, model_dir: Path, workload: aw.Workload) -> None:
    """Start fleet ``planned.fleet`` afresh for repeat ``repeat``; after a NIXL warm-up,
    each of its arms in the planned order. Stops the fleet however it ends."""
    config, name = run.config, FleetName(planned.fleet)
    fleet_id = f"{name.value.lower()}-r{repeat}"
    spec = fleet_spec(name, model_dir, run.root / f"fleet-{fleet_id}")
    started = time.perf_counter()
    log(f"starting fleet {name.value} ({FLEET_DESCRIPTIONS[name]}), repeat {repeat}")
    with running(spec) as fleet:
        run.timings[f"fleet_{fleet_id}_up"] = time.perf_counter() - started
        p_url, d_url = fleet.by_role("prefill")[0].url, fleet.by_role("decode")[0].url
        warm_up = logged_warm_up(name.value, p_url, d_url, config.warm_up_timeout)
        run.warm_ups.setdefault(name.value, []).append(warm_up)
        # a warm-up that hung can leave an engine dead (plain NixlConnector's first D->P
        # pull on an AMX Xeon: P's sample_tokens timed out after 300 s): its arms get it back
        fleet = restart_unhealthy(spec, fleet, f"fleet {name.value}'s warm-up", run.fleet_notes)
        by_key = {arm.key: arm for arm in ARMS}
        for key in planned.arms:
            setup = ArmSetup(
                p_url,
                d_url,
                fleet.client_url,  # Envoy where the fleet has one (kvpilot's), else the router
                f"arm-{key}-{run.run_id}-r{repeat}",
                config.generated,
                config.request_timeout,
                workload.shared_prefix,
                run.root,
            )
            fleet = run_arm(run, by_key[key](setup), spec, fleet, repeat)


def arm_keys(config: BenchConfig) -> list[str]:
    """The arms to run: ``--arms``' letters, and (f) with ``--handicap-arm``, in :data:`ARMS` order."""
    wanted = set(config.arms) | ({HANDICAP_ARM} if config.handicap_arm else set())
    return [arm.key for arm in ARMS if arm.key in wanted]


def run_plan(config: BenchConfig) -> list[agent_schedule.Repeat]:
    """The repeats' shuffled order (:mod:`agent_schedule`) of the arms :func:`arm_keys` names."""
    keys = arm_keys(config)
    by_fleet = {name.value: [arm.key for arm in ARMS if arm.fleet is name and arm.key in keys] for name in FleetName}
    return agent_schedule.plan(by_fleet, config.repeats, config.seed)


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
        "--repeats", type=int, default=1, help="runs of every arm, each on fresh fleets, in a shuffled order"
    )
    parser.add_argument(
        "--handicap-arm",
        action="store_true",
        help="also run arm (f): arm (c) on KVPilotConnector engines that keep their thread binding",
    )
    parser.add_argument("--ttft-slo", type=float, default=None, help="default: 1.5 x arm (a)'s TTFT p50 at step 1")
    parser.add_argument("--tpot-slo", type=float, default=None, help="default: 1.5 x arm (a)'s median step TPOT")
    parser.add_argument("--request-timeout", type=float, default=240.0)
    parser.add_argument("--warm-up-timeout", type=float, default=300.0)
    parser.add_argument("--settle", type=float, default=0.3, help="seconds before each after-step scrape")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvpilot-bench-agent.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/images/bench_agent_prefill.png"))
    parser.add_argument(
        "--sessions-sweep",
        type=lambda s: tuple(int(x) for x in s.split(",") if x),
        default=(),
        help="session counts to run the whole benchmark at, for goodput (needs --ttft-slo and --tpot-slo)",
    )
    args = parser.parse_args()
    if args.sessions_sweep and (args.ttft_slo is None or args.tpot_slo is None):
        parser.error("--sessions-sweep needs --ttft-slo and --tpot-slo: every load is judged by the same SLOs")
    return BenchConfig(**vars(args))


def at_load(config: BenchConfig, sessions: int) -> BenchConfig:
    """``config`` at ``sessions`` sessions, its JSON and plot named for the load."""
    return replace(
        config,
        sessions=sessions,
        editing_sessions=min(config.editing_sessions, sessions),
        out=config.out.with_name(f"{config.out.stem}-s{sessions}{config.out.suffix}"),
        plot=config.plot.with_name(f"{config.plot.stem}-s{sessions}{config.plot.suffix}"),
    )


def sweep(config: BenchConfig) -> None:
    """The whole benchmark at each of ``config.sessions_sweep``, then each arm's goodput."""
    points: dict[str, list[agent_goodput.LoadPoint]] = {}
    titles: dict[str, str] = {}
    for sessions in config.sessions_sweep:
        log(f"sweep: {sessions} sessions")
        run, judged = run_once(at_load(config, sessions))
        for key, repeats in run.results.items():
            met = [int(s["slo_met"]) for s in judged.summaries[key]["per_repeat"]]
            points.setdefault(key, []).append(agent_goodput.load_point(sessions, repeats, met))
            titles[key] = repeats[0].title
    print(
        f"\nGoodput (TTFT SLO {config.ttft_slo} s, TPOT SLO {config.tpot_slo} s, "
        f"{ATTAINMENT:.0%} of requests), {config.steps} steps per session:"
    )
    print(agent_goodput.table(points, titles))
    config.out.write_text(
        json.dumps(
            {
                "ttft_slo_s": config.ttft_slo,
                "tpot_slo_s": config.tpot_slo,
                "steps": config.steps,
                "provenance": provenance(),
                "goodput_rps": {key: agent_goodput.goodput(ps) for key, ps in points.items()},
                "points": {key: [asdict(p) for p in ps] for key, ps in points.items()},
                "per_load_json": [str(at_load(config, s).out) for s in config.sessions_sweep],
            },
            indent=1,
        )
    )
    print(f"- wrote {config.out}")


def main() -> None:
    config = parse_args()
    if config.sessions_sweep:
        sweep(config)
    else:
        run_once(config)


def run_once(config: BenchConfig) -> tuple[Run, RunSummary]:
    """The whole benchmark at ``config``'s load: the reference, every repeat of every arm,
    the report, the JSON and the plot."""
    started = time.perf_counter()
    model_dir = ensure_tiny_model()
    workload = aw.build(config.workload)
    run = Run(config, Path(tempfile.mkdtemp(prefix="kvpilot-bench-agent-")), uuid.uuid4().hex[:8])
    log(
        f"workload: {config.sessions} sessions x {config.steps} steps, prefix {config.prefix_tokens}, tool output "
        f"{config.tool_tokens}, G={config.generated}; editing sessions {config.editing_sessions} at "
        f"{config.workload.edit_plan}; logs under {run.root}"
    )
    repeats = run_plan(config)
    run.schedule = agent_schedule.describe(repeats)
    log(f"order (seed {config.seed}): {run.schedule}")
    reference_fleet(run, model_dir, workload)
    for repeat in repeats:
        for planned in repeat.fleets:
            run_fleet(run, planned, repeat.index, model_dir, workload)
    judged = judge_run(run)
    run.timings["total"] = time.perf_counter() - started
    print_report(run, judged)
    write_outputs(run, judged)
    return run, judged
