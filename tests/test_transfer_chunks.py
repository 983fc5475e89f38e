"""transfer.gather_chunks / scatter_chunks: a whole request into (and out of) its chunks.

Checked against a plain-torch reference on every layout, on the CPU (the native path) and
through the device paths run on CPU tensors (torch-ops staging, and the fused kernel's launch
structure with a recording fake). The structure tests count the torch ops these functions
dispatch: launches bounded by layers, not chunks, and no device-to-host read (a sync).
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from musacache import (
    DeviceError,
    InvalidInputError,
    ShapeError,
    SlotRangeError,
    _native,
    devices,
    transfer,
)
from musacache.transfer import relay as _relay
from musacache.transfer import triton as _kernels

NB, BS, H, D = 4, 4, 2, 8
NUM_SLOTS = NB * BS


def make_caches(layout: str, layers: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    if layout == "vllm":
        return [r(2, NB, BS, H, D) for _ in range(layers)]
    if layout == "flashinfer":
        return [r(NB, 2, BS, H, D) for _ in range(layers)]
    if layout == "vllm-hnd":
        return [r(2, NB, H, BS, D) for _ in range(layers)]
    if layout in ("vllm-packed", "vllm-packed-cpu"):
        return [r(NB, H, BS, 2 * D) for _ in range(layers)]
    if layout == "vllm-mla":
        return [r(NB, BS, D) for _ in range(layers)]
    if layout == "sglang":
        return ([r(NUM_SLOTS, H, D) for _ in range(layers)],
                [r(NUM_SLOTS, H, D) for _ in range(layers)])
    return [r(NUM_SLOTS, 1, D) for _ in range(layers)]  # sglang-mla


def slot_rows(caches: Any, layout: str, layer: int) -> list[torch.Tensor]:
    """The reference's view of one layer: per plane, a view indexed by :func:`at`."""
    if layout == "vllm":
        return [caches[layer][k] for k in range(2)]  # [NB, BS, H, D]
    if layout == "flashinfer":
        return [caches[layer][:, k] for k in range(2)]
    if layout == "vllm-hnd":
        return [caches[layer][k].transpose(1, 2) for k in range(2)]
    if layout == "vllm-packed":  # K and V halves of the last dim
        t = caches[layer]
        return [t[..., :D].transpose(1, 2), t[..., D:].transpose(1, 2)]
    if layout == "vllm-packed-cpu":  # as vLLM's CPU_ATTN reads it: view, split dim 2
        k, v = caches[layer].view(NB, H, 2 * BS, D).chunk(2, dim=2)
        return [k.transpose(1, 2), v.transpose(1, 2)]
    if layout == "vllm-mla":
        return [caches[layer]]  # [NB, BS, D]
    if layout == "sglang":
        return [caches[0][layer], caches[1][layer]]  # [num_slots, H, D]
    return [caches[layer][:, 0]]


def at(layout: str, slot: int) -> tuple[int, ...]:
    return (slot,) if layout.startswith("sglang") else (slot // BS, slot % BS)


def read_row(rows: torch.Tensor, layout: str, slot: int) -> torch.Tensor:
    return rows[at(layout, slot)]


def reference_gather(caches: Any, layout: str, slots: list[int], dense: torch.Tensor,
                     ) -> torch.Tensor:
    mla = layout in ("vllm-mla", "sglang-mla")
    expected = dense.clone()
    for layer in range(dense.shape[0]):
        for k, rows in enumerate(slot_rows(caches, layout, layer)):
            for t, s in enumerate(slots):
                if s >= 0:
                    if mla:
                        expected[layer, t] = read_row(rows, layout, s)
                    else:
                        expected[layer, k, t] = read_row(rows, layout, s)
    return expected


def reference_scatter(src: torch.Tensor, caches: Any, layout: str, slots: list[int]) -> Any:
    mla = layout in ("vllm-mla", "sglang-mla")
    target = clone_caches(caches)
    for layer in range(src.shape[0]):
        for k, rows in enumerate(slot_rows(target, layout, layer)):
            for t, s in enumerate(slots):  # in token order: a repeated slot keeps the last
                if s >= 0:
                    row = src[layer, t] if mla else src[layer, k, t]
                    rows[at(layout, s)] = row
    return target


def clone_caches(caches: Any) -> Any:
    if isinstance(caches, tuple):
        return tuple(clone_caches(c) for c in caches)
    return [c.clone() for c in caches]


def flat(caches: Any) -> list[torch.Tensor]:
    return [*caches[0], *caches[1]] if isinstance(caches, tuple) else list(caches)


def spec_shape(layout: str, layers: int, tokens: int) -> tuple[int, ...]:
    if layout in ("vllm-mla", "sglang-mla"):
        return (layers, tokens, D)
    return (layers, 2, tokens, H, D)


def chunk_tensors(layout: str, layers: int, sizes: list[int], permuted: list[bool],
                  ) -> list[torch.Tensor]:
    """Random chunk tensors; some as permuted views (token-major storage, as HF keeps it)."""
    out = []
    mla = layout in ("vllm-mla", "sglang-mla")
    for n, p in zip(sizes, permuted, strict=True):
        if p and not mla:
            out.append(torch.randn(layers, n, 2, H, D).to(torch.bfloat16).permute(0, 2, 1, 3, 4))
        elif p:
            out.append(torch.randn(n, layers, D).to(torch.bfloat16).permute(1, 0, 2))
        else:
            out.append(torch.randn(*spec_shape(layout, layers, n)).to(torch.bfloat16))
    return out


def token_dim(layout: str) -> int:
    return 1 if layout in ("vllm-mla", "sglang-mla") else 2


requests = st.fixed_dictionaries({
    "layout": st.sampled_from(transfer.LAYOUTS),
    "layers": st.integers(1, 3),
    "sizes": st.lists(st.integers(0, 6), min_size=1, max_size=5),
    "seed": st.integers(0, 2**31 - 1),
})


def draw_request(req: dict[str, Any], *, distinct: bool) -> tuple[Any, list[int], list[bool]]:
    rng = np.random.default_rng(req["seed"])
    total = sum(req["sizes"])
    if distinct:
        slots = rng.permutation(NUM_SLOTS)[:total].tolist() if total <= NUM_SLOTS else None
        if slots is None:
            slots = (list(range(NUM_SLOTS)) + [-1] * total)[:total]
    else:
        slots = rng.integers(0, NUM_SLOTS, total).tolist()
    for t in range(total):
        if rng.random() < 0.2:
            slots[t] = -1
    permuted = (rng.random(len(req["sizes"])) < 0.4).tolist()
    torch.manual_seed(req["seed"])
    return make_caches(req["layout"], req["layers"]), slots, permuted


def split(dense: torch.Tensor, layout: str, sizes: list[int]) -> list[torch.Tensor]:
    return list(dense.split(sizes, dim=token_dim(layout)))


def concat(chunks: list[torch.Tensor], layout: str) -> torch.Tensor:
    return torch.cat(chunks, dim=token_dim(layout))


# -- the CPU (native) path ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(req=requests)
def test_gather_chunks_matches_reference(req: dict[str, Any]) -> None:
    layout, layers, sizes = req["layout"], req["layers"], req["sizes"]
    caches, slots, permuted = draw_request(req, distinct=False)
    dsts = chunk_tensors(layout, layers, sizes, permuted)
    before = concat([d.clone() for d in dsts], layout)
    transfer.gather_chunks(caches, torch.tensor(slots, dtype=torch.int64), dsts, layout)
    expected = reference_gather(caches, layout, slots, before)
    assert torch.equal(concat(dsts, layout), expected)


@settings(max_examples=60, deadline=None)
@given(req=requests)
def test_scatter_chunks_matches_reference(req: dict[str, Any]) -> None:
    layout, layers, sizes = req["layout"], req["layers"], req["sizes"]
    caches, slots, permuted = draw_request(req, distinct=False)
    srcs = chunk_tensors(layout, layers, sizes, permuted)
    expected = reference_scatter(concat(srcs, layout), caches, layout, slots)
    transfer.scatter_chunks(srcs, caches, np.array(slots, dtype=np.int64), layout)
    assert all(torch.equal(a, b) for a, b in zip(flat(caches), flat(expected), strict=True))


def test_runs_do_not_cross_chunks() -> None:
    # Consecutive slots across a chunk boundary: the C code must not merge them into one
    # copy that runs past the first chunk's buffer into memory that is not the next chunk.
    caches = make_caches("sglang-mla", 1)
    first = torch.zeros(1, 3, D, dtype=torch.bfloat16)
    guard = torch.zeros(1, 64, D, dtype=torch.bfloat16)  # its tail would be written over
    dsts = [first, guard[:, :2]]
    transfer.gather_chunks(caches, torch.arange(5), dsts, "sglang-mla")
    assert torch.equal(first[0], caches[0][0:3, 0]) and torch.equal(guard[0, :2],
                                                                     caches[0][3:5, 0])
    assert not guard[0, 2:].any()


# -- checks before any byte moves -----------------------------------------------------------


def test_token_counts_must_sum_to_the_slots() -> None:
    caches = make_caches("vllm", 2)
    dsts = chunk_tensors("vllm", 2, [2, 2], [False, False])
    with pytest.raises(ShapeError, match="slot_mapping has 5 entries but the 2 chunks"):
        transfer.gather_chunks(caches, torch.arange(5), dsts, "vllm")


def test_bad_slot_writes_nothing() -> None:
    caches = make_caches("vllm", 2)
    dsts = chunk_tensors("vllm", 2, [2, 2], [False, False])
    before = [d.clone() for d in dsts]
    with pytest.raises(SlotRangeError, match=r"slot_mapping\[3\] = 99"):
        transfer.gather_chunks(caches, torch.tensor([0, 1, 2, 99]), dsts, "vllm")
    assert all(torch.equal(a, b) for a, b in zip(before, dsts, strict=True))
    saved = clone_caches(caches)
    with pytest.raises(SlotRangeError):
        transfer.scatter_chunks(dsts, caches, torch.tensor([0, 1, 2, 99]), "vllm")
    assert all(torch.equal(a, b) for a, b in zip(flat(caches), flat(saved), strict=True))


def test_overlapping_chunks_are_refused() -> None:
    caches = make_caches("vllm", 1)
    whole = torch.zeros(1, 2, 6, H, D, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=r"dsts\[0\] and dsts\[1\] overlap"):
        transfer.gather_chunks(caches, torch.arange(8), [whole[:, :, :4], whole[:, :, 2:6]],
                               "vllm")


def test_chunks_must_be_a_list_on_a_reachable_device() -> None:
    caches = make_caches("vllm", 1)
    with pytest.raises(InvalidInputError, match="list of chunk tensors"):
        transfer.gather_chunks(caches, torch.arange(2),
                               torch.zeros(1, 2, 2, H, D, dtype=torch.bfloat16), "vllm")
    meta = torch.zeros(1, 2, 2, H, D, dtype=torch.bfloat16, device="meta")
    with pytest.raises(DeviceError, match=r"dsts\[0\] is on the meta device"):
        transfer.gather_chunks(caches, torch.arange(2), [meta], "vllm")


def test_native_chunk_table_is_checked() -> None:
    src = np.zeros(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    addr = [src.ctypes.data]
    with pytest.raises(InvalidInputError, match="chunk_starts must run from 0 to 3"):
        _native.gather_rows(addr, [dst.ctypes.data] * 2, np.arange(3), row_bytes=4,
                            num_slots=16, paged_extents=64, dense_extents=64,
                            chunk_starts=[0, 1, 2])
    with pytest.raises(InvalidInputError, match="dense_planes has 1 entries, expected 2"):
        _native.gather_rows(addr, [dst.ctypes.data], np.arange(3), row_bytes=4,
                            num_slots=16, paged_extents=64, dense_extents=64,
                            chunk_starts=[0, 1, 3])
    with pytest.raises(InvalidInputError, match=r"dense_extents\[1\] is 4 bytes but 2 rows"):
        _native.gather_rows(addr, [dst.ctypes.data] * 2, np.arange(3), row_bytes=4,
                            num_slots=16, paged_extents=64, dense_extents=[64, 4],
                            chunk_starts=[0, 1, 3])


# -- the device paths, run on CPU tensors ----------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched: on a device each is at least one launch, and
    ``_local_scalar_dense`` (``.item()``, ``bool()``) is a device-to-host read, a sync."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None,
                           ) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class FakeStream:
    def __init__(self) -> None:
        self.synced = 0

    def synchronize(self) -> None:
        self.synced += 1


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """CPU tensors taken for cuda ones, with a fake torch.cuda that records stream use."""
    entered: list[Any] = []
    syncs: list[str] = []

    class Ctx:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            entered.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            return None

    mod = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, stream=Ctx,
        synchronize=lambda *a: syncs.append("device"), current_stream=lambda d=None: None)
    mod.entered, mod.syncs = entered, syncs
    monkeypatch.setitem(devices._module_overrides, "cuda", mod)
    monkeypatch.setattr(transfer, "_device_type", lambda tensor: "cuda")
    # The chunks stand for device tensors (host chunks take the piped path: test_relay.py).
    monkeypatch.setattr(_relay, "host_side", lambda tensor: False)
    devices._reset_probes()
    yield mod
    devices._reset_probes()


@pytest.mark.parametrize("layout", ["vllm", "flashinfer", "vllm-hnd", "sglang", "vllm-mla"])
@pytest.mark.parametrize("to_dense", [True, False], ids=["gather", "scatter"])
def test_staged_path_is_correct_and_bounded_by_layers(
        fake_cuda: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, layout: str,
        to_dense: bool) -> None:
    monkeypatch.setattr(_kernels, "available", lambda: False)
    layers, sizes = 4, [4, 4, 4, 3, 2, 1]  # six chunks, 18 tokens, three skipped
    caches = make_caches(layout, layers)
    slots = torch.randperm(NUM_SLOTS)[:15].tolist()  # distinct: devices pick any winner
    for t in (2, 9, 17):
        slots.insert(t, -1)
    dense = chunk_tensors(layout, layers, sizes, [False, True, False, False, True, False])
    before = concat([d.clone() for d in dense], layout)
    expected_caches = reference_scatter(before, caches, layout, slots)
    stream = FakeStream()
    counter = OpCounter()
    with counter:
        if to_dense:
            transfer.gather_chunks(caches, torch.tensor(slots), dense, layout, stream=stream)
        else:
            transfer.scatter_chunks(dense, caches, torch.tensor(slots), layout, stream=stream)
    if to_dense:
        assert torch.equal(concat(dense, layout), reference_gather(caches, layout, slots,
                                                                   before))
    else:
        assert all(torch.equal(a, b)
                   for a, b in zip(flat(caches), flat(expected_caches), strict=True))
    planes = 1 if layout == "vllm-mla" else 2
    per_layer = 1 if layout == "vllm" else planes
    moves = counter.ops["index_select"] + counter.ops["index_copy_"] + counter.ops["index"]
    # Skipped tokens cost an index_select plus an index_copy_ per move.
    assert 0 < moves <= 2 * per_layer * layers
    assert counter.ops["copy_"] <= 2 * len(sizes) + 2  # chunk pieces, slot tables
    assert counter.ops["_local_scalar_dense"] == 0  # no device-to-host read: no sync
    assert fake_cuda.entered == [stream] and fake_cuda.syncs == [] and stream.synced == 0


def test_staging_is_bounded(fake_cuda: types.SimpleNamespace,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "available", lambda: False)
    token_bytes = 3 * 2 * H * D * 2
    monkeypatch.setattr(transfer, "STAGING_BYTES", 5 * token_bytes)
    sizes = [3, 3, 3, 3]
    caches = make_caches("vllm", 3)
    slots = torch.randperm(NUM_SLOTS)[:12]
    dsts = chunk_tensors("vllm", 3, sizes, [False] * 4)
    largest: list[int] = []
    real_empty = torch.empty

    def watching_empty(*shape: Any, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*shape, **kwargs)
        largest.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", watching_empty)
    transfer.gather_chunks(caches, slots, dsts, "vllm")
    assert max(largest) == 5 * token_bytes  # three windows of at most five tokens
    expected = reference_gather(caches, "vllm", slots.tolist(),
                                torch.zeros(3, 2, 12, H, D, dtype=torch.bfloat16))
    assert torch.equal(concat(dsts, "vllm"), expected)


def test_fused_path_is_one_launch_with_address_tables(
        fake_cuda: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[dict[str, Any]] = []
    monkeypatch.setattr(_kernels, "available", lambda: True)
    monkeypatch.setattr(_kernels, "launch", lambda **kw: launches.append(kw))
    # The chunks stand for pinned host slots: device-visible.
    monkeypatch.setattr(transfer, "_device_visible", lambda dense, device: True)
    layers, sizes = 5, [4, 4, 2]
    caches = make_caches("vllm", layers)
    dsts = chunk_tensors("vllm", layers, sizes, [False, True, False])
    slots = torch.tensor([3, 4, 5, 6, 7, -1, 9, 10, 11, 12])
    stream = FakeStream()
    counter = OpCounter()
    with counter:
        transfer.gather_chunks(caches, slots, dsts, "vllm", stream=stream)
    assert len(launches) == 1
    kw = launches[0]
    assert kw["grid"] == (10, layers, 2) and kw["to_dense"] is True
    assert (kw["row_len"], kw["head_programs"], kw["elem_bytes"]) == (H * D, 1, 2)
    assert torch.equal(kw["slots"], slots)
    assert kw["token_chunk"].tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert kw["token_row"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    plane_bytes = NB * BS * H * D * 2
    assert kw["page_table"].tolist() == [c.data_ptr() + k * plane_bytes
                                         for c in caches for k in range(2)]
    table = kw["chunk_table"].view(len(sizes), _kernels.CHUNK_FIELDS).tolist()
    assert [row[0] for row in table] == [d.data_ptr() for d in dsts]
    assert table[1][1:] == [dsts[1].stride(i) for i in range(4)]
    # One table copy at most, nothing per chunk or layer, and no device-to-host read.
    assert sum(counter.ops.values()) <= 8 and counter.ops["_local_scalar_dense"] == 0
    assert fake_cuda.entered == [stream] and stream.synced == 0


def test_fused_path_is_skipped_for_unpinned_host_chunks(
        fake_cuda: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[dict[str, Any]] = []
    monkeypatch.setattr(_kernels, "available", lambda: True)
    monkeypatch.setattr(_kernels, "launch", lambda **kw: launches.append(kw))
    assert not transfer._device_visible(torch.zeros(1), torch.device("cuda", 0))
    caches = make_caches("vllm", 2)
    dsts = chunk_tensors("vllm", 2, [2, 2], [False, False])
    # One chunk in pageable host memory, which the device cannot address: no kernel.
    monkeypatch.setattr(transfer, "_device_visible", lambda dense, device: dense is dsts[0])
    transfer.gather_chunks(caches, torch.arange(4), dsts, "vllm")
    assert launches == []
    expected = reference_gather(caches, "vllm", [0, 1, 2, 3],
                                torch.zeros(2, 2, 4, H, D, dtype=torch.bfloat16))
    assert torch.equal(concat(dsts, "vllm"), expected)


@pytest.mark.parametrize("skipped", [False, True], ids=["all slots", "a -1 slot"])
def test_transfer_gather_into_a_device_tensor_needs_no_staging(
        fake_cuda: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        skipped: bool) -> None:
    monkeypatch.setattr(_kernels, "available", lambda: False)
    layers = 4
    caches = make_caches("vllm", layers)
    slots = torch.randperm(NUM_SLOTS)[:10]
    if skipped:
        slots[3] = -1
    out = torch.randn(layers, 2, 10, H, D).to(torch.bfloat16)
    expected = reference_gather(caches, "vllm", slots.tolist(), out)
    counter = OpCounter()
    with counter:
        transfer.gather(caches, slots, out, "vllm")
    assert torch.equal(out, expected)
    # Straight into out, one launch per layer (two when a skipped token needs index_copy_).
    assert counter.ops["index_select"] == layers
    assert counter.ops["index_copy_"] == (layers if skipped else 0)
    # No staging buffer and no copy out of one: the one allocation is the slot index.
    assert counter.ops["empty"] <= 1 and counter.ops["copy_"] == 0, counter.ops


@pytest.mark.parametrize("to_dense", [True, False], ids=["gather", "scatter"])
def test_musa_aiter_moves_each_staging_window(monkeypatch: pytest.MonkeyPatch,
                                              to_dense: bool) -> None:
    import sys

    from test_transfer import FakeAiter

    aiter = FakeAiter()
    monkeypatch.setattr(transfer, "_device_type", lambda tensor: "musa")
    monkeypatch.setattr(_relay, "host_side", lambda tensor: False)  # device chunks
    monkeypatch.setitem(sys.modules, "musa_aiter", aiter)
    transfer._musa_aiter.cache_clear()
    token_bytes = 2 * 2 * H * D * 2
    monkeypatch.setattr(transfer, "STAGING_BYTES", 6 * token_bytes)
    try:
        caches = make_caches("vllm", 2)
        sizes = [4, 4, 2]
        slots = torch.randperm(NUM_SLOTS)[:10].tolist()
        slots[5] = -1
        dense = chunk_tensors("vllm", 2, sizes, [False, True, False])
        before = concat([d.clone() for d in dense], "vllm")
        if to_dense:
            transfer.gather_chunks(caches, torch.tensor(slots), dense, "vllm")
            assert torch.equal(concat(dense, "vllm"),
                               reference_gather(caches, "vllm", slots, before))
        else:
            expected = reference_scatter(before, caches, "vllm", slots)
            transfer.scatter_chunks(dense, caches, torch.tensor(slots), "vllm")
            assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
        # Ten tokens in windows of six: two aiter calls, each for every layer at once.
        assert [len(args[0 if to_dense else 1]) for _, args in aiter.calls] == [2, 2]
    finally:
        transfer._musa_aiter.cache_clear()
