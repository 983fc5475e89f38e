"""The engine behind :class:`~musacache.Cache`: plan, move, commit.

Every request runs in three steps:

1. **plan**, synchronously on the loop: match keys, pin what is read, reserve slots, pick
   victims. No await separates a decision from the bookkeeping that records it.
2. **move**, one batched data movement for the whole request (``engine.move.Mover``): one worker-
   thread hop, and on a device one event wait.
3. **commit**, synchronously: re-check that nothing was deleted meanwhile, make the new
   residency visible, release what was not used.

Eviction, demotion, promotion and persist-on-close all go through :meth:`Engine.relocate`,
the one place that allocates, copies, re-checks ``dead`` and commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import numpy as np
import torch

from musacache._config import CacheConfig
from musacache._executor import finish
from musacache._keys import Fingerprint, KeyChain
from musacache.engine.directory import Directory, Entry, Match
from musacache.engine.move import Mover, accelerator_of
from musacache.engine.placement import victims
from musacache.engine.reads import Flight, Reads
from musacache.engine.staging import STAGE_KEEP_BYTES, StagePool
from musacache.engine.storage import ColdPath
from musacache.engine.tasks import CutWork, TaskOwner
from musacache.engine.tierstate import MemTier, StoreTier, Tier
from musacache.stats import InFlight, TokenCounts
from musacache.tiers.memory import MemoryPool, Slot
from musacache.transfer import DenseAt, Pages, _gather_checked

__all__ = ["ChunkSource", "DenseSource", "Engine", "PagedSource"]

# The fewest promotions that run at once (more with storage tiers that take more reads).
_MIN_PROMOTIONS = 8
# Directory work on many entries (delete, clear, learning a listing, planning a long put)
# is done this many at a time, letting other tasks run in between (well under a millisecond
# each on an idle core).
BATCH = 64
# New chunks a put plans, moves and commits per round (a put costs several times more per
# chunk than removing one; one round of a long prompt then stays near a millisecond).
_PUT_ROUND = 16
# A store's round: its planning costs a few microseconds a chunk (no tensor per chunk), and
# each round is a native call and a thread hop of its own: a request of up to 64 chunks
# (16,384 tokens in chunks of 256) is one call.
_STORE_ROUND = 64
# Chunks a lookup or read matches per turn of the loop (a few hundred microseconds).
_MATCH_RUN = 256
# Host bytes a put stages at once for chunks that go straight to a storage tier.
_STAGE_BYTES = 256 * 1024 * 1024


class ChunkSource(Protocol):
    """Where a put's bytes come from: ``move`` fills ``dst`` with tokens ``[start,
    start+n)`` of the request for every ``(start, n, dst)``, as one move."""

    async def move(self, mover: Mover, parts: Sequence[tuple[int, int, Any]]) -> None:
        """``dst`` is a tensor, or a :class:`DenseAt` for a source whose
        ``takes_addresses`` is true."""
        ...


class DenseSource:
    """A dense ``spec.shape(T)`` tensor (``put``)."""

    def __init__(self, kv: torch.Tensor, token_dim: int) -> None:
        self.kv = kv
        self.td = token_dim

    async def move(self, mover: Mover, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        await mover.copy([(dst, self.kv.narrow(self.td, s, n)) for s, n, dst in parts])


class PagedSource:
    """An engine's paged KV (``store``): one ``gather_chunks`` over every new chunk. A chunk
    that starts inside the skipped prefix takes its head from the cached chunk ``head``."""

    def __init__(self, pages: Pages, slots: torch.Tensor, token_dim: int, skip_prefix: int = 0,
                 head: tuple[int, torch.Tensor] | None = None) -> None:
        self.pages = pages  # described once by store; every gather below reuses it
        self.slots = slots
        self.td = token_dim
        self.skip = skip_prefix
        self.head = head
        #: Whether ``move`` takes the cache's own host slots by address (``DenseAt``): the
        #: native gather from host pages, no head to copy into a slot's first tokens.
        self.takes_addresses = pages.device.type == "cpu" and head is None

    async def move(self, mover: Mover,
                   parts: Sequence[tuple[int, int, torch.Tensor | DenseAt]]) -> None:
        if self.takes_addresses and any(isinstance(d, DenseAt) for _, _, d in parts):
            await self._move_to(mover, parts)  # host memory only: no device to look for
            return
        td = self.td
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        dsts: list[torch.Tensor] = []
        runs: list[tuple[int, int]] = []  # [start, end) of self.slots per chunk in dsts
        counts: list[int] = []
        for s, n, dst in parts:
            assert not isinstance(dst, DenseAt)  # only where takes_addresses
            if self.head is not None and s == self.head[0] and s < self.skip:
                k = self.skip - s
                copies.append((dst.narrow(td, 0, k), self.head[1].narrow(td, 0, k)))
                if n > k:
                    dsts.append(dst.narrow(td, k, n - k))
                    runs.append((self.skip, s + n))
                    counts.append(n - k)
            else:
                dsts.append(dst)
                runs.append((s, s + n))
                counts.append(n)
        slots = _joined(self.slots, runs)
        device = (self.pages.device if self.pages.device.type != "cpu"
                  else accelerator_of([*dsts, *(t for p in copies for t in p)]))
        nbytes = sum(d.numel() * d.element_size() for d in dsts)

        def work(stream: Any) -> None:
            for d, src in copies:
                d.copy_(src, non_blocking=stream is not None)
            if dsts:  # slots were checked by Cache.store, dsts are our own slots
                _gather_checked(self.pages, slots, dsts, counts, stream=stream)

        await mover.run(work, device=device, nbytes=max(nbytes, mover.inline_bytes))

    async def _move_to(self, mover: Mover,
                       parts: Sequence[tuple[int, int, torch.Tensor | DenseAt]]) -> None:
        """``move`` from host pages, the slots by address or as host tensors."""
        dsts = [dst for _, _, dst in parts]
        counts = [n for _, n, _ in parts]
        slots = _joined(self.slots, [(s, s + n) for s, n, _ in parts])
        nbytes = sum(d.nbytes for d in dsts)

        def work(_stream: Any) -> None:
            _gather_checked(self.pages, slots, dsts, counts)

        await mover.run(work, device=None, nbytes=max(nbytes, mover.inline_bytes))


def _host_memory(pool: MemoryPool) -> bool:
    return pool.device.type == "cpu"


def _evicted(t: MemTier, directory: Directory, chosen: list[Entry]) -> int:
    """Take ``chosen`` out of ``t`` (a reader still holding one keeps its slot until its
    last unpin), and out of the directory if no tier holds them any more."""
    t.c.evictions += t.evict(chosen)
    for e in chosen:
        if not e.resident and not e.dead:
            directory.remove(e)
    return len(chosen)


def _count_landed(t: Tier, demoting: bool) -> None:
    """Count a copy :meth:`Engine.relocate` placed in ``t``."""
    if demoting:
        t.c.demotions += 1
    else:
        t.c.promotions += 1


def _joined(slots: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``slots[a:b]`` of every run, end to end: a slice of ``slots`` (no copy) when each run
    starts where the one before ended (a request's new chunks, in prompt order)."""
    if not runs:
        return slots[:0]
    if all(b == a for (_, b), (a, _) in pairwise(runs)):
        return slots[runs[0][0] : runs[-1][1]]
    return torch.cat([slots[a:b] for a, b in runs])


class _LazyKeys:
    """A prompt's chunk keys, hashed as planning reaches them (a long prompt's keys are
    not all hashed in one step of the loop)."""

    def __init__(self, chain: KeyChain, toks: np.ndarray) -> None:
        self._it = chain.iter_keys(toks)
        self._done: list[tuple[int, int, bytes, bytes]] = []
        self._n = -(-len(toks) // chain.chunk_size)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[int, int, bytes, bytes]:
        while len(self._done) <= i:
            self._done.append(next(self._it))
        return self._done[i]


@dataclass(eq=False)
class _New:
    """A chunk a put places: where it goes, until its commit. Another put of the same
    chunk meanwhile waits for it through :meth:`settled`."""

    start: int
    end: int
    entry: Entry
    tier: MemTier | None = None
    index: int | None = None
    slot: Slot | None = None
    done: bool = False
    # Made by the first put that waits: almost no chunk has one (an event per chunk was a
    # tenth of a 16-chunk store's planning, right after a large copy left the caches cold).
    _settled: asyncio.Event | None = None

    def settled(self) -> asyncio.Event:
        """Set once this chunk is committed or abandoned."""
        if self._settled is None:
            self._settled = asyncio.Event()
            if self.done:
                self._settled.set()
        return self._settled

    def settle(self) -> None:
        self.done = True
        if self._settled is not None:
            self._settled.set()


def _cut(it: _New, held: list[Entry]) -> bool:
    """Whether the chunk ``it`` hangs under, which its put holds (``held[-1]``), was deleted
    while ``it`` was moved or waited for room: a delete racing the put. Committed then,
    ``it`` would hang under a chunk no longer in the directory, where no delete reaches it,
    and a later put of the prompt (with new KV) would bring it back."""
    return bool(held) and held[-1].dead and held[-1].key == it.entry.parent


class Engine(Reads):
    def __init__(self, config: CacheConfig, fingerprint: Fingerprint, chain: KeyChain,
                 tiers: list[Tier], mover: Mover, tasks: TaskOwner) -> None:
        self.config = config
        self.spec = config.spec
        self.fingerprint = fingerprint
        self.chain = chain
        self.dir = Directory(chain)
        self.tiers = tiers
        self.mem = [t for t in tiers if isinstance(t, MemTier)]
        self.tier_by_name = {t.name: t for t in tiers}
        self.stores = [t for t in tiers if isinstance(t, StoreTier)]
        # Whether a miss may ask a storage tier for chunks other nodes wrote.
        self.shared = any(t.store.shared for t in self.stores)
        # Memory tiers a put may place into: those before the first storage tier.
        lead = next((i for i, t in enumerate(tiers) if isinstance(t, StoreTier)), len(tiers))
        self.put_mem = [t for t in tiers[:lead] if isinstance(t, MemTier)]
        self.mover = mover
        self.executor = mover.executor
        self.tasks = tasks
        self.cut = CutWork()  # deletes running, noted if a close cuts them (engine.notes)
        self.cold = ColdPath(self)
        self.stage = StagePool(STAGE_KEEP_BYTES)  # host buffers of chunks put to storage
        self.wt_sem = anyio.Semaphore(max(2, config.copy_threads * 2))
        self.flights: dict[bytes, Flight] = {}
        # Promotions past this many wait at their start (see Reads._promote).
        self.promote_gate = anyio.Semaphore(
            max(_MIN_PROMOTIONS, 2 * sum(int(t.store.max_concurrency) for t in self.stores)))
        self._dense_at: dict[int, DenseAt] = {}  # by token count, at address 0
        self.put_flights: dict[bytes, _New] = {}  # chunks a put is placing, by key
        self.inflight = InFlight()
        self.tok = TokenCounts()
        # Pins held over all entries, kept as they change: stats() never walks the directory.
        self.pins_held = 0

    # -- views, pins, recency --------------------------------------------------------------

    def block_view(self, slot: Slot, n: int) -> torch.Tensor:
        return slot.view(self.spec.dtype, self.spec.shape(n))

    def view(self, t: MemTier, e: Entry) -> torch.Tensor:
        index = e.slot_index(t.idx)
        if index is None:
            raise KeyError(f"{t.name} does not hold {e!r}")
        return t.pool.view(index, self.spec.dtype, self.spec.shape(e.num_tokens))

    def hottest_mem(self, e: Entry) -> MemTier | None:
        return next((t for t in self.mem if t.holds(e)), None)

    def pin(self, e: Entry) -> None:
        e.pins += 1
        self.pins_held += 1

    def unpin(self, e: Entry) -> None:
        e.pins -= 1
        self.pins_held -= 1
        if e.pins == 0 and e.owes_memory:
            self._free_detached(e)

    async def let_go(self, entries: Sequence[Entry], *, touch: bool = False) -> None:
        """Unpin ``entries`` (touched first when ``touch``: leaf first, root last, so every
        prefix ends up more recent than what extends it), a run per turn of the loop. Every
        pin is let go of, once, even when the caller is cancelled meanwhile."""
        if len(entries) <= BATCH:  # one run: no turn of the loop, nothing to outlive
            self._let_go_run(entries, touch)
            return

        async def runs() -> None:
            for hi in range(len(entries), 0, -BATCH):
                self._let_go_run(entries[max(0, hi - BATCH) : hi], touch)
                if hi > BATCH:
                    await anyio.lowlevel.checkpoint()
        await finish(runs())

    def _let_go_run(self, entries: Sequence[Entry], touch: bool) -> None:
        if touch:
            self.touch(entries)
        for e in entries:
            self.unpin(e)

    def _free_detached(self, e: Entry) -> None:
        for idx, index in e.take_detached():
            t = self.tiers[idx]
            if isinstance(t, MemTier):
                t.pool.release(index)
        if e.dead:
            for idx, index in e.slots():
                e.pop_slot(idx)
                t = self.tiers[idx]
                if isinstance(t, MemTier):
                    t.lru.remove(index, e)
                    t.pool.release(index)

    def touch(self, entries: Sequence[Entry]) -> None:
        # Children first, parents last: the parents end up most recent, so LRU order alone
        # already puts leaves ahead of their prefixes.
        for e in reversed(entries):
            for t in self.tiers:
                t.touch(e)

    async def host_copy(self, data: torch.Tensor) -> torch.Tensor:
        if data.device.type == "cpu":
            return data
        host = torch.empty(data.shape, dtype=data.dtype, device="cpu")
        await self.mover.copy([(host, data)])
        return host

    def grow_ahead(self, t: MemTier) -> None:
        seg = t.pool.segment_to_grow()
        if seg is not None and seg not in t.growing:
            t.growing.add(seg)
            self.tasks.spawn(t.grow, seg)

    # -- put: plan, move, commit ----------------------------------------------------------------

    async def put(self, toks: np.ndarray, source: ChunkSource, *, skip_prefix: int = 0,
                  head_start: int | None = None,
                  keys: list[tuple[int, int, bytes, bytes]] | None = None) -> int:
        """Place each chunk of ``toks`` not yet cached; return the cached prefix length.
        ``keys`` (``put_pages``) replaces the token chain's keys, which are otherwise hashed
        as planning reaches them."""
        plan_keys: _LazyKeys | list[tuple[int, int, bytes, bytes]] = (
            _LazyKeys(self.chain, toks) if keys is None else keys)
        # Every chunk of this prompt stays pinned until the put ends: placing its tail must
        # never evict its own head (the head is what other prompts share).
        held: list[Entry] = []
        stored_to = 0
        pos = 0
        # A source on a device moves in rounds as large as a store's: each round is a hop
        # and an event wait, and between two rounds the bus idles (a 1 GiB put from a
        # device in rounds of 16 chunks was two moves).
        on_device = isinstance(source, PagedSource) or (
            isinstance(source, DenseSource) and accelerator_of((source.kv,)) is not None)
        cap = _STORE_ROUND if on_device else _PUT_ROUND
        # The directory this put plans and commits in. A clear swaps in a new one: the rest
        # of the prompt is then not put, since its chunks would go in without the parents
        # committed before the swap, where no delete of the prompt could reach them.
        within = self.dir
        try:
            while pos < len(plan_keys) and self.dir is within:
                items, pos, wait, stop, reached = self._plan_put(toks, plan_keys, pos, held,
                                                                 skip_prefix, head_start, cap)
                stored_to = max(stored_to, reached)
                if items:
                    try:
                        failed_at = await self._place(items, source, held, within)
                    finally:
                        for it in items:
                            self._abandon(it)
                    if failed_at is not None:
                        stored_to = failed_at
                        break
                    stored_to = items[-1].end
                if wait is not None:
                    await wait.wait()  # another put places that chunk; then plan again
                    continue
                if stop:
                    break
                if pos < len(plan_keys):
                    await anyio.lowlevel.checkpoint()  # between rounds of a long prompt
        finally:
            # Touched once for the whole prompt: touching round by round would leave each
            # round's parents older than the next round's chunks.
            await self.let_go(held, touch=True)
        self.tok.stored_tokens += stored_to
        return stored_to

    def _plan_put(self, toks: np.ndarray,
                  keys: _LazyKeys | list[tuple[int, int, bytes, bytes]], pos: int,
                  held: list[Entry], skip_prefix: int, head_start: int | None,
                  cap: int = _PUT_ROUND,
                  ) -> tuple[list[_New], int, asyncio.Event | None, bool, int]:
        """Synchronous: walk keys from ``pos``; pin the cached chunks before the first new
        one, then claim and reserve a top-tier slot for each new chunk of the run. Stops
        before a chunk another put is placing (returned, to wait on), before a cached chunk
        after the run, or at a chunk whose tokens may not be read (``stop``). Also returns
        the end of the last cached chunk pinned."""
        items: list[_New] = []
        reached = 0
        top = self.put_mem[0] if self.put_mem else None
        walked = 0
        while pos < len(keys):
            start, end, parent, key = keys[pos]
            e = self.dir.get(key)
            if e is not None:
                if items:
                    break  # commit the new run first; the next round pins this one
                self.pin(e)
                held.append(e)
                reached = end
                pos += 1
                walked += 1
                if walked >= BATCH:
                    # A long prompt already cached is hashed and pinned a batch per round
                    # too (all of it in one step: 36 ms at 16,384 chunks).
                    break
                continue
            flight = self.put_flights.get(key)
            if flight is not None:
                return items, pos, flight.settled(), False, reached
            if start < skip_prefix and start != head_start:
                # The caller said not to read these tokens, and we do not hold them: nothing
                # after them can be chained.
                return items, pos, None, True, reached
            n = end - start
            it = _New(start, end, Entry(key, parent, n, self.spec.nbytes(n), toks[start:end]))
            self.put_flights[key] = it
            if top is not None:
                idx = top.pool.reserve()
                if idx is not None:
                    it.tier, it.index = top, idx
            items.append(it)
            pos += 1
            if len(items) >= cap:
                break  # a long prompt is planned and placed in rounds: the loop runs between
        return items, pos, None, False, reached

    async def _place(self, items: list[_New], source: ChunkSource, held: list[Entry],
                     within: Directory) -> int | None:
        """Move and commit ``items`` (in ``within``, the put's directory: none once a clear
        has swapped it). Returns None if all were placed, else the token where placement
        stopped."""
        if not items:
            return None
        for mt in self.put_mem:  # make room: evict (demote) from the hottest tier first
            missing = [it for it in items if it.index is None]
            if not missing:
                break
            short = len(missing) - mt.pool.free_slots
            if short > 0:
                await self.evict(mt, short)
            for it in missing:
                idx = mt.pool.reserve()
                if idx is None:
                    break
                it.tier, it.index = mt, idx
        for mt in self.put_mem:
            self.grow_ahead(mt)
        overflow: list[_New] = []  # no memory tier has room: staged on the host for storage
        in_mem: list[tuple[_New, MemoryPool, int]] = []
        for it in items:
            if it.tier is not None and it.index is not None:
                pool = it.tier.pool
                it.slot = pool.ready(it.index) or await pool.materialize(it.index)
                in_mem.append((it, pool, it.index))
            else:
                overflow.append(it)
        parts = self._dests(in_mem, getattr(source, "takes_addresses", False))
        # Staging for storage is bounded: a prompt far larger than memory is moved, encoded and
        # queued a batch at a time (the first batch rides in the memory chunks' move).
        batches: list[list[_New]] = []
        size = _STAGE_BYTES
        for it in overflow:
            if size >= _STAGE_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(it)
            size += it.entry.raw_bytes
        for b, batch in enumerate(batches or [[]]):
            staged = [(it, self.stage.take(self.spec.shape(it.end - it.start), self.spec.dtype))
                      for it in batch]
            await source.move(self.mover, (parts if b == 0 else [])
                              + [(it.start, it.end - it.start, h) for it, h in staged])
            if self.dir is not within or (b == 0 and _cut(items[0], held)):
                return items[0].start if b == 0 else batch[0].start
            if b == 0:
                for it in items:  # commit, in prompt order: only now can a chunk be found
                    if it.tier is None or it.slot is None:
                        break
                    it.tier.commit(it.entry, it.slot)
                    self._commit_new(it, held)
            if staged:
                placed = await self._place_in_storage(staged, held, within)
                self.stage.give([d for _, d in staged])  # encoded: nothing reads them now
                if placed < len(staged):
                    return staged[placed][0].start
        return None

    def _dests(self, placed: list[tuple[_New, MemoryPool, int]], addressed: bool = False,
               ) -> list[tuple[int, int, torch.Tensor | DenseAt]]:
        """``(start, tokens, view of its slot)`` per placed chunk: the whole chunks in each
        pool viewed together (:meth:`MemoryPool.views`), a short tail alone. ``addressed``:
        slots in host memory as :class:`DenseAt` instead, no view made."""
        if addressed and all(_host_memory(pool) for _, pool, _ in placed):
            out: list[tuple[int, int, torch.Tensor | DenseAt]] = []
            for it, pool, index in placed:
                n = it.end - it.start
                at = self._dense_at.get(n)
                if at is None:
                    at = self._dense_at[n] = DenseAt.of(0, self.spec, n)
                out.append((it.start, n, DenseAt(pool.address(index), *at[1:])))
            return out
        cs, dtype = self.config.chunk_size, self.spec.dtype
        views: list[torch.Tensor | None] = [None] * len(placed)
        whole: dict[int, list[int]] = {}  # id(pool) -> positions in placed
        for k, (it, pool, index) in enumerate(placed):
            if it.end - it.start == cs:
                whole.setdefault(id(pool), []).append(k)
            else:
                views[k] = pool.view(index, dtype, self.spec.shape(it.end - it.start))
        for ks in whole.values():
            pool = placed[ks[0]][1]
            got = pool.views([placed[k][2] for k in ks], dtype, self.spec.shape(cs))
            for k, v in zip(ks, got, strict=True):
                views[k] = v
        return [(it.start, it.end - it.start, v)
                for (it, _, _), v in zip(placed, views, strict=True) if v is not None]

    def _commit_new(self, it: _New, held: list[Entry]) -> None:
        e = it.entry
        self.dir.add(e)
        if self.put_flights.get(e.key) is it:
            del self.put_flights[e.key]
        it.settle()
        self.pin(e)
        held.append(e)
        self.tok.put_tokens += e.num_tokens
        self.cold.write_through(e)

    async def _place_in_storage(self, staged: list[tuple[_New, torch.Tensor]],
                                held: list[Entry], within: Directory) -> int:
        for st in self.stores:
            objs = await self.cold.encode(st, [(it.entry, d) for it, d in staged])
            for i, ((it, _), obj) in enumerate(zip(staged, objs, strict=True)):
                if self.dir is not within or _cut(it, held):
                    return i
                e = it.entry
                # In the directory while its write waits for room (a delete or clear then
                # finds it, and its write is skipped or its object deleted after it).
                self.dir.add(e)
                placed = False
                try:
                    placed = await self.cold.place(st, e, obj)
                finally:
                    if not placed and self.dir.get(e.key) is e:
                        # Refused, or cancelled before its write was queued (place queues
                        # it in its last step): no tier holds it, and it must not stay
                        # behind as cached.
                        self.dir.remove(e)
                if not placed or e.dead or self.dir is not within:
                    # Not committed either when deleted while it waited (nothing queued, and
                    # the delete took it out), or when a clear swapped the directory
                    # meanwhile (its write, queued in the old one, is dismantled with it).
                    return i
                self._commit_new(it, held)
            return len(staged)
        return 0

    def _abandon(self, it: _New) -> None:
        """Release what an uncommitted item holds (after a failure, or a stop)."""
        if it.done:
            return
        it.done = True
        if it.tier is not None and it.index is not None:
            it.tier.pool.release(it.index)
        if self.put_flights.get(it.entry.key) is it:
            del self.put_flights[it.entry.key]
        it.settle()

    # -- relocation: allocate, copy, re-check dead, commit -------------------------------

    async def evict(self, t: MemTier, count: int) -> int:
        """Evict up to ``count`` chunks from ``t``, demoting each to the next tier that takes
        it. Returns how many left ``t``."""
        chosen = victims(t, self.dir, count)
        if t.idx + 1 >= len(self.tiers):
            # Nowhere to demote to (as relocate would count it): no await, so no pins and no
            # views; the victims leave in the same step they were chosen in.
            t.c.drops += len(chosen)
            return _evicted(t, self.dir, chosen)
        for e in chosen:
            self.pin(e)
        try:
            await self.relocate([(e, self.view(t, e)) for e in chosen], t.idx + 1,
                                demoting=True)
        finally:
            for e in chosen:
                self.unpin(e)  # before the slot is dropped: no detach and re-take for ours
            _evicted(t, self.dir, chosen)
        return len(chosen)

    async def relocate(self, items: Sequence[tuple[Entry, torch.Tensor]], dest_from: int,
                       dest_to: int | None = None, *, demoting: bool) -> list[Tier | None]:
        """Keep a copy of each ``(entry, data)`` in the first tier of ``tiers[dest_from:
        dest_to]`` that takes it: allocate there (evicting further down if needed), copy as
        one move, re-check that the entry was not deleted meanwhile, commit. Each copy is
        counted where it landed, as a demotion (``demoting``) or a promotion. Returns where
        each landed (None: nowhere)."""
        where: list[Tier | None] = [None] * len(items)
        todo = list(range(len(items)))
        for t in self.tiers[dest_from:dest_to]:
            todo = [i for i in todo if not items[i][0].dead]
            for i in [i for i in todo if t.holds(items[i][0])]:
                where[i] = t
            todo = [i for i in todo if where[i] is None]
            if not todo:
                break
            if isinstance(t, MemTier):
                todo = await self._relocate_mem(t, items, todo, where, demoting)
            else:
                host = [await self.host_copy(items[i][1]) for i in todo]
                objs = await self.cold.encode(t, [(items[i][0], h)
                                                  for i, h in zip(todo, host, strict=True)])
                for i, obj in zip(todo, objs, strict=True):
                    if await self.cold.place(t, items[i][0], obj):
                        _count_landed(t, demoting)
                        where[i] = t
                todo = [i for i in todo if where[i] is None]
        if todo and dest_from > 0 and demoting:
            self.tiers[dest_from - 1].c.drops += len(todo)  # nowhere had room: data gone
        return where

    async def _relocate_mem(self, t: MemTier, items: Sequence[tuple[Entry, torch.Tensor]],
                            todo: list[int], where: list[Tier | None], demoting: bool,
                            ) -> list[int]:
        short = len(todo) - t.pool.free_slots
        if short > 0:
            await self.evict(t, short)
        got: list[tuple[int, int]] = []
        for i in todo:
            idx = t.pool.reserve()
            if idx is None:
                break
            got.append((i, idx))
        if not got:
            return todo
        committed: set[int] = set()
        try:
            slots = [await t.pool.materialize(idx) for _, idx in got]
            await self.mover.copy([(self.block_view(s, items[i][0].num_tokens), items[i][1])
                                   for (i, _), s in zip(got, slots, strict=True)])
            for (i, _idx), slot in zip(got, slots, strict=True):
                e = items[i][0]
                if e.dead or t.holds(e):
                    continue  # deleted (or placed by another task) while we copied
                t.commit(e, slot)
                _count_landed(t, demoting)
                where[i] = t
                committed.add(i)
        finally:
            for i, idx in got:
                if i not in committed:
                    t.pool.release(idx)
        done = {i for i, _ in got}
        return [i for i in todo if i not in done]

    # -- matching, removal, persisting -----------------------------------------------------

    async def match(self, toks: np.ndarray) -> list[Match]:
        matches, stop_parent = await self._match(toks)
        if stop_parent is not None and self.shared \
                and sum(m.num_tokens for m in matches) < len(toks) \
                and await self.cold.refresh(stop_parent):
            matches, _ = await self._match(toks)
        return matches

    async def _match(self, toks: np.ndarray) -> tuple[list[Match], bytes | None]:
        """``dir.match``, ``_MATCH_RUN`` chunks per turn of the loop: a prompt of 16,384
        cached chunks took 22 ms of one step. A chunk matched in an earlier run may be
        evicted or deleted before the caller pins it; the read then stops there, as at any
        chunk it cannot read."""
        out, stop, more = self.dir.match_from(toks, 0, self.chain.seed, _MATCH_RUN)
        while more:
            await anyio.lowlevel.checkpoint()
            last = out[-1]
            part, stop, more = self.dir.match_from(toks, last.start + last.num_tokens,
                                                   last.entry.key, _MATCH_RUN)
            out += part
        return out, stop

    def remove(self, doomed: Sequence[Entry]) -> None:
        """Forget ``doomed`` in every tier now; storage deletes are chained after any write
        of the same entries still queued."""
        for e in doomed:
            if e.dead:
                continue
            e.dead = True
            self.dir.remove(e)
            for mt in self.mem:
                mt.detach(e)
            newer = self.dir.get(e.key)  # (after a clear: a new entry of the same key)
            for st in self.stores:
                if st.holds(e):
                    st.drop(e)
                    if newer is not None and newer is not e and st.holds(newer):
                        # Its object is (being) written over by the newer entry's, whose
                        # write came first in the key's chain: a delete now would remove
                        # that one (a clear taking the old directory apart
                        # deleted the files of chunks put again meanwhile).
                        continue
                    self.cold.schedule_delete(st, e.key)
            if e.pins == 0:
                self._free_detached(e)
