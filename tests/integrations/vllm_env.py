"""Helpers for the cases that need vLLM: they run under the vLLM venv's interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(module: str, script: str) -> None:
    """Skip (locally) or fail (CI=true) when ``module`` is not importable here."""
    if importlib.util.find_spec(module) is not None:
        return
    msg = (f"{module} is not importable by {os.sys.executable}; build its venv with "
           f"bash {script} and run these cases with that venv's python")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg)
    pytest.skip(msg)
