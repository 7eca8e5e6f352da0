"""Which committed results files are older than the code they measure, and re-running them::

    python -m benchmarks.staleness            # list them (what docs/benchmarks/stale.md shows)
    python -m benchmarks.staleness --write    # write docs/benchmarks/stale.md
    python -m benchmarks.staleness --rerun    # re-run each from a clean worktree of HEAD (make bench-stale)

A results file records the commit it ran at (:mod:`benchmarks.provenance`) and its command
(``run.argv``). It is stale when a path its benchmark measures (:data:`MEASURES`, by the
command's script) changed between that commit and ``HEAD``, or when that commit is not in
this clone's history. ``tests/unit/benchmarks/test_staleness.py`` fails when
``docs/benchmarks/stale.md`` does not name exactly the stale files: a change to measured
code names the results it leaves behind, on the page readers see.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks" / "stale.md"
PACKAGE_DIRS = ("deploy", "grafana", "kvconnectors", "policies", "routing")
"""The import package ``kvpilot``'s folders (``pyproject.toml``), linked into a clean worktree."""

_SIMULATED = ("routing/decide", "routing/index", "policies", "benchmarks/sim", "benchmarks/fleet", "benchmarks/agent")
_ENGINES = ("kvconnectors", "routing", "policies", "deploy")
_LIVE_ROUTER = ("routing", "policies", "deploy", "benchmarks/fleet", "benchmarks/agent/trace.py")
MEASURES: dict[str, tuple[str, ...]] = {
    "bench_fleet.py": (*_LIVE_ROUTER, "benchmarks/bench_fleet.py"),
    "live_goodput.py": (*_LIVE_ROUTER, "benchmarks/bench_fleet.py", "benchmarks/live_goodput.py"),
    "bench_agent.py": (*_ENGINES, "benchmarks/agent", "benchmarks/bench_agent.py"),
    "bench_session_hold.py": (*_ENGINES, "benchmarks/bench_session_hold.py"),
    "bench_router_scale.py": ("routing", "policies", "deploy", "benchmarks/scale", "benchmarks/bench_router_scale.py"),
    "bench_request_path.py": ("routing", "policies", "benchmarks/bench_request_path.py"),
    "bench_tokenize.py": ("routing/serve", "benchmarks/bench_tokenize.py"),
    "sim_goodput.py": (*_SIMULATED, "benchmarks/sim_goodput.py"),
    "sim_live.py": (*_SIMULATED, "benchmarks/sim_live.py"),
    "sim_vs_dynamo.py": (*_SIMULATED, "benchmarks/sim_vs_dynamo.py"),
}
"""Per benchmark script, the code its numbers measure: a change there makes them stale."""


@dataclass(frozen=True, slots=True)
class Staleness:
    """One results file's standing against ``HEAD``."""

    stem: str
    commit: str
    script: str
    changed: tuple[str, ...]
    """The measured paths changed since :attr:`commit` (all of them when it is unknown here)."""

    @property
    def stale(self) -> bool:
        return bool(self.changed)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def standing(path: Path) -> Staleness:
    """Whether the results file at ``path`` is older than the code it measures."""
    data = json.loads(path.read_text())
    commit = data["provenance"]["commit"].removesuffix("+dirty")
    script = Path(data["run"]["argv"][0]).name
    if script not in MEASURES:
        raise ValueError(f"{path.name}: no measured paths for {script} (add it to staleness.MEASURES)")
    measured = MEASURES[script]
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return Staleness(path.stem, commit, script, measured)
    diff = _git("diff", "--name-only", commit, "HEAD", "--", *measured)
    if diff.returncode != 0:
        raise RuntimeError(f"git diff failed for {path.name}: {diff.stderr.strip()}")
    changed = sorted({next(m for m in measured if f.startswith(m)) for f in diff.stdout.split()})
    return Staleness(path.stem, commit, script, tuple(changed))


def stale_files() -> list[Staleness]:
    """Every committed results file that is stale, by name."""
    return [s for path in sorted(RESULTS_DIR.glob("*.json")) if (s := standing(path)).stale]


def page(stale: list[Staleness]) -> str:
    """``docs/benchmarks/stale.md``: each stale results file, its commit and what changed."""
    lines = [
        "# Results older than their code",
        "",
        "Each results file below ran at a commit since which code its benchmark measures has",
        "changed (`benchmarks/staleness.py`); the numbers the pages quote from it are what that",
        "commit measured. `make bench-stale` re-runs them from a clean worktree.",
        "",
        "| results file | ran at | measured code changed since |",
        "|---|---|---|",
    ]
    lines += [f"| `{s.stem}.json` | `{s.commit}` | {', '.join(f'`{c}`' for c in s.changed)} |" for s in stale]
    if not stale:
        lines.append("| (none) | | |")
    return "\n".join(lines) + "\n"


def listed() -> set[str]:
    """The results files ``docs/benchmarks/stale.md`` names."""
    if not PAGE.is_file():
        return set()
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    return {row.split("`")[1].removesuffix(".json") for row in rows}


def rerun(stale: list[Staleness]) -> int:
    """Each stale file's recorded command, from a clean worktree of ``HEAD`` (its own code on
    the import path), writing the results file anew; 1 when any could not run."""
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-stale-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"], cwd=ROOT, check=True)
        try:
            shim = Path(scratch) / "shim" / "kvpilot"
            shim.mkdir(parents=True)
            (shim / "__init__.py").touch()
            for name in PACKAGE_DIRS:
                (shim / name).symlink_to(tree / name)
            env = {**os.environ, "PYTHONPATH": str(shim.parent)}
            for s in stale:
                failed += _rerun_one(s, tree, env)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    return 1 if failed else 0


def _rerun_one(s: Staleness, tree: Path, env: dict[str, str]) -> int:
    argv = json.loads((RESULTS_DIR / f"{s.stem}.json").read_text())["run"]["argv"]
    target = RESULTS_DIR / f"{s.stem}.json"
    args = list(argv[1:])
    for flag in ("--json", "--out"):
        if flag in args:
            args[args.index(flag) + 1] = str(target)
    missing = [a for a in args if a.startswith("/tmp/") and not Path(a).exists()]
    if missing:
        print(f"{s.stem}: its command reads {', '.join(missing)}, not here: run its `make bench` line first")
        return 1
    command = [sys.executable, "-m", f"benchmarks.{Path(argv[0]).stem}", *args]
    print(f"{s.stem}: {shlex.join(command)}", flush=True)
    done = subprocess.run(command, cwd=tree, env=env, check=False)
    if done.returncode != 0:
        return 1
    subprocess.run([sys.executable, "-m", "benchmarks.report", str(target)], cwd=ROOT, check=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    action.add_argument("--rerun", action="store_true", help="re-run each stale results file from a clean worktree")
    args = parser.parse_args(argv)
    stale = stale_files()
    if args.rerun:
        return rerun(stale)
    if args.write:
        PAGE.write_text(page(stale))
    for s in stale:
        print(f"{s.stem}: ran at {s.commit}; changed since: {', '.join(s.changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
