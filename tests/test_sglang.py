"""The SGLang HiCache backend's contract cases, run under the SGLang venv's interpreter
(``bash .ci/sglang-env.sh``; ``.ci/run`` exports ``MUSACACHE_SGLANG_PYTHON``). With
``CI=true`` a missing venv is a failure, never a skip."""

from __future__ import annotations

import pytest

from test_vllm import run_cases


@pytest.mark.timeout(1200)
def test_hicache_backend_against_the_real_sglang() -> None:
    run_cases("MUSACACHE_SGLANG_PYTHON", ".ci/sglang-env.sh",
              ["tests/integrations/sglang_cases.py"], timeout=900)
