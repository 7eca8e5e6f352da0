"""The agent benchmark's arms on the roofline, in the article's setting (70B, H100 pools)."""

from __future__ import annotations

import json

import pytest

from kvpilot.policies.agent_report import ARMS, predict, render
from kvpilot.policies.cli import main
from kvpilot.policies.disaggregation import KVPILOT_DEFAULT, DecodeState, LocalVsRemotePolicy
from kvpilot.policies.planner import Workload
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset


def _arms(link: str, streams: int = 0) -> dict:
    hw = hardware_preset("h100x2")
    policy = LocalVsRemotePolicy(
        model_preset("llama-70b"), kv_format_preset("bf16"), hw, hw, link_preset(link), KVPILOT_DEFAULT
    )
    return {p.arm: p for p in predict(policy, Workload(), DecodeState(0.0, streams))}


def test_session_reuse_prefills_about_ten_times_less_than_prefix_only_caching() -> None:
    arms = _arms("rdma")
    tokens = {arm: sum(p.prefill_tokens) for arm, p in arms.items()}
    assert 9 <= tokens["prefix_only"] / tokens["kvpilot"] <= 12  # the article: about 10x
    assert tokens["no_cache"] / tokens["kvpilot"] > 24  # the article's 24x counts instance-seconds
    # Pulling the whole session every step moves the most KV, growing with the session.
    assert sum(arms["vllm_pull"].moved_tokens) > 5 * sum(arms["kvpilot"].moved_tokens)
    assert arms["vllm_pull"].moved_tokens[19] > arms["vllm_pull"].moved_tokens[9]
    assert arms["kvpilot"].ttft_at(20) < arms["prefix_only"].ttft_at(20) / 10


@pytest.mark.parametrize(("streams", "options"), [(0, {"local"}), (64, {"pull", "affinity"})])
def test_kvpilot_prefills_on_an_idle_d_and_sends_a_busy_ds_steps_to_p(streams: int, options: set) -> None:
    later = set(_arms("rdma", streams)["kvpilot"].options[1:])
    assert later <= options and later


def test_the_cli_prints_one_table_per_link_and_d_state(capsys) -> None:
    assert main(["agent", "--link", "rdma", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("| (e) kvpilot |") == 2 and "D running 64 streams" in out
    assert render(
        predict(
            LocalVsRemotePolicy(
                model_preset("llama-8b"),
                kv_format_preset("bf16"),
                hardware_preset("h100"),
                hardware_preset("h100"),
                link_preset("tcp"),
            ),
            Workload(steps=3),
        ),
        "t",
    ).count("\n| (") == len(ARMS)


def test_measured_ratios_sit_beside_the_predicted_ones(tmp_path, capsys) -> None:
    run = {
        "config": {"prefix_tokens": 1000, "tool_tokens": 100, "generated": 32, "steps": 5},
        "summaries": {
            "a": {"prefill_computed": 900.0},
            "b": {"prefill_computed": 300.0},
            "e": {"prefill_computed": 100.0},
        },
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(run))
    assert main(["agent", "--link", "rdma", "--measured", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| (a) no prefix cache | " in out and " | 9.0 |" in out and " | 3.0 |" in out
    assert "| (c) vLLM proxy, pull every step | 1.0 | - |" in out  # not measured: shown as such
    path.write_text("{}")
    assert main(["agent", "--measured", str(path)]) == 2
