"""Structure of the control plane at scale: what the bookkeeping holds per chunk,
and what a stats() call may touch. Speed itself is shown by ``musacache bench scale``."""

from __future__ import annotations

import asyncio
import math
import sys

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import prefix_kv
from musacache._keys import Fingerprint, KeyChain
from musacache.bench.scale import _Listing
from musacache.engine.core import BATCH
from musacache.tiers.base import ChunkMeta

CH = 16


def _cfg(spec: mc.KVSpec, chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "scale", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * chunks),))


class _NoWalk(dict):  # type: ignore[type-arg]
    """A directory whose entries may be looked up but not walked."""

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats() walked every directory entry")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats() walked every directory entry")


async def test_stats_counts_pins_without_walking_the_directory(spec):
    async with mc.Cache(_cfg(spec, 64)) as c:
        toks = list(range(5 * CH))
        await c.put(toks, prefix_kv(spec, toks))
        eng = c._engine
        eng.dir.entries = _NoWalk(eng.dir.entries)
        assert (await c.stats())["pins"] == 0
        m = eng.dir.get(next(iter(dict.values(eng.dir.entries))).key)
        eng.pin(m)
        eng.pin(m)
        assert (await c.stats())["pins"] == 2
        eng.unpin(m)
        eng.unpin(m)
        assert (await c.stats())["pins"] == 0
        eng.dir.entries = dict(eng.dir.entries)


async def test_a_cached_chunk_holds_no_tensor_dict_or_set(spec):
    async with mc.Cache(_cfg(spec, 64)) as c:
        toks = list(range(3 * CH))
        await c.put(toks, prefix_kv(spec, toks))
        for e in c._engine.dir.entries.values():
            assert not hasattr(e, "__dict__")
            values = [getattr(e, name) for name in type(e).__slots__]
            assert not any(isinstance(v, (dict, set, list, torch.Tensor)) for v in values), e
            # One memory tier holds it: its residency is one int (slot index and tier).
            assert isinstance(e._mem, int)
            (idx, index), = e.slots()
            assert isinstance(index, int)
            assert isinstance(e.tokens, bytes) and len(e.tokens) == 4 * e.num_tokens
            # The slot's bytes are still reachable, as a view made on demand.
            view = c._engine.view(c._mem[idx], e)
            assert view.shape == spec.shape(CH)
        sizes = {id(e.raw_bytes) for e in c._engine.dir.entries.values()}
        assert len(sizes) == 1  # one shared int per chunk size
        assert sys.getsizeof(next(iter(c._engine.dir.entries.values()))) <= 160
        # The tier's recency list is linked through slot indices: no node per chunk.
        assert not hasattr(c._mem[0].lru, "__dict__")


class _Sampler:
    """Samples the directory size every time the loop runs another task."""

    def __init__(self, c: mc.Cache, what) -> None:  # type: ignore[no-untyped-def]
        self.c = c
        self.what = what
        self.sizes: list[int] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            eng = self.c._eng
            if eng is not None:
                self.sizes.append(self.what(eng))
            await asyncio.sleep(0)

    def between(self, lo: int, hi: int) -> bool:
        return any(lo < n < hi for n in self.sizes)


async def _sampled(c: mc.Cache, op, what=lambda eng: len(eng.dir)):  # type: ignore[no-untyped-def]
    s = _Sampler(c, what)
    task = asyncio.create_task(s.run())
    await asyncio.sleep(0)
    try:
        await op()
    finally:
        s.running = False
        await task
    return s


async def test_long_directory_work_lets_the_loop_run(spec):
    """Puts, deletes and clears of many chunks are done in batches: other tasks run while
    they are under way (the directory is seen half done), so the loop never stalls."""
    n = 4 * BATCH
    async with mc.Cache(_cfg(spec, 2 * n + 8)) as c:
        base = list(range(CH))
        await c.put(base, prefix_kv(spec, base))
        long = base + list(range(10**6, 10**6 + n * CH))
        s = await _sampled(c, lambda: c.put(long, prefix_kv(spec, long)))
        assert s.between(1, n + 1)
        # Many conversations after one shared prefix: deleting the prefix removes them all.
        for i in range(n):
            p = base + [2 * 10**6 + i] * CH
            await c.put(p, prefix_kv(spec, p))
        total = len(c._engine.dir)
        s = await _sampled(c, lambda: c.delete(base))
        assert s.between(0, total)
        assert len(c._engine.dir) == 0
        for i in range(n):
            p = [3 * 10**6 + i] * CH
            await c.put(p, prefix_kv(spec, p))
        # Nothing can be found from the start of a clear; memory is freed in batches.
        s = await _sampled(c, c.clear, lambda eng: len(eng.mem[0].lru))
        assert s.between(0, n)
        assert len(c._engine.dir) == 0 and (await c.stats())["tiers"]["host"]["bytes_used"] == 0


async def test_learning_a_large_listing_lets_the_loop_run(spec, monkeypatch):
    from musacache.engine.storage import ColdPath

    chain = KeyChain(Fingerprint("scale", spec, CH))
    n = 4 * BATCH
    metas, parent = [], chain.seed
    for i in range(n):
        key = KeyChain.child(parent, np.full(CH, i, dtype="<i4").tobytes())
        metas.append(ChunkMeta(key, parent, CH, spec.nbytes(CH), 100, float(i)))
        parent = key
    cfg = mc.CacheConfig(spec, "scale", chunk_size=CH, tiers=(_Listing(metas),))
    ticks = [0]
    seen: list[int] = []  # the loop's tick count at each call learning part of the listing
    learn = ColdPath._learn_rows  # a restart learns the listing's rows a batch per call

    def spy(self, st, part, *args, **kw):  # type: ignore[no-untyped-def]
        seen.append(ticks[0])
        return learn(self, st, part, *args, **kw)

    monkeypatch.setattr(ColdPath, "_learn_rows", spy)
    running = True

    async def tick() -> None:
        while running:
            ticks[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(tick())
    c = mc.Cache(cfg)
    try:
        await c.open()
    finally:
        running = False
        await task
    try:
        assert len(c._engine.dir) == n
        assert len(seen) > 1 and seen[-1] > seen[0]  # other tasks ran between the parts
    finally:
        await c.aclose()


async def test_a_long_put_leaves_its_leaf_oldest_and_its_root_newest(spec):
    n = 3 * BATCH + 5  # several planning rounds
    async with mc.Cache(_cfg(spec, 2 * n)) as c:
        toks = list(range(n * CH))
        await c.put(toks, prefix_kv(spec, toks))
        keys = [k for *_, k in c._engine.chain.keys(np.asarray(toks, dtype="<i4"))]
        order = [key for key, _e in c._mem[0].lru.items()]
        assert order == keys[::-1]


async def test_evicting_a_long_prompt_walks_the_lru_once(spec, monkeypatch):
    """Eviction is amortised O(1) per chunk: making room for a prompt of n chunks visits
    O(n) entries of the recency list, not O(n) per chunk."""
    from musacache.engine.lru import SlotLRU

    visited = [0]
    items = SlotLRU.items

    def counting(self):  # type: ignore[no-untyped-def]
        for kv in items(self):
            visited[0] += 1
            yield kv

    n = 16 * BATCH
    async with mc.Cache(_cfg(spec, n)) as c:
        a = list(range(n * CH))
        b = list(range(10**6, 10**6 + n * CH))
        await c.put(a, prefix_kv(spec, a))
        monkeypatch.setattr(SlotLRU, "items", counting)
        assert await c.put(b, prefix_kv(spec, b)) == n * CH
        assert (await c.stats())["tiers"]["host"]["evictions"] == n
        assert visited[0] <= 3 * n, visited[0]


async def test_a_disk_read_decodes_straight_into_the_top_tier_slot(spec, tmp_path, monkeypatch):
    from musacache import codec
    from musacache.tiers import disk

    outs: list[torch.Tensor | None] = []
    decode = codec.decode_chunk
    read_into = disk.read_chunk_into

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        outs.append(kw.get("out"))
        return decode(*args, **kw)

    def spy_file(fp, fd, size, out, **kw):  # type: ignore[no-untyped-def]
        outs.append(out)  # the disk tier reads the file straight into this tensor
        return read_into(fp, fd, size, out, **kw)

    monkeypatch.setattr(codec, "decode_chunk", spy)
    monkeypatch.setattr(disk, "read_chunk_into", spy_file)
    cfg = mc.CacheConfig(spec, "scale", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * 4),
        mc.DiskTier(path=str(tmp_path), capacity_bytes=spec.nbytes(CH) * 64)))
    async with mc.Cache(cfg) as c:
        a = list(range(4 * CH))
        await c.put(a, prefix_kv(spec, a))
        mt = c._mem[0]
        await c._engine.evict(mt, len(mt.lru))  # demoted: everything now lives on disk only
        await c.flush()
        assert not mt.lru and not outs
        hit = await c.get(a)
        assert hit.num_tokens == 4 * CH
        assert torch.equal(hit.kv, prefix_kv(spec, a))
        await c.flush()  # the promotions after a get's read straight into its tensor
        promoted = [e for e in c._engine.dir.entries.values() if mt.holds(e)]
        assert promoted and outs
        slots = {c._engine.view(mt, e).data_ptr() for e in promoted}
        assert all(o is not None for o in outs)  # never a fresh tensor per chunk
        assert slots <= {o.data_ptr() for o in outs if o is not None}


def test_bench_scale_runs_small_and_prints_every_goal(capsys, tmp_path):
    """Speed is shown by the benchmark; here only that it runs and prints each goal."""
    from musacache.bench import scale

    argv = ["--sizes", "200,1000", "--siblings", "100,1000", "--evict-chunks", "32",
            "--stall-entries", "2000", "--listing", "3000", "--paged-tokens", "512",
            "--disk-tokens", "512", "--repeats", "1"]
    assert scale.main(argv) == 0
    out = capsys.readouterr().out
    for line in ("lookup miss among siblings", "evicting put vs the same put with room",
                 "largest event-loop gap", "restart from a 3000-object listing",
                 "paged store vs a bare native gather", "paged retrieve vs a bare native scatter",
                 "warm disk get", "codec raw", "codec lz4", "curves over the directory size",
                 "memory at"):
        assert line in out, line


def test_bench_gaps_split_at_a_moment():
    """The restart row counts only the gaps that began once the tier's start returned (the
    cache's work); what the tier did before that is read out apart."""
    from musacache.bench.scale import _Gaps, _Within

    g = _Gaps()
    g.gaps[:] = [(1.0, 0.030, _Within(0.001, 0.029, 2)), (5.0, 0.004, _Within(0.003, 0.003)),
                 (6.0, 0.008, _Within(0.007, 0.008, 0, 0.0005, 0.01))]
    g.pauses[:] = [(1.0, 0.020, 0.020), (6.5, 0.002, 0.002)]
    after, before = g.within(5.0), g.within(-math.inf, 5.0)
    assert after.max == 0.008
    assert after.at_max == _Within(0.007, 0.008, 0, 0.0005, 0.01)
    assert (after.gc_max, after.gc_cpu_max) == (0.002, 0.002)
    assert (before.max, before.at_max.proc, before.at_max.majflt, before.gc_max) == (
        0.030, 0.029, 2, 0.020)
    assert g.within(7.0).max == 0.0


async def test_an_eviction_with_nowhere_to_demote_pins_and_detaches_nothing(spec, monkeypatch):
    """With no tier below, an evicted chunk leaves in the step it was chosen in: its slot goes
    straight back to the pool. No pin, unpin, or detach-then-free per evicted chunk (that
    bookkeeping made an evicting put cost up to 1.6x a put with room)."""
    from musacache.engine.core import Engine
    from musacache.engine.directory import Entry

    pins: list[Entry] = []
    detached: list[Entry] = []
    pin, detach_slot = Engine.pin, Entry.detach_slot

    def counting_pin(self, e):  # type: ignore[no-untyped-def]
        pins.append(e)
        return pin(self, e)

    def counting_detach(self, idx, index):  # type: ignore[no-untyped-def]
        detached.append(self)
        return detach_slot(self, idx, index)

    n = 4 * BATCH
    async with mc.Cache(_cfg(spec, n)) as c:
        a = list(range(n * CH))
        b = list(range(10**6, 10**6 + n * CH))
        await c.put(a, prefix_kv(spec, a))
        evicted = set(c._engine.dir.entries.keys())
        monkeypatch.setattr(Engine, "pin", counting_pin)
        monkeypatch.setattr(Entry, "detach_slot", counting_detach)
        assert await c.put(b, prefix_kv(spec, b)) == n * CH
        assert (await c.stats())["tiers"]["host"]["evictions"] == n
        assert len(pins) == n  # the put's own chunks, each once
        assert not [e for e in pins if e.key in evicted]
        assert detached == []
        pool = c._mem[0].pool
        assert pool.slots_in_use == n and len(c._engine.dir) == n
        hit = await c.get(b)
        assert hit.num_tokens == n * CH and torch.equal(hit.kv, prefix_kv(spec, b))


async def test_a_reader_who_pins_a_chunk_during_its_demotion_keeps_its_slot(spec, tmp_path,
                                                                            monkeypatch):
    """A demotion awaits its copy; a reader may pin a victim meanwhile. The victim leaves the
    top tier, but its slot is freed only by the reader's unpin, never under the reader."""
    from musacache.engine.core import Engine

    cfg = mc.CacheConfig(spec, "scale", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * 4),
        mc.DiskTier(path=str(tmp_path), capacity_bytes=spec.nbytes(CH) * 64)))
    relocate = Engine.relocate
    readers = []

    async def reader_arrives(self, items, *a, **kw):  # type: ignore[no-untyped-def]
        where = await relocate(self, items, *a, **kw)
        e, data = items[0]
        self.pin(e)  # as a get that matched it while the copy ran
        readers.append((e, data, data.clone()))
        return where

    async with mc.Cache(cfg) as c:
        a = list(range(4 * CH))
        await c.put(a, prefix_kv(spec, a))
        eng, mt = c._engine, c._mem[0]
        monkeypatch.setattr(Engine, "relocate", reader_arrives)
        assert await eng.evict(mt, 2) == 2
        (e, data, before), = readers
        assert not mt.holds(e) and mt.pool.slots_in_use == 3  # its slot kept for the reader
        assert torch.equal(data, before)
        eng.unpin(e)
        assert mt.pool.slots_in_use == 2
        await c.flush()
        hit = await c.get(a)
        assert hit.num_tokens == 4 * CH and torch.equal(hit.kv, prefix_kv(spec, a))


def test_bench_scale_refuses_an_unknown_part(capsys):
    # A misspelt part ("stall" for "stalls") ran nothing and printed only the title.
    from musacache.bench import scale

    with pytest.raises(SystemExit) as exited:
        scale.main(["--only", "stall"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "stall" in err and "stalls" in err
