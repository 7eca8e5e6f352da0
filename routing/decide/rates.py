"""Measured rates: how long each engine's prefill and decode step, and each KV read,
really take, learned from samples and starting from the roofline prior. Pure: no
I/O, no clock (a sample's window is a count, not a time).

Three models, each fitted by non-negative least squares over the last ``window``
samples (the fit and the prefill model are :mod:`kvpilot.policies.measured_fit`'s, which the
connector's pull policy fits too):

- **prefill** of ``n`` new (uncached) tokens after ``C`` cached ones, per engine::

      seconds = a + b * n + c * (n * C + n * (n + 1) / 2)

  (a fixed cost, the linear layers, attention over the (query, key) pairs);
- **decode step** with ``B`` running streams, per engine::

      seconds = a + b * B

- **KV read** of ``T`` tokens, per reading engine (the engine whose NIXL counters
  count the read: D for P's handoff, P for a pull of D's session)::

      seconds = setup * transfers + per_token * T

Until a model holds :data:`MIN_SAMPLES` samples (and they span at least two
distinct values of the leading variable; decode steps timed at one stream count
only fit their mean, with no per-stream term) it answers with the fit of the same model
on the engine with the most samples (the fleet serves one model: a P not yet timed
is predicted from D's measured prefills, so the first long prompt through a slow
box gets a timeout from a measurement), and while no engine has one with the
roofline prior (the served model on the ``disaggregation`` hardware and link presets:
:class:`Prior`). Every
answer is an :class:`Estimate` carrying both, so a caller can show the prior next
to the measurement.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvpilot.policies.measured_fit import (
    MIN_SAMPLES,
    PREFILL_SPREAD_FEATURE,
    WINDOW,
    LinearFit,
    prefill_features,
)
from kvpilot.policies.presets import hardware_preset, kv_format_preset, link_preset
from kvpilot.policies.roofline import decode_step, kv_bytes, prefill
from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec, SpecError
from kvpilot.routing.config import ConfigError, DisaggregationConfig, Role
from kvpilot.routing.health.engine_load import EngineLoad, RateCounters

DECODE_PRIOR_CONTEXT = 1024
"""The context each running stream is taken to have in the prior's decode step (the
router does not know the streams' lengths)."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """A predicted duration: the roofline prior's, the measured fit's (``None`` while
    no engine's model has :data:`MIN_SAMPLES` usable samples), how many samples the
    fit saw and whose fit it is (``measured_by``: the engine asked about, or, while its
    own model is on the prior, the engine with the most samples)."""

    prior_s: float
    measured_s: float | None
    samples: int
    measured_by: str | None = None

    @property
    def seconds(self) -> float:
        """The measured value where there is one, else the prior."""
        return self.measured_s if self.measured_s is not None else self.prior_s

    @property
    def measured(self) -> bool:
        """Whether :attr:`seconds` is a measurement's: a fit answered, or there is no work
        (the prior of no work is 0 s, as any fit's is)."""
        return self.measured_s is not None or self.prior_s == 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "prior_s": self.prior_s,
            "measured_s": self.measured_s,
            "samples": self.samples,
            "measured_by": self.measured_by,
        }


@dataclass(frozen=True, slots=True)
class Prior:
    """The roofline's rates for one engine: its model, KV format, hardware and the link
    it reads KV over."""

    model: ModelSpec
    fmt: KVFormat
    hardware: HardwareSpec
    link: LinkSpec

    def prefill_s(self, new: int, cached: int) -> float:
        return prefill(self.model, self.fmt, self.hardware, new, cached).seconds

    def decode_step_s(self, streams: int) -> float:
        return decode_step(self.model, self.fmt, self.hardware, [DECODE_PRIOR_CONTEXT] * max(1, streams)).seconds

    def transfer_s(self, tokens: int) -> float:
        return self.link.transfer_seconds(kv_bytes(self.model, self.fmt, tokens))


@dataclass(frozen=True, slots=True)
class RolePriors:
    """The prior of a prefill worker and of every other worker (decode, co-located):
    the ``disaggregation`` section's presets (``p_hardware``, ``d_hardware``)."""

    prefill: Prior
    other: Prior

    @classmethod
    def from_config(cls, cfg: DisaggregationConfig, model: ModelSpec) -> RolePriors:
        """The priors pricing ``model`` (:func:`kvpilot.routing.config.prior_model`). Raises
        :class:`~kvpilot.routing.config.ConfigError` naming the section for an unknown preset."""
        try:
            fmt = kv_format_preset(cfg.kv_format)
            link, p_hw, d_hw = (
                link_preset(cfg.link_preset),
                hardware_preset(cfg.p_hardware),
                hardware_preset(cfg.d_hardware),
            )
        except SpecError as exc:
            raise ConfigError("disaggregation", str(exc)) from None
        return cls(Prior(model, fmt, p_hw, link), Prior(model, fmt, d_hw, link))

    def of(self, role: Role | None) -> Prior:
        """The prior of a worker in ``role`` (``None``: a worker no longer in the fleet)."""
        return self.prefill if role is Role.PREFILL else self.other


def _decode_features(streams: float) -> tuple[float, float]:
    return (1.0, float(streams))


def _transfer_features(transfers: float, tokens: float) -> tuple[float, float]:
    return (float(transfers), float(tokens))


@dataclass
class Residuals:
    """One decode worker's overhead residuals on one path (:meth:`RateEstimator.observe_overhead`):
    the traffic's newest ``window``, and calibration's, which stand in until the traffic
    has ``min_samples`` (probes are not the traffic: they skip the router's parse and
    route)."""

    window: int
    min_samples: int
    traffic: deque[float] = field(init=False)
    probes: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.traffic = deque(maxlen=self.window)

    def values(self) -> list[float]:
        if len(self.traffic) >= self.min_samples:
            return list(self.traffic)
        return [*self.probes, *self.traffic]

    def __len__(self) -> int:
        traffic = len(self.traffic)
        return traffic if traffic >= self.min_samples else traffic + len(self.probes)


_Model = TypeVar("_Model", LinearFit, Residuals)


def _answering(models: Mapping[str, _Model], engine: str, ready: Callable[[_Model], bool]) -> str | None:
    """Whose model answers for ``engine``: its own once ``ready``, else the ready one with
    the most samples (the fleet's engines serve one model), else ``None`` (the prior).
    The others are looked at only when ``engine``'s own is not ready."""
    own = models.get(engine)
    if own is not None and ready(own):
        return engine
    sampled = [(len(model), name) for name, model in models.items() if ready(model)]
    return max(sampled)[1] if sampled else None


class PrefillPath(str, enum.Enum):
    """Where a request is prefilled, seen from its decode worker: what lies around the
    modelled terms differs by path (a remote prefill adds P's call, its answer and the
    handoff to D; a local one is one call), so each path learns its own overhead."""

    LOCAL = "local"
    """The decode worker prefills (D, or a co-located worker)."""
    REMOTE = "remote"
    """Another worker prefills, and the decode worker reads its KV."""

    @classmethod
    def of(cls, prefill_worker: str, decode_worker: str) -> PrefillPath:
        return cls.LOCAL if prefill_worker == decode_worker else cls.REMOTE


class RateEstimator:
    """Per engine: prefill and decode-step models; per reading engine: the KV-read model.
    See the module doc. ``prior(engine)`` gives an engine's roofline :class:`Prior`."""

    def __init__(self, prior: Callable[[str], Prior], *, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._prior = prior
        self._window, self._min = window, min_samples
        self._prefill: dict[str, LinearFit] = {}
        self._decode: dict[str, LinearFit] = {}
        self._overhead: dict[PrefillPath, dict[str, Residuals]] = {path: {} for path in PrefillPath}
        self._transfer: dict[str, LinearFit] = {}
        self._read: dict[str, tuple[float, float]] = {}  # per reader: bytes, seconds of its sampled reads
        self._last: dict[str, EngineLoad] = {}

    def _fit(self, fits: dict[str, LinearFit], engine: str, spread: int, flat_ok: bool = False) -> LinearFit:
        fit = fits.get(engine)
        if fit is None:
            fit = fits[engine] = LinearFit(spread, self._window, self._min, flat_ok)
        return fit

    def _prefill_fit(self, engine: str) -> LinearFit:
        return self._fit(self._prefill, engine, PREFILL_SPREAD_FEATURE)

    def _decode_fit(self, engine: str) -> LinearFit:
        return self._fit(self._decode, engine, spread=1, flat_ok=True)  # one stream count: its mean

    def _transfer_fit(self, engine: str) -> LinearFit:
        return self._fit(self._transfer, engine, spread=1)

    # ---- samples -----------------------------------------------------------------
    def observe_prefill(
        self, engine: str, new: float, cached: float, seconds: float, *, provisional: bool = False
    ) -> None:
        """``engine`` prefilled ``new`` tokens after ``cached`` ones in ``seconds`` (a
        request, or the mean request of a poll interval). Non-positive ``new`` or
        ``seconds`` is ignored. ``provisional``: a calibration probe's, dropped once the
        engine's traffic gave the model enough samples spanning its length (:meth:`LinearFit.add`)."""
        if new > 0 and seconds > 0:
            self._prefill_fit(engine).add(prefill_features(round(new), round(cached)), seconds, provisional=provisional)

    def observe_decode(self, engine: str, streams: float, step_s: float, *, provisional: bool = False) -> None:
        """``engine`` took ``step_s`` per decode step with ``streams`` running
        (``provisional`` as for :meth:`observe_prefill`)."""
        if streams > 0 and step_s > 0:
            self._decode_fit(engine).add(_decode_features(streams), step_s, provisional=provisional)

    def observe_sample(self, engine: str, sample: EngineLoad, *, prefill: bool = True) -> None:
        """``engine``'s newest poll: the interval since its previous one becomes samples
        (:func:`observe_interval`); the first poll only sets the baseline."""
        before, self._last[engine] = self._last.get(engine), sample
        if before is not None:
            observe_interval(self, engine, before, sample, prefill=prefill)

    def observe_transfer(
        self, reader: str, transfers: float, tokens: float, seconds: float, nbytes: float = 0.0
    ) -> None:
        """``reader`` read ``tokens`` of KV (``nbytes``) in ``transfers`` reads taking
        ``seconds`` in all."""
        if transfers > 0 and tokens > 0 and seconds > 0:
            self._transfer_fit(reader).add(_transfer_features(transfers, tokens), seconds)
            read = self._read.get(reader, (0.0, 0.0))
            self._read[reader] = (read[0] + nbytes, read[1] + seconds)

    def observe_overhead(
        self, decode_worker: str, path: PrefillPath, residual_s: float, *, provisional: bool = False
    ) -> None:
        """A streamed request decoded on ``decode_worker`` and prefilled by ``path``
        reached its first token ``residual_s`` later than its queue, prefill, read and
        first step predicted (the router's parse and route, the HTTP hops, the handoff,
        the engines' scheduling; may be negative). ``provisional``: a calibration probe's
        (:class:`Residuals`)."""
        residuals = self._overhead[path].get(decode_worker)
        if residuals is None:
            residuals = self._overhead[path][decode_worker] = Residuals(self._window, self._min)
        (residuals.probes if provisional else residuals.traffic).append(residual_s)

    # ---- predictions -------------------------------------------------------------
    def overhead(self, decode_worker: str, path: PrefillPath) -> Estimate:
        """What a request decoded on ``decode_worker`` and prefilled by ``path`` spends
        outside the modelled terms: the median of its last ``window`` residuals on that
        path (:meth:`observe_overhead`; calibration's while the traffic has too few). It
        is negative where the modelled terms overprice the path: a prefill on D priced,
        until D has its own samples, by P's fit, which holds P's call around its prefill.
        While it has fewer than ``min_samples``, the worker's with the most on that path;
        prior 0. Never another path's: a remote prefill's handoff is no part of a local one."""
        residuals_by_worker = self._overhead[path]
        name = _answering(residuals_by_worker, decode_worker, lambda residuals: len(residuals) >= self._min)
        if name is None:
            own = residuals_by_worker.get(decode_worker)
            return Estimate(0.0, None, len(own) if own is not None else 0)
        residuals = residuals_by_worker[name].values()
        return Estimate(0.0, float(np.median(residuals)), len(residuals), name)

    @staticmethod
    def _estimate(
        fits: dict[str, LinearFit], engine: str, prior_s: float, features: Sequence[float] | None
    ) -> Estimate:
        """From ``engine``'s fit, else from the fitted engine with the most samples (the
        fleet's engines serve one model: a measured neighbour beats the roofline of a
        preset), else the prior alone. ``features`` None: no work, 0 s once measured."""
        name = _answering(fits, engine, lambda fit: fit.coefficients() is not None)
        if name is None:
            return Estimate(prior_s, None, len(fits[engine]) if engine in fits else 0)
        fit = fits[name]
        measured = 0.0 if features is None else fit.predict(features)
        return Estimate(prior_s, measured, len(fit), name)

    def prefill(self, engine: str, new: int, cached: int) -> Estimate:
        """``engine``'s prefill of ``new`` tokens after ``cached`` ones (0 s for none)."""
        features = prefill_features(new, cached) if new > 0 else None
        return self._estimate(self._prefill, engine, self._prior(engine).prefill_s(new, cached), features)

    def decode_step(self, engine: str, streams: int) -> Estimate:
        """One decode step of ``engine`` with ``streams`` running (at least one: the new request)."""
        streams = max(1, streams)
        prior = self._prior(engine).decode_step_s(streams)
        return self._estimate(self._decode, engine, prior, _decode_features(streams))

    def transfer(self, reader: str, tokens: int) -> Estimate:
        """One read of ``tokens`` of KV by ``reader`` (0 s for none)."""
        features = _transfer_features(1, tokens) if tokens > 0 else None
        return self._estimate(self._transfer, reader, self._prior(reader).transfer_s(tokens), features)

    def read_bytes_per_s(self, reader: str) -> float | None:
        """The mean rate of ``reader``'s sampled KV reads in bytes/s (``None``: none yet)."""
        nbytes, seconds = self._read.get(reader, (0.0, 0.0))
        return nbytes / seconds if nbytes > 0 and seconds > 0 else None

    def learned(self) -> dict[str, dict[str, dict[str, float] | None]]:
        """Per engine with samples, each model's fitted coefficients (``None`` while on the prior);
        the KV-read model also gives ``bytes_per_s`` when the reads' bytes are known."""
        names = ("prefill", "decode_step", "kv_read")
        labels = (("fixed_s", "per_token_s", "per_pair_s"), ("fixed_s", "per_stream_s"), ("setup_s", "per_token_s"))
        engines = sorted(
            {e for fits in (self._prefill, self._decode, self._transfer) for e, fit in fits.items() if fit}
        )
        out: dict[str, dict[str, dict[str, float] | None]] = {}
        for engine in engines:
            fits = (self._prefill.get(engine), self._decode.get(engine), self._transfer.get(engine))
            out[engine] = {}
            for name, keys, fit in zip(names, labels, fits, strict=True):
                coef = fit.coefficients() if fit is not None else None
                out[engine][name] = None if coef is None else dict(zip(keys, coef, strict=True))
            read = out[engine]["kv_read"]
            rate = self.read_bytes_per_s(engine)
            if read is not None and rate is not None:
                read["bytes_per_s"] = rate
        return out


def observe_interval(
    estimator: RateEstimator,
    engine: str,
    before: EngineLoad,
    after: EngineLoad,
    *,
    prefill: bool = True,
    provisional: bool = False,
) -> None:
    """Feed ``estimator`` what ``engine`` did between two polls of its counters.

    - a decode-step sample: the mean inter-token latency of the interval, at the mean
      of the two polls' running streams, at least one (steps ran: a stream ran; a
      poll often finds an engine idle between short requests);
    - a KV-read sample: the interval's reads, their seconds and bytes, and the
      tokens the connector loaded (``external_kv_transfer``);
    - with ``prefill``, a prefill sample: the interval's mean request (its new tokens
      ``local_compute``, its cached ``local_cache_hit``, its prefill seconds), only
      when the interval loaded no KV over the connector (a request waiting for its KV
      would count the wait as prefill). Pass ``prefill=False`` for an engine whose
      prefills the router times itself (P: :meth:`RateEstimator.observe_prefill`).
      ``provisional``: the interval was a calibration probe (:meth:`RateEstimator.observe_prefill`).

    Any counter that went down (the engine restarted) skips the interval."""
    d = {name: getattr(after.rates, name) - getattr(before.rates, name) for name in RateCounters.__dataclass_fields__}
    d["reads"] = after.transfer.transfers - before.transfer.transfers
    d["read_seconds"] = after.transfer.transfer_seconds - before.transfer.transfer_seconds
    if any(v < 0 for v in d.values()):
        return
    if d["decode_steps"] > 0:
        streams = max(1.0, (before.running + after.running) / 2)
        estimator.observe_decode(engine, streams, d["decode_step_seconds"] / d["decode_steps"], provisional=provisional)
    if d["reads"] > 0:
        estimator.observe_transfer(engine, d["reads"], d["external_tokens"], d["read_seconds"], d["read_bytes"])
    if prefill and d["prefill_requests"] > 0 and d["external_tokens"] == 0:
        n = d["prefill_requests"]
        estimator.observe_prefill(
            engine, d["computed_tokens"] / n, d["cached_tokens"] / n, d["prefill_seconds"] / n, provisional=provisional
        )


PREFILL_TIMEOUT_FACTOR = 3.0
"""k in the router's timeout for P's prefill: ``max(floor, k * predicted queue + prefill)``."""


@dataclass(frozen=True, slots=True)
class TTFTPrediction:
    """A request's predicted time to first token, term by term (article section 7 and
    issue 20): the prefill queue ahead of it on the prefilling worker, the prefill of
    its uncached tokens, the KV read into D (0 for a local prefill), D's first decode
    step, and the overhead around them (:meth:`RateEstimator.overhead`: what requests
    through D spent beyond the other four). Each term is an :class:`Estimate` (prior
    and measured)."""

    queue: Estimate
    prefill: Estimate
    transfer: Estimate
    first_step: Estimate
    overhead: Estimate

    def _terms(self) -> tuple[Estimate, ...]:
        return (self.queue, self.prefill, self.transfer, self.first_step, self.overhead)

    def _modelled(self) -> tuple[Estimate, ...]:
        return (self.queue, self.prefill, self.transfer, self.first_step)

    @property
    def modelled_s(self) -> float:
        """The four modelled terms, without the overhead: what a request's observed TTFT
        is held against to learn the overhead."""
        return sum(term.seconds for term in self._modelled())

    @property
    def modelled_measured(self) -> bool:
        """Whether every modelled term is a measurement's (:attr:`Estimate.measured`): only
        then is an observed TTFT's residual an overhead (against a prior it would be the
        prior's error, and a fresh fleet's first requests would price every later one)."""
        return all(term.measured for term in self._modelled())

    @property
    def seconds(self) -> float:
        """The prediction: each term measured where it can be, else its prior; never
        below the first decode step (a negative overhead corrects the model, it does not
        outrun it)."""
        return max(self.first_step.seconds, self.modelled_s + self.overhead.seconds)

    @property
    def prior_s(self) -> float:
        """The roofline's prediction alone."""
        return sum(term.prior_s for term in self._terms())

    @property
    def prefill_s(self) -> float:
        """Until the prefilling worker is done: its queue and the prefill."""
        return self.queue.seconds + self.prefill.seconds

    @property
    def stall_s(self) -> float:
        """For a prefill on D itself: the pause it adds to each of D's running streams, its
        prefill beyond the decode step they run anyway."""
        return max(0.0, self.prefill.seconds - self.first_step.seconds)

    def prefill_timeout_s(self, floor_s: float, factor: float = PREFILL_TIMEOUT_FACTOR) -> float:
        """How long to wait for P: ``max(floor_s, factor * prefill_s)``."""
        return max(floor_s, factor * self.prefill_s)

    def as_dict(self) -> dict[str, object]:
        return {
            "ttft_s": self.seconds,
            "prior_ttft_s": self.prior_s,
            "queue": self.queue.as_dict(),
            "prefill": self.prefill.as_dict(),
            "transfer": self.transfer.as_dict(),
            "first_step": self.first_step.as_dict(),
            "overhead": self.overhead.as_dict(),
        }


def predict_ttft(
    rates: RateEstimator,
    prefill_worker: str,
    decode_worker: str,
    *,
    new: int,
    cached: int,
    queued: int,
    transfer_tokens: int,
    streams: int,
) -> TTFTPrediction:
    """The TTFT of a request whose ``new`` tokens (after ``cached``) ``prefill_worker``
    prefills behind ``queued`` tokens of prefill (taken as one prefill from scratch),
    after which ``decode_worker`` reads ``transfer_tokens`` of KV (0: local prefill,
    no read) and runs its first step with ``streams`` others running, plus the overhead
    measured around requests through ``decode_worker`` on the same :class:`PrefillPath`."""
    return TTFTPrediction(
        queue=rates.prefill(prefill_worker, queued, 0),
        prefill=rates.prefill(prefill_worker, new, cached),
        transfer=rates.transfer(decode_worker, transfer_tokens),
        first_step=rates.decode_step(decode_worker, streams + 1),
        overhead=rates.overhead(decode_worker, PrefillPath.of(prefill_worker, decode_worker)),
    )
