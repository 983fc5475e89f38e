"""Property tests: transfer.gather/scatter against a plain per-token Python reference.

The reference indexes each layout in its own engine's terms (not through the module's plane
views), so a wrong stride or plane mapping in the module shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musacache import _native, transfer

DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32]
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIMD_LEVELS = _native.SIMD_LEVELS[: _native.SIMD_LEVELS.index(_native.max_simd_level()) + 1]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included): the transfer must move bits, not values."""
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    # A fresh 1-D tensor has stride 1 whatever `t`'s strides (size-1 dims keep odd ones).
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@dataclass
class Case:
    layout: str
    dtype: torch.dtype
    num_layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    head_pad: int  # extra elements after each head in the caches (strided caches)

    @property
    def mla(self) -> bool:
        return self.layout in ("vllm-mla", "sglang-mla")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def dense_shape(self, tokens: int) -> tuple[int, ...]:
        if self.mla:
            return (self.num_layers, tokens, self.head_dim)
        return (self.num_layers, 2, tokens, self.heads, self.head_dim)


def make_caches(case: Case, gen: torch.Generator) -> Any:
    """Caches in the layout of `case`; with head_pad > 0 each is a strided view."""
    nb, bs, h, d, pad = case.num_blocks, case.block_size, case.heads, case.head_dim, case.head_pad

    def alloc(shape: tuple[int, ...]) -> torch.Tensor:
        full = random_tensor((*shape[:-1], shape[-1] + pad), case.dtype, gen)
        return full[..., : shape[-1]]

    layers = range(case.num_layers)
    if case.layout == "vllm":
        return [alloc((2, nb, bs, h, d)) for _ in layers]
    if case.layout == "flashinfer":
        return [alloc((nb, 2, bs, h, d)) for _ in layers]
    if case.layout == "vllm-hnd":
        return [alloc((2, nb, h, bs, d)) for _ in layers]
    if case.layout == "vllm-packed":
        return [alloc((nb, h, bs, 2 * d)) for _ in layers]
    if case.layout == "vllm-packed-cpu":  # CPU_ATTN views it: its block rows are contiguous
        return [random_tensor((nb, h, bs, 2 * d), case.dtype, gen) for _ in layers]
    if case.layout == "vllm-mla":
        return [alloc((nb, bs, d)) for _ in layers]
    if case.layout == "sglang":
        return ([alloc((nb * bs, h, d)) for _ in layers], [alloc((nb * bs, h, d)) for _ in layers])
    return [alloc((nb * bs, 1, d)) for _ in layers]  # sglang-mla (block_size is 1)


def all_tensors(caches: Any) -> list[torch.Tensor]:
    if isinstance(caches, tuple):
        return [*caches[0], *caches[1]]
    return list(caches)


def token_rows(case: Case, caches: Any, layer: int, slot: int) -> list[torch.Tensor]:
    """Views of one token's cache rows, K then V (one for MLA), in the engine's own indexing."""
    blk, off = divmod(slot, case.block_size)
    if case.layout == "vllm":
        t = caches[layer]
        return [t[0, blk, off], t[1, blk, off]]
    if case.layout == "flashinfer":
        t = caches[layer]
        return [t[blk, 0, off], t[blk, 1, off]]
    if case.layout == "vllm-hnd":
        t = caches[layer]
        return [t[0, blk, :, off], t[1, blk, :, off]]
    if case.layout == "vllm-packed":
        t = caches[layer]
        d = t.shape[-1] // 2
        return [t[blk, :, off, :d], t[blk, :, off, d:]]
    if case.layout == "vllm-packed-cpu":
        t = caches[layer]
        k, v = t.view(t.shape[0], t.shape[1], 2 * t.shape[2], t.shape[3] // 2).chunk(2, dim=2)
        return [k[blk, :, off], v[blk, :, off]]
    if case.layout == "vllm-mla":
        return [caches[layer][blk, off]]
    if case.layout == "sglang":
        return [caches[0][layer][slot], caches[1][layer][slot]]
    return [caches[layer][slot, 0]]


def dense_rows(case: Case, dense: torch.Tensor, layer: int, token: int) -> list[torch.Tensor]:
    if case.mla:
        return [dense[layer, token]]
    return [dense[layer, 0, token], dense[layer, 1, token]]


def reference_gather(case: Case, caches: Any, slots: list[int], out: torch.Tensor) -> None:
    for layer in range(case.num_layers):
        for t, s in enumerate(slots):
            if s < 0:
                continue
            targets = dense_rows(case, out, layer, t)
            for dst, src in zip(targets, token_rows(case, caches, layer, s), strict=True):
                dst.copy_(src)


def reference_scatter(case: Case, src: torch.Tensor, caches: Any, slots: list[int]) -> None:
    for layer in range(case.num_layers):
        for t, s in enumerate(slots):  # in token order: a repeated slot keeps the last token
            if s < 0:
                continue
            targets = token_rows(case, caches, layer, s)
            for dst, row in zip(targets, dense_rows(case, src, layer, t), strict=True):
                dst.copy_(row)


def all_same_bits(caches: Any, others: Any) -> bool:
    pairs = zip(all_tensors(caches), all_tensors(others), strict=True)
    return all(same_bits(a, b) for a, b in pairs)


def clone_caches(caches: Any) -> Any:
    if isinstance(caches, tuple):
        return ([t.clone() for t in caches[0]], [t.clone() for t in caches[1]])
    return [t.clone() for t in caches]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layout = draw(st.sampled_from(transfer.LAYOUTS))
    mla = layout in ("vllm-mla", "sglang-mla")
    flat = layout.startswith("sglang")
    return Case(
        layout=layout,
        dtype=draw(st.sampled_from(DTYPES)),
        num_layers=draw(st.integers(1, 3)),
        num_blocks=draw(st.integers(1, 12 if flat else 6)),
        block_size=1 if flat else draw(st.sampled_from([1, 2, 3, 4, 16])),
        heads=1 if mla else draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16, 64])),
        head_pad=draw(st.sampled_from([0, 0, 1])),
    )


@st.composite
def slot_mappings(draw: st.DrawFn, num_slots: int) -> list[int]:
    """Runs of consecutive slots, isolated slots, repeats and -1 gaps."""
    slots: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["run", "run", "gap", "single"]))
        if kind == "gap":
            slots += [-1] * draw(st.integers(1, 3))
        elif kind == "single":
            slots.append(draw(st.integers(0, num_slots - 1)))
        else:
            start = draw(st.integers(0, num_slots - 1))
            length = draw(st.integers(1, num_slots - start))
            slots += list(range(start, start + length))
    return slots


def make_dense(case: Case, tokens: int, style: str, gen: torch.Generator) -> torch.Tensor:
    """A dense tensor of the case's shape: contiguous, head-major (a permuted view, as from a
    HuggingFace cache), or with a non-unit last-dim stride (staged through a copy)."""
    shape = case.dense_shape(tokens)
    if style == "contiguous":
        return random_tensor(shape, case.dtype, gen)
    if style == "permuted" and not case.mla:
        base = random_tensor((shape[0], shape[1], shape[3], shape[2], shape[4]), case.dtype, gen)
        return base.transpose(2, 3)
    wide = random_tensor((*shape[:-1], shape[-1] * 2), case.dtype, gen)
    return wide[..., ::2]


@contextmanager
def tuning(simd: str, stream_all: bool, thread_all: bool) -> Iterator[None]:
    """Reach the SIMD, streaming-store and threaded kernels with small tensors."""
    before = _native.get_simd_level()
    try:
        _native.set_simd_level(simd)
        _native.set_streaming_threshold(0 if stream_all else None)
        _native.set_thread_min_bytes(0 if thread_all else None)
        yield
    finally:
        _native.set_simd_level(before)
        _native.set_streaming_threshold(None)
        _native.set_thread_min_bytes(None)


knobs = st.tuples(st.sampled_from(SIMD_LEVELS), st.booleans(), st.booleans(),
                  st.sampled_from([1, 2, 3]))
dense_styles = st.sampled_from(["contiguous", "permuted", "strided"])


@SETTINGS
@given(case=cases(), data=st.data(), knob=knobs, style=dense_styles, seed=st.integers(0, 2**31))
def test_gather_matches_reference(case: Case, data: st.DataObject,
                                  knob: tuple[str, bool, bool, int], style: str,
                                  seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = make_caches(case, gen)
    slots = data.draw(slot_mappings(case.num_slots))
    out = make_dense(case, len(slots), style, gen)
    expected = out.clone()
    reference_gather(case, caches, slots, expected)
    before = clone_caches(caches)
    simd, stream_all, thread_all, threads = knob
    with tuning(simd, stream_all, thread_all):
        transfer.gather(caches, torch.tensor(slots, dtype=torch.int64), out, case.layout,
                        threads=threads)
    assert same_bits(out, expected)
    assert all_same_bits(caches, before)


@SETTINGS
@given(case=cases(), data=st.data(), knob=knobs, style=dense_styles, seed=st.integers(0, 2**31))
def test_scatter_matches_reference(case: Case, data: st.DataObject,
                                   knob: tuple[str, bool, bool, int], style: str,
                                   seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = make_caches(case, gen)
    slots = data.draw(slot_mappings(case.num_slots))
    src = make_dense(case, len(slots), style, gen)
    src_before = src.clone()
    expected = clone_caches(caches)
    reference_scatter(case, src, expected, slots)
    simd, stream_all, thread_all, threads = knob
    with tuning(simd, stream_all, thread_all):
        transfer.scatter(src, caches, slots, case.layout, threads=threads)
    assert all_same_bits(caches, expected)
    assert same_bits(src, src_before)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), data=st.data(), style=dense_styles, seed=st.integers(0, 2**31))
def test_scatter_then_gather_round_trips(case: Case, data: st.DataObject, style: str,
                                         seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    caches = make_caches(case, gen)
    # Distinct slots: with repeats only the last token survives the scatter.
    slots = sorted(set(data.draw(slot_mappings(case.num_slots))) - {-1})
    slots = data.draw(st.permutations(slots))
    src = make_dense(case, len(slots), style, gen)
    transfer.scatter(src, caches, slots, case.layout)
    back = torch.zeros(case.dense_shape(len(slots)), dtype=case.dtype)
    transfer.gather(caches, slots, back, case.layout)
    assert same_bits(back, src)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases(), data=st.data(), style=dense_styles, seed=st.integers(0, 2**31),
       to_dense=st.booleans())
def test_torch_backend_matches_reference(monkeypatch: pytest.MonkeyPatch, case: Case,
                                         data: st.DataObject, style: str, seed: int,
                                         to_dense: bool) -> None:
    """The device path (index_select / index_copy_), run on CPU tensors."""
    monkeypatch.setattr(transfer, "backend_for", lambda tensor: "torch")
    gen = torch.Generator().manual_seed(seed)
    caches = make_caches(case, gen)
    slots = data.draw(slot_mappings(case.num_slots))
    if not to_dense:
        # index_copy_ leaves the winner of a repeated slot unspecified.
        seen: set[int] = set()
        slots = [s if s < 0 or (s not in seen and not seen.add(s)) else -1 for s in slots]
    dense = make_dense(case, len(slots), style, gen)
    if to_dense:
        expected = dense.clone()
        reference_gather(case, caches, slots, expected)
        transfer.gather(caches, slots, dense, case.layout)
        assert same_bits(dense, expected)
    else:
        expected_caches = clone_caches(caches)
        reference_scatter(case, dense, expected_caches, slots)
        transfer.scatter(dense, caches, slots, case.layout)
        assert all_same_bits(caches, expected_caches)
