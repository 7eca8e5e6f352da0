"""The agent benchmark's verdict on tokens (:mod:`benchmarks.agent.correctness`): a greedy token
that differs from the reference's is wrong where the reference led by more than the
noise, a tie where it led by less; logprobs alone decide nothing. And the client's
top-2 margins, which the reference is judged by."""

from __future__ import annotations

import math

import pytest

from benchmarks.agent.correctness import Verdict, judge_output
from kvpilot.deploy.client import Completion, _Parsed

NOISE = 0.03
REFERENCE = Completion(
    "", ("a", "b", "c"), (-0.1, -0.2, -0.3), 0.0, 0.0, token_ids=(1, 2, 3), top2_margins=(0.5, 0.01, 0.5)
)


def answer(ids: tuple[int, ...], logprobs: tuple[float, ...] = (-0.1, -0.2, -0.3)) -> Completion:
    return Completion("", tuple("x" * len(ids)), logprobs, 0.0, 0.0, token_ids=ids)


CASES = [
    ("the same tokens", answer((1, 2, 3)), Verdict.SAME, None, None),
    ("the same tokens, logprobs 0.4 off", answer((1, 2, 3), (-0.5, -0.2, -0.3)), Verdict.SAME, None, None),
    ("a flip where the reference led by 0.5", answer((9, 2, 3)), Verdict.WRONG, 0, 0.5),
    ("a flip where the reference led by 0.01", answer((1, 9, 3)), Verdict.TIE, 1, 0.01),
    ("a tie first: what follows it is not compared", answer((1, 9, 9)), Verdict.TIE, 1, 0.01),
    ("a flip beyond the noise after the same tokens", answer((1, 2, 9)), Verdict.WRONG, 2, 0.5),
    ("fewer tokens", answer((1, 2), (-0.1, -0.2)), Verdict.WRONG, 0, None),
]


@pytest.mark.parametrize(("out", "verdict", "first", "margin"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_verdict_is_decided_by_the_reference_s_margin_at_the_first_flip(
    out: Completion, verdict: Verdict, first: int | None, margin: float | None
) -> None:
    judged = judge_output(out, REFERENCE, NOISE)
    assert (judged.verdict, judged.first_mismatch, judged.margin) == (verdict, first, margin)


def test_a_margin_equal_to_the_noise_is_a_tie_and_above_it_wrong() -> None:
    flip = answer((9, 2, 3))
    assert judge_output(flip, REFERENCE, 0.5).verdict is Verdict.TIE
    assert judge_output(flip, REFERENCE, 0.4999).verdict is Verdict.WRONG


@pytest.mark.parametrize("noise", [math.nan, math.inf, -0.01])
def test_a_noise_that_is_no_logprob_difference_is_refused(noise: float) -> None:
    with pytest.raises(ValueError, match="noise must be"):
        judge_output(answer((1, 2, 3)), REFERENCE, noise)


def test_a_reference_without_top2_margins_is_refused() -> None:
    with pytest.raises(ValueError, match="top_logprobs=2"):
        judge_output(answer((1, 2, 3)), answer((1, 2, 3)), NOISE)


def _chat_token(token: str, logprob: float, *alternatives: float) -> dict:
    tops = [{"token": token, "logprob": logprob}] + [{"token": "?", "logprob": lp} for lp in alternatives]
    return {"token": token, "logprob": logprob, "top_logprobs": tops}


def test_a_chat_s_top2_margins_are_each_token_s_lead_over_the_runner_up() -> None:
    parsed = _Parsed({})
    content = [_chat_token("a", -0.1, -0.6), _chat_token("b", -1.0, -1.0)]
    parsed.add({"choices": [{"message": {"content": "ab"}, "logprobs": {"content": content}}]}, 0.1)
    assert parsed.completion(0.2).top2_margins == pytest.approx((0.5, 0.0))


def test_a_completion_s_top2_margins_come_from_its_top_logprobs() -> None:
    parsed = _Parsed({})
    lp = {"tokens": [" a"], "token_logprobs": [-0.5], "top_logprobs": [{" b": -1.25, " a": -0.5}]}
    parsed.add({"choices": [{"text": " a", "logprobs": lp}]}, 0.1)
    assert parsed.completion(0.2).top2_margins == pytest.approx((0.75,))


def test_without_two_top_logprobs_per_token_there_are_no_margins() -> None:
    parsed = _Parsed({})
    content = [_chat_token("a", -0.1, -0.6), _chat_token("b", -1.0)]  # top_logprobs=1 for the second chunk
    parsed.add({"choices": [{"message": {"content": "ab"}, "logprobs": {"content": content}}]}, 0.1)
    assert parsed.completion(0.2).top2_margins == ()
