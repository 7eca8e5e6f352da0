"""The benchmark tables the docs quote are rendered from committed results files."""

from __future__ import annotations

import json

import pytest

from benchmarks.report import RESULTS_DIR, render, table_for

RESULTS = sorted(RESULTS_DIR.glob("*.json"))


def test_there_are_results_to_quote() -> None:
    assert RESULTS, f"no results file in {RESULTS_DIR}"


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_each_committed_table_is_what_its_results_file_renders(path) -> None:
    results = json.loads(path.read_text())
    assert {"date", "commit", "hardware"} <= set(results["provenance"])  # where and when it ran
    assert table_for(path).read_text() == render(results), f"run: python -m benchmarks.report {path}"
