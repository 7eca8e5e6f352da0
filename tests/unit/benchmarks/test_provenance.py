"""Every results file says where and when it ran."""

from __future__ import annotations

import json

from provenance import describe, provenance


def test_a_run_records_its_date_commit_and_hardware() -> None:
    run = provenance()
    assert run["date"].startswith("20") and run["commit"] != ""
    cpu = run["hardware"]["cpu"]
    assert cpu["cores"] >= 1 and set(cpu["flags"]) <= {"avx2", "avx512f", "amx_tile"}
    json.dumps(run)  # a results file holds it as it is
    line = describe(run)
    assert run["date"] in line and run["commit"] in line and f"{cpu['cores']} cores" in line
