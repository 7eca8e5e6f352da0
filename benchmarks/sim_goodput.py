"""Goodput in virtual time, kvpilot's router against Dynamo's replay (:mod:`benchmarks.sim.goodput`)::

python -m benchmarks.sim_goodput --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --workers 64
"""

from __future__ import annotations

import sys

from benchmarks.sim.goodput import main

if __name__ == "__main__":
    sys.exit(main())
