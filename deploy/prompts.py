"""Deterministic filler text for prompts in the benchmarks and tests (no dataset needed)."""

from __future__ import annotations


def filler_text(n: int, seed: int) -> str:
    """``n`` words from a small coding vocabulary; the same ``(n, seed)`` gives the same text."""
    vocab = [
        "def",
        "return",
        "cache",
        "block",
        "token",
        "prefix",
        "decode",
        "prefill",
        "router",
        "session",
        "tool",
        "test",
        "file",
    ]
    return " ".join(vocab[(seed * 31 + i * 7 + (i * i) % 11) % len(vocab)] for i in range(n))
