"""The vocabulary of kvpilot's dashboards, as plain data: a dashboard of rows of panels, each
panel a few PromQL queries, the template variables, and the query helpers every dashboard
module uses (:mod:`kvpilot.grafana.panels` lists the dashboards). No Grafana import:
:mod:`kvpilot.grafana.generate` turns the dashboards into the committed JSON, and
``kvpilot.deploy.dashboards`` reads that JSON back (the e2e test, the PNG renderer).

Template variables the queries use (Grafana substitutes them; so does
``kvpilot.deploy.dashboards.substitute``):

* ``$datasource``: the Prometheus data source;
* ``$model``: vLLM's ``model_name`` label;
* ``$instance``: the engines' scrape ``instance`` (host:port of each engine);
* ``$worker``: the router's ``worker`` label (an engine's name in the router config);
* ``$__rate_interval``: Grafana's rate window (at least four scrape intervals).

Counters that the router creates at their first event (failures, refusals, rejected
KV events) are drawn as totals since the router started: ``rate()`` and
``increase()`` over a series whose first sample is already 1 read 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.kvconnectors import vllm_metrics as vm
from kvpilot.kvconnectors.vllm_metrics import HistogramFamily

ENGINE = 'model_name=~"$model", instance=~"$instance"'
"""Selects the engines the dashboard's ``model`` and ``instance`` variables name."""
WORKER = 'worker=~"$worker"'
"""Selects the router's per-worker series by the ``worker`` variable."""
RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    label: str
    query: str
    """``label_values(...)`` for a query variable; empty for the data source variable."""


@dataclass(frozen=True, slots=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...]


def vec(metric: str, sel: str) -> str:
    """``metric{sel}``, or the bare name (PromQL refuses an empty ``{}``)."""
    return f"{metric}{{{sel}}}" if sel else metric


def quantiles(metric: HistogramFamily, sel: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le) (rate({vec(metric.bucket, sel)}[{RATE}])))",
            f"p{round(q * 100)}",
        )
        for q in qs
    )


def mean(metric: HistogramFamily, sel: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    total, count = vec(metric.sum, sel), vec(metric.count, sel)
    return f"sum{group} (rate({total}[{RATE}])) / sum{group} (rate({count}[{RATE}]))"


def per_interval(series: str, sel: str, by: str) -> str:
    return f"sum by ({by}) (increase({vec(series, sel)}[{RATE}]))"


DATASOURCE = Variable("datasource", "Data source", "")
RUNNING = vm.NUM_REQUESTS_RUNNING.sample
MODEL = Variable("model", "Model", f"label_values({RUNNING}, model_name)")
INSTANCE = Variable("instance", "Engine", f'label_values({RUNNING}{{model_name=~"$model"}}, instance)')
WORKER_VAR = Variable("worker", "Worker (router)", "label_values(kvpilot_router_active_requests, worker)")
