"""Whether an arm's output is right, decided on its tokens. Pure.

An output is compared with the reference (the same prompt on one engine without cache)
token by token. Where every greedy token is the reference's, it is right, whatever its
logprobs. At the first token that differs (after it the two contexts differ, and
nothing more can be compared) the reference's own top-2 margin decides: the lead of its
chosen token over the runner-up. Bf16 arithmetic on another prefill split moves a
logprob by up to the noise measured on a known-correct path (the calibration's largest
logprob difference), so a greedy choice whose lead is within that noise can flip on a
correct path: a **tie**, counted apart. A choice that led by more than the noise and
still flipped was computed on something other than the reference's inputs: **wrong**.

    >>> ref = Completion("", ("a", "b"), (-0.1, -0.2), 0.0, 0.0, token_ids=(1, 2), top2_margins=(0.5, 0.01))
    >>> def out(ids):
    ...     return Completion("", ("a", "c"), (-0.1, -0.2), 0.0, 0.0, token_ids=ids)
    >>> judge_output(out((1, 3)), ref, noise=0.03).verdict   # led by 0.01: a tie
    <Verdict.TIE: 'tie'>
    >>> judge_output(out((3, 2)), ref, noise=0.03).verdict   # led by 0.5: wrong
    <Verdict.WRONG: 'wrong'>
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

from kvpilot.deploy.client import Completion


class Verdict(str, enum.Enum):
    """An output against the reference."""

    SAME = "same"
    """Every greedy token is the reference's."""
    TIE = "tie"
    """The first differing token is where the reference's top-2 margin is within the noise."""
    WRONG = "wrong"
    """The first differing token is where that margin exceeds the noise, or the lengths differ."""


class Judgement(NamedTuple):
    verdict: Verdict
    first_mismatch: int | None
    """Index of the first generated token that differs from the reference (None: all equal;
    0 when the lengths differ)."""
    max_diff: float
    """Max |logprob diff| over the tokens up to and including the first that differs
    (:meth:`~kvpilot.deploy.client.Completion.divergence`; inf when the lengths differ)."""
    margin: float | None
    """The reference's top-2 margin at ``first_mismatch`` (None where nothing differs or the
    lengths differ)."""


def judge_output(out: Completion, reference: Completion, noise: float) -> Judgement:
    """``out`` against ``reference`` with the logprob noise ``noise`` of a known-correct path.
    Raises ValueError for a ``noise`` that is not a finite number >= 0, or a reference without
    a top-2 margin per token (ask it with ``top_logprobs=2``)."""
    if not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite logprob difference >= 0, got {noise}")
    if len(reference.top2_margins) != len(reference.tokens):
        raise ValueError(
            f"the reference has {len(reference.top2_margins)} top-2 margins for {len(reference.tokens)} tokens: "
            "ask it with top_logprobs=2"
        )
    first, max_diff = out.divergence(reference)
    if first is None:
        return Judgement(Verdict.SAME, None, max_diff, None)
    if math.isinf(max_diff):  # divergence's answer for answers of different lengths
        return Judgement(Verdict.WRONG, first, max_diff, None)
    margin = reference.top2_margins[first]
    return Judgement(Verdict.WRONG if margin > noise else Verdict.TIE, first, max_diff, margin)


__all__ = ["Judgement", "Verdict", "judge_output"]
