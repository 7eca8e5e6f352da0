"""Prometheus beside a local fleet (``kvpilot fleet up --observe``): pure planning.

:func:`plan_observe` gives the Prometheus process to start, its ``prometheus.yml``
(every engine, the router and, when on, each engine's NIXL telemetry exporter,
scraped every ``scrape_interval`` on 127.0.0.1, with ``grafana/alerts.yml`` as its
rules), and the engines' plans with NIXL's Prometheus exporter switched on. Each
engine target carries ``worker`` and ``role`` labels, the names the router uses,
so engine and router series can be matched in one query.

Prometheus is Debian's ``prometheus`` package (``scripts/bootstrap.sh`` installs it
where apt works); :func:`prometheus_binary` says what to do when it is missing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvpilot.deploy.fleet_spec import HOST, ProcessPlan, check_ports

PROMETHEUS_CONFIG = "prometheus.yml"
DEFAULT_RULES = Path(__file__).resolve().parents[1] / "grafana" / "alerts.yml"
INSTALL_HINT = (
    "Prometheus is not installed: `apt-get install -y prometheus` (Debian/Ubuntu, as root; scripts/bootstrap.sh "
    "does it), or put a Prometheus 2.x `prometheus` binary on PATH, or set KVPILOT_PROMETHEUS to its path"
)


class PrometheusMissing(RuntimeError):
    """No ``prometheus`` binary; the message says how to get one."""


@dataclass(frozen=True, slots=True)
class ObserveSpec:
    port: int = 9090
    """Prometheus' HTTP port (on 127.0.0.1)."""
    scrape_interval: str = "2s"
    rules: Path | None = DEFAULT_RULES
    """Alert rules to load (``None``: none)."""
    nixl_telemetry: bool = True
    """Switch on NIXL's own Prometheus exporter in every engine and scrape it."""
    nixl_port: int | None = None
    """Engine i's NIXL exporter listens on ``nixl_port + i`` (default: ``port + 1``)."""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def nixl_port_of(self, ordinal: int) -> int:
        return (self.port + 1 if self.nixl_port is None else self.nixl_port) + ordinal


def prometheus_binary() -> str:
    """``$KVPILOT_PROMETHEUS`` or ``prometheus`` on PATH; raises :class:`PrometheusMissing`."""
    path = os.environ.get("KVPILOT_PROMETHEUS") or shutil.which("prometheus")
    if not path:
        raise PrometheusMissing(INSTALL_HINT)
    return path


def nixl_telemetry_env(port: int) -> dict[str, str]:
    """NIXL's Prometheus exporter on ``127.0.0.1:port`` (``_LOCAL``: not on every interface)."""
    return {
        "NIXL_TELEMETRY_ENABLE": "y",
        "NIXL_TELEMETRY_EXPORTER": "prometheus",
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
    }


def _target(port: int, plan: ProcessPlan | None = None) -> dict[str, object]:
    target: dict[str, object] = {"targets": [f"{HOST}:{port}"]}
    if plan is not None and plan.role is not None:
        target["labels"] = {"worker": plan.name, "role": plan.role.value}
    return target


def prometheus_config(spec: ObserveSpec, engines: list[ProcessPlan], router: ProcessPlan) -> dict[str, object]:
    """The ``prometheus.yml`` for this fleet."""
    jobs: list[dict[str, object]] = [
        {"job_name": "vllm", "static_configs": [_target(e.port, e) for e in engines]},
        {"job_name": "kvpilot-router", "static_configs": [_target(router.port)]},
    ]
    if spec.nixl_telemetry:
        jobs.append(
            {"job_name": "nixl", "static_configs": [_target(spec.nixl_port_of(i), e) for i, e in enumerate(engines)]}
        )
    config: dict[str, object] = {
        "global": {"scrape_interval": spec.scrape_interval, "evaluation_interval": spec.scrape_interval},
        "scrape_configs": jobs,
    }
    if spec.rules is not None:
        config["rule_files"] = [str(spec.rules.resolve())]
    return config


def plan_observe(
    spec: ObserveSpec, run_dir: Path, engines: list[ProcessPlan], router: ProcessPlan, binary: str = "prometheus"
) -> tuple[list[ProcessPlan], ProcessPlan, dict[str, object]]:
    """The engines (with NIXL's exporter when on), the Prometheus process, and its config
    (to be written to ``<run_dir>/prometheus.yml``). Raises
    :class:`~kvpilot.deploy.fleet_spec.PortCollision` when a port of Prometheus or of an exporter
    meets another of the fleet's (the router's too)."""
    if spec.nixl_telemetry:
        engines = [
            e.with_side_port(
                spec.nixl_port_of(i),
                f"NIXL Prometheus exporter ({'Prometheus port + 1' if spec.nixl_port is None else 'NIXL port'} + {i})",
                nixl_telemetry_env(spec.nixl_port_of(i)),
            )
            for i, e in enumerate(engines)
        ]
    argv = (
        binary,
        f"--config.file={run_dir / PROMETHEUS_CONFIG}",
        f"--storage.tsdb.path={run_dir / 'prometheus-data'}",
        "--storage.tsdb.retention.time=2d",
        f"--web.listen-address={HOST}:{spec.port}",
    )
    process = ProcessPlan("prometheus", None, argv, {}, spec.port, port_use="HTTP (--prometheus-port)")
    check_ports([*engines, router, process])
    return engines, process, prometheus_config(spec, engines, router)
