"""The fused Triton kernel, run by Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors, against the same plain-torch reference as the other transfer tests.

Needs the ``triton`` package (it ships with CUDA builds of torch; on a CPU machine install it
next to torch in a virtualenv). Marked ``triton`` and deselected by default: ``bash
.ci/kernels-interpret.sh`` runs them with ``-m triton`` in a venv that has it, and there a
missing triton fails them instead of skipping.
"""

from __future__ import annotations

import random
import types
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musacache import devices, transfer
from musacache.transfer import relay as _relay
from musacache.transfer import triton as _kernels
from test_transfer_chunks import (
    NUM_SLOTS,
    chunk_tensors,
    clone_caches,
    concat,
    flat,
    make_caches,
    reference_gather,
    reference_scatter,
)

pytestmark = pytest.mark.triton


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real kernel under the interpreter, fed CPU tensors taken for cuda ones."""
    import triton  # noqa: F401  (selected with -m triton: a missing package is a failure)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _kernels._compiled.cache_clear()
    launches: list[tuple[int, int, int]] = []
    real = _kernels.launch

    def counting(**kw: Any) -> None:
        launches.append(kw["grid"])
        real(**kw)

    monkeypatch.setattr(_kernels, "launch", counting)
    monkeypatch.setattr(transfer, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(transfer, "_device_visible", lambda dense, device: True)
    # The chunks stand for device tensors (or for one window of pinned host ones, which the
    # kernel writes through their device address); host chunks in windows are tested below.
    monkeypatch.setattr(_relay, "host_side", lambda tensor: False)
    mod = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                stream=lambda s: _Null(), current_stream=lambda d=None: None)
    monkeypatch.setitem(devices._module_overrides, "cuda", mod)
    devices._reset_probes()
    yield launches
    _kernels._compiled.cache_clear()
    devices._reset_probes()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


requests = st.fixed_dictionaries({
    "layout": st.sampled_from(transfer.LAYOUTS),
    "layers": st.integers(1, 2),
    "sizes": st.lists(st.integers(0, 4), min_size=1, max_size=3),
    "seed": st.integers(0, 2**31 - 1),
})


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_fused_kernel_gathers_and_scatters_like_the_reference(interpreted: Any,
                                                             req: dict[str, Any]) -> None:
    layout, layers, sizes = req["layout"], req["layers"], req["sizes"]
    rng = np.random.default_rng(req["seed"])
    total = sum(sizes)
    slots = rng.permutation(NUM_SLOTS)[:total].tolist()
    slots = [s if rng.random() > 0.2 else -1 for s in slots]
    torch.manual_seed(req["seed"])
    caches = make_caches(layout, layers)
    permuted = (rng.random(len(sizes)) < 0.4).tolist()
    dsts = chunk_tensors(layout, layers, sizes, permuted)
    before = concat([d.clone() for d in dsts], layout)
    interpreted.clear()
    transfer.gather_chunks(caches, torch.tensor(slots, dtype=torch.int64), dsts, layout)
    assert torch.equal(concat(dsts, layout), reference_gather(caches, layout, slots, before))
    assert len(interpreted) == (1 if total else 0)

    srcs = chunk_tensors(layout, layers, sizes, permuted)
    target = clone_caches(caches)
    expected = reference_scatter(concat(srcs, layout), target, layout, slots)
    transfer.scatter_chunks(srcs, target, torch.tensor(slots, dtype=torch.int64), layout)
    assert all(torch.equal(a, b) for a, b in zip(flat(target), flat(expected), strict=True))


def test_transfer_gather_on_cuda_uses_the_fused_kernel(interpreted: Any) -> None:
    caches = make_caches("vllm", 3)
    out = torch.zeros(3, 2, 5, 2, 8, dtype=torch.bfloat16)
    slots = [0, 7, -1, 3, 15]
    transfer.gather(caches, slots, out, "vllm")
    assert interpreted == [(5, 3, 2)]
    assert torch.equal(out, reference_gather(caches, "vllm", slots, torch.zeros_like(out)))


@pytest.mark.parametrize("to_dense", [True, False], ids=["store", "retrieve"])
def test_host_chunks_in_windows_go_through_the_kernel_on_device_buffers(
        interpreted: Any, monkeypatch: pytest.MonkeyPatch, to_dense: bool) -> None:
    """Chunks in host memory, on a simulated device (test_relay.Device: streams run in a
    random interleaving): each window is one kernel launch into (or out of) dense device
    buffers, and the bus copies move the windows; the result is the reference's."""
    from test_relay import host_tensors, simulate

    dev = simulate(monkeypatch)
    monkeypatch.setattr(transfer, "PIPE_WINDOW_BYTES", 8 * 2 * 2 * 2 * 8 * 2)  # 8 tokens
    caches = make_caches("vllm", 2)
    sizes = [4, 4, 4, 3]
    chunks = chunk_tensors("vllm", 2, sizes, [False] * 4)
    host_tensors(monkeypatch, chunks)
    slots = torch.randperm(NUM_SLOTS)[:15]
    before = concat([c.clone() for c in chunks], "vllm")
    expected = reference_scatter(before, clone_caches(caches), "vllm", slots.tolist())
    with dev.stream(dev.main):
        if to_dense:
            transfer.gather_chunks(caches, slots, chunks, "vllm", stream=dev.main)
        else:
            transfer.scatter_chunks(chunks, caches, slots, "vllm", stream=dev.main)
    dev.drain(random.Random(0))
    # Windows of at most 7.5 tokens (half the request; 8 is the cap): 4 | 4 | 4 + 3, a launch
    # each, grid (tokens, layers, planes).
    assert interpreted == [(4, 2, 2), (4, 2, 2), (7, 2, 2)]
    if to_dense:
        assert torch.equal(concat(chunks, "vllm"),
                           reference_gather(caches, "vllm", slots.tolist(), before))
    else:
        assert all(torch.equal(a, b) for a, b in zip(flat(caches), flat(expected), strict=True))
