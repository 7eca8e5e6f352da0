"""A session's next chat rendered from its last one (routing/serve/incremental_chat.py, on
routing/serve/template_loop.py's split): always the whole render's text, rendered from the
last chat only where the template's form makes that exact."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvpilot.deploy.tiny_model import PLAIN_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE
from kvpilot.routing.serve.chat import ChatError, ChatTemplate
from kvpilot.routing.serve.incremental_chat import IncrementalChat

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPLIT = {"tools": TOOLS_CHAT_TEMPLATE, "plain": PLAIN_CHAT_TEMPLATE, "chatml": CHATML}
"""Templates of the split form: a head, a loop rendering each message alone, a tail."""
WHOLE = {
    "loop index": (
        "{% for message in messages %}{% set content = message['role'] + ': ' + message['content'] %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}\n{% endfor %}"
    ),
    "loop last": "{% for m in messages %}{{ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}",
    "alternation": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('alternate') }}{% endif %}"
        "[{{ message['role'] }}]{{ message['content'] }}{% endfor %}"
    ),
    "namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ m.content }}"
        "{% endfor %}"
    ),
    "tail reads messages": (
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if messages[-1].role == 'user' %}A:{% endif %}"
    ),
    "head counts messages": "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "clock": "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "break": "{% for m in messages %}{% if m.role == 'tool' %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "reversed scan": (
        "{% set ns = namespace(last=0) %}{% for m in messages[::-1] %}{% if m.role == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
        "{{ ns.last }}"
    ),
    "head rebinds a variable": (
        "{% set tools = tools or [] %}{% for m in messages %}{{ m.content }}{{ tools | length }}{% endfor %}"
    ),
    "loop reads the head's": (
        "{% set first = messages[0]['content'] %}{% for m in messages %}{{ first }}{{ m.content }}{% endfor %}"
    ),
    "two loops": "{% for m in messages %}{{ m.content }}{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}",
}
"""Templates the split would get wrong, or cannot show right: rendered whole."""


def _chats(rng: random.Random, steps: int) -> list[dict[str, Any]]:
    """A session's successive chats: mostly appended turns, sometimes an edit, a shortened
    history or other variables."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Fix it."},
    ]
    out, thinking = [], True
    for k in range(steps):
        roll = rng.random()
        if roll < 0.1 and len(messages) > 3:
            messages = [dict(m) for m in messages]
            messages[rng.randrange(len(messages))]["content"] = f"edited {k}"
        elif roll < 0.15 and len(messages) > 3:
            messages = messages[: rng.randint(2, len(messages) - 1)]
        elif roll < 0.2:
            thinking = not thinking
        call = {"id": f"c{k}", "type": "function", "function": {"name": "grep", "arguments": '{"path": "a"}'}}
        messages = [
            *messages,
            {"role": "assistant", "content": f"step {k}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": f"result {k} " * rng.randint(1, 5)},
            {"role": "user", "content": f"go on {k}"},
        ][: len(messages) + rng.randint(1, 3)]
        out.append({"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}})
    return out


@pytest.mark.parametrize("name", sorted(SPLIT) + sorted(WHOLE))
@pytest.mark.parametrize("seed", range(3))
def test_a_session_s_chats_render_as_the_whole_template_does(name: str, seed: int) -> None:
    template = ChatTemplate({**SPLIT, **WHOLE}[name], SPECIALS)
    assert (template.message_loop is not None) == (name in SPLIT)
    chats = IncrementalChat(template)
    for k, body in enumerate(_chats(random.Random(seed), 30)):
        try:
            whole = template.render(body)
        except ChatError as exc:  # the alternation check: the same error either way
            with pytest.raises(ChatError, match=str(exc)):
                chats.render("s", body)
            continue
        assert chats.render("s", body) == whole, (name, seed, k)
    assert (chats.stats.appended > 10) == (name in SPLIT), chats.stats


def test_only_appended_chats_with_the_same_variables_reuse_the_last() -> None:
    template = ChatTemplate(TOOLS_CHAT_TEMPLATE, SPECIALS)
    chats = IncrementalChat(template)
    first = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}
    later = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    appended = {"messages": [*first["messages"], *later]}
    for body, reused in (
        (first, 0),
        (appended, 1),
        ({**appended, "add_generation_prompt": False}, 0),  # other variables
        (appended, 0),  # the same messages again: nothing appended
        ({"messages": appended["messages"][:3]}, 0),  # shorter
        ({"messages": [{"role": "system", "content": "t"}, *appended["messages"][1:]]}, 0),  # edited
    ):
        before = chats.stats.appended
        assert chats.render("s", body) == template.render(body)
        assert chats.stats.appended - before == reused, body


def test_a_continued_final_message_is_cut_as_a_whole_render_cuts_it() -> None:
    template = ChatTemplate(TOOLS_CHAT_TEMPLATE, SPECIALS)
    chats = IncrementalChat(template)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    assert chats.render("s", {"messages": base, **continued}).endswith("Sure")
    body = {"messages": [*base, {"role": "user", "content": "more"}, {"role": "assistant", "content": "Let me"}]}
    body |= continued
    assert chats.render("s", body) == template.render(body) and template.render(body).endswith("Let me")
    assert chats.stats.appended == 1


def test_a_bad_appended_message_is_named_by_its_index() -> None:
    chats = IncrementalChat(ChatTemplate(TOOLS_CHAT_TEMPLATE, SPECIALS))
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    chats.render("s", {"messages": base})
    with pytest.raises(ChatError, match=r"'messages\[2\]\.role'"):
        chats.render("s", {"messages": [*base, {"role": 3, "content": "x"}]})
    with pytest.raises(ChatError, match="non-empty list"):
        chats.render("s", {"messages": []})
    assert chats.render("s", {"messages": [*base, {"role": "user", "content": "x"}]}).endswith("<|assistant|>\n")


def test_kept_chats_are_bounded() -> None:
    template = ChatTemplate(CHATML, SPECIALS)
    chats = IncrementalChat(template, max_sessions=2, max_chars=200)
    short = {"messages": [{"role": "user", "content": "x"}]}
    for session in "abc":
        chats.render(session, short)
    assert chats.held == (2, 2 * len(template.render({**short, "add_generation_prompt": False})))
    long = {"messages": [{"role": "user", "content": "y" * 500}]}
    chats.render("d", long)  # heavier than the bound: not kept, and nothing else dropped for it
    assert chats.held[0] == 2
