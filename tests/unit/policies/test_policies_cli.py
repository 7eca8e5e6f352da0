"""``kvpilot cost`` / ``kvpilot plan`` and the package's purity rules."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.policies import cli
from kvpilot.policies.presets import HF_CONFIGS

PACKAGE = Path(cli.__file__).parent


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cost_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "cost", "--model", "llama-70b", "--hardware", "b200x2", "--new", "150", "--context", "62000"
    )
    assert code == 0
    for text in (
        "327,680 B (320 KiB)",
        "49.2 MB",
        "prefill (recompute)  16.88 ms",
        "transfer             1.25 ms",
        "decision             transfer:",
    ):
        assert text in out


@pytest.mark.parametrize(
    ("argv", "decision"),
    [
        (["--new", "8000", "--context", "40000"], "transfer"),
        (["--new", "20", "--context", "1000", "--link", "tcp", "--p-running", "100"], "recompute"),
        (
            [
                "--new",
                "150",
                "--context",
                "62000",
                "--kv-format",
                "nvfp4",
                "--model",
                "deepseek-v3",
                "--hardware",
                "b200x8",
            ],
            "transfer",
        ),
    ],
)
def test_cost_json(capsys: pytest.CaptureFixture[str], argv: list[str], decision: str) -> None:
    code, out, _ = _run(capsys, "cost", *argv, "--json")
    data = json.loads(out)
    assert code == 0
    assert data["decision"] == decision
    assert set(data) >= {"kv_bytes_per_token", "prefill_s", "transfer_s", "recompute_s", "reason"}


def test_cost_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "cost", "--scenarios")
    assert code == 0
    assert out.count("\n| ") == 24  # 24 rows after the header line
    assert "slower in 0" in out


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["cost", "--model", "gpt-9"], "model"),
        (["cost", "--hardware", "tpu"], "hardware"),
        (["cost", "--link", "wifi"], "link"),
        (["cost", "--new", "-1"], "new"),
        (["plan", "--sessions", "0"], "sessions"),
        (["plan", "--hardware", "h100"], "leave no KV room"),
    ],
)
def test_errors_exit_2_and_name_the_field(capsys: pytest.CaptureFixture[str], argv: list[str], field: str) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert err.startswith("kvpilot: error: ") and field in err


def test_specs_from_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIGS["llama-70b"]))
    hw = tmp_path / "hw.yaml"
    hw.write_text("preset: b200x2\ncompute_efficiency: 0.3\n")
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"name": "slow", "kind": "tcp", "lanes": 1, "lane_gbps": 10}))
    code, out, _ = _run(
        capsys,
        "cost",
        "--model",
        str(model_dir),
        "--hardware",
        str(hw),
        "--link",
        str(link),
        "--new",
        "150",
        "--context",
        "62000",
        "--json",
    )
    data = json.loads(out)
    assert code == 0
    assert data["prefill_s"] == pytest.approx(2 * 0.01688, rel=0.01)  # half the efficiency, twice the time
    assert data["decision"] == "recompute"  # 49 MB over 1.25 GB/s is slower
    bad = tmp_path / "bad.yaml"
    bad.write_text("preset: b200x2\ncompute_effciency: 0.3\n")
    code, _, err = _run(capsys, "cost", "--hardware", str(bad))
    assert code == 2 and "compute_effciency" in err


def test_plan_table_json_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _run(capsys, "plan")
    assert code == 0 and "4. Deduplication fixes capacity" in out
    code, out, _ = _run(capsys, "plan", "--json", "--sessions", "30")
    assert code == 0 and json.loads(out)["workload"]["sessions"] == 30
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code, _, _ = _run(capsys, "plan", "--plot", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_add_subcommands_plugs_into_a_host_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvpilot")
    cli.add_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cost", "--new", "10", "--context", "10", "--json"])
    assert args.func is cli.run_cost
    assert parser.parse_args(["plan"]).func is cli.run_plan


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.policies.cli", "plan", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent,
        timeout=60,
    )
    assert json.loads(result.stdout)["rows"][0]["key"] == "none"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_module_is_pure_and_small(path: Path) -> None:
    """No vLLM, no sibling packages, no clock, randomness or I/O (cli.py aside)."""
    imports = _imports(path)
    assert not imports & {"vllm", "kvconnectors", "routing", "time", "datetime", "random", "socket"}
    if path.name != "cli.py":
        assert not imports & {"pathlib", "os", "io", "matplotlib", "sys"}
        assert "open(" not in path.read_text()
    assert len(path.read_text().splitlines()) < 450


def test_docs_show_the_current_scenario_table_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    doc = (PACKAGE.parent / "docs" / "concepts" / "policies.md").read_text()
    for argv in (["cost", "--scenarios"], ["plan"]):
        _, out, _ = _run(capsys, *argv)
        assert out.strip() in doc, argv
