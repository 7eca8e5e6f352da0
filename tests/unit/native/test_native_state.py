"""What the compiled picker books, against the Python router's own accounting on random
operations: the active-block ledger (``kvp_ledger.c`` against :class:`LoadLedger`: each
worker's unique active blocks, a prompt's shared decode blocks) and the sessions
(``kvp_session.c`` against :class:`Residency` and a session's last worker)."""

from __future__ import annotations

import random

import pytest

from kvpilot.routing.decide.ledger import LoadLedger
from kvpilot.routing.decide.residency import Residency
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.chain import PromptChain

native = pytest.importorskip("kvpilot.routing.native")
try:
    native.load()
except native.NativeUnavailable as exc:  # pragma: no cover - make setup builds it
    pytest.skip(str(exc), allow_module_level=True)

BLOCK = 4
WORKERS = [WorkerId(f"w{i}") for i in range(3)]


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A prompt sharing a random stem with earlier ones (as a session's steps and a fleet's
    system prompts do), then its own tokens."""
    stem = rng.choice(prefixes)[: rng.randrange(0, 40)] if prefixes else []
    prompt = stem + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 30))]
    prefixes.append(prompt)
    return prompt


@pytest.mark.parametrize("seed", range(20))
def test_the_ledger_counts_as_the_python_ledger(seed: int) -> None:
    rng = random.Random(seed)
    python, c = LoadLedger(), native.NativeLedger(len(WORKERS))
    active: dict[str, tuple[int, list[int]]] = {}
    prefixes: list[list[int]] = []
    for step in range(300):
        if active and rng.random() < 0.45:
            request = rng.choice(sorted(active))
            worker, keys = active.pop(request)
            python.complete(request)
            c.remove(worker, keys)
        else:
            chain = PromptChain(_prompt(rng, prefixes), BLOCK)
            keys = [int(k) for k in chain.keys(chain.num_blocks)]
            worker = rng.randrange(len(WORKERS))
            request = f"r{step}"
            python.dispatch(request, WORKERS[worker], WORKERS[worker], chain, cached_blocks=0)
            assert c.add(worker, keys) == "applied"
            active[request] = (worker, keys)
        probe = PromptChain(_prompt(rng, prefixes), BLOCK)
        probe_keys = [int(k) for k in probe.keys(probe.num_blocks)]
        for w, name in enumerate(WORKERS):
            expected = python.load(name, probe)
            assert c.unique(w) == expected.active_decode_blocks, (seed, step, w)
            assert c.shared_depth(w, probe_keys) == expected.shared_decode_blocks, (seed, step, w)


def test_a_release_of_keys_never_booked_changes_nothing() -> None:
    c = native.NativeLedger(2)
    c.add(0, [1, 2, 3])
    c.remove(0, [9, 10])
    c.remove(1, [1, 2, 3])
    assert (c.unique(0), c.unique(1), c.shared_depth(0, [1, 2, 7])) == (3, 0, 2)


@pytest.mark.parametrize("seed", range(20))
def test_the_sessions_live_where_the_python_router_keeps_them(seed: int) -> None:
    rng = random.Random(seed)
    horizon = 5.0
    residency, c = Residency(horizon), native.NativeSessions(1000, len(WORKERS), horizon)
    last: dict[int, int] = {}
    now = 0.0
    for step in range(400):
        now += rng.choice([0.0, 0.1, 0.5, 2.0, 7.0])
        session, worker, blocks = rng.randrange(30), rng.randrange(len(WORKERS)), rng.randrange(1, 500)
        residency.settle(SessionId(str(session)), WORKERS[worker], blocks, now)
        if rng.random() < 0.5:
            c.served(session, worker, blocks, now)
            last[session] = worker
        else:
            c.settle(session, worker, blocks, now)
        probe_at = now + rng.choice([0.0, 1.0, 4.9, 5.1])
        now = probe_at
        expected = residency.blocks(now)
        assert c.resident(now) == [float(expected.get(w, 0)) for w in WORKERS], (seed, step)
        probe = rng.randrange(40)
        assert c.last(probe) == last.get(probe), (seed, step)


def test_past_its_capacity_the_least_recently_settled_session_is_forgotten() -> None:
    c = native.NativeSessions(2, 2, 60.0)
    c.served(1, 0, 10, 0.0)
    c.served(2, 1, 20, 1.0)
    c.served(1, 1, 30, 2.0)  # session 1 settles again: session 2 is now the oldest
    c.served(3, 0, 40, 3.0)
    assert (c.last(1), c.last(2), c.last(3), len(c)) == (1, None, 0, 2)
    assert c.resident(3.0) == [40.0, 30.0]


@pytest.mark.parametrize("args", [(0, 2, 1.0), (2, 0, 1.0), (2, 2, 0.0), (2, 2, float("nan"))])
def test_a_table_of_no_size_or_no_horizon_is_refused(args: tuple[int, int, float]) -> None:
    with pytest.raises(ValueError, match="no session table"):
        native.NativeSessions(*args)
