"""A ``get`` of chunks held by a host top tier, copied by slot address: one native copy for
the whole request, no torch view per chunk.

The general read path (``Engine.sources``, then ``Mover.copy``) makes a view of every chunk's
slot and of every part of ``out`` it writes, and copies them pair by pair with ``copy_`` in
worker threads. For a long prompt that is most of the get: at 16,384 chunks of a tiny spec
the views and pairs were about 12 µs a chunk of the loop's time (the get took 22 µs a
chunk), each pair a few tracked objects for the collector, and the copy threads' Python
loops took turns at the GIL with the loop.

Here each chunk's slot is an address (its segment's base plus its offset:
``MemoryPool.addresses``), and ``out`` is described once by its strides. One
:func:`~musacache._native.scatter_rows` call (the chunks' slots as the dense side, ``out``'s
token rows as the paged side, a slot per token) copies every plane of every chunk, with the
bounds of both sides checked in Python first. Only the leading chunks the top tier holds go
this way (usually all of them); the caller reads the rest by the general path.

Each chunk is pinned in the same step in which its slot is read, and stays pinned until the
copy ends: eviction or a delete may detach the slot meanwhile, but its memory is kept until
the last unpin, so the address stays good.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import anyio
import numpy as np
import torch

from musacache import _native
from musacache._spec import KVSpec, may_overlap, storage_short
from musacache.engine import core as _core
from musacache.engine import move as _move
from musacache.engine.reads import VIEW_RUN
from musacache.engine.tierstate import MemTier
from musacache.transfer import DenseAt, Pages, _native_rows, backend_for

if TYPE_CHECKING:
    from musacache.engine.core import Engine
    from musacache.engine.directory import Entry, Match

__all__ = ["MIN_CHUNKS", "OutRows", "Resident", "out_rows", "read_resident", "release",
           "retrieve_resident"]

#: Fewer chunks than this take the general path: a short request gains nothing from the
#: arrays built here.
MIN_CHUNKS = 2


class OutRows(NamedTuple):
    """``out`` as planes of token rows, and where a slot keeps the same rows."""

    planes: np.ndarray      # int64: each plane's first row, in bytes from out's first element
    row_bytes: int          # contiguous bytes of one token in one plane
    token_stride: int       # bytes from one token's row to the next in out
    slot_coef: np.ndarray   # int64: a slot of E tokens has plane p at coef[p] * E + head[p]
    slot_head: np.ndarray   # int64
    slot_row: int           # bytes from one token's row to the next in a slot
    end: int                # the byte past out's last element, from its first


def out_rows(spec: KVSpec, out: torch.Tensor) -> OutRows | None:
    """``out`` (checked by the get: shape, dtype, memory) as rows the native copy writes, or
    None where it cannot: not host memory, rows that are not contiguous, elements that may
    overlap each other, a storage that does not reach its last element."""
    if out.device.type != "cpu" or out.numel() == 0 or may_overlap(out) \
            or storage_short(out) is not None:
        return None
    it = spec.itemsize
    if spec.mla:
        layers, _t, d = out.shape
        s_layer, s_tok, s_d = out.stride()
        if d > 1 and s_d != 1:
            return None
        planes = [layer * s_layer for layer in range(layers)]
        coef = [layer * d * it for layer in range(layers)]
        head = [0] * layers
        row = slot_row = d * it
    else:
        layers, _k, _t, h, d = out.shape
        s_layer, s_kv, s_tok, s_head, s_d = out.stride()
        if d > 1 and s_d != 1:
            return None
        slot_row = h * d * it
        whole = h == 1 or s_head == d
        heads = 1 if whole else h
        row = slot_row if whole else d * it
        planes, coef, head = [], [], []
        for layer in range(layers):
            for kv in range(2):
                for hh in range(heads):
                    planes.append(layer * s_layer + kv * s_kv + hh * s_head)
                    coef.append((layer * 2 + kv) * slot_row)
                    head.append(hh * d * it)
    token_stride = s_tok * it
    if out.shape[spec.token_dim] > 1 and token_stride < row:
        return None
    last = sum((n - 1) * st for n, st in zip(out.shape, out.stride(), strict=True))
    return OutRows(np.array(planes, dtype=np.int64) * it, row, token_stride,
                   np.array(coef, dtype=np.int64), np.array(head, dtype=np.int64), slot_row,
                   (last + 1) * it)


class Resident:
    """The leading chunks of a get that its host top tier holds, pinned, with their slots."""

    def __init__(self, matches: Sequence[Match]) -> None:
        self.entries: list[Entry] = []
        # Typed arrays, not lists: numpy takes them without a conversion per element.
        self.index = array("q")   # each chunk's slot
        self.stored = array("q")  # the tokens in it
        self.served = array("q")  # the tokens of it the get reads (a prefix of them)
        self._matches = matches

    @property
    def count(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        """Tokens the chunks cover (from token 0, as every match does)."""
        if not self.index:
            return 0
        last = self._matches[len(self.index) - 1]
        return last.start + last.num_tokens

    def addresses(self, top: MemTier) -> np.ndarray:
        """Each chunk's slot address in ``top``'s pool (int64)."""
        return top.pool.addresses(np.frombuffer(self.index, dtype=np.int64))

    def copy_args(self, eng: Engine, top: MemTier, out: torch.Tensor,
                  rows: OutRows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                          np.ndarray, np.ndarray, int]:
        """The native copy's arguments: ``out``'s plane addresses and extents, each chunk's
        plane addresses and extents (chunk-major), the slot (token row of ``out``) of every
        token, the chunk boundaries and ``out``'s token count."""
        addr = self.addresses(top)
        stored = np.frombuffer(self.stored, dtype=np.int64)
        served = np.frombuffer(self.served, dtype=np.int64)
        dense = addr[:, None] + rows.slot_coef[None, :] * stored[:, None] + rows.slot_head
        slot_end = addr + stored * eng.spec.nbytes(1)
        base = out.data_ptr()
        starts = np.zeros(served.size + 1, dtype=np.int64)
        np.cumsum(served, out=starts[1:])
        return (base + rows.planes, rows.end - rows.planes, dense.reshape(-1),
                (slot_end[:, None] - dense).reshape(-1), starts,
                np.arange(self.tokens, dtype=np.int64), int(out.shape[eng.spec.token_dim]))


def _host_top(eng: Engine) -> MemTier | None:
    top = eng.tiers[0]
    return top if isinstance(top, MemTier) and _core._host_memory(top.pool) else None


async def _pin_leading(eng: Engine, top: MemTier, matches: Sequence[Match]) -> Resident | None:
    """Pin the leading chunks of ``matches`` that ``top`` holds, each in the step that reads
    its slot, a run per turn of the loop; None (nothing pinned) for fewer than
    :data:`MIN_CHUNKS`. The caller lets go of them with :func:`release`."""
    held = top.idx
    res = Resident(matches)
    try:
        for i, m in enumerate(matches):
            if i and not i % VIEW_RUN:
                await anyio.lowlevel.checkpoint()
            e = m.entry
            slot = e.slot_index(held)
            if slot is None or e.dead:
                break
            eng.pin(e)
            res.entries.append(e)
            res.index.append(slot)
            res.stored.append(e.num_tokens)
            res.served.append(m.num_tokens)
        if res.count < MIN_CHUNKS:
            await release(eng, res, served=False)
            return None
    except BaseException:
        await release(eng, res, served=False)  # (idempotent: its pins are let go of once)
        raise
    top.c.hits += res.count
    return res


async def read_resident(eng: Engine, matches: Sequence[Match],
                        out: torch.Tensor) -> Resident | None:
    """Pin the leading chunks of ``matches`` the host top tier holds and copy them into
    ``out`` (see the module docstring). Returns them (still pinned: :func:`release` lets
    go of them once the caller has read the rest), or None where this does not apply: no
    host top tier, an ``out`` the copy cannot write (on a device, or see :func:`out_rows`),
    or fewer than :data:`MIN_CHUNKS` of them held."""
    top = _host_top(eng)
    if top is None or len(matches) < MIN_CHUNKS \
            or matches[0].entry.slot_index(top.idx) is None \
            or _move.accelerator_of((out,)) is not None:
        return None  # (the first chunk not on top: a get from below, no arrays worked out)
    rows = out_rows(eng.spec, out)
    if rows is None:
        return None
    res = await _pin_leading(eng, top, matches)
    if res is None:
        return None
    try:
        paged, paged_ext, dense, dense_ext, starts, slots, num_slots = res.copy_args(
            eng, top, out, rows)

        def copy(_stream: object) -> None:
            _native.scatter_rows(paged, dense, slots, row_bytes=rows.row_bytes,
                                 num_slots=num_slots, paged_extents=paged_ext,
                                 dense_extents=dense_ext, block_size=1,
                                 block_stride=rows.token_stride,
                                 dense_row_stride=rows.slot_row, chunk_starts=starts)

        await eng.mover.run(copy, device=None, nbytes=eng.spec.nbytes(res.tokens))
    except BaseException:
        await release(eng, res, served=False)
        raise
    return res


async def retrieve_resident(eng: Engine, matches: Sequence[Match], slots: torch.Tensor,
                            pages: Pages, skip_prefix: int) -> tuple[Resident, int] | None:
    """``retrieve``'s leading chunks that the host top tier holds, written into host
    ``pages`` at ``slots`` (from ``skip_prefix`` on) with the slots given by address
    (:class:`~musacache.transfer.DenseAt`, as ``store`` reads them): no view per chunk.
    Returns them (pinned, as :func:`read_resident` does) and the tokens written, or None
    where this does not apply (pages on a device, no host top tier, fewer than
    :data:`MIN_CHUNKS` held). ``matches`` each end past ``skip_prefix``."""
    top = _host_top(eng)
    if top is None or len(matches) < MIN_CHUNKS or backend_for(pages.tensors[0]) != "native":
        return None
    res = await _pin_leading(eng, top, matches)
    if res is None:
        return None
    try:
        spec = eng.spec
        addr = res.addresses(top).tolist()
        shapes: dict[int, DenseAt] = {}
        denses: list[DenseAt] = []
        starts = [0]
        first = max(matches[0].start, skip_prefix)
        for i in range(res.count):
            m, stored = matches[i], res.stored[i]
            at = shapes.get(stored)
            if at is None:
                at = shapes[stored] = DenseAt.of(0, spec, stored)
            skip = (max(m.start, skip_prefix) - m.start) * at.strides[2] * at.itemsize
            denses.append(DenseAt(addr[i] + skip, at.nbytes - skip, at.strides, at.itemsize))
            starts.append(starts[-1] + m.start + m.num_tokens - max(m.start, skip_prefix))
        run = slots[first : first + starts[-1]]

        def copy(_stream: object) -> None:
            _native_rows(pages, run, denses, starts, False, None)

        await eng.mover.run(copy, device=None, nbytes=spec.nbytes(starts[-1]))
    except BaseException:
        await release(eng, res, served=False)
        raise
    return res, starts[-1]


async def release(eng: Engine, res: Resident, *, served: bool = True) -> None:
    """Touch the chunks of ``res`` (when ``served``: children first, parents last, as the
    general path does) and let go of their pins, a run per turn of the loop. Every pin is
    let go of, once, even when cancelled meanwhile."""
    entries, res.entries = res.entries, []
    await eng.let_go(entries, touch=served)
