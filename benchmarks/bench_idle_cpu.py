"""What an idle P/D fleet costs the box, and what D's hold of an unpulled offer adds.

In a bidirectional fleet (``bidirectional_kv_xfer``) D holds every finished request's KV
for P to pull back, for ``decoder_kv_blocks_ttl`` seconds, and vLLM keeps an engine's
busy loop stepping while it holds any finished request's blocks. This starts a 1 P + 1 D
fleet (``kvpilot.deploy.fleet``, the launcher of ``kvpilot fleet up``) with ``--ttl`` as D's hold,
waits out the hold of the fleet's own warm-up handoff, then measures each engine's CPU
(all its processes, in cores) over ``--window`` seconds three times: idle with nothing
held, idle right after one request through the router left D holding its offer, and
idle again once that hold ended.

    python -m benchmarks.bench_idle_cpu --ttl 25
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # ships no stubs; its types are not installed here

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import ensure_tiny_model

ENGINE_PORT, SIDE_CHANNEL_PORT, EVENTS_PORT, ROUTER_PORT = 27100, 27200, 27300, 27090
"""This benchmark's ports (27090-27500: no test or other benchmark uses them)."""
PROMPT = list(range(100, 100 + 8 * 32))
"""Eight full blocks, below the tiny model's vocabulary: a handoff D then holds."""


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process of group ``pgid``."""
    total = 0.0
    for pid in fleet_io.group_members(pgid):
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def cores_used(engines: dict[str, int], window_s: float) -> dict[str, float]:
    """Each engine's CPU over ``window_s``, in cores (1.0: one core busy throughout)."""
    before = {name: group_cpu_s(pgid) for name, pgid in engines.items()}
    started = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - started
    return {name: (group_cpu_s(pgid) - before[name]) / elapsed for name, pgid in engines.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ttl", type=int, default=25, help="D's hold of an offer (decoder_kv_blocks_ttl), seconds")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measurement")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kvpilot-idle-cpu-"))
    spec = FleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=run_dir,
        disaggregation="always",
        connector_extra_config={"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": args.ttl},
        engine_port=ENGINE_PORT,
        side_channel_port=SIDE_CHANNEL_PORT,
        events_port=EVENTS_PORT,
        router_port=ROUTER_PORT,
    )
    fleet = fleet_io.up(spec, timeout=600, progress=lambda _: None)
    try:
        engines = {e.name: e.pid for e in fleet.engines}
        time.sleep(args.ttl + 5)  # the warm-up handoff's hold ends
        phases = {"idle, nothing held": cores_used(engines, args.window)}
        route = complete(fleet.router.url, PROMPT, max_tokens=8).headers.get("X-KVPilot-Route")
        phases[f"idle, D holding one offer ({route})"] = cores_used(engines, args.window)
        time.sleep(max(0.0, args.ttl - args.window) + 5)
        phases["idle, after the hold"] = cores_used(engines, args.window)
    finally:
        fleet_io.down(run_dir)
    for phase, used in phases.items():
        print(f"{phase}: " + ", ".join(f"{name} {cores:.2f} cores" for name, cores in used.items()))


if __name__ == "__main__":
    main()
