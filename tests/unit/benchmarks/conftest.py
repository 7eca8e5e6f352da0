"""The benchmarks' pure modules, importable as the benchmark scripts import them: by
workload package from ``benchmarks/`` (``from fleet.trace import ...``), a folder of
entry-point scripts (``bench_*.py``) beside one package per workload."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
