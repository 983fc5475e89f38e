"""GPU tests: deselected by default (``-m 'not gpu'``); run with ``pytest -m gpu tests/gpu``.

They need a CUDA device. Selected on a machine without one, they skip (and say why) rather
than pass.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _require_cuda() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        pytest.skip("needs a CUDA device")


@pytest.fixture(params=["triton", "torch ops"])
def device_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with each device backend of the paged transfer: the fused Triton kernel
    (skipped where triton is not importable) and the torch ops."""
    from musacache.transfer import triton as _kernels

    if request.param == "triton" and not _kernels.available():
        pytest.skip("triton is not importable here")
    if request.param == "torch ops":
        monkeypatch.setattr(_kernels, "available", lambda: False)
    return str(request.param)
