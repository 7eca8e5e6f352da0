"""A session's next prompt tokenized from its last one (routing/serve/incremental_tokens.py):
always the full tokenization's ids, on the project's tiny tokenizer, for random texts and
random multi-turn chats with appended, edited and dropped turns; only the tail tokenized
where a safe cut exists; bounded; a tokenizer that merges across its added tokens never cut."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.incremental_tokens import IncrementalTokens, shared_length
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.truncation import truncation_of
from kvpilot.routing.serve.upstream import Api

WORDS = ("fix", "the", "test", " ", "  ", "\n", "\n\n", "\t", "é", "日本", "42", "{", '"a": 1', "}", "<", "|", ">")
FRAGMENTS = ("<|en", "d|>", "<tool", "_call>", "</tool_", "<|", "|>", "<think", "<s", "/s>")
"""Pieces of added tokens' texts: a shared prefix may end inside one, and a new one may form
across an edit."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(tiny_model_dir)


def _pieces(rng: random.Random, tokenizer: PromptTokenizer, n: int) -> str:
    alphabet = (*WORDS, *FRAGMENTS, *tokenizer.added_texts)
    return "".join(rng.choice(alphabet) for _ in range(n))


def _next_text(rng: random.Random, tokenizer: PromptTokenizer, text: str) -> str:
    """An agent's next prompt: mostly the last one with more at its end; else an edit, a cut
    or the same text again."""
    roll = rng.random()
    if roll < 0.6:
        return text + _pieces(rng, tokenizer, rng.randint(1, 12))
    at = rng.randint(0, len(text))
    if roll < 0.8:
        return text[:at] + _pieces(rng, tokenizer, rng.randint(0, 4)) + text[at + rng.randint(0, 6) :]
    if roll < 0.9:
        return text[:at]
    return text


@pytest.mark.parametrize("seed", range(8))
def test_random_texts_get_the_full_tokenization_s_ids(tokenizer: PromptTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    sessions = IncrementalTokens(tokenizer)
    for session in range(30):
        text = _pieces(rng, tokenizer, rng.randint(0, 20))
        for _ in range(10):
            assert sessions.encode(f"s{session}", text) == tokenizer.encode(text, add_special_tokens=False), text
            text = _next_text(rng, tokenizer, text)
    assert sessions.stats.reused > sessions.stats.prompts // 3, sessions.stats  # the cache was used


def test_the_shared_length_is_the_longest_common_prefix() -> None:
    rng = random.Random(3)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert shared_length(a, b) == expected, (a, b)


# ---- chats, rendered by the tiny model's template ------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}}]


def _turn(rng: random.Random, k: int) -> list[dict[str, Any]]:
    text = " ".join(rng.choice(WORDS + FRAGMENTS) for _ in range(rng.randint(1, 30)))
    kind = rng.choice(("tool", "user", "assistant"))
    if kind == "tool":
        call = {"id": f"c{k}", "type": "function", "function": {"name": "run_tests", "arguments": json.dumps({"k": k})}}
        return [
            {"role": "assistant", "content": rng.choice((None, text[:20])), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": text},
        ]
    return [{"role": kind, "content": text}]


def _next_chat(rng: random.Random, body: dict[str, Any], k: int) -> dict[str, Any]:
    messages = [dict(m) for m in body["messages"]]
    roll = rng.random()
    if roll < 0.6:
        messages += _turn(rng, k)
    elif roll < 0.8:
        i = rng.randrange(len(messages))
        messages[i]["content"] = f"edited {k}: " + str(messages[i].get("content"))
    elif len(messages) > 2:
        messages = messages[: rng.randint(2, len(messages) - 1)]
    out: dict[str, Any] = {"messages": messages}
    if rng.random() < 0.8:
        out["tools"] = TOOLS
    if rng.random() < 0.2:
        out["chat_template_kwargs"] = {"enable_thinking": False}
    if rng.random() < 0.1:
        out["add_generation_prompt"] = False
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_multi_turn_chats_get_the_full_tokenization_s_ids(tiny_model_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    prompts = EnginePrompt(PromptTokenizer(tiny_model_dir), ChatTemplate.from_model_dir(tiny_model_dir))
    for session in range(6):
        body: dict[str, Any] = {"messages": [{"role": "system", "content": "You are an agent."}, *_turn(rng, 0)]}
        for k in range(1, 25):
            full = prompts.token_ids(Api.CHAT, body)
            assert prompts.token_ids(Api.CHAT, body, session=f"s{session}") == full, (seed, session, k)
            body = _next_chat(rng, body, k)
    stats = prompts.sessions.stats
    assert stats.reused > stats.prompts // 2 and stats.reused_tokens > 0, stats


def _agent(steps: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the test."},
    ]
    for k in range(steps):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"step {k}: 3 passed, 1 failed " * 20})
    return {"messages": messages, "tools": TOOLS}


def _reused(prompts: EnginePrompt, body: dict[str, Any], session: str) -> int:
    before = prompts.sessions.stats.reused_tokens
    assert prompts.token_ids(Api.CHAT, body, session=session) == prompts.token_ids(Api.CHAT, body)
    return prompts.sessions.stats.reused_tokens - before


def test_an_agent_s_next_step_tokenizes_only_its_new_turn(tiny_model_dir: Path) -> None:
    prompts = EnginePrompt(PromptTokenizer(tiny_model_dir), ChatTemplate.from_model_dir(tiny_model_dir))
    assert _reused(prompts, _agent(5), "a") == 0  # a session's first step: all of it
    new_ids = len(prompts.token_ids(Api.CHAT, _agent(6))) - len(prompts.token_ids(Api.CHAT, _agent(5)))
    reused = _reused(prompts, _agent(6), "a")
    total = len(prompts.token_ids(Api.CHAT, _agent(6)))
    assert total - new_ids - 10 <= reused < total - new_ids, (reused, total, new_ids)  # cut just before the new turn


def test_an_edit_to_an_earlier_turn_cuts_before_it(tiny_model_dir: Path) -> None:
    prompts = EnginePrompt(PromptTokenizer(tiny_model_dir), ChatTemplate.from_model_dir(tiny_model_dir))
    _reused(prompts, _agent(6), "a")
    edited = _agent(7)
    edited["messages"][0]["content"] = "You are a careful coding agent."
    assert _reused(prompts, edited, "a") <= 2  # BOS and <|system|>: the ids before the edit
    _reused(prompts, _agent(7), "b")
    edited = _agent(8)
    edited["messages"][5]["content"] = "step 1: all passed"
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    before_edit = prompts.tokenizer.encode(
        template.render(_agent(8)).split("step 1: 3 passed")[0], add_special_tokens=False
    )
    assert 0 < _reused(prompts, edited, "b") <= len(before_edit)


def test_a_session_with_truncation_or_special_tokens_is_tokenized_whole(tiny_model_dir: Path) -> None:
    prompts = EnginePrompt(PromptTokenizer(tiny_model_dir), ChatTemplate.from_model_dir(tiny_model_dir))
    prompts.token_ids(Api.CHAT, _agent(3), session="a")
    with_bos = {**_agent(4), "add_special_tokens": True}
    assert prompts.token_ids(Api.CHAT, with_bos, session="a") == prompts.token_ids(Api.CHAT, with_bos)
    truncated = {**_agent(4), "truncate_prompt_tokens": 50}
    truncation = truncation_of(truncated, Api.CHAT, max_model_len=4096, max_chars_per_token=0)
    ids = prompts.token_ids(Api.CHAT, truncated, truncation=truncation, session="a")
    assert ids == prompts.token_ids(Api.CHAT, truncated, truncation=truncation) and len(ids) == 50
    assert prompts.sessions.stats.prompts == 1  # the cache was not asked


def test_the_cache_is_bounded_by_sessions_and_tokens(tokenizer: PromptTokenizer) -> None:
    sessions = IncrementalTokens(tokenizer, max_sessions=2, max_tokens=100)
    text = "<|user|>\nhello there<|end|>\n"
    size = len(tokenizer.encode(text, add_special_tokens=False))
    for name in ("a", "b", "c"):
        sessions.encode(name, text)
    assert sessions.held == (2, 2 * size)  # "a", the least recently used, dropped
    sessions.encode("b", text + "<|assistant|>\nok<|end|>\n")
    assert sessions.stats.reused == 1
    sessions.encode("a", text)
    assert sessions.stats.reused == 1  # "a" was dropped: tokenized whole
    sessions.encode("d", text * 30)  # over max_tokens alone: not kept
    assert sessions.held[0] == 2 and sessions.held[1] <= 100
    with pytest.raises(ValueError, match="at least 0"):
        IncrementalTokens(tokenizer, max_sessions=-1)


# ---- tokenizers that merge across their added tokens ---------------------------------------


def _tokenizer_dir(path: Path, *, prepend: str = "always", lstrip: bool = False, also: tuple[str, ...] = ()) -> Path:
    words = ["[UNK]", "hello", "▁hello", "world", "▁world", "▁", "x", "▁x"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend)
    added = ("<|end|>", *also)
    tok.add_special_tokens([AddedToken(t, special=True, lstrip=lstrip, normalized=False) for t in added])
    tok.save(str(path / "tokenizer.json"))
    return path


def test_a_tokenizer_that_prefixes_only_its_first_piece_has_no_cuts(tmp_path: Path) -> None:
    """Metaspace with ``prepend_scheme="first"`` encodes ``hello`` as ``▁hello`` alone and
    as ``hello`` after ``<|end|>``: no cut there, and the ids stay the full tokenization's."""
    first = PromptTokenizer(_tokenizer_dir(tmp_path, prepend="first"))
    assert first.cuts == {}
    assert PromptTokenizer(_tokenizer_dir(tmp_path, prepend="always")).cuts  # the same with "always" cuts
    sessions = IncrementalTokens(first)
    for text in ("hello<|end|>world", "hello<|end|>world<|end|>hello x", "hello<|end|>world<|end|>hello x<|end|>x"):
        assert sessions.encode("a", text) == first.encode(text, add_special_tokens=False)
    assert sessions.held == (0, 0)


def test_a_tokenizer_whose_added_token_strips_whitespace_has_no_cuts(tmp_path: Path) -> None:
    assert PromptTokenizer(_tokenizer_dir(tmp_path, lstrip=True)).cuts == {}


def test_no_cut_where_a_longer_added_token_forms_across_it(tmp_path: Path) -> None:
    """``<|end|>`` is a cut (the probes' tails never start with ``!``), and ``<|end|>!`` an
    added token: a step that appends ``!`` right after a cached ``<|end|>`` makes the longer
    token, so the cut before it is refused; a later one is taken."""
    tokenizer = PromptTokenizer(_tokenizer_dir(tmp_path, also=("<|end|>!",)))
    assert "<|end|>" in tokenizer.cuts.values()
    sessions = IncrementalTokens(tokenizer)
    steps = ("hello<|end|>world<|end|>", "hello<|end|>world<|end|>!x", "hello<|end|>world<|end|>!x<|end|>hello")
    reused = []
    for text in steps:
        assert sessions.encode("a", text) == tokenizer.encode(text, add_special_tokens=False), text
        reused.append(sessions.stats.reused_tokens)
    assert reused[1] == 2 and reused[2] > reused[1], reused  # "hello<|end|>" kept, then all but the tail
