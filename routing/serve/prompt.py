"""A request's prompt as the engine's token ids, computed at the router without vLLM.

The engines render and tokenize every request themselves; the router routes on the token
ids they will compute (the block hashes of :mod:`kvpilot.routing.index.chain`), and beside
Dynamo hands them to the frontend (``nvext.token_data``). So the ids follow vLLM's rules:

- completions: a text ``prompt`` is encoded with special tokens unless the request's
  ``add_special_tokens`` is false (BOS on Llama-, Mistral- and Gemma-family models), or,
  beside Dynamo, without them (its frontend's rule); a token-id ``prompt`` is taken as it is;
- chat: the messages rendered as vLLM renders them (:mod:`kvpilot.routing.serve.chat`:
  the template, tools, ``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message``), encoded without special tokens unless the request's
  ``add_special_tokens`` is true;
- ``truncate_prompt_tokens`` (and ``truncation_side``) applied as vLLM applies them
  (:mod:`kvpilot.routing.serve.truncation`).

A session's chat is rendered from its last one (:mod:`kvpilot.routing.serve.incremental_chat`)
and a session's text without special tokens (a chat, as a rule) is tokenized from its last
prompt's ids on (:mod:`kvpilot.routing.serve.incremental_tokens`): the same text and ids, in
time proportional to what the step added.

A mismatch would cost a cache miss, never a wrong answer (each engine tokenizes for itself
and the connector verifies every block it attaches); tests/e2e/test_parity.py holds these
ids equal to the engine's own ``POST /tokenize``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvpilot.routing.serve.chat import ChatError, ChatTemplate
from kvpilot.routing.serve.incremental_chat import IncrementalChat
from kvpilot.routing.serve.incremental_tokens import IncrementalTokens
from kvpilot.routing.serve.tokenizer import PromptError, PromptTokenizer
from kvpilot.routing.serve.truncation import Truncation
from kvpilot.routing.serve.upstream import Api


class EnginePrompt:
    """The token ids an engine computes for a request's prompt (module doc).
    ``completion_special_tokens``: whether the engines add special tokens to a text
    completion by default (vLLM's completions endpoint does; Dynamo 1.6.1's frontend does
    not, measured in tests/e2e/test_dynamo.py). ``sessions``: the sessions' last prompts
    (by default :class:`IncrementalTokens`' own bounds)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        chat_template: ChatTemplate | None,
        *,
        completion_special_tokens: bool = True,
        sessions: IncrementalTokens | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.completion_special_tokens = completion_special_tokens
        self.sessions = IncrementalTokens(tokenizer) if sessions is None else sessions
        self.chats = None if chat_template is None else IncrementalChat(chat_template)
        """The sessions' last chats (:class:`IncrementalChat`' own bounds)."""

    def token_ids(
        self,
        api: Api,
        body: Mapping[str, Any],
        *,
        truncation: Truncation | None = None,
        before_encoding: Callable[[str], None] | None = None,
        session: str | None = None,
    ) -> list[int]:
        """The prompt's token ids for ``body`` sent to ``api``, truncated as ``truncation``
        says (the request's, :func:`~kvpilot.routing.serve.truncation.truncation_of`); raises
        :class:`PromptError` or :class:`ChatError` naming the field (a batch of prompts, a model
        without a chat template, a value of the wrong type). ``before_encoding`` is called
        with the text (the prompt, or the rendered chat) before it is tokenized, so that a
        bound on its size can refuse it without the tokenizer's work; whatever it raises
        propagates. ``session``: the request's session key (scoped as the router keys its
        sessions); a chat is then rendered from that session's last chat, and a text encoded
        without special tokens nor truncation tokenized from that session's last prompt on
        (module doc), to the same text and ids."""
        add_special = body.get("add_special_tokens", api is Api.COMPLETIONS and self.completion_special_tokens)
        if not isinstance(add_special, bool):
            raise PromptError("'add_special_tokens' must be true or false")
        if api is Api.CHAT:
            if self.chat_template is None or self.chats is None:
                raise ChatError("this model has no chat template: use /v1/completions")
            text = self.chat_template.render(body) if session is None else self.chats.render(session, body)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                ids = self.tokenizer.checked_ids(prompt)
                return ids if truncation is None else truncation.of_ids(ids)
            if not isinstance(prompt, str) or not prompt:
                raise PromptError("'prompt' must be a non-empty string or a non-empty list of token ids")
            text = prompt
        if before_encoding is not None:
            before_encoding(text)
        if truncation is None:
            if session is not None and not add_special:
                return self.sessions.encode(session, text)
            return self.tokenizer.encode(text, add_special_tokens=add_special)
        if truncation.side is None:
            return self.tokenizer.encode_keeping_last(text, truncation.keep, add_special_tokens=add_special)
        return truncation.of_ids(self.tokenizer.encode(truncation.of_text(text), add_special_tokens=add_special))
