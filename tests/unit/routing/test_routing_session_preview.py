"""A session step's dry run names its prompt from the session's chain (``SessionState.preview``):
the same keys a fresh chain names, the same shared prefix ``advance`` would find, and the
session left as it was."""

from __future__ import annotations

import random

import pytest

from kvpilot.routing.decide.sessions import SessionState
from kvpilot.routing.index.chain import PromptChain

BS = 4


def _steps(rng: random.Random) -> list[list[int]]:
    """A session's prompts: each the last plus new tokens, now and then an earlier turn edited."""
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(3, 40))]
    steps = [list(prompt)]
    for _ in range(6):
        if rng.random() < 0.3 and len(prompt) > 2:
            prompt[rng.randrange(len(prompt))] = 5000  # an edit of an earlier turn
        prompt = prompt + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
        steps.append(list(prompt))
    return steps


@pytest.mark.parametrize("seed", range(40))
def test_a_preview_names_what_a_fresh_chain_names_and_advances_nothing(seed):
    rng = random.Random(seed)
    state = SessionState(BS)
    salt = None
    for prompt in _steps(rng):
        if rng.random() < 0.15:
            salt = f"tenant-{rng.randrange(2)}"
        before = None if state.chain is None else list(state.chain.tokens)
        if state.chain is not None:
            state.chain.keys(rng.randrange(state.chain.num_blocks + 1))  # the index named some of it
        chain, shared = state.preview(prompt, cache_salt=salt)
        fresh = PromptChain(prompt, BS, cache_salt=salt)
        assert chain.namespace == fresh.namespace
        assert chain.keys(chain.num_blocks) == fresh.keys(fresh.num_blocks)
        assert shared == state.shared_prefix(prompt, cache_salt=salt)
        assert (None if state.chain is None else list(state.chain.tokens)) == before  # not advanced
        advanced = state.advance(prompt, cache_salt=salt)
        assert advanced.reused_tokens == shared
        assert state.chain is not None and state.chain.keys(state.chain.num_blocks) == fresh.keys(fresh.num_blocks)
