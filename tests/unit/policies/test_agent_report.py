"""The agent benchmark's arms on the roofline, in the article's setting (70B, H100 pools)."""

from __future__ import annotations

import pytest

from policies.agent_report import ARMS, predict, render
from policies.cli import main
from policies.disaggregation import KVPILOT_DEFAULT, DecodeState, LocalVsRemotePolicy
from policies.planner import Workload
from policies.presets import hardware_preset, kv_format_preset, link_preset, model_preset


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
