"""A results file older than the code it measures is named where readers see it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.staleness import MEASURES, PAGE, RESULTS_DIR, ROOT, listed, page, stale_files, standing


def test_the_stale_page_names_exactly_the_results_older_than_their_code() -> None:
    stale = stale_files()
    named = listed()
    assert named == {s.stem for s in stale}, (
        f"{PAGE.relative_to(ROOT)} is out of date (run `python -m benchmarks.staleness --write`): "
        f"stale but not named {sorted({s.stem for s in stale} - named)}, "
        f"named but not stale {sorted(named - {s.stem for s in stale})}"
    )


def test_every_results_file_s_benchmark_names_the_code_it_measures() -> None:
    for path in sorted(RESULTS_DIR.glob("*.json")):
        script = Path(json.loads(path.read_text())["run"]["argv"][0]).name
        assert script in MEASURES, f"{path.name}: {script} is not in staleness.MEASURES"
        for measured in MEASURES[script]:
            assert (ROOT / measured).exists(), f"{script} measures {measured}, which does not exist"


def _results(tmp_path: Path, commit: str, script: str = "benchmarks/sim_goodput.py") -> Path:
    path = tmp_path / "made-up.json"
    path.write_text(json.dumps({"provenance": {"commit": commit}, "run": {"argv": [script]}}))
    return path


def test_a_run_at_head_is_fresh_and_one_at_an_unknown_commit_stale(tmp_path: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert not standing(_results(tmp_path, head.stdout.strip())).stale
    unknown = standing(_results(tmp_path, "0123456789ab"))
    assert unknown.stale and unknown.changed == MEASURES["sim_goodput.py"]
    assert "`made-up.json` | `0123456789ab`" in page([unknown])
