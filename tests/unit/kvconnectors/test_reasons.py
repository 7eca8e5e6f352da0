"""The rejection reasons: one enum, whose values are the connector's metric labels."""

from __future__ import annotations

import pytest

from kvpilot.kvconnectors import verify
from kvpilot.kvconnectors.reasons import RECOMPUTE_REASONS, REJECT_REASONS, Reason

# Dashboards, alerts and the e2e tests match these strings: they never change.
SHIPPED_LABELS = {
    Reason.VERIFIED_ALL: "verified_all",
    Reason.TOKEN_MISMATCH: "token_mismatch",
    Reason.CONTRACT_MISMATCH: "contract_mismatch",
    Reason.MALFORMED: "malformed_params",
    Reason.PARTIAL_TAIL: "partial_tail",
    Reason.LEASE_EXPIRED: "lease_expired",
    Reason.PEER_FAILED: "peer_failed",
    Reason.PULL_POLICY: "pull_policy",
    Reason.LOAD_FAILED: "load_failed",
}


def test_every_reason_keeps_its_shipped_label() -> None:
    assert {reason: reason.value for reason in Reason} == SHIPPED_LABELS


def test_verify_decides_with_the_same_enum() -> None:
    assert verify.Reason is Reason


def test_rejections_are_recomputed_and_verified_all_is_neither() -> None:
    assert RECOMPUTE_REASONS[: len(REJECT_REASONS)] == REJECT_REASONS
    assert set(RECOMPUTE_REASONS) == set(Reason) - {Reason.VERIFIED_ALL}
    assert len(set(RECOMPUTE_REASONS)) == len(RECOMPUTE_REASONS)


def test_the_connector_counts_exactly_these_labels() -> None:
    """stats' label tuples derive from the enum, and the scheduler's records are built by keyword."""
    pytest.importorskip("vllm")
    from kvpilot.kvconnectors import stats
    from kvpilot.kvconnectors.attach_plan import AttachPlan

    assert stats.REASONS == (
        "token_mismatch",
        "contract_mismatch",
        "malformed_params",
        "partial_tail",
        "lease_expired",
        "peer_failed",
    )
    assert (*stats.REASONS, "pull_policy", "load_failed") == stats.RECOMPUTE_REASONS
    counted = stats.KVPilotStats()
    for reason in RECOMPUTE_REASONS:
        counted.count("recomputed_tokens", 1, reason=reason.value)
    with pytest.raises(ValueError, match="verified_all"):
        counted.count("rejected_blocks", 1, reason=Reason.VERIFIED_ALL.value)
    with pytest.raises(TypeError):
        AttachPlan(0, Reason.MALFORMED, 1, 32, 0, "positional")  # type: ignore[misc]  # refused on purpose
