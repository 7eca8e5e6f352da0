"""The model's tokenizer at the router: ``tokenizer.json`` read by the ``tokenizers`` library,
no vLLM and no transformers. The same file every engine of the fleet loads."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvpilot.routing.index.chain import pack_tokens

TOKENIZER_FILE = "tokenizer.json"
"""The file of a model directory the router tokenizes with (the engines' own)."""
PROBE_HEADS = ("", "Hello, world.\n")
PROBE_TAILS = ("hello", " hello world", "\n\n  x\ty", "élan 12")
"""Text before and after a candidate cut token in the load-time probes of :attr:`PromptTokenizer.cuts`:
a word, leading spaces and newlines (what a pre-tokenizer may prefix or merge), non-ASCII."""


class PromptError(ValueError):
    """A prompt the router cannot turn into token ids; the message names the field."""


class CutEncoding(NamedTuple):
    """A text's token ids, and where in them the tokenizer starts afresh (see :attr:`PromptTokenizer.cuts`)."""

    ids: list[int]
    cut_ends: list[int]
    """The character offset in the text where each cut token ends, ascending."""
    cut_counts: list[int]
    """For each of those, how many ids precede that offset (the cut token's own included)."""


class PromptTokenizer:
    """Encodes text as the engines' tokenizer does (its post-processor adds BOS where the
    model's does), and checks token-id prompts against the vocabulary."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        added = self._tokenizer.get_added_tokens_decoder()
        self.added_texts = tuple(sorted({token.content for token in added.values() if token.content}))
        """Every added token's text: the tokenizer matches these in the raw text before anything else."""
        self.cuts: dict[int, str] = self._cut_tokens(added)
        """The added tokens the tokenizer cannot merge across, by id: for each, encoding
        ``head + token + tail`` without special tokens gives ``encode(head + token) + encode(tail)``,
        the token's id last in the first part (the tokenizer splits its input at added tokens
        first, then pre-tokenizes and normalizes each piece alone). Checked at load on
        :data:`PROBE_HEADS` and :data:`PROBE_TAILS`; empty where any added token strips
        whitespace beside it or matches whole words only (its match would depend on the text
        on both sides of a cut), or where no token passes (a pre-tokenizer that prefixes only
        the text's first piece, for one)."""

    def _cut_tokens(self, added: Mapping[int, Any]) -> dict[int, str]:
        """:attr:`cuts`, from the tokenizer's added tokens (``tokenizers.AddedToken`` by id)."""
        tokens = {i: t for i, t in added.items() if t.content}
        if any(t.lstrip or t.rstrip or t.single_word for t in tokens.values()):
            return {}
        return {i: t.content for i, t in tokens.items() if self._splits_at(i, t.content)}

    def _splits_at(self, token_id: int, token: str) -> bool:
        for head in PROBE_HEADS:
            before = self.encode(head + token, add_special_tokens=False)
            if not before or before[-1] != token_id:
                return False
            for tail in PROBE_TAILS:
                whole = self.encode(head + token + tail, add_special_tokens=False)
                if whole != before + self.encode(tail, add_special_tokens=False):
                    return False
        return True

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids; ``add_special_tokens`` as vLLM's request field of that name
        (true for a completions prompt, false for a rendered chat, by default)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_cuts(self, text: str) -> CutEncoding:
        """``text``'s token ids without special tokens, with the offsets of its :attr:`cuts`."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = encoding.ids
        at = [i for i, token in enumerate(ids) if token in self.cuts]
        offsets = encoding.offsets if at else ()
        return CutEncoding(ids, [offsets[i][1] for i in at], [i + 1 for i in at])

    def encode_keeping_last(self, text: str, keep: int, *, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids truncated to ``keep`` as vLLM's tokenizer truncates them (from the
        left, ``transformers``' ``truncation=True, max_length=keep``): the special tokens stay
        and the text's last tokens fill the rest; with fewer places than special tokens, the
        last ``keep`` ids of those (vLLM slices what the tokenizer returned); ``keep`` 0: none."""
        if keep <= 0:
            return []
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        added = self._tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(0, keep - added), direction="left")
        ids: list[int] = self._tokenizer.post_process(encoding, add_special_tokens=add_special_tokens).ids
        return ids[-keep:]

    def text_token_ids(self, text: str) -> list[int]:
        """The token ids of a piece of text, without special tokens: for building token-id
        prompts (a history plus a tool's output), never BOS in the middle."""
        return self.encode(text, add_special_tokens=False)

    def checked_ids(self, prompt: list[object], field: str = "prompt") -> list[int]:
        """``prompt`` itself (not copied) once every item is a token id of the vocabulary;
        raises :class:`PromptError` naming ``field`` (JSON ``true``/``false`` read as 1/0,
        as in Python)."""
        try:  # packed once and checked with numpy, not item by item in Python
            packed = np.frombuffer(pack_tokens(prompt), dtype=np.uint32)  # type: ignore[arg-type]
        except ValueError:
            packed = None
        if packed is None or not len(packed) or packed.max() >= self.vocab_size:
            raise PromptError(f"'{field}' token ids must be integers in [0, {self.vocab_size}) (the vocabulary)")
        return prompt  # type: ignore[return-value]
