#!/usr/bin/env bash
# The fused Triton kernel under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors:
# a venv of its own with torch 2.13.0 (this machine's local wheel) and the triton package,
# which CPU builds of torch do not bring. tests/test_kernels.py is marked
# triton and deselected in the main suite, so only this run covers it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-kernels
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 triton -e ".[test]"
"$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m triton tests/test_kernels.py
