"""The router's chat rendering (routing/serve/chat.py) against vLLM's own rules, piece by
piece, with vLLM's functions as the oracle where they can run without an engine (the whole
rendering is held to an engine's ``/tokenize`` in tests/e2e/test_parity.py)."""

from __future__ import annotations

import json
import re

import pytest

from kvpilot.deploy.tiny_model import PLAIN_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE
from kvpilot.routing.serve.chat import ChatError, ChatTemplate

OPENAI_STYLE = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}\n{% endfor %}"
)
VIA_ASSIGNMENT = (
    "{% set turns = messages %}{% for m in turns %}{% set c = m.content %}"
    "{% if c is string %}{{ c }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
)
TEMPLATES = {
    "plain": PLAIN_CHAT_TEMPLATE,
    "tools": TOOLS_CHAT_TEMPLATE,
    "openai": OPENAI_STYLE,
    "assigned": VIA_ASSIGNMENT,
}
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_content_format_is_detected_as_vllm_detects_it(name: str) -> None:
    from vllm.renderers.hf import _detect_content_format

    template = TEMPLATES[name]
    vllm_says = _detect_content_format(template, default="string")
    assert ChatTemplate(template, SPECIALS).openai_content == (vllm_says == "openai"), vllm_says


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "strict": True, "extra": 1}},
        {"function": {"name": "f"}, "defer_loading": True},
    ],
)
def test_tools_reach_the_template_as_vllm_dumps_them(tool: dict) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    template = ChatTemplate("{{ tools | tojson }}", SPECIALS)
    rendered = template.render({"messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    assert json.loads(rendered) == [ChatCompletionToolsParam.model_validate(tool).model_dump()]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [('{"path": "a"}', {"path": "a"}), ("not json", {}), ("[1, 2]", {}), ("", {}), (None, {}), ({"k": 1}, {"k": 1})],
)
def test_tool_call_arguments_become_objects_as_vllm_makes_them(arguments: object, expected: dict) -> None:
    from vllm.renderers.chat_utils import _postprocess_messages

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    template = ChatTemplate("{{ messages[0]['tool_calls'][0]['function']['arguments'] | tojson }}", SPECIALS)
    rendered = template.render({"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]})
    theirs = [{"role": "assistant", "content": "", "tool_calls": [json.loads(json.dumps(call))]}]
    _postprocess_messages(theirs)  # type: ignore[arg-type]
    assert json.loads(rendered) == expected == theirs[0]["tool_calls"][0]["function"]["arguments"]


def test_text_parts_are_joined_for_a_string_template_and_kept_for_an_openai_one() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "input_text", "text": "two"}, "three"]
    body = {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    assert ChatTemplate(PLAIN_CHAT_TEMPLATE, SPECIALS).render(body) == "<s><|user|>\none\ntwo\nthree<|end|>\n"
    assert ChatTemplate(OPENAI_STYLE, SPECIALS).render(body) == "user:onetwothree"  # trim_blocks ate the newline


def test_a_continued_final_message_ends_the_text() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert ChatTemplate(PLAIN_CHAT_TEMPLATE, SPECIALS).render(body) == "<s><|user|>\nhi<|end|>\n<|assistant|>\nLet me"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template() -> None:
    template = ChatTemplate(TOOLS_CHAT_TEMPLATE, SPECIALS)
    user = {"messages": [{"role": "user", "content": "hi"}]}
    off = template.render({**user, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    assert template.render({**user, "reasoning_effort": "none"}) == off  # vLLM: effort "none" turns thinking off
    assert template.render(user).endswith("<|assistant|>\n")


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"add_generation_prompt": True, "continue_final_message": True}, "'continue_final_message'"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "'chat_template_kwargs'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "'messages[0].content[0]'",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]}]}, "'tool_calls[0]'"),
        ({"tools": [{"type": "function", "function": {}}]}, "'tools[0].function.name'"),
        ({"messages": []}, "'messages'"),
    ],
)
def test_what_vllm_would_refuse_is_refused_naming_the_field(body: dict, names: str) -> None:
    with pytest.raises(ChatError, match=re.escape(names)):
        ChatTemplate(PLAIN_CHAT_TEMPLATE, SPECIALS).render({"messages": [{"role": "user", "content": "x"}], **body})
