"""Each arm's live goodput on the article's agent, bracketed and bisected (:mod:`benchmarks.fleet.bisect`)::

python -m benchmarks.live_goodput --workers 16 --sessions 16,32,64 --json /tmp/kvpilot-live-goodput-agent-16.json
"""

from __future__ import annotations

import sys

from benchmarks.fleet.bisect import main

if __name__ == "__main__":
    sys.exit(main())
