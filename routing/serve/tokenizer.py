"""The model's tokenizer at the router: ``tokenizer.json`` read by the ``tokenizers`` library,
no vLLM and no transformers. The same file every engine of the fleet loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpilot.routing.index.chain import pack_tokens

TOKENIZER_FILE = "tokenizer.json"
"""The file of a model directory the router tokenizes with (the engines' own)."""


class PromptError(ValueError):
    """A prompt the router cannot turn into token ids; the message names the field."""


class PromptTokenizer:
    """Encodes text as the engines' tokenizer does (its post-processor adds BOS where the
    model's does), and checks token-id prompts against the vocabulary."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids; ``add_special_tokens`` as vLLM's request field of that name
        (true for a completions prompt, false for a rendered chat, by default)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

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
