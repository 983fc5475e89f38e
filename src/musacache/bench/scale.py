"""``musacache bench scale``: the control plane at scale, every goal in one run.

Each goal is printed as measured and as a ratio to its baseline, taken in the same run:

* lookup miss with many siblings vs the same miss with few;
* an evicting put vs the same put with room;
* the largest event-loop gap during put, lookup, eviction, delete, clear and a restart from
  a large listing (directory work only: a tiny spec, so no byte copy hides it);
* paged store vs a bare native gather of the same pages, and retrieve vs scatter;
* a warm disk get vs a raw read of the same encoded bytes;
* directory memory per entry.

The curves (lookup hit and miss, put, get, memory) are tables over the directory size, 1k to
1M entries by default; ``--plot FILE`` draws them (needs matplotlib). Sizes fit in 24 GiB: the
tiny spec keeps a million chunks at 512 MiB of KV.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from musacache.cache import Cache

from .._config import CacheConfig, HostTier
from .._keys import Fingerprint, KeyChain
from .._spec import KVSpec
from ..tiers.base import ChunkListing, ChunkMeta, ListingBuilder, StorageTier, TierContext
from . import _scale_server

CH = 16                                          # tokens per chunk for the control-plane runs
TINY = KVSpec(1, 1, 8, torch.float16)            # 512 B per chunk: bookkeeping dominates
VOCAB = 128000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tiny_cache(chunks: int, **kw: Any) -> Cache:
    return Cache(CacheConfig(TINY, "bench-scale", chunk_size=CH,
                             tiers=(HostTier(capacity_bytes=TINY.nbytes(CH) * chunks),), **kw))


class _Within(NamedTuple):
    """What else the clocks counted within one gap of the loop."""

    cpu: float = 0.0        # the loop thread's CPU time: its own work
    proc: float = 0.0       # the whole process's (worker threads too, which may hold the GIL)
    majflt: int = 0         # the process's major page faults: pages read back from disk
    run_delay: float = 0.0  # the loop thread's wait for a core while runnable
    steal: float = 0.0      # the machine's stolen time, summed over its cores (10 ms ticks)

    def since(self, before: _Within) -> _Within:
        return _Within(self.cpu - before.cpu, self.proc - before.proc,
                       self.majflt - before.majflt, self.run_delay - before.run_delay,
                       self.steal - before.steal)


def _read_ns(path: str, field: int) -> float:
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[field]) / 1e9
    except (OSError, IndexError, ValueError):  # not Linux, or no schedstat: counted as 0
        return 0.0


def _steal() -> float:
    try:
        with open("/proc/stat", "rb") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _clocks() -> _Within:
    """Now, on every clock a gap is attributed by (``_Within``'s fields, cumulative)."""
    return _Within(time.thread_time(), time.process_time(),
                   resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
                   _read_ns("/proc/thread-self/schedstat", 1), _steal())


class _Gaps:
    """The loop's largest gap while it runs (a heartbeat every millisecond), and the longest
    pause of Python's cyclic garbage collector meanwhile (a full collection walks every
    tracked object of the process: with a million entries, that alone is a long gap).

    A gap is attributed (``_Within``): the loop thread's CPU time is the part that was its
    own work. On a shared machine the rest is the loop's wait for a core while other work
    ran (its ``run_delay``), time the hypervisor took from the machine's cores (``steal``),
    a worker thread that held the GIL meanwhile (the process's CPU beyond the loop's), or a
    wait off the CPU, such as a page the kernel had dropped and reads back from disk
    (``majflt``; this machine's kernel runs a reclaim daemon that pages out what was idle
    for a minute, code included). The GC pause is taken in the collecting thread's CPU too.
    """

    def __init__(self) -> None:
        self.max = 0.0
        self.at_max = _Within()
        self.gc_max = 0.0
        self.gc_cpu_max = 0.0
        # Every gap and GC pause with the time it began, so that the part of the watch that
        # came after a given moment can be read out (``within``).
        self.gaps: list[tuple[float, float, _Within]] = []  # start, length, attribution
        self.pauses: list[tuple[float, float, float]] = []  # start, length, cpu
        self._gc_t0 = 0.0
        self._gc_c0 = 0.0
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            self._gc_c0 = time.thread_time()
        else:
            length = time.perf_counter() - self._gc_t0
            cpu = time.thread_time() - self._gc_c0
            self.pauses.append((self._gc_t0, length, cpu))
            self.gc_max = max(self.gc_max, length)
            self.gc_cpu_max = max(self.gc_cpu_max, cpu)

    def within(self, lo: float, hi: float = math.inf) -> _Gaps:
        """The same figures for the gaps and GC pauses that began in ``[lo, hi)``."""
        part = _Gaps()
        for start, length, at in self.gaps:
            if lo <= start < hi and length > part.max:
                part.max, part.at_max = length, at
        for start, length, cpu in self.pauses:
            if lo <= start < hi:
                part.gc_max = max(part.gc_max, length)
                part.gc_cpu_max = max(part.gc_cpu_max, cpu)
        return part

    async def __aenter__(self) -> _Gaps:
        gc.callbacks.append(self._on_gc)
        async def beat() -> None:
            last, last_c = time.perf_counter(), _clocks()
            while not self._stop:
                await asyncio.sleep(0.001)
                now, c = time.perf_counter(), _clocks()
                gap, at = now - last, c.since(last_c)
                if gap > 0.002:
                    self.gaps.append((last, gap, at))
                if gap > self.max:
                    self.max, self.at_max = gap, at
                last, last_c = now, c

        self._task = asyncio.create_task(beat())
        await asyncio.sleep(0.005)
        self.max = self.gc_max = self.gc_cpu_max = 0.0
        self.at_max = _Within()
        self.gaps.clear()
        self.pauses.clear()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.002)
        self._stop = True
        if self._task is not None:
            await self._task
        gc.callbacks.remove(self._on_gc)


async def _timed(fn: Callable[[], Awaitable[Any]], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs)}


def _prompts(rng: np.random.Generator, count: int, chunks: int) -> np.ndarray:
    return rng.integers(0, VOCAB, (count, chunks * CH)).astype(np.int32)


# -- the curves: 1k to 1M cached chunks ------------------------------------------------------

# Timed samples of 200 put + delete pairs per repeat, at each size of the curves.
_PUT_SAMPLES = 4


async def curve(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """At each directory size: lookup hit and miss, one-chunk put and get, memory/entry."""
    rng = np.random.default_rng(1)
    return [await _curve_at(n, rng, repeats) for n in sizes]


async def _curve_at(n: int, rng: np.random.Generator, repeats: int) -> dict[str, Any]:
    per_prompt = 64
    inner = 50
    gc.collect()
    r0 = _rss()
    async with _tiny_cache(n + 4 * per_prompt) as c:
        kv = torch.zeros(TINY.shape(per_prompt * CH), dtype=TINY.dtype)
        t0 = time.perf_counter()
        kept = None
        for _ in range(max(1, n // per_prompt)):
            kept = _prompts(rng, 1, per_prompt)[0]
            await c.put(kept, kv)
        build_s = time.perf_counter() - t0
        gc.collect()
        eng = c._engine
        entries = len(eng.dir)
        kv_bytes = sum(t.pool.bytes_allocated for t in eng.mem)
        mem = (_rss() - r0 - kv_bytes) / entries
        objects, token_bytes = directory_bytes(eng)
        if kept is None:
            raise RuntimeError("bench: nothing was cached")
        hit = kept[: 4 * CH]
        miss = kept[: 4 * CH].copy()
        miss[3 * CH + 5] += 1  # diverges inside chunk 4: three chunks and a prefix match
        one = torch.zeros(TINY.shape(CH), dtype=TINY.dtype)
        out = torch.empty(TINY.shape(CH), dtype=TINY.dtype)
        # put + delete is the one curve with a goal (flat from 1k to 1M); at about 50 µs an op,
        # 50 of them are a 2.5 ms sample that one preemption doubles: more and longer samples.
        put_inner, put_samples = 200, repeats * _PUT_SAMPLES
        fresh = iter(_prompts(rng, put_samples * put_inner, 1))
        first = kept[:CH]

        async def put_one() -> None:
            p = next(fresh)
            await c.put(p, one)
            await c.delete(p)

        hits = await _timed(lambda: _loop(lambda: c.lookup(hit), inner), repeats)
        misses = await _timed(lambda: _loop(lambda: c.lookup(miss), inner), repeats)
        gets = await _timed(lambda: _loop(lambda: c.get(first, out=out), inner), repeats)
        puts = await _timed(lambda: _loop(put_one, put_inner), put_samples)
    return {
        "entries": entries, "build_s": build_s,
        "lookup_hit_us": {k: v / inner * 1e6 for k, v in _stats(hits).items()},
        "lookup_miss_us": {k: v / inner * 1e6 for k, v in _stats(misses).items()},
        "get_us": {k: v / inner * 1e6 for k, v in _stats(gets).items()},
        "put_delete_us": {k: v / put_inner * 1e6 for k, v in _stats(puts).items()},
        "bytes_per_entry": mem,
        "bytes_per_entry_beyond_tokens": mem - 4 * CH,
        "object_bytes_per_entry": objects / entries,
        "object_bytes_per_entry_beyond_tokens": (objects - token_bytes) / entries,
    }


def directory_bytes(eng: Any) -> tuple[int, int]:
    """What the directory's own Python objects take (entries, keys, token headers,
    residency, child indexes, recency lists), and the token-id bytes (data) among them."""
    import sys

    from musacache.engine.children import Siblings

    size = sys.getsizeof
    total = size(eng.dir.entries) + size(eng.dir.children)
    total += sum(size(d) for d in getattr(eng.dir.entries, "_shards", ()))
    tokens = 0
    seen: set[int] = set()
    for e in eng.dir.entries.values():
        total += size(e) + size(e.key)
        if e.tokens is not None:
            total += size(e.tokens)
            tokens += len(e.tokens)
        parent = eng.dir.entries.get(e.parent)
        if parent is None or parent.key is not e.parent:
            if id(e.parent) not in seen:  # a parent key object of its own
                seen.add(id(e.parent))
                total += size(e.parent)
        for packed in (e._mem, e._stored):
            if isinstance(packed, tuple):
                total += size(packed) + sum(size(x) for x in packed)
            elif isinstance(packed, int) and not -5 <= packed <= 256:
                total += size(packed)
        if e._gen > 256:
            total += size(e._gen)
        if isinstance(e.kids, Siblings):
            total += size(e.kids) + size(e.kids._runs) + size(e.kids._maxes) \
                + sum(size(r) for r in e.kids._runs) + size(e.kids._tokenless)
    for t in eng.mem:
        total += t.lru.table_bytes()
    return total, tokens


async def _loop(fn: Callable[[], Awaitable[Any]], n: int) -> None:
    for _ in range(n):
        await fn()


# -- lookup miss among many siblings ------------------------------------------------------

async def siblings(counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """Every conversation after one shared system prompt is a child of the same chunk; a
    lookup of a new conversation must find the best of them (a prefix match) or none."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, VOCAB, 4 * CH).astype(np.int32)
    return [await _siblings_at(n, rng, system, repeats) for n in counts]


async def _siblings_at(n: int, rng: np.random.Generator, system: np.ndarray,
                       repeats: int) -> dict[str, Any]:
    inner = 20
    async with _tiny_cache(n + 8) as c:
        kv = torch.zeros(TINY.shape(5 * CH), dtype=TINY.dtype)
        await c.put(system, kv)
        convs = rng.integers(0, VOCAB, (n, CH)).astype(np.int32)
        for conv in convs:
            await c.put(np.concatenate([system, conv]), kv)
        # A new conversation that shares its first 5 tokens with a cached one.
        probe = np.concatenate([system, convs[n // 2]])
        probe[4 * CH + 5] += 1

        async def miss() -> None:
            for _ in range(inner):
                got = await c.lookup(probe)
            if got != 4 * CH + 5:
                raise RuntimeError(f"bench: expected a prefix match, got {got}")

        async with _Gaps() as gaps:
            times = await _timed(miss, repeats)
    return {"siblings": n, **{k: v / inner * 1e6 for k, v in _stats(times).items()},
            "max_gap_ms": gaps.max * 1e3}


# -- eviction ---------------------------------------------------------------------------

# Timed puts of each kind per repeat (eviction), and timed gather/store pairs per repeat
# (paged): both sides of a ratio get the same number of samples, taken alternately.
_EVICT_SAMPLES = 3
_PAGED_SAMPLES = 20
# Timed get/raw-read pairs per repeat (disk).
_DISK_SAMPLES = 4


async def eviction(chunk_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """A put of ``n`` chunks into a cache full of another prompt vs into an empty one.

    The two caches are open side by side and their puts alternate (the order flipped every
    other time): on a shared machine a burst of other work then lands on both sides of the
    ratio, not on one block of repeats. ``_EVICT_SAMPLES`` puts of each kind per repeat: a
    put of 1024 chunks takes 30 ms, and the min of three such on a loaded machine is a
    draw. Each put is also timed by the loop thread's CPU clock (every step of a put of the
    tiny spec runs on the loop)."""
    rows = []
    rng = np.random.default_rng(3)
    for n in chunk_counts:
        kv = torch.zeros(TINY.shape(n * CH), dtype=TINY.dtype)
        a, b = _prompts(rng, 2, n)
        times: dict[str, list[float]] = {"room": [], "evicting": []}
        cpu: dict[str, list[float]] = {"room": [], "evicting": []}
        gaps_max = dict.fromkeys(times, 0.0)
        async with _tiny_cache(2 * n) as room, _tiny_cache(n) as full:
            caches = {"room": room, "evicting": full}
            for r in range(repeats * _EVICT_SAMPLES):
                for mode in ("room", "evicting") if r % 2 == 0 else ("evicting", "room"):
                    c = caches[mode]
                    await c.put(a, kv)
                    async with _Gaps() as gaps:
                        t0, c0 = time.perf_counter(), time.thread_time()
                        stored = await c.put(b, kv)
                        cpu[mode].append(time.thread_time() - c0)
                        times[mode].append(time.perf_counter() - t0)
                    gaps_max[mode] = max(gaps_max[mode], gaps.max)
                    if stored != n * CH:
                        raise RuntimeError(f"bench: put stored {stored} of {n * CH}")
                    await c.delete(b)
                    await c.delete(a)
        result: dict[str, Any] = {"chunks": n}
        for mode in times:
            result[mode] = {**_stats(times[mode]), "max_gap_ms": gaps_max[mode] * 1e3,
                            "cpu": _stats(cpu[mode])}
        result["ratio_min"] = result["evicting"]["min"] / result["room"]["min"]
        result["ratio_median"] = result["evicting"]["median"] / result["room"]["median"]
        result["cpu_ratio_min"] = (result["evicting"]["cpu"]["min"]
                                   / result["room"]["cpu"]["min"])
        rows.append(result)
    return rows


# -- event-loop gaps from directory work ------------------------------------------------

class _Listing(StorageTier):
    """A storage tier that reports a listing at start and holds nothing else: the compact
    form, or (``as_list``) a list of ``ChunkMeta`` made from it in ``start``, as a tier
    written before ``ChunkListing`` returns."""

    name = "listing"

    def __init__(self, listing: ChunkListing, as_list: bool = False) -> None:
        self.listing = listing
        self.as_list = as_list
        self.started_at = math.inf  # when ``start``'s own work ended (perf_counter)

    async def start(self, ctx: TierContext) -> ChunkListing | list[ChunkMeta]:
        if self.as_list:
            # The tier's own work, not the cache's: a million Python objects made in a
            # worker thread, which holds the GIL between its switch intervals.
            metas = await asyncio.to_thread(lambda: list(self.listing))
            self.started_at = time.perf_counter()
            return metas
        self.started_at = time.perf_counter()
        return self.listing

    async def write(self, meta: ChunkMeta, obj: bytes) -> None:
        return None

    async def read(self, meta: ChunkMeta) -> bytes | None:
        return None

    async def delete(self, key: bytes) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _listing(n: int, per_prompt: int) -> ChunkListing:
    chain = KeyChain(Fingerprint("bench-scale", TINY, CH))
    toks = np.random.default_rng(4).integers(0, VOCAB, (n, CH)).astype("<i4")
    size = TINY.nbytes(CH)
    b = ListingBuilder()
    parent = chain.seed
    for i in range(n):
        if i % per_prompt == 0:
            parent = chain.seed
        key = KeyChain.child(parent, toks[i].tobytes())
        b.add(key, parent, CH, size, size // 2, float(i))
        parent = key
    return b.build()


async def stalls(entries: int, siblings_n: int, listing_n: int) -> dict[str, Any]:
    """The loop's largest gap (ms) during each kind of directory work, and the longest GC
    pause (ms) within it."""
    out: dict[str, _Gaps] = {}
    async with _Gaps() as g:  # the baseline: the loop doing nothing else (OS scheduling)
        await asyncio.sleep(0.5)
    out["idle loop, 0.5 s (baseline)"] = g
    rng = np.random.default_rng(5)
    system = rng.integers(0, VOCAB, CH).astype(np.int32)
    kv1 = torch.zeros(TINY.shape(2 * CH), dtype=TINY.dtype)
    async with _tiny_cache(siblings_n + 8) as c:
        await c.put(system, kv1)
        for conv in rng.integers(0, VOCAB, (siblings_n, CH)).astype(np.int32):
            await c.put(np.concatenate([system, conv]), kv1)
        probe = np.concatenate([system, rng.integers(0, VOCAB, CH).astype(np.int32)])
        async with _Gaps() as g:
            await c.lookup(probe)
        out["lookup miss"] = g
        async with _Gaps() as g:
            await c.delete(system)  # the shared prefix and every conversation after it
        out[f"delete ({siblings_n} descendants)"] = g
    big = 16384  # a long prompt: its own steps must stay short whatever its length
    kv = torch.zeros(TINY.shape(big * CH), dtype=TINY.dtype)
    a, b = _prompts(rng, 2, big)
    async with _tiny_cache(big) as c:
        async with _Gaps() as g:
            await c.put(a, kv)
        out[f"put ({big} chunks)"] = g
        async with _Gaps() as g:
            await c.put(b, kv)  # evicts all of a
        out[f"evicting put ({big} chunks)"] = g
        # The same long prompt read and removed whole: each walks all of its chunks.
        for name, op in (("lookup", lambda: c.lookup(b)), ("get", lambda: c.get(b)),
                         ("put of it again (all cached)", lambda: c.put(b, kv)),
                         ("delete", lambda: c.delete(b))):
            async with _Gaps() as g:
                await op()
            out[f"{name} ({big} chunks, one prompt)"] = g
    grow = entries // 4  # a full collection fires when long-lived objects grew by 25%
    c = _tiny_cache(entries + grow + 128)
    await c.open()
    try:
        kv64 = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
        for p in _prompts(rng, max(1, entries // 64), 64):
            await c.put(p, kv64)
        more = _prompts(rng, max(1, grow // 64), 64)  # drawn before the loop is watched
        async with _Gaps() as g:
            for p in more:
                await c.put(p, kv64)
        out[f"puts growing {entries} chunks by 25%"] = g
        n = len(c._engine.dir)
        async with _Gaps() as g:
            await c.clear()
        out[f"clear ({n} chunks)"] = g
    finally:
        # Every slot of the pool was released by the clear: closing lets go of them all.
        async with _Gaps() as g:
            await c.aclose()
    out["aclose after that clear"] = g
    # Closing with persist_on_close (the default) and a storage tier: finding what to write
    # walks the directory, then the writes run until close_timeout.
    persist = Cache(CacheConfig(TINY, "bench-scale", chunk_size=CH, close_timeout=3.0,
                                tiers=(HostTier(capacity_bytes=TINY.nbytes(CH) * (entries + 64)),
                                       _Listing(ListingBuilder().build()))))
    await persist.open()
    kv64 = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    for p in _prompts(rng, max(1, entries // 64), 64):
        await persist.put(p, kv64)
    n = len(persist._engine.dir)
    async with _Gaps() as g:
        await persist.aclose()
    out[f"aclose with persist_on_close ({n} chunks, 3 s deadline)"] = g
    del persist
    listing = _listing(listing_n, 64)
    for as_list, form in ((False, "compact"), (True, "a list of ChunkMeta")):
        tier = _Listing(listing, as_list)
        cache = Cache(CacheConfig(TINY, "bench-scale", chunk_size=CH,
                                  tiers=(HostTier(capacity_bytes=TINY.nbytes(CH) * 64), tier)))
        async with _Gaps() as g:
            await cache.open()
        # The cache's work begins when the tier's start returns its listing; a tier that
        # makes a list of a million objects in a thread first is shown apart, as its own.
        out[f"restart from a {listing_n}-object listing ({form})"] = g.within(tier.started_at)
        if as_list:
            out["  (the tier's own start before it: making that list)"] = g.within(
                -math.inf, tier.started_at)
        if len(cache._engine.dir) != listing_n:
            raise RuntimeError("bench: the listing was not learned whole")
        await cache.aclose()
    return {k: {"gap_ms": g.max * 1e3, "gap_cpu_ms": g.at_max.cpu * 1e3,
                "gap_process_cpu_ms": g.at_max.proc * 1e3,
                "gap_major_faults": g.at_max.majflt,
                "gap_run_delay_ms": g.at_max.run_delay * 1e3,
                "gap_steal_ms": g.at_max.steal * 1e3,
                "gc_ms": g.gc_max * 1e3, "gc_cpu_ms": g.gc_cpu_max * 1e3}
            for k, g in out.items()}


# -- paged store vs a bare native gather --------------------------------------------------------

def paged_setup(tokens: int) -> tuple[KVSpec, list[torch.Tensor], torch.Tensor, torch.Tensor,
                                      np.ndarray, CacheConfig]:
    """The paged part's request: 8 layers of random vLLM pages with ``tokens`` in randomly
    chosen blocks, their slots, a dense tensor to gather them into, the tokens, and a cache
    with room for them."""
    spec = KVSpec(8, 8, 128, torch.bfloat16)
    block = 16
    nblocks = 2 * tokens // block
    caches = [torch.empty((2, nblocks, block, 8, 128), dtype=spec.dtype) for _ in range(8)]
    for t in caches:
        t.view(torch.int16).random_()
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randperm(nblocks, generator=gen)[: tokens // block]
    slots = (blocks[:, None] * block + torch.arange(block)).reshape(-1).to(torch.int64)
    dense = torch.empty(spec.shape(tokens), dtype=spec.dtype)
    toks = np.arange(tokens, dtype=np.int32)
    cfg = CacheConfig(spec, "bench-paged", chunk_size=256,
                      tiers=(HostTier(capacity_bytes=spec.nbytes(tokens) + spec.nbytes(256)),))
    return spec, caches, slots, dense, toks, cfg


async def paged(tokens: int, repeats: int) -> dict[str, Any]:
    from .. import transfer

    spec, caches, slots, dense, toks, cfg = paged_setup(tokens)
    transfer.gather(caches, slots, dense, "vllm")
    gather_s: list[float] = []
    store_s: list[float] = []
    async with Cache(cfg) as c:
        await c.store(toks, caches, slots)  # warm the pool's pages
        # Alternating, so a burst of other work on a shared machine lands on both sides.
        for _ in range(repeats * _PAGED_SAMPLES):
            t0 = time.perf_counter()
            await asyncio.to_thread(transfer.gather, caches, slots, dense, "vllm")
            gather_s.append(time.perf_counter() - t0)
            await c.delete(toks)
            t0 = time.perf_counter()
            await c.store(toks, caches, slots)
            store_s.append(time.perf_counter() - t0)
        moves = c._engine.mover.moves
        # The way back: a retrieve of the same prompt into the same pages, against a bare
        # native scatter of the dense KV there.
        scatter_s: list[float] = []
        retrieve_s: list[float] = []
        for _ in range(repeats * _PAGED_SAMPLES):
            t0 = time.perf_counter()
            await asyncio.to_thread(transfer.scatter, dense, caches, slots, "vllm")
            scatter_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = await c.retrieve(toks, caches, slots)
            retrieve_s.append(time.perf_counter() - t0)
            if got != tokens:
                raise RuntimeError("bench: the stored prompt should be retrieved whole")
    nbytes = spec.nbytes(tokens)
    return {"tokens": tokens, "bytes": nbytes, "gather": _stats(gather_s),
            "store": _stats(store_s), "moves": moves,
            "ratio": min(gather_s) / min(store_s),
            "ratio_median": statistics.median(gather_s) / statistics.median(store_s),
            "scatter": _stats(scatter_s), "retrieve": _stats(retrieve_s),
            "retrieve_ratio": min(scatter_s) / min(retrieve_s),
            "retrieve_ratio_median": statistics.median(scatter_s)
            / statistics.median(retrieve_s)}


# -- disk: warm get vs a raw read ----------------------------------------------------------------

async def disk(tokens: int, repeats: int) -> dict[str, Any]:
    return {codec: await _disk(tokens, repeats, codec) for codec in ("raw", "lz4")}


def _disk_spec() -> KVSpec:
    return KVSpec(8, 8, 128, torch.bfloat16)


async def _disk(tokens: int, repeats: int, codec: str) -> dict[str, Any]:
    from ..tiers.disk import DiskTier

    spec = _disk_spec()
    kv = torch.randn(spec.shape(tokens)).to(spec.dtype)
    toks = np.arange(tokens, dtype=np.int32)
    with tempfile.TemporaryDirectory() as path:
        cfg = CacheConfig(spec, "bench-disk", chunk_size=256, tiers=(
            HostTier(capacity_bytes=spec.nbytes(tokens)),
            DiskTier(path=path, capacity_bytes=spec.nbytes(tokens) * 2, codec=codec)))

        def listing() -> list[str]:
            return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                    if f.endswith(".kvc")]

        async with Cache(cfg) as c:
            eng = c._engine
            top = eng.mem[0]
            await c.put(toks, kv)
            await eng.evict(top, len(top.lru))  # the chunk files are written here
            await c.flush()
            files = await asyncio.to_thread(listing)

            def read_all() -> int:
                n = 0
                for f in files:
                    with open(f, "rb") as fh:
                        n += len(fh.read())
                return n

            encoded = await asyncio.to_thread(read_all)
            if encoded < spec.nbytes(tokens) // 4:
                raise RuntimeError(f"bench: only {encoded} encoded bytes on disk")
            out = torch.empty_like(kv)
            get_s, promote_s, raw_s = [], [], []
            # A get and a raw read of the same files, taken alternately, so that a burst of
            # other work on a shared machine lands on both sides of the ratio.
            for i in range(repeats * _DISK_SAMPLES + 1):
                # Push everything down to disk (untimed): the get reads and decodes every
                # chunk, from a warm page cache, and promotes it (in the background by
                # default: the flush after the get waits for that, timed apart).
                await eng.evict(top, len(top.lru))
                await c.flush()
                t0 = time.perf_counter()
                hit = await c.get(toks, out=out)
                t1 = time.perf_counter()
                await c.flush()
                t2 = time.perf_counter()
                await asyncio.to_thread(read_all)
                if i:
                    get_s.append(t1 - t0)
                    promote_s.append(t2 - t1)
                    raw_s.append(time.perf_counter() - t2)
                if hit.num_tokens != tokens or hit.tiers.get("disk") != tokens:
                    raise RuntimeError(f"bench: disk get served {hit.tiers}, not {tokens} "
                                       "tokens from disk")
            if not torch.equal(out.view(torch.uint8), kv.view(torch.uint8)):
                raise RuntimeError("bench: the disk get returned other bytes than were put")
        parts = await asyncio.to_thread(_disk_parts, files, spec, repeats)
    put = await _disk_put(kv, repeats, codec)
    return {"tokens": tokens, "raw_bytes": spec.nbytes(tokens), "encoded_bytes": encoded,
            "get": _stats(get_s), "raw_read": _stats(raw_s), "promotion": _stats(promote_s),
            "ratio": min(raw_s) / min(get_s),
            "ratio_median": statistics.median(raw_s) / statistics.median(get_s),
            "samples": len(get_s), "parts": parts, **put}


def _read_chunk_files(folder: str) -> list[bytes]:
    objs: list[bytes] = []
    for d, _, fs in os.walk(folder):
        for f in fs:
            if f.endswith(".kvc"):
                with open(os.path.join(d, f), "rb") as fh:
                    objs.append(fh.read())
    return objs


def _disk_parts(files: list[str], spec: KVSpec, repeats: int) -> dict[str, dict[str, float]]:
    """The pieces of a disk get, each over every chunk file on one thread (min and median of
    ``repeats``): read the files into a buffer per chunk, as a promotion reads into its slot
    (``read``); the block checksums (``verify``); decoding the read bytes into a chunk tensor
    (``decode``, verify included); ``read_chunk_into``, what a promotion runs (``read+decode``),
    also split over two threads (``read+decode on 2 threads``: the get's floor here); and
    copying the promoted chunks into the caller's ``out``, as the get's move does
    (``copy``)."""
    from .. import _native
    from ..codec import _block_layout, decode_chunk, read_chunk_into, read_header

    fp = Fingerprint("bench-disk", spec, 256)
    sizes = [os.path.getsize(f) for f in files]
    bufs = [bytearray(n) for n in sizes]
    dests = []
    for f in files:
        with open(f, "rb") as fh:
            dests.append(torch.empty(spec.shape(read_header(fh.read(256)).num_tokens),
                                     dtype=spec.dtype))
    outs = [torch.empty_like(d) for d in dests]

    def read() -> None:
        for f, b in zip(files, bufs, strict=True):
            with open(f, "rb", buffering=0) as fh:
                fh.readinto(b)

    def verify() -> None:
        for b in bufs:
            hdr = read_header(b)
            view = memoryview(b)
            _, offsets = _block_layout(hdr, view[256 : 256 + hdr.table_len])
            for i in range(hdr.num_blocks):
                _native.crc32c(view[offsets[i] : offsets[i + 1]])

    def decode() -> None:
        for b, d in zip(bufs, dests, strict=True):
            decode_chunk(fp, b, out=d)

    def read_decode(lane: int = 0, lanes: int = 1) -> None:
        for f, n, d in list(zip(files, sizes, dests, strict=True))[lane::lanes]:
            fd = os.open(f, os.O_RDONLY)
            try:
                read_chunk_into(fp, fd, n, d)
            finally:
                os.close(fd)

    def read_decode_2() -> None:
        # The same reads on two threads (the cores the get has): what the memory bus allows
        # two of them at once, with no event loop in between.
        other = threading.Thread(target=read_decode, args=(1, 2))
        other.start()
        read_decode(0, 2)
        other.join()

    def copy() -> None:
        for o, d in zip(outs, dests, strict=True):
            o.copy_(d)

    read()
    out: dict[str, dict[str, float]] = {}
    for name, fn in (("read", read), ("verify", verify), ("decode", decode),
                     ("read+decode", read_decode), ("read+decode on 2 threads", read_decode_2),
                     ("copy", copy)):
        fn()  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = _stats(times)
    return out


async def _disk_put(kv: torch.Tensor, repeats: int, codec: str) -> dict[str, Any]:
    """A disk-only put and its flush (encode, then write the files) vs writing the same
    encoded bytes to new files."""
    from ..tiers.disk import DiskTier

    spec = _disk_spec()
    tokens = kv.shape[spec.token_dim]
    with tempfile.TemporaryDirectory() as path:
        cfg = CacheConfig(spec, "bench-disk-put", chunk_size=256, tiers=(
            DiskTier(path=os.path.join(path, "cache"), capacity_bytes=spec.nbytes(tokens) * 4,
                     codec=codec),))
        put_s = []
        async with Cache(cfg) as c:
            for i in range(repeats + 1):
                toks = np.arange(tokens, dtype=np.int32) + i * tokens
                t0 = time.perf_counter()
                await c.put(toks, kv)
                await c.flush()
                if i:
                    put_s.append(time.perf_counter() - t0)
                if i < repeats:  # the last put's files are the raw write's bytes
                    await c.delete(toks)
                    await c.flush()
        objs = await asyncio.to_thread(_read_chunk_files, os.path.join(path, "cache"))
        plain = os.path.join(path, "plain")
        os.mkdir(plain)

        def write_all() -> None:
            for i, obj in enumerate(objs):
                name = os.path.join(plain, f"{i}.kvc")
                with open(name, "wb") as fh:
                    fh.write(obj)
            for i in range(len(objs)):
                os.unlink(os.path.join(plain, f"{i}.kvc"))

        await asyncio.to_thread(write_all)
        write_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await asyncio.to_thread(write_all)
            write_s.append(time.perf_counter() - t0)
    return {"put": _stats(put_s), "raw_write": _stats(write_s),
            "put_ratio": min(write_s) / min(put_s)}


# -- report -------------------------------------------------------------------------------------

def _fmt_stats(d: dict[str, float], unit: str = "") -> str:
    return f"min {d['min']:.2f}{unit}, median {d['median']:.2f}{unit}"


def report(res: dict[str, Any]) -> None:
    print("musacache bench scale: measured, and the ratio to its baseline "
          "in this run")
    sib = res.get("siblings")
    if sib:
        lo, hi = sib[0], sib[-1]
        print(f"\nlookup miss among siblings (goal: {hi['siblings']} within 2x of "
              f"{lo['siblings']})")
        print("  siblings | miss us (min) | miss us (median) | largest loop gap ms")
        for r in sib:
            print(f"  {r['siblings']:>8} | {r['min']:13.1f} | {r['median']:16.1f} | "
                  f"{r['max_gap_ms']:.1f}")
        print(f"  ratio {hi['siblings']} vs {lo['siblings']}: "
              f"{hi['min'] / lo['min']:.2f} (min), {hi['median'] / lo['median']:.2f} (median)")
    ev = res.get("eviction")
    if ev:
        print("\nevicting put vs the same put with room (goal <= 1.3 at 1024 chunks)")
        print("  chunks | room ms (min) | evicting ms (min) | ratio min | ratio median"
              " | CPU ratio min")
        for r in ev:
            print(f"  {r['chunks']:>6} | {r['room']['min'] * 1e3:13.2f} | "
                  f"{r['evicting']['min'] * 1e3:17.2f} | {r['ratio_min']:9.2f} | "
                  f"{r['ratio_median']:12.2f} | {r['cpu_ratio_min']:.2f}")
    st = res.get("stalls")
    if st:
        print("\nlargest event-loop gap during directory work (goal < 10 ms each). Within it:"
              " the loop thread's CPU (its own work), the whole process's CPU (worker"
              " threads, which may hold the GIL), the loop's wait for a core while runnable,"
              " the machine's stolen time (all cores, 10 ms ticks), major page faults, and"
              " the longest GC pause (wall / CPU)")
        for k, v in st.items():
            # A row in parentheses is not directory work (no goal): printed for the record.
            versus = ("  (not the cache's: no goal)" if k.lstrip().startswith("(")
                      else f"   ratio to goal {v['gap_ms'] / 10:5.2f}")
            print(f"  {k:<40} {v['gap_ms']:7.2f} ms{versus}"
                  f"   (loop CPU {v['gap_cpu_ms']:.2f} ms, process {v['gap_process_cpu_ms']:.2f}"
                  f" ms; waiting for a core {v['gap_run_delay_ms']:.2f} ms; stolen"
                  f" {v['gap_steal_ms']:.0f} ms; {v['gap_major_faults']} major faults;"
                  f" GC {v['gc_ms']:.2f} / {v['gc_cpu_ms']:.2f} ms)")
    pg = res.get("paged")
    if pg:
        print(f"\npaged store vs a bare native gather of the same pages ({pg['tokens']} tokens,"
              f" {pg['bytes'] / 2**20:.0f} MiB; goal >= 0.9)")
        print(f"  gather {_fmt_stats({k: v * 1e3 for k, v in pg['gather'].items()}, ' ms')}; "
              f"store {_fmt_stats({k: v * 1e3 for k, v in pg['store'].items()}, ' ms')}; "
              f"ratio {pg['ratio']:.2f} (min), {pg['ratio_median']:.2f} (median)")
        print("paged retrieve vs a bare native scatter into the same pages (goal >= 0.9)")
        print(f"  scatter {_fmt_stats({k: v * 1e3 for k, v in pg['scatter'].items()}, ' ms')}; "
              f"retrieve {_fmt_stats({k: v * 1e3 for k, v in pg['retrieve'].items()}, ' ms')}; "
              f"ratio {pg['retrieve_ratio']:.2f} (min), {pg['retrieve_ratio_median']:.2f} "
              "(median)")
    for codec, dk in (res.get("disk") or {}).items():
        ms = {name: {k: v * 1e3 for k, v in d.items()} for name, d in dk["parts"].items()}
        print(f"\nwarm disk get vs a raw read of the encoded bytes, codec {codec} "
              f"({dk['tokens']} tokens, {dk['encoded_bytes'] / 2**20:.0f} MiB encoded; "
              "goal >= 0.5)")
        print(f"  raw read {_fmt_stats({k: v * 1e3 for k, v in dk['raw_read'].items()}, ' ms')};"
              f" get {_fmt_stats({k: v * 1e3 for k, v in dk['get'].items()}, ' ms')}; ratio "
              f"{dk['ratio']:.2f} (min), {dk['ratio_median']:.2f} (median); "
              f"{dk['samples']} alternated samples")
        promote_ms = {k: v * 1e3 for k, v in dk["promotion"].items()}
        print("  then the chunks' promotion to the host tier, after the get returned (the "
              f"flush that waits for it): {_fmt_stats(promote_ms, ' ms')}")
        print("  the get's pieces, each over every chunk (on one thread unless named): "
              + "; ".join(f"{name} {_fmt_stats(d, ' ms')}" for name, d in ms.items()))
        put_ms = {k: v * 1e3 for k, v in dk["put"].items()}
        write_ms = {k: v * 1e3 for k, v in dk["raw_write"].items()}
        print(f"  disk-only put + flush {_fmt_stats(put_ms, ' ms')} vs writing the encoded "
              f"bytes to new files {_fmt_stats(write_ms, ' ms')}; ratio {dk['put_ratio']:.2f}")
    cv = res.get("curve")
    if cv:
        print("\ncurves over the directory size (tiny spec, 16-token chunks, 64-chunk prompts)")
        print("  (bytes/entry: the directory's objects, with and without the token ids; "
              "RSS: the process's growth less the KV pool)")
        print("  entries | lookup hit us | lookup miss us | get us | put+delete us | "
              "B/entry | w/o token ids | RSS B/entry")
        for r in cv:
            print(f"  {r['entries']:>7} | {r['lookup_hit_us']['min']:13.1f} | "
                  f"{r['lookup_miss_us']['min']:14.1f} | {r['get_us']['min']:6.1f} | "
                  f"{r['put_delete_us']['min']:13.1f} | {r['object_bytes_per_entry']:7.0f} | "
                  f"{r['object_bytes_per_entry_beyond_tokens']:13.0f} | "
                  f"{r['bytes_per_entry']:.0f}")
        lo, hi = cv[0], cv[-1]
        print(f"  put+delete {hi['entries']} vs {lo['entries']}: "
              f"{hi['put_delete_us']['min'] / lo['put_delete_us']['min']:.2f} (goal <= 1.5); "
              f"memory at {hi['entries']}: {hi['object_bytes_per_entry']:.0f} B/entry, "
              f"{hi['bytes_per_entry']:.0f} by RSS (ratio to the 400 B goal "
              f"{hi['object_bytes_per_entry'] / 400:.2f}, {hi['bytes_per_entry'] / 400:.2f})")
    if res.get("server"):
        _scale_server.report(res["server"])


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cv = res.get("curve") or []
    xs = [r["entries"] for r in cv]
    ax = axes[0]
    for name, label in (("lookup_hit_us", "lookup hit"), ("lookup_miss_us", "lookup miss"),
                        ("get_us", "get, one chunk"), ("put_delete_us", "put + delete")):
        ax.plot(xs, [r[name]["min"] for r in cv], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="cached chunks", ylabel="us per op (min)",
           title="ops vs directory size")
    ax.legend()
    ax = axes[1]
    ax.plot(xs, [r["object_bytes_per_entry"] for r in cv], marker="o", label="directory objects")
    ax.plot(xs, [r["bytes_per_entry"] for r in cv], marker="s", label="RSS growth less KV")
    ax.axhline(400, color="r", ls="--", label="goal")
    ax.set(xscale="log", xlabel="cached chunks", ylabel="bytes per entry beyond KV",
           title="directory memory")
    ax.legend()
    ax = axes[2]
    sib = res.get("siblings") or []
    ax.plot([r["siblings"] for r in sib], [r["min"] for r in sib], marker="o")
    ax.set(xscale="log", xlabel="siblings", ylabel="lookup miss us (min)",
           title="lookup miss vs siblings")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: The parts of a run, in the order they run (``--only`` picks some).
PARTS = ("siblings", "eviction", "stalls", "paged", "disk", "curve", "server")


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    parts = {p for p in args.only.split(",") if p} if args.only else None

    def want(name: str) -> bool:
        return parts is None or name in parts

    if want("siblings"):
        res["siblings"] = await siblings(_ints(args.siblings), args.repeats)
    if want("eviction"):
        res["eviction"] = await eviction(_ints(args.evict_chunks), args.repeats)
    if want("stalls"):
        res["stalls"] = await stalls(args.stall_entries, max(_ints(args.siblings)),
                                     args.listing)
    if want("paged"):
        res["paged"] = await paged(args.paged_tokens, args.repeats)
    if want("disk"):
        res["disk"] = await disk(args.disk_tokens, args.repeats)
    if want("curve"):
        res["curve"] = await curve(_ints(args.sizes), args.repeats)
    if want("server"):
        res["server"] = await _scale_server.server_part(_ints(args.sizes), args.repeats)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musacache bench scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000,1000000",
                   help="directory sizes of the curves (cached chunks)")
    p.add_argument("--siblings", default="1000,200000",
                   help="sibling counts for the lookup miss (first is the baseline)")
    p.add_argument("--evict-chunks", default="32,256,1024")
    p.add_argument("--stall-entries", type=int, default=1_000_000,
                   help="chunks in the cache, grown by 25%% then cleared while the loop is watched")
    p.add_argument("--listing", type=int, default=1_000_000,
                   help="objects in the listing a restart learns")
    p.add_argument("--paged-tokens", type=int, default=4096)
    p.add_argument("--disk-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default="", help=f"comma list of parts: {','.join(PARTS)}")
    p.add_argument("--plot", metavar="FILE", help="draw the curves (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    args = p.parse_args(argv)
    unknown = sorted({x for x in args.only.split(",") if x} - set(PARTS))
    if unknown:
        p.error(f"--only: no part named {', '.join(unknown)} (the parts: {','.join(PARTS)})")
    for flag in ("sizes", "siblings", "evict_chunks"):
        try:  # read now, not after the parts before the one that needs them have run
            _ints(getattr(args, flag))
        except ValueError:
            p.error(f"--{flag.replace('_', '-')}: not a comma list of numbers: "
                    f"{getattr(args, flag)!r}")
    res = asyncio.run(run(args))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res)
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
