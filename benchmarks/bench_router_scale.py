"""The scale benchmark: decision time, sustained rate and index memory against Dynamo's KV router
(:mod:`benchmarks.scale.bench`).
``python -m benchmarks.bench_router_scale --help`` lists its options; the module's doc says what it measures."""

from __future__ import annotations

import sys

from benchmarks.scale.bench import main

if __name__ == "__main__":
    sys.exit(main())
