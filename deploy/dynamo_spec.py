"""What a Dynamo fleet beside kvpilot's router is made of: pure planning, no processes.

:func:`plan_dynamo_fleet` turns a :class:`DynamoFleetSpec` into the exact argv,
environment and ports of every ``dynamo.mocker`` worker (one simulated vLLM worker per
process, so that each can leave on its own), of Dynamo's frontend in direct mode and of
the router, and the router's config. Everything runs on 127.0.0.1 with Dynamo's file
discovery in ``<run_dir>/discovery``, the TCP request plane and the ZMQ event plane: no
etcd, no NATS.

Ports of worker ``i`` (its ordinal among all workers), with ``s = port_stride``:
``worker_port + i`` its request plane (``DYN_TCP_RPC_PORT``, so discovery shows it),
``+ s`` its vLLM-format KV events (``--zmq-kv-events-ports``; the router maps an
instance to them by ``kv_events_port_offset = s``), ``+ 2s`` its system server
(``/metrics``), ``+ 3s`` its bootstrap port (prefill workers: the P->D rendezvous), ``+ 4s``
its KV-event replay (``--zmq-replay-ports``, ``kv_replay_port_offset = 4s``: a restarted
router reads back what each worker holds).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpilot.deploy.env import DYNAMO_LOOPBACK_ENV
from kvpilot.deploy.envoy_spec import GatewaySpec, PickerFailure
from kvpilot.deploy.fleet_spec import (
    FLEET_CALIBRATION_WORKERS,
    FLEET_TTFT_SLO_S,
    HOST,
    ROUTER_CONFIG,
    ProcessPlan,
    check_ports,
    envoy_plan,
)
from kvpilot.routing.config import Role

DISCOVERY_DIR = "discovery"
DYNAMO_PLANES = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")
"""Every Dynamo process's flags: file discovery, TCP requests, ZMQ events."""
WORKER_HEALTH = "/metrics"
"""What answers 200 once a worker's system server is up. Its ``/health`` stays 503
("notready", every endpoint "ready") in Dynamo 1.6.1's mocker: the fleet is ready when
the router's discovery lists every worker instead (:func:`kvpilot.deploy.dynamo_fleet.up`)."""
FRONTEND_HEALTH = "/v1/models"
"""What answers 200 once the frontend serves."""


class FrontendRouting(str, enum.Enum):
    """Who picks each request's workers: Dynamo's frontend's ``--router-mode``."""

    DIRECT = "direct"
    """The instances each request names: kvpilot's router in front of the frontend."""
    ROUND_ROBIN = "round-robin"
    """Dynamo's frontend, in turn (no kvpilot router)."""
    KV = "kv"
    """Dynamo's own KV router in the frontend (no kvpilot router)."""


@dataclass(frozen=True, slots=True)
class DynamoFleetSpec:
    """A one-machine Dynamo fleet: ``workers`` aggregated ones, or ``prefill`` and
    ``decode`` ones (disaggregated), simulated by ``dynamo.mocker`` on the tiny model."""

    model_dir: Path
    run_dir: Path
    workers: int = 0
    prefill: int = 0
    decode: int = 0
    served_model_name: str = "tiny"
    block_size: int = 32
    speedup_ratio: float = 10.0
    """The mocker's simulated time runs this much faster than a real GPU's."""
    worker_port: int = 20000
    port_stride: int = 1000
    frontend_port: int = 8090
    router_port: int = 8000
    discovery_interval_s: float = 0.5
    frontend_routing: FrontendRouting = FrontendRouting.DIRECT
    ttft_slo_s: float = FLEET_TTFT_SLO_S
    """kvpilot's router refuses a request whose predicted TTFT is over this
    (``server.ttft_slo_s``; 0: no SLO), as in a vLLM fleet."""
    frontend_flags: tuple[str, ...] = ()
    """More flags for the frontend (Dynamo's KV router options, ``--router-temperature 0.1``)."""
    mocker_flags: tuple[str, ...] = ()
    """More flags for every mocker worker (``--num-gpu-blocks-override 4096``)."""
    router_cost: tuple[tuple[str, object], ...] = ()
    """kvpilot's ``cost`` section, (key, value) pairs over its defaults
    (``(("objective", "predicted_ttft"),)``)."""
    gateway_port: int = 8080
    """Envoy's listener, where clients send requests when kvpilot routes: Envoy asks the
    router's endpoint picker (``picker_port``) where each request goes and carries the
    stream itself (``deploy/envoy_spec.py``). 0: no Envoy; clients send to the router,
    which relays every stream."""
    picker_port: int = 8070
    envoy_admin_port: int = 8071
    envoy_in_front: bool = False
    """Where Dynamo routes (not kvpilot): Envoy on ``gateway_port`` in front of the frontend
    with a fixed route (no picker), the gateway's hop alone (a baseline beside kvpilot's
    Envoy and picker)."""
    native_picker: bool = False
    """Where kvpilot routes through Envoy: Envoy decides each token-id prompt itself with the
    compiled picker (``routing/native``), its index fed by the workers' KV events; the Python
    picker decides the rest."""
    envoy_upstream_http2: bool = False
    """Envoy reaches the frontend over HTTP/2 on kept-alive connections
    (:attr:`~kvpilot.deploy.envoy_spec.GatewaySpec.upstream_http2`), not one HTTP/1.1
    connection per request."""
    on_picker_failure: PickerFailure = PickerFailure.REFUSE
    """What Envoy answers when the picker fails (beside Dynamo's direct-mode frontend
    nothing else can route: :attr:`PickerFailure.REFUSE` only)."""

    def __post_init__(self) -> None:
        if min(self.workers, self.prefill, self.decode) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.ttft_slo_s < 0:
            raise ValueError(f"ttft_slo_s must be >= 0, got {self.ttft_slo_s}")
        if self.workers and (self.prefill or self.decode):
            raise ValueError("a fleet is aggregated (workers) or disaggregated (prefill and decode), not both")
        if not self.workers and not (self.prefill and self.decode):
            raise ValueError("a fleet needs workers, or both prefill and decode workers")
        if self.workers + self.prefill + self.decode > self.port_stride:
            raise ValueError(f"at most port_stride ({self.port_stride}) workers")
        if self.block_size <= 0 or self.speedup_ratio <= 0:
            raise ValueError("block_size and speedup_ratio must be positive")
        if self.on_picker_failure is not PickerFailure.REFUSE:
            raise ValueError(
                "on_picker_failure must be refuse beside Dynamo: its direct-mode frontend routes nothing "
                "the picker did not name"
            )

    @property
    def gateway(self) -> GatewaySpec | None:
        """Envoy in front, when ``gateway_port`` is set and kvpilot routes (asking its picker)
        or :attr:`envoy_in_front` (a fixed route to the frontend)."""
        if not self.gateway_port or not (self.kvpilot_routes or self.envoy_in_front):
            return None
        return GatewaySpec(
            self.gateway_port,
            self.envoy_admin_port,
            self.picker_port,
            self.on_picker_failure,
            fixed_upstream=None if self.kvpilot_routes else f"{HOST}:{self.frontend_port}",
            upstream_http2=self.envoy_upstream_http2,
        )

    @property
    def client_url(self) -> str:
        """Where clients send requests: Envoy, the router (no Envoy), or the frontend
        (Dynamo routes, no Envoy)."""
        if self.gateway is not None:
            return f"http://{HOST}:{self.gateway_port}"
        return f"http://{HOST}:{self.router_port}" if self.kvpilot_routes else self.frontend_url

    @property
    def discovery_dir(self) -> Path:
        """Dynamo's file discovery (``DYN_FILE_KV``) for every process of the fleet."""
        return self.run_dir / DISCOVERY_DIR

    @property
    def dynamo_env(self) -> dict[str, str]:
        """What every Dynamo process (and the router's discovery client) gets."""
        return {**DYNAMO_LOOPBACK_ENV, "DYN_FILE_KV": str(self.discovery_dir)}

    @property
    def roles(self) -> list[Role]:
        """Each worker's role, by ordinal: prefill, then decode; or co-located."""
        if self.workers:
            return [Role.COLOCATED] * self.workers
        return [Role.PREFILL] * self.prefill + [Role.DECODE] * self.decode

    @property
    def frontend_url(self) -> str:
        return f"http://{HOST}:{self.frontend_port}"

    @property
    def smallest_pool(self) -> int:
        """Workers of the smaller pool (prefill or decode; all of them when aggregated): the
        frontend's ``--router-min-initial-workers``. With the whole fleet's count (16 P + 48 D:
        64) Dynamo 1.6.1's frontend never served the model (measured): it counts a pool, not the fleet."""
        return self.workers or min(self.prefill, self.decode)

    @property
    def kvpilot_routes(self) -> bool:
        """Whether kvpilot's router runs in front (direct mode); otherwise clients send
        to the frontend, which routes on its own."""
        return self.frontend_routing is FrontendRouting.DIRECT


MOCKER_MODES = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.COLOCATED: "agg"}


def worker_name(role: Role, index: int) -> str:
    return f"{'worker' if role is Role.COLOCATED else role.value}-{index}"


def _mocker_argv(spec: DynamoFleetSpec, role: Role, events_ports: Sequence[int]) -> list[str]:
    """``dynamo.mocker`` with one worker per port of ``events_ports`` (each publishing its
    KV events there), in ``role``'s disaggregation mode."""
    return [
        sys.executable,
        "-m",
        "dynamo.mocker",
        "--model-path",
        str(spec.model_dir),
        "--model-name",
        spec.served_model_name,
        "--num-workers",
        str(len(events_ports)),
        *DYNAMO_PLANES,
        "--zmq-kv-events-ports",
        ",".join(map(str, events_ports)),
        "--block-size",
        str(spec.block_size),
        "--speedup-ratio",
        str(spec.speedup_ratio),
        "--disaggregation-mode",
        MOCKER_MODES[role],
        *spec.mocker_flags,
    ]


def worker_plan(spec: DynamoFleetSpec, role: Role, index: int, ordinal: int) -> ProcessPlan:
    """Worker ``index`` of its role, ``ordinal`` among all workers (its ports)."""
    rpc = spec.worker_port + ordinal
    events, system, bootstrap, replay = (rpc + k * spec.port_stride for k in (1, 2, 3, 4))
    argv = [*_mocker_argv(spec, role, [events]), "--zmq-replay-ports", str(replay)]
    if role is Role.PREFILL:
        argv += ["--bootstrap-ports", str(bootstrap)]
    env = {**spec.dynamo_env, "DYN_TCP_RPC_PORT": str(rpc), "DYN_SYSTEM_PORT": str(system)}
    side = (rpc, events, replay, *((bootstrap,) if role is Role.PREFILL else ()))
    uses = ("request plane", "KV events", "KV-event replay", "bootstrap")[: len(side)]
    return ProcessPlan(worker_name(role, index), role, tuple(argv), env, system, side, uses, "system HTTP")


def mocker_group_plan(spec: DynamoFleetSpec, name: str = "mockers") -> ProcessPlan:
    """All of an aggregated spec's ``workers`` in ONE ``dynamo.mocker`` process
    (``--num-workers``; the scale benchmark's 256 workers on 2 cores: one process each
    would not fit). They share its request plane (``DYN_TCP_RPC_PORT`` = ``worker_port``)
    and its system server (``worker_port + 2s``; the first worker binds it, the others
    log that it is taken); worker ``i`` publishes its KV events on ``worker_port + s + i``.
    A shared request-plane port tells no worker apart, so the router needs each
    instance's events endpoint by id (``dynamo.kv_events_endpoints``), and no worker can
    leave alone. Raises ValueError for a disaggregated spec."""
    if not spec.workers:
        raise ValueError("one mocker process holds aggregated workers only")
    events = [spec.worker_port + spec.port_stride + i for i in range(spec.workers)]
    system = spec.worker_port + 2 * spec.port_stride
    argv = _mocker_argv(spec, Role.COLOCATED, events)
    env = {**spec.dynamo_env, "DYN_TCP_RPC_PORT": str(spec.worker_port), "DYN_SYSTEM_PORT": str(system)}
    return ProcessPlan(name, Role.COLOCATED, tuple(argv), env, system, (spec.worker_port, *events))


def frontend_plan(spec: DynamoFleetSpec) -> ProcessPlan:
    """Dynamo's frontend: in direct mode each request goes to the instances it names;
    otherwise the frontend routes (``spec.frontend_routing``, ``spec.frontend_flags``), once
    it has seen enough workers (``--router-min-initial-workers``: :attr:`DynamoFleetSpec.smallest_pool`;
    the workers start and register first, so its first look at discovery finds them all)."""
    argv = (
        sys.executable,
        "-m",
        "dynamo.frontend",
        *DYNAMO_PLANES,
        "--router-mode",
        spec.frontend_routing.value,
        "--http-host",
        HOST,
        "--http-port",
        str(spec.frontend_port),
        "--model-path",
        str(spec.model_dir),
        "--model-name",
        spec.served_model_name,
        *(() if spec.kvpilot_routes else ("--router-min-initial-workers", str(spec.smallest_pool))),
        *spec.frontend_flags,
    )
    return ProcessPlan("frontend", None, argv, spec.dynamo_env, spec.frontend_port)


def router_config(spec: DynamoFleetSpec) -> dict[str, object]:
    """The router's config: no workers (discovery finds them), every request to the
    frontend, each worker's KV events at its request-plane port + ``port_stride``."""
    return {
        "server": {
            "host": HOST,
            "port": spec.router_port,
            "model_name": spec.served_model_name,
            "model_dir": str(spec.model_dir),
            "ttft_slo_s": spec.ttft_slo_s,
            "calibration_workers": FLEET_CALIBRATION_WORKERS,
            # the router reads max_model_len from the frontend's /v1/models; where it states
            # none, the mockers' lengths are left to them (Dynamo's frontend checks its own)
            "allow_unchecked_lengths": True,
        },
        "index": {"block_size": spec.block_size},
        **({"cost": dict(spec.router_cost)} if spec.router_cost else {}),
        # Dynamo 1.6.1's direct mode needs a prefill instance on every request of a
        # disaggregated deployment (a decode-only request is a 500): always prefill on P.
        "disaggregation": {"max_local_tokens": 0} if spec.prefill else {},
        "dynamo": {
            "frontend_url": spec.frontend_url,
            "discovery_backend": "file",
            "discovery_interval_s": spec.discovery_interval_s,
            "kv_events_port_offset": spec.port_stride,
            "kv_replay_port_offset": 4 * spec.port_stride,
        },
        **({"gateway": {"picker_port": spec.picker_port}} if spec.gateway is not None else {}),
    }


def router_plan(spec: DynamoFleetSpec) -> ProcessPlan:
    argv = (sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(spec.run_dir / ROUTER_CONFIG))
    return ProcessPlan("router", None, argv, spec.dynamo_env, spec.router_port)


def plan_dynamo_fleet(spec: DynamoFleetSpec) -> tuple[list[ProcessPlan], ProcessPlan, ProcessPlan, dict[str, object]]:
    """The workers (by ordinal), the frontend, the router, and the router's config (to be
    written to ``<run_dir>/router.yaml``). Raises :class:`~kvpilot.deploy.fleet_spec.PortCollision`
    when two of their ports meet (Envoy's and the picker's among them)."""
    counts: dict[Role, int] = {}
    workers = []
    for ordinal, role in enumerate(spec.roles):
        workers.append(worker_plan(spec, role, counts.get(role, 0), ordinal))
        counts[role] = counts.get(role, 0) + 1
    frontend, router = frontend_plan(spec), router_plan(spec)
    gateway = spec.gateway
    if gateway is not None:
        router = router.with_side_port(spec.picker_port, "endpoint picker (gRPC)", {})
    check_ports([*workers, frontend, router, *([envoy_plan(gateway, spec.run_dir)] if gateway is not None else [])])
    return workers, frontend, router, router_config(spec)
