"""A chat request's prompt text, rendered as vLLM renders it, without vLLM.

The router routes a chat on the token ids the engine will compute for it, so it renders
the request exactly as vLLM's chat server does before tokenizing (vLLM 0.32-0.34,
``vllm/renderers/chat_utils.py`` and ``hf.py``, then transformers' ``apply_chat_template``):

1. **Messages** (``parse_chat_messages``): ``content`` ``None`` is empty; text parts are
   joined with ``"\\n"`` for a template that reads ``content`` as a string, or kept as
   ``[{"type": "text", "text": ...}]`` for one that iterates over it (the *content format*,
   detected from the template's syntax tree as vLLM detects it); an assistant's
   ``tool_calls`` and ``reasoning`` (also as ``reasoning_content``), a tool's
   ``tool_call_id`` (its text parts joined), and any ``name`` are kept; then every tool
   call's ``arguments`` become an object (a JSON string parsed; unparsable, empty or not an
   object: ``{}``) and an empty ``tool_calls`` list is dropped.
2. **Tools** as vLLM's ``ChatCompletionToolsParam.model_dump()`` hands them over:
   ``{"type": "function", "function": {"name", "description", "parameters"}}``, ``None``
   where the client sent none, ``strict`` and ``defer_loading`` only when sent.
3. **Template variables**: the request's ``chat_template_kwargs``, overridden by
   ``add_generation_prompt`` (default true), ``continue_final_message`` (default false),
   ``documents`` and ``reasoning_effort`` when set (``reasoning_effort`` also sets
   ``enable_thinking`` unless the kwargs do), and the tokenizer's named special tokens
   beneath them all; rendered in transformers' sandbox (``trim_blocks``, ``lstrip_blocks``,
   ``loopcontrols``, its ``tojson``, ``raise_exception`` and ``strftime_now``).
4. **continue_final_message**: the text ends where the last message's content ends.

Whatever vLLM would refuse here (both generation switches set, a ``chat_template`` or
``tokenize`` kwarg, a tool call that is not a function) is refused with vLLM's reason, as
a :class:`ChatError`. A part that is not text (images, audio) is refused naming its
message: the router routes text only. tests/e2e/test_parity.py holds the rendering
against the engine's own ``POST /tokenize``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpilot.routing.serve.template_loop import TURNS, MessageLoop, message_loop


class ChatError(ValueError):
    """A chat request the router cannot render; the message names the field."""


JINJA_TEMPLATE = "chat_template.jinja"
"""The file transformers saves a tokenizer's chat template to, beside ``tokenizer_config.json``."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' named special tokens: each one the tokenizer sets is a template variable."""
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
"""Content parts vLLM reads as text: from their ``text`` field (``refusal`` and ``thinking``
from the field of their name); one without it is skipped."""
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' marker after the final message when it is continued."""
REFUSED_KWARGS = frozenset({"chat_template", "tokenize"})
"""``chat_template_kwargs`` vLLM refuses."""


class _Generation(Extension):
    """transformers' ``{% generation %}`` tag, which renders its body (no mask is asked here)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it an instance attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """The model's chat template with its special tokens (see the module doc)."""

    def __init__(self, template: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.source = template
        self._template = env.from_string(template)
        self._special_tokens = dict(special_tokens)
        self.openai_content = iterates_content(env.parse(template))
        """Whether the template iterates over a message's content (vLLM's "openai" content
        format: text parts kept as a list), else reads it as a string."""
        self.message_loop: MessageLoop | None = message_loop(env, template)
        """The template's message loop and tail, each renderable alone, where its form allows
        (:mod:`kvpilot.routing.serve.template_loop`); None: it renders only whole."""

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
        specials = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(cfg.get(name)))}
        return cls(template, specials)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text vLLM renders for the chat request ``body`` (module doc).

        Raises :class:`ChatError` naming the bad field.
        """
        variables = self.variables(body)
        messages = self.conversation(body.get("messages"))
        return self.finished(self.whole(messages, variables), messages[-1], variables)

    def whole(self, messages: list[dict[str, Any]], variables: Mapping[str, Any]) -> str:
        """The template rendered over ``messages`` (:meth:`conversation`'s) with
        ``variables`` (:meth:`variables`'), before :meth:`finished`."""
        return _rendered(self._template, {**variables, "messages": messages})

    def turns(self, messages: list[dict[str, Any]], variables: Mapping[str, Any]) -> str:
        """What the template's message loop renders for ``messages`` alone (its
        :attr:`message_loop` must not be None)."""
        assert self.message_loop is not None
        return _rendered(self.message_loop.loop, {**variables, TURNS: messages})

    def tail(self, variables: Mapping[str, Any]) -> str:
        """What the template renders after its message loop (its :attr:`message_loop` must not
        be None)."""
        assert self.message_loop is not None
        return _rendered(self.message_loop.tail, variables)

    def finished(self, text: str, final: dict[str, Any], variables: Mapping[str, Any]) -> str:
        """``text`` (:meth:`whole`'s) as the prompt: cut after the ``final`` message's content
        where the chat is continued (module doc, 4)."""
        if not variables.get("continue_final_message"):
            return text
        return _cut_after_final(text, _continued_text(final))

    def variables(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The template's variables for the chat request ``body`` (module doc, 2 and 3)."""
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict):
            raise ChatError("'chat_template_kwargs' must be an object")
        if refused := sorted(REFUSED_KWARGS & user.keys()):
            raise ChatError(f"'chat_template_kwargs' may not set {', '.join(refused)}")
        add_generation = body.get("add_generation_prompt", True)
        continued = body.get("continue_final_message", False)
        if add_generation and continued:
            raise ChatError("'continue_final_message' and 'add_generation_prompt' cannot both be true")
        overrides: dict[str, Any] = {"add_generation_prompt": add_generation, "continue_final_message": continued}
        for name in ("documents", "reasoning_effort"):
            if body.get(name) is not None:
                overrides[name] = body[name]
        effort = body.get("reasoning_effort")
        if effort is not None and "enable_thinking" not in user:
            overrides["enable_thinking"] = effort != "none"
        kwargs: dict[str, Any] = {"tools": _tool_schemas(body.get("tools")), "documents": None}
        return {**kwargs, **self._special_tokens, **user, **overrides}

    def conversation(self, messages: object, start: int = 0) -> list[dict[str, Any]]:
        """``messages[start:]`` as the template reads them (module doc, 1); ``messages`` must be
        a non-empty list."""
        if not isinstance(messages, list) or not messages:
            raise ChatError("'messages' must be a non-empty list")
        out = [self._message(i, messages[i]) for i in range(start, len(messages))]
        for message in out:
            _tool_call_arguments_as_objects(message)
        return out

    def _message(self, i: int, message: object) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise ChatError(f"'messages[{i}]' must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"'messages[{i}].role' must be a non-empty string")
        texts = list(_texts(i, message.get("content")))
        out: dict[str, Any] = {"role": role}
        if self.openai_content:
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                if not isinstance(message["tool_calls"], list):
                    raise ChatError(f"'messages[{i}].tool_calls' must be a list")
                out["tool_calls"] = [dict(c) if isinstance(c, dict) else c for c in message["tool_calls"]]
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                out["tool_call_id"] = message["tool_call_id"]
            if self.openai_content:
                out["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out


def _rendered(template: Template, variables: Mapping[str, Any]) -> str:
    """``template`` rendered with ``variables``; a template's own error as a :class:`ChatError`."""
    try:
        return template.render(variables)
    except TemplateError as exc:
        raise ChatError(f"chat template failed on 'messages': {exc}") from None


def _texts(i: int, content: object) -> Iterator[str]:
    """The text of a message's ``content`` (a string, ``None`` or a list of text parts)."""
    if content is None:
        return
    if isinstance(content, str):
        yield content
        return
    if not isinstance(content, list):
        raise ChatError(f"'messages[{i}].content' must be a string, null or a list of text parts")
    for j, part in enumerate(content):
        if isinstance(part, str):
            yield part
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise ChatError(f"'messages[{i}].content[{j}]' is a {kind!r} part: the router takes text parts only")
        text = part.get(kind if kind in ("thinking", "refusal") else "text")
        if text is not None:
            if not isinstance(text, str):
                raise ChatError(f"'messages[{i}].content[{j}]' text must be a string")
            yield text


def _tool_call_arguments_as_objects(message: dict[str, Any]) -> None:
    """vLLM's ``_postprocess_messages``: each tool call's ``arguments`` an object."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ChatError(f"'tool_calls[{k}]': chat completions only support assistant tool_calls of type 'function'")
        function = call["function"] = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        function["arguments"] = arguments if isinstance(arguments, dict) else {}


def _tool_schemas(tools: object) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` hands them to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("'tools' must be a list")
    out = []
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError(f"'tools[{k}].function.name' must be a string")
        if tool.get("type", "function") != "function":
            raise ChatError(f"'tools[{k}].type' must be 'function'")
        defer = function.get("defer_loading", tool.get("defer_loading"))
        dumped = {k: function.get(k) for k in ("name", "description", "parameters")}
        optional = {"strict": function.get("strict"), "defer_loading": defer}
        dumped |= {name: value for name, value in optional.items() if value is not None}
        schema: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            schema["defer_loading"] = tool["defer_loading"]
        out.append(schema)
    return out


def _continued_text(final: dict[str, Any]) -> str:
    """The final message's text that a continued chat ends with (transformers' rule)."""
    content = final.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if "text" in part]
        if not texts:
            raise ChatError("'continue_final_message': the final message has no text to continue")
        return str(texts[-1])
    return str(content)


def _cut_after_final(text: str, final: str) -> str:
    """``text`` up to the end of the final message's ``final`` content (transformers cuts at
    a marker it appends to the content; cutting at the content's last occurrence is the same
    wherever the template keeps the content whole)."""
    if final.strip() not in text:
        raise ChatError("'continue_final_message': the final message does not appear in the rendered chat")
    at = text.rindex(final.strip())
    if text[at : at + len(final.lstrip())] == final.lstrip():
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


# ---- vLLM's content-format detection (renderers/hf.py), on jinja2's syntax tree ----------


def iterates_content(root: nodes.Template) -> bool:
    """Whether a loop in the template iterates over a message's ``content`` (vLLM's
    "openai" content format), following the names that ``messages`` is assigned or looped to."""
    message_vars = {target for _, target in _loops_over(root, _names_bound_to(root, "messages"))}
    for loop in root.find_all(nodes.For):
        if any(_accesses(loop.iter, name, "content") for name in message_vars):
            return True
        if isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            return True
    return False


def _names_bound_to(root: nodes.Template, name: str) -> set[str]:
    names, queue = {name}, [name]
    while queue:
        current = queue.pop()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and _accesses(assign.node, current) and target.name not in names:
                names.add(target.name)
                queue.append(target.name)
    return names


def _loops_over(root: nodes.Template, names: set[str]) -> Iterator[tuple[nodes.For, str]]:
    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(_accesses(loop.iter, n) for n in names):
            yield loop, loop.target.name


def _accesses(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or its ``key`` item or attribute), possibly filtered, tested or sliced."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _accesses(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.name == name
    if isinstance(node, nodes.Getitem):
        return _accesses(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _accesses(node.node, name) and node.attr == key
    return False
