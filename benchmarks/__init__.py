"""kvpilot's benchmarks: one package per workload (``agent/``, ``fleet/``, ``scale/``,
``sim/``) beside the entry points (``bench_*.py``, ``sim_*.py``, ``live_goodput.py``...),
each run from the repository's root as a module (``python -m benchmarks.bench_fleet --help``)
and imported as ``benchmarks.*`` (the tests import them so, from the root). Not part of the
installed ``kvpilot`` package."""
