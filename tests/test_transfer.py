"""transfer: layouts, checks before any write, backend dispatch (with fake devices), threads."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from musacache import (
    DeviceError,
    DTypeError,
    InvalidInputError,
    LayoutError,
    ShapeError,
    SlotRangeError,
    _native,
    transfer,
)
from musacache._spec import KVSpec
from musacache.transfer import relay as _relay

L, NB, BS, H, D = 3, 4, 4, 2, 8
NUM_SLOTS = NB * BS


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def vllm_caches(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return [rand(2, NB, BS, H, D, dtype=dtype) for _ in range(L)]


def reference_vllm_gather(caches: list[torch.Tensor], slots: list[int],
                          out: torch.Tensor) -> torch.Tensor:
    expected = out.clone()
    for layer, cache in enumerate(caches):
        for t, s in enumerate(slots):
            if s >= 0:
                expected[layer, :, t] = cache[:, s // BS, s % BS]
    return expected


def snapshot(*groups: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for g in groups:
        if isinstance(g, torch.Tensor):
            tensors.append(g)
        elif isinstance(g, (list, tuple)):
            tensors += snapshot(*g)
    return tensors


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    # The data here comes from randn, so it has no NaNs and equal values mean equal bits.
    return len(before) == len(after) and all(
        torch.equal(a, b) for a, b in zip(before, after, strict=True))


# -- describe -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "caches", "expected"),
    [
        ("vllm", [torch.zeros(2, 5, 16, 4, 32)] * 2, (2, 4, 32, 80, 16, False)),
        ("flashinfer", [torch.zeros(5, 2, 16, 4, 32)] * 2, (2, 4, 32, 80, 16, False)),
        ("vllm-hnd", [torch.zeros(2, 5, 4, 16, 32)] * 2, (2, 4, 32, 80, 16, False)),
        ("vllm-mla", [torch.zeros(5, 16, 64)] * 3, (3, 1, 64, 80, 16, True)),
        ("sglang", ([torch.zeros(100, 4, 32)] * 2, [torch.zeros(100, 4, 32)] * 2),
         (2, 4, 32, 100, 1, False)),
        ("sglang-mla", [torch.zeros(100, 1, 64)] * 3, (3, 1, 64, 100, 1, True)),
    ],
)
def test_describe_each_layout(layout: str, caches: Any,
                              expected: tuple[int, int, int, int, int, bool]) -> None:
    info = transfer.describe(caches, layout)
    got = (info.num_layers, info.num_kv_heads, info.head_dim, info.num_slots, info.block_size,
           info.mla)
    assert got == expected
    assert info.layout == layout and info.dtype == torch.float32
    assert info.device == torch.device("cpu")
    assert info.spec() == KVSpec(expected[0], expected[1], expected[2], torch.float32,
                                 expected[5])
    assert set(transfer.LAYOUTS) >= {"vllm", "vllm-mla", "sglang", "sglang-mla"}


BAD_LAYOUTS: list[tuple[str, Any, str, type[Exception], str]] = [
    ("unknown layout", [torch.zeros(2, 2, 2, 2, 2)], "paged", LayoutError, "unknown paged layout"),
    ("tensor not list", torch.zeros(2, 2, 2, 2, 2), "vllm", LayoutError, "list of per-layer"),
    ("no layers", [], "vllm", LayoutError, "at least one layer"),
    ("not a tensor", [torch.zeros(2, 2, 2, 2, 2), "x"], "vllm", LayoutError, "layer 1 is a str"),
    ("wrong rank", [torch.zeros(2, 2, 2, 2)], "vllm", ShapeError, "layer 0 has shape"),
    ("layers disagree", [torch.zeros(2, 2, 2, 2, 2), torch.zeros(2, 3, 2, 2, 2)], "vllm",
     ShapeError, r"layer 1 has shape \(2, 3, 2, 2, 2\), but layer 0 has \(2, 2, 2, 2, 2\)"),
    ("dtypes disagree", [torch.zeros(2, 2, 2, 2, 2), torch.zeros(2, 2, 2, 2, 2).half()], "vllm",
     DTypeError, "layer 1 has dtype float16"),
    ("devices disagree", [torch.zeros(2, 2, 2, 2, 2), torch.zeros(2, 2, 2, 2, 2, device="meta")],
     "vllm", DeviceError, "layer 1 is on meta"),
    ("unsupported dtype", [torch.zeros(2, 2, 2, 2, 2, dtype=torch.float64)], "vllm", DTypeError,
     "float64"),
    ("kv dim not 2", [torch.zeros(3, 2, 2, 2, 2)], "vllm", ShapeError, "K/V dim is 3"),
    ("flashinfer kv dim", [torch.zeros(2, 3, 2, 2, 2)], "flashinfer", ShapeError, "K/V dim is 3"),
    ("sglang-mla dim 1", [torch.zeros(8, 2, 4)], "sglang-mla", ShapeError, "dim 1 must be 1"),
    ("sglang not a pair", [torch.zeros(8, 2, 4)], "sglang", LayoutError, "pair"),
    ("sglang uneven", ([torch.zeros(8, 2, 4)] * 2, [torch.zeros(8, 2, 4)]), "sglang", LayoutError,
     "2 K buffers but 1 V"),
    ("sglang v disagrees", ([torch.zeros(8, 2, 4)], [torch.zeros(9, 2, 4)]), "sglang", ShapeError,
     r"v_buffers\[0\] has shape"),
    ("strided head dim", [torch.zeros(2, 2, 2, 2, 4)[..., ::2]], "vllm", LayoutError,
     "must be contiguous"),
    ("empty dim", [torch.zeros(2, 0, 2, 2, 2)], "vllm", ShapeError, "positive"),
]


@pytest.mark.parametrize(("caches", "layout", "error", "message"),
                         [case[1:] for case in BAD_LAYOUTS], ids=[c[0] for c in BAD_LAYOUTS])
def test_describe_names_what_is_wrong(caches: Any, layout: str, error: type[Exception],
                                      message: str) -> None:
    with pytest.raises(error, match=message):
        transfer.describe(caches, layout)


# -- bad calls change nothing ---------------------------------------------------------------


def _gather_case(**change: Any) -> dict[str, Any]:
    caches = vllm_caches()
    call: dict[str, Any] = dict(kv_caches=caches, slot_mapping=torch.tensor([0, 5, -1, 15]),
                                out=rand(L, 2, 4, H, D), layout="vllm")
    call.update(change)
    return call


def _bad_gathers() -> list[tuple[str, Callable[[], dict[str, Any]], type[Exception], str]]:
    caches = vllm_caches()
    return [
        ("slot past the end", lambda: _gather_case(slot_mapping=torch.tensor([0, 16, -1, 99])),
         SlotRangeError, r"slot_mapping\[1\] = 16 "),
        ("slot below -1", lambda: _gather_case(slot_mapping=torch.tensor([0, 1, -2, 3])),
         SlotRangeError, r"slot_mapping\[2\] = -2"),
        ("int32 slots", lambda: _gather_case(slot_mapping=torch.tensor([0, 1, 2, 3],
                                                                      dtype=torch.int32)),
         DTypeError, "int64"),
        ("float slots", lambda: _gather_case(slot_mapping=[0.0, 1.0, 2.0, 3.0]), DTypeError,
         "integers"),
        ("2-D slots", lambda: _gather_case(slot_mapping=torch.zeros(2, 2, dtype=torch.int64)),
         ShapeError, "1-D"),
        ("short slots", lambda: _gather_case(slot_mapping=torch.tensor([0, 1, 2])), ShapeError,
         "3 entries but the dense tensor has 4"),
        ("out wrong heads", lambda: _gather_case(out=rand(L, 2, 4, H + 1, D)), ShapeError,
         "shape"),
        ("out wrong layers", lambda: _gather_case(out=rand(L + 1, 2, 4, H, D)), ShapeError,
         "shape"),
        ("out wrong dtype", lambda: _gather_case(out=rand(L, 2, 4, H, D, dtype=torch.float16)),
         DTypeError, "float16"),
        ("out not a tensor", lambda: _gather_case(out=np.zeros((L, 2, 4, H, D))), ShapeError,
         "torch.Tensor"),
        ("out on another device", lambda: _gather_case(
            out=torch.empty(L, 2, 4, H, D, dtype=torch.bfloat16, device="meta")), DeviceError,
         "meta"),
        ("out aliases a cache", lambda: _gather_case(
            kv_caches=caches, out=caches[1].view(-1)[: L * 2 * 4 * H * D].view(L, 2, 4, H, D)),
         InvalidInputError, "overlaps the memory of paged cache tensor 1"),
        ("out overlaps a cache", lambda: _gather_case(
            kv_caches=caches,
            out=torch.as_strided(caches[2], (L, 2, 4, H, D),
                                 (2 * 4 * H * D, 4 * H * D, H * D, D, 1))), InvalidInputError,
         "overlaps the memory of paged cache tensor 2"),
        ("bad layout", lambda: _gather_case(layout="vllm-v2"), LayoutError, "unknown"),
        ("bad threads", lambda: _gather_case(threads=0), InvalidInputError, "threads"),
        ("bool threads", lambda: _gather_case(threads=True), InvalidInputError, "threads"),
        ("layers disagree", lambda: _gather_case(
            kv_caches=[*vllm_caches()[:2], rand(2, NB + 1, BS, H, D)]), ShapeError, "layer 2"),
    ]


BAD_GATHERS = _bad_gathers()


@pytest.mark.parametrize("index", range(len(BAD_GATHERS)), ids=[c[0] for c in BAD_GATHERS])
def test_bad_gather_raises_typed_error_and_writes_nothing(index: int) -> None:
    _, build, error, message = BAD_GATHERS[index]
    call = build()
    before = [t.clone() for t in snapshot(call["kv_caches"], call["out"])
              if t.device.type == "cpu"]
    with pytest.raises(error, match=message):
        transfer.gather(call["kv_caches"], call["slot_mapping"], call["out"], call["layout"],
                        threads=call.get("threads"))
    after = [t for t in snapshot(call["kv_caches"], call["out"]) if t.device.type == "cpu"]
    assert unchanged(before, after)


@pytest.mark.parametrize("index", range(len(BAD_GATHERS)), ids=[c[0] for c in BAD_GATHERS])
def test_bad_scatter_raises_typed_error_and_writes_nothing(index: int) -> None:
    name, build, error, message = BAD_GATHERS[index]
    call = build()
    src = call["out"]
    before = [t.clone() for t in snapshot(call["kv_caches"], src) if t.device.type == "cpu"]
    if name == "out not a tensor" or "alias" in name or "overlap" in name:
        message = message.replace("out", "src") if "out" in message else message
    with pytest.raises(error, match=message):
        transfer.scatter(src, call["kv_caches"], call["slot_mapping"], call["layout"],
                         threads=call.get("threads"))
    after = [t for t in snapshot(call["kv_caches"], src) if t.device.type == "cpu"]
    assert unchanged(before, after)


def test_gather_into_out_with_overlapping_memory_is_refused() -> None:
    caches = vllm_caches()
    out = rand(L, 2, 1, H, D).expand(L, 2, 3, H, D)
    before = snapshot(caches, out)
    before = [t.clone() for t in before]
    with pytest.raises(InvalidInputError, match="overlapping memory"):
        transfer.gather(caches, [0, 1, 2], out, "vllm")
    assert unchanged(before, snapshot(caches, out))


# -- happy paths ----------------------------------------------------------------------------


def test_gather_accepts_lists_and_ndarrays_of_slots() -> None:
    caches = vllm_caches()
    slots = [3, 4, 5, -1, 12, 0]
    for mapping in (slots, np.array(slots, dtype=np.int32), np.array(slots, dtype=np.uint64)
                    if min(slots) >= 0 else np.array(slots), torch.tensor(slots)):
        out = torch.zeros(L, 2, len(slots), H, D, dtype=torch.bfloat16)
        expected = reference_vllm_gather(caches, slots, out)
        transfer.gather(caches, mapping, out, "vllm")
        assert torch.equal(out, expected)


def test_empty_and_all_skipped_calls_change_nothing() -> None:
    caches = vllm_caches()
    before = [c.clone() for c in caches]
    out = torch.zeros(L, 2, 0, H, D, dtype=torch.bfloat16)
    transfer.gather(caches, [], out, "vllm")
    transfer.scatter(out, caches, torch.empty(0, dtype=torch.int64), "vllm")
    out = rand(L, 2, 3, H, D)
    out_before = out.clone()
    transfer.gather(caches, [-1, -1, -1], out, "vllm")
    transfer.scatter(out, caches, [-1, -1, -1], "vllm")
    assert torch.equal(out, out_before)
    assert unchanged(before, caches)


def test_large_gather_uses_threads_and_streaming_stores() -> None:
    """Big enough to cross the default thread and streaming thresholds."""
    caches = [rand(2, 64, 16, 8, 128) for _ in range(4)]  # 4 x 4 MiB
    slots = torch.randperm(64 * 16)[:700]
    slots[100:200] = torch.arange(300, 400)
    out = torch.zeros(4, 2, 700, 8, 128, dtype=torch.bfloat16)
    threshold = _native.get_streaming_threshold()
    try:
        _native.set_streaming_threshold(1 << 20)
        transfer.gather(caches, slots, out, "vllm", threads=2)
    finally:
        _native.set_streaming_threshold(None)
    assert _native.get_streaming_threshold() == threshold
    for layer, cache in enumerate(caches):
        assert torch.equal(out[layer], cache.view(2, -1, 8, 128)[:, slots])
    back = [torch.zeros_like(c) for c in caches]
    transfer.scatter(out, back, slots, "vllm", threads=2)
    for cache, got in zip(caches, back, strict=True):
        flat_got, flat_cache = got.view(2, -1, 8, 128), cache.view(2, -1, 8, 128)
        assert torch.equal(flat_got[:, slots], flat_cache[:, slots])


def test_set_num_threads_is_checked() -> None:
    before = transfer.get_num_threads()
    try:
        transfer.set_num_threads(2)
        assert transfer.get_num_threads() == 2 == _native.get_num_threads()
        for bad in (0, -3, 10_000, 1.5, False):
            with pytest.raises(InvalidInputError):
                transfer.set_num_threads(bad)  # type: ignore[arg-type]
        assert transfer.get_num_threads() == 2
    finally:
        transfer.set_num_threads(before)


# -- backend dispatch with fake devices -----------------------------------------------------


def test_backend_for_real_devices() -> None:
    assert transfer.backend_for(torch.zeros(1)) == "native"
    assert transfer.backend_for(torch.zeros(1, device="meta")) == "torch"


class FakeAiter(ModuleType):
    """A ``musa_aiter`` stand-in that implements the ABI-1 contract with torch ops and records
    its calls, so the dispatch and the buffer layouts are checked without a device."""

    def __init__(self, abi: object = 1, result: bool = True, fail: bool = False) -> None:
        super().__init__("musa_aiter")
        self.KV_TRANSFER_ABI = abi
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.result = result
        self.fail = fail

    def _record(self, name: str, args: tuple[Any, ...]) -> None:
        self.calls.append((name, args))
        if self.fail:
            raise RuntimeError("device fault")

    def lmcache_kv_paged_to_buffer(self, kvcaches: list[torch.Tensor], buffer: torch.Tensor,
                                   slot_mapping: torch.Tensor, block_size: int, num_heads: int,
                                   head_size: int) -> bool:
        self._record("kv_paged_to_buffer", (kvcaches, buffer, slot_mapping, block_size,
                                            num_heads, head_size))
        for layer, cache in enumerate(kvcaches):
            buffer[:, layer] = cache.view(2, -1, num_heads * head_size)[:, slot_mapping]
        return self.result

    def lmcache_kv_buffer_to_paged(self, buffer: torch.Tensor, kvcaches: list[torch.Tensor],
                                   slot_mapping: torch.Tensor, skip_prefix_n_tokens: int,
                                   block_size: int, num_heads: int, head_size: int) -> bool:
        self._record("kv_buffer_to_paged", (buffer, kvcaches, slot_mapping, skip_prefix_n_tokens,
                                            block_size, num_heads, head_size))
        if self.result:
            for layer, cache in enumerate(kvcaches):
                flat = cache.view(2, -1, num_heads * head_size)
                flat[:, slot_mapping[skip_prefix_n_tokens:]] = (
                    buffer[:, layer, skip_prefix_n_tokens:])
        return self.result

    def lmcache_mla_paged_to_buffer(self, kvcaches: list[torch.Tensor], buffer: torch.Tensor,
                                    slot_mapping: torch.Tensor, block_size: int,
                                    head_size: int) -> bool:
        self._record("mla_paged_to_buffer", (kvcaches, buffer, slot_mapping, block_size,
                                             head_size))
        for layer, cache in enumerate(kvcaches):
            buffer[layer] = cache.reshape(-1, head_size)[slot_mapping]
        return self.result

    def lmcache_mla_buffer_to_paged(self, buffer: torch.Tensor, kvcaches: list[torch.Tensor],
                                    slot_mapping: torch.Tensor, skip_prefix_n_tokens: int,
                                    block_size: int, head_size: int) -> bool:
        self._record("mla_buffer_to_paged", (buffer, kvcaches, slot_mapping,
                                             skip_prefix_n_tokens, block_size, head_size))
        if self.result:
            for layer, cache in enumerate(kvcaches):
                cache.view(-1, head_size)[slot_mapping[skip_prefix_n_tokens:]] = (
                    buffer[layer, skip_prefix_n_tokens:])
        return self.result


@pytest.fixture
def fake_musa(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[ModuleType | None], None]]:
    """Make every tensor look like a MUSA tensor; install a fake musa_aiter (or none)."""
    monkeypatch.setattr(transfer, "_device_type", lambda tensor: "musa")
    monkeypatch.setattr(_relay, "host_side", lambda tensor: False)  # device tensors

    def install(module: ModuleType | None) -> None:
        monkeypatch.setitem(sys.modules, "musa_aiter", module)  # None makes the import fail
        transfer._musa_aiter.cache_clear()

    yield install
    transfer._musa_aiter.cache_clear()


def test_musa_without_aiter_uses_torch_ops(fake_musa: Callable[[ModuleType | None], None],
                                           ) -> None:
    fake_musa(None)
    assert transfer.backend_for(torch.zeros(1)) == "torch"
    caches = vllm_caches()
    slots = [1, 2, 3, -1, 9]
    out = torch.zeros(L, 2, 5, H, D, dtype=torch.bfloat16)
    transfer.gather(caches, slots, out, "vllm")
    assert torch.equal(out, reference_vllm_gather(caches, slots, torch.zeros_like(out)))


@pytest.mark.parametrize(
    "module",
    [FakeAiter(abi=2), FakeAiter(abi=None), ModuleType("musa_aiter")],
    ids=["abi 2", "no abi", "no symbols"],
)
def test_incompatible_aiter_is_not_used(fake_musa: Callable[[ModuleType | None], None],
                                        module: ModuleType) -> None:
    fake_musa(module)
    assert transfer.backend_for(torch.zeros(1)) == "torch"


def test_aiter_abi_probe_function_is_accepted(
        fake_musa: Callable[[ModuleType | None], None]) -> None:
    module = FakeAiter(abi=None)
    module.native_lmcache_kv_transfer_abi_version = lambda: 1  # type: ignore[attr-defined]
    fake_musa(module)
    assert transfer.backend_for(torch.zeros(1)) == "musa_aiter"


def test_aiter_vllm_gather_and_scatter(fake_musa: Callable[[ModuleType | None], None]) -> None:
    aiter = FakeAiter()
    fake_musa(aiter)
    caches = vllm_caches()
    assert transfer.backend_for(caches[0]) == "musa_aiter"
    slots = [5, 6, -1, 7, 0]
    valid = torch.tensor([5, 6, 7, 0])
    out = rand(L, 2, 5, H, D)
    expected = reference_vllm_gather(caches, slots, out)
    transfer.gather(caches, torch.tensor(slots), out, "vllm")
    assert torch.equal(out, expected)
    name, args = aiter.calls[-1]
    assert name == "kv_paged_to_buffer"
    kvcaches, buffer, slot_arg, block_size, heads, head_size = args
    assert all(a is b for a, b in zip(kvcaches, caches, strict=True)) and len(kvcaches) == L
    assert buffer.shape == (2, L, 4, H * D) and buffer.is_contiguous()
    assert torch.equal(slot_arg, valid) and slot_arg.dtype == torch.int64
    assert (block_size, heads, head_size) == (BS, H, D)

    src = rand(L, 2, 5, H, D)
    target = [c.clone() for c in caches]
    transfer.scatter(src, target, slots, "vllm")
    name, args = aiter.calls[-1]
    assert name == "kv_buffer_to_paged"
    assert args[0].shape == (2, L, 4, H * D) and args[3] == 0 and args[4:] == (BS, H, D)
    for layer in range(L):
        for t, s in enumerate(slots):
            if s >= 0:
                assert torch.equal(target[layer][:, s // BS, s % BS], src[layer, :, t])


@pytest.mark.parametrize("layout", ["vllm-mla", "sglang-mla"])
def test_aiter_mla_gather_and_scatter(fake_musa: Callable[[ModuleType | None], None],
                                      layout: str) -> None:
    aiter = FakeAiter()
    fake_musa(aiter)
    if layout == "vllm-mla":
        caches = [rand(NB, BS, 16) for _ in range(L)]
        block_size = BS
    else:
        caches = [rand(NUM_SLOTS, 1, 16) for _ in range(L)]
        block_size = 1
    flat = [c.reshape(-1, 16) for c in caches]
    slots = [-1, 3, 4, 15]
    out = rand(L, 4, 16)
    expected = out.clone()
    for layer in range(L):
        for t, s in enumerate(slots):
            if s >= 0:
                expected[layer, t] = flat[layer][s]
    transfer.gather(caches, slots, out, layout)
    assert torch.equal(out, expected)
    name, args = aiter.calls[-1]
    assert name == "mla_paged_to_buffer"
    assert args[1].shape == (L, 3, 16) and args[3:] == (block_size, 16)

    target = [torch.zeros_like(c) for c in caches]
    transfer.scatter(out, target, slots, layout)
    name, args = aiter.calls[-1]
    assert name == "mla_buffer_to_paged" and args[3:] == (0, block_size, 16)
    for layer in range(L):
        assert torch.equal(target[layer].reshape(-1, 16)[[3, 4, 15]], flat[layer][[3, 4, 15]])


def test_aiter_is_skipped_for_layouts_it_lacks(
        fake_musa: Callable[[ModuleType | None], None]) -> None:
    aiter = FakeAiter()
    fake_musa(aiter)
    k = [rand(NUM_SLOTS, H, D) for _ in range(L)]
    v = [rand(NUM_SLOTS, H, D) for _ in range(L)]
    out = rand(L, 2, 2, H, D)
    transfer.gather((k, v), [3, 9], out, "sglang")
    assert aiter.calls == []
    assert torch.equal(out[:, 0], torch.stack([t[[3, 9]] for t in k]))
    assert torch.equal(out[:, 1], torch.stack([t[[3, 9]] for t in v]))


@pytest.mark.parametrize("failure", ["returns False", "raises"])
def test_aiter_failure_falls_back_to_torch(fake_musa: Callable[[ModuleType | None], None],
                                           failure: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    aiter = FakeAiter(result=failure != "returns False", fail=failure == "raises")
    fake_musa(aiter)
    caches = vllm_caches()
    slots = [2, 3, 4]
    out = torch.zeros(L, 2, 3, H, D, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="musacache.transfer"):
        transfer.gather(caches, slots, out, "vllm")
    assert aiter.calls  # it was tried
    assert torch.equal(out, reference_vllm_gather(caches, slots, torch.zeros_like(out)))
    src = rand(L, 2, 3, H, D)
    transfer.scatter(src, caches, slots, "vllm")
    for layer in range(L):
        for t, s in enumerate(slots):
            assert torch.equal(caches[layer][:, s // BS, s % BS], src[layer, :, t])
    if failure == "raises":
        assert "device fault" in caplog.text


def test_aiter_is_not_given_non_contiguous_caches(
        fake_musa: Callable[[ModuleType | None], None]) -> None:
    aiter = FakeAiter()
    fake_musa(aiter)
    caches = [rand(NB, 2, BS, H, D).transpose(0, 1) for _ in range(L)]  # vllm view, strided
    out = torch.zeros(L, 2, 2, H, D, dtype=torch.bfloat16)
    transfer.gather(caches, [1, 6], out, "vllm")
    assert aiter.calls == []
    assert torch.equal(out, reference_vllm_gather(caches, [1, 6], torch.zeros_like(out)))


# -- benchmark ------------------------------------------------------------------------------


def test_bench_runs_small_and_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from musacache.bench import transfer as bench

    argv = ["--layers", "2", "--blocks", "8", "--block-size", "4", "--heads", "2",
            "--head-dim", "16", "--tokens", "12", "--threads", "2", "--repeats", "1", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["bytes_per_call"] == 2 * 2 * 12 * 2 * 16 * 2
    for name in ("native_gather", "native_scatter", "copy", "torch_index_select",
                 "torch_index_copy"):
        for n in (1, 2):
            assert report["gbps"][f"{name}_{n}t"] > 0
    assert report["gbps"]["shuffle_1t"] > 0
    assert set(report["goals_met"]) == {"gather_1t_vs_copy_1t", "gather_1t_vs_index_select_1t",
                                        "shuffle_1t_gbps"}
    assert bench.main(argv[:-1]) == 0
    assert "gather_1t_vs_copy_1t" in capsys.readouterr().out
