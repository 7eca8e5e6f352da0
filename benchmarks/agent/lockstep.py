"""The agent benchmark's lockstep runner (:func:`lockstep`): every session's step k at once,
the engines' counters scraped around it, then step k+1."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from benchmarks.agent import workload as aw
from benchmarks.agent.arms import Served
from benchmarks.agent.progress import log
from benchmarks.agent.results import ArmResult, Outcome, Run, counters
from kvpilot.deploy.metrics import scrape

Serve = Callable[[int, list[aw.Message]], Served]
"""``serve(session, messages)``: one request of the current step."""


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
