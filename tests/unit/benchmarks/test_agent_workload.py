"""The agent benchmark's workload as a chat client sends it: deterministic messages, the
model's text resent as reasoning before each tool call, and the three edits."""

from __future__ import annotations

from benchmarks.agent import workload as aw


def _run(spec: aw.WorkloadSpec) -> aw.Workload:
    workload = aw.build(spec)
    for step in range(1, spec.steps + 1):
        for s in range(spec.sessions):
            workload.prompt(s, step)
            workload.advance(s, step, f"generated text of session {s} at step {step}, long enough to re-render")
    return workload


def test_the_same_seed_gives_the_same_messages() -> None:
    spec = aw.WorkloadSpec(sessions=2, steps=3, editing_sessions=0)
    assert _run(spec).histories == _run(spec).histories


def test_each_step_answers_the_last_call_with_a_tool_message() -> None:
    workload = aw.build(aw.WorkloadSpec(sessions=1, steps=3, editing_sessions=0))
    first = workload.prompt(0, 1)
    assert [m["role"] for m in first] == ["system", "user"]
    workload.advance(0, 1, "thinking")
    second = workload.prompt(0, 2)
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    call = second[2]["tool_calls"][0]
    assert second[2]["reasoning"] == "thinking" and second[2]["content"] is None
    assert second[3]["tool_call_id"] == call["id"] and call["function"]["name"] == aw.TOOLS[0]["function"]["name"]


def test_the_edits_change_what_the_next_step_resends() -> None:
    spec = aw.WorkloadSpec(sessions=2, steps=8, editing_sessions=1, edit_steps=(3, 4, 6))
    edited, plain = _run(spec).histories[1], _run(spec).histories[0]
    assert spec.edit_plan == {3: "strip", 4: "rerender", 6: "truncate"}
    turns = [m for m in edited if m["role"] == "assistant"]
    assert len(turns) == len([m for m in plain if m["role"] == "assistant"]) - 2  # truncate: two steps gone
    stripped = next(m for m in turns if m["tool_calls"][0]["id"] == "call-1-3")
    assert "reasoning" not in stripped
    rerendered = next(m for m in turns if m["tool_calls"][0]["id"] == "call-1-4")
    assert rerendered["reasoning"] != "generated text of session 1 at step 4, long enough to re-render"
    assert len(rerendered["reasoning"]) == len("generated text of session 1 at step 4, long enough to re-render")
    assert not any(m.get("tool_call_id") in ("call-1-1", "call-1-2") for m in edited)  # the oldest steps' results
