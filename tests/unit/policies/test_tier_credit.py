"""A slower tier's credit per block: what restoring a block saves against recomputing it."""

from __future__ import annotations

import pytest

from kvpilot.policies.tier_credit import restore_credit


@pytest.mark.parametrize(
    ("restore_s", "recompute_s", "credit"),
    [(0.0, 1e-3, 1.0), (0.25e-3, 1e-3, 0.75), (1e-3, 1e-3, 0.0), (4e-3, 1e-3, 0.0), (0.04e-3, 1e-3, 0.96)],
)
def test_a_block_earns_the_share_of_its_prefill_its_restore_saves(
    restore_s: float, recompute_s: float, credit: float
) -> None:
    assert restore_credit(restore_s, recompute_s) == pytest.approx(credit)


@pytest.mark.parametrize(("restore_s", "recompute_s"), [(1e-3, 0.0), (-1e-3, 1e-3)])
def test_a_restore_priced_against_no_prefill_is_refused(restore_s: float, recompute_s: float) -> None:
    with pytest.raises(ValueError, match="recompute time must be positive"):
        restore_credit(restore_s, recompute_s)
