"""A session's next step across pools: the five options, priced. Pure.

After step ``k`` the newest KV of a session lives on the decode worker D that
generated it; step ``k+1`` arrives at the router, which can serve it five ways
(article section 9.2):

1. ``reprefill``: the cost model's P prefills what its own cache lacks (D's
   generated tokens at least), then hands D the KV D lacks;
2. ``pull``: that P first pulls the session's KV from the D holding it (D's
   end-of-turn offer, vLLM's bidirectional protocol), prefills only the rest,
   then D pulls the new blocks back;
3. ``affinity``: the P and the D of the last step again, each reusing its own
   prefix cache (the connector loads only beyond D's local hit);
4. ``shared_tier``: restore from a shared tier, then prefill the rest (priced
   only when the index knows a shared tier holding the prompt);
5. ``local``: D prefills the increment itself (conditional disaggregation,
   with the local-vs-remote policy's guards: thresholds, decode-busy, stall).

Each option gets an expected time to first token from the roofline (P's
queue, the prefill P or D would run, the bytes each transfer moves over the
configured link) or is unavailable with the reason. :func:`choose` takes a
forced option when it is available, else the cheapest; ties go to the option
that moves the least data (``local``, ``affinity``, ``reprefill``, ``shared_tier``,
``pull``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvpilot.policies.disaggregation import (
    DecodeState,
    LocalRemoteDecision,
    LocalVsRemotePolicy,
    MeasuredTimes,
    PromptState,
    Where,
)
from kvpilot.policies.roofline import kv_bytes, linear_flops, pass_seconds, prefill


class Option(str, enum.Enum):
    """The article's options, by the name the router's config and metrics use."""

    REPREFILL = "reprefill"
    PULL = "pull"
    AFFINITY = "affinity"
    SHARED_TIER = "shared_tier"
    LOCAL = "local"

    @property
    def article_number(self) -> int:
        return _ARTICLE_NUMBER[self]


_ARTICLE_NUMBER = {Option.REPREFILL: 1, Option.PULL: 2, Option.AFFINITY: 3, Option.SHARED_TIER: 4, Option.LOCAL: 5}
TIE_ORDER = (Option.LOCAL, Option.AFFINITY, Option.REPREFILL, Option.SHARED_TIER, Option.PULL)
"""On equal cost, the option earlier here wins: it moves less data."""


@dataclass(frozen=True, slots=True)
class PrefillSite:
    """A prefill worker as an option sees it: the prompt tokens its GPU cache holds
    and the prefill tokens queued on it."""

    name: str
    cached_tokens: int
    queued_tokens: int = 0
    available: bool = True


@dataclass(frozen=True, slots=True)
class SessionStep:
    """What the router knows when step ``k+1`` arrives.

    ``p`` is the cost model's P for this step (``None``: no P is available), ``d``
    the chosen D with ``d_cached_tokens`` of the prompt in its GPU cache.
    ``last_p``: the P of the session's last step (``None``: it was prefilled on D
    or is unknown); ``last_d_chosen``: D is the session's last D. ``offer_tokens``:
    the prompt tokens D's end-of-turn offer holds (``None``: no offer), readable
    for ``offer_time_left_s`` more seconds (``None``: no stated hold).
    ``shared_tokens``: the prompt tokens a shared tier holds (0: none)."""

    prompt_tokens: int
    p: PrefillSite | None
    d_name: str
    d_cached_tokens: int
    decode: DecodeState
    last_p: PrefillSite | None = None
    last_d_chosen: bool = False
    offer_tokens: int | None = None
    offer_time_left_s: float | None = None
    offer_margin_s: float = 5.0
    shared_tokens: int = 0
    measured: MeasuredTimes | None = None
    """Measured local and remote seconds for the local option's verdict (``None``: the roofline's)."""


@dataclass(frozen=True, slots=True)
class OptionPrice:
    """One option: its expected TTFT in seconds (``inf`` when unavailable), where it
    prefills, and why (the terms, or why it cannot be used); when available, the
    prompt tokens it prefills and the tokens of KV it moves between engines."""

    option: Option
    seconds: float
    prefill_worker: str | None
    why: str
    prefill_tokens: int = 0
    moved_tokens: int = 0

    @property
    def available(self) -> bool:
        return math.isfinite(self.seconds)

    def explain(self) -> str:
        cost = f"{self.seconds * 1e3:.2f} ms" if self.available else "unavailable"
        return f"option {self.option.article_number} {self.option.value}: {cost}: {self.why}"


def _unavailable(option: Option, why: str) -> OptionPrice:
    return OptionPrice(option, math.inf, None, why)


class SessionOptionPricer:
    """Prices the five options with the local-vs-remote policy's specs and guards."""

    def __init__(self, policy: LocalVsRemotePolicy) -> None:
        self.policy = policy

    def _queue_s(self, site: PrefillSite) -> float:
        return pass_seconds(self.policy.p_hw, linear_flops(self.policy.model, site.queued_tokens), 0.0)[0]

    def _transfer_s(self, tokens: int) -> float:
        return self.policy.link.transfer_seconds(kv_bytes(self.policy.model, self.policy.fmt, max(0, tokens)))

    def _remote(
        self,
        option: Option,
        step: SessionStep,
        site: PrefillSite,
        loaded_tokens: int,
        loaded_s: float,
        loaded_what: str,
    ) -> OptionPrice:
        """P at ``site`` holds ``max(own cache, loaded_tokens)`` after ``loaded_s`` of loading,
        prefills the rest, then D pulls what it lacks."""
        pol = self.policy
        have = min(step.prompt_tokens, max(site.cached_tokens, loaded_tokens))
        queue_s = self._queue_s(site)
        prefill_s = prefill(pol.model, pol.fmt, pol.p_hw, step.prompt_tokens - have, have).seconds
        handoff_s = self._transfer_s(step.prompt_tokens - step.d_cached_tokens)
        seconds = queue_s + loaded_s + prefill_s + handoff_s
        moved = max(0, have - site.cached_tokens) + step.prompt_tokens - step.d_cached_tokens
        why = (
            f"P={site.name} queue {queue_s * 1e3:.2f} ms + {loaded_what}{loaded_s * 1e3:.2f} ms + prefill "
            f"{step.prompt_tokens - have} tokens after {have} {prefill_s * 1e3:.2f} ms + D={step.d_name} pulls "
            f"{step.prompt_tokens - step.d_cached_tokens} tokens {handoff_s * 1e3:.2f} ms"
        )
        return OptionPrice(option, seconds, site.name, why, step.prompt_tokens - have, moved)

    def reprefill(self, step: SessionStep) -> OptionPrice:
        if step.p is None:
            return _unavailable(Option.REPREFILL, "no prefill worker is available")
        return self._remote(Option.REPREFILL, step, step.p, 0, 0.0, "")

    def pull(self, step: SessionStep) -> OptionPrice:
        if step.p is None:
            return _unavailable(Option.PULL, "no prefill worker is available")
        if step.offer_tokens is None:
            return _unavailable(Option.PULL, "D made no offer of the session's KV at the last step")
        gain = step.offer_tokens - step.p.cached_tokens
        if gain <= 0:
            return _unavailable(Option.PULL, f"P={step.p.name} already holds the {step.offer_tokens} tokens D offers")
        pull_s = self._transfer_s(gain)
        if step.offer_time_left_s is not None:
            reach_s = self._queue_s(step.p) + pull_s + step.offer_margin_s
            if step.offer_time_left_s < reach_s:
                return _unavailable(
                    Option.PULL,
                    f"D's offer expires in {step.offer_time_left_s:.1f} s, before P "
                    f"could read it ({reach_s:.1f} s with the margin)",
                )
        return self._remote(Option.PULL, step, step.p, step.offer_tokens, pull_s, f"pull {gain} tokens from D ")

    def affinity(self, step: SessionStep) -> OptionPrice:
        if step.last_p is None:
            return _unavailable(Option.AFFINITY, "the session's last step had no prefill worker")
        if not step.last_p.available:
            return _unavailable(Option.AFFINITY, f"the last P={step.last_p.name} is unavailable")
        if not step.last_d_chosen:
            return _unavailable(Option.AFFINITY, f"the cost model moved the session off its last D to {step.d_name}")
        return self._remote(Option.AFFINITY, step, step.last_p, 0, 0.0, "")

    def shared_tier(self, step: SessionStep) -> OptionPrice:
        if step.p is None:
            return _unavailable(Option.SHARED_TIER, "no prefill worker is available")
        gain = step.shared_tokens - step.p.cached_tokens
        if gain <= 0:
            return _unavailable(Option.SHARED_TIER, "no shared tier holds more of the prompt than P's cache")
        return self._remote(
            Option.SHARED_TIER, step, step.p, step.shared_tokens, self._transfer_s(gain), f"restore {gain} tokens "
        )

    def _local_verdict(self, step: SessionStep) -> tuple[PromptState, LocalRemoteDecision, str]:
        """The policy's verdict on D prefilling ``step``, the prompt it judged and the why."""
        p_cached = step.p.cached_tokens if step.p is not None else 0
        p_queued = step.p.queued_tokens if step.p is not None else 0
        prompt = PromptState(step.prompt_tokens, step.d_cached_tokens, p_cached, p_queued)
        verdict = self.policy.decide(prompt, step.decode, step.measured)
        why = f"D={step.d_name} prefills {prompt.effective_tokens} tokens; " + "; ".join(verdict.reasons)
        return prompt, verdict, why

    def local(self, step: SessionStep) -> OptionPrice:
        prompt, verdict, why = self._local_verdict(step)
        if verdict.where is not Where.LOCAL and step.p is not None:
            return _unavailable(Option.LOCAL, why)
        return OptionPrice(Option.LOCAL, verdict.local_priced_s, step.d_name, why, prompt.effective_tokens, 0)

    def local_despite_stall(self, step: SessionStep, best_remote_s: float) -> OptionPrice | None:
        """The local option priced with the stall it imposes on D's running streams
        (its prefill, plus that pause once per running stream), when only the stall
        budget or the cost comparison ruled it out and it is still faster than
        ``best_remote_s``, the cheapest other option's price; else ``None``. A budget
        must not send a step to an option slower than prefilling here and pausing the
        streams: with concurrent steps on one D, each one's streams would otherwise
        send every later step to a P that lacks the session."""
        prompt, verdict, why = self._local_verdict(step)
        if verdict.where is Where.LOCAL or not verdict.guards_ok:
            return None
        seconds = verdict.local_priced_s
        if seconds >= best_remote_s:
            return None
        why += (
            f"; with the stall on {step.decode.running_streams} streams {seconds * 1e3:.2f} ms,"
            f" below the best other option's {best_remote_s * 1e3:.2f} ms"
        )
        return OptionPrice(Option.LOCAL, seconds, step.d_name, why, prompt.effective_tokens, 0)

    def price(self, step: SessionStep) -> tuple[OptionPrice, ...]:
        """All five options in the article's order."""
        return (self.reprefill(step), self.pull(step), self.affinity(step), self.shared_tier(step), self.local(step))


def choose(prices: tuple[OptionPrice, ...], forced: Option | None = None) -> OptionPrice:
    """The forced option when it is available, else the cheapest available one
    (ties by :data:`TIE_ORDER`). Raises ValueError when none is available."""
    by_option = {p.option: p for p in prices}
    if forced is not None and forced in by_option and by_option[forced].available:
        return by_option[forced]
    available = [p for p in prices if p.available]
    if not available:
        raise ValueError("no option can serve this step: " + "; ".join(p.explain() for p in prices))
    return min(available, key=lambda p: (p.seconds, TIE_ORDER.index(p.option)))


__all__ = ["TIE_ORDER", "Option", "OptionPrice", "PrefillSite", "SessionOptionPricer", "SessionStep", "choose"]
