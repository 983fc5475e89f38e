"""A second destination for a chunk read from storage: the caller's tensor, written from the
read's own worker thread block by block, while each verified block is still in the CPU cache.

A get that promotes a chunk from disk reads it into a top-tier slot; without a tee it then
copies the whole slot into the caller's ``out`` in a second pass after every chunk is read.
With a tee, the codec hands each block to :meth:`Tee.put` right after the block's checksum
passed, and the tee copies it on into the caller's view of the chunk. The later copy of the
get skips a chunk whose tee is :attr:`complete`.

A tee is closed (:meth:`close`) when its get ends, whatever the outcome: a read that timed
out and was abandoned to its thread, or a promotion that outlives a cancelled get, then stops
writing into the caller's memory. The copy of one block and the close share a lock, so once
``close`` returns no byte is written into the destination any more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ._directory import Match

__all__ = ["Tee", "fill_flat", "make_tees"]


class Tee:
    """Copies verified byte ranges of a contiguous source chunk into ``dst``, a CPU tensor of
    the same dtype and element count, in ``dst``'s logical (row-major) element order."""

    def __init__(self, dst: torch.Tensor) -> None:
        self.dst = dst
        self.nbytes = dst.numel() * dst.element_size()
        self._itemsize = dst.element_size()
        # numpy views: their copies are plain memcpy per contiguous run and release the GIL,
        # where a torch copy would start its own intra-op threads inside each reader thread.
        self._dst = _as_numpy(dst)
        self._written = 0
        self._closed = False
        self._lock = threading.Lock()

    def put(self, src: torch.Tensor, start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of ``src`` (the contiguous chunk the read fills,
        verified up to ``end``) to the same elements of ``dst``. Called from the read's
        worker thread; does nothing once the tee is closed."""
        size = self._itemsize
        flat = _as_numpy(src).reshape(-1)
        with self._lock:
            if self._closed:
                return
            fill_flat(self._dst, flat[start // size : end // size], start // size)
            self._written += end - start

    @property
    def complete(self) -> bool:
        """Every byte of ``dst`` was written by verified blocks (a read that failed part-way,
        or a tier that does not tee, leaves it False: the caller copies the chunk itself)."""
        with self._lock:
            return not self._closed and self._written == self.nbytes

    def close(self) -> None:
        """Write nothing into ``dst`` from now on. Waits at most for one block's copy."""
        with self._lock:
            self._closed = True


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s elements as same-sized integers (numpy has no bfloat16)."""
    return t.detach().view(_INT_OF_SIZE[t.element_size()]).numpy()


def fill_flat(dst: np.ndarray, src: np.ndarray, first: int) -> None:
    """Write the 1-D ``src`` into the elements ``[first, first + src.size)`` of ``dst``
    counted in row-major order, for any strides of ``dst``: whole rows in one copy each
    dimension down, partial rows at either end by recursion."""
    n = src.size
    if n == 0:
        return
    if dst.ndim <= 1 or dst.flags.c_contiguous:
        dst.reshape(-1)[first : first + n] = src
        return
    inner = 1
    for s in dst.shape[1:]:
        inner *= s
    row, off = divmod(first, inner)
    pos = 0
    if off:
        k = min(inner - off, n)
        fill_flat(dst[row], src[:k], off)
        pos, row = k, row + 1
    whole = (n - pos) // inner
    if whole:
        np.copyto(dst[row : row + whole],
                  src[pos : pos + whole * inner].reshape(whole, *dst.shape[1:]))
        pos, row = pos + whole * inner, row + whole
    if pos < n:
        fill_flat(dst[row], src[pos:], 0)


def make_tees(matches: Sequence[Match], dest: Callable[[Match], torch.Tensor | None] | None,
              ) -> list[Tee | None]:
    """A tee per match for ``dest(match)`` where it can be written from a read's thread (a
    CPU tensor), None elsewhere; an empty list without ``dest``."""
    if dest is None:
        return []
    tees: list[Tee | None] = []
    for m in matches:
        d = dest(m)
        tees.append(Tee(d) if d is not None and d.device.type == "cpu" else None)
    return tees
