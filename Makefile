# The two commands: `make demo` (set up, then run the main job on the tiny CPU fleet)
# and `make test` (set up, lint and type-check, build the docs site, check the vLLM contract against
# each release, then run every test). Both install what they need.
.PHONY: setup demo test lint

setup:
	./scripts/bootstrap.sh
	$(MAKE) --no-print-directory -C routing/native  # kvpilot's compiled decision (routing/native/README.md)

demo: setup
	.venv/bin/kvpilot demo

test: setup
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory docs
	./scripts/compat.sh
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25

# The docs site, built strictly (a broken link, a missing anchor or a page left out of the
# navigation fails it); run by `make test`. `.venv/bin/mkdocs serve` to read it while writing.
.PHONY: docs
docs:
	.venv/bin/mkdocs build --strict --quiet

# Lint and types (after `make setup`; run by `make test`): ruff (rules in pyproject.toml) on
# LINT_PATHS; mypy strict on the package by its import names (`kvpilot.routing` is routing/:
# TYPECHECK holds the links that name it so) and on the benchmarks.
LINT_PATHS = .
PACKAGE_DIRS = kvconnectors routing policies deploy grafana
TYPECHECK = .kvpilot/typecheck
lint:
	.venv/bin/ruff check $(LINT_PATHS)
	.venv/bin/ruff format --check $(LINT_PATHS)
	mkdir -p $(TYPECHECK)/kvpilot
	for d in $(PACKAGE_DIRS); do ln -sfn ../../../$$d $(TYPECHECK)/kvpilot/$$d; done
	.venv/bin/python -m mypy -p kvpilot
	.venv/bin/python -m mypy benchmarks

# vLLM compatibility: the contract KVPilotConnector relies on (kvconnectors/vllm_contract.py),
# checked against each vLLM release of scripts/compat.sh by reading its wheel's source (no
# install, no GPU; wheels cached under $${KVPILOT_CACHE:-~/.cache/kvpilot}/compat); run by `make test`.
.PHONY: compat
compat: setup
	./scripts/compat.sh

# The image every kvpilot pod runs (deploy/k8s/Dockerfile: vLLM's CUDA image with kvpilot
# installed), tagged as deploy/k8s/values.yaml's `image` names it; `make image BASE=...` builds
# it on another base image (the Dockerfile says which ones work).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
.PHONY: image
image:
	docker build -f deploy/k8s/Dockerfile $(if $(BASE),--build-arg BASE=$(BASE) )-t kvpilot:$(VERSION) .

# Re-run exactly the committed results that are older than the code they measure
# (docs/benchmarks/stale.md, benchmarks/staleness.py), each by its recorded command from a clean
# worktree of HEAD; then `python -m benchmarks.staleness --write` and commit.
.PHONY: bench-stale
bench-stale: setup
	.venv/bin/python -m benchmarks.staleness --rerun

# The benchmarks: ratios against baselines measured in the same run (see README).
.PHONY: bench
bench: setup
	taskset -c 1 .venv/bin/python -m benchmarks.bench_verify
	.venv/bin/python -m benchmarks.bench_verify_e2e
	taskset -c 1 .venv/bin/python -m benchmarks.bench_router_index
	.venv/bin/python -m benchmarks.bench_router_overhead
	.venv/bin/python -m benchmarks.bench_tokenize --json /tmp/kvpilot-bench-tokenize.json
	.venv/bin/python -m benchmarks.bench_hot_prefix
	.venv/bin/python -m benchmarks.bench_transfer
	.venv/bin/python -m benchmarks.bench_pull_policy
	.venv/bin/python -m benchmarks.bench_agent
	.venv/bin/python -m benchmarks.bench_agent --steps 6 --arms e --handicap-arm --sessions-sweep 1,2,4 \
		--ttft-slo 1.0 --tpot-slo 0.1 --out /tmp/kvpilot-bench-agent-goodput.json --plot /tmp/kvpilot-bench-agent-goodput.png
	.venv/bin/python -m benchmarks.bench_fleet
	.venv/bin/python -m benchmarks.make_agent_trace --sessions 32 --steps 20 --out /tmp/kvpilot-agent-trace.jsonl
	.venv/bin/python -m benchmarks.bench_fleet --trace /tmp/kvpilot-agent-trace.jsonl --workers 64 --max-requests 640 \
		--tokens-per-hash 128 --speedup 1 --arms dynamo_kv,dynamo_kv_tuned,dynamo_kv_envoy,kvpilot,kvpilot_native \
		--no-floor --json /tmp/kvpilot-bench-fleet-agent.json
	for p in 16:16:1.25 16:32:0.625 16:64:0.3125 64:32:0.625 64:64:0.3125 64:128:0.15625; do w=$${p%%:*}; \
		g=$${p##*:}; s=$${p#*:}; s=$${s%:*}; .venv/bin/python -m benchmarks.make_agent_trace --sessions $$s --steps 20 \
		--session-gap-s $$g --out /tmp/kvpilot-agent-s$$s.jsonl && .venv/bin/python -m benchmarks.bench_fleet \
		--trace /tmp/kvpilot-agent-s$$s.jsonl --workers $$w --max-requests 100000 --tokens-per-hash 128 --speedup 1 \
		--arms dynamo_kv,dynamo_kv_tuned,kvpilot --json /tmp/kvpilot-live-agent-$$w-s$$s.json || exit 1; done
	.venv/bin/python -m benchmarks.live_goodput --workers 16 --sessions 16,32,64 --out-dir /tmp/kvpilot-live-goodput-16 \
		--json /tmp/kvpilot-live-goodput-agent-16.json
	.venv/bin/python -m benchmarks.sim_live /tmp/kvpilot-live-agent-16-s16.json /tmp/kvpilot-live-agent-16-s32.json \
		/tmp/kvpilot-live-agent-16-s64.json --json /tmp/kvpilot-sim-live-agent-16-sweep.json
	.venv/bin/python -m benchmarks.sim_live /tmp/kvpilot-live-agent-64-s32.json /tmp/kvpilot-live-agent-64-s64.json \
		/tmp/kvpilot-live-agent-64-s128.json --json /tmp/kvpilot-sim-live-agent-64-sweep.json
	for r in 4 8 16; do .venv/bin/python -m benchmarks.bench_fleet --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
		--workers 64 --max-requests 200 --rate-scale $$r --speedup 1 --arms dynamo_kv,dynamo_kv_tuned,kvpilot \
		--json /tmp/kvpilot-live-conversation-64-x$$r.json || exit 1; done
	.venv/bin/python -m benchmarks.sim_live /tmp/kvpilot-live-conversation-64-x4.json \
		/tmp/kvpilot-live-conversation-64-x8.json /tmp/kvpilot-live-conversation-64-x16.json \
		--json /tmp/kvpilot-sim-live-conversation-64-sweep.json
	.venv/bin/python -m benchmarks.sim_vs_dynamo --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
		--trace benchmarks/traces/mooncake_synthetic_trace.jsonl --trace /tmp/kvpilot-agent-trace.jsonl --workers 16,64
	.venv/bin/python -m benchmarks.sim_goodput --trace benchmarks/traces/mooncake_synthetic_trace.jsonl --workers 64
	for w in 64 256; do .venv/bin/python -m benchmarks.sim_goodput --agent --workers $$w \
		--json /tmp/kvpilot-sim-goodput-agent-$$w.json || exit 1; done
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 1024 --sessions-per-worker 1 \
		--json /tmp/kvpilot-sim-goodput-agent-1024.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 1024 --sessions-per-worker 2 \
		--json /tmp/kvpilot-sim-goodput-agent-1024-2.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 1024 --sessions-per-worker 4 \
		--json /tmp/kvpilot-sim-goodput-agent-1024-4.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 64 --sessions-per-worker 2,4,6,8,10 --steps-per-turn 5 \
		--human-gap-s 60 --num-gpu-blocks 2048 --host-blocks 16384 --kv-bytes-per-token 131072 --host-gb-s 32 \
		--json /tmp/kvpilot-sim-goodput-agent-64-tiers.json
	.venv/bin/python -m benchmarks.make_agent_trace --sessions 96 --steps 20 --steps-per-turn 5 --human-gap-s 30 \
		--session-gap-s 0.2 --out /tmp/kvpilot-agent-tiers-s96.jsonl
	.venv/bin/python -m benchmarks.bench_fleet --trace /tmp/kvpilot-agent-tiers-s96.jsonl --workers 16 --max-requests 100000 \
		--tokens-per-hash 128 --speedup 1 --arms dynamo_kv,dynamo_kv_tuned,kvpilot --mocker-flags "--num-gpu-blocks-override \
		768 --num-host-blocks 8192 --kv-bytes-per-token 131072 --host-offload-d2h-bandwidth-gbps 32 \
		--host-offload-h2d-bandwidth-gbps 32" --json /tmp/kvpilot-live-agent-16-tiers.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 64 --sessions-per-worker 1,2,3,4,5 --ablate \
		--json /tmp/kvpilot-sim-goodput-agent-64-ablate.json
	.venv/bin/python -m benchmarks.sim_vs_dynamo --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
		--trace benchmarks/traces/mooncake_synthetic_trace.jsonl --trace /tmp/kvpilot-agent-trace.jsonl --workers 16,64 \
		--prefill-workers 8,32 --json /tmp/kvpilot-sim-vs-dynamo-disaggregated.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 64 --prefill-workers 32 --sessions-per-worker 2,4,6,7,8 \
		--json /tmp/kvpilot-sim-goodput-agent-32p64d.json
	.venv/bin/python -m benchmarks.sim_vs_dynamo --trace /tmp/kvpilot-agent-trace.jsonl --workers 16,64 --repeats 10 \
		--json /tmp/kvpilot-sim-vs-dynamo-agent-10.json
	.venv/bin/python -m benchmarks.sim_vs_dynamo --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
		--trace benchmarks/traces/mooncake_synthetic_trace.jsonl --trace /tmp/kvpilot-agent-trace.jsonl --workers 16,64 \
		--kv-event-lag-ms 100 --json /tmp/kvpilot-sim-vs-dynamo-lag-100ms.json
	.venv/bin/python -m benchmarks.sim_goodput --trace benchmarks/traces/mooncake_conversation_trace.jsonl --workers 64 \
		--json /tmp/kvpilot-sim-goodput-conversation-64.json
	for t in synthetic conversation; do .venv/bin/python -m benchmarks.sim_goodput \
		--trace benchmarks/traces/mooncake_$${t}_trace.jsonl --workers 256 --speedups 16,32,64,128,256 \
		--json /tmp/kvpilot-sim-goodput-$$t-256.json && .venv/bin/python -m benchmarks.sim_goodput \
		--trace benchmarks/traces/mooncake_$${t}_trace.jsonl --workers 1024 --speedups 64,128,256,512,1024 \
		--json /tmp/kvpilot-sim-goodput-$$t-1024.json || exit 1; done
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 256 --prefill-workers 128 --sessions-per-worker 2,4 \
		--json /tmp/kvpilot-sim-goodput-agent-128p256d.json
	.venv/bin/python -m benchmarks.sim_goodput --agent --workers 256 --prefill-workers 128 --sessions-per-worker 6 \
		--json /tmp/kvpilot-sim-goodput-agent-128p256d-6.json
	.venv/bin/python -m benchmarks.bench_dynamo_connections
	.venv/bin/python -m benchmarks.bench_router_scale
	.venv/bin/python -m benchmarks.bench_idle_cpu
	.venv/bin/python -m benchmarks.bench_session_hold --json /tmp/kvpilot-session-hold.json
