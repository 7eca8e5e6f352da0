"""A session's next prompt tokenized in time proportional to what changed since its last one.

An agent's step re-sends its whole history with a new turn at the end, so its prompt text
starts with most of the last step's. :class:`IncrementalTokens` keeps, per session, the last
prompt text and its token ids; for the next text it finds the prefix the two share, cuts it
at the last *safe cut* inside it, keeps the ids before the cut and tokenizes only the text
after it. The ids are always exactly the full tokenization's:

- A cut is the end of an added token the tokenizer cannot merge across
  (:attr:`~kvpilot.routing.serve.tokenizer.PromptTokenizer.cuts`, checked at load): the
  tokenizer splits its input at added tokens first, leftmost-longest, then encodes each
  piece alone, so the ids of ``text[:end]`` are the cached ones and those of
  ``text[end:]`` are its own tokenization.
- The cut's token is the cached id there, and its text is there in the new text.
- The split at the cut is the same in the new text: no added token occurs in either text
  starting before the cut and ending past the shared prefix (each added-token match before
  the cut is then decided on text both share).

Where no cut passes (an edit before the first turn, a first step, a tokenizer without
cuts), the text is tokenized whole. The cache only saves time: whatever a client sends
under a session key, the ids are the text's own.

Bounded (:class:`~kvpilot.routing.serve.session_cache.SessionCache`): least recently used
sessions are dropped past ``max_sessions`` or past ``max_tokens`` ids held in all; a prompt
longer than ``max_tokens`` is not kept. Thread-safe (the router tokenizes in worker threads):
no lock is held while tokenizing.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from dataclasses import dataclass

from kvpilot.routing.serve.session_cache import SessionCache
from kvpilot.routing.serve.tokenizer import CutEncoding, PromptTokenizer

MAX_SESSIONS = 4096
"""Sessions whose last prompt is kept, by default."""
MAX_TOKENS = 1 << 22
"""Token ids kept in all, by default (each with its share of the text)."""


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A session's last prompt: its text and :class:`CutEncoding` (never mutated once kept)."""

    text: str
    encoding: CutEncoding


@dataclass(frozen=True, slots=True)
class IncrementalStats:
    """What :meth:`IncrementalTokens.encode` did since the start."""

    prompts: int
    """Texts encoded for a session."""
    reused: int
    """Of those, the ones that kept a cached prefix."""
    reused_tokens: int
    """Ids taken from the cache rather than tokenized."""


def shared_length(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo], and the answer is at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class IncrementalTokens:
    """Per session, the last prompt's text and ids, and the next prompt's ids from them (module doc)."""

    def __init__(
        self, tokenizer: PromptTokenizer, *, max_sessions: int = MAX_SESSIONS, max_tokens: int = MAX_TOKENS
    ) -> None:
        if max_sessions < 0 or max_tokens < 0:
            raise ValueError("max_sessions and max_tokens must be at least 0")
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._prompts: SessionCache[_Prompt] = SessionCache(max_sessions=max_sessions, max_weight=max_tokens)
        self._lock = threading.Lock()
        self._stats = IncrementalStats(0, 0, 0)

    def encode(self, session: str, text: str) -> list[int]:
        """``text``'s token ids without special tokens, equal to
        ``tokenizer.encode(text, add_special_tokens=False)``; only the part after the last safe
        cut it shares with ``session``'s last prompt is tokenized. Keeps ``text`` as
        ``session``'s last prompt (the least recently used sessions dropped past the bounds),
        unless the tokenizer has no cuts. Returns a list the caller owns."""
        if not self.tokenizer.cuts:  # nothing could be kept: tokenized whole, nothing held
            return self.tokenizer.encode(text, add_special_tokens=False)
        last = self._prompts.get(session)
        cut = None if last is None else self._last_cut(last, text)
        if last is None or cut is None:
            encoding = self.tokenizer.encode_with_cuts(text)
            reused = 0
        else:
            end, reused = last.encoding.cut_ends[cut], last.encoding.cut_counts[cut]
            tail = self.tokenizer.encode_with_cuts(text[end:])
            encoding = CutEncoding(
                last.encoding.ids[:reused] + tail.ids,
                last.encoding.cut_ends[: cut + 1] + [end + e for e in tail.cut_ends],
                last.encoding.cut_counts[: cut + 1] + [reused + n for n in tail.cut_counts],
            )
        self._keep(session, _Prompt(text, encoding), reused)
        return list(encoding.ids)

    def _last_cut(self, last: _Prompt, text: str) -> int | None:
        """The index of the last of ``last``'s cuts that ``text`` keeps (module doc), or None."""
        shared = shared_length(last.text, text)
        ids, ends, counts = last.encoding
        for k in range(bisect_right(ends, shared) - 1, -1, -1):
            token = self.tokenizer.cuts.get(ids[counts[k] - 1])
            if (
                token is not None
                and text.startswith(token, ends[k] - len(token))
                and self._settled(last.text, text, ends[k], shared)
            ):
                return k
        return None

    def _settled(self, old: str, new: str, end: int, shared: int) -> bool:
        """Whether no added token starts before ``end`` and ends past ``shared`` in ``old`` or ``new``."""
        for added in self.tokenizer.added_texts:
            start = max(0, shared - len(added) + 1)
            if start < end and (
                old.find(added, start, end - 1 + len(added)) >= 0 or new.find(added, start, end - 1 + len(added)) >= 0
            ):
                return False
        return True

    def _keep(self, session: str, prompt: _Prompt, reused: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = IncrementalStats(s.prompts + 1, s.reused + (reused > 0), s.reused_tokens + reused)
        self._prompts.keep(session, prompt, len(prompt.encoding.ids))

    @property
    def stats(self) -> IncrementalStats:
        """What :meth:`encode` did since the start."""
        return self._stats

    @property
    def held(self) -> tuple[int, int]:
        """The sessions kept and the token ids they hold."""
        return self._prompts.held
