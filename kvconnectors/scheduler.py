"""kvpilot's scheduler-side layer: what ``KVPilotConnector`` adds between vLLM's
scheduler and the inner connector.

* **Offering side** (P, or D in bidirectional mode): ``request_finished`` stamps an
  offer into the kv_transfer_params the inner connector returns whenever they hand
  blocks to a peer: the hash contract, a digest of every full block whose KV was
  computed, and the token ids of the partial tail block.
* **Attaching side**: before the inner connector plans a pull, the request's own
  block hashes (vLLM computed them over *this* engine's token ids) are checked
  against the offer. Only the verified run of blocks beyond the local prefix hit is
  attached; the rest is prefilled locally. vLLM's NIXL pull pairs the blocks it
  allocated with the end of the peer's block list, so attaching the verified prefix
  of ``k`` blocks means handing the inner connector the peer's first ``k`` block ids
  and reporting ``k * block_size - num_computed_tokens`` external tokens. A hybrid
  model's sliding-window groups hold only their in-window tail: each group's list is
  cut by its own rule, or the prefix is recomputed (:mod:`kvpilot.kvconnectors.group_clip`).

Every remote attach goes through :meth:`KVPilotScheduler.plan_attach`, whatever the
direction (P->D prefill handoff or a bidirectional pull of the peer's session KV); the
decision itself is :func:`kvpilot.kvconnectors.attach_plan.plan_attach`, pure and tested
without vLLM. This class is its vLLM-facing side and holds the live state.
A session pull (P pulling D's KV of earlier turns) is optional: the verified span
is pulled or recomputed as the pull policy decides (:mod:`kvpilot.kvconnectors.pull_policy`),
on this engine's own prefill backlog, measured NIXL transfers and prefill rate (its
steps timed on the injected clock, :mod:`kvpilot.kvconnectors.step_rates`). A P->D handoff is
always loaded: P computed it for this request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.kvconnectors.attach_plan import (
    AttachPlan,
    PromptView,
    external_tokens,
    is_session_pull,
    plan_attach,
)
from kvpilot.kvconnectors.group_clip import GroupKind, GroupLayout
from kvpilot.kvconnectors.hash_contract import HashAlgo, SeedId, salt_identity, seed_identity
from kvpilot.kvconnectors.pull_params import (
    LEASE_MARGIN_S,
    declines_hold,
    lease_seconds_left,
    pull_fields_error,
    stamp_wall_clock_expiry,
    strip_pull_fields,
    wants_remote_pull,
)
from kvpilot.kvconnectors.pull_policy import (
    FailedPeers,
    LinkMeter,
    PrefillBacklog,
    PullPolicy,
)
from kvpilot.kvconnectors.read_deadline import measured_rate
from kvpilot.kvconnectors.reasons import Reason
from kvpilot.kvconnectors.stats import KVPilotStats
from kvpilot.kvconnectors.step_rates import Chunk, StepRates
from kvpilot.kvconnectors.transfer_params import (
    PARAMS_KEY,
    ContractId,
    TransferParamsError,
    decode_offer,
    encode_offer,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvpilot.connector")

# Contract fields whose mismatch means the peer's KV cannot be read here at all.
_INCOMPATIBLE_FIELDS = frozenset({"model", "block_size", "kv_dtype", "kv_layout"})


@dataclass(frozen=True, slots=True)
class PullInFlight:
    """A request waiting for a peer's KV: the peer, the local blocks it fills, how
    many tokens it loads, and since when (the scheduler's clock) it waits."""

    peer: str
    block_ids: frozenset[int]
    external_tokens: int
    session_pull: bool
    started_s: float


def kv_bytes_per_token(kv_cache_config: KVCacheConfig, block_size: int) -> float:
    """Bytes of KV one token holds in this engine's cache, over all its layers."""
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return per_block / block_size


def model_identity(model: str) -> str:
    """A model's name in the contract: a hub id as is, a local directory by its name
    (the same weights live at different paths on different hosts)."""
    path = Path(model)
    return path.name if path.is_dir() else model


def _dtype_name(cache_dtype: str, model_dtype: object) -> str:
    if cache_dtype != "auto":
        return cache_dtype
    return str(model_dtype).removeprefix("torch.")


def step_chunks(scheduler_output: SchedulerOutput) -> list[Chunk]:
    """What one scheduler output runs, per request: its scheduled tokens after its
    computed ones (the counts before this step: vLLM builds the connector's metadata
    before it advances them), and whether it is still prefilling (a new request, one
    resumed after a preemption, or one with no output token yet)."""
    scheduled = scheduler_output.num_scheduled_tokens
    chunks = [
        Chunk(scheduled.get(new.req_id, 0), new.num_computed_tokens, True)
        for new in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    # vLLM 0.32-0.33 list the requests resumed after a preemption here; 0.34 sends them again
    # whole, among the new ones
    resumed: Collection[str] = getattr(cached, "resumed_req_ids", frozenset())
    for req_id, computed, outputs in zip(
        cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, strict=True
    ):
        chunks.append(Chunk(scheduled.get(req_id, 0), computed, outputs == 0 or req_id in resumed))
    return chunks


def group_layouts(kv_cache_config: KVCacheConfig) -> tuple[GroupLayout, ...]:
    """This engine's transfer groups, in the order of the block lists the NIXL
    connector exchanges. A kind is matched by its exact vLLM type: a subclass may keep
    its blocks otherwise (``RSWASpec`` evicts a middle gap) and counts as other."""
    return tuple(_layout(i, g.kv_cache_spec) for i, g in enumerate(kv_cache_config.transfer_groups))


def _layout(index: int, spec: KVCacheSpec) -> GroupLayout:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {_layout(index, s) for s in spec.kv_cache_specs.values()}
        if len(kinds) == 1:
            return replace(kinds.pop(), spec_name=name)
    elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupLayout(index=index, spec_name=name, kind=GroupKind.FULL)
    elif type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
        assert isinstance(spec, SlidingWindowSpec)
        return GroupLayout(
            index=index,
            spec_name=name,
            kind=GroupKind.SLIDING,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    return GroupLayout(index=index, spec_name=name, kind=GroupKind.OTHER)


class KVPilotScheduler:
    """Scheduler-side state of one ``KVPilotConnector``. Not thread-safe: vLLM's
    scheduler calls it from one thread. ``clock`` (seconds, monotonic) times this
    engine's steps for its measured prefill rate."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        kv_layout: str | None,
        pull_policy: PullPolicy,
        peer_retry_after_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        cache_config = vllm_config.cache_config
        self._block_size: int = kv_cache_config.hash_block_size or cache_config.block_size
        if self._block_size != cache_config.block_size:
            raise ValueError(
                f"KVPilotConnector verifies at the block size it attaches: hash block size "
                f"{self._block_size} != block size {cache_config.block_size} (hybrid models) is not supported"
            )
        self._model = model_identity(vllm_config.model_config.model)
        self._algo: HashAlgo = cache_config.prefix_caching_hash_algo
        self._kv_dtype = _dtype_name(cache_config.cache_dtype, vllm_config.model_config.dtype)
        self._kv_layout = kv_layout or "default"
        self._seed_id: SeedId | None = None
        self._groups = group_layouts(kv_cache_config)
        self._plans: dict[str, AttachPlan] = {}
        # request id -> why its pull fields were dropped: a malformed field's description,
        # or None for an incompatible peer (its offer is still verified, to count it)
        self._screened_out: dict[str, str | None] = {}
        self._logged: set[tuple[str, ...]] = set()
        self._stats = KVPilotStats()
        self._pull_policy = pull_policy
        self._backlog = PrefillBacklog()
        self._link = LinkMeter()
        self._kv_bytes_per_token = kv_bytes_per_token(kv_cache_config, self._block_size)
        self._steps = StepRates()
        self._clock = clock
        self._pulls_in_flight: dict[str, PullInFlight] = {}
        self._failed_peers = FailedPeers(peer_retry_after_s)
        ktc = vllm_config.kv_transfer_config
        self._recompute_failed_loads = ktc is not None and ktc.kv_load_failure_policy == "recompute"

    # ------------------------------------------------------------------ contract
    def contract(self, request: Request) -> ContractId:
        """This engine's contract for ``request`` (its salt is part of it)."""
        if self._seed_id is None:
            # vLLM seeds NONE_HASH after the connector is built: read it on first use.
            from vllm.v1.core import kv_cache_utils

            self._seed_id = seed_identity(kv_cache_utils.NONE_HASH)
        return ContractId(
            model=self._model,
            block_size=self._block_size,
            hash_algo=self._algo,
            seed_id=self._seed_id,
            kv_dtype=self._kv_dtype,
            kv_layout=self._kv_layout,
            salt_id=salt_identity(request.cache_salt),
        )

    # ------------------------------------------------------------------ offering side
    def stamp_offer(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Add kvpilot's offer to ``params`` when they hand blocks to a peer.

        The offer covers the tokens whose KV this engine computed
        (``request.num_computed_tokens``): their full blocks' digests and the partial
        tail's token ids. Returns ``params`` (mutated), or ``None`` if it was ``None``.
        """
        if params is None or not any(params.get("remote_block_ids") or ()):
            return params
        num_tokens = request.num_computed_tokens
        num_blocks = min(num_tokens // self._block_size, len(request.block_hashes))
        tail = request.all_token_ids[num_blocks * self._block_size : num_tokens]
        params[PARAMS_KEY] = encode_offer(self.contract(request), request.block_hashes[:num_blocks], tail)
        stamp_wall_clock_expiry(params, time.perf_counter(), time.time())
        self._stats.count("offers")
        return params

    # ------------------------------------------------------------------ attaching side
    def screen_new_request(self, request: Request) -> None:
        """Before the inner connector sees a new request: if it asks for a pull with
        malformed fields or from an incompatible peer, make it a local request (in
        place) and remember why. Counts its prompt in this engine's prefill backlog."""
        self._backlog.add(request.request_id, request.num_prompt_tokens)
        params = request.kv_transfer_params
        if not wants_remote_pull(params):
            return
        assert params is not None
        bad_field = pull_fields_error(params)
        if bad_field is not None:
            strip_pull_fields(params)
            self._screened_out[request.request_id] = f"malformed {bad_field}: prefill locally"
            return
        try:
            offer = decode_offer(params.get(PARAMS_KEY))
        except TransferParamsError:
            return  # a compatible-looking peer with a bad offer: refused in plan_attach, peer notified
        differing = {d.field for d in offer.contract.diff(self.contract(request))}
        if differing & _INCOMPATIBLE_FIELDS:
            strip_pull_fields(params)
            self._screened_out[request.request_id] = None

    def plan_attach(self, request: Request, num_computed_tokens: int) -> AttachPlan | None:
        """Decide what ``request`` may load from its peer; ``None`` if it loads nothing
        remote. Leaves ``request`` as it is; remembers the plan for :meth:`take_plan`."""
        params = request.kv_transfer_params
        screened = request.request_id in self._screened_out
        if not screened and not wants_remote_pull(params):
            self._plans.pop(request.request_id, None)
            return None
        assert params is not None
        started = time.perf_counter()
        plan = self._plan(request, params, num_computed_tokens, self._screened_out.get(request.request_id))
        self._stats.count("verify_seconds", time.perf_counter() - started)
        self._plans[request.request_id] = plan
        return plan

    def take_plan(self, request_id: str) -> AttachPlan | None:
        """The plan made for ``request_id``, once; counts it in the stats."""
        self._screened_out.pop(request_id, None)
        plan = self._plans.pop(request_id, None)
        if plan is not None:
            self._record(request_id, plan)
        return plan

    def finished(self, request: Request) -> bool:
        """``request`` finished: forget it, and say whether its params decline this engine's
        hold on its blocks (the router's :data:`~kvpilot.kvconnectors.pull_params.HOLD_KEY`,
        counted); the caller then hands the inner connector no blocks to hold."""
        self._forget(request.request_id)
        if not declines_hold(request.kv_transfer_params):
            return False
        self._stats.count("holds_released")
        return True

    def _forget(self, request_id: str) -> None:
        self._plans.pop(request_id, None)
        self._screened_out.pop(request_id, None)
        self._backlog.finished(request_id)
        self._pulls_in_flight.pop(request_id, None)

    # ------------------------------------------------------------------ pulls in flight
    def pull_started(self, request: Request, block_ids: Iterable[int], external_tokens: int) -> None:
        """``request`` waits for ``external_tokens`` of KV from its peer, into
        ``block_ids`` (the blocks allocated for it)."""
        params = request.kv_transfer_params or {}
        self._pulls_in_flight[request.request_id] = PullInFlight(
            peer=str(params.get("remote_engine_id")),
            block_ids=frozenset(block_ids),
            external_tokens=external_tokens,
            session_pull=is_session_pull(params),
            started_s=self._clock(),
        )

    def link_rate(self) -> float | None:
        """Bytes per second of this engine's recent whole pulls (``None`` before the first)."""
        return measured_rate(self._link.telemetry().pulls)

    def has_pulls_in_flight(self) -> bool:
        """Whether a pull is still waiting for the worker to report it received: the
        engine must keep stepping, since only a step collects that report."""
        return bool(self._pulls_in_flight)

    # ------------------------------------------------------------------ live inputs of the pull policy
    def observe_step(self, scheduler_output: SchedulerOutput) -> None:
        """One scheduler step, before its pass: what it scheduled shrinks the prefill
        backlog, and its pass is timed from now (``build_connector_meta``)."""
        first = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        self._backlog.scheduled(
            scheduler_output.num_scheduled_tokens, first, scheduler_output.total_num_scheduled_tokens
        )
        self._steps.started(step_chunks(scheduler_output), self._clock())

    def observe_transfers(self, connector_output: KVConnectorOutput) -> None:
        """The worker's report for the last step, after its pass
        (``update_connector_output``): the step's pass ends now; pulls received or
        failed (a pull received is timed whole, from :meth:`pull_started`), and its NIXL
        telemetry (durations, bytes, failures)."""
        self._steps.finished(self._clock())
        failed = set(connector_output.failed_recving or ())
        invalid = connector_output.invalid_block_ids or set()
        for request_id in (connector_output.finished_recving or set()) | failed:
            pull = self._pulls_in_flight.pop(request_id, None)
            if pull is None:
                continue
            if request_id in failed or not pull.block_ids.isdisjoint(invalid):
                self._pull_failed(request_id, pull)
            else:
                self._failed_peers.succeeded(pull.peer)
                nbytes = pull.external_tokens * self._kv_bytes_per_token
                self._link.pulled(nbytes, self._clock() - pull.started_s)
        stats = connector_output.kv_connector_stats
        inner = stats.inner if isinstance(stats, KVPilotStats) else stats
        data = inner if isinstance(inner, dict) else getattr(inner, "data", None)  # in-process, or to_dict()'s
        if not isinstance(data, dict):
            return
        failures = len(data.get("num_failed_transfers", ())) + len(data.get("num_kv_expired_reqs", ()))
        self._link.observe(data.get("transfer_duration", ()), data.get("bytes_transferred", ()), failures)

    def _pull_failed(self, request_id: str, pull: PullInFlight) -> None:
        """Count a failed pull and remember its peer. vLLM's ``kv_load_failure_policy``
        decides the request: ``recompute`` prefills the tokens here, ``fail`` ends it
        with an error (the router's retry serves it)."""
        self._failed_peers.failed(pull.peer, time.monotonic())
        action = "recompute" if self._recompute_failed_loads else "fail"
        self._stats.count("load_failures", reason=action)
        if self._recompute_failed_loads:
            self._stats.count("recomputed_tokens", pull.external_tokens, reason=Reason.LOAD_FAILED.value)
        logger.warning(
            "kvpilot %s: the pull of %d tokens from %s failed; kv_load_failure_policy=%s; its offers "
            "are prefilled locally for %.0f s",
            request_id,
            pull.external_tokens,
            pull.peer,
            action,
            self._failed_peers.retry_after_s,
        )

    def external_tokens(self, plan: AttachPlan, num_computed_tokens: int) -> int:
        """Tokens to load from the peer under a partial ``plan`` (may be <= 0: none)."""
        return external_tokens(plan, num_computed_tokens, self._block_size)

    def _plan(
        self, request: Request, params: dict[str, Any], num_computed_tokens: int, screened_out: str | None
    ) -> AttachPlan:
        prompt = PromptView(
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_token_ids=request.prompt_token_ids,
            block_hashes=request.block_hashes,
            extra_keys=bool(request.lora_request or request.mm_features),
        )
        return plan_attach(
            prompt,
            params,
            self.contract(request),
            num_computed_tokens,
            screened_out=screened_out,
            skip=self._skip_reason(params, is_session_pull(params)),
            groups=self._groups,
            decide_pull=lambda span: self._pull_policy.decide(
                span, self._backlog.load(request.request_id), self._link.telemetry(), self._steps.measured()
            ),
        )

    def _skip_reason(self, params: dict[str, Any], session_pull: bool) -> tuple[Reason, str] | None:
        """Why not to try this pull at all, or ``None``: the peer's lease (nearly)
        ended, or a pull from it just failed. A P->D handoff skips a failed peer only
        when vLLM would recompute its failure anyway (``kv_load_failure_policy``)."""
        left = lease_seconds_left(params, time.time())
        if left is not None and left < LEASE_MARGIN_S:
            return Reason.LEASE_EXPIRED, f"the peer's lease ends in {left:.1f} s"
        peer = str(params.get("remote_engine_id"))
        since = self._failed_peers.seconds_since_failure(peer, time.monotonic())
        if since is not None and (session_pull or self._recompute_failed_loads):
            return Reason.PEER_FAILED, f"a pull from {peer} failed {since:.1f} s ago"
        return None

    def _record(self, request_id: str, plan: AttachPlan) -> None:
        if plan.attached_blocks:
            self._stats.count("verified_blocks", plan.attached_blocks)
        if plan.pull_decision is not None:
            self._stats.count("pull_decisions", reason=plan.pull_decision.label)
            if plan.policy_recomputed_tokens:
                self._stats.count("recomputed_tokens", plan.policy_recomputed_tokens, reason=Reason.PULL_POLICY.value)
            logger.info("kvpilot %s: %s", request_id, plan.explanation)  # one line per session pull
        if plan.reason is Reason.VERIFIED_ALL and plan.recomputed_tokens == 0:
            logger.debug("kvpilot %s: %s", request_id, plan.explanation)
            return
        if plan.rejected_blocks:
            self._stats.count("rejected_blocks", plan.rejected_blocks, reason=plan.reason.value)
        if plan.recomputed_tokens:
            self._stats.count("recomputed_tokens", plan.recomputed_tokens, reason=plan.reason.value)
        label = plan.reason.value
        key = (label, *(f"{d.field}={d.this!r}/{d.other!r}" for d in plan.contract_diffs))
        if key not in self._logged:  # once per reason and distinct contract diff: bounded by the peers' configs
            self._logged.add(key)
            logger.warning("kvpilot %s: %s (further %s cases log at debug level)", request_id, plan.explanation, label)
        else:
            logger.debug("kvpilot %s: %s", request_id, plan.explanation)

    def take_stats(self) -> KVPilotStats:
        """The counts since the last call; resets them."""
        stats, self._stats = self._stats, KVPilotStats()
        return stats
