"""Build the tiny offline Llama model every CPU test and the demo run on.

The model is made here, never downloaded: a byte-level BPE tokenizer trained on a
corpus this module generates, and a 4-layer Llama (hidden 256, 4 query heads,
2 KV heads, head_dim 64) with seeded random weights.

It is shaped like the models users serve (:data:`TINY_MODEL_SPEC`): its tokenizer adds
BOS to encoded text (Llama, Mistral and Gemma do), its vocabulary has the tool-call and
thinking tokens vLLM's ``hermes`` tool parser and ``qwen3`` reasoning parser look for, and
its chat template (:data:`TOOLS_CHAT_TEMPLATE`) renders tools, assistant ``tool_calls``
(arguments as objects, as vLLM hands them to templates), tool results, reasoning and an
``enable_thinking`` switch. :data:`PLAIN_MODEL_SPEC` is the older shape (no BOS, a
template without tools), kept so that the parity tests cover both. The build is deterministic:
the same :data:`TINY_MODEL_SPEC` gives byte-identical files on every rebuild, so
the model directory is named by a digest of the spec and built once per cache.

Random weights are enough for what the tests check (that a transferred KV gives
the same logprobs as a local prefill); they make the greedy *text* meaningless,
which is why the tests compare logprobs and not just text.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Everything that determines the model's bytes. Change it and the name changes."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 16384
    initializer_range: float = 0.05
    seed: int = 20261130
    corpus_lines: int = 4000
    add_bos_token: bool = True
    """The tokenizer adds BOS to encoded text (a post-processor), as Llama-family ones do."""
    tools_template: bool = True
    """The chat template renders tools and thinking (:data:`TOOLS_CHAT_TEMPLATE`), else
    :data:`PLAIN_CHAT_TEMPLATE`."""
    layout_version: int = 2  # bump when this module changes what it writes


TINY_MODEL_SPEC = TinyModelSpec()
"""The model every test, benchmark and the demo run on."""
PLAIN_MODEL_SPEC = TinyModelSpec(add_bos_token=False, tools_template=False)
"""The older shape: no BOS added to text, a chat template without tools."""

BOS_TOKEN = "<s>"
SPECIAL_TOKENS = [
    BOS_TOKEN,
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
"""Their ids are their positions (BOS is 0): the trainer gives special tokens the first ids."""

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% if system is not none or tools %}<|system|>\n{% if system is not none %}{{ system }}{% endif %}"
    "{% if tools %}{% if system is not none %}{{ '\\n\\n' }}{% endif %}# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\nCall a function with a"
    " JSON object of its name and arguments within <tool_call></tool_call> tags.{% endif %}<|end|>\n{% endif %}"
    "{% for message in turns %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n"
    "{% if message['reasoning_content'] is defined and message['reasoning_content'] %}"
    "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|end|>\n"
    "{% elif message['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response><|end|>\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""A hermes-style template: tools in the system turn, ``<tool_call>`` blocks, tool results
as ``<tool_response>``, reasoning in ``<think>``, and ``enable_thinking: false`` rendering an
empty thought (as Qwen3's template does)."""
TOOL_CALLING_ENGINE_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
"""The ``vllm serve`` flags that parse :data:`TOOLS_CHAT_TEMPLATE`'s tool calls, as a server for
tool-calling agents runs (a request with ``tools`` and no ``tool_choice`` is ``auto``, which
needs them; a named ``tool_choice`` needs a parser too in vLLM 0.32)."""
TINY_MODEL_ENGINE_ARGS = (*TOOL_CALLING_ENGINE_ARGS, "--reasoning-parser", "qwen3")
""":data:`TOOL_CALLING_ENGINE_ARGS` and the parser of the template's thinking."""

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "for",
    "on",
    "with",
    "by",
    "from",
    "at",
    "as",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "this",
    "that",
    "these",
    "def",
    "class",
    "return",
    "import",
    "yield",
    "async",
    "await",
    "if",
    "else",
    "elif",
    "while",
    "for",
    "try",
    "except",
    "finally",
    "raise",
    "with",
    "lambda",
    "self",
    "none",
    "true",
    "false",
    "int",
    "str",
    "list",
    "dict",
    "set",
    "tuple",
    "bytes",
    "float",
    "request",
    "response",
    "token",
    "block",
    "cache",
    "prefix",
    "session",
    "prefill",
    "decode",
    "transfer",
    "kernel",
    "engine",
    "worker",
    "router",
    "index",
    "hash",
    "layer",
    "head",
    "query",
    "key",
    "value",
    "tensor",
    "batch",
    "step",
    "tool",
    "agent",
    "repository",
    "file",
    "test",
    "commit",
    "branch",
    "merge",
    "error",
    "failure",
    "retry",
    "lease",
    "heartbeat",
    "memory",
    "bandwidth",
    "latency",
    "throughput",
    "queue",
    "schedule",
    "allocate",
    "free",
    "evict",
    "offload",
    "restore",
    "gpu",
    "cpu",
    "host",
    "disk",
    "network",
    "socket",
    "port",
    "address",
    "connect",
    "bind",
    "send",
    "receive",
    "publish",
    "event",
    "config",
    "option",
    "flag",
    "default",
    "value",
    "parse",
    "validate",
    "schema",
    "version",
    "field",
    "name",
    "type",
    "path",
]


def _corpus(spec: TinyModelSpec) -> list[str]:
    """A deterministic, code-and-prose-like corpus: the tokenizer's training text."""
    rng = random.Random(spec.seed)
    lines = []
    for i in range(spec.corpus_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if i % 3 == 0:
            lines.append(f"def {words[0]}_{words[1]}({', '.join(words[2:4])}):")
            lines.append(f"    return {' + '.join(words[4:7]) or 'None'}  # {i}")
        else:
            lines.append(" ".join(words).capitalize() + ".")
    return lines


def model_dir_name(spec: TinyModelSpec = TINY_MODEL_SPEC) -> str:
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()
    return f"tiny-llama-{digest[:12]}"


def default_cache_dir() -> Path:
    """``$KVPILOT_CACHE`` or ``~/.cache/kvpilot``."""
    return Path(os.environ.get("KVPILOT_CACHE", Path.home() / ".cache" / "kvpilot"))


def _write_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec), trainer=trainer)
    if spec.add_bos_token:
        bos = (BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[bos]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=TOOLS_CHAT_TEMPLATE if spec.tools_template else PLAIN_CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def _write_weights(spec: TinyModelSpec, out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # float32: the config's dtype, torch's default
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model(path: Path, spec: TinyModelSpec = TINY_MODEL_SPEC) -> Path:
    """Build the model into ``path`` (created; must not exist). Returns ``path``.

    Deterministic: two builds of the same spec are byte-identical.
    """
    path.mkdir(parents=True)
    _write_tokenizer(spec, path)
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(path))
    _write_weights(spec, path, vocab_size)
    return path


def ensure_tiny_model(cache_dir: Path | None = None, spec: TinyModelSpec = TINY_MODEL_SPEC) -> Path:
    """Return the cached model directory, building it on first use.

    Safe against concurrent callers: the build goes to a temporary directory that
    is renamed into place; a loser of the race discards its copy.
    """
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / "models" / model_dir_name(spec)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_tiny_model(staging / "model", spec)
        try:
            os.rename(staging / "model", target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def whitespace_logit_bias(model_dir: Path) -> dict[str, dict[str, int]]:
    """``{"logit_bias": ...}`` against every token of ``model_dir``'s vocabulary that is only
    whitespace. A tiny model's random weights prefer whitespace wherever a grammar allows it:
    in a named tool call that vLLM forces (xgrammar's ``hermes`` structural tag allows it
    between JSON tokens) they never close the call. Sent with such a request, a strict tool
    whose arguments are an enum is called in a few tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.get_vocab_size())}
    return {"logit_bias": {str(i): -100 for i, t in text.items() if t and not t.strip()}}


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative name and bytes: equal digests, equal trees."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()
