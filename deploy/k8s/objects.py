"""The labels every kvpilot object carries and small builders of plain Kubernetes objects."""

from __future__ import annotations

from collections.abc import Mapping

from kvpilot.deploy.k8s.plan import NAME, SIDE_CHANNEL_HOST_ENV

Obj = dict[str, object]
"""A Kubernetes object as plain data, ready for YAML."""

NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "kvpilot.io/role"
METRICS_LABEL = "kvpilot.io/metrics"
"""On every Service whose ``http`` port serves ``/metrics``: the ServiceMonitor selects it."""
ENGINE = "engine"
ROUTER = "router"
GATEWAY = "gateway"
"""Envoy's pods (the standalone gateway beside the picker)."""

HTTP_PORT_NAME = "http"
PICKER_PORT_NAME = "picker"
"""The router's endpoint picker (gRPC)."""
NIXL_PORT_NAME = "nixl"
REPLAY_PORT_NAME = "kv-replay"


def labels(component: str, **extra: str) -> dict[str, str]:
    return {NAME_LABEL: NAME, COMPONENT_LABEL: component, **extra}


def meta(name: str, namespace: str | None, **fields: object) -> Obj:
    """An object's ``metadata``: its name, its namespace (``None``: a cluster-wide object), ``fields``."""
    out: Obj = {"name": name}
    if namespace is not None:
        out["namespace"] = namespace
    out.update(fields)
    return out


def obj(api_version: str, kind: str, metadata: Obj, **fields: object) -> Obj:
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


def env_list(literal: Mapping[str, str], secret: Mapping[str, str], secret_name: str) -> list[Obj]:
    """Container ``env``: literal values, then each ``secret`` variable from its key of
    ``secret_name`` (required: the pod does not start without it)."""
    out: list[Obj] = [{"name": k, "value": v} for k, v in literal.items()]
    out += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}} for k, key in secret.items()]
    return out


def http_probe(port: str, path: str = "/health", **fields: int) -> Obj:
    return {"httpGet": {"path": path, "port": port}, **fields}


SIDE_CHANNEL_HOST_FROM_POD: Obj = {
    "name": SIDE_CHANNEL_HOST_ENV,
    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
}
"""NIXL's side channel advertises the pod's IP, which its peers connect to."""
