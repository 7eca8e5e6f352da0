"""The simulator's prediction of a live fleet run against what it measured (:mod:`sim.live`)::

python benchmarks/sim_live.py /tmp/kvpilot-bench-fleet-agent.json
"""

from __future__ import annotations

import sys

from sim.live import main

if __name__ == "__main__":
    sys.exit(main())
