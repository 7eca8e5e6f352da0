"""Write the reference article's coding agent as a Mooncake trace (:mod:`benchmarks.agent.trace`)::

python -m benchmarks.make_agent_trace --sessions 32 --steps 20 --out /tmp/agent-trace.jsonl
"""

from __future__ import annotations

import sys

from benchmarks.agent.trace import main

if __name__ == "__main__":
    sys.exit(main())
