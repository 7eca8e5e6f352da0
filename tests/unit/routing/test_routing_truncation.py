"""``truncate_prompt_tokens`` at the router (kvpilot.routing.serve.truncation, applied by
EnginePrompt) against vLLM's own: the installed vLLM's request models build the tokenize
parameters, and vLLM's tokenizer and ``TokenizeParams`` truncate the same prompt; the
router's ids must be the ones vLLM keeps, BOS and all, for every side, ``-1`` and 0."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpilot.deploy.prompts import filler_text
from kvpilot.routing.config import ServerConfig
from kvpilot.routing.serve.chat import ChatTemplate
from kvpilot.routing.serve.intake import engine_limits
from kvpilot.routing.serve.prompt import EnginePrompt
from kvpilot.routing.serve.tokenizer import PromptTokenizer
from kvpilot.routing.serve.truncation import Truncation, TruncationSide, truncation_of
from kvpilot.routing.serve.upstream import Api

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.tokenizers import get_tokenizer

MAX_MODEL_LEN = 64
TEXT = filler_text(120, 3)
CHAT = [{"role": "user", "content": filler_text(90, 4)}]
KEEPS = [0, 1, 7, 63, 64, -1]
SIDES = [None, "left", "right"]
OUTPUTS: list[dict[str, Any]] = [{}, {"max_tokens": 4}, {"max_tokens": None}]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> EnginePrompt:
    return EnginePrompt(PromptTokenizer(tiny_model_dir), ChatTemplate.from_model_dir(tiny_model_dir))


@pytest.fixture(scope="module")
def vllm_tokenizer(tiny_model_dir: Path) -> Any:
    return get_tokenizer(str(tiny_model_dir))


def vllm_ids(tokenizer: Any, prompts: EnginePrompt, api: Api, body: dict[str, Any]) -> list[int]:
    """The ids vLLM's renderer keeps: its request model's tokenize parameters, its tokenizer
    with their encode arguments between the pre- and post-tokenization steps (a chat rendered
    first, as the router renders it: tests/e2e/test_parity.py holds that equal to vLLM's)."""
    model = ChatCompletionRequest if api is Api.CHAT else CompletionRequest
    params = model.model_validate({"model": "tiny", **body}).build_tok_params(
        SimpleNamespace(max_model_len=MAX_MODEL_LEN)
    )
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return list(params.apply_post_tokenization(tokenizer, {"prompt_token_ids": prompt})["prompt_token_ids"])
    text = prompts.chat_template.render(body) if api is Api.CHAT else prompt
    text = params.apply_pre_tokenization(tokenizer, {"prompt": text})["prompt"]
    ids = tokenizer(text, **params.get_encode_kwargs())["input_ids"]
    return list(params.apply_post_tokenization(tokenizer, {"prompt_token_ids": ids})["prompt_token_ids"])


def router_ids(prompts: EnginePrompt, tiny_model_dir: Path, api: Api, body: dict[str, Any]) -> list[int]:
    limits = engine_limits(ServerConfig(model_dir=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN))
    truncation = truncation_of(
        body, api, max_model_len=limits.max_model_len, max_chars_per_token=limits.max_chars_per_token
    )
    return prompts.token_ids(api, body, truncation=truncation)


BODIES = [
    pytest.param(Api.COMPLETIONS, {"prompt": TEXT}, id="text"),
    pytest.param(Api.COMPLETIONS, {"prompt": TEXT, "add_special_tokens": False}, id="text-without-bos"),
    pytest.param(Api.COMPLETIONS, {"prompt": list(range(3, 203))}, id="token-ids"),
    pytest.param(Api.CHAT, {"messages": CHAT}, id="chat"),
    pytest.param(Api.CHAT, {"messages": CHAT, "add_special_tokens": True}, id="chat-with-special-tokens"),
]


@pytest.mark.parametrize(("api", "body"), BODIES)
@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("output", OUTPUTS, ids=["max-tokens-absent", "max-tokens", "max-tokens-null"])
def test_the_router_keeps_the_ids_vllm_keeps(
    prompts: EnginePrompt, vllm_tokenizer: Any, tiny_model_dir: Path, api: Api, body: dict, keep: int, side, output
) -> None:
    request = {**body, **output, "truncate_prompt_tokens": keep, **({"truncation_side": side} if side else {})}
    expected = vllm_ids(vllm_tokenizer, prompts, api, request)
    assert router_ids(prompts, tiny_model_dir, api, request) == expected
    assert len(expected) < len(prompts.token_ids(api, body))  # vLLM truncated it: the case tests something


def test_a_completion_keeps_its_bos_unless_a_side_is_named(prompts: EnginePrompt, tiny_model_dir: Path) -> None:
    """vLLM's tokenizer truncates around its special tokens; a named side slices them away."""
    bos = prompts.token_ids(Api.COMPLETIONS, {"prompt": TEXT})[0]
    kept = router_ids(prompts, tiny_model_dir, Api.COMPLETIONS, {"prompt": TEXT, "truncate_prompt_tokens": 8})
    sliced = {"prompt": TEXT, "truncate_prompt_tokens": 8, "truncation_side": "left"}
    assert kept[0] == bos and router_ids(prompts, tiny_model_dir, Api.COMPLETIONS, sliced)[0] != bos


def test_a_long_text_is_cut_to_what_the_model_can_hold_from_the_named_side() -> None:
    cut = Truncation(4, TruncationSide.LEFT, max_chars=10)
    assert cut.of_text("a" * 5 + "b" * 10) == "b" * 10
    assert Truncation(4, TruncationSide.RIGHT, max_chars=10).of_text("a" * 10 + "b" * 5) == "a" * 10
    assert Truncation(4, None, max_chars=10).of_text("a" * 20) == "a" * 20  # the tokenizer truncates it


def test_minus_one_is_left_to_the_engines_when_the_model_s_length_is_unknown() -> None:
    assert (
        truncation_of({"truncate_prompt_tokens": -1}, Api.COMPLETIONS, max_model_len=0, max_chars_per_token=8) is None
    )
    assert truncation_of({"truncate_prompt_tokens": 5}, Api.COMPLETIONS, max_model_len=0, max_chars_per_token=8) == (
        Truncation(5)
    )
    chat = {"truncate_prompt_tokens": -1, "max_completion_tokens": 3}
    assert truncation_of(chat, Api.CHAT, max_model_len=10, max_chars_per_token=2) == Truncation(9, None, 20)
