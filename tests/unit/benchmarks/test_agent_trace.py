"""The article's agent as a Mooncake trace: shared prefix blocks, sessions' own blocks, arrivals."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.agent.trace import AgentShape, agent_trace, hash_ids, main, to_jsonl
from benchmarks.fleet.trace import TRACE_BLOCK_TOKENS, PromptShape, PromptSynth, load_trace, reuse_ceiling

SMALL = AgentShape(sessions=3, steps=4, shared_prefix=1_300, task=100, call=150, tool_output=600, seed=5)


def test_step_prompts_grow_by_one_call_and_one_tool_output() -> None:
    assert AgentShape().prompt_tokens(0) == 32_100
    assert AgentShape().prompt_tokens(19) == 32_100 + 19 * 1_650  # about 63,000: the article's step 20


def test_sessions_share_the_prefix_s_whole_blocks_and_nothing_else() -> None:
    ids = [hash_ids(SMALL, s, SMALL.prompt_tokens(3)) for s in range(3)]
    shared = SMALL.shared_prefix // TRACE_BLOCK_TOKENS  # 2 whole blocks; the third mixes prefix and task
    assert all(i[:shared] == (0, 1) for i in ids)
    own = [set(i[shared:]) for i in ids]
    assert not (own[0] & own[1]) and not (own[1] & own[2]) and not (own[0] & own[2])
    assert min(min(o) for o in own) >= shared


def test_each_step_extends_the_last_one_partial_block_included() -> None:
    requests = [r for r in agent_trace(SMALL) if r.hash_ids[2] == hash_ids(SMALL, 1, 2_000)[2]]
    assert [r.input_length for r in requests] == [SMALL.prompt_tokens(k) for k in range(4)]
    for before, after in itertools.pairwise(requests):
        assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
    # the partial last block's tokens are a prefix of the same block once full
    synth = PromptSynth(PromptShape(block_size=32))
    first, second = synth.prompt(requests[0]), synth.prompt(requests[1])
    assert second[: len(first)] == first


def test_every_step_names_its_session_and_the_session_holds_its_own_blocks() -> None:
    by_session: dict[str, list[int]] = {}
    for request in agent_trace(SMALL):
        assert request.session_id is not None
        by_session.setdefault(request.session_id, []).append(request.input_length)
    assert sorted(by_session) == ["agent-0", "agent-1", "agent-2"]
    assert all(lengths == [SMALL.prompt_tokens(k) for k in range(4)] for lengths in by_session.values())
    own = {r.session_id: r.hash_ids[3] for r in agent_trace(SMALL) if len(r.hash_ids) > 3}
    assert own["agent-1"] == hash_ids(SMALL, 1, SMALL.prompt_tokens(3))[3]


def test_arrivals_are_sorted_and_steps_follow_by_the_step_gap() -> None:
    requests = agent_trace(SMALL)
    assert len(requests) == 12
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times) and times[0] == 0
    session_one = [r.timestamp_ms for r in requests if r.hash_ids[2] == hash_ids(SMALL, 1, 2_000)[2]]
    assert [b - a for a, b in itertools.pairwise(session_one)] == [2_000] * 3
    assert agent_trace(SMALL) == requests  # seeded


def test_the_ceiling_reuses_the_prefix_across_sessions_and_each_history_within_one() -> None:
    ceiling = reuse_ceiling(PromptShape(block_size=32), agent_trace(SMALL))
    # what only the first prompt of each session computes, plus each step's new tokens
    assert 0.5 < ceiling.reuse < 1.0


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"sessions": 0}, "must be positive"), ({"tool_output": 0}, "must be positive"), ({"step_gap_s": -1.0}, "gaps")],
)
def test_bad_shapes_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentShape(**kw)


def test_the_command_writes_a_trace_the_fleet_benchmark_loads(tmp_path) -> None:
    out = tmp_path / "agent.jsonl"
    assert (
        main(
            [
                "--sessions",
                "3",
                "--steps",
                "4",
                "--shared-prefix",
                "1300",
                "--tool-output",
                "600",
                "--seed",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert load_trace(out) == agent_trace(SMALL)
    assert out.read_text() == to_jsonl(agent_trace(SMALL))


def test_a_human_turn_s_first_step_waits_the_human_gap_the_rest_the_tool_s() -> None:
    """With a human turn every 4 steps, steps 4 and 8 of a session follow their previous step
    by a seeded exponential gap of mean 30 s; every other step by the tool's 2 s. Without
    human turns the trace is the one it always was."""
    shape = AgentShape(sessions=64, steps=12, steps_per_turn=4, human_gap_s=30.0)
    requests = agent_trace(shape)
    gaps: list[float] = []
    for session in {r.session_id for r in requests}:
        times = [r.timestamp_ms for r in requests if r.session_id == session]
        for step in range(1, len(times)):
            gap = times[step] - times[step - 1]
            if step % 4:
                assert gap == 2000, (session, step, gap)
            else:
                gaps.append(gap / 1e3)
    assert len(gaps) == 64 * 2 and 20 < sum(gaps) / len(gaps) < 40
    assert agent_trace(AgentShape(sessions=8)) == agent_trace(AgentShape(sessions=8, human_gap_s=30.0))
