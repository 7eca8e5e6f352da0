"""A tiny hybrid model for tests: Gemma 3 text layers that alternate sliding-window and
full attention, with seeded random weights and the project's tiny tokenizer.

vLLM gives such a model two KV cache groups (one per attention kind), which is what
the hybrid tests need; the project's tiny Llama has one. Built locally, never
downloaded, once per cache directory (named by a digest of :data:`HYBRID_SPEC`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.deploy.tiny_model import default_cache_dir, ensure_tiny_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, slots=True)
class HybridModelSpec:
    """Everything that determines the model's bytes. Change it and the name changes."""

    hidden_size: int = 256
    intermediate_size: int = 512
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    sliding_window: int = 64
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    initializer_range: float = 0.05
    seed: int = 20261201
    layout_version: int = 1


HYBRID_SPEC = HybridModelSpec()


def hybrid_dir_name(spec: HybridModelSpec = HYBRID_SPEC) -> str:
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    return f"tiny-gemma3-hybrid-{digest}"


def _write(spec: HybridModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer_dir = ensure_tiny_model()
    out.mkdir(parents=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    config = Gemma3TextConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(out)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=len(spec.layer_types),
        layer_types=list(spec.layer_types),
        sliding_window=spec.sliding_window,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    Gemma3ForCausalLM(config).save_pretrained(out, safe_serialization=True)


def ensure_hybrid_model(cache_dir: Path | None = None, spec: HybridModelSpec = HYBRID_SPEC) -> Path:
    """The cached model directory, built on first use (into a temporary directory
    renamed into place, so concurrent callers are safe)."""
    target = (cache_dir or default_cache_dir()) / "models" / hybrid_dir_name(spec)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        _write(spec, staging / "model")
        try:
            os.rename(staging / "model", target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
