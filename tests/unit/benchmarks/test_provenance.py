"""Every results file says where and when it ran."""

from __future__ import annotations

import json

from benchmarks.provenance import describe, provenance


def test_a_run_records_its_date_commit_and_hardware() -> None:
    run = provenance()
    assert run["date"].startswith("20") and run["commit"] != ""
    cpu = run["hardware"]["cpu"]
    assert cpu["cores"] >= 1 and set(cpu["flags"]) <= {"avx2", "avx512f", "amx_tile"}
    json.dumps(run)  # a results file holds it as it is
    line = describe(run)
    assert run["date"] in line and run["commit"] in line and f"{cpu['cores']} cores" in line


def test_every_committed_results_file_comes_from_a_clean_tree() -> None:
    """A number on a page is rendered from a committed results file (issue 41 item 6): each
    names the commit it ran at, never one with uncommitted changes (``+dirty``)."""
    from benchmarks.report import RESULTS_DIR

    dirty = {
        path.name: commit
        for path in sorted(RESULTS_DIR.glob("*.json"))
        if "dirty" in (commit := json.loads(path.read_text())["provenance"]["commit"])
    }
    assert not dirty, dirty
