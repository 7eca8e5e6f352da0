"""KV transfer throughput, P->D and D->P, through KVPilotConnector against plain NixlConnector.

One run brings up a 1 P + 1 D tiny fleet per connector in turn (both bidirectional,
``kv_recompute_threshold`` 0 so that every verified span is pulled), each with the
same ``--sessions`` agent sessions: turn 1 P prefills a ``--history``-token prompt and
D pulls it (P->D), D generates ``--generated`` tokens; turn 2 P receives D's
end-of-turn params with the history + D's output + a new tool output and pulls D's
blocks beyond its local hit (D->P); D pulls turn 2 from P. Throughput is the bytes
vLLM's NIXL worker moved over the time it measured for them, from each engine's own
``vllm:nixl_bytes_transferred`` and ``vllm:nixl_xfer_time_seconds`` (D's counters for
P->D, P's for D->P), so the one-time NIXL handshakes and the CPU box's scheduling
stalls between requests do not count. Then raw NIXL (:mod:`benchmarks.nixl_raw`: two bare
agents in two processes) reads the same number of transfers with the mean descriptor
size and count the connectors used in each direction: the link's ceiling here. It
prints bytes/s per direction and the kvpilot / plain and kvpilot / raw ratios
(target: kvpilot at least 0.9x plain).

    python -m benchmarks.bench_transfer
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import nixl_raw
from kvpilot.deploy import fleet as fleet_io
from kvpilot.deploy.agent_session import decoded_turn, prefill_next_turn
from kvpilot.deploy.client import HTTPStatusError, complete
from kvpilot.deploy.fleet_spec import FleetSpec
from kvpilot.deploy.metrics import Samples, delta, scrape
from kvpilot.deploy.prompts import filler_text
from kvpilot.deploy.tiny_model import ensure_tiny_model
from kvpilot.kvconnectors.vllm_metrics import NIXL_BYTES_TRANSFERRED, NIXL_NUM_DESCRIPTORS, NIXL_XFER_TIME_SECONDS
from kvpilot.routing.serve.tokenizer import PromptTokenizer

CONNECTORS = ("NixlConnector", "KVPilotConnector")


def session(p_url: str, d_url: str, tokenizer: PromptTokenizer, seed: int, history: int, generated: int) -> None:
    """One two-turn agent session: P->D, then D->P and P->D again."""
    x = tokenizer.text_token_ids(f"session {seed}: " + filler_text(history, seed))
    turn = decoded_turn(p_url, d_url, x, generated)
    x2 = x + turn.generated + tokenizer.text_token_ids(" tool: " + filler_text(60, seed + 1))
    p2 = prefill_next_turn(p_url, x2, turn.d_params)
    complete(d_url, x2, max_tokens=2, kv_transfer_params=p2.kv_transfer_params)


@dataclass(frozen=True)
class Moved:
    """What one engine's NIXL worker moved between two scrapes."""

    nbytes: float
    seconds: float
    transfers: int
    descriptors: int

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


def throughput(after: Samples, before: Samples) -> Moved:
    return Moved(
        delta(after, before, NIXL_BYTES_TRANSFERRED.sum),
        delta(after, before, NIXL_XFER_TIME_SECONDS.sum),
        int(delta(after, before, NIXL_XFER_TIME_SECONDS.count)),
        int(delta(after, before, NIXL_NUM_DESCRIPTORS.sum)),
    )


def raw_baseline(moved: Moved) -> Moved:
    """Raw NIXL on ``moved``'s transfer count and mean descriptor size and count."""
    if not moved.transfers or not moved.descriptors:
        return Moved(0.0, 0.0, 0, 0)
    per_transfer = max(1, round(moved.descriptors / moved.transfers))
    descriptor_bytes = max(1, round(moved.nbytes / moved.descriptors))
    raw = nixl_raw.measure(descriptor_bytes, per_transfer, moved.transfers)
    return Moved(raw.nbytes, raw.seconds, raw.transfers, per_transfer * raw.transfers)


def measure(connector: str, args: argparse.Namespace, tokenizer: PromptTokenizer) -> dict[str, Moved]:
    spec = FleetSpec(
        model_dir=ensure_tiny_model(),
        run_dir=Path(tempfile.mkdtemp(prefix="kvpilot-bench-")),
        disaggregation="always",
        connector=connector,
        connector_extra_config={"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0},
        engine_port=8710,
        side_channel_port=6110,
        events_port=6710,
        router_port=8700,
    )
    started = fleet_io.up(spec, progress=lambda _: None)
    try:
        p_url, d_url = started.by_role("prefill")[0].url, started.by_role("decode")[0].url
        session(p_url, d_url, tokenizer, 0, 64, args.generated)  # the one-time handshakes, both ways
        p0, d0 = scrape(p_url), scrape(d_url)
        for seed in range(1, args.sessions + 1):
            session(p_url, d_url, tokenizer, seed, args.history, args.generated)
        return {"P->D": throughput(scrape(d_url), d0), "D->P": throughput(scrape(p_url), p0)}
    finally:
        fleet_io.down(spec.run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--history", type=int, default=1500, help="words of history per session")
    parser.add_argument("--generated", type=int, default=160, help="tokens D generates in turn 1")
    args = parser.parse_args()
    tokenizer = PromptTokenizer(ensure_tiny_model())
    results: dict[str, dict[str, Moved]] = {}
    for connector in CONNECTORS:
        try:
            results[connector] = measure(connector, args, tokenizer)
        except (TimeoutError, OSError, HTTPStatusError, RuntimeError) as exc:  # a stalled or dead engine
            print(f"{connector}: the sessions did not complete ({exc!r}); its row is empty")
            results[connector] = {direction: Moved(0.0, 0.0, 0, 0) for direction in ("P->D", "D->P")}
    raw = {direction: raw_baseline(results["KVPilotConnector"][direction]) for direction in ("P->D", "D->P")}

    print(f"{args.sessions} sessions, {args.history}-word history, {args.generated} generated tokens")
    print(f"{'direction':10} {'path':18} {'transfers':>9} {'MB':>9} {'xfer s':>8} {'MB/s':>9}")
    for direction in ("P->D", "D->P"):
        rows = {**{c: results[c][direction] for c in CONNECTORS}, "raw NIXL": raw[direction]}
        for path, moved in rows.items():
            print(
                f"{direction:10} {path:18} {moved.transfers:9d} {moved.nbytes / 1e6:9.2f} {moved.seconds:8.3f} "
                f"{moved.bytes_per_s / 1e6:9.1f}"
            )
        kvpilot = rows["KVPilotConnector"].bytes_per_s
        plain, ceiling = rows["NixlConnector"].bytes_per_s, rows["raw NIXL"].bytes_per_s
        print(
            f"{direction:10} kvpilot / plain {kvpilot / plain if plain else float('nan'):.2f}x, "
            f"kvpilot / raw {kvpilot / ceiling if ceiling else float('nan'):.2f}x"
        )


if __name__ == "__main__":
    main()
