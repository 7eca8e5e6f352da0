"""The Grafana dashboards and alert rules, offline: the committed JSON is what the
generator builds, every metric a panel or an alert reads is one kvpilot's code,
vLLM or NIXL defines, every query is valid PromQL (promtool), and
``fleet up --observe``'s Prometheus plan scrapes every process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvpilot.deploy import dashboards
from kvpilot.deploy.fleet import Fleet, RunningProcess
from kvpilot.deploy.fleet_spec import FleetSpec, plan_fleet
from kvpilot.deploy.observe import ObserveSpec, plan_observe, prometheus_config

REPO = Path(__file__).resolve().parents[3]
ALERTS = REPO / "grafana" / "alerts.yml"
RUNBOOK = REPO / "docs" / "guides" / "observability.md"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool is not installed: `apt-get install -y prometheus` (scripts/bootstrap.sh does it as root)"
NO_SDK = "grafana-foundation-sdk is not installed (kvpilot[dev] on Python 3.11+)"

# NIXL's own exporter (libtelemetry_exporter_prometheus.so): the names it registers.
NIXL_AGENT_METRICS = (
    "agent_tx_bytes_total",
    "agent_rx_bytes_total",
    "agent_tx_requests_num_total",
    "agent_rx_requests_num_total",
    "agent_xfer_time_total",
    "agent_xfer_post_time_total",
    "agent_errors_total",
    "agent_memory_registered_total",
)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "e"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords left
    out), as far as the dashboards' and alert rules' expressions need."""
    bare = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub('""', expr))))
    return {name for name in _IDENT.findall(bare) if name.lower() not in _KEYWORDS}


def _alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def _vllm_families() -> set[str]:
    """Every ``name="vllm:..."`` a Prometheus family of the installed vLLM is created with."""
    import vllm

    root = Path(vllm.__file__).parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        found.update(re.findall(r'name="(vllm:[a-z_:]+)"', path.read_text(errors="replace")))
    return found


def _router_families(model_dir: Path) -> dict[str, str]:
    """The router's families (name -> type), from a real RouterServer's registry."""
    from kvpilot.routing.config_load import load_config
    from kvpilot.routing.fleet import fleet_from_config
    from kvpilot.routing.serve.app import build_server

    workers = [
        {"name": "prefill-0", "role": "prefill", "url": "http://127.0.0.1:1"},
        {"name": "decode-0", "role": "decode", "url": "http://127.0.0.1:2"},
    ]
    (model_dir / "router.yaml").write_text(
        yaml.safe_dump({"index": {"block_size": 4}, "server": {"model_dir": str(model_dir)}, "workers": workers})
    )
    config = load_config(model_dir / "router.yaml")
    server = build_server(config, fleet_from_config(config), feed_index=False)
    return {family.name: family.type for family in server.core.metrics.registry.collect()}


def _sample_names(family: str, kind: str) -> set[str]:
    """The sample names a family of ``kind`` exposes (what a query selects)."""
    if kind == "counter":
        return {family + "_total"}
    if kind == "histogram":
        return {family + s for s in ("_bucket", "_sum", "_count")}
    return {family}


@pytest.fixture(scope="module")
def known_metrics(model_dir: Path) -> set[str]:
    from kvpilot.kvconnectors.stats import COUNTERS

    known = {spec.metric.total for spec in COUNTERS}
    for name, kind in _router_families(model_dir).items():
        known |= _sample_names(name, kind)
    for family in _vllm_families():  # counters and histograms alike: every suffix
        known |= {family, family + "_total", family + "_bucket", family + "_sum", family + "_count"}
    return known | set(NIXL_AGENT_METRICS)


def test_the_committed_json_is_what_the_generator_builds() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason=NO_SDK)
    from kvpilot.grafana.generate import DASHBOARDS, path_for, render

    assert [path_for(s).name for s in DASHBOARDS] == ["kvpilot-transfers.json", "kvpilot-router.json"]
    for spec in DASHBOARDS:
        assert path_for(spec).read_text() == render(spec), f"run `kvpilot dashboards generate` ({spec.uid})"


def test_the_json_is_a_valid_grafana_dashboard_model() -> None:
    """Grafana's own schema types (the SDK's models) read every file back to the same JSON."""
    pytest.importorskip("grafana_foundation_sdk", reason=NO_SDK)
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    for path in sorted(dashboards.DASHBOARD_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        again = json.loads(JSONEncoder(sort_keys=True).encode(Dashboard.from_json(doc)))
        assert again == doc, path.name
        ids = [p["id"] for p in doc["panels"]]
        assert len(set(ids)) == len(ids) and min(ids) > 0, "panel ids unique and non-zero"
        for panel in doc["panels"]:
            refs = [t["refId"] for t in panel.get("targets", [])]
            assert len(set(refs)) == len(refs) and all(refs), panel["title"]


def test_dashboards_have_the_four_variables_and_use_them() -> None:
    for dash in dashboards.load_all():
        doc = json.loads((dashboards.DASHBOARD_DIR / f"{dash.uid}.json").read_text())
        names = [v["name"] for v in doc["templating"]["list"]]
        assert names == ["datasource", "model", "instance", "worker"]
        used = {v for q in dash.queries for v in re.findall(r"\$(\w+)", q.expr)} - {"__rate_interval"}
        assert used <= set(names), used
        for panel in doc["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    every = {v for d in dashboards.load_all() for q in d.queries for v in re.findall(r"\$(\w+)", q.expr)}
    assert {"model", "instance", "worker"} <= every


def test_every_metric_a_panel_reads_is_defined(known_metrics: set[str]) -> None:
    queries = [q for d in dashboards.load_all() for q in d.queries]
    queried = {name: q.name for q in queries for name in metric_names(q.expr)}
    unknown = {name: where for name, where in queried.items() if name not in known_metrics}
    assert not unknown, f"queried but defined nowhere: {unknown}"
    for must in (
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:prompt_tokens_by_source_total",
        "vllm:kvpilot_rejected_blocks_total",
        "kvpilot_router_session_options_total",
        "kvpilot_router_session_offers_total",
    ):
        assert must in queried, must


def test_every_metric_an_alert_reads_is_defined(known_metrics: set[str]) -> None:
    for rule in _alert_rules():
        unknown = metric_names(rule["expr"]) - known_metrics
        assert not unknown, f"{rule['alert']}: {unknown}"


def test_metric_names_are_found_and_functions_are_not() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, stage) (rate(a:b_bucket{x=~"$m", y!="c d"}[$__rate_interval]))) '
        "/ 1e6 + on(x) group_left() sum without (z) (c_total offset 5m) or vector(0)"
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total"}


def test_variables_are_substituted_as_grafana_sends_all() -> None:
    values = {"model": dashboards.regex_of(["tiny"]), "instance": dashboards.regex_of(["127.0.0.1:9610", "h:1"])}
    out = dashboards.substitute('x{model_name=~"$model", instance=~"${instance}"}[$__rate_interval]', values, "5m")
    assert out == 'x{model_name=~"tiny", instance=~"(127\\\\.0\\\\.0\\\\.1:9610|h:1)"}[5m]'
    with pytest.raises(KeyError, match="worker"):
        dashboards.substitute('x{worker=~"$worker"}', values)


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_alert_rules_pass_promtool() -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_every_panel_query_is_valid_promql(tmp_path: Path) -> None:
    """Each query (variables substituted) as a recording rule, checked by promtool's parser."""
    queries = [q for d in dashboards.load_all() for q in d.queries]
    values = {"model": "tiny", "instance": ".*", "worker": ".*"}
    rules = [
        {"record": f"kvpilot:panel_{i}", "expr": dashboards.substitute(q.expr, values)} for i, q in enumerate(queries)
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(queries)} rules found" in out.stdout


def test_every_alert_has_a_runbook_entry() -> None:
    text = RUNBOOK.read_text()
    for rule in _alert_rules():
        name = rule["alert"]
        assert f"### {name}" in text, f"docs/guides/observability.md has no runbook for {name}"
        assert rule["annotations"]["runbook"] == f"docs/guides/observability.md#{name.lower()}"
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_observe_plan_scrapes_every_engine_the_router_and_nixl() -> None:
    spec = FleetSpec(model_dir=Path("/m"), run_dir=Path("/r"), cores=2, engine_port=9610, router_port=9600)
    engines, router, _ = plan_fleet(spec)
    observe = ObserveSpec(port=9690)
    observed, prom, config = plan_observe(observe, spec.run_dir, engines, router, "/usr/bin/prometheus")
    assert prom.port == 9690 and prom.name == "prometheus"
    assert "--web.listen-address=127.0.0.1:9690" in prom.argv and "--config.file=/r/prometheus.yml" in prom.argv
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert [t["targets"] for t in jobs["vllm"]] == [["127.0.0.1:9610"], ["127.0.0.1:9611"]]
    assert [t["labels"] for t in jobs["vllm"]] == [
        {"worker": "prefill-0", "role": "prefill"},
        {"worker": "decode-0", "role": "decode"},
    ]
    assert jobs["kvpilot-router"] == [{"targets": ["127.0.0.1:9600"]}]
    assert [t["targets"] for t in jobs["nixl"]] == [["127.0.0.1:9691"], ["127.0.0.1:9692"]]
    assert config["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    assert config["rule_files"] == [str(ALERTS)]
    for i, engine in enumerate(observed):
        assert engine.env["NIXL_TELEMETRY_PROMETHEUS_PORT"] == str(9691 + i)
        assert engine.env["NIXL_TELEMETRY_PROMETHEUS_LOCAL"] == "y"
        assert engine.side_ports[-1] == 9691 + i and engine.argv == engines[i].argv
    quiet = prometheus_config(ObserveSpec(nixl_telemetry=False, rules=None), engines, router)
    assert "nixl" not in {j["job_name"] for j in quiet["scrape_configs"]} and "rule_files" not in quiet


def test_fleet_state_keeps_prometheus_and_reads_older_state(tmp_path: Path) -> None:
    def proc(name: str, port: int, health: str = "/health") -> RunningProcess:
        return RunningProcess(name, None, 1, port, (), "log", health)

    fleet = Fleet(tmp_path, (proc("decode-0", 1),), proc("router", 2), proc("prometheus", 3, "/-/ready"))
    fleet.save()
    assert Fleet.load(tmp_path) == fleet
    assert [p.name for p in fleet.processes] == ["decode-0", "router", "prometheus"]
    state = json.loads((tmp_path / "fleet.json").read_text())
    del state["prometheus"]
    for entry in (*state["engines"], state["router"]):
        del entry["health"]
    (tmp_path / "fleet.json").write_text(json.dumps(state))
    older = Fleet.load(tmp_path)
    assert older is not None and older.prometheus is None and older.router.health == "/health"


def test_provisioning_points_grafana_at_prometheus_and_the_dashboards() -> None:
    prov = REPO / "grafana" / "provisioning"
    (source,) = yaml.safe_load((prov / "datasources" / "kvpilot.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    (provider,) = yaml.safe_load((prov / "dashboards" / "kvpilot.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_observe_without_prometheus_refuses_before_starting_anything(tmp_path: Path, monkeypatch) -> None:
    from kvpilot.deploy import fleet as fleet_io
    from kvpilot.deploy.fleet import FleetStartError

    monkeypatch.delenv("KVPILOT_PROMETHEUS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus here
    spec = FleetSpec(model_dir=tmp_path, run_dir=tmp_path / "run", cores=2)
    with pytest.raises(FleetStartError, match="apt-get install -y prometheus"):
        fleet_io.up(spec, observe=ObserveSpec())
    assert not (tmp_path / "run").exists()


def test_cli_fleet_up_takes_observe_flags() -> None:
    from kvpilot.deploy.cli import build_parser

    args = build_parser().parse_args(["fleet", "up", "--observe", "--prometheus-port", "9690", "--no-nixl-telemetry"])
    assert args.observe and args.prometheus_port == 9690 and args.no_nixl_telemetry
    assert not build_parser().parse_args(["fleet", "up"]).observe


class _FakePrometheus:
    """Answers label_values and range queries with one rising series per query."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def label_values(self, query: str) -> list[str]:
        return {"model_name": ["tiny"], "instance": ["127.0.0.1:9610"], "worker": ["decode-0"]}[
            query.rsplit(",", 1)[-1].strip(" )") if "," in query else "worker"
        ]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        self.queries.append(expr)
        return [
            {
                "metric": {"instance": "127.0.0.1:9610", "stage": "route"},
                "values": [[start + i * step, str(i)] for i in range(5)],
            }
        ]


def test_render_draws_one_png_per_panel_with_variables_substituted(tmp_path: Path) -> None:
    prom = _FakePrometheus()
    written = dashboards.render(prom, tmp_path, minutes=2, end=1_000_000.0)
    every = dashboards.load_all()
    assert len(written) == sum(len(d.panels) for d in every) == len(set(written))
    assert all(p.suffix == ".png" and p.stat().st_size > 5000 for p in written)
    assert len(prom.queries) == sum(len(d.queries) for d in every)
    assert not [q for q in prom.queries if "$" in q]
    assert any('model_name=~"tiny"' in q and "[1m]" in q for q in prom.queries)
