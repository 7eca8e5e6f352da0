"""The fleet benchmark: kvpilot's router against Dynamo's own on Dynamo mocker fleets (:mod:`benchmarks.fleet.bench`).
``python -m benchmarks.bench_fleet --help`` lists its options; the module's doc says what it measures."""

from __future__ import annotations

import sys

from benchmarks.fleet.bench import main

if __name__ == "__main__":
    sys.exit(main())
