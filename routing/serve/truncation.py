"""vLLM 0.32's ``truncate_prompt_tokens`` (and ``truncation_side``), applied to the router's
token ids so that it routes on the ids the engine keeps. Pure.

vLLM's rules (``vllm/renderers/params.py``, ``TokenizeParams``), for the generation
endpoints, whose tokenizer truncates from the left:

- ``truncate_prompt_tokens`` N keeps N tokens; ``-1`` means the model's length, less one
  token held back for the output when the request names an output length (``max_tokens``,
  16 for a completion that sends none, or a chat's ``max_completion_tokens``), the whole
  length when it names none (a chat without either);
- a text prompt (or a rendered chat) without ``truncation_side`` is truncated by the
  tokenizer: its special tokens stay and the text's last tokens fill the rest (a completion
  keeps its BOS); with ``truncation_side`` it is tokenized whole and then sliced, special
  tokens and all (``left``: the last N, ``right``: the first N), after its characters
  were cut to what ``max_model_len`` tokens can hold, from that side;
- a token-id prompt is sliced (from the left unless ``truncation_side`` says ``right``);
- N = 0 keeps nothing.

The engines are sent the client's body as it came and truncate it themselves; these ids are
what the router hashes and routes on (and beside Dynamo, what it hands the frontend).
tests/unit/routing/test_routing_truncation.py holds them equal to vLLM's own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.routing.serve.engine_checks import COMPLETIONS_DEFAULT_MAX_TOKENS
from kvpilot.routing.serve.upstream import Api


class TruncationSide(str, enum.Enum):
    """vLLM's ``truncation_side`` request field."""

    LEFT = "left"
    RIGHT = "right"


@dataclass(frozen=True, slots=True)
class Truncation:
    """A request's truncation: ``keep`` tokens; ``side`` as the request named it (``None``:
    the tokenizer truncates, from the left, keeping its special tokens); ``max_chars``, the
    most characters vLLM tokenizes of a text when ``side`` is named (0: no cut)."""

    keep: int
    side: TruncationSide | None = None
    max_chars: int = 0

    def of_ids(self, ids: list[int]) -> list[int]:
        """``ids`` truncated as vLLM truncates a prompt's token ids (``ids`` itself when
        there are at most ``keep`` of them)."""
        if self.keep >= len(ids):
            return ids
        if self.keep == 0:
            return []
        return ids[: self.keep] if self.side is TruncationSide.RIGHT else ids[-self.keep :]

    def of_text(self, text: str) -> str:
        """``text`` as vLLM tokenizes it: cut to ``max_chars`` from ``side`` when a side is
        named and the text is longer, else as it is."""
        if self.side is None or not self.max_chars or len(text) <= self.max_chars:
            return text
        return text[-self.max_chars :] if self.side is TruncationSide.LEFT else text[: self.max_chars]


def truncation_of(
    body: Mapping[str, Any], api: Api, *, max_model_len: int, max_chars_per_token: int
) -> Truncation | None:
    """The truncation ``body`` asks for (module doc), or ``None`` when it asks for none, or
    asks for ``-1`` while ``max_model_len`` is unknown (0: the engines truncate it, and the
    router's ids are then the whole prompt's). Raises ``ValueError`` for a
    ``truncation_side`` that is neither ``left`` nor ``right``; reads ``body`` only."""
    keep = body.get("truncate_prompt_tokens")
    named = body.get("truncation_side")
    side = None if named is None else TruncationSide(named)
    if keep is None:
        return None
    if keep < 0:
        if not max_model_len:
            return None
        keep = max_model_len if not _output_tokens(body, api) else max(0, max_model_len - 1)
    return Truncation(keep, side, max_model_len * max_chars_per_token)


def _output_tokens(body: Mapping[str, Any], api: Api) -> int:
    """vLLM's ``TokenizeParams.max_output_tokens``: the output length the request names (a
    completion's ``max_tokens`` is 16 when it is absent or null), 0 if none."""
    if api is Api.CHAT:
        named = body.get("max_completion_tokens")
        return int(body.get("max_tokens") or 0) if named is None else int(named)
    named = body.get("max_tokens")
    return COMPLETIONS_DEFAULT_MAX_TOKENS if named is None else int(named)
