"""Cache: the embedded engine's public face. Checks every argument, then hands the request to
the engine (``engine.core.Engine``: plan, move, commit), whose bookkeeping lives in the
per-tier state objects (``engine.tierstate``), placement rules (``engine.placement``), the
storage path (``engine.storage``) and the data path (``engine.move``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

from musacache import _validate, devices, transfer
from musacache._config import CacheConfig, DeviceTier, HostTier
from musacache._errors import (
    CacheClosedError,
    ConfigError,
    DeviceError,
    EventLoopError,
    InvalidInputError,
    ShapeError,
)
from musacache._executor import Executor, outlive
from musacache._keys import Fingerprint, KeyChain, as_tokens, check_token_memory
from musacache._spec import KVSpec, check_has_data
from musacache.engine import notes as _notes
from musacache.engine import removal as _removal
from musacache.engine.core import BATCH, DenseSource, Engine, PagedSource
from musacache.engine.directory import Match
from musacache.engine.move import Mover, accelerator_of
from musacache.engine.pages import (
    PAGE_RUN,
    PageSource,
    check_pages_paced,
    first_missing_page,
    page_keys_paced,
)
from musacache.engine.reads import VIEW_RUN
from musacache.engine.resident import MIN_CHUNKS as RESIDENT_MIN
from musacache.engine.resident import read_resident, retrieve_resident
from musacache.engine.resident import release as release_resident
from musacache.engine.tasks import TaskOwner
from musacache.engine.tee import Tee
from musacache.engine.tierstate import MemTier, StoreTier, Tier
from musacache.stats import CloseReport, OpCounts, OpLatencies, as_dict
from musacache.tiers.base import StorageTier, TierContext
from musacache.transfer import _scatter_own

log = logging.getLogger("musacache")

__all__ = ["Cache", "Hit"]


@dataclass(frozen=True)
class Hit:
    """The result of :meth:`Cache.get`.

    ``num_tokens`` is the length of the prefix served (0 is a miss). ``kv`` holds exactly those
    tokens, shape ``spec.shape(num_tokens)``; with ``out=`` it is a view of ``out``.
    ``tiers`` counts the tokens served by each tier.
    """

    num_tokens: int
    kv: torch.Tensor
    tiers: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.num_tokens > 0


def _new_hit(num_tokens: int, kv: torch.Tensor, tiers: dict[str, int],
             _new: Any = object.__new__) -> Hit:
    """``Hit(num_tokens, kv, tiers)`` without the frozen dataclass's ``__init__``: its three
    ``object.__setattr__`` calls are 0.6 µs of a one-chunk get's 8 (the direct path's)."""
    hit = _new(Hit)
    d = hit.__dict__
    d["num_tokens"] = num_tokens
    d["kv"] = kv
    d["tiers"] = tiers
    return hit


def _dense_dest(dst: torch.Tensor, td: int) -> tuple[
        Callable[[Match, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        Callable[[Match], torch.Tensor | None]]:
    """``get``'s pairs for its move (``dst``'s part for each match, and the source's), and
    ``dst``'s part for each match that is a whole chunk (a tee's destination)."""
    return (lambda m, src: (_part(dst, td, m.start, m.num_tokens),
                            _part(src, td, 0, m.num_tokens)),
            lambda m: _part(dst, td, m.start, m.num_tokens)
            if m.num_tokens == m.entry.num_tokens else None)


def _part(t: torch.Tensor, dim: int, start: int, n: int) -> torch.Tensor:
    """``t.narrow(dim, start, n)``, or ``t`` itself when that is all of it (a torch view
    costs a microsecond: the small-op floor of a one-chunk get counts them)."""
    return t if start == 0 and t.shape[dim] == n else t.narrow(dim, start, n)


def _first_skip(slots: torch.Tensor, skip_prefix: int) -> int:
    """Tokens before the first -1 slot at or after ``skip_prefix``."""
    tail = slots[skip_prefix:]
    holes = (tail == -1).nonzero()
    return skip_prefix + int(holes[0, 0]) if holes.numel() else len(slots)


def _covered(matches: Sequence[Match]) -> int:
    """Tokens a match covers: they run from token 0 without a gap, so its last one's end."""
    return matches[-1].start + matches[-1].num_tokens if matches else 0


async def _drop_in_runs(items: list[Any]) -> None:
    """Empty ``items`` a run at a time, the loop free in between (shielded: the read is
    done). A long read's views and copy pairs, let go of at once as it returned, were a
    step of 10 to 20 ms at 16,384 chunks."""
    while len(items) > VIEW_RUN:
        del items[-VIEW_RUN:]
        await anyio.lowlevel.cancel_shielded_checkpoint()
    items.clear()


async def _read_into(eng: Engine, matches: list[Match],
                     pair: Callable[[Match, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     dest: Callable[[Match], torch.Tensor | None] | None = None, *,
                     staged: bool = False, every: bool = False,
                     ) -> list[tuple[Match, torch.Tensor, str]]:
    """The read of ``get`` and ``get_pages``: pin ``matches``, take each from the hottest tier
    holding it (promoting from below), copy it where ``pair(match, source)`` says in one
    move, and touch what was served. Returns the contiguous run served, or with ``every``
    (independent pages) each chunk that could be read.

    ``dest(match)`` is the tensor for a whole chunk (its elements in the chunk's order), or
    None: a chunk promoted from disk is written there by its read, block by block
    (:mod:`musacache.engine.tee`), and left out of the move. ``staged``: ``dest`` is the caller's
    memory, which must hold nothing a chunk not served would write; a read from storage then
    writes a tensor of its own instead, and the move copies on only the chunks served (a
    chunk in memory is copied once, from its slot)."""
    # A tee only for a chunk fetched from below the top tier (the only reads that write the
    # caller's tensor), made when ``sources`` starts that fetch: one costs 15 to 20 µs, too
    # much to make for every chunk of a get served from memory.
    tees: dict[int, Tee] = {}
    direct = eng.config.promotion == "background"

    def tee_for(i: int) -> Tee | None:
        d = dest(matches[i]) if dest is not None else None
        if d is None or d.device.type != "cpu":
            return None
        if not staged:
            tee = tees[i] = Tee(d)
            return tee
        # Staged, only a read straight from storage gets a tee (into a stage): a read
        # through a top-tier slot is staged there already, and a tee would copy it twice.
        if not direct:
            return None
        tee = Tee(torch.empty(d.shape, dtype=d.dtype))
        if eng.cold.direct.direct_source(matches[i].entry, tee) is None:
            return None
        tees[i] = tee
        return tee

    pinned = 0
    try:
        # A run per turn of the loop: a chunk matched but not pinned yet may be evicted or
        # deleted meanwhile, and the read then stops there, as at any chunk it cannot read.
        for m in matches:
            if pinned and not pinned % VIEW_RUN:
                await anyio.lowlevel.checkpoint()
            eng.pin(m.entry)
            pinned += 1
        found = await eng.sources(matches, tee_for, every=every)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (m, src, _name) in enumerate(found):
            if i and not i % VIEW_RUN:  # a long read's views, a run per turn of the loop
                await anyio.lowlevel.checkpoint()
            if staged or not ((tee := tees.get(i)) is not None and tee.complete):
                pairs.append(pair(m, src))
        await eng.mover.copy(pairs)
        await _drop_in_runs(pairs)
        served = [m.entry for m, _, _ in found]
        # Children first, parents last, as one touch would; a run per turn of the loop.
        for hi in range(len(served), 0, -VIEW_RUN):
            eng.touch(served[max(0, hi - VIEW_RUN) : hi])
            if hi > VIEW_RUN:
                await anyio.lowlevel.checkpoint()
        return found
    finally:
        for tee in tees.values():
            tee.close()  # an abandoned read writes nothing into the caller's tensor now
        await eng.let_go([m.entry for m in matches[:pinned]])


class Cache:
    """The embedded KV cache. Use as ``async with Cache(config) as cache:``.

    Every method is a coroutine, safe to call concurrently from many tasks of one event
    loop. Misses are values, failures are :class:`~musacache.MusaCacheError`.
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"Cache() takes a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.spec = config.spec
        self.fingerprint = Fingerprint(config.namespace, config.spec, config.chunk_size)
        salt = config.tenant.encode() if config.tenant else None
        self._chain = KeyChain(self.fingerprint, salt)
        self._state = "new"
        self._release_task: asyncio.Task[None] | None = None  # the end of aclose
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop open() ran in
        self._closed_stores: set[int] = set()  # storage tiers aclose has closed (by idx)
        self._tasks = TaskOwner()
        self._eng: Engine | None = None
        self._ops = OpCounts()
        self._close = CloseReport()
        # None until an exporter asks (musacache.metrics): an untimed call then costs a
        # load and a test, no clock read.
        self._latency: OpLatencies | None = None
        self._device = torch.device("cpu")
        # store/retrieve: the engine's raw caches, described once while they stay the same,
        # and the last description found to hold this cache's spec (neither holds a tensor).
        self._pages_memo = transfer.PagesMemo()
        self._pages_fit: transfer.PagedKV | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Cache:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def _engine(self) -> Engine:
        if self._eng is None:
            raise CacheClosedError("the cache is not open: use `async with Cache(config) as cache`")
        return self._eng

    @property
    def _mem(self) -> list[MemTier]:
        return self._engine.mem

    @property
    def _stores(self) -> list[StoreTier]:
        return self._engine.stores

    async def open(self) -> None:
        """Create the tiers and learn what the storage tiers already hold."""
        if self._state != "new":
            raise CacheClosedError(f"Cache.open() called on a cache that is {self._state}")
        self._state = "opening"
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        slot_bytes = self.spec.nbytes(cfg.chunk_size)
        started: list[StorageTier] = []
        mover: Mover | None = None
        executor = Executor("musacache")
        try:
            tiers: list[Tier] = []
            for idx, tc in enumerate(cfg.tiers):
                if isinstance(tc, (HostTier, DeviceTier)):
                    tiers.append(MemTier(idx, tc, slot_bytes, executor))
                    continue
                store = tc.build() if hasattr(tc, "build") else tc
                if not isinstance(store, StorageTier):
                    raise ConfigError(f"tier {idx} ({type(tc).__name__}) is neither a memory "
                                      "tier config nor a StorageTier")
                tiers.append(StoreTier(idx, store, int(cfg.write_queue_bytes)))
            _check_room(cfg, slot_bytes)
            mem = [t for t in tiers if isinstance(t, MemTier)]
            self._device = (mem[0].device if mem else torch.device("cpu")) \
                if cfg.device == "auto" else devices.resolve(cfg.device)
            mover = Mover(executor.lane(cfg.copy_threads), int(cfg.inline_copy_bytes))
            await self._tasks.start()
            eng = Engine(cfg, self.fingerprint, self._chain, tiers, mover, self._tasks)
            ctx = TierContext(self.fingerprint, tenant=self.config.tenant, executor=executor)
            for st in eng.stores:
                listing = await st.store.start(ctx)
                started.append(st.store)
                await eng.cold.learn_all(st, listing, BATCH)
                del listing
            for st in eng.stores:
                if st.capacity is not None and st.used > st.capacity:
                    # Objects of a run with a larger capacity: the tier is brought within
                    # this one before the cache opens (leaves first, demoting below, once
                    # every tier is learned, so that what a lower one holds is not written
                    # to it again).
                    await eng.cold.make_room(st, 0)
            # Deletes a close cut short, done before the first read (a deleted prefix must
            # never come back as a hit).
            await _notes.replay(eng, BATCH)
            for mt in eng.mem:
                if mt.prealloc_bytes:
                    await mt.pool.prealloc(mt.prealloc_bytes)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for store in started:
                    await store.aclose()
                await self._tasks.aclose()
            if mover is not None:
                mover.close()
            executor.close()
            self._state = "closed"
            raise
        self._eng = eng
        self._state = "open"

    async def aclose(self) -> None:
        """Persist (``persist_on_close``) and finish queued writes and deletes, within
        ``close_timeout`` seconds; then release every tier. What did not make it is counted
        in ``stats()["close"]``: deletes cut short are noted by the storage tiers that keep
        notes (the disk tier) and finished at the next open, never run on here.
        Idempotent. Call it in the event loop that opened the cache:
        from any other it raises :class:`~musacache.EventLoopError` (after releasing what
        it can, when that loop has closed)."""
        if self._state == "closing" and self._release_task is not None:
            await _release_to_end(self)  # one that a cancellation of every task cut short
            return
        if self._state in ("closed", "closing", "new") or self._eng is None:
            self._state = "closed"
            return
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            await _close_from_other_loop(self, self._loop)
        self._state = "closing"
        eng = self._eng
        with anyio.CancelScope(shield=True):
            try:
                with anyio.move_on_after(self.config.close_timeout) as deadline:
                    if self.config.persist_on_close:
                        await eng.cold.persist(self._close, BATCH)
                    await self._tasks.drain()
                self._close.timed_out = int(deadline.cancelled_caught)
                self._close.not_persisted = self._close.to_persist - self._close.persisted
                self._close.writes_abandoned = sum(len(st.pending) for st in eng.stores)
            finally:
                await _release_to_end(self)

    def _check_open(self) -> Engine:
        if self._state != "open" or self._eng is None:
            raise CacheClosedError(
                "the cache is closed" if self._state in ("closed", "closing")
                else "the cache is not open: use `async with Cache(config) as cache`")
        return self._eng

    def _timed(self) -> OpLatencies:
        """The latencies of this cache's calls, counted from now on (idempotent)."""
        if self._latency is None:
            self._latency = OpLatencies()
        return self._latency

    @property
    def device(self) -> torch.device:
        """Where ``get`` returns KV: ``CacheConfig.device`` (by default the hottest memory
        tier's device)."""
        return self._device

    # -- the public API -------------------------------------------------------------------

    async def put(self, tokens: Any, kv: torch.Tensor) -> int:
        """Store the KV of ``tokens`` (dense ``spec.shape(T)``, any strides, ``T >= len(tokens)``).

        Returns once the cache owns a copy: the number of leading tokens of ``tokens`` now
        cached. Writes to lower tiers happen in the background.
        """
        eng = self._check_open()
        toks = as_tokens(tokens)
        _check_kv(self.spec, kv, toks, "kv")
        self._ops.puts += 1
        eng.inflight.puts += 1
        lat = self._latency
        t0 = time.perf_counter() if lat is not None else 0.0
        try:
            # A prefill run with grad on hands over KV that requires grad: its values are what
            # is cached (a copy into a slot, which autograd would refuse to record).
            return await eng.put(toks, DenseSource(kv.detach() if kv.requires_grad else kv,
                                                   self.spec.token_dim))
        finally:
            eng.inflight.puts -= 1
            if lat is not None:
                lat.put.observe(time.perf_counter() - t0)

    async def lookup(self, tokens: Any) -> int:
        """The length of the longest prefix of ``tokens`` cached in any tier. Moves no data."""
        eng = self._check_open()
        toks = as_tokens(tokens)
        self._ops.lookups += 1
        eng.inflight.lookups += 1
        lat = self._latency
        t0 = time.perf_counter() if lat is not None else 0.0
        try:
            return _covered(await eng.match(toks))
        finally:
            eng.inflight.lookups -= 1
            if lat is not None:
                lat.lookup.observe(time.perf_counter() - t0)

    async def get(self, tokens: Any, out: torch.Tensor | None = None) -> Hit:
        """The KV of the longest cached prefix of ``tokens``.

        With ``out`` (any strided tensor of ``spec.shape(len(tokens))``), the KV is written
        into it and ``hit.kv`` is a view of it. Without it, ``hit.kv`` is on
        :attr:`device`. A miss is ``hit.num_tokens == 0``. ``out`` past ``hit.num_tokens``
        is left as it was: a chunk that cannot be read ends the hit, and neither it nor any
        chunk after it writes a byte of ``out``.
        """
        eng = self._check_open()
        toks = as_tokens(tokens)
        if out is not None:
            _check_kv(self.spec, out, toks, "out", exact=True)
            self.spec.check_out(out)
        self._ops.gets += 1
        eng.inflight.gets += 1
        td = self.spec.token_dim
        lat = self._latency
        t0 = time.perf_counter() if lat is not None else 0.0
        try:
            return await _get_matched(self, eng, toks, out, td)
        finally:
            eng.inflight.gets -= 1
            if lat is not None:
                lat.get.observe(time.perf_counter() - t0)

    async def prefetch(self, tokens: Any, timeout: float | None = None) -> int:
        """Promote the cached prefix of ``tokens`` into the hottest tier.

        Without ``timeout``: schedule the promotion and return at once the number of prefix
        tokens being brought up. With ``timeout=s``: wait up to ``s`` seconds and return the
        number of prefix tokens already resident in the hottest tier; the rest carries on.
        """
        eng = self._check_open()
        toks = as_tokens(tokens)
        timeout = _validate.timeout(timeout, "prefetch timeout")
        self._ops.prefetches += 1
        eng.inflight.prefetches += 1
        try:
            matches = await eng.match(toks)
            top = eng.tiers[0]
            flights = []
            for i, m in enumerate(matches):
                if i and not i % VIEW_RUN:  # a long prompt's, a run per turn of the loop
                    await anyio.lowlevel.checkpoint()
                if not top.holds(m.entry):
                    flights.append(eng.promotion(m.entry))
            if timeout is None:
                return _covered(matches)
            with anyio.move_on_after(timeout):
                for f in flights:
                    await f.done.wait()
            n = 0
            for m in matches:
                if not top.holds(m.entry):
                    break
                n += m.num_tokens
            return n
        finally:
            eng.inflight.prefetches -= 1

    async def store(self, tokens: Any, kv_caches: Any, slot_mapping: Any, *,
                    layout: str | None = None, skip_prefix: int = 0, ready: Any = None,
                    ready_timeout: float | None = None) -> int:
        """Store the KV of ``tokens``, gathered from an engine's paged ``kv_caches`` (a
        ``transfer.Pages``, or raw caches in ``layout``, default ``"vllm"``).

        ``slot_mapping[i]`` is the slot of ``tokens[i]`` in the pages (see
        :mod:`musacache.transfer` for the layouts). The first ``skip_prefix`` tokens are not
        read (the engine got them from this cache). A chunk holding a -1 slot past
        ``skip_prefix`` ends the store: its KV is not in the pages. ``ready`` (a host or
        device event) is awaited, without blocking the loop, before the pages are read.
        Returns the number of leading tokens of ``tokens`` now cached, as ``put`` does.
        """
        eng = self._check_open()
        self._ops.puts += 1
        eng.inflight.puts += 1
        head: Match | None = None
        lat = self._latency
        t0 = time.perf_counter() if lat is not None else 0.0
        try:
            toks, slots, paged, holes = await _paged_args(
                self, tokens, kv_caches, slot_mapping, layout, skip_prefix, ready, ready_timeout)
            valid = _first_skip(slots, skip_prefix) if holes else len(slots)
            head_data: torch.Tensor | None = None
            if skip_prefix % self.config.chunk_size:
                # The skipped prefix ends inside a chunk. The pages must not be read there, but
                # the cache itself holds those tokens (the engine retrieved them from us, for
                # example a partial tail of the last turn): the new, longer chunk is built from
                # the cached head plus the pages after skip_prefix.
                matches = await eng.match(toks[:skip_prefix])
                if matches and sum(m.num_tokens for m in matches) == skip_prefix:
                    head = matches[-1]
                    eng.pin(head.entry)
                    head_data = await eng.read_entry(head.entry)
            cached = None if head is None or head_data is None else (head.start, head_data)
            source = PagedSource(paged, slots, self.spec.token_dim, skip_prefix, cached)
            return await eng.put(toks[:valid], source, skip_prefix=skip_prefix,
                                 head_start=head.start if head_data is not None and head
                                 else None)
        finally:
            if head is not None:
                eng.unpin(head.entry)
            eng.inflight.puts -= 1
            if lat is not None:
                lat.store.observe(time.perf_counter() - t0)

    async def retrieve(self, tokens: Any, kv_caches: Any, slot_mapping: Any, *,
                       layout: str | None = None, skip_prefix: int = 0, ready: Any = None,
                       ready_timeout: float | None = None) -> int:
        """Write the cached prefix of ``tokens`` into an engine's paged ``kv_caches`` (as
        for ``store``).

        Tokens before ``skip_prefix`` (the engine holds them) are neither read nor overwritten;
        slots of -1 are skipped. ``ready`` is awaited before the pages are written. Returns the
        number of tokens written: the cached prefix length minus ``skip_prefix`` (0 if the
        cached prefix is shorter). Every argument is checked before any page is touched. The
        slots of tokens past those written are left as they were: a chunk that cannot be read
        ends the retrieve, and neither it nor any chunk after it writes a slot.
        """
        eng = self._check_open()
        self._ops.gets += 1
        eng.inflight.gets += 1
        lat = self._latency
        t0 = time.perf_counter() if lat is not None else 0.0
        try:
            toks, slots, paged, _holes = await _paged_args(
                self, tokens, kv_caches, slot_mapping, layout, skip_prefix, ready, ready_timeout)
            return await _retrieve_held(self, eng, toks, slots, paged, skip_prefix)
        finally:
            eng.inflight.gets -= 1
            if lat is not None:
                lat.retrieve.observe(time.perf_counter() - t0)

    # -- key-addressed pages (engines that hash their own pages: SGLang HiCache) -----------

    async def put_pages(self, keys: Sequence[str | bytes], pages: Sequence[torch.Tensor], *,
                        after: str | bytes | None = None) -> int:
        """Store ``pages[i]`` under the engine's key ``keys[i]``; return how many leading
        pages are now cached.

        A page is one chunk (``chunk_size`` tokens) of KV: a tensor of ``spec.dtype`` with
        ``spec.nbytes(chunk_size)`` bytes in any shape and strides, stored in its logical
        (row-major) element order. ``after`` names the page before ``keys[0]`` in the
        engine's sequence (eviction drops a sequence's tail before its head). Pages share the
        tiers, eviction, codec and storage of token chunks; see :mod:`musacache.engine.pages`.
        """
        eng = self._check_open()
        cs = self.config.chunk_size
        ks = await page_keys_paced(eng.chain.seed, keys, cs, after)
        await check_pages_paced(pages, len(ks), self.spec, cs, "pages")
        if not ks:
            return 0
        self._ops.puts += 1
        eng.inflight.puts += 1
        try:
            toks = np.zeros(len(ks) * cs, dtype=np.int32)
            return await eng.put(toks, PageSource(pages, cs), keys=ks) // cs
        finally:
            eng.inflight.puts -= 1

    async def get_pages(self, keys: Sequence[str | bytes], outs: Sequence[torch.Tensor],
                        ) -> list[bool]:
        """Copy each cached page into ``outs[i]`` (same element count and dtype as a page,
        any shape and strides); ``result[i]`` says whether ``keys[i]`` was found. A page
        that cannot be read (a cold-tier fault) is a miss, and its ``outs[i]`` is left as it
        was; the pages after it are still served."""
        eng = self._check_open()
        cs = self.config.chunk_size
        ks = await page_keys_paced(eng.chain.seed, keys, cs)
        await check_pages_paced(outs, len(ks), self.spec, cs, "outs", writes=True)
        self._ops.gets += 1
        eng.inflight.gets += 1
        try:
            wanted = []
            for i, (start, _end, _parent, key) in enumerate(ks):
                if i and not i % PAGE_RUN:
                    await anyio.lowlevel.checkpoint()
                e = eng.dir.get(key)
                if e is not None:
                    wanted.append(Match(start, cs, e))
            # Staged: a page that fails part-way leaves its ``outs`` as it was.
            found = await _read_into(eng, wanted, lambda m, src: (
                outs[m.start // cs], src.reshape(outs[m.start // cs].shape)),
                lambda m: outs[m.start // cs], staged=True, every=True)
            hit = [False] * len(ks)
            for m, _src, _name in found:
                hit[m.start // cs] = True
            self._count_request(len(ks) * cs, len(found) * cs)
            return hit
        finally:
            eng.inflight.gets -= 1

    async def exists_pages(self, keys: Sequence[str | bytes]) -> int:
        """How many of ``keys``, from the first, are cached in some tier. Moves no data."""
        eng = self._check_open()
        found = await first_missing_page(eng.chain.seed, keys,
                                         lambda key: eng.dir.get(key) is not None)
        self._ops.lookups += 1
        return found

    async def delete(self, tokens: Any) -> int:
        """Forget the chunks of ``tokens`` and every chunk that extends them, in every tier.

        The prompt's chunks are those a lookup of ``tokens`` would serve (including a cached
        partial tail, or a cached chunk that starts with the prompt's tail) and any chunk
        keyed on the prompt's chain; everything stored after any of them goes too, to any
        depth, whether or not the rest of the prompt was ever cached. Storage objects are
        deleted in the background (``flush()`` waits for them), after any write of the same
        chunk still queued. Returns the number of chunks removed.

        The chunks go a batch per turn of the loop, the prompt's first chunk in the first
        batch. A lookup of the prompt finds none of them from then on; a put of the same
        tokens made while the delete runs may find chunks it has not reached yet and chain
        onto them, until it does. None of them is served once ``delete`` has returned. A
        delete that has started finishes: cancelled, the rest runs in the background
        (``flush()`` waits for it)."""
        eng = self._check_open()
        toks = as_tokens(tokens)
        self._ops.deletes += 1
        return await _removal.delete(eng, toks, BATCH)

    async def clear(self) -> None:
        """Forget every chunk in every tier (storage objects of this fingerprint included)."""
        eng = self._check_open()
        await _removal.clear(eng, BATCH)

    async def flush(self) -> None:
        """Wait until every background write and delete (write-behind, write-through) has
        finished."""
        self._check_open()
        await self._tasks.drain()

    async def stats(self) -> dict[str, Any]:
        """Counters: per tier hits, misses, bytes in/out, evictions, bytes used, capacity;
        operations in flight; tokens hit and missed; pins held; what ``aclose`` left. Each
        group of counters is the ``dataclasses.asdict`` of its record in
        :mod:`musacache.stats` (``ops``: ``OpCounts``, ``tokens``: ``TokenCounts``, ...)."""
        eng = self._eng
        return {
            "namespace": self.config.namespace,
            "chunk_size": self.config.chunk_size,
            "device": str(self._device),
            "state": self._state,
            "chunks": len(eng.dir) if eng else 0,
            "pins": eng.pins_held if eng else 0,
            "tiers": {t.name: t.stats() for t in eng.tiers} if eng else {},
            "ops": as_dict(self._ops),
            "in_flight": {**(as_dict(eng.inflight) if eng else {}),
                          "background": self._tasks.running},
            "tokens": as_dict(eng.tok) if eng else {},
            "close": as_dict(self._close),
            "capabilities": {k: devices.capabilities(k).to_dict()
                             for k in ("cpu", *devices.ACCELERATORS)},
        }

    def _count_request(self, asked: int, found: int) -> None:
        tok = self._engine.tok
        tok.hit_tokens += found
        tok.miss_tokens += asked - found


async def _release_to_end(cache: Cache) -> None:
    """Run the end of ``aclose`` (:func:`_close_rest`) in a task of its own, through any
    cancellation of the caller (raised after): a plain ``task.cancel()`` of the closing task
    (anyio's shield holds off only anyio's own scopes) would leave the cache's tasks
    running, its storage tiers open, and the memory and the copy threads held for good. One
    cut short itself (a cancellation of every task, at a shutdown) is run again: each of its
    steps can be, and each storage tier is closed at most once."""
    came: BaseException | None = None
    while True:
        task = cache._release_task
        if task is None or task.cancelled():
            assert cache._eng is not None
            task = cache._release_task = asyncio.ensure_future(_close_rest(cache, cache._eng))
        came = await outlive(task) or came
        if not task.cancelled():
            break
    cache._state = "closed"
    task.result()
    if came is not None:
        try:
            raise came
        finally:
            del came  # (a local would keep its traceback in a cycle)


async def _close_from_other_loop(cache: Cache, opened: asyncio.AbstractEventLoop) -> None:
    """``aclose`` called in a loop other than ``opened``, the one the cache was opened in:
    its tasks, events and connections are that loop's and cannot be awaited from this one.
    A loop still open keeps the cache open (close it there); a closed one took the tasks with
    it, so what needs no loop is released here before the error is raised."""
    rule = ("a cache is used and closed in the event loop that opened it (one asyncio.run): "
            "aclose() was called in another")
    if not opened.is_closed():
        raise EventLoopError(f"{rule}, while the cache's own loop is still open; nothing was "
                             "released: close the cache in its own loop")
    eng = cache._eng
    assert eng is not None
    cache._state = "closing"
    cache._tasks.abandon()
    cache._close.writes_abandoned = sum(len(st.pending) for st in eng.stores)
    with anyio.CancelScope(shield=True):
        for st in eng.stores:
            if st.idx in cache._closed_stores:
                continue
            cache._closed_stores.add(st.idx)
            try:
                # A tier whose connections belong to the closed loop fails or hangs here:
                # what it could not release goes with its objects.
                with anyio.move_on_after(float(st.store.timeout)):
                    await st.store.aclose()
            except Exception as e:
                eng.cold.errlog.warn(st.name, "close", repr(e))
        # The old loop's moves never finish in this one: instead of waiting for them, the
        # copy threads are let go of and waited for, so none writes memory freed below.
        await eng.executor.run(eng.mover.shut_down)
        await _release(eng, moves_done=True)
    cache._state = "closed"
    raise EventLoopError(f"{rule}, after the cache's own loop had closed; its memory, copy "
                         "threads and storage tiers were released here, and writes still "
                         f"queued ({cache._close.writes_abandoned}) were lost")


async def _close_rest(cache: Cache, eng: Engine) -> None:
    """Stop the cache's own tasks, note the deletes cut short (once), close each storage
    tier (once, even when this is run again), then :func:`_release`."""
    await cache._tasks.aclose()
    if not eng.cut.noted:
        eng.cut.noted = True  # first: a note written twice would drop the first's keys
        try:
            await _notes.note_cut(eng, cache._close, BATCH)
        except Exception:  # closing must release the rest regardless
            log.exception("musacache: noting the deletes cut short failed")
    for st in eng.stores:
        if st.idx in cache._closed_stores:
            continue
        cache._closed_stores.add(st.idx)  # first: a tier's aclose is never called twice
        try:
            await st.store.aclose()
        except Exception as e:  # closing must release the rest regardless
            eng.cold.errlog.warn(st.name, "close", repr(e))
    await _release(eng)


async def _release(eng: Engine, moves_done: bool = False) -> None:
    """The end of ``Cache.aclose``: let go of every tier's memory and the directory.
    ``moves_done``: the copy threads have ended already (no move to wait for)."""
    # No move may write a slot (by address: that keeps no memory alive) once its segment is
    # freed: new ones fail, running ones finish first.
    if not moves_done:
        await eng.mover.quiesce()
    for mt in eng.mem:
        await _removal.release_memory(mt)
    for st in eng.stores:
        await _removal.release_store(st)
    # A batch of entries freed at a time, not a million in one step.
    old, eng.dir = eng.dir, eng.dir.emptied()
    await _removal.dismantle_closed(old, BATCH)
    eng.mover.close()
    eng.executor.close()  # its threads end once idle (a hung read's, when it returns)


def _check_room(cfg: CacheConfig, slot_bytes: int) -> None:
    """A memory tier keeps whole chunk slots: one smaller than a slot holds nothing, and puts
    fall through it to the next tier; with no tier that can hold a chunk, every put stores
    nothing. Said in the log when the cache opens (a put's return value says it too), since
    it stored nothing without a word (a server's tiers split over its caches, say)."""
    small = [t for t in cfg.tiers if isinstance(t, (HostTier, DeviceTier))
             and int(t.capacity_bytes) < slot_bytes]
    for t in small:
        log.warning("musacache: tier %r (%d bytes) is less than one chunk (%d tokens: %d "
                    "bytes): puts %s", t.name, int(t.capacity_bytes), cfg.chunk_size,
                    slot_bytes, "fall through it" if len(small) < len(cfg.tiers)
                    else "store nothing: no tier can hold a chunk")


async def _get_matched(cache: Cache, eng: Engine, toks: np.ndarray,
                       out: torch.Tensor | None, td: int) -> Hit:
    """``Cache.get`` once its arguments are checked and counted."""
    matches = await eng.match(toks)
    total = _covered(matches)
    cache._count_request(len(toks), total)
    if total == 0:
        empty = (out.narrow(td, 0, 0) if out is not None
                 else torch.empty(cache.spec.shape(0), dtype=cache.spec.dtype,
                                  device=cache._device))
        return Hit(0, empty, {})
    dst = out if out is not None else torch.empty(
        cache.spec.shape(total), dtype=cache.spec.dtype, device=cache._device)
    by_tier: dict[str, int] = {}
    # The leading chunks the host top tier holds, by slot address in one copy (_resident);
    # the rest (usually none) by the general path, before those are touched and unpinned.
    res = await read_resident(eng, matches, dst) if len(matches) >= RESIDENT_MIN else None
    first = 0 if res is None else res.count
    read = False
    try:
        # A read from storage can fail part-way, or fail while a later chunk reads well: into
        # the caller's ``out`` it is staged, so that ``out`` past the hit is left as it was.
        found = await _read_into(eng, matches[first:], *_dense_dest(dst, td),
                                 staged=out is not None) \
            if first < len(matches) else []
        read = True
    finally:
        if res is not None:
            await release_resident(eng, res, served=read)
    if res is not None:
        by_tier[eng.tiers[0].name] = res.tokens
    names = eng.tier_by_name
    for m, _src, name in found:
        by_tier[name] = by_tier.get(name, 0) + m.num_tokens
    for name, n in by_tier.items():  # bytes are per token: summed once per tier
        names[name].c.bytes_out += cache.spec.nbytes(n)
    served = found[-1][0].start + found[-1][0].num_tokens if found else (
        0 if res is None else res.tokens)
    if served < total:
        eng.tok.hit_tokens -= total - served
        eng.tok.miss_tokens += total - served
    await _drop_in_runs(found)  # (its views)
    return Hit(served, _part(dst, td, 0, served), by_tier)


async def _retrieve_held(cache: Cache, eng: Engine, toks: np.ndarray, slots: torch.Tensor,
                         paged: transfer.Pages, skip_prefix: int) -> int:
    """``Cache.retrieve`` once its arguments are checked and counted."""
    td = cache.spec.token_dim
    matches = await eng.match(toks)
    total = _covered(matches)
    cache._count_request(len(toks), total)
    if total <= skip_prefix:
        return 0
    wanted = [m for m in matches if m.start + m.num_tokens > skip_prefix]
    # Into host pages, the leading chunks the host top tier holds go by slot address
    # (_resident); the rest by the general path, before those are touched and unpinned.
    got = await retrieve_resident(eng, wanted, slots, paged, skip_prefix) \
        if len(wanted) >= RESIDENT_MIN else None
    if got is None:
        return await _retrieve_rest(eng, td, wanted, slots, paged, skip_prefix)
    res, written = got
    read = False
    try:
        written += await _retrieve_rest(eng, td, wanted[res.count:], slots, paged, skip_prefix) \
            if res.count < len(wanted) else 0
        read = True
    finally:
        await release_resident(eng, res, served=read)
    return written


async def _retrieve_rest(eng: Engine, td: int, wanted: list[Match], slots: torch.Tensor,
                         paged: transfer.Pages, skip_prefix: int) -> int:
    """``retrieve``'s chunks ``wanted`` by the general path: pinned, their data from the
    tier holding each (promoted from below), one scatter of their views."""
    for m in wanted:
        eng.pin(m.entry)
    try:
        found = await eng.sources(wanted)
        srcs: list[torch.Tensor] = []
        runs: list[torch.Tensor] = []
        for m, src, _name in found:
            lo = max(m.start, skip_prefix)
            hi = m.start + m.num_tokens
            srcs.append(src.narrow(td, lo - m.start, hi - lo))
            runs.append(slots[lo:hi])
        if srcs:
            run = torch.cat(runs) if len(runs) > 1 else runs[0]
            device = accelerator_of([torch.empty(0, device=paged.device), *srcs])
            await eng.mover.run(
                lambda stream: _scatter_own(srcs, paged, run, stream=stream),
                device=device, nbytes=eng.mover.inline_bytes)
        eng.touch([m.entry for m, _, _ in found])
        return sum(s.shape[td] for s in srcs)
    finally:
        for m in wanted:
            eng.unpin(m.entry)


# -- input checks ------------------------------------------------------------------------------

async def _paged_args(cache: Cache, tokens: Any, kv_caches: Any, slot_mapping: Any,
                      layout: str | None, skip_prefix: int, ready: Any,
                      ready_timeout: float | None) -> tuple[np.ndarray, torch.Tensor,
                                                            transfer.Pages, bool]:
    """Check a store/retrieve call and await ``ready``; also return whether a slot is -1.
    Tokens or slots on a device are brought to the host in a worker thread *after*
    ``ready``: reading them on the loop would block it until the engine's stream has
    produced them."""
    ready_timeout = _validate.timeout(ready_timeout, "ready_timeout")
    paged = cache._pages_memo.open(kv_caches, layout)
    if paged.info is not cache._pages_fit:
        if paged.spec != cache.spec:
            raise ShapeError(f"kv_caches hold {paged.spec.describe()}, this cache stores "
                             f"{cache.spec.describe()}")
        cache._pages_fit = paged.info
    if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) or skip_prefix < 0:
        raise InvalidInputError(f"skip_prefix must be an int >= 0, got {skip_prefix!r}")
    # (before a tensor on a device is copied to the host: one on the meta device cannot be)
    if isinstance(tokens, torch.Tensor):
        check_token_memory(tokens)
    if isinstance(slot_mapping, torch.Tensor):
        check_has_data(slot_mapping, "slot_mapping")
    on_device = [x for x in (tokens, slot_mapping)
                 if isinstance(x, torch.Tensor) and x.device.type != "cpu"]
    if on_device:
        await devices.wait_ready(ready, ready_timeout)
        tokens, slot_mapping = await cache._engine.mover.in_thread(
            lambda: tuple(x.to("cpu") if isinstance(x, torch.Tensor) else x
                          for x in (tokens, slot_mapping)))
    toks = as_tokens(tokens)
    slots = transfer._as_slots(slot_mapping, len(toks))
    holes = transfer._check_slot_range(slots, paged.num_slots)
    if skip_prefix > len(toks):
        raise InvalidInputError(f"skip_prefix must be an int in [0, {len(toks)}], "
                                f"got {skip_prefix!r}")
    if not on_device:
        await devices.wait_ready(ready, ready_timeout)
    return toks, slots, paged, holes



def _check_kv(spec: KVSpec, kv: torch.Tensor, toks: np.ndarray, what: str,
              exact: bool = False) -> None:
    """``kv`` (``put``'s KV, ``get``'s ``out``) is dense KV of ``spec`` covering ``toks``
    (exactly, with ``exact``) on a device the cache can read and write."""
    have = spec.check_dense(kv, what=what)
    spec.check_memory(kv, what=what)
    n = len(toks)
    if exact and have != n:
        raise ShapeError(f"{what} holds {have} tokens, tokens has {n}: {what} must have "
                         f"shape {spec.shape(n)}")
    if have < n:
        raise ShapeError(f"{what} holds {have} tokens but tokens has {n}: the KV must cover "
                         f"every token")
    dev = kv.device
    if dev.type == "meta" or (dev.type != "cpu" and not devices.available(dev.type)):
        raise DeviceError(f"{what} is on device {dev}, which the cache cannot read or write")
    if dev.type not in ("cpu", *devices.ACCELERATORS):
        raise DeviceError(f"{what} is on device {dev}; use cpu, cuda or musa tensors")
