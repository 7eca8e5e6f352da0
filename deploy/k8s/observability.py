"""Prometheus's operator objects and Grafana's dashboards for the fleet.

A ServiceMonitor scrapes ``/metrics`` on the ``http`` port of every Service labelled
:data:`~kvpilot.deploy.k8s.objects.METRICS_LABEL` (each engine and the router); a PrometheusRule
carries ``grafana/alerts.yml`` unchanged; each dashboard of ``grafana/dashboards/`` is a
ConfigMap labelled for Grafana's dashboard sidecar (:data:`DASHBOARD_LABEL`).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvpilot.deploy.dashboards import DASHBOARD_DIR
from kvpilot.deploy.k8s.objects import HTTP_PORT_NAME, METRICS_LABEL, NAME_LABEL, Obj, meta, obj
from kvpilot.deploy.k8s.plan import NAME, ClusterSpec, service_name
from kvpilot.deploy.observe import DEFAULT_RULES

MONITORING_API = "monitoring.coreos.com/v1"
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
"""What Grafana's sidecar (kube-prometheus-stack's default) picks dashboards up by."""
SCRAPE_INTERVAL = "15s"


def service_monitor(spec: ClusterSpec) -> Obj:
    return obj(
        MONITORING_API,
        "ServiceMonitor",
        meta(NAME, spec.namespace, labels={NAME_LABEL: NAME, **spec.prometheus_labels}),
        spec={
            "selector": {"matchLabels": {NAME_LABEL: NAME, METRICS_LABEL: "true"}},
            "namespaceSelector": {"matchNames": [spec.namespace]},
            "endpoints": [{"port": HTTP_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL}],
        },
    )


def prometheus_rule(spec: ClusterSpec, rules: Path = DEFAULT_RULES) -> Obj:
    """``rules`` (Prometheus's rule-file format) as a PrometheusRule: its groups verbatim."""
    groups = yaml.safe_load(rules.read_text())["groups"]
    return obj(
        MONITORING_API,
        "PrometheusRule",
        meta(NAME, spec.namespace, labels={NAME_LABEL: NAME, **spec.prometheus_labels}),
        spec={"groups": groups},
    )


def dashboard_config_maps(namespace: str, directory: Path = DASHBOARD_DIR) -> list[Obj]:
    """One ConfigMap per dashboard JSON, its file name as the key, text unchanged."""
    return [
        obj(
            "v1",
            "ConfigMap",
            meta(
                service_name(f"dashboard-{path.stem.removeprefix(NAME + '-')}"),
                namespace,
                labels={NAME_LABEL: NAME, **DASHBOARD_LABEL},
            ),
            data={path.name: path.read_text()},
        )
        for path in sorted(directory.glob("*.json"))
    ]


def observability(spec: ClusterSpec) -> list[Obj]:
    return [service_monitor(spec), prometheus_rule(spec), *dashboard_config_maps(spec.namespace)]
