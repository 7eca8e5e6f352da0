"""Sessions: the affinity key, and each session's incremental block chain. Pure.

An agent's step ``k+1`` prompt is step ``k``'s prompt plus a little more, so a
session keeps its :class:`~kvpilot.routing.index.chain.PromptChain` (and the index's last
match for it) and only names the new blocks. If the new prompt does not extend
the old one (history edited, re-rendered, truncated), the chain is cut back to
the last full block before the first differing token and renamed from there.

Example (block size 2)::

    >>> store = SessionStore(block_size=2, max_sessions=8)
    >>> s = store.get(SessionId("a"))
    >>> s.advance([1, 2, 3, 4, 5]).reused_tokens
    0
    >>> s.advance([1, 2, 3, 4, 5, 6, 7]).reused_tokens   # extends: nothing rehashed
    5
    >>> s.advance([1, 2, 9, 4]).reused_tokens            # diverges at token 2
    2
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from kvpilot.kvconnectors.pull_params import LEASE_MARGIN_S, lease_expires_at, offers_blocks
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.chain import PromptChain, first_difference, pack_tokens

SESSION_FIELDS = ("conversation_id", "prompt_cache_key")
"""The body fields that name a session, by precedence (the router strips them before
the engines see the body)."""

SESSION_HEADERS = (
    "x-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "session_id",
    "x-session-affinity",
    "x-opencode-session",
)
"""The headers that name a session, by precedence, after :data:`SESSION_FIELDS` (names in
lower case; a request's header names match in any case):

- ``X-Session-ID``: kvpilot's own (OpenCode sends it too, with its session id);
- ``X-Dynamo-Session-ID``: NVIDIA Dynamo's, so a client written for Dynamo's router keeps its sessions;
- ``X-Claude-Code-Session-Id``: Claude Code's, on every request of a session;
- ``session_id``: OpenAI Codex CLI's (its conversation id, ``codex-rs/codex-api/src/requests/headers.rs``);
- ``x-session-affinity``, then ``x-opencode-session``: OpenCode's (the second only to its own providers).
"""
MAX_KEY_LENGTH = 256
MAX_GAPS = 8
"""The gaps a session keeps (:attr:`SessionState.gaps_s`): its recent rhythm, tool calls and human turns."""


class InvalidSessionKey(ValueError):
    """A session field is present but not a usable key (the front answers 400)."""


def session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> SessionId | None:
    """The request's affinity key, or None.

    Precedence: body ``conversation_id``, then body ``prompt_cache_key``, then each of
    :data:`SESSION_HEADERS` in turn (a header name in any case; of one header given twice,
    the first). The first present key decides: it must be a non-empty string of at most
    256 characters, else :class:`InvalidSessionKey` naming the field or header (a later
    one is not tried). A ``None`` body value counts as absent.
    """
    for field in SESSION_FIELDS:
        value = body.get(field)
        if value is not None:
            return _checked(value, field)
    named: dict[str, str] = {}
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in SESSION_HEADERS:
            named.setdefault(lowered, value)
    for header in SESSION_HEADERS:
        if header in named:
            return _checked(named[header], header)
    return None


def scoped(key: SessionId, cache_salt: str | None) -> SessionId:
    """``key`` within ``cache_salt``'s namespace, so that one tenant's session id
    never names another tenant's session. The salt is length-prefixed: no pair of
    (salt, key) can spell another pair."""
    return key if cache_salt is None else SessionId(f"{len(cache_salt)}:{cache_salt}:{key}")


def _checked(value: object, field: str) -> SessionId:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise InvalidSessionKey(f"{field} must be a non-empty string of at most {MAX_KEY_LENGTH} characters")
    return SessionId(value)


OfferUse = Literal["sent", "expired", "unused", "none"]


@dataclass(frozen=True, slots=True)
class SessionOffer:
    """D's end-of-turn kv_transfer_params for a session (vLLM's bidirectional mode):
    the blocks of the whole session D holds for a peer to pull, until ``expires_at``
    (Unix seconds, from KVPilotConnector's :data:`~kvpilot.kvconnectors.pull_params.EXPIRES_AT_KEY`; ``None`` when D
    stated no wall-clock hold)."""

    holder: WorkerId
    params: Mapping[str, Any]
    expires_at: float | None

    @classmethod
    def from_response(cls, holder: WorkerId, params: object) -> SessionOffer | None:
        """The offer in D's returned params, or ``None`` if they offer no blocks."""
        if not offers_blocks(params):
            return None
        return cls(holder, dict(params), lease_expires_at(params))

    @property
    def blocks(self) -> int:
        """The blocks offered (of the first KV-cache group when ids come per group)."""
        ids = self.params.get("remote_block_ids") or []
        first = ids[0] if ids else None
        return len(first) if isinstance(first, (list, tuple)) else len(ids)

    def use(self, now: float, margin_s: float = LEASE_MARGIN_S) -> OfferUse:
        """``sent`` if P may still pull it at ``now`` (Unix seconds), else ``expired``:
        an offer whose hold ends within ``margin_s`` would race D freeing its blocks
        (P's connector refuses it by the same margin)."""
        if self.expires_at is not None and self.expires_at - now < margin_s:
            return "expired"
        return "sent"


class Advance(NamedTuple):
    """What :meth:`SessionState.advance` kept: tokens reused from the last prompt."""

    reused_tokens: int
    new_tokens: int
    diverged: bool


class SessionState:
    """One session: its chain (with the index's cached match) and where it last ran."""

    __slots__ = (
        "_lora",
        "_salt",
        "block_size",
        "chain",
        "ended_at",
        "gaps_s",
        "last_prefill",
        "last_worker",
        "offer",
        "steps",
    )

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chain: PromptChain | None = None
        self.last_worker: WorkerId | None = None
        """The D (or co-located worker) that served the last step: it holds the newest KV."""
        self.last_prefill: WorkerId | None = None
        """The P that prefilled the last step (``None``: prefilled where it decoded)."""
        self.offer: SessionOffer | None = None
        """D's offer of the session's KV after its last step, until used or replaced."""
        self.ended_at: float | None = None
        """When its last step's answer ended (Unix seconds), until its next step arrives."""
        self.gaps_s: deque[float] = deque(maxlen=MAX_GAPS)
        """Its latest gaps (a step's arrival after the previous step's end), oldest first."""
        self.steps = 0
        """Steps served (:meth:`kvpilot.routing.decide.router.Router.served`): which of two views of the
        session is newer (:func:`kvpilot.routing.decide.session_record.merge`)."""
        self._lora: str | None = None
        self._salt: str | None = None

    def arrived(self, now: float) -> None:
        """A step arrived at ``now`` (Unix seconds): its gap since the last step's end is kept."""
        if self.ended_at is not None:
            self.gaps_s.append(max(0.0, now - self.ended_at))
            self.ended_at = None

    def _reset(self, tokens: Sequence[int], lora: str | None, salt: str | None) -> Advance:
        self.chain = PromptChain(tokens, self.block_size, lora_name=lora, cache_salt=salt, incremental=True)
        self._lora, self._salt = lora, salt
        return Advance(0, len(tokens), False)

    def advance(self, prompt: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> Advance:
        """Make the chain name ``prompt``, reusing what the last prompt shares with it.

        Packs ``prompt`` once and compares it with the old one with numpy. A
        different salt or LoRA starts a fresh chain (namespaces never mix).
        Raises ValueError for a token id outside ``[0, 2**32)``.
        """
        chain = self.chain
        if chain is None or (lora_name, cache_salt) != (self._lora, self._salt):
            return self._reset(prompt, lora_name, cache_salt)
        packed = pack_tokens(prompt)
        old = chain.tokens
        same = first_difference(old, packed)
        diverged = same < len(old)
        if diverged:
            chain.truncate(same)
        chain.extend(packed[same:])
        return Advance(same, len(prompt) - same, diverged)

    def shared_prefix(
        self, prompt: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> int:
        """How many leading tokens ``prompt`` shares with the last prompt (0: none yet, or
        another salt or LoRA): what :meth:`advance` would reuse, without advancing."""
        if self.chain is None or (lora_name, cache_salt) != (self._lora, self._salt):
            return 0
        return first_difference(self.chain.tokens, pack_tokens(prompt))

    def preview(
        self, prompt: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[PromptChain, int]:
        """A chain naming ``prompt`` and the tokens it shares with the last prompt (:meth:`shared_prefix`),
        without advancing: the shared blocks' keys are the session chain's, named once
        (:meth:`~kvpilot.routing.index.chain.PromptChain.seeded`), so a step's preview costs
        what its new tokens cost to name. The chain names what :meth:`advance` would make it name."""
        shared = self.shared_prefix(prompt, lora_name=lora_name, cache_salt=cache_salt)
        if self.chain is None or (lora_name, cache_salt) != (self._lora, self._salt):
            return PromptChain(prompt, self.block_size, lora_name=lora_name, cache_salt=cache_salt), shared
        return self.chain.seeded(prompt, shared), shared

    def extend(self, appended: Sequence[int]) -> Advance:
        """The caller vouches that the new prompt is the last one plus ``appended``.

        O(len(appended)): for a front that renders each turn incrementally. A
        wrong claim only misroutes (engines match KV by content), never corrupts.
        """
        if self.chain is None:
            return self._reset(appended, None, None)
        reused = len(self.chain.tokens)
        self.chain.extend(appended)
        return Advance(reused, len(appended), False)


class SessionStore:
    """Sessions by key, in two parts, so that naming a session never drops a real one.

    A session is *live* once a step of it was served (its state's ``steps`` above 0:
    :meth:`~kvpilot.routing.decide.router.Router.served`, or a newer record merged from the
    shared store); until then it is *pending* (named by a request in flight, or by one that
    was refused or failed). Each part holds at most ``max_sessions``, least recently used
    dropped beyond it: a flood of new session ids drops only pending sessions, and a live
    one is dropped only for another live one. A pending session found served (by
    :meth:`get`, or as it would be dropped) becomes live.

    ``max_per_client`` (0: no limit): a client's sessions (:meth:`claim`) beyond it drop
    that client's least recently claimed one, never another client's.
    """

    def __init__(self, block_size: int, max_sessions: int, max_per_client: int = 0) -> None:
        if max_sessions <= 0 or max_per_client < 0:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}; max_per_client 0 or more")
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self._live: OrderedDict[SessionId, SessionState] = OrderedDict()
        self._pending: OrderedDict[SessionId, SessionState] = OrderedDict()
        self._owner: dict[SessionId, str] = {}
        self._owned: dict[str, OrderedDict[SessionId, None]] = {}
        self.evicted = 0
        """Sessions dropped, live or pending."""

    def __len__(self) -> int:
        """Sessions held, live and pending."""
        return len(self._live) + len(self._pending)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` names a session held (live or pending); touches nothing."""
        return key in self._live or key in self._pending

    def get(self, key: SessionId) -> SessionState:
        """The session for ``key``, created pending if new; marks it most recent."""
        state = self._live.get(key)
        if state is not None:
            self._live.move_to_end(key)
            return state
        state = self._pending.pop(key, None) or SessionState(self.block_size)
        if state.steps:
            self._make_live(key, state)
        else:
            self._pending[key] = state
            while len(self._pending) > self.max_sessions:
                old, old_state = self._pending.popitem(last=False)
                if old_state.steps:
                    self._make_live(old, old_state)
                else:
                    self._dropped(old)
        return state

    def claim(self, key: SessionId, client: str) -> SessionState:
        """:meth:`get`, and ``client`` (the requester as the front sees it) now owns ``key``;
        beyond ``max_per_client`` the client's least recently claimed session is dropped."""
        state = self.get(key)
        if not self.max_per_client:
            return state
        self._disown(key)
        self._owner[key] = client
        owned = self._owned.setdefault(client, OrderedDict())
        owned[key] = None
        while len(owned) > self.max_per_client:
            old = next(iter(owned))
            self.forget(old)
            self.evicted += 1
        return state

    def forget(self, key: SessionId) -> None:
        """Drop ``key`` (no-op if unknown)."""
        self._live.pop(key, None)
        self._pending.pop(key, None)
        self._disown(key)

    def _make_live(self, key: SessionId, state: SessionState) -> None:
        self._live[key] = state
        if len(self._live) > self.max_sessions:
            self._dropped(self._live.popitem(last=False)[0])

    def _dropped(self, key: SessionId) -> None:
        self.evicted += 1
        self._disown(key)

    def _disown(self, key: SessionId) -> None:
        client = self._owner.pop(key, None)
        if client is not None:
            owned = self._owned[client]
            del owned[key]
            if not owned:
                del self._owned[client]


__all__ = [
    "Advance",
    "InvalidSessionKey",
    "OfferUse",
    "SessionOffer",
    "SessionState",
    "SessionStore",
    "scoped",
    "session_key",
]
