"""``kvpilot cost``, ``kvpilot plan`` and ``kvpilot agent``: the policies package's only I/O.

``add_subcommands`` registers them on an argparse subparsers object; each sets
``func(args) -> int``. ``python -m kvpilot.policies.cli {cost,plan,agent} ...`` runs them
standalone. ``--model``/``--hardware``/``--link`` take a preset name or a path
(a YAML/JSON spec, an HF ``config.json``, or a model directory holding one).
Exit codes: 0 done, 2 bad spec or argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvpilot.policies import agent_report
from kvpilot.policies.disaggregation import KVPILOT_DEFAULT, DecodeState, LocalVsRemotePolicy
from kvpilot.policies.planner import Workload, plan, render
from kvpilot.policies.presets import (
    HF_CONFIGS,
    KV_FORMATS,
    LINKS,
    hardware_from_mapping,
    hardware_preset,
    kv_format_preset,
    link_from_mapping,
    link_preset,
    model_from_mapping,
    model_preset,
    parse_document,
)
from kvpilot.policies.recompute_vs_transfer import PrefillLoad, RecomputeVsTransferPolicy, Span
from kvpilot.policies.roofline import kv_bytes, kv_bytes_per_token, prefill
from kvpilot.policies.scenarios import default_scenarios, evaluate, render_table
from kvpilot.policies.specs import SpecError

_T = TypeVar("_T")


def _resolve(arg: str, preset: Callable[[str], _T], from_mapping: Callable[[dict[str, Any], str], _T]) -> _T:
    """A preset by name, or a spec read from a file (or a directory's config.json)."""
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return from_mapping(parse_document(path.read_text(), str(path)), str(path))
    return preset(arg)


def _fail(exc: Exception) -> int:
    print(f"kvpilot: error: {exc}", file=sys.stderr)
    return 2


def run_cost(args: argparse.Namespace) -> int:
    """Cost one span: KV bytes, recompute seconds, transfer seconds, and the decision."""
    try:
        model = _resolve(args.model, model_preset, model_from_mapping)
        hw = _resolve(args.hardware, hardware_preset, hardware_from_mapping)
        link = _resolve(args.link, link_preset, link_from_mapping)
        fmt = kv_format_preset(args.kv_format)
        policy = RecomputeVsTransferPolicy(model, fmt, hw, link)
        if args.scenarios:
            print(render_table(evaluate(policy, default_scenarios(link))))
            return 0
        if args.new < 0 or args.context < 0:
            raise SpecError("new" if args.new < 0 else "context", "must be >= 0")
        decision = policy.decide(Span(args.new, args.context), PrefillLoad(args.p_queued, args.p_running))
    except (SpecError, ValueError) as exc:
        return _fail(exc)
    span_bytes = kv_bytes(model, fmt, args.new)
    result = {
        "model": model.name,
        "hardware": hw.name,
        "kv_format": fmt.name,
        "link": link.name,
        "new_tokens": args.new,
        "context_tokens": args.context,
        "kv_bytes_per_token": kv_bytes_per_token(model, fmt),
        "span_kv_bytes": span_bytes,
        "prefill_s": prefill(model, fmt, hw, args.new, args.context).seconds,
        "recompute_s": decision.recompute_s,
        "transfer_s": decision.transfer_s,
        "decision": decision.choice.value,
        "reason": decision.explain(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{model.name} on {hw.name}, KV {fmt.name}, link {link.name}: {args.new} tokens at context {args.context}")
    print(
        f"  KV bytes per token   {result['kv_bytes_per_token']:,.0f} B ({result['kv_bytes_per_token'] / 1024:.0f} KiB)"
    )
    print(f"  KV bytes of the span {span_bytes / 1e6:,.1f} MB")
    print(f"  prefill (recompute)  {result['prefill_s'] * 1e3:,.2f} ms")
    print(f"  transfer             {decision.transfer_s * 1e3:,.2f} ms")
    print(f"  decision             {decision.explain()}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """Size P and D pools under each caching regime; table, JSON, or a PNG chart."""
    try:
        model = _resolve(args.model, model_preset, model_from_mapping)
        hw = _resolve(args.hardware, hardware_preset, hardware_from_mapping)
        link = _resolve(args.restore_link, link_preset, link_from_mapping)
        workload = Workload(
            args.sessions,
            args.prefix,
            args.task,
            args.output_tokens,
            args.tool_output,
            args.steps,
            args.tool_seconds,
            args.tpot_ms / 1e3,
        )
        result = plan(model, hw, link, workload)
    except (SpecError, ValueError) as exc:
        return _fail(exc)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    if args.plot:
        _plot(result.to_dict(), args.plot)
    return 0


def run_agent(args: argparse.Namespace) -> int:
    """The agent benchmark's arms on the roofline, one table per link (and D state)."""
    try:
        model = _resolve(args.model, model_preset, model_from_mapping)
        hw = _resolve(args.hardware, hardware_preset, hardware_from_mapping)
        links = [_resolve(name, link_preset, link_from_mapping) for name in args.link or ("rdma", "nvlink")]
        workload = Workload(1, args.prefix, args.task, args.output_tokens, args.tool_output, args.steps)
        fmt = kv_format_preset(args.kv_format)
    except (SpecError, ValueError) as exc:
        return _fail(exc)
    tables = []
    for link in links:
        policy = LocalVsRemotePolicy(model, fmt, hw, hw, link, KVPILOT_DEFAULT)
        for streams in sorted({0, args.decode_streams}):
            title = f"{model.name} on {hw.name}, {link.name}, D running {streams} streams"
            tables.append(agent_report.render(agent_report.predict(policy, workload, DecodeState(0.0, streams)), title))
    if args.measured:
        try:
            run = json.loads(Path(args.measured).read_text())
            cfg, summaries = run["config"], run["summaries"]
            bench = Workload(
                1, cfg["prefix_tokens"], cfg["tool_tokens"], cfg["generated"], cfg["tool_tokens"], cfg["steps"]
            )
            measured = {
                agent_report.BENCH_ARMS[letter]: float(summary["prefill_computed"])
                for letter, summary in summaries.items()
                if letter in agent_report.BENCH_ARMS
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return _fail(ValueError(f"--measured {args.measured}: not a bench_agent.py result ({exc!r})"))
        policy = LocalVsRemotePolicy(model, fmt, hw, hw, links[0], KVPILOT_DEFAULT)
        title = f"{model.name} on {hw.name}, {links[0].name}: the benchmark's workload, predicted and measured"
        tables.append(agent_report.render_measured(agent_report.predict(policy, bench), measured, title))
    print("\n\n".join(tables))
    return 0


def _plot(data: dict[str, Any], path: str) -> None:
    """P and D instances per regime as grouped bars, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    labels = [r["label"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar([x - 0.2 for x in xs], [r["p_instances"] for r in rows], width=0.4, label="P instances")
    ax.bar([x + 0.2 for x in xs], [r["d_instances"] for r in rows], width=0.4, label="D instances")
    ax.set_xticks(list(xs), labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("instances")
    ax.set_title(
        f"{data['model']} on {data['hardware']}: {data['workload']['sessions']} agent sessions, "
        f"{data['steps_per_s']:.1f} steps/s"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cost``, ``plan`` and ``agent`` to a ``kvpilot`` subparsers object."""
    models = f"preset ({', '.join(HF_CONFIGS)}) or a YAML/JSON/config.json path"
    hardware = "preset (<gpu>x<count>, GPUs b200, h100, h200) or a YAML/JSON path"
    formatter = argparse.ArgumentDefaultsHelpFormatter
    cost = subparsers.add_parser(
        "cost",
        help="cost one span: recompute vs transfer",
        description="Price one span of KV on the roofline: recompute it, or transfer it.",
        formatter_class=formatter,
    )
    cost.add_argument("--model", default="llama-70b", help=models)
    cost.add_argument("--hardware", default="b200x2", help=hardware)
    cost.add_argument("--kv-format", default="bf16", choices=sorted(KV_FORMATS), help="the KV cache's element format")
    cost.add_argument("--link", default="rdma", help=f"preset ({', '.join(LINKS)}) or a YAML/JSON path")
    cost.add_argument("--new", type=int, default=150, help="tokens in the span")
    cost.add_argument("--context", type=int, default=62_000, help="tokens before the span")
    cost.add_argument("--p-queued", type=int, default=0, help="P's queued prefill tokens")
    cost.add_argument("--p-running", type=int, default=0, help="tokens in P's running pass")
    cost.add_argument("--scenarios", action="store_true", help="print the scenario table instead")
    cost.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cost.set_defaults(func=run_cost)

    pl = subparsers.add_parser(
        "plan",
        help="size P and D pools for an agent workload",
        description="Size the prefill and decode pools for an agent workload on the roofline.",
        formatter_class=formatter,
    )
    defaults = Workload()
    pl.add_argument("--model", default="llama-70b", help=models)
    pl.add_argument("--hardware", default="b200x2", help=hardware)
    pl.add_argument("--restore-link", default="pcie", help="link that restores offloaded sessions")
    pl.add_argument("--sessions", type=int, default=defaults.sessions, help="concurrent agent sessions")
    pl.add_argument("--prefix", type=int, default=defaults.shared_prefix_tokens, help="shared prefix tokens")
    pl.add_argument("--task", type=int, default=defaults.task_tokens, help="task tokens")
    pl.add_argument("--output-tokens", type=int, default=defaults.output_tokens, help="generated tokens per step")
    pl.add_argument("--tool-output", type=int, default=defaults.tool_output_tokens, help="tool tokens per step")
    pl.add_argument("--steps", type=int, default=defaults.steps, help="steps per session")
    pl.add_argument("--tool-seconds", type=float, default=defaults.tool_seconds, help="seconds a tool call takes")
    pl.add_argument(
        "--tpot-ms", type=float, default=defaults.tpot_target_s * 1e3, help="the decode pool's TPOT target, ms"
    )
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.add_argument("--plot", metavar="FILE", help="write a PNG chart of the pools")
    pl.set_defaults(func=run_plan)

    ag = subparsers.add_parser(
        "agent",
        help="the agent benchmark's arms (no cache ... kvpilot) on the roofline",
        description="The agent benchmark's five arms priced on the roofline, for the article's setting.",
        formatter_class=formatter,
    )
    ag.add_argument("--model", default="llama-70b", help=models)
    ag.add_argument("--hardware", default="h100x2", help=hardware)
    ag.add_argument("--kv-format", default="bf16", choices=sorted(KV_FORMATS), help="the KV cache's element format")
    ag.add_argument("--link", action="append", help="preset or path; repeat for several (default: rdma and nvlink)")
    ag.add_argument("--prefix", type=int, default=defaults.shared_prefix_tokens, help="shared prefix tokens")
    ag.add_argument("--task", type=int, default=defaults.task_tokens, help="task tokens")
    ag.add_argument("--output-tokens", type=int, default=defaults.output_tokens, help="generated tokens per step")
    ag.add_argument("--tool-output", type=int, default=defaults.tool_output_tokens, help="tool tokens per step")
    ag.add_argument("--steps", type=int, default=defaults.steps, help="steps per session")
    ag.add_argument("--decode-streams", type=int, default=64, help="D's running streams in the busy case")
    ag.add_argument("--measured", metavar="JSON", help="a bench_agent.py --out file: its ratios beside the model's")
    ag.set_defaults(func=run_agent)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.policies.cli")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
