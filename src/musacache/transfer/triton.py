"""The fused paged-KV kernel (Triton): a whole request in one launch, all layers and planes.

One program moves one row (``H * D`` elements when the heads are packed, else ``D``) of one
token, one layer and one K/V plane: the grid is ``(tokens, layers, planes x head rows)``.
Addresses come from int64 tables, cast to pointers inside the kernel, so that

- the layers' pages need no stacking (each layer's plane base is one table entry), and
- each chunk of the request lands in its own tensor, which may be pinned host memory reached
  through its device-visible (UVA) address: no device staging of the whole prompt, and the
  copy engine is not needed at all (the SMs' loads and stores cross the bus).

Triton ships with CUDA builds of torch; where it is missing, :func:`available` is False and
``transfer`` uses torch ops. ``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors, which
is how it is tested without a GPU.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

__all__ = ["COLUMNS", "CHUNK_FIELDS", "available", "launch"]

#: Entries per chunk in the chunk table: base address, then the element strides of its
#: layer, K/V plane, token and head dims.
CHUNK_FIELDS = 5
#: Elements one program moves per step of its row loop (a power of two).
COLUMNS = 1024


@functools.lru_cache(maxsize=1)
def _compiled() -> Any | None:
    try:
        triton = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")
    except Exception:  # not installed, or built against another torch: use torch ops
        return None
    return _define(triton, tl)


def available() -> bool:
    """Whether the Triton kernel can be launched here."""
    return _compiled() is not None


def _define(triton: Any, tl: Any) -> Any:
    # The kernel is defined inside a function so that importing this module never needs
    # Triton; the decorator only parses the source.
    @triton.jit
    def paged_rows(slots, token_chunk, token_row, page_table, chunk_table,
                   num_planes, head_programs, row_len,
                   block_size, block_stride, slot_stride, page_head_stride,
                   ELEM_BYTES: tl.constexpr, COLS: tl.constexpr, TO_DENSE: tl.constexpr):
        token = tl.program_id(0)
        layer = tl.program_id(1)
        plane_head = tl.program_id(2)
        plane = plane_head // head_programs
        head = plane_head % head_programs
        slot = tl.load(slots + token)
        if slot >= 0:  # -1: skip the token, its dense rows keep their values
            chunk = tl.load(token_chunk + token)
            row = tl.load(token_row + token)
            page_base = tl.load(page_table + layer * num_planes + plane)
            entry = chunk_table + chunk * 5
            dense_base = tl.load(entry)
            dense_off = (layer * tl.load(entry + 1) + plane * tl.load(entry + 2)
                         + row * tl.load(entry + 3) + head * tl.load(entry + 4))
            page_off = ((slot // block_size) * block_stride + (slot % block_size) * slot_stride
                        + head * page_head_stride)
            # Bits are moved, not values: fp8 and NaN payloads pass unchanged.
            if ELEM_BYTES == 1:
                kind = tl.int8
            elif ELEM_BYTES == 2:
                kind = tl.int16
            elif ELEM_BYTES == 4:
                kind = tl.int32
            else:
                kind = tl.int64
            page = page_base.to(tl.pointer_type(kind)) + page_off
            dense = dense_base.to(tl.pointer_type(kind)) + dense_off
            for start in range(0, row_len, COLS):
                cols = start + tl.arange(0, COLS)
                mask = cols < row_len
                if TO_DENSE:
                    tl.store(dense + cols, tl.load(page + cols, mask=mask), mask=mask)
                else:
                    tl.store(page + cols, tl.load(dense + cols, mask=mask), mask=mask)

    return paged_rows


def launch(*, grid: tuple[int, int, int], slots: Any, token_chunk: Any, token_row: Any,
           page_table: Any, chunk_table: Any, num_planes: int, head_programs: int,
           row_len: int, block_size: int, block_stride: int, slot_stride: int,
           page_head_stride: int, elem_bytes: int, to_dense: bool) -> None:
    """Launch the kernel once on the current stream (strides in elements, tables int64)."""
    kernel = _compiled()
    if kernel is None:
        raise RuntimeError("triton is not importable")  # callers check available() first
    cols = min(COLUMNS, 1 << max(0, (row_len - 1).bit_length()))
    kernel[grid](slots, token_chunk, token_row, page_table, chunk_table,
                 num_planes, head_programs, row_len,
                 block_size, block_stride, slot_stride, page_head_stride,
                 ELEM_BYTES=elem_bytes, COLS=cols, TO_DENSE=to_dense)
