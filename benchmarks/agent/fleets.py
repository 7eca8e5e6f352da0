"""The agent benchmark's fleets N, K and B (:func:`fleet_spec`; :mod:`benchmarks.agent.bench`'s
doc says what each runs): started and stopped around a block (:func:`running`), their NIXL
handshakes made before any arm (:func:`logged_warm_up`), an engine that stopped answering
restarted (:func:`restart_unhealthy`)."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.agent import workload as aw
from benchmarks.agent.arms import FleetName
from benchmarks.agent.progress import log
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.agent_session import prefill_then_decode
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.tiny_model import TOOL_CALLING_ENGINE_ARGS
from kvpilot.kvconnectors.pull_policy import RecomputePolicy

FLEET_DESCRIPTIONS = {
    FleetName.N: "NixlConnector, 1 P + 1 D",
    FleetName.K: "KVPilotConnector, 1 P + 1 D, kvpilot router, live pull policy",
    FleetName.B: "KVPilotConnector as a drop-in for NixlConnector (vLLM's pull rule), 1 P + 1 D",
}
NIXL_KEYS = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 480}
"""Fleet N's ``kv_connector_extra_config``; fleet B's NixlConnector keys. D holds its
blocks vLLM's default 480 s, not the CPU fleet's 60 s (``kvpilot.deploy.fleet_spec.DECODE_HOLD_TTL_S``):
the conversation-id proxy arm keeps sessions 450 s, for vLLM's hold (``agent_arms``)."""


@dataclass(frozen=True)
class _FleetPlan:
    """What a fleet's :class:`FleetSpec` sets beyond the model and run directory."""

    connector: str
    extra_config: Mapping[str, object]
    disaggregation: str
    ports: tuple[int, int, int, int]  # engine, side channel, events, router
    dev_mode: bool
    gateway_ports: tuple[int, int, int] | None = None
    """Envoy's, the picker's and Envoy's admin port: kvpilot's arm goes through Envoy, as a
    client of ``kvpilot fleet up`` does; ``None``: no Envoy (the baselines' own proxies)."""


_FLEETS = {
    FleetName.N: _FleetPlan("NixlConnector", NIXL_KEYS, "always", (9410, 7640, 7740, 9400), True),
    FleetName.K: _FleetPlan(
        "KVPilotConnector", NIXL_KEYS, "conditional", (9510, 7660, 7760, 9500), False, (9520, 9521, 9522)
    ),
    FleetName.B: _FleetPlan(
        "KVPilotConnector",
        {**NIXL_KEYS, "recompute_policy": RecomputePolicy.THRESHOLD.value},
        "always",
        (9610, 7680, 7780, 9600),
        True,
    ),
}


def fleet_spec(fleet: FleetName, model_dir: Path, run_dir: Path) -> FleetSpec:
    """Fleet N, K or B (:mod:`benchmarks.agent.bench`'s doc); each on its own ports."""
    plan = _FLEETS[fleet]
    engine_port, side_channel_port, events_port, router_port = plan.ports
    spec = FleetSpec(
        model_dir=model_dir,
        run_dir=run_dir,
        connector=plan.connector,
        connector_extra_config=dict(plan.extra_config),
        disaggregation=plan.disaggregation,
        engine_port=engine_port,
        side_channel_port=side_channel_port,
        events_port=events_port,
        router_port=router_port,
        engine_env={"VLLM_SERVER_DEV_MODE": "1"} if plan.dev_mode else {},
        engine_args=TOOL_CALLING_ENGINE_ARGS,  # every request declares a tool (tool_choice auto)
    )
    if plan.gateway_ports is None:
        return spec
    gateway_port, picker_port, envoy_admin_port = plan.gateway_ports
    return dataclasses.replace(
        spec, gateway_port=gateway_port, picker_port=picker_port, envoy_admin_port=envoy_admin_port
    )


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


def restart_unhealthy(spec: FleetSpec, fleet: fleet_io.Fleet, after: str, notes: list[str]) -> fleet_io.Fleet:
    """``fleet`` with each engine that no longer answers ``/health`` restarted, each
    restart noted in ``notes`` (``after``: what it was found unhealthy after). Returns the
    fleet as it then runs."""
    for role, name in (("prefill", "P"), ("decode", "D")):
        engine = fleet.by_role(role)[0]
        if not fleet_io.is_healthy(engine.url):
            notes.append(f"{name} unhealthy after {after}")
            log(f"  {name} is not healthy after {after}; restarting it")
            fleet = fleet_io.restart_engine(spec, engine.name)
    return fleet
