"""The slot pool behind the memory tiers (device and host).

Memory is handed out in fixed *slots* of one full chunk each, carved from *segments* that are
allocated only when a slot in them is first needed. So:

* start-up allocates nothing, whatever the capacity;
* a freed slot is reused without another allocation or page fault (put/get run at copy speed
  once warm);
* ``bytes_allocated <= capacity_bytes`` always: segments are never larger than what capacity
  has left, and slots are never handed out past ``capacity_bytes // slot_bytes``.

A partial tail chunk takes a whole slot. Tails are one per conversation, and a fixed slot size
keeps the pool free of fragmentation.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import anyio
import numpy as np
import torch

from .. import devices
from .._errors import CacheClosedError
from .._executor import Executor

__all__ = ["MemoryPool", "Slot"]


class Slot:
    """One slot: ``index`` in its pool. Holds no tensor: a view of its bytes is made when
    asked for, so a million cached chunks are not a million torch views (about 600 bytes
    each)."""

    __slots__ = ("index", "pool")

    def __init__(self, index: int, pool: MemoryPool) -> None:
        self.index = index
        self.pool = pool

    @property
    def buf(self) -> torch.Tensor:
        """The slot's bytes, as a uint8 tensor."""
        return self.pool.slot_bytes_view(self.index, self.pool.slot_bytes)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.pool.view(self.index, dtype, shape)

    def __repr__(self) -> str:
        return f"Slot({self.index})"


class MemoryPool:
    """Fixed-size slots on one device, grown lazily in segments."""

    def __init__(self, *, capacity_bytes: int, slot_bytes: int, device: torch.device,
                 pinned: bool, segment_bytes: int, executor: Executor | None = None) -> None:
        #: Where allocations and frees that take long run: the cache's threads.
        self.executor = executor if executor is not None else Executor("musacache-pool")
        self.device = device
        self.pinned = pinned
        self.slot_bytes = slot_bytes
        self.capacity_bytes = capacity_bytes
        self.max_slots = capacity_bytes // slot_bytes if slot_bytes else 0
        self.slots_per_segment = max(1, segment_bytes // slot_bytes) if slot_bytes else 1
        self._segments: dict[int, torch.Tensor] = {}
        #: Each host segment's base address, as an int: a resident read copies between
        #: addresses without making a tensor view per slot.
        self.seg_addr: dict[int, int] = {}
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # Released slot numbers, a stack in one flat buffer: a list held an int object per
        # slot, and after a clear of a million chunks dropping it took 36 to 88 ms of loop
        # in one step (freeing the last few thousand of them alone, 57 ms). A table reserved
        # up front (as SlotLRU's links) made a delete of 200,000 chunks slower per step
        # (3.7 against 6.4 to 11 ms of loop CPU); this grows as the list did.
        self._free = array("q")
        self._next = 0  # slots [0, _next) have been handed out at least once
        self._in_use = 0
        self._grow_lock = anyio.Lock()
        self._cleared = False  # by aclear_memory, at the cache's close: it never grows again

    # -- accounting (synchronous, so check-and-reserve can never interleave) --------------

    @property
    def slots_in_use(self) -> int:
        return self._in_use

    @property
    def bytes_used(self) -> int:
        return self._in_use * self.slot_bytes

    @property
    def bytes_allocated(self) -> int:
        return sum(int(t.numel()) for t in self._segments.values())

    def reserve(self) -> int | None:
        """Reserve a slot index, or None if the pool is full. Never awaits."""
        if self._free:
            idx = self._free.pop()
        elif self._next < self.max_slots:
            idx = self._next
            self._next += 1
        else:
            return None
        self._in_use += 1
        return idx

    @property
    def free_slots(self) -> int:
        return self.max_slots - self._in_use

    def release(self, index: int) -> None:
        if self._cleared:  # a slot handed out before the close: nothing is left to return
            return
        self._in_use -= 1
        self._free.append(index)

    # -- memory ---------------------------------------------------------------------------

    async def materialize(self, index: int) -> Slot:
        """The memory of a reserved slot, allocating its segment on first use."""
        slot = self.ready(index)
        if slot is None:
            await self.ensure_segment(index // self.slots_per_segment)
            slot = Slot(index, self)
        return slot

    def ready(self, index: int) -> Slot | None:
        """The slot of reserved ``index`` if its segment is allocated (no await), else None:
        then :meth:`materialize` allocates it."""
        return Slot(index, self) if index // self.slots_per_segment in self._segments else None

    def _typed_segment(self, seg_no: int, dtype: torch.dtype) -> torch.Tensor:
        """Segment ``seg_no`` as a ``dtype`` tensor: made once per segment and dtype, not
        once per slot."""
        typed = self._typed.get((seg_no, dtype))
        if typed is None:
            typed = self._segments[seg_no].view(dtype)
            self._typed[(seg_no, dtype)] = typed
        return typed

    def view(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot ``index`` (materialized) as a ``dtype`` tensor of ``shape``."""
        n = 1
        for s in shape:
            n *= s
        seg_no, off = divmod(index, self.slots_per_segment)
        start = off * self.slot_bytes // dtype.itemsize  # an attribute: no 0-d tensor
        return self._typed_segment(seg_no, dtype)[start : start + n].view(shape)

    def address(self, index: int) -> int:
        """Where slot ``index`` (materialized) begins."""
        seg_no, off = divmod(index, self.slots_per_segment)
        return self.seg_addr[seg_no] + off * self.slot_bytes

    def addresses(self, indices: np.ndarray) -> np.ndarray:
        """:meth:`address` of every slot in ``indices`` (int64, all materialized), worked
        out for all of them at once (a long read's copy by address, ``_resident``)."""
        seg, off = np.divmod(indices, self.slots_per_segment)
        bases = np.zeros(int(seg.max()) + 1 if seg.size else 0, dtype=np.int64)
        for s, addr in self.seg_addr.items():
            if s < bases.size:
                bases[s] = addr
        if not bool((bases[seg] > 0).all()):
            raise AssertionError("a materialized slot in a segment that is not allocated")
        return bases[seg] + off * self.slot_bytes

    def views(self, indices: Sequence[int], dtype: torch.dtype,
              shape: tuple[int, ...]) -> list[torch.Tensor]:
        """:meth:`view` of each slot in ``indices`` (all materialized), in their order.

        A run of consecutive indices within one segment (rising or falling: the free list
        hands back a deleted prompt's slots in reverse) is one view of the run, split by
        ``unbind``: about 0.9 us a slot instead of 4.8 for a slice and a view each, which a
        256-chunk store would otherwise spend on the loop before its copy starts."""
        out: list[torch.Tensor] = []
        per = self.slot_bytes // dtype.itemsize
        if per * dtype.itemsize != self.slot_bytes:  # slots not aligned to dtype: one by one
            return [self.view(i, dtype, shape) for i in indices]
        n = 1
        for s in shape:
            n *= s
        sps = self.slots_per_segment
        i, count = 0, len(indices)
        while i < count:
            first = indices[i]
            seg_no = first // sps
            step = 0
            if i + 1 < count and abs(indices[i + 1] - first) == 1:
                step = indices[i + 1] - first
            j = i + 1
            if step:
                while (j < count and indices[j] - indices[j - 1] == step
                       and indices[j] // sps == seg_no):
                    j += 1
            if j - i == 1:
                out.append(self.view(first, dtype, shape))
                i = j
                continue
            low = min(first, indices[j - 1])
            start = (low - seg_no * sps) * per
            typed = self._typed_segment(seg_no, dtype)
            run = typed[start : start + (j - i) * per].view(j - i, per)[:, :n]
            parts = run.unflatten(1, shape).unbind(0)
            out.extend(parts if step > 0 else reversed(parts))
            i = j
        return out

    def slot_bytes_view(self, index: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``index`` (materialized) as a uint8 tensor."""
        seg_no, off = divmod(index, self.slots_per_segment)
        start = off * self.slot_bytes
        return self._segments[seg_no][start : start + nbytes]

    async def ensure_segment(self, seg_no: int) -> torch.Tensor:
        async with self._grow_lock:
            self._check_not_cleared()  # an operation that outlived the cache's close
            seg = self._segments.get(seg_no)
            if seg is None:
                seg = await self._allocate_segment(seg_no)
                self._check_not_cleared()  # closed while it was allocated
                self._segments[seg_no] = seg
                self.seg_addr[seg_no] = seg.data_ptr()
            return seg

    def _check_not_cleared(self) -> None:
        if self._cleared:
            raise CacheClosedError("the cache closed: its memory is released")

    def segment_to_grow(self) -> int | None:
        """The next segment worth allocating ahead of need: the one after the highest slot
        handed out so far, once that slot is past the middle of its own segment. Growing it
        in the background keeps allocation (and pinning, about 2 GB/s) off the request path."""
        if self._next == 0:
            return None  # start-up allocates nothing
        seg_no, off = divmod(self._next - 1, self.slots_per_segment)
        nxt = seg_no + 1
        if off * 2 + 1 < self.slots_per_segment or nxt * self.slots_per_segment >= self.max_slots:
            return None
        return None if nxt in self._segments else nxt

    async def prealloc(self, nbytes: int) -> None:
        """Allocate (and pin) segments covering ``nbytes`` now."""
        seg_bytes = self.slots_per_segment * self.slot_bytes
        count = min(-(-nbytes // seg_bytes) if seg_bytes else 0,
                    -(-self.max_slots // self.slots_per_segment))
        for seg_no in range(count):
            await self.ensure_segment(seg_no)

    async def _allocate_segment(self, seg_no: int) -> torch.Tensor:
        first = seg_no * self.slots_per_segment
        nslots = min(self.slots_per_segment, self.max_slots - first)
        nbytes = nslots * self.slot_bytes
        if self.device.type == "cpu":
            if self.pinned:
                # Pinning walks every page: seconds for large segments. Keep it off the loop.
                return await self.executor.run(lambda: devices.alloc_host(nbytes, pinned=True))
            return devices.alloc_host(nbytes, pinned=False)
        return await self.executor.run(
            lambda: torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    async def aclear_memory(self) -> None:
        """Drop every segment (the cache's close); the pool never grows again, and a slot
        handed out before is not taken back.

        The segments are dropped in a worker thread, one at a time: freeing a segment gives
        its pages back to the OS (17 ms of CPU for 256 MiB), and torch lets go of the GIL
        while it frees a tensor's storage, so the loop runs on meanwhile.
        """
        self._cleared = True
        segments = list(self._segments.values())
        self._segments.clear()
        self.seg_addr.clear()
        self._typed.clear()  # views: they share the segments' storage, which frees nothing
        self._free = array("q")
        self._next = 0
        self._in_use = 0

        def drop() -> None:
            while segments:
                segments.pop()

        await self.executor.run(drop)
