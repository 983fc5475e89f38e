"""Paged KV <-> dense KV: gather and scatter by ``slot_mapping``.

``gather`` copies the rows of a paged KV cache (the layout of an inference engine) into a
dense ``(L, 2, T, H, D)`` tensor (``(L, T, D)`` for MLA layouts); ``scatter`` writes a dense
tensor back into the paged cache. ``slot_mapping[t]`` is the slot of token ``t``; a slot of
-1 skips the token (nothing is read or written for it).

Every check (layout, shapes, dtypes, devices, slot dtype, length and range, aliasing) runs
before the first byte is written, so a call that raises leaves every tensor unchanged.

An engine opens its caches once as :class:`Pages` (``Pages.open(kv_caches, layout)``): the
caches checked, their layout's row of the layout table, what they hold (spec, ``num_slots``,
device) and the byte spans, strides and plane table the native and device paths address
them by. Every function here takes a ``Pages`` in place of ``kv_caches`` (and then no
layout); raw caches with a layout are still accepted, opened once per call.

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

=================== =============================================================
``vllm``        ``[2, num_blocks, block_size, H, D]``; slot = block * block_size + offset
``vllm-mla``    ``[num_blocks, block_size, D]``
``sglang``      a pair ``(k_buffers, v_buffers)``, each a list of ``[num_slots, H, D]``
``sglang-mla``  ``[num_slots, 1, D]``
``flashinfer``  ``[num_blocks, 2, block_size, H, D]``
``vllm-hnd``    ``[2, num_blocks, H, block_size, D]``
``vllm-packed`` ``[num_blocks, H, block_size, 2*D]``: K = ``[..., :D]``, V = ``[..., D:]``
                (vLLM >= 0.32, GPU attention backends; any physical order)
``vllm-packed-cpu`` the same shape as vLLM's CPU backend views it: each head's block is
                ``block_size`` rows of K then ``block_size`` rows of V (its kernel
                writes a block's keys transposed, so K rows mean tokens only for a
                whole block moved to a whole block: the vLLM connector moves no less)
=================== =============================================================
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from musacache import _native, devices
from musacache._errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidInputError,
    LayoutError,
    ShapeError,
    SlotRangeError,
)
from musacache._spec import KVSpec, check_has_data, check_plain_values, dtype_from_name, dtype_name
from musacache.transfer import relay as _relay
from musacache.transfer import triton as _kernels

__all__ = [
    "LAYOUTS",
    "PagedKV",
    "Pages",
    "as_pages",
    "backend_for",
    "describe",
    "gather",
    "gather_chunks",
    "get_num_threads",
    "scatter",
    "scatter_chunks",
    "set_num_threads",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Layout:
    """One row of the layout table: everything musacache knows about an engine's layout.

    ``dims(shape)`` reads ``(kv, num_blocks, block_size, H, D)`` off a layer's shape;
    ``planes(t)`` gives a tensor's K and V planes (one for MLA, and one per tensor for a
    ``pair`` layout) as ``[num_blocks, block_size, H, D]`` views; ``geometry(t)`` their
    element strides for the native path: ``(plane offsets, block, slot, head)``.
    ``check_shape(shape, name)`` refuses what ``dims`` cannot tell apart, ``check(t, name,
    which)`` what the strides rule out. ``pair``: the engine hands ``(k_buffers, v_buffers)``
    (two tensors a layer, K then V) instead of one list. ``stacked``: a layer is
    ``[2, num_blocks, block_size, H, D]``, so K and V merge into one ``[2, num_slots, H, D]``
    view on the device. ``aiter``: a format MUSA-Aiter's paged-KV kernels take as is.
    """

    name: str
    rank: int
    pretty: str
    dims: Any
    planes: Any
    geometry: Any
    mla: bool = False
    check: Any = None
    check_shape: Any = None
    pair: bool = False
    stacked: bool = False
    aiter: bool = False


def _packed_dims(shape: tuple[int, ...], name: str) -> tuple[int, int, int, int, int]:
    nb, h, bs, d2 = shape
    if d2 % 2:
        raise ShapeError(f"{name} layer 0 has shape {shape}: its last dim holds K and V "
                         f"(2*D) and must be even")
    return 2, nb, bs, h, d2 // 2


def _kv_dim_check(dim: int, pretty: str) -> Any:
    def check(shape: tuple[int, ...], name: str) -> None:
        kv = shape[dim]
        if kv != 2:
            raise ShapeError(f"{name} layer 0 has shape {shape}: the K/V dim is {kv}, not 2; "
                             f"the layout wants {pretty}")
    return check


def _one_head_check(shape: tuple[int, ...], name: str) -> None:
    if shape[1] != 1:
        raise ShapeError(f"{name} layer 0 has shape {shape}; the layout wants "
                         "[num_slots, 1, D] (dim 1 must be 1)")


def _cpu_packed_check(t: torch.Tensor, name: str, which: str) -> None:
    # CPU_ATTN views each [block_size, 2*D] block of a head as [2*block_size, D]: only a
    # tensor whose block rows are contiguous can be read that way.
    if t.numel() and (t.stride(3) != 1 or t.stride(2) != t.shape[3]):
        raise LayoutError(f"{name} {which} has strides {t.stride()}: the CPU backend reads "
                          "each block of a head as [2*block_size, D], so its "
                          "[block_size, 2*D] rows must be contiguous")


def _cpu_packed_planes(t: torch.Tensor) -> list[torch.Tensor]:
    nb, h, bs, d2 = t.shape
    v = t.view(nb, h, 2 * bs, d2 // 2)
    return [v[:, :, :bs].transpose(1, 2), v[:, :, bs:].transpose(1, 2)]


_TABLE: dict[str, _Layout] = {row.name: row for row in (
    _Layout("vllm", 5, "[2, num_blocks, block_size, H, D]",
            dims=lambda sh, n: tuple(sh),
            planes=lambda t: [t[0], t[1]],
            geometry=lambda t, s: ((0, s[0]), s[1], s[2], s[3]),
            check_shape=_kv_dim_check(0, "[2, num_blocks, block_size, H, D]"),
            stacked=True, aiter=True),
    _Layout("vllm-mla", 3, "[num_blocks, block_size, D]",
            dims=lambda sh, n: (1, sh[0], sh[1], 1, sh[2]),
            planes=lambda t: [t.unsqueeze(2)],
            geometry=lambda t, s: ((0,), s[0], s[1], 0), mla=True, aiter=True),
    # SGLang's MHA pool: per layer a K buffer and a V buffer, each [num_slots, H, D].
    _Layout("sglang", 3, "a pair (k_buffers, v_buffers), each a list of [num_slots, H, D]",
            dims=lambda sh, n: (2, sh[0], 1, sh[1], sh[2]),
            planes=lambda t: [t.unsqueeze(1)],
            geometry=lambda t, s: ((0,), s[0], s[0], s[1]), pair=True),
    # MUSA-Aiter's MLA format with a block size of 1.
    _Layout("sglang-mla", 3, "[num_slots, 1, D]",
            dims=lambda sh, n: (1, sh[0], 1, sh[1], sh[2]),
            planes=lambda t: [t.unsqueeze(1)],
            geometry=lambda t, s: ((0,), s[0], s[0], s[1]), mla=True,
            check_shape=_one_head_check, aiter=True),
    _Layout("flashinfer", 5, "[num_blocks, 2, block_size, H, D]",
            dims=lambda sh, n: (sh[1], sh[0], sh[2], sh[3], sh[4]),
            planes=lambda t: [t[:, 0], t[:, 1]],
            geometry=lambda t, s: ((0, s[1]), s[0], s[2], s[3]),
            check_shape=_kv_dim_check(1, "[num_blocks, 2, block_size, H, D]")),
    _Layout("vllm-hnd", 5, "[2, num_blocks, H, block_size, D]",
            dims=lambda sh, n: (sh[0], sh[1], sh[3], sh[2], sh[4]),
            planes=lambda t: [t[0].transpose(1, 2), t[1].transpose(1, 2)],
            geometry=lambda t, s: ((0, s[0]), s[1], s[3], s[2]),
            check_shape=_kv_dim_check(0, "[2, num_blocks, H, block_size, D]")),
    # vLLM >= 0.32: one logical [num_blocks, H, block_size, 2*D] tensor per layer, read two
    # ways. GPU attention backends: K is [..., :D] and V is [..., D:], the first three dims in
    # any physical order.
    _Layout("vllm-packed", 4, "[num_blocks, H, block_size, 2*D] (K = [..., :D], V = [..., D:])",
            dims=_packed_dims,
            planes=lambda t: [t[..., :t.shape[-1] // 2].transpose(1, 2),
                              t[..., t.shape[-1] // 2:].transpose(1, 2)],
            geometry=lambda t, s: ((0, t.shape[-1] // 2), s[0], s[2], s[1])),
    # The CPU backend (CPU_ATTN) reads the same shape as [num_blocks, H, 2*block_size, D]:
    # block_size rows of K, then block_size rows of V.
    _Layout("vllm-packed-cpu", 4,
            "[num_blocks, H, block_size, 2*D] read as [num_blocks, H, 2*block_size, D] "
            "(K rows, then V rows)",
            dims=_packed_dims, planes=_cpu_packed_planes,
            geometry=lambda t, s: ((0, t.shape[2] * (t.shape[3] // 2)), s[0],
                                   t.shape[3] // 2, s[1]),
            check=_cpu_packed_check),
)}

LAYOUTS: tuple[str, ...] = tuple(_TABLE)
_MLA_LAYOUTS = frozenset(name for name, row in _TABLE.items() if row.mla)
_RANK = {name: row.rank for name, row in _TABLE.items()}
_PRETTY = {name: row.pretty for name, row in _TABLE.items()}

# Integer dtypes of each element size: the torch path moves bits, so fp8 (which lacks some
# indexing kernels) and NaN payloads go through unchanged.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

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
    """The layout's tensors, in plane order (a pair layout: all K buffers, then all V)."""
    row = _TABLE[layout]
    if row.pair:
        if not isinstance(kv_caches, (tuple, list)) or len(kv_caches) != 2:
            raise LayoutError(
                f"the {layout} layout takes a pair (k_buffers, v_buffers), got "
                f"{type(kv_caches).__name__}"
                + (f" of length {len(kv_caches)}" if isinstance(kv_caches, (tuple, list)) else "")
            )
        k_buffers, v_buffers = kv_caches
        for name, buffers in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
            if not isinstance(buffers, (tuple, list)):
                raise LayoutError(f"{layout} {name} must be a list of tensors, got "
                                  f"{type(buffers).__name__}")
        if len(k_buffers) != len(v_buffers):
            raise LayoutError(f"{layout} has {len(k_buffers)} K buffers but {len(v_buffers)} "
                              "V buffers")
        tensors = [*k_buffers, *v_buffers]
    else:
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, (tuple, list)):
            raise LayoutError(f"the {layout} layout takes a list of per-layer tensors, got "
                              f"{type(kv_caches).__name__}")
        tensors = list(kv_caches)
    return _check_tensors(tensors, layout)


def _check_tensors(tensors: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
    """Check a flat tensor list (plane order) against ``layout``."""
    if not tensors:
        raise LayoutError(f"the {layout} layout needs at least one layer, got none")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        i = next(i for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise LayoutError(f"{layout} {_tensor_name(layout, i, len(tensors))} is a "
                          f"{type(tensors[i]).__name__}, not a torch.Tensor")
    if _TABLE[layout].pair and len(tensors) % 2:
        raise LayoutError(f"the {layout} layout has as many K as V buffers; got "
                          f"{len(tensors)} tensors")
    first = tensors[0]
    # Fast checks first; the loop below only finds the culprit.
    uniform = (all(t.shape == first.shape for t in tensors)
               and len({t.dtype for t in tensors}) == 1
               and len({t.device for t in tensors}) == 1)
    for i, t in enumerate([first] if uniform else tensors):
        name = _tensor_name(layout, i, len(tensors))
        first_name = _tensor_name(layout, 0, len(tensors))
        if t.dim() != _RANK[layout]:
            if t.dim() == 4 and _RANK[layout] == 5:
                raise ShapeError(
                    f"{layout} {name} has shape {tuple(t.shape)}: a 4-D tensor is vLLM's "
                    "packed [num_blocks, H, block_size, 2*D] layout, which its attention "
                    "backends read two ways; name it: 'vllm-packed' (GPU backends: K and V "
                    "halves of the last dim) or 'vllm-packed-cpu' (CPU_ATTN)")
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
    for i, t in enumerate(tensors):
        name = f"{layout} {_tensor_name(layout, i, len(tensors))}"
        # Memory behind it, holding its values as they are: the copies move memory (a
        # negated view gave the negated values back, found by a probe).
        check_has_data(t, name)
        check_plain_values(t, name)
    # The native path copies rows of contiguous head_dim elements; the torch path does not
    # care, but a cache on the host is only ever reached natively.
    if first.device.type == "cpu" and first.numel() > 0 and first.shape[-1] > 1:
        for i, t in enumerate(tensors):
            if t.stride(-1) != 1:
                raise LayoutError(f"{layout} {_tensor_name(layout, i, len(tensors))} has "
                                  f"strides {t.stride()}: the last dim (head_dim) must be "
                                  "contiguous (stride 1)")
    return tensors


def _shares_pages(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether two of the cache tensors start at the same address (the same pages)."""
    starts = [t.data_ptr() for t in tensors if t.numel()]
    return len(set(starts)) < len(starts)


def _check_storage(tensors: Sequence[torch.Tensor], layout: str) -> None:
    """Host caches are reached by address alone: a storage resized or freed under its tensor
    (``untyped_storage().resize_()``) would be read and written past its end (a segfault, or 2 MiB
    written past a 64-byte storage)."""
    for i, t in enumerate(tensors):
        KVSpec.check_memory(t, what=f"{layout} {_tensor_name(layout, i, len(tensors))}")


def _tensor_name(layout: str, index: int, count: int) -> str:
    """How error messages name the tensor at ``index`` of the flat tensor list."""
    if _TABLE[layout].pair:
        half = count // 2
        return f"k_buffers[{index}]" if index < half else f"v_buffers[{index - half}]"
    return f"layer {index}"


def describe(kv_caches: object, layout: str | None = None) -> PagedKV:
    """Check ``kv_caches`` against ``layout`` and say what it holds (``kv_caches`` may also
    be a :class:`Pages`, which was checked when it was opened).

    Raises LayoutError (unknown layout, wrong container), ShapeError, DTypeError or
    DeviceError, naming the offending layer and the values that disagree.
    """
    return as_pages(kv_caches, layout).info


def _check_layout(layout: object) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise LayoutError(f"unknown paged layout {layout!r}; use one of {LAYOUTS}")
    return layout


def _describe(tensors: list[torch.Tensor], layout: str) -> PagedKV:
    """What the checked flat tensor list holds (the rest of the checks)."""
    first = tensors[0]
    try:
        dtype_from_name(first.dtype)
    except ConfigError as exc:
        raise DTypeError(f"{layout} caches have dtype {dtype_name(first.dtype)}: {exc}") from None
    shape = tuple(first.shape)
    row = _TABLE[layout]
    num_layers = len(tensors) // 2 if row.pair else len(tensors)
    _, nb, bs, h, d = row.dims(shape, layout)
    if row.check_shape is not None:
        row.check_shape(shape, layout)
    if row.check is not None:
        for i, t in enumerate(tensors):
            row.check(t, layout, _tensor_name(layout, i, len(tensors)))
    if min(nb, bs, h, d) <= 0:
        raise ShapeError(f"{layout} layer 0 has shape {shape}: every dim must be positive")
    info = PagedKV(layout=layout, num_layers=num_layers, num_kv_heads=h, head_dim=d,
                   dtype=first.dtype, device=first.device, num_slots=nb * bs, block_size=bs,
                   mla=row.mla)
    return info


class Pages:
    """An engine's paged KV caches, checked once and described once.

    Open it once, when the engine allocates its caches: ``Pages.open(kv_caches, layout)``
    (or ``Pages(kv_caches, layout)``). It holds the tensors, their layout's row of the
    layout table, what they hold (``info``: spec, ``num_slots``, device) and what the
    native and device paths address them by (per tensor its byte span and strides, per
    plane which tensor it lies in). Every function here that takes ``kv_caches`` and a
    ``layout`` also takes a ``Pages`` (and no layout, or the same one); so do
    :meth:`musacache.Cache.store` / ``retrieve`` and the client's ``register_kv_caches``.
    Passing one skips the per-call description of the caches.

    Frozen: the tensors' memory must stay where it was (an engine never moves its pages);
    open a new ``Pages`` if the caches are reallocated.

    Raises LayoutError (unknown layout, wrong container), ShapeError, DTypeError or
    DeviceError before anything else happens.
    """

    __slots__ = ("geometry", "info", "layout", "plane_table", "row", "spans", "tensors")

    layout: str
    row: _Layout
    tensors: tuple[torch.Tensor, ...]
    info: PagedKV
    spans: tuple[tuple[int, int], ...]
    geometry: tuple[tuple[tuple[int, ...], int, int, int], ...]
    plane_table: tuple[tuple[int, int, int, int], ...]

    def __init__(self, kv_caches: object, layout: str = "vllm") -> None:
        name = _check_layout(layout)
        self._fill(name, _layer_list(kv_caches, name))

    @classmethod
    def open(cls, kv_caches: object, layout: str = "vllm") -> Pages:
        """Check and describe ``kv_caches`` in ``layout`` (see :data:`LAYOUTS`)."""
        return cls(kv_caches, layout)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], layout: str) -> Pages:
        """From the flat tensor list :attr:`tensors` (how pages cross a process boundary)."""
        name = _check_layout(layout)
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise LayoutError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
        pages = cls.__new__(cls)
        pages._fill(name, _check_tensors(list(tensors), name))
        return pages

    def _fill(self, layout: str, tensors: list[torch.Tensor]) -> None:
        info = _describe(tensors, layout)
        row = _TABLE[layout]
        values = {
            "layout": layout, "row": row, "tensors": tuple(tensors), "info": info,
            "spans": tuple(_byte_span(t) for t in tensors),
            "geometry": tuple(row.geometry(t, t.stride()) for t in tensors),
            "plane_table": _plane_table(row, info.num_layers),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def _replaced(self, **changes: object) -> Pages:
        """A copy with ``changes`` (no new checks: each caller derives them from this one)."""
        pages = Pages.__new__(Pages)
        for key in Pages.__slots__:
            object.__setattr__(pages, key, changes.get(key, getattr(self, key)))
        return pages

    def _with_tensors(self, tensors: Sequence[torch.Tensor]) -> Pages:
        """This description over ``tensors`` (the same ones, as PagesMemo has checked; or
        none, for the memo to keep without holding them)."""
        return self._replaced(tensors=tuple(tensors))

    def __setattr__(self, key: str, value: object) -> None:
        raise dataclasses.FrozenInstanceError(f"Pages is frozen: cannot set {key!r}")

    def __delattr__(self, key: str) -> None:
        raise dataclasses.FrozenInstanceError(f"Pages is frozen: cannot delete {key!r}")

    def __repr__(self) -> str:
        return (f"Pages({self.layout!r}, {self.spec.describe()}, num_slots={self.num_slots}, "
                f"device={self.device})")

    @property
    def spec(self) -> KVSpec:
        """The :class:`KVSpec` of the dense tensors these pages gather to and scatter from."""
        return self.info.spec()

    @property
    def num_slots(self) -> int:
        return self.info.num_slots

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def kv_caches(self) -> object:
        """The tensors in the container the layout takes (a pair layout: ``(k, v)`` lists)."""
        if self.row.pair:
            n = self.info.num_layers
            return (list(self.tensors[:n]), list(self.tensors[n:]))
        return list(self.tensors)

    def layers(self, start: int, stop: int) -> Pages:
        """The pages of layers ``start:stop`` (no new checks: a subset of checked pages)."""
        n = self.info.num_layers
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= n):
            raise InvalidInputError(f"layers({start!r}, {stop!r}) is not a non-empty range "
                                    f"of the {n} layers")
        index = ([*range(start, stop), *range(n + start, n + stop)] if self.row.pair
                 else list(range(start, stop)))
        return self._replaced(
            tensors=tuple(self.tensors[i] for i in index),
            info=dataclasses.replace(self.info, num_layers=stop - start),
            spans=tuple(self.spans[i] for i in index),
            geometry=tuple(self.geometry[i] for i in index),
            plane_table=_plane_table(self.row, stop - start))


def as_pages(kv_caches: object, layout: str | None = None, *, default: str = "vllm") -> Pages:
    """``kv_caches`` as :class:`Pages`: itself when it is one (``layout`` must then be None
    or its layout), else opened in ``layout`` (``default`` when None). This is what every
    public entry point that takes raw caches runs once, at its boundary."""
    if isinstance(kv_caches, Pages):
        if layout is not None and layout != kv_caches.layout:
            raise LayoutError(f"these pages are in the {kv_caches.layout!r} layout, not "
                              f"{layout!r}")
        return kv_caches
    return Pages(kv_caches, default if layout is None else layout)


class PagesMemo:
    """:func:`as_pages` for a caller that passes the same raw caches again and again (an
    engine's ``store``/``retrieve`` per request): the description of the caches opened
    last is reused while ``kv_caches`` holds the very tensors it was made from, each still
    at the same address with the same shape, strides, dtype and device. Comparing that
    costs about a microsecond a tensor; checking and describing them again cost 4 (32 us
    for 8 layers warm, about 0.2 ms on the loop right after a large copy, where the next
    store starts).

    The memo holds the tensors by weak reference only: an engine that frees or reallocates
    its caches gets the memory back (a strong reference here would pin gigabytes of device
    memory until the next call). A dead reference never matches, so a new tensor that
    happens to sit at the old address is described anew."""

    __slots__ = ("_last", "_state")

    def __init__(self) -> None:
        self._last: Pages | None = None  # the description, with no tensors in it
        self._state: tuple[tuple[Any, ...], ...] = ()

    def open(self, kv_caches: object, layout: str | None) -> Pages:
        if isinstance(kv_caches, Pages):
            return as_pages(kv_caches, layout)
        last = self._last
        # (None is as_pages' default layout, not "whatever was passed last".)
        if last is not None and (layout or "vllm") == last.layout:
            flat = self._same(kv_caches, last.row.pair)
            if flat is not None:
                return last._with_tensors(flat)
        pages = as_pages(kv_caches, layout)
        self._last = pages._with_tensors(())
        self._state = tuple((weakref.ref(t), *_tensor_state(t)) for t in pages.tensors)
        return pages

    def _same(self, kv_caches: object, pair: bool) -> list[torch.Tensor] | None:
        """``kv_caches`` flattened (as Pages.tensors) if they are the described tensors."""
        flat: list[Any]
        if pair:
            if not (isinstance(kv_caches, (tuple, list)) and len(kv_caches) == 2
                    and all(isinstance(b, (tuple, list)) for b in kv_caches)):
                return None
            flat = [*kv_caches[0], *kv_caches[1]]
        elif isinstance(kv_caches, (tuple, list)):
            flat = list(kv_caches)
        else:
            return None
        state = self._state
        if len(flat) != len(state):
            return None
        for t, (ref, *was) in zip(flat, state):
            # Identity first: no attribute of a non-tensor is read.
            if ref() is not t or list(_tensor_state(t)) != was:
                return None
        return flat


def _tensor_state(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _plane_table(row: _Layout, num_layers: int) -> tuple[tuple[int, int, int, int], ...]:
    """``(tensor index, plane within it, layer, K/V)`` per plane, layer-major, K first."""
    if row.pair:
        return tuple((i + k * num_layers, 0, i, k) for i in range(num_layers) for k in range(2))
    kv = 1 if row.mla else 2
    return tuple((i, k, i, k) for i in range(num_layers) for k in range(kv))


def _paged_planes(pages: Pages) -> list[list[torch.Tensor]]:
    """Per layer, the K and V (one for MLA) views ``[num_blocks, block_size, H, D]``.

    They are views: writing into them writes into the caches.
    """
    views = [pages.row.planes(t) for t in pages.tensors]
    layers: list[list[torch.Tensor]] = [[] for _ in range(pages.info.num_layers)]
    for index, within, layer, _ in pages.plane_table:
        layers[layer].append(views[index][within])
    return layers


def _dense_planes(dense: torch.Tensor, mla: bool) -> list[list[torch.Tensor]]:
    """Per layer, the K and V (one for MLA) views ``[T, H, D]`` of a dense tensor."""
    if mla:
        return [[dense[i].unsqueeze(1)] for i in range(dense.shape[0])]
    return [[dense[i, 0], dense[i, 1]] for i in range(dense.shape[0])]


# -- checks ---------------------------------------------------------------------------------


def _as_slots(slot_mapping: object, num_tokens: int, *,
              holder: str = "the dense tensor") -> torch.Tensor:
    """``slot_mapping`` as a 1-D int64 tensor of ``num_tokens`` entries (not range-checked)."""
    if isinstance(slot_mapping, torch.Tensor):
        check_has_data(slot_mapping, "slot_mapping")
        if slot_mapping.dtype != torch.int64:
            raise DTypeError(f"slot_mapping has dtype {dtype_name(slot_mapping.dtype)}; it must "
                             "be int64")
        # (its values are read by address: a storage freed under it was a segfault)
        KVSpec.check_memory(slot_mapping, what="slot_mapping")
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
        raise ShapeError(f"slot_mapping has {slots.shape[0]} entries but {holder} has "
                         f"{num_tokens} tokens")
    return slots


def _check_slot_range(slots: torch.Tensor, num_slots: int) -> bool:
    """Raise :class:`SlotRangeError` for a slot outside [0, num_slots) other than -1; return
    whether any slot is -1."""
    n = slots.numel()
    if n == 0:
        return False
    if slots.is_cpu:
        host = slots.contiguous()
        if host.dtype == torch.int64:
            # One native pass (numpy's min and max were 0.1 ms here with the caches cold).
            got = _native.slot_range_at(host.data_ptr(), n)
            if got is not None and got[0] >= -1 and got[1] < num_slots:
                return got[0] == -1
        return _native.check_slots(host.numpy(), num_slots)  # names the first bad slot
    lo, hi = torch.stack((slots.min(), slots.max())).tolist()  # one synchronization
    if lo >= -1 and hi < num_slots:
        return bool(lo == -1)
    bad = (slots < -1) | (slots >= num_slots)
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


class _OnPages:
    pages: Pages

    @property
    def info(self) -> PagedKV:
        return self.pages.info

    @property
    def caches(self) -> list[torch.Tensor]:
        return list(self.pages.tensors)

    @property
    def cache_spans(self) -> tuple[tuple[int, int], ...]:
        return self.pages.spans


@dataclass(frozen=True)
class _Call(_OnPages):
    pages: Pages
    slots: torch.Tensor
    threads: int | None


def _prepare(pages: Pages, dense: object, what: str, slot_mapping: object,
             threads: object) -> _Call:
    info = pages.info
    if not isinstance(dense, torch.Tensor):
        raise ShapeError(f"{what} must be a torch.Tensor, got {type(dense).__name__}")
    num_tokens = info.spec().check_dense(dense, what=what)
    KVSpec.check_memory(dense, what=what)
    if dense.device != info.device:
        raise DeviceError(f"{what} is on {dense.device}, but the paged caches are on "
                          f"{info.device}")
    if what == "out" and _has_internal_overlap(dense):
        raise InvalidInputError(f"out has overlapping memory (strides {dense.stride()}); "
                                "gather cannot write into it")
    slots = _as_slots(slot_mapping, num_tokens)
    _check_slot_range(slots, info.num_slots)
    nthreads = _check_threads(threads)
    # All caches share one device (checked by Pages), and so does `dense` by now.
    _check_no_alias(dense, what, pages.spans)
    return _Call(pages, slots, nthreads)


def _on_device(call: _Call) -> _Call:
    """``call`` with its slots on the caches' device (what device kernels index with)."""
    if call.slots.device == call.info.device:
        return call
    return dataclasses.replace(call, slots=call.slots.to(call.info.device))


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


def _native_transfer(call: _Call, dense: torch.Tensor, to_dense: bool) -> None:
    _native_rows(call.pages, call.slots, [dense],
                 [0, int(call.slots.shape[0])], to_dense, call.threads)


def _dense_strides(dense: torch.Tensor | DenseAt, mla: bool) -> tuple[int, int, int, int]:
    """Element strides of a dense tensor's (layer, K/V, token, head) dims (0 where absent)."""
    if isinstance(dense, DenseAt):
        return dense.strides
    return _dims(dense.stride(), mla)


def _dims(ds: Sequence[int], mla: bool) -> tuple[int, int, int, int]:
    if mla:
        return ds[0], 0, ds[1], 0
    return ds[0], ds[1], ds[2], ds[3]


class DenseAt(NamedTuple):
    """A contiguous dense chunk given by its address: one of the cache's own host slots,
    for the native path, which reads of a chunk tensor only its address, extent and strides.
    A store made a tensor view per slot on the loop and read several of its attributes per
    chunk in the worker: about 0.15 ms for 16 chunks, the CPU's caches cold from the copy
    before."""

    ptr: int
    nbytes: int
    strides: tuple[int, int, int, int]  # element strides of (layer, K/V, token, head)
    itemsize: int

    @staticmethod
    def of(ptr: int, spec: KVSpec, num_tokens: int) -> DenseAt:
        """``spec.shape(num_tokens)``, contiguous, at ``ptr``."""
        shape = spec.shape(num_tokens)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return DenseAt(ptr, spec.nbytes(num_tokens), _dims(strides, spec.mla), spec.itemsize)


def _itemsize(x: torch.Tensor | DenseAt) -> int:
    return x.itemsize if isinstance(x, DenseAt) else x.element_size()


def _end(x: torch.Tensor | DenseAt) -> int:
    return x.ptr + x.nbytes if isinstance(x, DenseAt) else _byte_span(x)[1]


def _ptr(x: torch.Tensor | DenseAt) -> int:
    return x.ptr if isinstance(x, DenseAt) else x.data_ptr()


def _native_rows(pages: Pages, slots: torch.Tensor, denses: Sequence[torch.Tensor | DenseAt],
                 starts: Sequence[int], to_dense: bool, threads: int | None, *,
                 check_only: bool = False, checked: bool = False) -> None:
    """One C call per group of planes with equal strides (one group for a normal model),
    covering every chunk: chunk ``k`` (tokens ``starts[k]:starts[k + 1]``) is ``denses[k]``.

    Plane addresses are computed from strides rather than through per-plane tensor views:
    with 32 layers the views alone cost more than a small transfer.

    Every call's arguments are checked before the first one copies anything
    (``check_only``: check them, copy nothing; ``checked``: the caller has).
    """
    # Empty chunks have no rows (and maybe no memory): leave them out of the table.
    kept = [(d, a, b) for d, a, b in zip(denses, starts, starts[1:]) if b > a]
    if not kept:
        return
    if not checked:
        # (A Pages kept across calls, or caches the memo knows, too: a storage can shrink in
        # place under its tensor, and the copies go by address.)
        _check_storage(pages.tensors, pages.layout)
        if not to_dense and _shares_pages(pages.tensors):
            # Layers that share their pages (vLLM's KV sharing across layers): the planes'
            # threads would race to write the same rows. One thread writes them in layer
            # order, the last layer's values last, as per-layer copies would (the same tensor for
            # two layers came out of either, or half of each).
            threads = 1
    info, cache_spans = pages.info, pages.spans
    itemsize = _itemsize(kept[0][0])
    h, d = info.num_kv_heads, info.head_dim
    strides = [_dense_strides(x, info.mla) for x, _, _ in kept]
    token_strides = {s[2] for s in strides}
    head_strides = {s[3] for s in strides}
    if len(kept) > 1 and (len(token_strides) > 1 or (h > 1 and len(head_strides) > 1)):
        # Chunks strided unlike each other cannot share one row geometry: one call each.
        for only in (True, False) if not check_only else (True,):
            for x, a, b in kept:
                _native_rows(pages, slots[a:b], [x], [0, b - a], to_dense, threads,
                             check_only=only, checked=True)
        return
    dense_token = strides[0][2]
    dense_head = strides[0][3]
    dense_whole = h == 1 or dense_head == d
    chunk_starts = [0]
    for _, a, b in kept:
        chunk_starts.append(chunk_starts[-1] + b - a)
    slot_array = (slots if len(kept) == len(denses) else torch.cat(
        [slots[a:b] for _, a, b in kept])).contiguous().numpy()
    planes = pages.plane_table
    geometry = pages.geometry
    move = _native.gather_rows if to_dense else _native.scatter_rows

    # Per group of planes: paged bases and extents, and each plane's (layer, K/V, head). A
    # chunk's plane address is its base plus those times its strides: the table of chunks x
    # planes is one numpy broadcast, not a Python loop over both (a 16-chunk, 8-layer
    # request was 256 appends and half a millisecond before its copy started).
    Group = tuple[list[int], list[int], list[tuple[int, int, int]]]
    groups: dict[tuple[int, int, int], Group] = {}
    for index, plane_in_tensor, layer, k in planes:
        ptr, end = cache_spans[index]
        kv_offsets, block, slot, head = geometry[index]
        whole = dense_whole and (h == 1 or head == d)
        row_bytes = (h * d if whole else d) * itemsize
        group = groups.setdefault((row_bytes, block * itemsize, slot * itemsize), ([], [], []))
        paged_base = ptr + kv_offsets[plane_in_tensor] * itemsize
        for hh in range(1 if whole else h):
            p_addr = paged_base + hh * head * itemsize
            group[0].append(p_addr)
            group[1].append(end - p_addr)
            group[2].append((layer, k, hh))

    bases = np.array([_ptr(x) for x, _, _ in kept], dtype=np.int64)[:, None]
    ends = np.array([_end(x) for x, _, _ in kept], dtype=np.int64)[:, None]
    # Per chunk, the element strides of its layer, K/V and head dims (token: one for all).
    dims = np.array([(dl, dkv, dh) for dl, dkv, _, dh in strides], dtype=np.int64)
    # One group (a normal model) is checked by its own call before it copies; with several,
    # all are checked first: a later group's refusal must not come after an earlier copy
    # (a permuted layer's pages after a plain one's).
    passes = (True,) if check_only else (True, False) if len(groups) > 1 else (False,)
    for only in passes:
        for (row_bytes, block_stride, slot_stride), (paged, p_ext, which) in groups.items():
            # [chunks, planes]: chunk-major, as the C call reads them
            dense_addr = bases + itemsize * (dims @ np.array(which, dtype=np.int64).T)
            move(paged, dense_addr.reshape(-1).tolist(), slot_array, row_bytes=row_bytes,
                 num_slots=info.num_slots, paged_extents=p_ext,
                 dense_extents=(ends - dense_addr).reshape(-1).tolist(),
                 block_size=info.block_size,
                 block_stride=block_stride, slot_stride=slot_stride,
                 dense_row_stride=dense_token * itemsize, threads=threads,
                 chunk_starts=chunk_starts if len(kept) > 1 else None, check_only=only)


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


def _torch_transfer(call: _Call, dense: torch.Tensor, to_dense: bool) -> None:
    """The device path of :func:`gather` and :func:`scatter`: ``dense`` as a one-chunk request."""
    slots = call.slots if call.slots.device.type == "cpu" else call.slots.cpu()
    request = _Chunks(call.pages, slots, [dense], [0, int(slots.shape[0])])
    _device_chunks(request, to_dense, stream=None)


# -- requests of many chunks ----------------------------------------------------------------

#: The most bytes of KV the torch-ops fallback stages on the device at once.
STAGING_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Chunks(_OnPages):
    """A checked request: ``denses[k]`` holds tokens ``starts[k]:starts[k + 1]``."""

    pages: Pages
    slots: torch.Tensor  # int64 on the CPU, range-checked
    denses: list[torch.Tensor]
    starts: list[int]


def _prepare_chunks(pages: Pages, denses: object, what: str, slot_mapping: object,
                    caller_memory: bool = True) -> _Chunks:
    info = pages.info
    if isinstance(denses, torch.Tensor) or not isinstance(denses, (list, tuple)):
        raise InvalidInputError(f"{what} must be a list of chunk tensors, got "
                                f"{type(denses).__name__}")
    spec = info.spec()
    starts = [0]
    for i, dense in enumerate(denses):
        name = f"{what}[{i}]"
        starts.append(starts[-1] + spec.check_dense(dense, what=name))
        if caller_memory:  # (not the cache's own slots: see KVSpec.check_memory)
            spec.check_memory(dense, what=name)
        if dense.device != info.device and not (info.device.type != "cpu"
                                                and dense.device.type == "cpu"):
            raise DeviceError(f"{name} is on {dense.device}; the paged caches are on "
                              f"{info.device}, so chunks must be there"
                              + (" or in host memory" if info.device.type != "cpu" else ""))
        if what == "dsts" and _has_internal_overlap(dense):
            raise InvalidInputError(f"{name} has overlapping memory (strides "
                                    f"{dense.stride()}); gather cannot write into it")
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device.type != "cpu":
        # The range check reads every slot on the host: a device tensor costs one copy (and
        # a wait on its stream) here. Engines that have the slots on the host pass those.
        slot_mapping = slot_mapping.cpu()
    slots = _as_slots(slot_mapping, starts[-1], holder=f"the {len(denses)} chunks together")
    _check_slot_range(slots, info.num_slots)
    spans = pages.spans
    written: list[tuple[int, int, int]] = []
    for i, dense in enumerate(denses):
        if dense.device == info.device:
            _check_no_alias(dense, f"{what}[{i}]", spans)
        if what == "dsts" and dense.numel():
            written.append((*_byte_span(dense), i))
    written.sort()
    for (_, end, i), (start, _, j) in itertools.pairwise(written):
        if start < end:
            raise InvalidInputError(f"{what}[{i}] and {what}[{j}] overlap; each chunk needs "
                                    "its own memory")
    return _Chunks(pages, slots, list(denses), starts)


def _device_visible(dense: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can address ``dense`` directly: it is on that device,
    or in pinned host memory (mapped into the device's address space, UVA)."""
    if dense.device == device:
        return True
    return dense.device.type == "cpu" and dense.is_pinned()


def _to_device(array: np.ndarray[Any, Any], device: torch.device) -> torch.Tensor:
    """A host int64 array on ``device``: pinned first, so the copy is asynchronous."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _device_chunks(request: _Chunks, to_dense: bool, stream: Any | None) -> None:
    """Move a request on its device, enqueued on ``stream`` (the current one when None).

    No call in here waits for the device: the caller orders ``stream`` after the producer of
    its data and waits once, on an event recorded after this returns.
    """
    if request.starts[-1] == 0:
        return
    kind = _device_type(request.caches[0])
    context: AbstractContextManager[None] = nullcontext()
    if stream is not None and kind != "cpu":
        context = devices.stream_context(torch.device(kind, request.info.device.index), stream)
    with context:
        if kind != "cpu" and _piped_host_chunks(request, to_dense, stream, kind):
            return
        _kernel_or_ops(request, to_dense)


def _kernel_or_ops(request: _Chunks, to_dense: bool) -> None:
    if not _fused_transfer(request, to_dense):
        _staged_transfer(request, to_dense)


#: Bytes of chunks one window of a piped transfer stages on the device (two windows are in
#: flight, so STAGING_BYTES in all).
PIPE_WINDOW_BYTES = STAGING_BYTES // 2


def _piped_host_chunks(request: _Chunks, to_dense: bool, stream: Any | None,
                       kind: str) -> bool:
    """Device pages and chunks in host memory: the request in windows of whole chunks, each
    gathered into (or scattered from) dense device buffers on the side stream while the copy
    engine moves the window before (or after) it over the bus (``musacache.transfer.relay``).

    A kernel that reaches pinned host memory through its device address moves 42 to 46 GB/s
    on an H200 where the copy engine moves 55; gathering into device memory first costs a
    ~1.5 ms pass per GiB, which the pipeline hides behind the bus. False (nothing queued)
    for fewer than two windows; for a gather that skips tokens (a skipped token's rows must
    keep their values in the host chunk, and a window's dense copy would overwrite them);
    for a host chunk that is not contiguous (a bus copy into it would be staged by torch in
    pageable memory and wait on the host, where the kernel writes it as it is)."""
    denses = request.denses
    if len(denses) < 2 or not all(_relay.host_side(x) and x.is_contiguous() for x in denses):
        return False
    if to_dense and bool((request.slots < 0).any()):
        return False
    info = request.info
    spec = info.spec()
    starts = request.starts
    sizes = [spec.nbytes(b - a) for a, b in itertools.pairwise(starts)]
    limit = min(PIPE_WINDOW_BYTES, max(max(sizes), sum(sizes) // 2))
    windows: list[list[int]] = [[]]
    size = 0
    for k, n in enumerate(sizes):
        if windows[-1] and size + n > limit:
            windows.append([])
            size = 0
        windows[-1].append(k)
        size += n
    if len(windows) < 2:
        return False
    device = torch.device(kind, info.device.index)
    main = stream if stream is not None else devices.current_stream(device)
    depth = 2
    room = max(sum(sizes[k] for k in w) for w in windows)
    ring = _relay.buffers(room, info.device, depth)
    if ring is None:
        return False  # no room on the device for two windows: the kernel (or ops) as before
    steps: list[_relay.Step] = []
    for j, window in enumerate(windows):
        stage: list[torch.Tensor] = []
        at = 0
        for k in window:
            stage.append(ring[j % depth][at : at + sizes[k]].view(info.dtype)
                         .view(spec.shape(starts[k + 1] - starts[k])))
            at += sizes[k]
        lo, hi = starts[window[0]], starts[window[-1] + 1]
        sub = _Chunks(request.pages, request.slots[lo:hi], stage,
                      [x - lo for x in starts[window[0] : window[-1] + 2]])
        host = [denses[k] for k in window]

        def device_half(sub: _Chunks = sub) -> None:
            _kernel_or_ops(sub, to_dense)

        def bus_half(stage: list[torch.Tensor] = stage, host: list[torch.Tensor] = host,
                     ) -> None:
            for x, y in zip(host, stage):
                _relay._copy(*((x, y) if to_dense else (y, x)))

        steps.append((device_half, bus_half) if to_dense else (bus_half, device_half))
    _relay.relay(device, main, steps, first_on_main=not to_dense, depth=depth)
    return True


def _fused_transfer(request: _Chunks, to_dense: bool) -> bool:
    """One Triton launch for the whole request; False when it does not apply here."""
    info = request.info
    if not (_device_type(request.caches[0]) == "cuda" and _kernels.available()):
        return False
    if not all(_device_visible(x, info.device) for x in request.denses):
        return False
    h, d = info.num_kv_heads, info.head_dim
    if d > 1 and any(x.stride(-1) != 1 for x in [*request.caches, *request.denses]):
        return False
    geometry = request.pages.geometry
    if len({g[1:] for g in geometry}) != 1:
        return False  # layers strided unlike each other: not one kernel
    _, block, slot, head = geometry[0]
    strides = [_dense_strides(x, info.mla) for x in request.denses]
    packed = h == 1 or (head == d and all(s[3] == d for s in strides))
    row_len, head_programs = (h * d, 1) if packed else (d, h)

    num_layers = info.num_layers
    num_planes = 1 if info.mla else 2
    itemsize = info.dtype.itemsize
    page_table = np.empty((num_layers, num_planes), dtype=np.int64)
    for index, within, layer, plane in request.pages.plane_table:
        page_table[layer, plane] = (request.cache_spans[index][0]
                                    + geometry[index][0][within] * itemsize)
    chunk_table = np.array([(x.data_ptr(), *st) for x, st in zip(request.denses, strides)],
                           dtype=np.int64).reshape(-1)
    counts: np.ndarray[Any, Any] = np.diff(np.asarray(request.starts, dtype=np.int64))
    first = np.repeat(np.asarray(request.starts[:-1], dtype=np.int64), counts)
    num_tokens = request.starts[-1]
    token_chunk = np.repeat(np.arange(len(request.denses), dtype=np.int64), counts)
    token_row = np.arange(num_tokens, dtype=np.int64) - first
    # One table, one host-to-device copy, sliced on the device.
    parts = [request.slots.numpy(), token_chunk, token_row, page_table.reshape(-1), chunk_table]
    table = _to_device(np.concatenate(parts), info.device)
    bounds = np.cumsum([0, *(len(p) for p in parts)])
    views = [table[int(a):int(b)] for a, b in itertools.pairwise(bounds)]
    _kernels.launch(grid=(num_tokens, num_layers, num_planes * head_programs),
                    slots=views[0], token_chunk=views[1], token_row=views[2],
                    page_table=views[3], chunk_table=views[4], num_planes=num_planes,
                    head_programs=head_programs, row_len=row_len,
                    block_size=info.block_size, block_stride=block, slot_stride=slot,
                    page_head_stride=head, elem_bytes=itemsize, to_dense=to_dense)
    return True


def _layer_rows(request: _Chunks) -> list[list[tuple[torch.Tensor | None, int | None]]]:
    """Per layer, how it is indexed by slot: ``(rows, plane)`` items.

    A contiguous vllm layer is one ``[2, num_slots, H, D]`` view (``plane`` None), so K and V
    move in one launch; other layouts go plane by plane, with ``rows`` the plane's
    ``[num_slots, H, D]`` view, or None when blocks and offsets cannot be merged into one
    slot dim without a copy.
    """
    info = request.info
    planes = _paged_planes(request.pages)
    layers: list[list[tuple[torch.Tensor | None, int | None]]] = []
    for layer in range(info.num_layers):
        if request.pages.row.stacked:
            kv, nb, bs, h, d = request.caches[layer].shape
            try:
                layers.append([(_bits(request.caches[layer]).view(kv, nb * bs, h, d), None)])
                continue
            except RuntimeError:
                pass
        layers.append([(_slot_rows(_bits(p)), k) for k, p in enumerate(planes[layer])])
    return layers


def _staged_transfer(request: _Chunks, to_dense: bool) -> None:
    """Torch ops: per layer one ``index_select`` (or ``index_copy_``) over a window of the
    request in a bounded device staging buffer, and one copy per chunk piece of the window.

    Launches: about ``layers x windows + chunks``, never ``chunks x layers x planes``.
    """
    info = request.info
    spec = info.spec()
    device = info.device
    module = _musa_aiter() if backend_for(request.caches[0]) == "musa_aiter" else None
    token_dim = spec.token_dim
    slots = request.slots.numpy()
    valid = slots >= 0
    window = max(1, STAGING_BYTES // max(1, spec.nbytes(1)))
    layers = _layer_rows(request)
    planes = _paged_planes(request.pages)
    bits = _BITS_DTYPE[info.dtype.itemsize]
    for a in range(0, request.starts[-1], window):
        b = min(request.starts[-1], a + window)
        ok = valid[a:b]
        if not ok.any():
            continue
        every = bool(ok.all())
        pieces = [(x, max(a, lo) - lo, min(b, hi) - lo, max(a, lo) - a, min(b, hi) - a)
                  for x, lo, hi in zip(request.denses, request.starts, request.starts[1:])
                  if lo < b and hi > a]
        index = _to_device(slots[a:b][ok], device)
        tokens = None if every else _to_device(np.flatnonzero(ok), device)
        x, lo, hi, _, _ = pieces[0]
        if (module is None and len(pieces) == 1 and (lo, hi) == (0, b - a)
                and x.device == info.device and x.is_contiguous()):
            # The window is one whole contiguous chunk on the device (transfer.gather into a
            # device tensor): it is its own staging buffer.
            for layer, items in enumerate(layers):
                for rows, which in items:
                    _move_rows(rows, planes[layer], which, _bits(x)[layer], index, tokens,
                               to_dense, info)
            continue
        stage = torch.empty(spec.shape(b - a), dtype=bits, device=device)
        if not to_dense or not every:
            # A scatter reads the chunks; a gather with skipped tokens keeps their old rows.
            for x, lo, hi, s0, s1 in pieces:
                stage.narrow(token_dim, s0, s1 - s0).copy_(
                    _bits(x).narrow(token_dim, lo, hi - lo), non_blocking=True)
        if module is None or not _aiter_window(module, request, stage, slots[a:b], to_dense):
            for layer, items in enumerate(layers):
                for rows, which in items:
                    _move_rows(rows, planes[layer], which, stage[layer], index, tokens,
                               to_dense, info)
        if to_dense:
            for x, lo, hi, s0, s1 in pieces:
                _bits(x).narrow(token_dim, lo, hi - lo).copy_(
                    stage.narrow(token_dim, s0, s1 - s0), non_blocking=True)


def _move_rows(rows: torch.Tensor | None, planes: list[torch.Tensor], which: int | None,
               stage: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor | None,
               to_dense: bool, info: PagedKV) -> None:
    """One layer's rows (one plane's, or both when ``which`` is None) between the pages and
    ``stage``, the layer's slice of the staging window."""
    if which is None:
        target, dim = stage, 1  # [2, w, H, D] against [2, num_slots, H, D]
    else:
        target, dim = (stage.unsqueeze(1) if info.mla else stage[which]), 0
    if rows is None:  # blocks and offsets are not one dim: advanced indexing on the plane
        plane = _bits(planes[0 if which is None else which])
        block = torch.div(index, info.block_size, rounding_mode="floor")
        offset = index - block * info.block_size
        if to_dense:
            picked = plane[block, offset]
            if tokens is None:
                target.copy_(picked)
            else:
                target.index_copy_(0, tokens, picked)
        else:
            plane[block, offset] = target if tokens is None else target.index_select(0, tokens)
        return
    if to_dense:
        if tokens is None:
            torch.index_select(rows, dim, index, out=target)
        else:
            target.index_copy_(dim, tokens, rows.index_select(dim, index))
    else:
        rows.index_copy_(dim, index, target if tokens is None else target.index_select(
            dim, tokens))


def _aiter_window(module: Any, request: _Chunks, stage: torch.Tensor,
                  slots: np.ndarray[Any, Any], to_dense: bool) -> bool:
    """MUSA-Aiter over one staging window; False when it declines (torch ops then run)."""
    info = request.info
    call = _Call(request.pages, _to_device(slots, info.device), None)
    return _aiter_transfer(module, call, stage.view(info.dtype), to_dense)


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
    if not call.pages.row.aiter:
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


def gather(kv_caches: object, slot_mapping: object, out: torch.Tensor,
           layout: str | None = None, *, threads: int | None = None) -> None:
    """Copy the paged KV of ``slot_mapping``'s slots into ``out``.

    ``kv_caches`` is a :class:`Pages`, or raw caches in ``layout`` (then opened here, once
    per call; ``layout`` is required with raw caches).

    ``out`` is ``(L, 2, T, H, D)``, or ``(L, T, D)`` for MLA layouts, with the caches' dtype
    and device; any strides (a view with a non-contiguous last dim is staged through a
    contiguous copy). ``slot_mapping`` is a 1-D int64 tensor (or a list/ndarray of ints) of
    ``T`` slots; -1 leaves that token's rows of ``out`` unchanged. ``threads`` overrides the
    native thread count for this call.

    Raises LayoutError, ShapeError, DTypeError, DeviceError, SlotRangeError or
    InvalidInputError before anything is written; NativeError if the C code fails.
    """
    call = _prepare(_pages_arg(kv_caches, layout), out, "out", slot_mapping, threads)
    if out.numel() == 0:
        return
    backend = backend_for(call.caches[0])
    if backend == "native":
        _native_gather(call, out)
        return
    if backend == "musa_aiter":
        module = _musa_aiter()
        if module is not None and _aiter_transfer(module, _on_device(call), out, to_dense=True):
            return
    _torch_transfer(call, out, to_dense=True)


def scatter(src: torch.Tensor, kv_caches: object, slot_mapping: object,
            layout: str | None = None, *, threads: int | None = None) -> None:
    """Write the dense KV ``src`` into the paged caches at ``slot_mapping``'s slots.

    ``src`` is ``(L, 2, T, H, D)`` or ``(L, T, D)`` (MLA), any strides. Tokens whose slot is
    -1 are not written. When a slot repeats, the native backend writes the last token; on
    devices the winner is unspecified (as with ``index_copy_``).

    Raises the same errors as :func:`gather`, before anything is written.
    """
    call = _prepare(_pages_arg(kv_caches, layout), src, "src", slot_mapping, threads)
    if src.numel() == 0:
        return
    backend = backend_for(call.caches[0])
    if backend == "native":
        _native_scatter(call, src)
        return
    if backend == "musa_aiter":
        module = _musa_aiter()
        if module is not None and _aiter_transfer(module, _on_device(call), src, to_dense=False):
            return
    _torch_transfer(call, src, to_dense=False)


def gather_chunks(kv_caches: object, slots: object, dsts: Sequence[torch.Tensor],
                  layout: str | None = None, *, stream: Any | None = None) -> None:
    """Copy a whole request's paged KV into its chunk tensors, in one batch.

    ``kv_caches`` is a :class:`Pages` (or raw caches in ``layout``). ``slots`` (1-D int64,
    one per token, -1 to skip) covers the request; ``dsts`` are dense
    chunk tensors (``spec.shape(n_i)``, any strides) whose token counts sum to
    ``len(slots)``: ``dsts[0]`` takes the first ``n_0`` tokens, and so on. A skipped token's
    rows keep their values. Chunks live with the pages, or, for pages on a device, in host
    memory (pinned host memory is written by the device directly).

    How it moves: on the CPU, one native call for every chunk, layer and plane. On cuda, one
    fused Triton kernel for the whole request where Triton is importable and every chunk is
    device-visible (on the device, or pinned); otherwise torch ops through a bounded device
    staging buffer, one ``index_select`` per layer per window and one copy per chunk
    (``musa_aiter`` instead of the torch ops on MUSA, where it is installed). Device work is
    enqueued on ``stream`` (the current stream when None) and nothing here waits for it:
    record an event on ``stream`` afterwards and wait on that. Slots on the device are
    copied to the host for the range check, which waits for them: pass host slots.

    Raises LayoutError, ShapeError, DTypeError, DeviceError, SlotRangeError or
    InvalidInputError (also for chunks that overlap each other) before anything is written;
    NativeError if the C code fails.
    """
    request = _prepare_chunks(_pages_arg(kv_caches, layout), dsts, "dsts", slots)
    _move_chunks(request, to_dense=True, stream=stream)


def _gather_checked(pages: Pages, slots: torch.Tensor, dsts: Sequence[torch.Tensor | DenseAt],
                    counts: Sequence[int], *, stream: Any | None = None) -> None:
    """:func:`gather_chunks` for the engine's store, whose arguments were checked where they
    came in: ``slots`` (host int64, range-checked against ``pages`` by ``Cache.store``) and
    ``dsts``, views of distinct slots of its own pool holding ``counts`` tokens each. The
    per-chunk checks would be repeated on the request's critical path (a third of a
    millisecond for 16 chunks before the copy starts); the native call still checks every
    address range it is given. A :class:`DenseAt` (a host slot by address) goes only with
    host pages, to the native path."""
    starts = list(itertools.accumulate(counts, initial=0))
    tensors: list[torch.Tensor] = []
    for x in dsts:
        if isinstance(x, DenseAt):
            if backend_for(pages.tensors[0]) != "native":
                raise TypeError("a slot by address (DenseAt) is for host pages only")
            if starts[-1]:
                _native_rows(pages, slots, dsts, starts, True, None)
            return
        tensors.append(x)
    _move_chunks(_Chunks(pages, slots, tensors, starts), to_dense=True, stream=stream)


def scatter_chunks(srcs: Sequence[torch.Tensor], kv_caches: object, slots: object,
                   layout: str | None = None, *, stream: Any | None = None) -> None:
    """The reverse of :func:`gather_chunks`: write the chunk tensors ``srcs`` (token counts
    summing to ``len(slots)``) into the pages at ``slots``; -1 skips a token. When a slot
    repeats, the native backend writes the last token; on devices the winner is unspecified.

    Raises the same errors as :func:`gather_chunks`, before anything is written.
    """
    request = _prepare_chunks(_pages_arg(kv_caches, layout), srcs, "srcs", slots)
    _move_chunks(request, to_dense=False, stream=stream)


def _scatter_own(srcs: Sequence[torch.Tensor], pages: Pages, slots: torch.Tensor, *,
                 stream: Any | None = None) -> None:
    """:func:`scatter_chunks` of the cache's own slots (``retrieve``): every check but the
    storage's reach, which would make torch keep a Python object on a pool segment."""
    request = _prepare_chunks(pages, srcs, "srcs", slots, caller_memory=False)
    _move_chunks(request, to_dense=False, stream=stream)


def _pages_arg(kv_caches: object, layout: str | None) -> Pages:
    """The transfer functions' ``kv_caches``: a :class:`Pages`, or raw caches and a layout."""
    if layout is None and not isinstance(kv_caches, Pages):
        raise LayoutError("name the layout of raw kv_caches (one of "
                          f"{LAYOUTS}), or pass transfer.Pages")
    return as_pages(kv_caches, layout)


def _move_chunks(request: _Chunks, *, to_dense: bool, stream: Any | None) -> None:
    if request.starts[-1] == 0:
        return
    if backend_for(request.caches[0]) == "native":
        staged = [x if _unit_last_stride(x) else x.contiguous() for x in request.denses]
        _native_rows(request.pages, request.slots, staged, request.starts, to_dense, None)
        if to_dense:
            for x, work in zip(request.denses, staged):
                if work is not x:
                    x.copy_(work)
        return
    _device_chunks(request, to_dense, stream)


def set_num_threads(n: int) -> None:
    """Set how many threads a native gather/scatter uses by default (1 to 256).

    The default is ``os.cpu_count()`` capped at 8, or ``MUSACACHE_NATIVE_THREADS``.
    """
    _native.set_num_threads(n)


def get_num_threads() -> int:
    """How many threads a native gather/scatter uses by default."""
    return _native.get_num_threads()
