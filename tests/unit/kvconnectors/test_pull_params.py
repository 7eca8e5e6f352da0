from __future__ import annotations

import pytest

from kvpilot.kvconnectors.pull_params import pull_fields_error, wants_remote_pull

GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e-1",
    "remote_request_id": "r-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 90,
}


@pytest.mark.parametrize(
    ("params", "wanted"),
    [
        (None, False),
        ("garbage", False),
        ({}, False),
        ({"do_remote_decode": True}, False),  # P side of a normal handoff
        (GOOD, True),
        ({"do_remote_prefill": True}, True),  # asks for a pull, fields missing: must be checked
        ({"do_remote_decode": True, "remote_block_ids": [[1]]}, True),  # bidirectional pull on P
        ({"do_remote_decode": True, "remote_block_ids": [[1]], "_remote_blocks_processed": True}, False),
    ],
)
def test_wants_remote_pull(params: object, wanted: bool) -> None:
    assert wants_remote_pull(params) is wanted  # type: ignore[arg-type]  # malformed params on purpose


def test_well_formed_fields_pass() -> None:
    assert pull_fields_error(GOOD) is None
    # NixlConnector's own params before any JSON round trip: block ids per group as tuples
    assert pull_fields_error({**GOOD, "remote_block_ids": ([1, 2, 3],)}) is None
    assert pull_fields_error({**GOOD, "remote_block_ids": [(1, 2, 3)]}) is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_block_ids": None}, "remote_block_ids"),
        ({"remote_block_ids": "abc"}, "remote_block_ids"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [[]]}, "remote_block_ids"),
        ({"remote_block_ids": [[1, -2]]}, "remote_block_ids"),
        ({"remote_block_ids": [[1, True]]}, "remote_block_ids"),
        ({"remote_block_ids": [1, 2]}, "remote_block_ids"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_request_id": 7}, "remote_request_id"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_port": "http"}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"pp_size": "1"}, "pp_size"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
    ],
)
def test_malformed_field_is_named(change: dict, field: str) -> None:
    error = pull_fields_error({**GOOD, **change})
    assert error is not None and error.startswith(field)
