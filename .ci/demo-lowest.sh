#!/usr/bin/env bash
# The demo test at the lowest transformers that pyproject.toml declares: a venv of its own
# (torch 2.13.0, the only torch this machine has a local wheel for), the project installed
# with its test extra, transformers pinned to the floor of the declared range.
set -euo pipefail
cd "$(dirname "$0")/.."
lowest=$(sed -n 's/^ *"transformers>=\([0-9][0-9.]*\)[,"].*/\1/p' pyproject.toml | head -n 1)
if [ -z "$lowest" ]; then
  echo ".ci/demo-lowest.sh: no transformers>=X line in pyproject.toml" >&2
  exit 2
fi
venv=.venv-demo-lowest
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 \
  -e ".[test]" "transformers==$lowest"
"$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_demo.py
