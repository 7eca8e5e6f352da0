"""Where and when a benchmark ran: written into every results file, and printed, so a number
quoted anywhere can be traced to its run; and the command that ran it (``run.argv``). Not
pure: it runs ``git`` and ``nvidia-smi`` and reads ``/proc/cpuinfo`` and the clock; it
touches no network and writes nothing."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("avx2", "avx512f", "amx_tile")
"""The instruction sets the engines' kernels pick between (vLLM-CPU: AVX2, AVX-512, AMX)."""


def _commit() -> str:
    """The clone's commit, ``+dirty`` when the tree has uncommitted changes; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": cores, "flags": [f for f in CPU_FLAGS if f in flags]}


def provenance() -> dict[str, Any]:
    """``{"date", "commit", "hardware": {"cpu": {...}, "memory_gib", "gpu"}, "python"}``."""
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpu = None
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        gpu = smi.stdout.strip() or None if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        gpu = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "hardware": {
            "cpu": _cpu(),
            "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1) if pages else None,
            "gpu": gpu,
        },
        "python": platform.python_version(),
    }


def describe(run: dict[str, Any]) -> str:
    """One line for a report's head: date, commit, CPU (cores, instruction sets), GPU."""
    cpu = run["hardware"]["cpu"]
    return (
        f"{run['date']}, commit {run['commit']}, {cpu['model']} ({cpu['cores']} cores; "
        f"{', '.join(cpu['flags']) or 'no AVX2'}), GPU: {run['hardware']['gpu'] or 'none'}"
    )


def recorded_argv() -> list[str]:
    """This run's command line as a results file records it (``run.argv``): the entry
    script's path from the repository's root (``benchmarks/sim_goodput.py``; run as
    ``python -m benchmarks.sim_goodput``, Python names it by its absolute path), then its
    arguments as given."""
    script = Path(sys.argv[0]).resolve()
    return [str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]]


def command(argv: Sequence[str], python: str = "python") -> str:
    """The shell command that runs a recorded ``run.argv`` again from the repository's root:
    ``python -m benchmarks.<script> ARGS`` (every entry script sits in ``benchmarks/``)."""
    return shlex.join([python, "-m", f"benchmarks.{Path(argv[0]).stem}", *argv[1:]])
