"""The virtual-time simulator's engines against Dynamo's offline replay (:mod:`benchmarks.sim.compare`)::

    python -m benchmarks.sim_vs_dynamo --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
        --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --workers 16,64
"""

from __future__ import annotations

import sys

from benchmarks.sim.compare import main

if __name__ == "__main__":
    sys.exit(main())
