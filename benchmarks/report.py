"""The Markdown a docs page quotes of a benchmark, rendered from the benchmark's results file,
never typed by hand::

    python -m benchmarks.report docs/benchmarks/results/scale.json   # writes docs/benchmarks/tables/scale.md
    python -m benchmarks.report docs/benchmarks/results/sim-goodput-agent-*.json \
        --plot docs/benchmarks/img/sim-goodput-agent.png

A results file is what ``bench_fleet.py --json`` or ``bench_router_scale.py --json`` wrote
(with its :mod:`benchmarks.provenance`). The table's head names the run: date, commit, hardware, command.
``tests/unit/benchmarks/test_report.py`` fails when a committed table differs from what its
committed results file renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.provenance import command, describe

RESULTS_DIR = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results"
TABLES_DIR = RESULTS_DIR.parent / "tables"
RUN_KEYS = ("run", "provenance")
"""A fleet results file's keys that are not arms."""


def _head(results: dict[str, Any]) -> list[str]:
    run = f"Run: {describe(results['provenance'])}."
    return [run, "", f"Command: `{command(results['run']['argv'])}`", ""]


def render(results: dict[str, Any]) -> str:
    """The tables of a results file of ``bench_router_scale.py``, ``bench_fleet.py``,
    ``bench_tokenize.py``, ``bench_request_path.py``, ``bench_agent.py``, ``sim_vs_dynamo.py``,
    ``sim_goodput.py``, ``sim_live.py``, ``live_goodput.py`` or ``bench_session_hold.py``."""
    if "summaries" in results:
        from benchmarks.agent.output import results_table

        body = results_table(results)
    elif "request_path" in results:
        from benchmarks.bench_request_path import table as request_path_table

        body = request_path_table(results)
    elif "tokenize" in results:
        from benchmarks.bench_tokenize import table as tokenize_table

        body = tokenize_table(results["tokenize"])
    elif "live_goodput" in results:
        from benchmarks.fleet.bisect import table as live_goodput_table

        body = live_goodput_table(results)
    elif "runs" in results:
        from benchmarks.sim.live import tables as live_tables

        body = live_tables(results)
    elif "goodput_rps" in results:
        from benchmarks.sim.goodput import table as goodput_table

        body = goodput_table(results)
    elif "rows" in results:
        from benchmarks.sim.compare import table as sim_table

        body = sim_table(results["rows"])
    elif "holds" in results:
        from benchmarks.bench_session_hold import table as holds_table

        body = holds_table(results)
    elif "fleets" in results:
        from benchmarks.scale.bench import tables

        body = tables(results["fleets"], results["index_memory"], results["run"].get("limit_ms", 5.0))
    else:
        from benchmarks.fleet.bench import table
        from benchmarks.fleet.stages import stage_table

        arms = {k: v for k, v in results.items() if k not in RUN_KEYS}
        body = table(arms, results["run"]["workload"]["reuse_ceiling"])
        stages = stage_table(results)
        body += f"\n\n{stages}" if stages else ""
    return "\n".join([*_head(results), body]) + "\n"


def table_for(results_path: Path) -> Path:
    """Where the table of ``results_path`` lives (``tables/<its stem>.md``)."""
    return TABLES_DIR / f"{results_path.stem}.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="results files (JSON)")
    parser.add_argument(
        "--plot", type=Path, help="also draw the given sim_goodput.py results side by side (PNG), in the order given"
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        from benchmarks.sim.goodput import plot

        plot([json.loads(path.read_text()) for path in args.results], args.plot)
        print(f"wrote {args.plot}")
    for path in args.results:
        out = table_for(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(json.loads(path.read_text())))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
