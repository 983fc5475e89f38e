"""A second destination for a chunk read from storage: the get's tensor, written from the
read's own worker thread block by block, while each verified block is still in the CPU cache.

A get that promotes a chunk from disk reads it into a top-tier slot; without a tee it then
copies the whole slot into the get's tensor in a second pass after every chunk is read.
With a tee, the codec hands each block to :meth:`Tee.put` right after the block's checksum
passed, and the tee copies it on into the get's view of the chunk. The later copy of the
get skips a chunk whose tee is :attr:`complete`. A caller's ``out`` is never a tee's
destination: a read can fail after some of its blocks were written, and ``out`` past the hit
must be left as it was, so a get into ``out`` tees into a stage of its own (``cache._read_into``).

Where the destination's elements lie in runs of at least :data:`MIN_RUN_BYTES` contiguous bytes
(any tensor whose innermost dimension is contiguous: a slice of a dense ``out``, a permuted
HuggingFace cache), the tee hands the codec a native :class:`~musacache._native.ChunkCopy`
(:meth:`Tee.target`): the chunk's decode then writes the caller's runs itself, a 32 KiB strip
at a time, right after it unshuffled that strip into the slot, so those bytes are never read
back from memory. Other destinations get the block-by-block Python copy (:meth:`Tee.put`).

A tee is closed (:meth:`close`) when its get ends, whatever the outcome: a read that timed
out and was abandoned to its thread, or a promotion that outlives a cancelled get, then stops
writing into the caller's memory. The Python copy of one block and the close share a lock,
and the native copy checks a flag under a handshake (``mc_tee_close``), so once ``close``
returns no byte is written into the destination any more (it waits at most for one block's,
or one strip's, copy).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import torch

from musacache._native import ChunkCopy

__all__ = ["MIN_RUN_BYTES", "Tee", "fill_flat"]

#: The shortest contiguous run of the destination the native copy takes; shorter runs (an
#: innermost dimension that is not contiguous) go through the Python copy.
MIN_RUN_BYTES = 64
# Up to this many runs, their addresses are worked out with plain ints, else with numpy.
_FEW_RUNS = 256


class Tee:
    """Copies verified byte ranges of a contiguous source chunk into ``dst``, a CPU tensor of
    the same dtype and element count, in ``dst``'s logical (row-major) element order."""

    def __init__(self, dst: torch.Tensor) -> None:
        self.dst = dst
        self.nbytes = dst.numel() * dst.element_size()
        self._itemsize = dst.element_size()
        self._written = 0
        self._closed = False
        self._lock = threading.Lock()
        self._copy = _native_copy(dst)
        # Only where no native copy applies, the Python copy writes through a numpy view: its
        # copies are plain memcpy per contiguous run and release the GIL, where a torch copy
        # would start its own intra-op threads inside each reader thread. (Made here, on the
        # loop, only when needed: a tee is made for each chunk a get reads from disk.)
        self._dst = _as_numpy(dst) if self._copy is None else None

    @property
    def native(self) -> ChunkCopy | None:
        """``dst`` as a native copy target (its runs of contiguous bytes), or None where
        only the Python copy can write it: what a read straight into ``dst`` writes through
        (:meth:`~musacache.engine.storage.DirectReads.read_to_tee`)."""
        return self._copy

    def target(self, src: torch.Tensor) -> Callable[[int, int], None]:
        """What the codec's read of ``src`` (the contiguous chunk it fills) reports to: a
        callable of ``(start, end)`` that runs :meth:`put`, carrying the native copy into
        ``dst`` (``native_copy``, None without one) for a codec that writes it itself."""
        return _Sink(self, src)

    def put(self, src: torch.Tensor, start: int, end: int) -> None:
        """Copy bytes ``[start, end)`` of ``src`` (the contiguous chunk the read fills,
        verified up to ``end``) to the same elements of ``dst``. Called from the read's
        worker thread; does nothing once the tee is closed."""
        size = self._itemsize
        flat = _as_numpy(src).reshape(-1)
        with self._lock:
            if self._closed:
                return
            if self._copy is not None:
                self._copy.copy(flat[start // size : end // size], start)
                return
            assert self._dst is not None  # made whenever there is no native copy
            fill_flat(self._dst, flat[start // size : end // size], start // size)
            self._written += end - start

    @property
    def complete(self) -> bool:
        """Every byte of ``dst`` was written by verified blocks (a read that failed part-way,
        or a tier that does not tee, leaves it False: the caller copies the chunk itself)."""
        with self._lock:
            if self._closed:
                return False
            written = self._written if self._copy is None else self._copy.written
            return written == self.nbytes

    def close(self) -> None:
        """Write nothing into ``dst`` from now on. Waits at most for one block's copy."""
        with self._lock:
            self._closed = True
            if self._copy is not None:
                self._copy.close()


class _Sink:
    """:meth:`Tee.put` for one source, with the tee's native copy beside it."""

    __slots__ = ("_src", "_tee", "native_copy")

    def __init__(self, tee: Tee, src: torch.Tensor) -> None:
        self._tee = tee
        self._src = src
        self.native_copy = tee._copy

    def __call__(self, start: int, end: int) -> None:
        self._tee.put(self._src, start, end)


def _native_copy(dst: torch.Tensor) -> ChunkCopy | None:
    """``dst`` as a native copy target (its runs of contiguous bytes in row-major order), or
    None when its runs are shorter than :data:`MIN_RUN_BYTES` or it overlaps itself."""
    layout = _run_layout(tuple(dst.shape), dst.stride(), dst.element_size())
    if layout is None:
        return None
    offsets, run_bytes = layout
    return ChunkCopy(offsets + np.uint64(dst.data_ptr()), run_bytes)


@functools.lru_cache(maxsize=64)
def _run_layout(shape: tuple[int, ...], strides: tuple[int, ...], size: int,
                ) -> tuple[np.ndarray, int] | None:
    """Where the runs of a tensor of this shape, strides and element size start, in bytes
    from its first element (uint64, row-major order), and their length; None as
    :func:`_native_copy` says. Memoised: a get's tees are views of one ``out``, all alike
    but for their address, and working the runs out again cost each a few µs on the loop."""
    dims = [(n, st) for n, st in zip(shape, strides, strict=True) if n != 1]
    run = 1  # elements per contiguous run: merge the innermost dimensions while they abut
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if run * size < MIN_RUN_BYTES or any(st <= 0 for _n, st in dims):
        return None
    count = 1
    for n, _st in dims:
        count *= n
    if count <= _FEW_RUNS:
        # A slice of a dense tensor has a few dozen runs: plain ints beat numpy's per-call
        # cost here.
        starts = [0]
        for n, st in dims:
            step = st * size
            starts = [a + k * step for a in starts for k in range(n)]
        ordered = sorted(starts)
        if any(b - a < run * size for a, b in pairwise(ordered)):
            return None  # runs that overlap (an expanded view): the Python copy's business
        offsets = np.array(starts, dtype=np.uint64)
    else:
        wide = np.zeros(1, dtype=np.int64)
        for n, st in dims:
            wide = (wide[:, None] + np.arange(n, dtype=np.int64) * (st * size)).reshape(-1)
        if int(np.diff(np.sort(wide)).min()) < run * size:
            return None
        offsets = wide.astype(np.uint64)
    offsets.flags.writeable = False  # shared by every tee of this layout
    return offsets, run * size


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
