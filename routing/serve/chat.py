"""Chat completions at the router: render messages with the model's chat template,
turn a chat request into a completions request for the engines, and convert the
engines' completions answers (whole or streamed) back into chat format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_ONLY_KEYS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs")
UNSUPPORTED_CHAT_KEYS = ("tools", "tool_choice", "functions", "function_call", "response_format")


class ChatError(ValueError):
    """A chat request the router cannot render; the message names the field."""


JINJA_TEMPLATE = "chat_template.jinja"
"""The file transformers saves a tokenizer's chat template to, beside ``tokenizer_config.json``."""


class ChatTemplate:
    """The model's ``chat_template`` (from ``tokenizer_config.json``), rendered with jinja2
    the way Hugging Face does (sandboxed, ``trim_blocks``, ``lstrip_blocks``)."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_chat_error
        self._template = env.from_string(template)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The model's template as transformers saves it: ``model_dir/chat_template.jinja``
        (transformers 4.50 and later write it there), else ``tokenizer_config.json``'s
        ``chat_template``; None if it has neither. The special tokens come from
        ``tokenizer_config.json``."""
        path = model_dir / "tokenizer_config.json"
        if not path.exists():
            return None
        cfg = json.loads(path.read_text())
        jinja = model_dir / JINJA_TEMPLATE
        template = jinja.read_text() if jinja.is_file() else cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            return None
        return cls(template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages: object) -> str:
        """The prompt text for OpenAI ``messages`` (generation prompt added).

        Raises :class:`ChatError` naming the bad field.
        """
        try:
            return self._template.render(
                messages=_checked_messages(messages), add_generation_prompt=True, **self._specials
            )
        except TemplateError as exc:
            raise ChatError(f"chat template failed on 'messages': {exc}") from None


def _raise_chat_error(message: str) -> None:
    raise ChatError(message)


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _checked_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"'messages[{i}]' must be an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ChatError(f"'messages[{i}].role' must be a non-empty string")
        if isinstance(content, list):  # text parts only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ChatError(f"'messages[{i}].content' parts must all be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ChatError(f"'messages[{i}].content' must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def chat_to_completion_body(body: dict[str, Any]) -> dict[str, Any]:
    """The completions request for a chat request (the prompt is set by the caller)."""
    for key in UNSUPPORTED_CHAT_KEYS:
        if body.get(key) is not None:
            raise ChatError(f"'{key}' is not supported by the router")
    out = {k: v for k, v in body.items() if k not in CHAT_ONLY_KEYS}
    if body.get("max_completion_tokens") is not None:
        out["max_tokens"] = body["max_completion_tokens"]
    if body.get("logprobs"):
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ChatError("'top_logprobs' must be a non-negative integer")
        out["logprobs"] = top
    return out


def _chat_logprobs(lp: Any) -> Any:
    if not lp:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t, x), "top_logprobs": [entry(k, v) for k, v in (top or {}).items()]}
            for t, x, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=False)
        ]
    }


def chat_response(completion: dict[str, Any], request_id: str) -> dict[str, Any]:
    """An engine's ``text_completion`` as a ``chat.completion``."""
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "logprobs": _chat_logprobs(c.get("logprobs")),
            "finish_reason": c.get("finish_reason"),
        }
        for c in completion["choices"]
    ]
    return {**_chat_head(completion, request_id, "chat.completion"), "choices": choices}


def chat_chunk(chunk: dict[str, Any], request_id: str, first: bool) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk as a ``chat.completion.chunk``."""
    choices = []
    for c in chunk.get("choices") or ():
        delta = {"role": "assistant", "content": c["text"]} if first else {"content": c["text"]}
        choices.append(
            {
                "index": c["index"],
                "delta": delta,
                "logprobs": _chat_logprobs(c.get("logprobs")),
                "finish_reason": c.get("finish_reason"),
            }
        )
    return {**_chat_head(chunk, request_id, "chat.completion.chunk"), "choices": choices}


def _chat_head(completion: dict[str, Any], request_id: str, kind: str) -> dict[str, Any]:
    head: dict[str, Any] = {"id": request_id, "object": kind}
    head.update(created=completion.get("created"), model=completion.get("model"))
    if completion.get("usage") is not None:
        head["usage"] = completion["usage"]
    return head


# ---- metrics --------------------------------------------------------------------
