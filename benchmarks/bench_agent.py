"""The agent benchmark: five ways to serve the article's coding agent across P and D pools
(:mod:`benchmarks.agent.bench`).
``python -m benchmarks.bench_agent --help`` lists its options; the module's doc says what it measures."""

from __future__ import annotations

from benchmarks.agent.bench import main

if __name__ == "__main__":
    main()
