"""cut_to_prefix: each KV cache group's share of a verified prefix, table by table.

The peer computed 330 tokens in 11 blocks of 32 (block id ``100 + position`` in the
full-attention group, ``200 + position`` in the sliding-window group); its window of
64 tokens starts at block 8, and it sends that group's last ``cdiv(64, 32) + 1 = 3``
blocks, positions 8 to 10.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from kvpilot.kvconnectors.group_clip import ONE_FULL_GROUP, GroupKind, GroupLayout, Refused, cut_to_prefix

BS = 32
FULL = GroupLayout(index=1, spec_name="FullAttentionSpec", kind=GroupKind.FULL)
SW = GroupLayout(index=0, spec_name="SlidingWindowSpec", kind=GroupKind.SLIDING, sliding_window=64)
SW_RETAINING = GroupLayout(
    index=0, spec_name="SlidingWindowSpec", kind=GroupKind.SLIDING, sliding_window=64, extra_retained_tokens=32
)
MAMBA = GroupLayout(index=0, spec_name="MambaSpec", kind=GroupKind.OTHER)
PEER_FULL = [100 + p for p in range(11)]
PEER_SW = [208, 209, 210]


class Case(NamedTuple):
    groups: tuple[GroupLayout, ...]
    lists: list[list[int]]
    attach: int
    hit: int
    peer_tokens: int
    expected: tuple[tuple[int, ...], ...] | str
    """The cut lists, or a fragment of the refusal."""


CASES = {
    "one full group: its first blocks": Case(ONE_FULL_GROUP, [PEER_FULL], 2, 0, 330, ((100, 101),)),
    "window ends where the peer's does: the tail before the attach end": Case(
        (SW, FULL), [PEER_SW, PEER_FULL], 10, 0, 330, ((208, 209), tuple(PEER_FULL[:10]))
    ),
    "one block short, 8 here already: only block 8 pulled": Case(
        (SW, FULL), [PEER_SW, PEER_FULL], 9, 8, 330, ((208,), tuple(PEER_FULL[:9]))
    ),
    "one block short, nothing here: block 7 is gone on the peer": Case(
        (SW, FULL), [PEER_SW, PEER_FULL], 9, 0, 330, "needs the peer's blocks 7..8, and it holds only 8 on"
    ),
    "far short of the peer's end": Case((SW, FULL), [PEER_SW, PEER_FULL], 3, 0, 330, "blocks 1..2"),
    "extra retained tokens widen what is pulled": Case(
        (SW_RETAINING, FULL), [PEER_SW, PEER_FULL], 10, 0, 330, "blocks 7..9, and it holds only 8 on"
    ),
    "a short prompt whose window the peer holds whole": Case(
        (SW, FULL), [[200, 201, 202], [100, 101, 102]], 2, 0, 70, ((200, 201), (100, 101))
    ),
    "the list starts early but the peer's window does not": Case(
        (SW, FULL), [[200, 201, 202], [100, 101, 102]], 2, 0, 96, "holds only 1 on"
    ),
    "nothing to pull: cut, unchecked": Case((SW, FULL), [PEER_SW, PEER_FULL], 3, 3, 330, ((), (100, 101, 102))),
    "a state group cannot be cut short": Case((MAMBA, FULL), [[7], PEER_FULL], 9, 0, 330, "not one per position"),
    "a state group with nothing to pull": Case((MAMBA, FULL), [[7], PEER_FULL], 0, 0, 330, ((), ())),
    "no full-attention group to place the window by": Case(
        (SW,), [PEER_SW], 10, 0, 330, "no full-attention group places its blocks"
    ),
    "lists for other groups than this engine's": Case(
        (SW, FULL), [PEER_FULL], 9, 0, 330, "1 block lists for 2 KV cache groups"
    ),
    "a full list shorter than the prefix": Case(ONE_FULL_GROUP, [[100]], 2, 0, 330, "the peer sent 1 blocks"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_group_is_cut_by_its_own_rule(case: Case) -> None:
    cut = cut_to_prefix(
        case.groups,
        case.lists,
        attach_blocks=case.attach,
        local_hit=case.hit,
        peer_tokens=case.peer_tokens,
        block_size=BS,
    )
    if isinstance(case.expected, str):
        assert isinstance(cut, Refused) and case.expected in cut.why
    else:
        assert cut == case.expected


def test_a_refusal_names_the_group() -> None:
    cut = cut_to_prefix((SW, FULL), [PEER_SW, PEER_FULL], attach_blocks=3, local_hit=0, peer_tokens=330, block_size=BS)
    assert isinstance(cut, Refused)
    assert cut.why.startswith("KV cache group 0 (SlidingWindowSpec, window 64): ")


@pytest.mark.parametrize(
    ("tokens", "skipped"), [(0, 0), (63, 0), (64, 0), (95, 1), (96, 1), (330, 8)], ids=lambda v: str(v)
)
def test_skipped_blocks_follow_vllms_window(tokens: int, skipped: int) -> None:
    # vLLM: max(0, num_computed_tokens - sliding_window + 1) tokens skipped, in whole blocks
    assert SW.skipped_blocks(tokens, BS) == skipped


def test_a_window_is_given_for_and_only_for_a_sliding_group() -> None:
    with pytest.raises(ValueError, match="KV cache group 2"):
        GroupLayout(index=2, spec_name="FullAttentionSpec", kind=GroupKind.FULL, sliding_window=64)
    with pytest.raises(ValueError, match="window"):
        GroupLayout(index=0, spec_name="SlidingWindowSpec", kind=GroupKind.SLIDING)
