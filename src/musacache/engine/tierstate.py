"""Per-tier state: what one tier holds, its LRU, its slots or write queue, and its counters.

Every method here is synchronous bookkeeping (it never awaits), except the few marked async
that wait on the tier itself (a storage tier's queue, its per-key operation chain). The engine
decides *what* to do; these objects keep each tier's state consistent while it is done.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import torch

from musacache import devices
from musacache._config import DeviceTier, HostTier
from musacache._errors import ConfigError
from musacache._executor import Executor
from musacache.engine.directory import Entry
from musacache.engine.lru import KeyLRU, SlotLRU
from musacache.stats import MemoryTierStats, StorageTierStats, as_dict
from musacache.tiers.base import ChunkMeta, StorageTier
from musacache.tiers.memory import MemoryPool, Slot

__all__ = ["MemTier", "StoreTier", "Tier", "holds"]

# Parents remembered per storage tier as "asked recently" (refresh on a miss). Older ones are
# also dropped once ``refresh_interval`` has passed, as they would be asked again anyway.
REFRESH_MEMORY = 4096


class MemTier:
    """A memory tier (device or host): slots in a pool, and an LRU of the chunks in them."""

    kind = "memory"

    def __init__(self, idx: int, cfg: HostTier | DeviceTier, slot_bytes: int,
                 executor: Executor | None = None) -> None:
        self.idx = idx
        self.name = cfg.name
        prealloc = 0
        if isinstance(cfg, HostTier):
            self.device = torch.device("cpu")
            pinned = devices.has_accelerator() if cfg.pinned == "auto" else bool(cfg.pinned)
            if pinned and not devices.has_accelerator():
                raise ConfigError(f"{cfg.name}: pinned=True needs a cuda or musa device; "
                                  "use pinned='auto'")
            prealloc = int(cfg.prealloc)
        else:
            self.device = devices.resolve(cfg.device)
            pinned = False
        self.pool = MemoryPool(capacity_bytes=int(cfg.capacity_bytes), slot_bytes=slot_bytes,
                               device=self.device, pinned=pinned,
                               segment_bytes=int(cfg.segment_bytes), executor=executor)
        self.prealloc_bytes = prealloc
        self.growing: set[int] = set()  # segments being allocated ahead of need
        self.capacity_bytes = int(cfg.capacity_bytes)
        self.lru = SlotLRU(self.pool.max_slots)
        self.c = MemoryTierStats()

    def holds(self, e: Entry) -> bool:
        return e.slot_index(self.idx) is not None

    def touch(self, e: Entry) -> None:
        index = e.slot_index(self.idx)
        if index is not None:
            self.lru.touch(index)

    async def grow(self, seg: int) -> None:
        """Allocate segment ``seg`` ahead of need (a background task)."""
        try:
            await self.pool.ensure_segment(seg)
        finally:
            self.growing.discard(seg)

    def commit(self, e: Entry, slot: Slot) -> None:
        """``e``'s bytes are in ``slot``: from now on this tier serves it."""
        e.set_slot(self.idx, slot.index)
        self.lru.add(slot.index, e)
        self.c.bytes_in += e.raw_bytes

    def detach(self, e: Entry) -> None:
        """Forget ``e`` here. Its slot is freed now, or by the last reader's unpin."""
        index = e.pop_slot(self.idx)
        if index is not None:
            self.lru.remove(index, e)
            e.detach_slot(self.idx, index)

    def evict(self, entries: list[Entry]) -> int:
        """:meth:`detach` for each of ``entries``, and the slot of one that no reader holds
        freed at once (no detach and re-take). Returns how many were held here."""
        idx, lru, pool = self.idx, self.lru, self.pool
        n = 0
        for e in entries:
            index = e.pop_slot(idx)
            if index is None:
                continue
            n += 1
            lru.remove(index, e)
            if e.pins:
                e.detach_slot(idx, index)  # freed by the last reader's unpin
            else:
                pool.release(index)
        return n

    def stats(self) -> dict[str, Any]:
        return {"kind": "device" if self.device.type != "cpu" or self.name == "device" else "host",
                "device": str(self.device), "pinned": self.pool.pinned, **as_dict(self.c),
                "bytes_used": self.pool.bytes_used, "bytes_allocated": self.pool.bytes_allocated,
                "capacity_bytes": self.capacity_bytes, "chunks": len(self.lru),
                "slot_bytes": self.pool.slot_bytes}


class StoreTier:
    """A storage tier: the objects it holds, its write-behind queue, and its key chains.

    Operations on one key (writes and deletes) run in the order they were scheduled, each
    after the previous one finished: a delete of an old generation of a chunk can then never
    remove a newer one written after it.
    """

    kind = "storage"

    def __init__(self, idx: int, store: StorageTier, queue_bytes: int) -> None:
        self.idx = idx
        self.store = store
        self.name = store.name
        self.capacity: int | None = store.capacity_bytes
        self.used = 0
        self.lru = KeyLRU()
        # Objects waiting to be written, readable meanwhile; by (key, generation).
        self.pending: OrderedDict[tuple[bytes, int], tuple[bytes, float]] = OrderedDict()
        self.pending_bytes = 0
        self.queue_bytes = queue_bytes
        self.drained = anyio.Event()
        self.sem = anyio.Semaphore(max(1, int(store.max_concurrency)))
        self.refreshed: OrderedDict[bytes | None, float] = OrderedDict()
        self._chains: dict[bytes, anyio.Event] = {}
        # Keys with a delete queued or running, and when recent deletes finished: a listing
        # (refresh) that saw the object before its delete must not bring it back.
        self.deleting: dict[bytes, int] = {}
        self.deleted: OrderedDict[bytes, float] = OrderedDict()
        # Keys whose delete failed for good (the object may still be there): no listing
        # brings them back while this process runs, until a new object is written under
        # the key (a delete refused by the store was learned again at
        # the next miss, and served).
        self.undeleted: OrderedDict[bytes, None] = OrderedDict()
        self.last_write_failed = False
        # Keys whose delete a close cut short (or refused once the close had begun): noted
        # for the next open (engine.notes), never run on the loop then.
        self.cut_deletes: list[bytes] = []
        # Whether the tier keeps a delete note of this cache not yet done with.
        self.notes_held = False
        self.c = StorageTierStats()

    def holds(self, e: Entry) -> bool:
        return e.stored_size(self.idx) is not None or e.is_pending(self.idx)

    def touch(self, e: Entry) -> None:
        if e.key in self.lru:
            self.lru.move_to_end(e.key)

    def pending_obj(self, e: Entry) -> bytes | None:
        got = self.pending.get((e.key, e.gen))
        return got[0] if got is not None else None

    def meta(self, e: Entry) -> ChunkMeta:
        return ChunkMeta(e.key, e.parent, e.num_tokens, e.raw_bytes, e.stored_size(self.idx) or 0)

    # -- per-key ordering ---------------------------------------------------------------------

    def chain_link(self, key: bytes) -> tuple[anyio.Event | None, anyio.Event]:
        """Take the next place in ``key``'s operation chain, synchronously (so the order is
        the order of scheduling): the event to wait for, and the one to set when done."""
        before = self._chains.get(key)
        mine = anyio.Event()
        self._chains[key] = mine
        return before, mine

    def last_link(self, key: bytes) -> anyio.Event | None:
        """The event of the last operation scheduled on ``key`` (None: none is running)."""
        return self._chains.get(key)

    def chain_done(self, key: bytes, mine: anyio.Event) -> None:
        mine.set()
        if self._chains.get(key) is mine:
            del self._chains[key]

    def delete_started(self, key: bytes) -> None:
        self.deleting[key] = self.deleting.get(key, 0) + 1

    def delete_done(self, key: bytes) -> None:
        left = self.deleting.pop(key, 1) - 1
        if left:
            self.deleting[key] = left
        self.deleted[key] = time.monotonic()
        self.deleted.move_to_end(key)
        while len(self.deleted) > REFRESH_MEMORY:
            self.deleted.popitem(last=False)

    def tombstoned(self, key: bytes, listed_at: float) -> bool:
        """Whether a listing taken at ``listed_at`` may still show ``key`` after its delete."""
        return (key in self.deleting or key in self.undeleted
                or self.deleted.get(key, float("-inf")) >= listed_at)

    def delete_failed(self, key: bytes) -> None:
        self.undeleted[key] = None
        self.undeleted.move_to_end(key)
        while len(self.undeleted) > REFRESH_MEMORY:
            self.undeleted.popitem(last=False)

    # -- the write queue ----------------------------------------------------------------------

    def failing(self) -> bool:
        """The last write failed, or the oldest queued write has waited past the tier's
        timeout: the tier is not keeping up, so a full queue sheds instead of waiting."""
        if self.last_write_failed:
            return True
        if not self.pending:
            return False
        oldest = next(iter(self.pending.values()))[1]
        return time.monotonic() - oldest > float(self.store.timeout)

    async def admit(self, size: int) -> bool:
        """Wait for room in the queue for ``size`` bytes (backpressure). False: shed it,
        because the queue is full and the tier is failing. The wait is bounded by the tier's
        timeout: a hung tier turns into a failing one, and puts go on at memory speed."""
        while self.pending_bytes and self.pending_bytes + size > self.queue_bytes:
            if self.failing():
                self.c.write_sheds += 1
                return False
            oldest = next(iter(self.pending.values()))[1]
            left = max(0.001, oldest + float(self.store.timeout) - time.monotonic())
            if self.drained.is_set():
                self.drained = anyio.Event()
            with anyio.move_on_after(left):
                await self.drained.wait()
        return True

    @contextmanager
    def reserve(self, e: Entry, obj: bytes) -> Iterator[None]:
        """Count ``obj``'s bytes in ``used`` from now on, in the step its room was made:
        writes that wait for the queue meanwhile would otherwise all count the same free
        bytes, and together go over the capacity. Given back on leaving, unless ``obj``
        was queued for ``e`` (:meth:`enqueue`) within."""
        self.used += len(obj)
        try:
            yield
        finally:
            queued = self.pending.get((e.key, e.gen))
            if queued is None or queued[0] is not obj:
                self.used -= len(obj)

    def enqueue(self, e: Entry, obj: bytes) -> None:
        """Queue ``obj`` for ``e``, within :meth:`reserve`, which counted its bytes."""
        self.pending[(e.key, e.gen)] = (obj, time.monotonic())
        self.pending_bytes += len(obj)
        e.set_pending(self.idx, True)

    def dequeue(self, e: Entry, obj: bytes) -> None:
        self.pending.pop((e.key, e.gen), None)
        self.pending_bytes -= len(obj)
        e.set_pending(self.idx, False)
        self.drained.set()

    def commit_stored(self, e: Entry, size: int, coldest: bool = True) -> None:
        self.undeleted.pop(e.key, None)  # a new object under the key replaced the old one
        e.set_stored(self.idx, size)
        self.lru[e.key] = e
        if coldest:
            self.lru.move_to_end(e.key, last=False)  # demoted data is the coldest here

    def drop(self, e: Entry) -> bool:
        """Forget ``e``'s object here (the caller deletes it). True if it was stored."""
        size = e.pop_stored(self.idx)
        if size is None:
            return False
        self.used -= size
        if self.lru.get(e.key) is e:  # (not a newer entry's of the same key)
            self.lru.pop(e.key)
        return True

    # -- refresh bookkeeping ------------------------------------------------------------------

    def asked_recently(self, parent: bytes | None, interval: float) -> bool:
        now = time.monotonic()
        last = self.refreshed.get(parent)
        if last is not None and now - last < interval:
            return True
        self.refreshed[parent] = now
        self.refreshed.move_to_end(parent)
        # Bounded: an LRU of at most REFRESH_MEMORY parents, and none older than the interval.
        while self.refreshed:
            first, t = next(iter(self.refreshed.items()))
            if len(self.refreshed) > REFRESH_MEMORY or (now - t >= interval and first != parent):
                self.refreshed.popitem(last=False)
            else:
                break
        return False

    def stats(self) -> dict[str, Any]:
        return {"kind": self.store.kind, **as_dict(self.c), "bytes_used": self.used,
                "capacity_bytes": self.capacity, "chunks": len(self.lru),
                "pending_writes": len(self.pending), "pending_bytes": self.pending_bytes,
                "codec": self.store.codec, "write_through": self.store.write_through,
                **{f"store_{k}": v for k, v in self.store.stats().items()}}


Tier = MemTier | StoreTier


def holds(t: Tier, e: Entry) -> bool:
    return t.holds(e)
