"""The simulator's prediction of a live fleet run against what it measured (:mod:`benchmarks.sim.live`)::

python -m benchmarks.sim_live /tmp/kvpilot-bench-fleet-agent.json
"""

from __future__ import annotations

import sys

from benchmarks.sim.live import main

if __name__ == "__main__":
    sys.exit(main())
