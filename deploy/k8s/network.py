"""NetworkPolicies that close the engines' data plane to everything but the fleet.

- Engines' HTTP ports (``/v1``, ``/health``, ``/metrics``) and KV replay sockets: the
  router only, and Prometheus's namespace on HTTP (``/metrics``).
- Engines' NIXL side channels: other engines only.
- Engines' HTTP ports also: the gateway (Envoy, which carries D's requests and streams).
- The router's HTTP port: anyone (its clients; its own API key guards ``/v1``); its KV
  event ports (the engines' publishers connect to them: vLLM's publisher has no ZMQ CURVE,
  so this policy is what keeps forged events out): engines only; its picker port (Envoy's
  ext_proc and the access-log receiver whose records count against workers' circuits):
  the gateway's pods only.
- A GAIE gateway's proxy runs in the namespace its implementation puts it in: with
  ``gateway_namespace`` set, that namespace's pods are let into the engines' HTTP ports
  and the router's picker (set ``gateway.token_env`` where the proxy can send it).

Egress is left open. UCX's RDMA and NVLink traffic does not cross the pod network, so
no NetworkPolicy sees it; UCX over TCP (``UCX_TLS=tcp``, debugging) needs its data
ports opened besides these.
"""

from __future__ import annotations

from kvpilot.deploy.k8s.objects import (
    COMPONENT_LABEL,
    ENGINE,
    GATEWAY,
    HTTP_PORT_NAME,
    NAME_LABEL,
    NIXL_PORT_NAME,
    PICKER_PORT_NAME,
    REPLAY_PORT_NAME,
    ROUTER,
    Obj,
    meta,
    obj,
)
from kvpilot.deploy.k8s.plan import NAME, ClusterPlan, service_name
from kvpilot.deploy.k8s.workloads import events_port_name


def pods_of(component: str) -> Obj:
    """The label selector of one component's pods."""
    return {"matchLabels": {NAME_LABEL: NAME, COMPONENT_LABEL: component}}


def _tcp(port: str) -> Obj:
    return {"protocol": "TCP", "port": port}


def namespace_peer(namespace: str) -> Obj:
    """Every pod of ``namespace`` (by the label Kubernetes gives each namespace)."""
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}


def _gateway_peers(plan: ClusterPlan) -> list[Obj]:
    """The standalone Envoy's pods, and a GAIE gateway's namespace when one is named."""
    gaie = [namespace_peer(plan.spec.gateway_namespace)] if plan.spec.gateway_namespace else []
    return [{"podSelector": pods_of(GATEWAY)}, *gaie]


def engines_policy(plan: ClusterPlan) -> Obj:
    return obj(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        meta(service_name("engines"), plan.spec.namespace),
        spec={
            "podSelector": pods_of(ENGINE),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": pods_of(ROUTER)}], "ports": [_tcp(HTTP_PORT_NAME), _tcp(REPLAY_PORT_NAME)]},
                {"from": _gateway_peers(plan), "ports": [_tcp(HTTP_PORT_NAME)]},
                {"from": [{"podSelector": pods_of(ENGINE)}], "ports": [_tcp(NIXL_PORT_NAME)]},
                {"from": [namespace_peer(plan.spec.monitoring_namespace)], "ports": [_tcp(HTTP_PORT_NAME)]},
            ],
        },
    )


def router_policy(plan: ClusterPlan) -> Obj:
    events = [_tcp(events_port_name(i)) for i in range(len(plan.router.events_ports))]
    return obj(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        meta(service_name(ROUTER), plan.spec.namespace),
        spec={
            "podSelector": pods_of(ROUTER),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [_tcp(HTTP_PORT_NAME)]},
                {"from": _gateway_peers(plan), "ports": [_tcp(PICKER_PORT_NAME)]},
                {"from": [{"podSelector": pods_of(ENGINE)}], "ports": events},
            ],
        },
    )


def network_policies(plan: ClusterPlan) -> list[Obj]:
    return [engines_policy(plan), router_policy(plan)]
