"""End-to-end cost of verified KV attach on the live CPU fleet.

Starts a 1 P + 1 D tiny fleet with KVPilotConnector, then, for the longest prompt
the tiny model serves (``--tokens``, default 8,000 of its 8,192-token window), sends
``--repeats`` disaggregated requests through the router, each under a fresh cache
salt so that neither engine has a prefix hit. For each it reads:

- TTFT at the client (router -> P prefill -> NIXL pull -> D's first token);
- the scheduler time D spent verifying P's offer, from D's own
  ``vllm:kvpilot_verify_seconds_total`` (measured inside the engine);
- the bytes kvpilot added to P's kv_transfer_params.

It reports verification time as a fraction of TTFT measured in the same run.

    python -m benchmarks.bench_verify_e2e
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.client import complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import delta, scrape
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.kvconnectors.pull_params import handoff_request
from kvpilot.kvconnectors.vllm_metrics import KVPILOT_VERIFY_SECONDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model_dir = ensure_tiny_model()
    run_dir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-"))
    spec = FleetSpec(model_dir=model_dir, run_dir=run_dir, engine_port=8710, side_channel_port=6110, router_port=8700)
    started = fleet_io.up(spec, progress=lambda _: None)
    try:
        prefill, decode = started.by_role("prefill")[0].url, started.by_role("decode")[0].url
        prompt = [(i * 7919) % 2000 + 7 for i in range(args.tokens)]  # ids of ordinary tokens
        params = complete(
            prefill, prompt, max_tokens=1, kv_transfer_params=handoff_request(), cache_salt="size"
        ).kv_transfer_params
        if params is None:
            raise RuntimeError("P returned no kv_transfer_params (is it a KVPilotConnector engine?)")
        added_bytes = len(json.dumps({"kvpilot": params["kvpilot"]}))
        complete(started.router.url, prompt[:64], max_tokens=1)  # warm-up: the one-time NIXL handshake
        rows = []
        for _ in range(args.repeats):
            before = scrape(decode)
            out = complete(started.router.url, prompt, max_tokens=2, stream=True, cache_salt=uuid.uuid4().hex)
            time.sleep(0.5)  # counts reach /metrics on the stats loop's next tick
            verify = delta(scrape(decode), before, KVPILOT_VERIFY_SECONDS.total)
            rows.append((out.ttft_seconds, verify))
    finally:
        fleet_io.down(run_dir)

    ttft = statistics.median(r[0] for r in rows)
    verify = statistics.median(r[1] for r in rows)
    print(f"prompt {args.tokens} tokens, block size {spec.block_size}, {args.repeats} requests, medians")
    print(f"  TTFT (P prefill + NIXL pull + D first token)  {ttft * 1e3:10.1f} ms")
    print(f"  D-side verification (in-engine)               {verify * 1e3:10.3f} ms")
    print(f"  verification / TTFT                           {verify / ttft:10.5%}")
    print(f"  bytes added to kv_transfer_params             {added_bytes:10,d}")


if __name__ == "__main__":
    main()
