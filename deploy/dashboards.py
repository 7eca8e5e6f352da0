"""The committed Grafana dashboards (``grafana/dashboards/*.json``) read back: their
panels and queries, template variables substituted as Grafana would, evaluated
against a Prometheus over its HTTP API, and drawn to PNGs without Grafana.

    kvpilot dashboards render --prometheus http://127.0.0.1:9090 --out DIR [--minutes 15] [--end UNIX_TIME]
    kvpilot dashboards queries            # every panel's queries, one per line

Reads the JSON, not the generator: what is checked and drawn is what a user imports.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "grafana" / "dashboards"
RATE_INTERVAL = "1m"
"""What ``$__rate_interval`` becomes outside Grafana (Grafana's own: at least 4 scrape intervals)."""


@dataclass(frozen=True, slots=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str
    legend: str

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


@dataclass(frozen=True, slots=True)
class DashboardFile:
    uid: str
    title: str
    variables: dict[str, str]
    """Query variables: name -> ``label_values(...)`` query (the data source one is left out)."""
    panels: tuple[tuple[str, str, tuple[PanelQuery, ...]], ...]
    """(title, unit, queries) per panel, rows left out."""

    @property
    def queries(self) -> list[PanelQuery]:
        return [q for _, _, queries in self.panels for q in queries]


def load(path: Path) -> DashboardFile:
    doc = json.loads(path.read_text())
    variables = {v["name"]: v["query"] for v in doc["templating"]["list"] if v["type"] == "query"}
    panels = []
    for panel in doc["panels"]:
        if panel["type"] == "row":
            continue
        queries = tuple(
            PanelQuery(doc["title"], panel["title"], t["refId"], t["expr"], t.get("legendFormat", ""))
            for t in panel.get("targets", [])
        )
        panels.append((panel["title"], panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""), queries))
    return DashboardFile(doc["uid"], doc["title"], variables, tuple(panels))


def load_all(directory: Path = DASHBOARD_DIR) -> list[DashboardFile]:
    return [load(p) for p in sorted(directory.glob("*.json"))]


# ---- PromQL, as far as the dashboards need it --------------------------------


def regex_of(values: Sequence[str]) -> str:
    """Grafana's value for a multi-value variable inside ``=~``: ``(a|b)``, regex-escaped."""
    escaped = [re.sub(r"([\\.+*?^$()\[\]{}|])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: Mapping[str, str], rate_interval: str = RATE_INTERVAL) -> str:
    """``expr`` with ``$__rate_interval`` and ``$name`` / ``${name}`` replaced (longest names first).
    Raises ``KeyError`` naming a variable that has no value."""
    out = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        out = out.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    left = re.findall(r"\$\{?(\w+)", out)
    if left:
        raise KeyError(f"no value for template variable(s) {sorted(set(left))} in {expr!r}")
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


# ---- Prometheus' HTTP API ------------------------------------------------------


class PrometheusError(RuntimeError):
    """Prometheus answered with an error (a bad query, an unknown endpoint)."""


class Prometheus:
    """A tiny client for Prometheus' HTTP API (``/api/v1``)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, **params: object) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout) as resp:
                doc = json.load(resp)
        except urllib.error.HTTPError as exc:
            doc = json.loads(exc.read() or b"{}")
        if doc.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        vector: list[dict[str, Any]] = self._get("/api/v1/query", query=expr, time=at)["result"]
        return vector

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        answer = self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)
        matrix: list[dict[str, Any]] = answer["result"]
        return matrix

    def label_values(self, variable_query: str) -> list[str]:
        """The values of a Grafana ``label_values([selector,] label)`` variable query."""
        match = _LABEL_VALUES.match(variable_query.strip())
        if match is None:
            raise ValueError(f"not a label_values() query: {variable_query!r}")
        selector = match["selector"]
        values: list[str] = self._get(
            f"/api/v1/label/{match['label']}/values", **({"match[]": selector} if selector else {})
        )
        return values

    def targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self._get("/api/v1/targets")["activeTargets"]
        return targets

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return alerts

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"]]


def variable_values(prom: Prometheus, dashboard: DashboardFile) -> dict[str, str]:
    """Each query variable set to "All" as Grafana sends it: the regex of every value
    its ``label_values`` query finds, resolved in order (``$model`` before ``$instance``)."""
    values: dict[str, str] = {}
    for name, query in dashboard.variables.items():
        found = prom.label_values(substitute(query, values)) if "$" in query else prom.label_values(query)
        values[name] = regex_of(sorted(found)) if found else ".*"
    return values


# ---- PNGs ----------------------------------------------------------------------

_UNIT_SCALE = {
    "percentunit": (100.0, "%"),
    "Bps": (1 / 2**20, "MiB/s"),
    "bytes": (1 / 2**20, "MiB"),
    "s": (1000.0, "ms"),
    "ops": (1.0, "/s"),
}


def _legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or "value"


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def render(
    prom: Prometheus,
    out_dir: Path,
    minutes: float = 15.0,
    rate_interval: str = RATE_INTERVAL,
    dashboards: Sequence[DashboardFile] | None = None,
    end: float | None = None,
) -> list[Path]:
    """One PNG per panel (``<out_dir>/<dashboard uid>/<panel>.png``) from range queries
    over the last ``minutes``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time() if end is None else end
    start, step = end - minutes * 60, max(2.0, minutes * 60 / 300)
    written = []
    for dash in dashboards if dashboards is not None else load_all():
        variables = variable_values(prom, dash)
        folder = out_dir / dash.uid
        folder.mkdir(parents=True, exist_ok=True)
        for title, unit, queries in dash.panels:
            scale, suffix = _UNIT_SCALE.get(unit, (1.0, ""))
            fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
            drawn = 0
            for q in queries:
                for series in prom.query_range(substitute(q.expr, variables, rate_interval), start, end, step):
                    points = [(float(t) - end, float(v) * scale) for t, v in series["values"]]
                    xs, ys = [p[0] / 60 for p in points], [p[1] for p in points]
                    ax.plot(xs, ys, label=_legend(q.legend, series["metric"]), linewidth=1.5)
                    drawn += 1
            ax.set_xlim(-minutes, 0)
            ax.set_title(f"{dash.title}: {title}", fontsize=10, loc="left")
            ax.set_xlabel("minutes before the end of the range")
            ax.set_ylabel(suffix or unit)
            ax.grid(alpha=0.3)
            if drawn:
                ax.legend(fontsize=7, loc="upper left")
            else:
                ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="grey")
            fig.tight_layout()
            path = folder / f"{slug(title)}.png"
            fig.savefig(path)
            plt.close(fig)
            written.append(path)
    return written


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dashboards generate | render | queries`` to a ``kvpilot`` subparsers object."""
    dashboards = subparsers.add_parser(
        "dashboards", help="the Grafana dashboards", description="Generate, draw or list the Grafana dashboards."
    )
    sub = dashboards.add_subparsers(dest="dashboards_command", required=True)
    gen = sub.add_parser(
        "generate",
        help="write grafana/dashboards/*.json from grafana/panels.py",
        description="Build the dashboards with Grafana's foundation SDK (needs kvpilot[dev]).",
    )
    gen.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    gen.set_defaults(func=_generate)
    draw = sub.add_parser(
        "render",
        help="every panel to a PNG, from Prometheus range queries",
        description="Draw every panel of the committed dashboards to a PNG, from a Prometheus' range queries "
        "(template variables substituted as Grafana would), without Grafana.",
    )
    draw.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus' base URL")
    draw.add_argument("--out", type=Path, required=True, help="folder for <dashboard>/<panel>.png")
    draw.add_argument("--minutes", type=float, default=15.0, help="time range, ending now")
    draw.add_argument("--rate-interval", default=RATE_INTERVAL, help="what $__rate_interval becomes")
    draw.add_argument("--end", type=float, help="end of the range, Unix seconds (default: now)")
    draw.set_defaults(func=_render)
    queries = sub.add_parser("queries", help="print every panel's queries", description="Every panel's queries.")
    queries.set_defaults(func=_queries)


def _generate(args: argparse.Namespace) -> int:
    from kvpilot.grafana.generate import generate

    return generate(args.check)


def _render(args: argparse.Namespace) -> int:
    written = render(Prometheus(args.prometheus), args.out, args.minutes, args.rate_interval, end=args.end)
    print(f"wrote {len(written)} panels under {args.out}")
    return 0


def _queries(_: argparse.Namespace) -> int:
    for dash in load_all():
        for q in dash.queries:
            print(f"{q.name}\t{q.expr}")
    return 0
