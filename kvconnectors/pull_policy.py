"""Pull a peer's span or recompute it: the live replacement for vLLM's fixed
``kv_recompute_threshold`` (article section 9.3). Pure: no vLLM, no clock.

When P is offered the KV of a session's earlier turns by D (a D->P pull in
vLLM's bidirectional mode), the verified blocks beyond P's local hit form a
*span*. Pulling it costs the link's fixed cost plus its bytes over the bandwidth
this engine's own NIXL transfers achieved; recomputing it costs the time it adds
to P's pass: P's own prefill rate, fitted to its steps, once it has timed enough of
them (:mod:`kvpilot.kvconnectors.step_rates`), the roofline on its hardware spec given the
prefill work P already has until then. :class:`RooflinePullPolicy` asks
:class:`policies.RecomputeVsTransferPolicy`; :class:`ThresholdPullPolicy` is
vLLM's rule, kept for users who pin ``kv_recompute_threshold``.

The live inputs are kept as plain counters fed by the connector:
:class:`PrefillBacklog` (from the scheduler's own outputs), :class:`LinkMeter`
(from the NIXL worker's transfer telemetry) and
:class:`kvpilot.kvconnectors.step_rates.StepRates` (from the steps' timings).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from kvpilot.policies.recompute_vs_transfer import (
    Choice,
    LinkTelemetry,
    MeasuredPrefill,
    PrefillLoad,
    RecomputeVsTransferPolicy,
    Span,
    TransferSample,
)

PullChoice = Literal["pull", "recompute"]


class RecomputePolicy(str, enum.Enum):
    """Who decides whether a span is pulled: the connector's ``recompute_policy``
    (:mod:`kvpilot.kvconnectors.config`)."""

    ROOFLINE = "roofline"
    """:class:`RooflinePullPolicy`: :class:`policies.RecomputeVsTransferPolicy` on live inputs."""
    THRESHOLD = "threshold"
    """:class:`ThresholdPullPolicy`: vLLM's fixed ``kv_recompute_threshold``."""


class DecidedBy(str, enum.Enum):
    """What decided one span: the ``reason`` of each :class:`PullDecision`, and of
    ``vllm:kvpilot_pull_decisions_total``."""

    ROOFLINE = "roofline"
    """:class:`RooflinePullPolicy` with recomputing priced by the roofline on a hardware
    spec (the prior: this engine has not yet timed enough of its own steps)."""
    MEASURED = "measured"
    """:class:`RooflinePullPolicy` with recomputing priced by this engine's own prefill
    rate, fitted to its steps (:mod:`kvpilot.kvconnectors.step_rates`)."""
    THRESHOLD = "threshold"
    """:class:`ThresholdPullPolicy`: vLLM's fixed ``kv_recompute_threshold``."""


@dataclass(frozen=True, slots=True)
class PullDecision:
    """Whether to pull ``span.tokens`` from the peer, who decided, and why."""

    choice: PullChoice
    decided_by: DecidedBy
    span: Span
    explanation: str

    @property
    def pull(self) -> bool:
        return self.choice == "pull"

    @property
    def label(self) -> str:
        """The ``decision/reason`` key of ``vllm:kvpilot_pull_decisions_total``."""
        return f"{self.choice}/{self.decided_by.value}"


class PullPolicy(Protocol):
    def decide(
        self, span: Span, load: PrefillLoad, telemetry: LinkTelemetry, measured: MeasuredPrefill | None
    ) -> PullDecision:
        """Decide one span on this engine's prefill backlog, link and measured prefill
        rate (``None`` while too few of its steps are timed); mutates nothing."""
        ...


class ThresholdPullPolicy:
    """vLLM's rule: recompute spans shorter than ``threshold`` tokens (0: always pull)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def decide(
        self, span: Span, load: PrefillLoad, telemetry: LinkTelemetry, measured: MeasuredPrefill | None
    ) -> PullDecision:
        pull = span.tokens >= self.threshold
        relation = ">=" if pull else "<"
        return PullDecision(
            "pull" if pull else "recompute",
            DecidedBy.THRESHOLD,
            span,
            f"{span.tokens} tokens {relation} kv_recompute_threshold {self.threshold}",
        )


class RooflinePullPolicy:
    """:class:`policies.RecomputeVsTransferPolicy` on live load and link telemetry, its
    recompute side priced by this engine's measured prefill rate once there is one
    (:data:`DecidedBy.MEASURED`), by the roofline on its hardware spec until then
    (:data:`DecidedBy.ROOFLINE`)."""

    def __init__(self, policy: RecomputeVsTransferPolicy) -> None:
        self.policy = policy

    def decide(
        self, span: Span, load: PrefillLoad, telemetry: LinkTelemetry, measured: MeasuredPrefill | None
    ) -> PullDecision:
        decision = self.policy.decide(span, load, telemetry, measured)
        choice: PullChoice = "pull" if decision.choice is Choice.TRANSFER else "recompute"
        by = DecidedBy.MEASURED if decision.measured else DecidedBy.ROOFLINE
        queued = f"; P load {load.queued_prefill_tokens} queued + {load.running_batch_tokens} running tokens"
        return PullDecision(choice, by, span, decision.explain() + queued)


class PrefillBacklog:
    """Prompt tokens this engine still has to prefill, per request, from its own
    scheduler's outputs. Not thread-safe (the scheduler's thread only)."""

    def __init__(self) -> None:
        self._remaining: dict[str, int] = {}
        self._running_tokens = 0

    def add(self, request_id: str, prompt_tokens: int) -> None:
        """A request arrived with ``prompt_tokens`` to prefill (before any cache hit)."""
        self._remaining[request_id] = prompt_tokens

    def scheduled(
        self, num_scheduled_tokens: Mapping[str, int], first_computed: Mapping[str, int], total_scheduled: int
    ) -> None:
        """One scheduler step: ``num_scheduled_tokens`` per request, and for requests
        scheduled for the first time the tokens their cache hits already covered."""
        self._running_tokens = total_scheduled
        for request_id, n in num_scheduled_tokens.items():
            left = self._remaining.get(request_id)
            if left is None:
                continue
            left -= n + first_computed.get(request_id, 0)
            if left > 0:
                self._remaining[request_id] = left
            else:
                del self._remaining[request_id]

    def finished(self, request_id: str) -> None:
        self._remaining.pop(request_id, None)

    def load(self, excluding: str) -> PrefillLoad:
        """The backlog without ``excluding`` (the request being decided)."""
        queued = sum(self._remaining.values()) - self._remaining.get(excluding, 0)
        return PrefillLoad(queued_prefill_tokens=queued, running_batch_tokens=self._running_tokens)

    def __len__(self) -> int:
        return len(self._remaining)


class LinkMeter:
    """The last ``window`` transfers this engine's NIXL worker made (bytes and
    seconds each), the failures among the last ``window`` outcomes, and the last
    ``window`` whole pulls as their requests waited for them
    (:class:`~kvpilot.policies.recompute_vs_transfer.LinkTelemetry`)."""

    def __init__(self, window: int = 32) -> None:
        self._samples: deque[TransferSample] = deque(maxlen=window)
        self._outcomes: deque[bool] = deque(maxlen=window)  # True = failed
        self._pulls: deque[TransferSample] = deque(maxlen=window)

    def observe(self, durations_s: Iterable[float], nbytes: Iterable[float], failures: int = 0) -> None:
        """Record completed transfers (paired ``durations_s`` and ``nbytes``) and failures."""
        for seconds, size in zip(durations_s, nbytes, strict=True):
            if seconds > 0 and size > 0:
                self._samples.append(TransferSample(float(size), float(seconds)))
                self._outcomes.append(False)
        self._outcomes.extend([True] * failures)

    def pulled(self, nbytes: float, seconds: float) -> None:
        """A pull of ``nbytes`` arrived ``seconds`` after its request began to wait for it."""
        if seconds > 0 and nbytes > 0:
            self._pulls.append(TransferSample(float(nbytes), float(seconds)))

    def telemetry(self) -> LinkTelemetry:
        failures = sum(self._outcomes)
        return LinkTelemetry(samples=tuple(self._samples), failures=failures, pulls=tuple(self._pulls))


PEER_RETRY_AFTER_S = 30.0
"""After a pull from a peer fails, its offers are prefilled locally for this long
instead of paying another failed handshake (vLLM's worker waits 5 s per try)."""


class FailedPeers:
    """Peers (by NIXL engine id) whose last pull failed, and when. A later pull that
    succeeds clears the peer. Pure: the caller passes the clock."""

    def __init__(self, retry_after_s: float = PEER_RETRY_AFTER_S) -> None:
        self.retry_after_s = retry_after_s
        self._failed_at: dict[str, float] = {}

    def failed(self, engine_id: str, now: float) -> None:
        self._failed_at[engine_id] = now

    def succeeded(self, engine_id: str) -> None:
        self._failed_at.pop(engine_id, None)

    def seconds_since_failure(self, engine_id: str, now: float) -> float | None:
        """Seconds since ``engine_id``'s last failed pull if that is within the retry
        window, else ``None`` (never failed, or time to try it again)."""
        at = self._failed_at.get(engine_id)
        if at is None:
            return None
        if now - at >= self.retry_after_s:
            del self._failed_at[engine_id]
            return None
        return now - at
