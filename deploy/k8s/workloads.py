"""The engines' and the router's Deployments, Services, config and Secret, from a
:class:`~kvpilot.deploy.k8s.plan.ClusterPlan`.

Each engine is its own Deployment (one replica) and Service: the router's config names
every engine by its Service, so scaling P or D is re-rendering with other counts
(docs/guides/kubernetes.md), never ``kubectl scale``. An engine's Service is headless: its
name resolves to its pod's IP, which the endpoint picker names to Envoy (an
original-destination cluster connects only to an ``IP:port``, and GAIE's protocol names a
pod) and the router connects to directly.
"""

from __future__ import annotations

import yaml

from kvpilot.deploy.fleet_spec import ROUTER_CONFIG
from kvpilot.deploy.k8s.objects import (
    ENGINE,
    HTTP_PORT_NAME,
    INSTANCE_LABEL,
    METRICS_LABEL,
    NIXL_PORT_NAME,
    PICKER_PORT_NAME,
    REPLAY_PORT_NAME,
    ROLE_LABEL,
    ROUTER,
    SIDE_CHANNEL_HOST_FROM_POD,
    Obj,
    env_list,
    http_probe,
    labels,
    meta,
    obj,
)
from kvpilot.deploy.k8s.plan import (
    API_KEYS_SECRET,
    CONFIG_MOUNT,
    GPU_RESOURCE,
    MODELS_MOUNT,
    NAME,
    SECRET_KEYS,
    ClusterPlan,
    ClusterSpec,
    EnginePod,
    RouterPod,
    service_name,
)

ROUTER_CONFIG_MAP = f"{NAME}-router-config"
MODELS_VOLUME = "models"
SHM_VOLUME = "dshm"


def namespace(spec: ClusterSpec) -> Obj:
    name = spec.namespace
    return obj("v1", "Namespace", meta(name, None, labels={"kubernetes.io/metadata.name": name}))


def api_keys_secret(spec: ClusterSpec) -> Obj:
    """The API keys' Secret, without values: its keys are applied by another field
    manager (docs/guides/kubernetes.md), so re-applying this leaves them; no pod starts until
    the Secret holds every key the pod reads."""
    keys = ",".join(sorted(set(SECRET_KEYS.values())))
    return obj(
        "v1", "Secret", meta(API_KEYS_SECRET, spec.namespace, annotations={"kvpilot.io/keys": keys}), type="Opaque"
    )


def engine_labels(engine: EnginePod) -> dict[str, str]:
    return labels(ENGINE, **{ROLE_LABEL: engine.role.value, INSTANCE_LABEL: engine.name})


def _models_volume(spec: ClusterSpec) -> Obj:
    return {"name": MODELS_VOLUME, "persistentVolumeClaim": {"claimName": spec.models_claim, "readOnly": True}}


def _models_mount() -> Obj:
    return {"name": MODELS_VOLUME, "mountPath": str(MODELS_MOUNT), "readOnly": True}


def _engine_resources(spec: ClusterSpec) -> Obj:
    gpus = str(spec.tensor_parallel_size)
    return {"limits": {GPU_RESOURCE: gpus, spec.rdma_resource: "1"}}


def engine_container(spec: ClusterSpec, engine: EnginePod) -> Obj:
    secrets = {k: SECRET_KEYS[k] for k in engine.secret_env}
    return {
        "name": "vllm",
        "image": spec.image,
        "command": list(engine.command),
        "env": [SIDE_CHANNEL_HOST_FROM_POD, *env_list(engine.env, secrets, API_KEYS_SECRET)],
        "ports": [
            {"name": HTTP_PORT_NAME, "containerPort": engine.port, "protocol": "TCP"},
            {"name": NIXL_PORT_NAME, "containerPort": engine.side_channel_port, "protocol": "TCP"},
            {"name": REPLAY_PORT_NAME, "containerPort": engine.replay_port, "protocol": "TCP"},
        ],
        "resources": _engine_resources(spec),
        # Loading weights and compiling CUDA graphs can take minutes: /health answers 200
        # only once the engine serves.
        "startupProbe": http_probe(HTTP_PORT_NAME, periodSeconds=10, failureThreshold=90),
        "readinessProbe": http_probe(HTTP_PORT_NAME, periodSeconds=5, failureThreshold=2),
        "livenessProbe": http_probe(HTTP_PORT_NAME, periodSeconds=10, failureThreshold=6),
        # RDMA registers (pins) the KV cache's memory.
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [_models_mount(), {"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }


def engine_deployment(spec: ClusterSpec, engine: EnginePod) -> Obj:
    pod_labels = engine_labels(engine)
    pod: Obj = {
        "metadata": {"labels": pod_labels},
        "spec": {
            "containers": [engine_container(spec, engine)],
            "volumes": [_models_volume(spec), {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
        },
    }
    return obj(
        "apps/v1",
        "Deployment",
        meta(service_name(engine.name), spec.namespace, labels=pod_labels),
        spec={
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # its GPUs are freed before the new pod asks for them
            "selector": {"matchLabels": pod_labels},
            "template": pod,
        },
    )


def engine_service(spec: ClusterSpec, engine: EnginePod) -> Obj:
    """Headless (see the module doc): DNS answers the ready pod's IP."""
    pod_labels = engine_labels(engine)
    return obj(
        "v1",
        "Service",
        meta(service_name(engine.name), spec.namespace, labels={**pod_labels, METRICS_LABEL: "true"}),
        spec={
            "clusterIP": "None",
            "selector": pod_labels,
            "ports": [
                {"name": HTTP_PORT_NAME, "port": engine.port, "targetPort": HTTP_PORT_NAME},
                {"name": REPLAY_PORT_NAME, "port": engine.replay_port, "targetPort": REPLAY_PORT_NAME},
            ],
        },
    )


def router_config_map(spec: ClusterSpec, router: RouterPod) -> Obj:
    text = yaml.safe_dump(router.config, sort_keys=False)
    metadata = meta(ROUTER_CONFIG_MAP, spec.namespace, labels=labels(ROUTER))
    return obj("v1", "ConfigMap", metadata, data={ROUTER_CONFIG: text})


def events_port_name(ordinal: int) -> str:
    return f"kv-events-{ordinal}"


def router_deployment(spec: ClusterSpec, router: RouterPod) -> Obj:
    pod_labels = labels(ROUTER)
    container: Obj = {
        "name": "router",
        "image": spec.image,
        "command": list(router.command),
        "env": env_list({}, {k: SECRET_KEYS[k] for k in router.secret_env}, API_KEYS_SECRET),
        "ports": [
            {"name": HTTP_PORT_NAME, "containerPort": router.cpu_plan.port, "protocol": "TCP"},
            {"name": PICKER_PORT_NAME, "containerPort": router.picker_port, "protocol": "TCP"},
            *(
                {"name": events_port_name(i), "containerPort": port, "protocol": "TCP"}
                for i, port in enumerate(router.events_ports)
            ),
        ],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "readinessProbe": http_probe(HTTP_PORT_NAME, periodSeconds=5, failureThreshold=2),
        "livenessProbe": http_probe(HTTP_PORT_NAME, periodSeconds=10, failureThreshold=6),
        "volumeMounts": [
            {"name": "config", "mountPath": str(CONFIG_MOUNT), "readOnly": True},
            _models_mount(),  # the tokenizer
        ],
    }
    pod: Obj = {
        "metadata": {"labels": pod_labels},
        "spec": {
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": ROUTER_CONFIG_MAP}}, _models_volume(spec)],
        },
    }
    return obj(
        "apps/v1",
        "Deployment",
        meta(service_name(ROUTER), spec.namespace, labels=pod_labels),
        spec={
            # One replica: every engine publishes its KV events to the one router bound
            # behind this Service; replicas wait for a shared router state.
            "replicas": 1,
            # The old router serves until the new one is ready (no gap for clients); the
            # new one's index starts cold and fills from the events that follow.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": pod_labels},
            "template": pod,
        },
    )


def router_service(spec: ClusterSpec, router: RouterPod) -> Obj:
    pod_labels = labels(ROUTER)
    events = [
        {"name": events_port_name(i), "port": port, "targetPort": port} for i, port in enumerate(router.events_ports)
    ]
    return obj(
        "v1",
        "Service",
        meta(service_name(ROUTER), spec.namespace, labels={**pod_labels, METRICS_LABEL: "true"}),
        spec={
            "selector": pod_labels,
            "ports": [
                {"name": HTTP_PORT_NAME, "port": router.cpu_plan.port, "targetPort": HTTP_PORT_NAME},
                {
                    "name": PICKER_PORT_NAME,
                    "port": router.picker_port,
                    "targetPort": PICKER_PORT_NAME,
                    "appProtocol": "kubernetes.io/h2c",
                },
                *events,
            ],
        },
    )


def workloads(plan: ClusterPlan) -> list[Obj]:
    """The engines' Deployments and Services, then the router's config, Deployment and Service."""
    out: list[Obj] = []
    for engine in plan.engines:
        out += [engine_deployment(plan.spec, engine), engine_service(plan.spec, engine)]
    spec, router = plan.spec, plan.router
    out += [router_config_map(spec, router), router_deployment(spec, router), router_service(spec, router)]
    return out
