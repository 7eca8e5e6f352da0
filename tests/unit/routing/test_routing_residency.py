"""kvpilot.routing.decide.residency and the session rules it feeds: a session's first step placed
for its later ones, a later step kept on its worker unless another starts it sooner."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from kvpilot.routing.config import CostConfig, RouterConfig
from kvpilot.routing.decide.cost import Candidate, CandidateTable, CostModel, TierOverlap
from kvpilot.routing.decide.ledger import LoadLedger, WorkerLoad
from kvpilot.routing.decide.residency import Residency
from kvpilot.routing.decide.router import Router
from kvpilot.routing.decide.sessions import SessionStore
from kvpilot.routing.fleet import fleet_from_config
from kvpilot.routing.ids import SessionId, WorkerId
from kvpilot.routing.index.block_index import BlockIndex
from kvpilot.routing.index.events import BlockStored

BS = 4
W1, W2 = WorkerId("w1"), WorkerId("w2")


def test_a_session_lives_where_its_latest_step_went_until_the_horizon_after_it() -> None:
    residency = Residency(horizon_s=10.0)
    residency.settle(SessionId("a"), W1, 100, now=0.0)
    residency.settle(SessionId("b"), W1, 50, now=1.0)
    assert residency.blocks(1.0) == {W1: 150}
    residency.settle(SessionId("a"), W2, 120, now=2.0)  # its next step went to w2: it moved
    assert residency.blocks(2.0) == {W1: 50, W2: 120}
    assert residency.blocks(11.5) == {W2: 120}  # b's last step was 10.5 s ago
    assert residency.blocks(None) == {W2: 120}  # no clock: nothing expires
    assert residency.blocks(12.5) == {} and len(residency) == 0


def test_the_horizon_must_be_positive() -> None:
    with pytest.raises(ValueError, match="horizon_s"):
        Residency(0.0)


def _table(start_blocks: list[int], decode_blocks: list[int], home: list[bool]) -> CandidateTable:
    """Candidates whose uncached prompt blocks are ``start_blocks`` (no queue, no overlap
    of a 100-block prompt) and whose active decode blocks are ``decode_blocks``."""
    rows = [
        Candidate(
            f"w{i}",
            TierOverlap(100 - start, 0, 0, 0),
            WorkerLoad(0, decode, 1 if decode else 0, 0),
            session_affinity=is_home,
        )
        for i, (start, decode, is_home) in enumerate(zip(start_blocks, decode_blocks, home, strict=True))
    ]
    return CandidateTable.of(rows)


@pytest.mark.parametrize(
    ("case", "start", "decode", "home", "stays", "chosen", "barred"),
    [
        # Dynamo's cost alone would leave the busy home (2,000 decode blocks) for w1 (60 to prefill)
        ("a busy home that starts the step soonest keeps it", [2, 60], [2000, 0], [True, False], True, "w0", ["w1"]),
        ("the rule off: Dynamo's cost moves it", [2, 60], [2000, 0], [True, False], False, "w1", []),
        # the home lost the session's KV (evicted): both others start it sooner; Dynamo's cost
        # picks among them (w1 starts soonest but decodes 500 blocks)
        (
            "those that start it sooner compete by cost",
            [90, 10, 50],
            [0, 500, 0],
            [True, False, False],
            True,
            "w2",
            ["w0"],
        ),
        ("no session step: every row is eligible", [2, 60], [2000, 0], [False, False], True, "w1", []),
    ],
)
def test_a_session_s_later_step_moves_only_to_a_sooner_start(case, start, decode, home, stays, chosen, barred) -> None:
    model = CostModel(CostConfig(session_stays_unless_sooner=stays, session_affinity_credit=0.0), random.Random(0))
    decision = model.decide("r", 100, _table(start, decode, home))
    assert decision.chosen == chosen, case
    explained = [line.split()[1] for line in decision.explain().splitlines() if "(barred:" in line]
    assert explained == [f"worker={name}" for name in barred], case


def test_the_residency_cost_is_its_weight_times_the_living_blocks() -> None:
    table = _table([50, 50], [0, 0], [False, False])
    table = CandidateTable(
        table.names, table.overlap, table.load, table.session_affinity, table.pair_penalty_blocks, np.array([300, 0])
    )
    decision = CostModel(CostConfig(session_residency_weight=0.5), random.Random(0)).decide("r", 100, table)
    assert decision.chosen == "w1"
    assert [t.residency_cost for t in decision.terms] == [150.0, 0.0]
    assert "residency_cost(150.00)" in decision.explain()


def _router() -> Router:
    rows = [{"name": w, "role": "colocated", "url": f"http://127.0.0.1:1/{w}"} for w in ("w1", "w2")]
    config = msgspec.convert({"index": {"block_size": BS}, "workers": rows}, RouterConfig)
    return Router(
        fleet_from_config(config), config, BlockIndex(BS), LoadLedger(), SessionStore(BS, 16), None, random.Random(0)
    )


def test_a_first_step_avoids_the_worker_where_a_session_lives_though_it_holds_the_shared_prefix() -> None:
    """Two agents on one 6-block shared prefix that only w1 holds: by Dynamo's cost the second
    agent's first step goes to w1 too (the first agent, between steps, is not in flight), and
    the two collide there at every later step. kvpilot's router prices the first agent's blocks
    living on w1 and sends the second to w2."""
    router = _router()
    prefix = list(range(6 * BS))
    router.index.apply(W1, BlockStored([b"p%d" % i for i in range(6)], None, prefix, BS, medium="GPU"))
    first_prompt = prefix + [1000 + i for i in range(2 * BS)]
    first = router.route(first_prompt, "a-0", session=SessionId("a"), now=0.0)
    assert first.decode.name == W1  # it holds the prefix
    router.served(SessionId("a"), first, now=1.0)  # the step ended; the agent runs its tool
    second = router.route(prefix + [2000 + i for i in range(2 * BS)], "b-0", session=SessionId("b"), now=1.5)
    assert second.decode.name == W2
    assert second.decision.terms[0].residency_cost == len(first_prompt) // BS
    later = router.route(first_prompt + [7] * BS, "a-1", session=SessionId("a"), now=3.0)
    assert later.decode.name == W1  # its own later step is not charged for itself
    assert all(t.residency_cost == 0 for t in later.decision.terms)


def test_without_the_residency_weight_the_second_agent_joins_the_first() -> None:
    router = _router()
    router.cost = CostModel(CostConfig(session_residency_weight=0.0), random.Random(0))
    prefix = list(range(6 * BS))
    router.index.apply(W1, BlockStored([b"p%d" % i for i in range(6)], None, prefix, BS, medium="GPU"))
    first = router.route(prefix + [1000 + i for i in range(2 * BS)], "a-0", session=SessionId("a"), now=0.0)
    router.served(SessionId("a"), first, now=1.0)
    second = router.route(prefix + [2000 + i for i in range(2 * BS)], "b-0", session=SessionId("b"), now=1.5)
    assert second.decode.name == W1
