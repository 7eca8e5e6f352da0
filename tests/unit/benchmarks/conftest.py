"""The benchmarks' pure modules, importable as the benchmark scripts import them: by
their bare names from ``benchmarks/`` (``import fleet_trace``), a folder of scripts and
not a package."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
