"""Build the dashboards of :mod:`kvpilot.grafana.panels` into Grafana JSON with Grafana's
foundation SDK, and write them to ``grafana/dashboards/<uid>.json``.

    kvpilot dashboards generate           # write
    kvpilot dashboards generate --check   # exit 1 if a committed file differs

The output is deterministic (sorted keys, panel ids and grid positions assigned
in order), so the committed JSON is checked against a fresh build in the tests.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
)
from grafana_foundation_sdk.builders.dashboard import Row as RowBuilder
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    GridPos,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from kvpilot.grafana.panels import DASHBOARDS, DashboardSpec, Panel, Variable

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
PANEL_W, PANEL_H, GRID_W = 8, 8, 24
TAGS = ["kvpilot", "vllm"]


def _variable(var: Variable) -> DatasourceVariable | QueryVariable:
    if not var.query:
        return DatasourceVariable(var.name).label(var.label).type("prometheus")
    return (
        QueryVariable(var.name)
        .label(var.label)
        .datasource(DATASOURCE)
        .query(var.query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(VariableOption(text="All", value="$__all"))
    )


def _panel(panel: Panel, panel_id: int, pos: GridPos) -> Timeseries:
    built = (
        Timeseries()
        .id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .datasource(DATASOURCE)
        .unit(panel.unit)
        .grid_pos(pos)
        .fill_opacity(10)
        .legend(
            VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
        )
    )
    if panel.stacked:
        built = built.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)
    for ref, query in zip(string.ascii_uppercase, panel.queries, strict=False):
        built = built.with_target(Dataquery().ref_id(ref).expr(query.expr).legend_format(query.legend).range())
    return built


def build(spec: DashboardSpec) -> Dashboard:
    """The dashboard builder: rows in order, three panels per grid line."""
    dash = (
        Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(TAGS)
        .editable()
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .link(
            DashboardLink("kvpilot")
            .type(DashboardLinkType.DASHBOARDS)
            .tags(["kvpilot"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for var in spec.variables:
        dash = dash.with_variable(_variable(var))
    panel_id, y = 1, 0
    for row in spec.rows:
        dash = dash.with_row(RowBuilder(row.title).id(panel_id).grid_pos(GridPos(h=1, w=GRID_W, x=0, y=y)))
        panel_id, y = panel_id + 1, y + 1
        for i, panel in enumerate(row.panels):
            x = (i * PANEL_W) % GRID_W
            if i and x == 0:
                y += PANEL_H
            dash = dash.with_panel(_panel(panel, panel_id, GridPos(h=PANEL_H, w=PANEL_W, x=x, y=y)))
            panel_id += 1
        y += PANEL_H
    return dash


def render(spec: DashboardSpec) -> str:
    """The dashboard's JSON text, as committed."""
    return JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False).encode(build(spec).build()) + "\n"


def path_for(spec: DashboardSpec, out_dir: Path = OUT_DIR) -> Path:
    return out_dir / f"{spec.uid}.json"


def generate(check: bool, out_dir: Path = OUT_DIR) -> int:
    """Write every dashboard's JSON under ``out_dir``, or with ``check`` only compare;
    returns the exit code (1: a file differs, named on stderr). ``kvpilot dashboards
    generate`` runs it."""
    stale = []
    for spec in DASHBOARDS:
        path, text = path_for(spec, out_dir), render(spec)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run `kvpilot dashboards generate`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0
