from __future__ import annotations

from pathlib import Path

from kvpilot.deploy.tiny_model import TINY_MODEL_SPEC, build_tiny_model, ensure_tiny_model, model_dir_name, tree_digest


def test_rebuild_is_byte_identical(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a")
    second = build_tiny_model(tmp_path / "b")
    assert tree_digest(first) == tree_digest(second)
    assert {p.name for p in first.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_cache_builds_once(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path)
    assert path.name == model_dir_name(TINY_MODEL_SPEC)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
