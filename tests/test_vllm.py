"""The vLLM cases, run under the vLLM venv's interpreter.

vLLM (the CPU build) lives in its own venv (``bash .ci/vllm-env.sh``): it pins its own torch
stack. ``.ci/run`` exports that venv's python as ``MUSACACHE_VLLM_PYTHON``; these tests run
the cases in tests/integrations/ under it, as a subprocess, and fail with its output. With
``CI=true`` a missing venv is a failure, never a skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def run_cases(env_var: str, script: str, cases: list[str], timeout: float) -> None:
    python = os.environ.get(env_var)
    if not python:
        msg = f"{env_var} is unset: build the venv with bash {script} and export its python"
        if CI:
            pytest.fail(msg)
        pytest.skip(msg)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        *cases], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    # pytest's exit status 5 is "nothing collected": a case file that lost its tests.
    if r.returncode != 0 or " passed" not in r.stdout or "skipped" in r.stdout.splitlines()[-1]:
        pytest.fail(f"{' '.join(cases)} under {python} exited {r.returncode}:\n"
                    f"{r.stdout[-8000:]}\n{r.stderr[-4000:]}", pytrace=False)


@pytest.mark.timeout(1200)
def test_connector_cases_with_vllms_own_classes() -> None:
    run_cases("MUSACACHE_VLLM_PYTHON", ".ci/vllm-env.sh",
              ["tests/integrations/vllm_connector_cases.py",
               "tests/integrations/vllm_worker_cases.py"], timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_two_vllm_processes_share_one_node_server() -> None:
    run_cases("MUSACACHE_VLLM_PYTHON", ".ci/vllm-env.sh",
              ["tests/integrations/vllm_e2e.py"], timeout=2400)
