"""The package as a user installs it: the wheel built from this clone, installed into a fresh
virtual environment, run from a directory outside the clone. Everything it imports lives
under ``kvpilot``; the CLI finds its resources (dashboards, alert rules, recipes, manifests)
inside the installed package. The fresh environment takes kvpilot's dependencies from this
one's site-packages (a path entry, so this one's editable install of kvpilot is not seen)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the wheel, the fresh environment's python, a working directory outside the clone)."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = tmp.glob("kvpilot-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "kvpilot-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    outside = tmp / "elsewhere"
    outside.mkdir()
    return wheel, python, outside


def _run(python: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([*argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_holds_one_top_level_name_and_the_cli_s_resources(installed: tuple[Path, Path, Path]) -> None:
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "kvpilot",
        f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info",
    }
    for resource in (
        "kvpilot/grafana/alerts.yml",
        "kvpilot/grafana/dashboards/kvpilot-router.json",
        "kvpilot/grafana/dashboards/kvpilot-transfers.json",
        "kvpilot/deploy/recipes/router-beside-dynamo.yaml",
        "kvpilot/deploy/k8s/manifests/base.yaml",
    ):
        assert resource in names, resource
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvpilot = kvpilot.deploy.cli:main" in entry_points
    assert "kvpilot = kvpilot.kvconnectors.plugin:register" in entry_points


def test_the_installed_cli_runs_outside_the_clone_and_finds_its_resources(installed: tuple[Path, Path, Path]) -> None:
    _, python, outside = installed
    kvpilot = str(python.parent / "kvpilot")
    assert _run(python, outside, kvpilot, "--help").returncode == 0
    queries = _run(python, outside, kvpilot, "dashboards", "queries")
    assert queries.returncode == 0 and "kvpilot_router_" in queries.stdout, queries.stderr[-2000:]
    render = _run(python, outside, kvpilot, "k8s", "render", "--out", "manifests")
    assert render.returncode == 0, render.stderr[-2000:]
    assert "KVPilotKVEventsStale" in (outside / "manifests" / "base.yaml").read_text()  # the alert rules, inlined
    probe = (
        "import json, importlib.metadata as md, kvpilot.deploy.observe as o, kvpilot.deploy.dashboards as d\n"
        "import kvpilot.routing.config, kvpilot.policies.presets\n"
        "plugins = {e.name: e.value for e in md.entry_points(group='vllm.general_plugins')}\n"
        "print(json.dumps({'rules': str(o.DEFAULT_RULES), 'dashboards': str(d.DASHBOARD_DIR),\n"
        "  'config': kvpilot.routing.config.__file__, 'plugin': plugins.get('kvpilot')}))\n"
    )
    out = _run(python, outside, str(python), "-c", probe)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout)
    prefix = str(python.parent.parent)
    assert all(found[k].startswith(prefix) for k in ("rules", "dashboards", "config")), found  # not the clone's
    assert Path(found["rules"]).is_file() and Path(found["dashboards"]).is_dir()
    assert found["plugin"] == "kvpilot.kvconnectors.plugin:register"
    for name in ("routing", "deploy", "policies", "grafana", "kvconnectors"):  # nothing else in site-packages
        leaked = _run(python, outside, str(python), "-c", f"import {name}; print({name}.__file__)")
        assert leaked.returncode != 0 or not leaked.stdout.startswith(prefix), leaked.stdout
