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
