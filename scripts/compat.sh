#!/usr/bin/env bash
# `make compat` (also run by `make test`, before pytest): check what KVPilotConnector relies on in
# vLLM (kvconnectors/vllm_contract.py) against each vLLM release in VERSIONS, without installing
# any of them: each release's wheel is downloaded once (--no-deps), its Python files unpacked into
# a scratch folder, and the contract checked there by reading the source (ast; no torch, no GPU).
# One line per version, then its violations; exit status 1 if any version has one.
#
# VERSIONS: the newest patch of each vLLM minor release the GPU range covers and the ones it is
# meant to cover next (`pip index versions vllm`); override with KVPILOT_COMPAT_VERSIONS.
# Downloads and unpacked trees are kept under ${KVPILOT_CACHE:-~/.cache/kvpilot}/compat.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=${KVPILOT_COMPAT_VERSIONS:-"0.32.0 0.33.0 0.34.0"}
CACHE="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}/compat"
PY=.venv/bin/python

unpack() {  # wheel dest: the wheel's vllm/**/*.py into dest, atomically
    rm -rf "$2.partial"
    "$PY" - "$1" "$2.partial" <<'PYEOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
PYEOF
    mv "$2.partial" "$2"
}

status=0
for version in $VERSIONS; do
    src="$CACHE/src/$version"
    if [ ! -f "$src/vllm/__init__.py" ]; then
        wheel=$(ls "$CACHE/wheels/vllm-$version-"*.whl 2>/dev/null | head -n 1 || true)
        if [ -z "$wheel" ]; then
            "$PY" -m pip download --quiet --no-deps --only-binary=:all: "vllm==$version" -d "$CACHE/wheels"
            wheel=$(ls "$CACHE/wheels/vllm-$version-"*.whl | head -n 1)
        fi
        rm -rf "$src"
        unpack "$wheel" "$src"
    fi
    "$PY" -m kvpilot.kvconnectors.vllm_contract "$src" || status=1
done
exit $status
