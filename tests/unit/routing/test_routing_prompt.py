"""The engine's token ids at the router (routing/serve/prompt.py): special tokens as vLLM's
endpoints add them by default, or as Dynamo's frontend does, and what a request says."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.routing.serve.chat import ChatError, ChatTemplate
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptError, PromptTokenizer
from kvpilot.routing.serve.upstream import Api

BOS = 0


def _prompts(model_dir: Path, **kw: bool) -> EnginePrompt:
    return EnginePrompt(PromptTokenizer(model_dir), ChatTemplate.from_model_dir(model_dir), **kw)


def test_a_text_completion_gets_bos_as_vllm_adds_it_and_none_beside_dynamo(tiny_model_dir: Path) -> None:
    vllm, dynamo = _prompts(tiny_model_dir), _prompts(tiny_model_dir, completion_special_tokens=False)
    text = {"prompt": "fix the failing test"}
    assert vllm.token_ids(Api.COMPLETIONS, text)[0] == BOS
    assert vllm.token_ids(Api.COMPLETIONS, text)[1:] == dynamo.token_ids(Api.COMPLETIONS, text)
    assert vllm.token_ids(Api.COMPLETIONS, {**text, "add_special_tokens": False})[0] != BOS  # the request decides
    assert dynamo.token_ids(Api.COMPLETIONS, {**text, "add_special_tokens": True})[0] == BOS


def test_a_chat_adds_no_special_tokens_beyond_its_template_s(tiny_model_dir: Path) -> None:
    ids = _prompts(tiny_model_dir).token_ids(Api.CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert ids[0] == BOS and BOS not in ids[1:]  # the template's own bos_token, once


@pytest.mark.parametrize(
    ("api", "body", "error"),
    [
        (Api.COMPLETIONS, {"prompt": ["a", "b"]}, PromptError),
        (Api.COMPLETIONS, {"prompt": ""}, PromptError),
        (Api.COMPLETIONS, {"prompt": "x", "add_special_tokens": "yes"}, PromptError),
        (Api.CHAT, {"messages": "hi"}, ChatError),
    ],
)
def test_a_prompt_the_router_cannot_read_is_refused(tiny_model_dir: Path, api: Api, body: dict, error: type) -> None:
    with pytest.raises(error):
        _prompts(tiny_model_dir).token_ids(api, body)
