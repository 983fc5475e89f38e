"""The storage tiers' side of the engine: reads, write-behind, deletes, capacity, refresh.

Every write and delete of a key on a storage tier takes its place in that key's operation
chain when it is scheduled and runs after the one before it (``StoreTier.chain_link``), and
names the entry (so its generation) it is for. Reads of a queued object are served from the
queue. Every fault here is a counted miss or a counted drop, never an exception to the caller.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import torch

from musacache import _errors
from musacache._errors import CacheClosedError, MusaCacheError, TierError
from musacache._executor import Executor
from musacache._log import RateLimitedLog
from musacache.engine.directory import Entry
from musacache.engine.placement import EntryQueue, memory_only_batches, victims
from musacache.engine.tierstate import MemTier, StoreTier, Tier
from musacache.stats import CloseReport, InFlight
from musacache.tiers.base import NOT_TRIED, ChunkMeta, QuarantinedError
from musacache.tiers.listing import ChunkListing, ListingBuilder, sorted_from

if TYPE_CHECKING:
    from musacache._config import CacheConfig
    from musacache._keys import Fingerprint
    from musacache._native import ChunkCopy
    from musacache._spec import KVSpec
    from musacache.engine.directory import Directory
    from musacache.engine.move import Mover
    from musacache.engine.tasks import TaskOwner
    from musacache.engine.tee import Tee
    from musacache.tiers.memory import Slot


class EngineServices(Protocol):
    """What the cold path needs of the engine that owns it. A protocol, so that this module
    depends on nothing above it (the engine imports the cold path, never the reverse)."""

    config: CacheConfig
    spec: KVSpec
    fingerprint: Fingerprint
    dir: Directory
    tiers: list[Tier]
    stores: list[StoreTier]
    mover: Mover
    executor: Executor
    tasks: TaskOwner
    inflight: InFlight
    wt_sem: anyio.Semaphore
    flights: dict[bytes, Any]

    def pin(self, e: Entry) -> None: ...
    def unpin(self, e: Entry) -> None: ...
    def view(self, t: MemTier, e: Entry) -> torch.Tensor: ...
    def hottest_mem(self, e: Entry) -> MemTier | None: ...
    async def host_copy(self, data: torch.Tensor) -> torch.Tensor: ...
    async def relocate(self, items: Sequence[tuple[Entry, torch.Tensor]], dest_from: int,
                       dest_to: int | None = None, *, demoting: bool) -> list[Tier | None]: ...
    async def evict(self, t: MemTier, count: int) -> int: ...
    def block_view(self, slot: Slot, n: int) -> torch.Tensor: ...

__all__ = ["ColdPath"]

# Chunks encoded per batch when persisting on close (bounds the encoded bytes held at once).
_PERSIST_BATCH = 16
# Pauses (s) between the tries of a storage delete that failed: a brief fault (a 503, a reset
# connection) passes; past the last, the key is tombstoned for this process (delete_failed).
_DELETE_RETRY_PAUSES = (0.2, 1.0)
# Evictions make_room makes per turn of the loop when none reads (no demotion between them).
_TRIM_RUN = 256

# Objects that are intact but not for this cache: another model, layout or chunk size
# (FingerprintMismatchError), or another format version (ForeignFormatError). Unreadable here,
# counted as "foreign", not deleted.
_FOREIGN: tuple[type[BaseException], ...] = (_errors.FingerprintMismatchError,
                                             _errors.ForeignFormatError)
# What a tier's read_into raises for an object it cannot read (other errors are faults).
_UNREADABLE: tuple[type[BaseException], ...] = (*_FOREIGN, _errors.CorruptChunkError)

log = logging.getLogger("musacache")
_R = TypeVar("_R")


class ColdPath:
    def __init__(self, engine: EngineServices) -> None:
        # The engine holds this cold path, which holds its direct reads; each names its
        # owner by weak reference, so that a closed cache is freed by reference counting
        # alone, without waiting for a full collection to find the cycle.
        self._engine: weakref.ref[EngineServices] = weakref.ref(engine)
        self.errlog = RateLimitedLog(log)
        self.direct = DirectReads(self)
        # Top-tier slots a timed-out read may still write into: (tier, slot index, the
        # storage tier read, the slot's view), released once the read's thread returns.
        self._parked: list[tuple[MemTier, int, StoreTier, torch.Tensor]] = []
        # Storage tiers whose room is being made after a refresh learned past capacity.
        self._trimming: set[StoreTier] = set()

    @property
    def eng(self) -> EngineServices:
        eng = self._engine()
        if eng is None:  # only an object that outlived its cache's engine can see this
            raise _errors.CacheClosedError("the cache is closed")
        return eng

    # -- reads ----------------------------------------------------------------------------

    async def read(self, t: StoreTier, e: Entry, out: torch.Tensor | None = None,
                   tee: Tee | None = None) -> torch.Tensor | None:
        """``e``'s KV from ``t`` (a host tensor, decoded into ``out`` when given: no fresh
        allocation, no second copy), or None: absent, a fault, a timeout, or an object that
        cannot be read here (corrupt, another model's, another format version). Each is
        counted under its own name and is a miss, never an exception; ``out`` then holds
        garbage (a tier that reads into it may have written part of the chunk), so it must
        be a destination the caller discards on a miss. A ``tee`` is written block by block
        from the read's thread when the tier reads into ``out`` (:mod:`musacache.engine.tee`)."""
        from musacache.codec import decode_chunk

        eng = self.eng
        obj = t.pending_obj(e)
        meta = t.meta(e)
        if obj is None:
            if e.stored_size(t.idx) is None:
                return None
            if t.store.reads_into:
                # Read, verify and decode in the tier's one worker-thread call, straight into
                # the destination (a raw payload needs no buffer in between).
                dst = out if out is not None else torch.empty(
                    eng.spec.shape(e.num_tokens), dtype=eng.spec.dtype, device="cpu")
                if tee is None:
                    def read_into() -> Awaitable[int | None]:
                        return t.store.read_into(meta, eng.fingerprint, dst)
                else:
                    on_block = tee.target(dst)

                    def read_into() -> Awaitable[int | None]:
                        return t.store.read_into(meta, eng.fingerprint, dst, on_block=on_block)
                size = await self._guarded(t, e, read_into, decodes=True)
                if size is None:
                    if tee is not None:
                        # A timed-out read's thread may still complete it: the chunk may be
                        # served by another tier now, and only the move may write it then.
                        tee.close()
                    return None
                t.c.bytes_out += size
                return dst
            obj = await self._guarded(t, e, lambda: t.store.read(meta), decodes=False)
            if obj is None:
                return None
        try:
            _, data = await eng.mover.in_thread(
                lambda: decode_chunk(eng.fingerprint, obj, expect=meta, out=out))
        except MusaCacheError as exc:  # any failure to decode the bytes is a corrupt object
            self._unreadable(t, e, exc)
            return None
        t.c.bytes_out += len(obj)
        return data

    def _stored_below_host(self, e: Entry, skip: tuple[Tier, ...] = (),
                           ) -> tuple[MemTier, StoreTier] | None:
        """The host top tier and the hottest tier holding ``e`` (other than those in
        ``skip``), when that is a storage tier: None for a top tier that is not host memory
        or holds ``e``, a deleted entry, or one held nowhere but in tiers to skip."""
        eng = self.eng
        top = eng.tiers[0]
        if e.dead or not isinstance(top, MemTier) or top.device.type != "cpu":
            return None
        src = next((t for t in eng.tiers if t.holds(e) and t not in skip), None)
        return (top, src) if isinstance(src, StoreTier) else None

    async def _guarded(self, t: StoreTier, e: Entry, call: Callable[[], Awaitable[_R | None]],
                       *, decodes: bool) -> _R | None:
        """``await call()`` (a read of ``e`` from ``t``) under the tier's concurrency bound and
        timeout; None, counted, for an absent object, a fault or a timeout, and (when the call
        ``decodes``) an object that cannot be read here."""
        try:
            async with t.sem:
                with anyio.fail_after(t.store.timeout):
                    got = await call()
        except Exception as exc:  # a TimeoutError too: our deadline, or the tier's own
            self._read_failed(t, e, exc, decodes=decodes)
            return None
        if got is None:
            t.c.misses += 1
            self.forget(t, e)
        return got

    def _read_failed(self, t: StoreTier, e: Entry, exc: Exception, *, decodes: bool) -> None:
        """Count and log a read of ``e`` from ``t`` that raised ``exc`` (a miss)."""
        if isinstance(exc, TimeoutError):  # a TierTimeoutError too
            t.c.read_timeout()
            self.errlog.warn(t.name, "timeout",
                             str(exc) or f"read took over {t.store.timeout} s")
        elif decodes and isinstance(exc, _UNREADABLE):  # the object, not the tier
            self._unreadable(t, e, exc)
        elif isinstance(exc, QuarantinedError):  # an object the tier will not read again
            t.c.read_fault()
            self.errlog.warn(t.name, "quarantined", str(exc))
            _drop_object(self, t, e)
        else:  # TierError, or anything a plug-in tier lets escape
            t.c.read_fault()
            self.errlog.warn(t.name, "read fault", repr(exc))

    def _unreadable(self, t: StoreTier, e: Entry, exc: BaseException) -> None:
        """Count and log an object that cannot be read here; a corrupt one is deleted."""
        if isinstance(exc, _FOREIGN):
            # Another model's, layout's or format version's object under our key: a miss, and
            # the message names both sides. It is not ours to delete.
            t.c.foreign += 1
            t.c.misses += 1
            self.errlog.warn(t.name, "foreign chunk", f"{e.key.hex()}: {exc}")
            self.forget(t, e)
            return
        t.c.corrupt += 1
        t.c.misses += 1
        self.errlog.warn(t.name, "corrupt chunk", f"{e.key.hex()}: {exc}")
        _drop_object(self, t, e, check_shared=True)

    async def promote_decoding(self, e: Entry, tee: Tee | None = None,
                               skip: tuple[Tier, ...] = (), *, counts_hit: bool = True,
                               ) -> tuple[torch.Tensor | None, str, Tier | None]:
        """When ``e`` lives only in storage and the top tier is host memory: decode it
        straight into a top-tier slot (one decode, no fresh tensor, no second copy). Returns
        the data and the tier it came from, or None and the tier whose read missed (not to be
        asked again; None if this did not apply). ``tee`` (the caller's tensor for this
        chunk) is written by the same read, block by block. Tiers in ``skip`` (a read
        there missed already) are not asked; the read counts as a hit of its tier unless
        ``counts_hit`` is False."""
        eng = self.eng
        below = self._stored_below_host(e, skip)
        if below is None:
            return None, "", None
        top, src = below
        self._release_parked()
        idx = top.pool.reserve()
        if idx is None and await eng.evict(top, 1):
            idx = top.pool.reserve()
        if idx is None:
            return None, "", None
        committed = False
        view: torch.Tensor | None = None
        try:
            slot = await top.pool.materialize(idx)
            view = eng.block_view(slot, e.num_tokens)
            if await self.read(src, e, out=view, tee=tee) is None:
                return None, "", src
            if counts_hit:
                src.c.hits += 1
            if not e.dead and not top.holds(e):
                top.commit(e, slot)
                top.c.promotions += 1
                committed = True
                return view, src.name, None
            # Deleted (or promoted by another path) meanwhile: serve this read only.
            return view.clone(), src.name, None
        finally:
            if not committed:
                if view is not None and src.store.writing_into(view):
                    # A timed-out (or cancelled) read's thread may still write into this slot:
                    # it is not free until that thread returns (_release_parked).
                    self._parked.append((top, idx, src, view))
                else:
                    top.pool.release(idx)

    def _release_parked(self) -> None:
        """Give back the slots whose abandoned reads have returned."""
        if not self._parked:
            return
        keep = []
        for top, idx, src, view in self._parked:
            if src.store.writing_into(view):
                keep.append((top, idx, src, view))
            else:
                top.pool.release(idx)
        self._parked = keep

    def forget(self, t: StoreTier, e: Entry) -> None:
        """``t`` no longer holds ``e``; an entry held nowhere leaves the directory."""
        t.drop(e)
        if not e.resident and not e.dead:
            self.eng.dir.remove(e)

    # -- writes ----------------------------------------------------------------------------

    async def encode(self, t: StoreTier, items: Sequence[tuple[Entry, torch.Tensor]],
                     ) -> list[bytes]:
        """Encode every item for ``t`` in one worker-thread hop and one codec call, the chunks
        spread over ``copy_threads`` (host data only)."""
        from musacache.codec import encode_chunks

        eng = self.eng
        batch = [(ChunkMeta(e.key, e.parent, e.num_tokens, e.raw_bytes), d) for e, d in items]
        out: list[bytes] = await eng.mover.in_thread(
            lambda: encode_chunks(eng.fingerprint, batch, t.store.codec,
                                  threads=eng.config.copy_threads, executor=eng.executor))
        return out

    async def place(self, t: StoreTier, e: Entry, obj: bytes) -> bool:
        """Queue ``obj`` for ``t`` (capacity made first, then room in the queue). False if
        ``t`` cannot take it: too big, full of pinned chunks, or shed by a failing tier. An
        entry no longer in the directory (deleted, or of one a clear swapped out and takes
        apart meanwhile) is not written: True, nothing to do. Written, such an entry's object
        could land after that of the same key put again since, and be served as its KV."""
        if self._stale(e):
            return True
        size = len(obj)
        if t.capacity is not None and (size > t.capacity or not await self.make_room(t, size)):
            t.c.write_drops += 1
            return False
        with t.reserve(e, obj):  # the room made above, held through the wait for the queue
            if not await t.admit(size):
                return False
            if t.holds(e) or self._stale(e):
                return True  # written by another task while we waited, or gone: nothing to do
            if not self.eng.tasks.running_group():
                raise CacheClosedError("the cache closed while a write waited for room")
            t.enqueue(e, obj)
        before, mine = t.chain_link(e.key)
        self.eng.tasks.spawn(self._write_job, t, e, obj, before, mine)
        return True

    def _stale(self, e: Entry) -> bool:
        return e.dead or self.eng.dir.get(e.key) is not e

    async def _write_job(self, t: StoreTier, e: Entry, obj: bytes, before: anyio.Event | None,
                         mine: anyio.Event) -> None:
        eng = self.eng
        eng.inflight.writes += 1
        ok = False
        try:
            if before is not None:
                await before.wait()
            async with t.sem:
                await t.store.write(t.meta(e), obj)
            ok = True
            t.last_write_failed = False
            t.c.writes += 1
            t.c.bytes_in += len(obj)
        except Exception as exc:  # retries are the tier's; after them, drop and count
            t.last_write_failed = True
            t.c.write_drops += 1
            self.errlog.warn(t.name, "write dropped", repr(exc))
        finally:
            eng.inflight.writes -= 1
            t.dequeue(e, obj)
            t.chain_done(e.key, mine)
            if ok and not e.dead:
                t.commit_stored(e, len(obj))
            else:
                # Not stored, or stored for an entry deleted meanwhile: its delete was
                # chained after this write when it was deleted.
                t.used -= len(obj)
                if not e.resident and not e.dead:
                    eng.dir.remove(e)

    def schedule_delete(self, t: StoreTier, key: bytes) -> None:
        """Delete ``key`` on ``t`` after every operation on it scheduled so far; once the
        cache is closing, noted for the next open instead (``engine.notes``)."""
        if not self.eng.tasks.running_group():
            t.cut_deletes.append(key)
            return
        before, mine = t.chain_link(key)
        t.delete_started(key)
        self.eng.tasks.spawn(self._delete_job, t, key, before, mine)

    async def _delete_job(self, t: StoreTier, key: bytes, before: anyio.Event | None,
                          mine: anyio.Event) -> None:
        ran = False
        try:
            if before is not None:
                await before.wait()
            for pause in (*_DELETE_RETRY_PAUSES, None):
                try:
                    with anyio.fail_after(t.store.timeout):
                        await t.store.delete(key)
                    t.c.deletes += 1
                    break
                except Exception as exc:
                    t.c.faults += 1
                    self.errlog.warn(t.name, "delete fault", repr(exc))
                    if pause is None:
                        t.delete_failed(key)
                    else:
                        await anyio.sleep(pause)
            ran = True
        finally:
            if not ran:  # cut short by the close: noted for the next open
                t.cut_deletes.append(key)
            t.delete_done(key)
            t.chain_done(key, mine)

    async def make_room(self, t: StoreTier, size: int) -> bool:
        """Evict from a bounded storage tier (leaves first, demoting below) until ``size``
        more bytes fit (``size`` 0: until it is within its capacity); False if only pinned or
        queued chunks are left."""
        eng = self.eng
        cap = t.capacity if t.capacity is not None else 0
        evicted = 0
        while t.used + size > cap:
            if evicted and not evicted % _TRIM_RUN:
                # Many evictions without a demotion's read between them (a restart with a
                # smaller capacity, say): the loop is let go between runs of them.
                await anyio.lowlevel.checkpoint()
            evicted += 1
            found = victims(t, eng.dir, 1)
            if not found:
                return False
            e = found[0]
            eng.pin(e)
            try:
                if e.stored_size(t.idx) is not None \
                        and not any(x.holds(e) for x in eng.tiers[t.idx + 1:]) \
                        and t.idx + 1 < len(eng.tiers):
                    data = await self.read(t, e)
                    if data is not None and not e.dead:
                        await eng.relocate([(e, data)], t.idx + 1, demoting=True)
            finally:
                eng.unpin(e)
            if t.drop(e):
                t.c.evictions += 1
                self.schedule_delete(t, e.key)
                if not e.resident and not e.dead:
                    eng.dir.remove(e)
        return True

    def write_through(self, e: Entry) -> None:
        for t in self.eng.stores:
            if t.store.write_through and not t.holds(e):
                self.eng.tasks.spawn(self._write_through, t, e)

    async def _write_through(self, t: StoreTier, e: Entry) -> None:
        eng = self.eng
        async with eng.wt_sem:
            if e.dead or t.holds(e):
                return
            mt = eng.hottest_mem(e)
            if mt is None:
                return
            eng.pin(e)
            try:
                host = await eng.host_copy(eng.view(mt, e))
                obj, = await self.encode(t, [(e, host)])
            finally:
                eng.unpin(e)
            await self.place(t, e, obj)

    async def persist(self, progress: CloseReport, batch: int) -> None:
        """Write chunks held only in memory down to the first storage tier, parents first,
        so the chain a restarted cache rebuilds is whole. ``progress`` counts as it goes.

        What to write is found first, ``batch`` entries of the directory per loop turn, and
        queued where the cyclic collector does not walk it (``EntryQueue``); it is all counted
        in ``to_persist`` before the first write, so a close cut short by its deadline still
        reports what it left."""
        eng = self.eng
        if not eng.stores:
            return
        first = eng.stores[0]
        todo = EntryQueue()
        for part in memory_only_batches(eng.dir, eng.stores, batch):
            todo.extend(part)
            progress.to_persist += len(part)
            await anyio.lowlevel.checkpoint()
        try:
            while todo:
                batch_ = [(e, mt) for e in todo.take(_PERSIST_BATCH)
                          if not e.dead and (mt := eng.hottest_mem(e)) is not None]
                for e, _ in batch_:
                    eng.pin(e)
                try:
                    where = await eng.relocate([(e, eng.view(mt, e)) for e, mt in batch_],
                                               first.idx, first.idx + 1, demoting=True)
                finally:
                    for e, _ in batch_:
                        eng.unpin(e)
                progress.persisted += sum(w is not None for w in where)
        finally:
            # Cut short by close_timeout: what is left (a million references) is let go of a
            # block per loop turn, not in one step.
            with anyio.CancelScope(shield=True):
                while todo.drop_block():
                    await anyio.lowlevel.checkpoint()

    # -- what storage already holds ----------------------------------------------------------

    async def refresh(self, parent: bytes) -> bool:
        """Ask shared storage tiers for chunks under ``parent`` that other nodes wrote.

        Follows the chain down while it finds more, each parent at most once per
        ``refresh_interval``, all within the tier's timeout. True if anything was learned.
        """
        eng = self.eng
        learned = False
        for st in eng.stores:
            if not st.store.shared:
                continue
            cur: bytes | None = parent
            with anyio.move_on_after(st.store.timeout):
                while cur is not None:
                    if st.asked_recently(cur, eng.config.refresh_interval):
                        break
                    listed_at = time.monotonic()
                    try:
                        metas = await st.store.refresh(cur)
                    except Exception as exc:
                        st.c.faults += 1
                        self.errlog.warn(st.name, "refresh", repr(exc))
                        break
                    st.c.refreshes += 1
                    new = self.learn(st, metas, listed_at)
                    learned = learned or bool(new)
                    # Keep walking down a single new child: that is a longer cached prefix.
                    cur = new[0].key if len(new) == 1 else None
            if st.capacity is not None and st.used > st.capacity \
                    and st not in self._trimming and eng.tasks.running_group():
                # Learned past its capacity: room is made after this request, as at open
                # (oldest leaves first, so what was just learned is the last to go).
                self._trimming.add(st)
                eng.tasks.spawn_soon(self._trim, st)
        return learned

    async def _trim(self, st: StoreTier) -> None:
        try:
            await self.make_room(st, 0)
        finally:
            self._trimming.discard(st)

    async def learn_all(self, st: StoreTier, listing: ChunkListing | Sequence[ChunkMeta],
                        batch: int) -> None:
        """Learn a whole listing (a restart): ``batch`` chunks at a time, with the loop free
        in between. A list of ``ChunkMeta`` is read into compact form ``batch`` objects per
        loop turn and emptied as it is read; building and sorting the compact form run in a
        worker thread: no step on the loop touches, makes or frees more than ``batch`` rows
        of it."""
        n = len(listing)
        make: Callable[[], ChunkListing]  # sorted into new arrays (in a worker thread)
        if isinstance(listing, ChunkListing):
            make = partial(sorted_from, listing) if listing.given else listing.oldest_first
        elif isinstance(listing, list):
            make = partial(sorted_from, await self._take_list(listing, batch), backwards=True)
        else:  # not ours to empty: converted in one go, dropped whenever the tier drops it
            make = partial(sorted_from, listing)
        if n > batch:
            compact = await self.eng.mover.in_thread(make)
        else:
            compact = make()  # a batch or less: no thread hop for it
        for i in range(0, len(compact), batch):
            self._learn_rows(st, compact.rows(i, i + batch))
            await anyio.lowlevel.checkpoint()

    @staticmethod
    async def _take_list(metas: list[ChunkMeta], batch: int) -> ListingBuilder:
        """A tier's list of ``ChunkMeta`` as rows in flat buffers, last row first, emptying
        the list from its end ``batch`` objects per loop turn: the objects are freed a batch
        at a time (when the tier kept no other reference to them), never all in the one
        step that drops the list (about 60 ms for a million)."""
        rows = ListingBuilder()
        while metas:
            for m in reversed(metas[-batch:]):
                rows.add(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes,
                         m.last_used)
            del metas[-batch:]
            await anyio.lowlevel.checkpoint()
        return rows

    def learn(self, st: StoreTier, metas: Iterable[ChunkMeta],
              listed_at: float | None = None, ordered: bool = False) -> list[Entry]:
        """Record chunks a storage tier reports (in a listing taken at ``listed_at``; oldest
        first if ``ordered``); returns the entries that were new to it. A chunk deleted since
        is not learned."""
        rows = ((m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes)
                for m in (metas if ordered else sorted(metas, key=lambda m: m.last_used))
                if listed_at is None or not st.tombstoned(m.key, listed_at))
        return self._learn_rows(st, rows)

    def _learn_rows(self, st: StoreTier,
                    rows: Iterable[tuple[bytes, bytes, int, int, int]]) -> list[Entry]:
        """Learn ``(key, parent, num_tokens, raw_bytes, stored_bytes)`` rows, in order."""
        eng = self.eng
        new: list[Entry] = []
        for key, parent, num_tokens, raw_bytes, stored_bytes in rows:
            if raw_bytes != eng.spec.nbytes(num_tokens) or not (
                    0 < num_tokens <= eng.config.chunk_size):
                continue  # not a chunk of this spec: never serve it
            e = eng.dir.get(key)
            if e is None:
                e = Entry(key, parent, num_tokens, raw_bytes, None)
                eng.dir.add(e)
            if not st.holds(e):
                e.set_stored(st.idx, stored_bytes)
                st.used += stored_bytes
                st.lru[key] = e
                new.append(e)
        return new


class DirectReads:
    """Reads of chunks straight into a get's own tensor (its tee), with no top-tier slot in
    between: one at a time (:meth:`read_to_tee`), or all those of a request that one tier
    holds as one batch of its (:meth:`read_to_tees`). Kept apart from :class:`ColdPath`,
    whose counting and guards it uses, so that each class stays small."""

    def __init__(self, cold: ColdPath) -> None:
        self._cold = weakref.ref(cold)  # see ColdPath.__init__

    @property
    def cold(self) -> ColdPath:
        cold = self._cold()
        if cold is None:
            raise _errors.CacheClosedError("the cache is closed")
        return cold

    async def read_to_tee(self, e: Entry, tee: Tee) -> tuple[bool, StoreTier | None]:
        """Read ``e`` straight into ``tee`` (a get's own tensor, no top-tier slot in between)
        where that applies: the top tier is host memory and does not hold ``e``, no
        promotion of ``e`` is in flight (the caller joins it), ``e`` lives in a storage tier
        that reads into runs (:attr:`StorageTier.reads_to`, the disk tier) with no write of
        it queued, and ``tee`` is a native copy target. Returns whether every byte was
        written (all of them verified; none once the get closes its tee), and the tier read
        (None: this did not apply). A read that missed is counted, as :meth:`read` counts
        it; its tier is not to be asked again."""
        eng = self.cold.eng
        copy = tee.native
        src = self.direct_source(e, tee)
        if copy is None or src is None:
            return False, None
        meta = src.meta(e)

        def read_to() -> Awaitable[int | None]:
            return src.store.read_to(meta, eng.fingerprint, copy)

        size = await self.cold._guarded(src, e, read_to, decodes=True)
        return size is not None and self._served(src, copy, size), src

    @staticmethod
    def _served(src: StoreTier, copy: ChunkCopy, size: int) -> bool:
        """Count a direct read of ``size`` bytes from ``src`` that returned; whether it wrote
        every byte of ``copy`` (all verified), and so is a hit."""
        src.c.bytes_out += size
        complete = copy.written == copy.nbytes
        if complete:
            src.c.hits += 1
        return complete

    def direct_source(self, e: Entry, tee: Tee) -> StoreTier | None:
        """The storage tier :meth:`read_to_tee` would read ``e`` from into ``tee``, or None
        where that does not apply (see there)."""
        if tee.native is None or e.key in self.cold.eng.flights:
            return None
        below = self.cold._stored_below_host(e)
        if below is None:
            return None
        src = below[1]
        if not src.store.reads_to or src.pending_obj(e) is not None \
                or e.stored_size(src.idx) is None:
            return None
        return src

    async def read_to_tees(self, src: StoreTier, items: Sequence[tuple[Entry, Tee]],
                           ) -> list[bool | None]:
        """:meth:`read_to_tee` for each of ``items`` (whose :meth:`direct_source` is
        ``src``, a tier that :attr:`~StorageTier.reads_to_many`) as one batch of the tier's
        (one slot of its concurrency bound; the tier bounds the batch by its own timeout).
        Per item: True if every byte was written, False for a read that missed (counted; the
        tier is not to be asked again), None for one the batch never started."""
        eng = self.cold.eng
        batch: list[tuple[Entry, ChunkCopy]] = []
        for e, tee in items:
            copy = tee.native
            if copy is None:  # direct_source said otherwise
                raise AssertionError("a tee without a native copy in a batch read")
            batch.append((e, copy))
        # The tier bounds each read of a batch by its timeout; this bound, one timeout per
        # chunk and one more, only stops a plug-in tier that would hang the get.
        limit = src.store.timeout * (len(batch) + 1)
        try:
            async with src.sem:
                with anyio.fail_after(limit):
                    got = await src.store.read_to_many(
                        [(src.meta(e), copy) for e, copy in batch], eng.fingerprint)
            if len(got) != len(batch):
                raise TierError(f"tier {src.name!r}: read_to_many answered {len(got)} items "
                                f"for {len(batch)}")
        except TimeoutError:
            # A chunk whose every byte was written (and so verified) is served all the same:
            # only the others are lost with the batch.
            done = [copy.written == copy.nbytes for _e, copy in batch]
            for ok in done:
                if ok:
                    src.c.hits += 1
                else:
                    src.c.read_timeout()
            self.cold.errlog.warn(src.name, "timeout", f"a batch of reads took over {limit} s")
            return list(done)
        except Exception as exc:  # the whole batch failed: every item a fault
            for e, _copy in batch:
                self.cold._read_failed(src, e, exc, decodes=False)
            return [False] * len(batch)
        served: list[bool | None] = []
        for (e, copy), size in zip(batch, got, strict=True):
            if size is NOT_TRIED:
                served.append(None)
            elif isinstance(size, Exception):
                self.cold._read_failed(src, e, size, decodes=True)
                served.append(False)
            elif size is None:
                src.c.misses += 1
                self.cold.forget(src, e)
                served.append(False)
            elif not isinstance(size, int):  # a plug-in tier's answer that is none of these
                self.cold._read_failed(src, e, TierError(
                    f"tier {src.name!r}: read_to_many answered {size!r}"), decodes=False)
                served.append(False)
            else:
                served.append(self._served(src, copy, size))
        return served


def _drop_object(cold: ColdPath, t: StoreTier, e: Entry, *, check_shared: bool = False) -> None:
    """Forget ``e`` in ``t`` and delete its object there (forgotten and left in place, an
    object escapes a later delete or clear, and comes back at the next restart). With
    ``check_shared``, an object on a shared tier is deleted only if a second read finds it
    unreadable too."""
    was_current = not e.dead
    meta = t.meta(e)
    cold.forget(t, e)
    if not was_current:  # a dead entry may be reading a newer entry's object: keep it
        return
    if check_shared and t.store.shared:
        # Over a network a body damaged on its way (a proxy's error page, a cut connection)
        # is not a damaged object, and the object is every node's: read it once more first
        # (one bad pass deleted a bucket's good chunks).
        cold.eng.tasks.spawn(_delete_if_still_corrupt, cold, t, meta)
    else:
        cold.schedule_delete(t, e.key)


async def _delete_if_still_corrupt(cold: ColdPath, t: StoreTier, meta: ChunkMeta) -> None:
    """Delete the object of ``meta`` on the shared tier ``t`` if a second read finds it
    unreadable too (see ``ColdPath._unreadable``)."""
    from musacache.codec import decode_chunk

    eng = cold.eng
    try:
        async with t.sem:
            with anyio.fail_after(t.store.timeout):
                obj = await t.store.read(meta)
        if obj is None:
            return  # gone already
        await eng.mover.in_thread(lambda: decode_chunk(eng.fingerprint, obj, expect=meta))
        return  # intact: the first read was damaged on its way
    except _FOREIGN:
        return  # another model's object under the key: not ours to delete
    except _errors.CorruptChunkError:
        pass  # damaged in the store: delete it (below)
    except Exception:  # a fault or a timeout: not ours to judge
        return
    if eng.dir.get(meta.key) is None:  # (a newer put of the key writes over it itself)
        cold.schedule_delete(t, meta.key)
