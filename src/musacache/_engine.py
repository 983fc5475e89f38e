"""Cache: the embedded engine. Directory, tier policy, single-flight, prefetch, write-behind.

Control path and data path are kept apart: every decision (match, pin, reserve, evict, commit)
is made synchronously on the event loop, where it cannot interleave with another; every byte
moved larger than ``inline_copy_bytes`` is moved in a worker thread (torch copies, lz4 and the
native module all release the GIL), so the loop is never blocked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from . import devices
from ._config import CacheConfig, DeviceTier, HostTier
from ._directory import Directory, Entry, Match
from ._errors import (
    CacheClosedError,
    ConfigError,
    DeviceError,
    FingerprintMismatchError,
    InvalidInputError,
    MusaCacheError,
    ShapeError,
)
from ._keys import Fingerprint, KeyChain, as_tokens
from .tiers.base import ChunkMeta, StorageTier, TierContext
from .tiers.memory import MemoryPool, Slot

__all__ = ["Cache", "Hit"]

log = logging.getLogger("musacache")


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


class _RateLimitedLog:
    """At most one log line per (tier, kind) every ``interval`` seconds; the rest are counted."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def warn(self, tier: str, kind: str, msg: str) -> None:
        now = time.monotonic()
        k = (tier, kind)
        if now - self._last.get(k, -1e9) >= self.interval:
            n = self._suppressed.pop(k, 0)
            extra = f" ({n} similar suppressed)" if n else ""
            log.warning("tier %s: %s: %s%s", tier, kind, msg, extra)
            self._last[k] = now
        else:
            self._suppressed[k] = self._suppressed.get(k, 0) + 1


def _counters(*names: str) -> dict[str, int]:
    return dict.fromkeys(names, 0)


class _MemTier:
    kind = "memory"

    def __init__(self, idx: int, cfg: HostTier | DeviceTier, slot_bytes: int) -> None:
        self.idx = idx
        self.name = cfg.name
        if isinstance(cfg, HostTier):
            self.device = torch.device("cpu")
            pinned = devices.has_accelerator() if cfg.pinned == "auto" else bool(cfg.pinned)
            if pinned and not devices.has_accelerator():
                raise ConfigError(f"{cfg.name}: pinned=True needs a cuda or musa device; "
                                  "use pinned='auto'")
        else:
            self.device = devices.resolve(cfg.device)
            pinned = False
        self.pool = MemoryPool(capacity_bytes=int(cfg.capacity_bytes), slot_bytes=slot_bytes,
                               device=self.device, pinned=pinned,
                               segment_bytes=int(cfg.segment_bytes))
        self.capacity_bytes = int(cfg.capacity_bytes)
        self.lru: OrderedDict[bytes, Entry] = OrderedDict()
        self.c = _counters("hits", "misses", "bytes_in", "bytes_out", "evictions", "promotions",
                           "demotions", "drops")

    def stats(self) -> dict[str, Any]:
        return {"kind": "device" if self.device.type != "cpu" or self.name == "device" else "host",
                "device": str(self.device), "pinned": self.pool.pinned, **self.c,
                "bytes_used": self.pool.bytes_used, "bytes_allocated": self.pool.bytes_allocated,
                "capacity_bytes": self.capacity_bytes, "chunks": len(self.lru),
                "slot_bytes": self.pool.slot_bytes}


class _StoreTier:
    kind = "storage"

    def __init__(self, idx: int, store: StorageTier, queue_bytes: int) -> None:
        self.idx = idx
        self.store = store
        self.name = store.name
        self.capacity: int | None = store.capacity_bytes
        self.used = 0
        self.lru: OrderedDict[bytes, Entry] = OrderedDict()
        self.pending: dict[bytes, bytes] = {}
        self.pending_bytes = 0
        self.queue_bytes = queue_bytes
        self.drained = anyio.Event()
        self.sem = anyio.Semaphore(max(1, int(store.max_concurrency)))
        self.refreshed: dict[bytes | None, float] = {}
        self.c = _counters("hits", "misses", "bytes_in", "bytes_out", "evictions", "faults",
                           "timeouts", "corrupt", "writes", "write_drops", "promotions",
                           "demotions", "refreshes", "drops")

    def stats(self) -> dict[str, Any]:
        return {"kind": type(self.store).__name__, **self.c, "bytes_used": self.used,
                "capacity_bytes": self.capacity, "chunks": len(self.lru),
                "pending_writes": len(self.pending), "pending_bytes": self.pending_bytes,
                "codec": self.store.codec, "write_through": self.store.write_through,
                **{f"store_{k}": v for k, v in self.store.stats().items()}}


_Tier = _MemTier | _StoreTier


# Dense puts copy this many bytes of new chunks per worker-thread call.
_PUT_BATCH_BYTES = 256 * 1024 * 1024
# Above about this many bytes per copy, torch's copy_ already runs on all intra-op threads.
_TORCH_PARALLEL_COPY_BYTES = 4 * 1024 * 1024


class _HeadUnavailable(Exception):
    """Internal: the cached head of a chunk that store() extends could not be read."""


class _Flight:
    """A promotion in flight; gets and prefetches of the same chunk join it."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.tensor: torch.Tensor | None = None  # the promoted (or at least readable) data
        self.source = ""  # the tier the data came from
        self.error: BaseException | None = None


class Cache:
    """The embedded KV cache. Use as ``async with Cache(config) as cache:``.

    All methods are coroutines and safe to call concurrently from many tasks of one event loop.
    Misses are values, failures are :class:`~musacache.MusaCacheError`.
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"Cache() takes a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.spec = config.spec
        self.fingerprint = Fingerprint(config.namespace, config.spec, config.chunk_size)
        salt = config.tenant.encode() if config.tenant else None
        self._chain = KeyChain(self.fingerprint, salt)
        self._dir = Directory(self._chain)
        self._slot_bytes = self.spec.nbytes(config.chunk_size)
        self._tiers: list[_Tier] = []
        self._mem: list[_MemTier] = []
        self._stores: list[_StoreTier] = []
        self._state = "new"
        self._limiter: anyio.CapacityLimiter | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._bg_idle = anyio.Event()
        self._bg_idle.set()
        self._flights: dict[bytes, _Flight] = {}
        self._put_flights: dict[bytes, anyio.Event] = {}
        self._wt_sem: anyio.Semaphore | None = None
        self._ops = _counters("puts", "gets", "lookups", "prefetches", "deletes")
        self._inflight = _counters("puts", "gets", "lookups", "prefetches", "promotions",
                                   "writes")
        self._tok = _counters("hit_tokens", "miss_tokens", "put_tokens", "stored_tokens")
        self._errlog = _RateLimitedLog()
        self._device = torch.device("cpu")

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Cache:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Create the tiers and learn what the storage tiers already hold."""
        if self._state != "new":
            raise CacheClosedError(f"Cache.open() called on a cache that is {self._state}")
        self._state = "opening"
        self._limiter = anyio.CapacityLimiter(self.config.copy_threads)
        self._wt_sem = anyio.Semaphore(max(2, self.config.copy_threads * 2))
        ctx = TierContext(self.fingerprint)
        started: list[StorageTier] = []
        try:
            for idx, cfg in enumerate(self.config.tiers):
                if isinstance(cfg, (HostTier, DeviceTier)):
                    mt = _MemTier(idx, cfg, self._slot_bytes)
                    self._tiers.append(mt)
                    self._mem.append(mt)
                    continue
                store = cfg.build() if hasattr(cfg, "build") else cfg
                if not isinstance(store, StorageTier):
                    raise ConfigError(f"tier {idx} ({type(cfg).__name__}) is neither a memory "
                                      "tier config nor a StorageTier")
                st = _StoreTier(idx, store, int(self.config.write_queue_bytes))
                self._tiers.append(st)
                self._stores.append(st)
                metas = await store.start(ctx)
                started.append(store)
                self._learn(st, metas)
        except BaseException:
            for store in started:
                with anyio.CancelScope(shield=True):
                    await store.aclose()
            self._state = "closed"
            raise
        self._device = self._mem[0].device if self._mem else torch.device("cpu")
        self._state = "open"

    async def aclose(self) -> None:
        """Wait for pending writes, then release every tier. Idempotent."""
        if self._state in ("closed", "closing", "new"):
            self._state = "closed"
            return
        self._state = "closing"
        with anyio.CancelScope(shield=True):
            try:
                if self.config.persist_on_close:
                    await self._persist()
                await self._drain()
            finally:
                for t in list(self._bg):
                    t.cancel()
                if self._bg:
                    await asyncio.gather(*self._bg, return_exceptions=True)
                for st in self._stores:
                    try:
                        await st.store.aclose()
                    except Exception as e:  # closing must release the rest regardless
                        log.warning("tier %s: error on close: %r", st.name, e)
                for mt in self._mem:
                    mt.lru.clear()
                    mt.pool.clear_memory()
                self._dir.entries.clear()
                self._dir.children.clear()
                self._state = "closed"

    async def _persist(self) -> None:
        """Write chunks held only in memory down to the first storage tier, parents first,
        so the chain a restarted cache rebuilds is whole."""
        if not self._stores:
            return
        first = self._stores[0]
        depth: dict[bytes, int] = {}

        def depth_of(e: Entry) -> int:
            chain: list[Entry] = []
            cur: Entry | None = e
            while cur is not None and cur.key not in depth:
                chain.append(cur)
                cur = self._dir.get(cur.parent)
            base = depth[cur.key] if cur is not None else 0
            for i, x in enumerate(reversed(chain)):
                depth[x.key] = base + i + 1
            return depth[e.key]

        todo = [e for e in self._dir.entries.values()
                if e.blocks and not any(self._holds(t, e) for t in self._stores)]
        for e in sorted(todo, key=depth_of):
            mt = self._hottest_mem(e)
            if mt is None or e.dead:
                continue
            self._pin(e)
            try:
                await self._demote(e, first.idx, self._entry_view(mt, e))
            except Exception as exc:  # closing must go on; the chunk is simply not persisted
                self._errlog.warn(first.name, "persist on close", repr(exc))
            finally:
                self._unpin(e)

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError(
                "the cache is closed" if self._state in ("closed", "closing")
                else "the cache is not open: use `async with Cache(config) as cache`")

    @property
    def device(self) -> torch.device:
        """Where ``get`` returns KV: the device of the hottest memory tier."""
        return self._device

    # -- the public API -------------------------------------------------------------------

    async def put(self, tokens: Any, kv: torch.Tensor) -> int:
        """Store the KV of ``tokens`` (dense ``spec.shape(T)``, any strides, ``T >= len(tokens)``).

        Returns once the cache owns a copy: the number of leading tokens of ``tokens`` now
        cached. Writes to lower tiers happen in the background.
        """
        self._check_open()
        toks = as_tokens(tokens)
        self._check_kv(kv, toks, "kv")
        self._ops["puts"] += 1
        self._inflight["puts"] += 1
        try:
            return await self._put(toks, lambda s, n: kv.narrow(self.spec.token_dim, s, n))
        finally:
            self._inflight["puts"] -= 1

    async def lookup(self, tokens: Any) -> int:
        """The length of the longest prefix of ``tokens`` cached in any tier. Moves no data."""
        self._check_open()
        toks = as_tokens(tokens)
        self._ops["lookups"] += 1
        self._inflight["lookups"] += 1
        try:
            matches = await self._match(toks)
            return sum(m.num_tokens for m in matches)
        finally:
            self._inflight["lookups"] -= 1

    async def get(self, tokens: Any, out: torch.Tensor | None = None) -> Hit:
        """The KV of the longest cached prefix of ``tokens``.

        With ``out`` (any strided tensor of ``spec.shape(len(tokens))``), the KV is written
        into it and ``hit.kv`` is a view of it. A miss is ``hit.num_tokens == 0``.
        """
        self._check_open()
        toks = as_tokens(tokens)
        if out is not None:
            self._check_kv(out, toks, "out", exact=True)
        self._ops["gets"] += 1
        self._inflight["gets"] += 1
        try:
            matches = await self._match(toks)
            total = sum(m.num_tokens for m in matches)
            self._count_request(len(toks), total)
            if total == 0:
                empty = (out.narrow(self.spec.token_dim, 0, 0) if out is not None
                         else torch.empty(self.spec.shape(0), dtype=self.spec.dtype,
                                          device=self._device))
                return Hit(0, empty, {})
            dst = out if out is not None else torch.empty(
                self.spec.shape(total), dtype=self.spec.dtype, device=self._device)
            served, by_tier = await self._read_matches(matches, dst)
            if served < total:
                self._tok["hit_tokens"] -= total - served
                self._tok["miss_tokens"] += total - served
            return Hit(served, dst.narrow(self.spec.token_dim, 0, served), by_tier)
        finally:
            self._inflight["gets"] -= 1

    async def prefetch(self, tokens: Any, timeout: float | None = None) -> int:
        """Promote the cached prefix of ``tokens`` into the hottest tier.

        Without ``timeout``: schedule the promotion and return at once the number of prefix
        tokens being brought up. With ``timeout=s``: wait up to ``s`` seconds and return the
        number of prefix tokens already resident in the hottest tier; the rest carries on.
        """
        self._check_open()
        toks = as_tokens(tokens)
        self._ops["prefetches"] += 1
        self._inflight["prefetches"] += 1
        try:
            matches = await self._match(toks)
            flights = [self._promotion(m.entry) for m in matches
                       if not self._in_top(m.entry)]
            if timeout is None:
                return sum(m.num_tokens for m in matches)
            with anyio.move_on_after(timeout):
                for f in flights:
                    await f.done.wait()
            return self._top_prefix(matches)
        finally:
            self._inflight["prefetches"] -= 1

    async def store(self, tokens: Any, kv_caches: Any, slot_mapping: Any, *,
                    layout: str = "vllm", skip_prefix: int = 0, ready: Any = None,
                    ready_timeout: float | None = None) -> int:
        """Store the KV of ``tokens``, gathered from an engine's paged ``kv_caches``.

        ``slot_mapping[i]`` is the slot of ``tokens[i]`` in the pages (see
        :mod:`musacache.transfer` for the layouts). The first ``skip_prefix`` tokens are not
        read (the engine got them from this cache). A chunk holding a -1 slot past
        ``skip_prefix`` ends the store: its KV is not in the pages. ``ready`` (a host or
        device event) is awaited, without blocking the loop, before the pages are read.
        Returns the number of leading tokens of ``tokens`` now cached, as ``put`` does.
        """
        self._check_open()
        toks = as_tokens(tokens)
        slots, paged = self._check_paged(toks, kv_caches, slot_mapping, layout, skip_prefix)
        self._ops["puts"] += 1
        self._inflight["puts"] += 1
        head: Match | None = None
        try:
            await devices.wait_ready(ready, ready_timeout)
            valid = self._first_skip(slots, skip_prefix)
            td = self.spec.token_dim
            if skip_prefix % self.config.chunk_size:
                # The skipped prefix ends inside a chunk. The pages must not be read there, but
                # the cache itself holds those tokens (the engine retrieved them from us, for
                # example a partial tail of the last turn): the new, longer chunk is built from
                # the cached head plus the pages after skip_prefix.
                matches = await self._match(toks[:skip_prefix])
                if matches and sum(m.num_tokens for m in matches) == skip_prefix:
                    head = matches[-1]
                    self._pin(head.entry)

            async def fill(dst: torch.Tensor, start: int, n: int) -> None:
                if head is not None and start == head.start and start < skip_prefix:
                    k = skip_prefix - start
                    src, _tier = await self._read_entry(head.entry)
                    if src is None:
                        raise _HeadUnavailable
                    await self._copy(dst.narrow(td, 0, k), src.narrow(td, 0, k))
                    if n > k:
                        await self._gather_into(kv_caches, slots[skip_prefix:start + n],
                                                dst.narrow(td, k, n - k), layout,
                                                paged.device)
                    return
                await self._gather_into(kv_caches, slots[start:start + n], dst, layout,
                                        paged.device)

            return await self._put(toks[:valid], lambda s, n: torch.empty(0), fill,
                                   skip_prefix=skip_prefix,
                                   head_start=head.start if head is not None else None)
        finally:
            if head is not None:
                self._unpin(head.entry)
            self._inflight["puts"] -= 1

    async def _read_entry(self, e: Entry) -> tuple[torch.Tensor | None, str]:
        """The data of ``e`` from wherever it lives (promoting it if it is below the top)."""
        top = self._top_view(e)
        return top if top is not None else await self._fetch(e)

    def _top_view(self, e: Entry) -> tuple[torch.Tensor, str] | None:
        """``e``'s block in the top tier, counted as a hit there; None (a miss there) if it
        lives only lower down."""
        t = self._hottest_mem(e)
        if t is not None and t.idx == 0:
            t.c["hits"] += 1
            return self._entry_view(t, e), t.name
        self._tiers[0].c["misses"] += 1
        return None

    async def retrieve(self, tokens: Any, kv_caches: Any, slot_mapping: Any, *,
                       layout: str = "vllm", skip_prefix: int = 0, ready: Any = None,
                       ready_timeout: float | None = None) -> int:
        """Write the cached prefix of ``tokens`` into an engine's paged ``kv_caches``.

        Tokens before ``skip_prefix`` (the engine holds them) are neither read nor overwritten;
        slots of -1 are skipped. ``ready`` is awaited before the pages are written. Returns the
        number of tokens written: the cached prefix length minus ``skip_prefix`` (0 if the
        cached prefix is shorter). Every argument is checked before any page is touched.
        """
        self._check_open()
        toks = as_tokens(tokens)
        slots, paged = self._check_paged(toks, kv_caches, slot_mapping, layout, skip_prefix)
        self._ops["gets"] += 1
        self._inflight["gets"] += 1
        try:
            await devices.wait_ready(ready, ready_timeout)
            matches = await self._match(toks)
            total = sum(m.num_tokens for m in matches)
            self._count_request(len(toks), total)
            if total <= skip_prefix:
                return 0
            td = self.spec.token_dim
            # Read the matched chunks like get() (pinned, promoted), then scatter each
            # chunk's tokens past skip_prefix straight into the pages.
            for m in matches:
                self._pin(m.entry)
            try:
                written = 0
                served: list[Entry] = []
                for m in matches:
                    lo = max(m.start, skip_prefix)
                    hi = m.start + m.num_tokens
                    if hi <= lo:
                        continue
                    src, _name = await self._read_entry(m.entry)
                    if src is None:
                        break
                    part = src.narrow(td, lo - m.start, hi - lo)
                    await self._scatter_from(part, kv_caches, slots[lo:hi], layout,
                                             paged.device)
                    written += hi - lo
                    served.append(m.entry)
                self._touch(served)
                return written
            finally:
                for m in matches:
                    self._unpin(m.entry)
        finally:
            self._inflight["gets"] -= 1

    def _check_paged(self, toks: np.ndarray, kv_caches: Any, slot_mapping: Any, layout: str,
                     skip_prefix: int) -> tuple[torch.Tensor, Any]:
        from . import transfer

        paged = transfer.describe(kv_caches, layout)
        if paged.spec() != self.spec:
            raise ShapeError(f"kv_caches hold {paged.spec().describe()}, this cache stores "
                             f"{self.spec.describe()}")
        slots = transfer._as_slots(slot_mapping, len(toks))
        transfer._check_slot_range(slots, paged.num_slots)
        if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) \
                or not 0 <= skip_prefix <= len(toks):
            raise InvalidInputError(f"skip_prefix must be an int in [0, {len(toks)}], "
                                    f"got {skip_prefix!r}")
        return slots, paged

    @staticmethod
    def _first_skip(slots: torch.Tensor, skip_prefix: int) -> int:
        """Tokens before the first -1 slot at or after ``skip_prefix``."""
        tail = slots[skip_prefix:]
        holes = (tail == -1).nonzero()
        return skip_prefix + int(holes[0, 0]) if holes.numel() else len(slots)

    async def _gather_into(self, kv_caches: Any, slots: torch.Tensor, dst: torch.Tensor,
                           layout: str, pages_device: torch.device) -> None:
        from . import transfer

        if dst.device == pages_device:
            await self._in_thread(lambda: transfer.gather(kv_caches, slots, dst, layout))
            return
        tmp = torch.empty(dst.shape, dtype=dst.dtype, device=pages_device)
        await self._in_thread(lambda: transfer.gather(
            kv_caches, slots.to(pages_device), tmp, layout))
        await self._copy(dst, tmp)

    async def _scatter_from(self, src: torch.Tensor, kv_caches: Any, slots: torch.Tensor,
                            layout: str, pages_device: torch.device) -> None:
        from . import transfer

        if src.device != pages_device:
            staged = torch.empty(src.shape, dtype=src.dtype, device=pages_device)
            await self._copy(staged, src)
            src = staged
            slots = slots.to(pages_device)
        await self._in_thread(lambda: transfer.scatter(src, kv_caches, slots, layout))

    async def delete(self, tokens: Any) -> int:
        """Forget the chunks of ``tokens`` (and every chunk that extends them) in all tiers.
        Returns the number of chunks removed."""
        self._check_open()
        toks = as_tokens(tokens)
        self._ops["deletes"] += 1
        doomed: list[Entry] = []
        for _s, _e, _p, key in self._chain.iter_keys(toks):
            e = self._dir.get(key)
            if e is None:
                break
            doomed.append(e)
        if doomed:
            doomed.extend(self._dir.descendants(doomed[-1]))
        await self._remove_entries(doomed)
        return len(doomed)

    async def clear(self) -> None:
        """Forget every chunk in every tier (storage objects of this fingerprint included)."""
        self._check_open()
        await self._remove_entries(list(self._dir.entries.values()))

    async def flush(self) -> None:
        """Wait until every background write (write-behind, write-through) has finished."""
        self._check_open()
        await self._drain()

    async def stats(self) -> dict[str, Any]:
        """Counters: per tier hits, misses, bytes in/out, evictions, bytes used, capacity;
        operations in flight; tokens hit and missed; pins held."""
        return {
            "namespace": self.config.namespace,
            "chunk_size": self.config.chunk_size,
            "device": str(self._device),
            "state": self._state,
            "chunks": len(self._dir),
            "pins": sum(e.pins for e in self._dir.entries.values()),
            "tiers": {t.name: t.stats() for t in self._tiers},
            "ops": dict(self._ops),
            "in_flight": {**self._inflight, "background": len(self._bg)},
            "tokens": dict(self._tok),
            "capabilities": {k: devices.capabilities(k).to_dict()
                             for k in ("cpu", *devices.ACCELERATORS)},
        }

    # -- engine API used by store/retrieve (paged caches) ---------------------------------

    async def _put(self, toks: np.ndarray,
                   source: Callable[[int, int], torch.Tensor],
                   fill: Callable[[torch.Tensor, int, int], Awaitable[None]] | None = None,
                   skip_prefix: int = 0, head_start: int | None = None) -> int:
        """Place each chunk of ``toks`` not yet cached; return the cached prefix length.

        ``source(start, n)`` gives the dense KV of tokens ``[start, start+n)``; ``fill``, when
        given, writes them into a destination tensor instead (the paged gather path).
        """
        # Every chunk of this prompt stays pinned until the put ends: placing its tail must
        # never evict its own head (the head is what other prompts share).
        held: list[Entry] = []
        # Dense puts reserve slots for several chunks, then copy them in one worker-thread
        # call: one thread hop per chunk costs about a fifth of the copy bandwidth.
        batch: list[tuple[_MemTier, Slot, Entry, anyio.Event, torch.Tensor, torch.Tensor]] = []
        stored_to = 0

        async def flush() -> None:
            if not batch:
                return
            await self._copy_many([(dst, src) for *_, dst, src in batch])
            for t, slot, e, flight, _dst, _src in batch:
                self._commit_block(t, slot, e)
                self._pin(e)
                held.append(e)
                del self._put_flights[e.key]
                flight.set()
            batch.clear()

        try:
            for start, end, parent, key in self._chain.iter_keys(toks):
                n = end - start
                e = self._dir.get(key)
                while e is None and key in self._put_flights:
                    # Single-flight: another put is placing this chunk; if it was cancelled,
                    # the first of its waiters to wake takes over.
                    await self._put_flights[key].wait()
                    e = self._dir.get(key)
                if e is None:
                    if start < skip_prefix and start != head_start:
                        # The caller said not to read these tokens, and we do not hold them:
                        # nothing after them can be chained.
                        break
                    flight = anyio.Event()
                    self._put_flights[key] = flight
                    if fill is None:
                        try:
                            reserved = await self._reserve_in_memory(key, parent, toks[start:end])
                        except BaseException:
                            del self._put_flights[key]
                            flight.set()
                            raise
                        if reserved is not None:
                            t, slot, e = reserved
                            batch.append((t, slot, e, flight, self._block_view(slot, n),
                                          source(start, n)))
                            self._tok["put_tokens"] += n
                            stored_to = end
                            if sum(x[2].raw_bytes for x in batch) >= _PUT_BATCH_BYTES:
                                await flush()
                            continue
                    try:
                        await flush()  # commit in order before the slow path
                        e = await self._place(key, parent, toks[start:end], start, source, fill)
                    except _HeadUnavailable:
                        e = None  # the cached head vanished (a cold fault): store stops here
                    finally:
                        del self._put_flights[key]
                        flight.set()
                    if e is None:
                        break
                    self._tok["put_tokens"] += n
                else:
                    self._touch([e])
                self._pin(e)
                held.append(e)
                stored_to = end
            await flush()
        finally:
            for t, slot, e, flight, _dst, _src in batch:  # only left on error or cancellation
                t.pool.release(slot.index)
                self._put_flights.pop(e.key, None)
                flight.set()
            for e in held:
                self._unpin(e)
        self._tok["stored_tokens"] += stored_to
        return stored_to

    async def _reserve_in_memory(self, key: bytes, parent: bytes, toks: np.ndarray,
                                 ) -> tuple[_MemTier, Slot, Entry] | None:
        """A slot for a new chunk in the hottest memory tier with room (evicting as needed);
        None if a storage tier comes first or no memory tier has room."""
        n = len(toks)
        for t in self._tiers:
            if not isinstance(t, _MemTier):
                return None
            slot = await self._alloc(t)
            if slot is not None:
                return t, slot, Entry(key, parent, n, self.spec.nbytes(n), toks.copy())
        return None

    def _commit_block(self, t: _MemTier, slot: Slot, e: Entry) -> None:
        """Make a chunk whose bytes are in ``slot`` visible: only now can it be found."""
        e.blocks[t.idx] = slot
        t.lru[e.key] = e
        t.c["bytes_in"] += e.raw_bytes
        self._dir.add(e)
        self._schedule_write_through(e)

    # -- matching ---------------------------------------------------------------------------

    async def _match(self, toks: np.ndarray) -> list[Match]:
        matches, stop_parent = self._dir.match(toks)
        covered = sum(m.num_tokens for m in matches)
        if covered < len(toks) and stop_parent is not None and await self._refresh(stop_parent):
            matches, _ = self._dir.match(toks)
        return matches

    async def _refresh(self, parent: bytes) -> bool:
        """Ask shared storage tiers for chunks under ``parent`` that other nodes wrote.

        Follows the chain down while it finds more, each parent at most once per
        ``refresh_interval``, all within the tier's timeout. True if anything was learned.
        """
        learned = False
        for st in self._stores:
            if not st.store.shared:
                continue
            cur: bytes | None = parent
            with anyio.move_on_after(st.store.timeout):
                while cur is not None:
                    now = time.monotonic()
                    if now - st.refreshed.get(cur, -1e9) < self.config.refresh_interval:
                        break
                    st.refreshed[cur] = now
                    try:
                        metas = await st.store.refresh(cur)
                    except Exception as e:
                        st.c["faults"] += 1
                        self._errlog.warn(st.name, "refresh", repr(e))
                        break
                    st.c["refreshes"] += 1
                    new = self._learn(st, metas)
                    learned = learned or bool(new)
                    # Keep walking down a single new child: that is a longer cached prefix.
                    cur = new[0].key if len(new) == 1 else None
        return learned

    def _learn(self, st: _StoreTier, metas: Iterable[ChunkMeta]) -> list[Entry]:
        """Record chunks a storage tier reports; returns the entries that were new to it."""
        new: list[Entry] = []
        ordered = sorted(metas, key=lambda m: m.last_used)
        for m in ordered:
            if m.raw_bytes != self.spec.nbytes(m.num_tokens) or not (
                    0 < m.num_tokens <= self.config.chunk_size):
                continue  # not a chunk of this spec: never serve it
            e = self._dir.get(m.key)
            if e is None:
                e = Entry(m.key, m.parent, m.num_tokens, m.raw_bytes, None)
                self._dir.add(e)
            if st.idx not in e.stored and st.idx not in e.pending:
                e.stored[st.idx] = m.stored_bytes
                st.used += m.stored_bytes
                st.lru[m.key] = e
                new.append(e)
        return new

    # -- placing new chunks -----------------------------------------------------------------

    async def _place(self, key: bytes, parent: bytes, toks: np.ndarray, start: int,
                     source: Callable[[int, int], torch.Tensor],
                     fill: Callable[[torch.Tensor, int, int], Awaitable[None]] | None,
                     ) -> Entry | None:
        n = len(toks)
        e = Entry(key, parent, n, self.spec.nbytes(n), toks.copy())
        for t in self._tiers:
            if isinstance(t, _MemTier):
                slot = await self._alloc(t)
                if slot is None:
                    continue
                dst = self._block_view(slot, n)
                try:
                    if fill is not None:
                        await fill(dst, start, n)
                    else:
                        await self._copy(dst, source(start, n))
                except BaseException:
                    t.pool.release(slot.index)
                    raise
                self._commit_block(t, slot, e)
                return e
            # No memory tier had room: encode straight into a storage tier.
            data = await self._host_copy_of(source, fill, start, n)
            obj = await self._encode(t, e, data)
            self._dir.add(e)
            if await self._enqueue_write(t, e, obj):
                return e
            self._dir.remove(e)
        return None

    async def _host_copy_of(self, source: Callable[[int, int], torch.Tensor],
                            fill: Callable[[torch.Tensor, int, int], Awaitable[None]] | None,
                            start: int, n: int) -> torch.Tensor:
        dst = torch.empty(self.spec.shape(n), dtype=self.spec.dtype)
        if fill is not None:
            await fill(dst, start, n)
        else:
            await self._copy(dst, source(start, n))
        return dst

    def _block_view(self, slot: Slot, n: int) -> torch.Tensor:
        return slot.view(self.spec.dtype, self.spec.shape(n))

    def _entry_view(self, t: _MemTier, e: Entry) -> torch.Tensor:
        return self._block_view(e.blocks[t.idx], e.num_tokens)

    async def _alloc(self, t: _MemTier) -> Slot | None:
        """A free slot in ``t``, evicting (leaves first, LRU) to make room; None if all pinned."""
        while True:
            idx = t.pool.reserve()
            if idx is not None:
                try:
                    return await t.pool.materialize(idx)
                except BaseException:
                    t.pool.release(idx)
                    raise
            if not await self._evict_one(t):
                return None

    def _victim(self, t: _Tier) -> Entry | None:
        for key, e in t.lru.items():
            if e.pins or (isinstance(t, _StoreTier) and key in t.pending):
                continue  # pinned by a reader, or its write to this tier is still queued
            if any(self._holds(t, c) for c in self._dir.child_entries(key)):
                continue  # leaves first: a suffix is worthless without its prefix
            return e
        return None

    @staticmethod
    def _holds(t: _Tier, e: Entry) -> bool:
        if isinstance(t, _MemTier):
            return t.idx in e.blocks
        return t.idx in e.stored or t.idx in e.pending

    async def _evict_one(self, t: _MemTier) -> bool:
        e = self._victim(t)
        if e is None:
            return False
        self._pin(e)
        try:
            await self._demote(e, t.idx + 1, self._entry_view(t, e))
        finally:
            slot = e.blocks.pop(t.idx, None)
            t.lru.pop(e.key, None)
            t.c["evictions"] += 1
            if slot is not None:
                e.detached.append((t.idx, slot))
            self._unpin(e)
            if not e.resident and not e.dead:
                self._dir.remove(e)
        return True

    async def _demote(self, e: Entry, from_idx: int, data: torch.Tensor) -> None:
        """Keep a copy of ``e`` in the first tier at or below ``from_idx`` that takes it."""
        for t in self._tiers[from_idx:]:
            if self._holds(t, e):
                return
            if isinstance(t, _MemTier):
                slot = await self._alloc(t)
                if slot is None:
                    continue
                try:
                    await self._copy(self._block_view(slot, e.num_tokens), data)
                except BaseException:
                    t.pool.release(slot.index)
                    raise
                if e.dead:
                    t.pool.release(slot.index)
                    return
                e.blocks[t.idx] = slot
                t.lru[e.key] = e
                t.c["demotions"] += 1
                t.c["bytes_in"] += e.raw_bytes
                return
            obj = await self._encode(t, e, data)
            if await self._enqueue_write(t, e, obj):
                t.c["demotions"] += 1
                return
        if from_idx > 0:
            self._tiers[from_idx - 1].c["drops"] += 1  # nowhere below had room: data is gone

    # -- reading ---------------------------------------------------------------------------

    def _in_top(self, e: Entry) -> bool:
        return bool(self._tiers) and self._holds(self._tiers[0], e)

    def _top_prefix(self, matches: Sequence[Match]) -> int:
        n = 0
        for m in matches:
            if not self._in_top(m.entry):
                break
            n += m.num_tokens
        return n

    def _count_request(self, asked: int, found: int) -> None:
        self._tok["hit_tokens"] += found
        self._tok["miss_tokens"] += asked - found

    async def _read_matches(self, matches: list[Match], dst: torch.Tensor,
                            ) -> tuple[int, dict[str, int]]:
        """Copy every match into ``dst``; return the contiguous prefix served and per-tier
        token counts. Entries are pinned for the whole read."""
        for m in matches:
            self._pin(m.entry)
        try:
            sources: list[tuple[Match, torch.Tensor | None, str]] = []
            slow: list[tuple[int, Match]] = []
            for i, m in enumerate(matches):
                top = self._top_view(m.entry)
                if top is not None:
                    sources.append((m, *top))
                else:
                    sources.append((m, None, ""))
                    slow.append((i, m))
            if slow:
                results: dict[int, tuple[torch.Tensor | None, str]] = {}
                failures: list[MusaCacheError] = []

                async def fetch(i: int, m: Match) -> None:
                    try:
                        results[i] = await self._fetch(m.entry)
                    except MusaCacheError as exc:  # re-raised bare, not in an ExceptionGroup
                        failures.append(exc)
                        results[i] = (None, "")

                async with anyio.create_task_group() as tg:
                    for i, m in slow:
                        tg.start_soon(fetch, i, m)
                if failures:
                    raise failures[0]
                for i, _m in slow:
                    tensor, name = results[i]
                    sources[i] = (sources[i][0], tensor, name)
            served = 0
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            by_tier: dict[str, int] = {}
            td = self.spec.token_dim
            for m, src, name in sources:
                if src is None:
                    break
                copies.append((dst.narrow(td, m.start, m.num_tokens),
                               src.narrow(td, 0, m.num_tokens)))
                by_tier[name] = by_tier.get(name, 0) + m.num_tokens
                served = m.start + m.num_tokens
            await self._copy_many(copies)
            self._touch([m.entry for m in matches[: len(copies)]])
            for m, _src, name in sources[: len(copies)]:
                for tier in self._tiers:
                    if tier.name == name:
                        tier.c["bytes_out"] += self.spec.nbytes(m.num_tokens)
            return served, by_tier
        finally:
            for m in matches:
                self._unpin(m.entry)

    def _hottest_mem(self, e: Entry) -> _MemTier | None:
        for t in self._mem:
            if t.idx in e.blocks:
                return t
        return None

    async def _fetch(self, e: Entry) -> tuple[torch.Tensor | None, str]:
        """Data of ``e`` from below the top tier, promoting it on the way (single-flight)."""
        flight = self._promotion(e)
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error
        if flight.tensor is not None:
            return flight.tensor, flight.source
        return None, ""

    def _promotion(self, e: Entry) -> _Flight:
        """Join or start the promotion of ``e`` into the top tier."""
        if self._in_top(e) and isinstance(self._tiers[0], _MemTier):
            f = _Flight()
            f.tensor = self._entry_view(self._tiers[0], e)
            f.source = self._tiers[0].name
            f.done.set()
            return f
        joined = self._flights.get(e.key)
        if joined is not None:
            return joined
        f = _Flight()
        self._flights[e.key] = f
        self._spawn(self._promote(e, f))
        return f

    async def _promote(self, e: Entry, f: _Flight) -> None:
        self._pin(e)
        self._inflight["promotions"] += 1
        try:
            data, src_tier = await self._read_lower(e)
            f.tensor = data
            top = self._tiers[0]
            if data is not None and isinstance(top, _MemTier) and not e.dead \
                    and top.idx not in e.blocks:
                slot = await self._alloc(top)
                if slot is not None:
                    view = self._block_view(slot, e.num_tokens)
                    try:
                        await self._copy(view, data)
                    except BaseException:
                        top.pool.release(slot.index)
                        raise
                    if e.dead:
                        top.pool.release(slot.index)
                    else:
                        e.blocks[top.idx] = slot
                        top.lru[e.key] = e
                        top.c["promotions"] += 1
                        top.c["bytes_in"] += e.raw_bytes
                        f.tensor = view
            if src_tier is not None:
                src_tier.c["hits"] += 1
                f.source = src_tier.name
        except FingerprintMismatchError as exc:
            f.error = exc
        except Exception as exc:  # a fault below the top tier is a miss, never a crash
            self._errlog.warn("engine", "promotion", repr(exc))
            f.tensor = None
        finally:
            self._inflight["promotions"] -= 1
            self._flights.pop(e.key, None)
            f.done.set()
            self._unpin(e)

    async def _read_lower(self, e: Entry) -> tuple[torch.Tensor | None, _Tier | None]:
        """The data of ``e`` from the hottest tier that can produce it."""
        for t in self._tiers:
            if isinstance(t, _MemTier):
                if t.idx in e.blocks:
                    return self._entry_view(t, e), t
                continue
            if t.idx in e.pending or t.idx in e.stored:
                data = await self._read_store(t, e)
                if data is not None:
                    return data, t
        return None, None

    async def _read_store(self, t: _StoreTier, e: Entry) -> torch.Tensor | None:
        from .codec import decode_chunk

        obj = t.pending.get(e.key)
        meta = self._meta(e, t)
        if obj is None:
            if t.idx not in e.stored:
                return None
            try:
                async with t.sem:
                    with anyio.fail_after(t.store.timeout):
                        obj = await t.store.read(meta)
            except TimeoutError:
                t.c["timeouts"] += 1
                t.c["faults"] += 1
                t.c["misses"] += 1
                self._errlog.warn(t.name, "timeout", f"read took over {t.store.timeout} s")
                return None
            except Exception as exc:  # TierError, or anything a plug-in tier lets escape
                t.c["faults"] += 1
                t.c["misses"] += 1
                self._errlog.warn(t.name, "read fault", repr(exc))
                return None
            if obj is None:
                t.c["misses"] += 1
                self._drop_stored(t, e)
                return None
        try:
            _, data = await self._in_thread(
                lambda: decode_chunk(self.fingerprint, obj, expect=meta))
        except FingerprintMismatchError:
            raise
        except MusaCacheError as exc:
            t.c["corrupt"] += 1
            t.c["misses"] += 1
            self._errlog.warn(t.name, "corrupt chunk", f"{e.key.hex()}: {exc}")
            self._drop_stored(t, e)
            self._spawn(self._quiet_delete(t, e.key))
            return None
        t.c["bytes_out"] += len(obj)
        return data

    def _drop_stored(self, t: _StoreTier, e: Entry) -> None:
        size = e.stored.pop(t.idx, None)
        if size is not None:
            t.used -= size
            t.lru.pop(e.key, None)
        if not e.resident and not e.dead:
            self._dir.remove(e)

    async def _quiet_delete(self, t: _StoreTier, key: bytes) -> None:
        try:
            with anyio.fail_after(t.store.timeout):
                await t.store.delete(key)
        except Exception as exc:
            t.c["faults"] += 1
            self._errlog.warn(t.name, "delete fault", repr(exc))

    def _meta(self, e: Entry, t: _StoreTier | None = None) -> ChunkMeta:
        stored = e.stored.get(t.idx, 0) if t is not None else 0
        return ChunkMeta(e.key, e.parent, e.num_tokens, e.raw_bytes, stored)

    # -- storage writes ---------------------------------------------------------------------

    async def _encode(self, t: _StoreTier, e: Entry, data: torch.Tensor) -> bytes:
        from .codec import encode_chunk

        if data.device.type != "cpu":
            host = torch.empty(data.shape, dtype=data.dtype)
            await self._copy(host, data)
            data = host
        elif not data.is_contiguous():
            data = data.contiguous()
        meta = self._meta(e)
        return await self._in_thread(lambda: encode_chunk(self.fingerprint, meta, data,
                                                          t.store.codec))

    async def _enqueue_write(self, t: _StoreTier, e: Entry, obj: bytes) -> bool:
        """Queue ``obj`` for a background write to ``t`` (with backpressure); False if ``t``
        cannot take it."""
        size = len(obj)
        while t.pending_bytes and t.pending_bytes + size > t.queue_bytes:
            if t.drained.is_set():
                t.drained = anyio.Event()
            await t.drained.wait()
        if t.capacity is not None:
            if size > t.capacity or not await self._make_room(t, size):
                t.c["write_drops"] += 1
                return False
        if self._holds(t, e) or e.dead:
            return True  # another task wrote it while we waited
        t.used += size
        t.pending[e.key] = obj
        t.pending_bytes += size
        e.pending.add(t.idx)
        self._spawn(self._write_job(t, e, obj))
        return True

    async def _make_room(self, t: _StoreTier, size: int) -> bool:
        cap = t.capacity if t.capacity is not None else 0
        while t.used + size > cap:
            e = self._victim(t)
            if e is None:
                return False
            self._pin(e)
            try:
                if t.idx in e.stored and not self._held_below(e, t.idx):
                    data = await self._read_store(t, e)
                    if data is not None and not e.dead:
                        await self._demote(e, t.idx + 1, data)
            finally:
                self._unpin(e)
            if t.idx in e.stored:
                t.c["evictions"] += 1
                self._drop_stored(t, e)
                await self._quiet_delete(t, e.key)
        return True

    def _held_below(self, e: Entry, idx: int) -> bool:
        return any(self._holds(t, e) for t in self._tiers[idx + 1 :])

    async def _write_job(self, t: _StoreTier, e: Entry, obj: bytes) -> None:
        self._inflight["writes"] += 1
        ok = False
        try:
            async with t.sem:
                await t.store.write(self._meta(e, t), obj)
            ok = True
            t.c["writes"] += 1
            t.c["bytes_in"] += len(obj)
        except Exception as exc:  # retries are the tier's; after them, drop and count
            t.c["write_drops"] += 1
            self._errlog.warn(t.name, "write dropped", repr(exc))
        finally:
            self._inflight["writes"] -= 1
            t.pending.pop(e.key, None)
            t.pending_bytes -= len(obj)
            e.pending.discard(t.idx)
            t.drained.set()
            if ok and not e.dead:
                e.stored[t.idx] = len(obj)
                t.lru[e.key] = e
                t.lru.move_to_end(e.key, last=False)  # demoted data is the coldest here
            else:
                t.used -= len(obj)
                if ok and e.dead:
                    self._spawn(self._quiet_delete(t, e.key))
                if not e.resident and not e.dead:
                    self._dir.remove(e)

    def _schedule_write_through(self, e: Entry) -> None:
        for t in self._stores:
            if t.store.write_through and not self._holds(t, e):
                self._spawn(self._write_through(t, e))

    async def _write_through(self, t: _StoreTier, e: Entry) -> None:
        if self._wt_sem is None:
            return
        async with self._wt_sem:
            if e.dead or self._holds(t, e):
                return
            mt = self._hottest_mem(e)
            if mt is None:
                return
            self._pin(e)
            try:
                obj = await self._encode(t, e, self._entry_view(mt, e))
            finally:
                self._unpin(e)
            await self._enqueue_write(t, e, obj)

    # -- removal ---------------------------------------------------------------------------

    async def _remove_entries(self, doomed: list[Entry]) -> None:
        deletes: list[tuple[_StoreTier, bytes]] = []
        for e in doomed:
            if e.dead:
                continue
            e.dead = True
            self._dir.remove(e)
            for mt in self._mem:
                slot = e.blocks.pop(mt.idx, None)
                if slot is not None:
                    mt.lru.pop(e.key, None)
                    e.detached.append((mt.idx, slot))
            for st in self._stores:
                if st.idx in e.stored:
                    st.used -= e.stored.pop(st.idx)
                    st.lru.pop(e.key, None)
                    deletes.append((st, e.key))
            if e.pins == 0:
                self._free_detached(e)
        for st, key in deletes:
            await self._quiet_delete(st, key)

    # -- pins, LRU, copies, background ---------------------------------------------------------

    def _pin(self, e: Entry) -> None:
        e.pins += 1

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            self._free_detached(e)

    def _free_detached(self, e: Entry) -> None:
        while e.detached:
            idx, slot = e.detached.pop()
            t = self._tiers[idx]
            if isinstance(t, _MemTier):
                t.pool.release(slot.index)
        if e.dead:
            for idx in list(e.blocks):
                slot = e.blocks.pop(idx)
                t = self._tiers[idx]
                if isinstance(t, _MemTier):
                    t.pool.release(slot.index)

    def _touch(self, entries: Sequence[Entry]) -> None:
        # Children first, parents last: the parents end up most recent, so LRU order alone
        # already puts leaves ahead of their prefixes.
        for e in reversed(entries):
            for t in self._tiers:
                if e.key in t.lru:
                    t.lru.move_to_end(e.key)

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(fn, limiter=self._limiter)

    async def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        await self._copy_many([(dst, src)])

    async def _copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        total = sum(d.numel() * d.element_size() for d, _ in pairs)
        streams = [(d, s, self._stream_for(d, s)) for d, s in pairs]

        def run() -> None:
            for d, s, (dev, stream) in streams:
                with devices.stream_context(dev, stream):
                    d.copy_(s)
                devices.synchronize(dev, stream)

        if total < int(self.config.inline_copy_bytes) and all(
                st[2][1] is None for st in streams):
            run()
            return
        # torch already spreads one large copy over its intra-op threads; splitting a batch of
        # large copies over our worker threads as well only oversubscribes the cores. Small
        # copies (which torch runs on one thread) are split.
        large = total // len(streams) >= _TORCH_PARALLEL_COPY_BYTES
        nthreads = 1 if large else min(self.config.copy_threads, len(streams))
        if nthreads <= 1:
            await self._in_thread(run)
            return
        groups = [streams[i::nthreads] for i in range(nthreads)]

        def runner(group: list[Any]) -> Callable[[], None]:
            def go() -> None:
                for d, s, (dev, stream) in group:
                    with devices.stream_context(dev, stream):
                        d.copy_(s)
                    devices.synchronize(dev, stream)
            return go

        async with anyio.create_task_group() as tg:
            for g in groups:
                tg.start_soon(self._in_thread, runner(g))

    @staticmethod
    def _stream_for(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.device, Any]:
        for t in (src, dst):
            if t.device.type != "cpu":
                return t.device, devices.current_stream(t.device)
        return dst.device, None

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def wrapped() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("musacache background task failed")

        task = asyncio.get_running_loop().create_task(wrapped())
        self._bg.add(task)
        if self._bg_idle.is_set():
            self._bg_idle = anyio.Event()

        def done(t: asyncio.Task[Any]) -> None:
            self._bg.discard(t)
            if not self._bg:
                self._bg_idle.set()

        task.add_done_callback(done)

    async def _drain(self) -> None:
        while self._bg:
            await self._bg_idle.wait()

    # -- input checks --------------------------------------------------------------------------

    def _check_kv(self, kv: torch.Tensor, toks: np.ndarray, what: str,
                  exact: bool = False) -> None:
        have = self.spec.check_dense(kv, what=what)
        n = len(toks)
        if exact and have != n:
            raise ShapeError(f"{what} holds {have} tokens, tokens has {n}: {what} must have "
                             f"shape {self.spec.shape(n)}")
        if have < n:
            raise ShapeError(f"{what} holds {have} tokens but tokens has {n}: the KV must cover "
                             f"every token")
        dev = kv.device
        if dev.type == "meta" or (dev.type != "cpu" and not devices.available(dev.type)):
            raise DeviceError(f"{what} is on device {dev}, which the cache cannot read or write")
        if dev.type not in ("cpu", *devices.ACCELERATORS):
            raise DeviceError(f"{what} is on device {dev}; use cpu, cuda or musa tensors")

