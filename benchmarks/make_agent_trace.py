"""Write the reference article's coding agent as a Mooncake trace (:mod:`agent.trace`)::

python benchmarks/make_agent_trace.py --sessions 32 --steps 20 --out /tmp/agent-trace.jsonl
"""

from __future__ import annotations

import sys

from agent.trace import main

if __name__ == "__main__":
    sys.exit(main())
