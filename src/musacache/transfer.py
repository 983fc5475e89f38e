"""Paged KV <-> dense KV: gather and scatter by ``slot_mapping``.

``gather`` copies the rows of a paged KV cache (the layout of an inference engine) into a
dense ``(L, 2, T, H, D)`` tensor (``(L, T, D)`` for MLA layouts); ``scatter`` writes a dense
tensor back into the paged cache. ``slot_mapping[t]`` is the slot of token ``t``; a slot of
-1 skips the token (nothing is read or written for it).

Every check (layout, shapes, dtypes, devices, slot dtype, length and range, aliasing) runs
before the first byte is written, so a call that raises leaves every tensor unchanged.

Backends, chosen by the caches' device (:func:`backend_for`):

- ``"native"`` (CPU): one C call covers all layers, K and V; runs of consecutive slots are
  merged into one copy, large copies use streaming stores, and up to
  :func:`get_num_threads` threads share the work, with the GIL released. The C code copies
  rows of contiguous ``head_dim`` values (``H * D`` when the heads are packed too, so a
  head-major view such as a permuted HuggingFace cache still goes direct, one row per head);
  a dense tensor whose last dim is strided is staged through a contiguous copy. CPU caches
  must have a unit-stride last dim (LayoutError otherwise).
- ``"torch"`` (CUDA, MUSA without MUSA-Aiter, anything else): ``index_select`` /
  ``index_copy_`` per layer on a ``[num_slots, H, D]`` view, on the device.
- ``"musa_aiter"`` (MUSA with ``musa_aiter`` ABI 1): its paged-KV kernels for the ``vllm``,
  ``vllm-mla`` and ``sglang-mla`` layouts; other layouts, and calls it rejects, use torch ops.

The layouts (``LAYOUTS``), per layer:

=============== =================================================================
``vllm``        ``[2, num_blocks, block_size, H, D]``; slot = block * block_size + offset
``vllm-mla``    ``[num_blocks, block_size, D]``
``sglang``      a pair ``(k_buffers, v_buffers)``, each a list of ``[num_slots, H, D]``
``sglang-mla``  ``[num_slots, 1, D]``
``flashinfer``  ``[num_blocks, 2, block_size, H, D]``
``vllm-hnd``    ``[2, num_blocks, H, block_size, D]``
=============== =================================================================
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _native
from ._errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidInputError,
    LayoutError,
    ShapeError,
    SlotRangeError,
)
from ._spec import KVSpec, dtype_from_name, dtype_name

__all__ = [
    "LAYOUTS",
    "PagedKV",
    "backend_for",
    "describe",
    "gather",
    "get_num_threads",
    "scatter",
    "set_num_threads",
]

logger = logging.getLogger(__name__)

LAYOUTS: tuple[str, ...] = ("vllm", "vllm-mla", "sglang", "sglang-mla", "flashinfer", "vllm-hnd")
_MLA_LAYOUTS = frozenset({"vllm-mla", "sglang-mla"})
_RANK = {"vllm": 5, "vllm-mla": 3, "sglang": 3, "sglang-mla": 3, "flashinfer": 5, "vllm-hnd": 5}
_PRETTY = {
    "vllm": "[2, num_blocks, block_size, H, D]",
    "vllm-mla": "[num_blocks, block_size, D]",
    "sglang": "[num_slots, H, D]",
    "sglang-mla": "[num_slots, 1, D]",
    "flashinfer": "[num_blocks, 2, block_size, H, D]",
    "vllm-hnd": "[2, num_blocks, H, block_size, D]",
}
# Integer dtypes of each element size: the torch path moves bits, so fp8 (which lacks some
# indexing kernels) and NaN payloads go through unchanged.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_AITER_LAYOUTS = frozenset({"vllm", "vllm-mla", "sglang-mla"})
_AITER_ABI = 1
_AITER_SYMBOLS = (
    "lmcache_kv_paged_to_buffer",
    "lmcache_kv_buffer_to_paged",
    "lmcache_mla_paged_to_buffer",
    "lmcache_mla_buffer_to_paged",
)


# -- layouts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedKV:
    """What a paged KV cache holds, as found by :func:`describe`."""

    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    num_slots: int
    block_size: int
    mla: bool

    def spec(self) -> KVSpec:
        """The :class:`KVSpec` of the dense tensors this cache gathers to and scatters from."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.mla)


def _layer_list(kv_caches: object, layout: str) -> list[torch.Tensor]:
    """The layout's tensors, in plane order (for sglang: all K buffers, then all V buffers)."""
    if layout == "sglang":
        if not isinstance(kv_caches, (tuple, list)) or len(kv_caches) != 2:
            raise LayoutError(
                "the sglang layout takes a pair (k_buffers, v_buffers), got "
                f"{type(kv_caches).__name__}"
                + (f" of length {len(kv_caches)}" if isinstance(kv_caches, (tuple, list)) else "")
            )
        k_buffers, v_buffers = kv_caches
        for name, buffers in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
            if not isinstance(buffers, (tuple, list)):
                raise LayoutError(f"sglang {name} must be a list of tensors, got "
                                  f"{type(buffers).__name__}")
        if len(k_buffers) != len(v_buffers):
            raise LayoutError(f"sglang has {len(k_buffers)} K buffers but {len(v_buffers)} "
                              "V buffers")
        tensors = [*k_buffers, *v_buffers]
    else:
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, (tuple, list)):
            raise LayoutError(f"the {layout} layout takes a list of per-layer tensors, got "
                              f"{type(kv_caches).__name__}")
        tensors = list(kv_caches)
    if not tensors:
        raise LayoutError(f"the {layout} layout needs at least one layer, got none")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        i = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise LayoutError(f"{layout} {_tensor_name(layout, i, len(tensors))} is a "
                          f"{type(tensors[i]).__name__}, not a torch.Tensor")
    first = tensors[0]
    # Fast checks first (this runs on every transfer); the loop below only finds the culprit.
    uniform = (all(t.shape == first.shape for t in tensors)
               and len({t.dtype for t in tensors}) == 1
               and len({t.device for t in tensors}) == 1)
    for i, t in enumerate([first] if uniform else tensors):
        name = _tensor_name(layout, i, len(tensors))
        first_name = _tensor_name(layout, 0, len(tensors))
        if t.dim() != _RANK[layout]:
            raise ShapeError(f"{layout} {name} has shape {tuple(t.shape)}; the layout wants "
                             f"{_PRETTY[layout]}")
        if t.shape != first.shape:
            raise ShapeError(f"{layout} {name} has shape {tuple(t.shape)}, but {first_name} has "
                             f"{tuple(first.shape)}; all layers must agree")
        if t.dtype != first.dtype:
            raise DTypeError(f"{layout} {name} has dtype {dtype_name(t.dtype)}, but "
                             f"{first_name} has {dtype_name(first.dtype)}")
        if t.device != first.device:
            raise DeviceError(f"{layout} {name} is on {t.device}, but {first_name} is on "
                              f"{first.device}")
    # The native path copies rows of contiguous head_dim elements; the torch path does not
    # care, but a cache on the host is only ever reached natively.
    if first.device.type == "cpu" and first.numel() > 0 and first.shape[-1] > 1:
        for i, t in enumerate(tensors):
            if t.stride(-1) != 1:
                raise LayoutError(f"{layout} {_tensor_name(layout, i, len(tensors))} has "
                                  f"strides {t.stride()}: the last dim (head_dim) must be "
                                  "contiguous (stride 1)")
    return tensors


def _tensor_name(layout: str, index: int, count: int) -> str:
    """How error messages name the tensor at ``index`` of the flat tensor list."""
    if layout == "sglang":
        half = count // 2
        return f"k_buffers[{index}]" if index < half else f"v_buffers[{index - half}]"
    return f"layer {index}"


def describe(kv_caches: object, layout: str) -> PagedKV:
    """Check ``kv_caches`` against ``layout`` and say what it holds.

    Raises LayoutError (unknown layout, wrong container), ShapeError, DTypeError or
    DeviceError, naming the offending layer and the values that disagree.
    """
    return _describe(kv_caches, layout)[0]


def _describe(kv_caches: object, layout: str) -> tuple[PagedKV, list[torch.Tensor]]:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise LayoutError(f"unknown paged layout {layout!r}; use one of {LAYOUTS}")
    tensors = _layer_list(kv_caches, layout)
    first = tensors[0]
    try:
        dtype_from_name(first.dtype)
    except ConfigError as exc:
        raise DTypeError(f"{layout} caches have dtype {dtype_name(first.dtype)}: {exc}") from None
    shape = tuple(first.shape)
    num_layers = len(tensors) // 2 if layout == "sglang" else len(tensors)
    if layout == "vllm":
        kv, nb, bs, h, d = shape
    elif layout == "flashinfer":
        nb, kv, bs, h, d = shape
    elif layout == "vllm-hnd":
        kv, nb, h, bs, d = shape
    elif layout == "vllm-mla":
        (nb, bs, d), kv, h = shape, 1, 1
    elif layout == "sglang":
        (nb, h, d), kv, bs = shape, 2, 1
    else:  # sglang-mla
        (nb, h, d), kv, bs = shape, 1, 1
        if shape[1] != 1:
            raise ShapeError(f"sglang-mla layer 0 has shape {shape}; the layout wants "
                             f"{_PRETTY[layout]} (dim 1 must be 1)")
    if layout in ("vllm", "flashinfer", "vllm-hnd") and kv != 2:
        raise ShapeError(f"{layout} layer 0 has shape {shape}: the K/V dim is {kv}, not 2; the "
                         f"layout wants {_PRETTY[layout]}")
    if min(nb, bs, h, d) <= 0:
        raise ShapeError(f"{layout} layer 0 has shape {shape}: every dim must be positive")
    info = PagedKV(layout=layout, num_layers=num_layers, num_kv_heads=h, head_dim=d,
                   dtype=first.dtype, device=first.device, num_slots=nb * bs, block_size=bs,
                   mla=layout in _MLA_LAYOUTS)
    return info, tensors


def _paged_planes(kv_caches: object, layout: str) -> list[list[torch.Tensor]]:
    """Per layer, the K and V (one for MLA) views ``[num_blocks, block_size, H, D]``.

    They are views: writing into them writes into the caches.
    """
    if layout == "sglang":
        k_buffers: Sequence[torch.Tensor]
        v_buffers: Sequence[torch.Tensor]
        k_buffers, v_buffers = kv_caches  # type: ignore[misc]
        pairs = zip(k_buffers, v_buffers, strict=True)
        return [[k.unsqueeze(1), v.unsqueeze(1)] for k, v in pairs]
    layers: Sequence[torch.Tensor] = kv_caches  # type: ignore[assignment]
    if layout == "vllm":
        return [[t[0], t[1]] for t in layers]
    if layout == "flashinfer":
        return [[t[:, 0], t[:, 1]] for t in layers]
    if layout == "vllm-hnd":
        return [[t[0].transpose(1, 2), t[1].transpose(1, 2)] for t in layers]
    if layout == "vllm-mla":
        return [[t.unsqueeze(2)] for t in layers]
    return [[t.unsqueeze(1)] for t in layers]  # sglang-mla: [S, 1, D] -> [S, 1, 1, D]


def _dense_planes(dense: torch.Tensor, mla: bool) -> list[list[torch.Tensor]]:
    """Per layer, the K and V (one for MLA) views ``[T, H, D]`` of a dense tensor."""
    if mla:
        return [[dense[i].unsqueeze(1)] for i in range(dense.shape[0])]
    return [[dense[i, 0], dense[i, 1]] for i in range(dense.shape[0])]


# -- checks ---------------------------------------------------------------------------------


def _as_slots(slot_mapping: object, num_tokens: int) -> torch.Tensor:
    """``slot_mapping`` as a 1-D int64 tensor of ``num_tokens`` entries (not range-checked)."""
    if isinstance(slot_mapping, torch.Tensor):
        if slot_mapping.dtype != torch.int64:
            raise DTypeError(f"slot_mapping has dtype {dtype_name(slot_mapping.dtype)}; it must "
                             "be int64")
        slots = slot_mapping
    else:
        try:
            array = np.asarray(slot_mapping)
        except (TypeError, ValueError) as exc:
            raise DTypeError(f"slot_mapping cannot be read as integers: {exc}") from None
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise DTypeError(f"slot_mapping must hold integers, got {array.dtype}")
        if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise SlotRangeError("slot_mapping holds values past the int64 range")
        slots = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if slots.dim() != 1:
        raise ShapeError(f"slot_mapping must be 1-D, got shape {tuple(slots.shape)}")
    if slots.shape[0] != num_tokens:
        raise ShapeError(f"slot_mapping has {slots.shape[0]} entries but the dense tensor has "
                         f"{num_tokens} tokens")
    return slots


def _check_slot_range(slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel() == 0:
        return
    if slots.device.type == "cpu":
        _native.check_slots(slots.contiguous().numpy(), num_slots)  # faster than torch ops
        return
    bad = (slots < -1) | (slots >= num_slots)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    raise SlotRangeError(f"slot_mapping[{first}] = {int(slots[first])} is outside the paged "
                         f"cache [0, {num_slots}) (only -1 may mean skip)")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor's elements occupy."""
    numel = t.numel()
    if numel == 0:
        return 0, 0
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + numel * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _check_no_alias(dense: torch.Tensor, what: str, cache_spans: Sequence[tuple[int, int]],
                    ) -> None:
    start, end = _byte_span(dense)
    if start == end:
        return
    for i, (c_start, c_end) in enumerate(cache_spans):
        if c_start < end and start < c_end:
            raise InvalidInputError(f"{what} overlaps the memory of paged cache tensor {i}")


def _has_internal_overlap(t: torch.Tensor) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))


def _check_threads(threads: object) -> int | None:
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            1 <= threads <= _native.MAX_THREADS):
        raise InvalidInputError(f"threads must be None or an int in [1, {_native.MAX_THREADS}], "
                                f"got {threads!r}")
    return threads


@dataclass(frozen=True)
class _Call:
    info: PagedKV
    caches: list[torch.Tensor]
    cache_spans: list[tuple[int, int]]  # [start, end) byte addresses, as caches
    slots: torch.Tensor
    threads: int | None


def _prepare(kv_caches: object, layout: str, dense: object, what: str, slot_mapping: object,
             threads: object) -> _Call:
    info, caches = _describe(kv_caches, layout)
    if not isinstance(dense, torch.Tensor):
        raise ShapeError(f"{what} must be a torch.Tensor, got {type(dense).__name__}")
    num_tokens = info.spec().check_dense(dense, what=what)
    if dense.device != info.device:
        raise DeviceError(f"{what} is on {dense.device}, but the paged caches are on "
                          f"{info.device}")
    if what == "out" and _has_internal_overlap(dense):
        raise InvalidInputError(f"out has overlapping memory (strides {dense.stride()}); "
                                "gather cannot write into it")
    slots = _as_slots(slot_mapping, num_tokens)
    _check_slot_range(slots, info.num_slots)
    nthreads = _check_threads(threads)
    # All caches share one device (checked by _describe), and so does `dense` by now.
    spans = [_byte_span(c) for c in caches]
    _check_no_alias(dense, what, spans)
    if slots.device != info.device:
        slots = slots.to(info.device)
    return _Call(info, caches, spans, slots, nthreads)


# -- backends -------------------------------------------------------------------------------


def _device_type(t: torch.Tensor) -> str:
    return t.device.type


@functools.lru_cache(maxsize=1)
def _musa_aiter() -> Any | None:
    """The ``musa_aiter`` module when it is importable and speaks KV-transfer ABI 1."""
    try:
        module = importlib.import_module("musa_aiter")
    except Exception:  # an optional extension: any failure to load means "not available"
        return None
    abi: object = getattr(module, "KV_TRANSFER_ABI", None)
    probe = getattr(module, "native_lmcache_kv_transfer_abi_version", None)
    if abi is None and callable(probe):
        try:
            abi = probe()
        except Exception:
            return None
    if abi != _AITER_ABI:
        return None
    if not all(callable(getattr(module, name, None)) for name in _AITER_SYMBOLS):
        return None
    return module


def backend_for(tensor: torch.Tensor) -> str:
    """The backend that moves KV for caches on ``tensor``'s device.

    ``"native"`` for CPU tensors, ``"musa_aiter"`` for MUSA tensors when ``musa_aiter``
    (ABI 1) is importable, ``"torch"`` otherwise.
    """
    kind = _device_type(tensor)
    if kind == "cpu":
        return "native"
    if kind == "musa" and _musa_aiter() is not None:
        return "musa_aiter"
    return "torch"


def _valid_tokens(slots: torch.Tensor) -> torch.Tensor | None:
    """Indices of tokens whose slot is not -1, or None when every slot is valid."""
    valid = slots >= 0
    if bool(valid.all()):
        return None
    return valid.nonzero().squeeze(1)


# native ------------------------------------------------------------------------------------


def _layer_geometry(t: torch.Tensor, layout: str) -> tuple[tuple[int, ...], int, int, int]:
    """Element strides of one cache tensor: (offsets of its K/V planes, block, slot, head)."""
    s = t.stride()
    if layout == "vllm":
        return (0, s[0]), s[1], s[2], s[3]
    if layout == "flashinfer":
        return (0, s[1]), s[0], s[2], s[3]
    if layout == "vllm-hnd":
        return (0, s[0]), s[1], s[3], s[2]
    if layout == "vllm-mla":
        return (0,), s[0], s[1], 0
    return (0,), s[0], s[0], s[1]  # sglang, sglang-mla: one plane per tensor, block size 1


def _native_transfer(call: _Call, dense: torch.Tensor, to_dense: bool) -> None:
    """One C call per group of planes with equal strides (one group for a normal model).

    Plane addresses are computed from strides rather than through per-plane tensor views:
    with 32 layers the views alone cost more than a small transfer.
    """
    info = call.info
    itemsize = dense.element_size()
    h, d = info.num_kv_heads, info.head_dim
    ds = dense.stride()
    if info.mla:
        dense_layer, dense_kv, dense_token, dense_head = ds[0], 0, ds[1], 0
    else:
        dense_layer, dense_kv, dense_token, dense_head = ds[0], ds[1], ds[2], ds[3]
    dense_ptr = dense.data_ptr()
    dense_end = _byte_span(dense)[1]
    dense_whole = h == 1 or dense_head == d

    # (cache tensor index, K/V plane within it, layer, K/V) per plane, layer-major, K first.
    num_layers = info.num_layers
    if info.layout == "sglang":
        planes = [(i + k * num_layers, 0, i, k) for i in range(num_layers) for k in range(2)]
    else:
        kv = 1 if info.mla else 2
        planes = [(i, k, i, k) for i in range(num_layers) for k in range(kv)]
    geometry = [_layer_geometry(c, info.layout) for c in call.caches]

    groups: dict[tuple[int, int, int], tuple[list[int], list[int], list[int], list[int]]] = {}
    for index, plane_in_tensor, layer, k in planes:
        ptr, end = call.cache_spans[index]
        kv_offsets, block, slot, head = geometry[index]
        whole = dense_whole and (h == 1 or head == d)
        row_bytes = (h * d if whole else d) * itemsize
        group = groups.setdefault((row_bytes, block * itemsize, slot * itemsize),
                                  ([], [], [], []))
        paged_base = ptr + kv_offsets[plane_in_tensor] * itemsize
        dense_base = dense_ptr + (layer * dense_layer + k * dense_kv) * itemsize
        for hh in range(1 if whole else h):
            p_addr = paged_base + hh * head * itemsize
            d_addr = dense_base + hh * dense_head * itemsize
            group[0].append(p_addr)
            group[1].append(d_addr)
            group[2].append(end - p_addr)
            group[3].append(dense_end - d_addr)

    slots = call.slots.contiguous().numpy()
    move = _native.gather_rows if to_dense else _native.scatter_rows
    for (row_bytes, block_stride, slot_stride), (paged, dense_planes, p_ext, d_ext) in (
            groups.items()):
        move(paged, dense_planes, slots, row_bytes=row_bytes, num_slots=info.num_slots,
             paged_extents=p_ext, dense_extents=d_ext, block_size=info.block_size,
             block_stride=block_stride, slot_stride=slot_stride,
             dense_row_stride=dense_token * itemsize, threads=call.threads)


def _unit_last_stride(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.shape[-1] == 1


def _native_gather(call: _Call, out: torch.Tensor) -> None:
    if _unit_last_stride(out):
        _native_transfer(call, out, to_dense=True)
        return
    # Rows of `out` are not contiguous: gather into a contiguous copy of it (so tokens with
    # slot -1 keep their old values) and copy back.
    staging = out.contiguous()
    _native_transfer(call, staging, to_dense=True)
    out.copy_(staging)


def _native_scatter(call: _Call, src: torch.Tensor) -> None:
    _native_transfer(call, src if _unit_last_stride(src) else src.contiguous(), to_dense=False)


# torch -------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def _slot_rows(plane: torch.Tensor) -> torch.Tensor | None:
    """A ``[num_slots, H, D]`` view of a ``[NB, BS, H, D]`` plane, when one exists."""
    nb, bs, h, d = plane.shape
    try:
        return plane.view(nb * bs, h, d)
    except RuntimeError:  # blocks and offsets cannot be merged without a copy
        return None


def _torch_transfer(call: _Call, kv_caches: object, dense: torch.Tensor, to_dense: bool) -> None:
    info = call.info
    tokens = _valid_tokens(call.slots)
    index = call.slots if tokens is None else call.slots.index_select(0, tokens)
    if index.numel() == 0:
        return
    block = offset = None
    for layer_paged, layer_dense in zip(_paged_planes(kv_caches, info.layout),
                                        _dense_planes(dense, info.mla), strict=True):
        for p, dv in zip(layer_paged, layer_dense, strict=True):
            p, dv = _bits(p), _bits(dv)
            rows = _slot_rows(p)
            if rows is None and block is None:
                block = torch.div(index, info.block_size, rounding_mode="floor")
                offset = index - block * info.block_size
            if to_dense:
                picked = rows.index_select(0, index) if rows is not None else p[block, offset]
                if tokens is None:
                    dv.copy_(picked)
                else:
                    dv.index_copy_(0, tokens, picked)
            else:
                source = dv if tokens is None else dv.index_select(0, tokens)
                if rows is not None:
                    rows.index_copy_(0, index, source)
                else:
                    p[block, offset] = source


# musa_aiter --------------------------------------------------------------------------------


def _aiter_transfer(module: Any, call: _Call, dense: torch.Tensor, to_dense: bool) -> bool:
    """Move KV with MUSA-Aiter; False when it cannot or will not (the caller uses torch ops).

    The contract (LMCache's MUSA adapter, ABI 1): all tensors contiguous on the device,
    int64 slots; the non-MLA buffer is ``[2, L, T, H * D]`` and the MLA buffer ``[L, T, D]``;
    gathers are ``*_paged_to_buffer(kvcaches, buffer, slot_mapping, block_size, [num_heads,]
    head_size)`` and scatters ``*_buffer_to_paged(buffer, kvcaches, slot_mapping,
    skip_prefix_n_tokens, block_size, [num_heads,] head_size)``; each returns True on success.
    Gathers land in a staging buffer, so a rejected gather has written nothing the caller
    sees, and a rejected scatter is redone in full by torch ops (the result is the same).
    """
    info = call.info
    if info.layout not in _AITER_LAYOUTS:
        return False
    # vllm [2, NB, BS, H, D] and vllm-mla [NB, BS, D] are MUSA-Aiter's own formats; an
    # sglang-mla [num_slots, 1, D] cache is its MLA format with a block size of 1.
    caches = call.caches
    if not all(c.is_contiguous() for c in caches):
        return False
    tokens = _valid_tokens(call.slots)
    index = (call.slots if tokens is None else call.slots.index_select(0, tokens)).contiguous()
    n = int(index.numel())
    if n == 0:
        return True
    layers, h, d = info.num_layers, info.num_kv_heads, info.head_dim
    token_dim = 1 if info.mla else 2
    try:
        if to_dense:
            shape = (layers, n, d) if info.mla else (2, layers, n, h * d)
            buffer = torch.empty(shape, dtype=info.dtype, device=dense.device)
            if info.mla:
                ok = module.lmcache_mla_paged_to_buffer(caches, buffer, index, info.block_size, d)
            else:
                ok = module.lmcache_kv_paged_to_buffer(caches, buffer, index, info.block_size,
                                                       h, d)
            if not ok:
                return False
            picked = buffer if info.mla else buffer.view(2, layers, n, h, d).transpose(0, 1)
            if tokens is None:
                dense.copy_(picked)
            else:
                dense.index_copy_(token_dim, tokens, picked)
        else:
            source = dense if tokens is None else dense.index_select(token_dim, tokens)
            if info.mla:
                buffer = source.contiguous()
                ok = module.lmcache_mla_buffer_to_paged(buffer, caches, index, 0,
                                                        info.block_size, d)
            else:
                buffer = source.transpose(0, 1).contiguous().view(2, layers, n, h * d)
                ok = module.lmcache_kv_buffer_to_paged(buffer, caches, index, 0,
                                                       info.block_size, h, d)
            if not ok:
                return False
    except Exception as exc:  # a foreign extension: fall back rather than fail the transfer
        logger.warning("musa_aiter %s failed (%r); using torch ops",
                       "gather" if to_dense else "scatter", exc)
        return False
    return True


# -- public API -----------------------------------------------------------------------------


def gather(kv_caches: object, slot_mapping: object, out: torch.Tensor, layout: str, *,
           threads: int | None = None) -> None:
    """Copy the paged KV of ``slot_mapping``'s slots into ``out``.

    ``out`` is ``(L, 2, T, H, D)``, or ``(L, T, D)`` for MLA layouts, with the caches' dtype
    and device; any strides (a view with a non-contiguous last dim is staged through a
    contiguous copy). ``slot_mapping`` is a 1-D int64 tensor (or a list/ndarray of ints) of
    ``T`` slots; -1 leaves that token's rows of ``out`` unchanged. ``threads`` overrides the
    native thread count for this call.

    Raises LayoutError, ShapeError, DTypeError, DeviceError, SlotRangeError or
    InvalidInputError before anything is written; NativeError if the C code fails.
    """
    call = _prepare(kv_caches, layout, out, "out", slot_mapping, threads)
    if out.numel() == 0:
        return
    backend = backend_for(call.caches[0])
    if backend == "native":
        _native_gather(call, out)
        return
    if backend == "musa_aiter":
        module = _musa_aiter()
        if module is not None and _aiter_transfer(module, call, out, to_dense=True):
            return
    _torch_transfer(call, kv_caches, out, to_dense=True)


def scatter(src: torch.Tensor, kv_caches: object, slot_mapping: object, layout: str, *,
            threads: int | None = None) -> None:
    """Write the dense KV ``src`` into the paged caches at ``slot_mapping``'s slots.

    ``src`` is ``(L, 2, T, H, D)`` or ``(L, T, D)`` (MLA), any strides. Tokens whose slot is
    -1 are not written. When a slot repeats, the native backend writes the last token; on
    devices the winner is unspecified (as with ``index_copy_``).

    Raises the same errors as :func:`gather`, before anything is written.
    """
    call = _prepare(kv_caches, layout, src, "src", slot_mapping, threads)
    if src.numel() == 0:
        return
    backend = backend_for(call.caches[0])
    if backend == "native":
        _native_scatter(call, src)
        return
    if backend == "musa_aiter":
        module = _musa_aiter()
        if module is not None and _aiter_transfer(module, call, src, to_dense=False):
            return
    _torch_transfer(call, kv_caches, src, to_dense=False)


def set_num_threads(n: int) -> None:
    """Set how many threads a native gather/scatter uses by default (1 to 256).

    The default is ``os.cpu_count()`` capped at 8, or ``MUSACACHE_NATIVE_THREADS``.
    """
    _native.set_num_threads(n)


def get_num_threads() -> int:
    """How many threads a native gather/scatter uses by default."""
    return _native.get_num_threads()
