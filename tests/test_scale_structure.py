"""The control plane at scale, through what the cache does: long work in batches with the
loop free between them, eviction order, pins seen by stats(). Speed and memory per chunk
are shown by ``musacache bench scale``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import musacache as mc
from fake_store import MemStore
from helpers import prefix_kv, stats_per_turn
from musacache._keys import Fingerprint, KeyChain
from musacache.bench.scale import _Listing
from musacache.engine.core import BATCH
from musacache.tiers.base import ChunkMeta

CH = 16


def _cfg(spec: mc.KVSpec, chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "scale", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * chunks),))


class _GatedReads(MemStore):
    """A storage tier whose reads wait for ``gate`` once it is set, saying when one does."""

    def __init__(self, objects: dict[bytes, bytes], **kw: Any) -> None:
        super().__init__(objects, **kw)
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def read(self, meta: mc.ChunkMeta) -> bytes | None:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        return await super().read(meta)


async def test_stats_counts_the_pins_of_a_get_in_flight(spec):
    """A get pins what it matched until it has copied it: stats() shows those pins while
    its read below is held up, and none once it returns."""
    objects: dict[bytes, bytes] = {}
    toks = list(range(4 * CH))

    def cfg(store: MemStore) -> mc.CacheConfig:
        return mc.CacheConfig(spec, "scale", chunk_size=CH,
                              tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * 8), store))

    async with mc.Cache(cfg(MemStore(objects, write_through=True))) as c:
        await c.put(toks, prefix_kv(spec, toks))
    store = _GatedReads(objects)
    async with mc.Cache(cfg(store)) as c:
        await c.get(toks[: 2 * CH])  # the head back in host memory, the rest below only
        await c.flush()
        assert (await c.stats())["pins"] == 0
        store.gate = asyncio.Event()
        get = asyncio.create_task(c.get(toks))
        await store.entered.wait()
        assert (await c.stats())["pins"] > 0
        store.gate.set()
        hit = await get
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, prefix_kv(spec, toks))
        assert (await c.stats())["pins"] == 0


def _between(seen: list[dict[str, Any]], what: Callable[[dict[str, Any]], int], lo: int,
             hi: int) -> bool:
    """Whether ``what`` of some stats() seen was strictly between ``lo`` and ``hi``."""
    return any(lo < what(st) < hi for st in seen)


def _chunks(st: dict[str, Any]) -> int:
    return int(st["chunks"])


def _host_chunks(st: dict[str, Any]) -> int:
    return int(st["tiers"]["host"]["chunks"])


async def test_long_directory_work_lets_the_loop_run(spec):
    """Puts, deletes and clears of many chunks are done in batches: other tasks run while
    they are under way (the cache is seen half done), so the loop never stalls."""
    n = 4 * BATCH
    async with mc.Cache(_cfg(spec, 2 * n + 8)) as c:
        base = list(range(CH))
        await c.put(base, prefix_kv(spec, base))
        long = base + list(range(10**6, 10**6 + n * CH))
        seen = await stats_per_turn(c, lambda: c.put(long, prefix_kv(spec, long)))
        assert _between(seen, _chunks, 1, n + 1)
        # Many conversations after one shared prefix: deleting the prefix removes them all.
        for i in range(n):
            p = base + [2 * 10**6 + i] * CH
            await c.put(p, prefix_kv(spec, p))
        total = (await c.stats())["chunks"]
        seen = await stats_per_turn(c, lambda: c.delete(base))
        assert _between(seen, _chunks, 0, total)
        assert (await c.stats())["chunks"] == 0
        for i in range(n):
            p = [3 * 10**6 + i] * CH
            await c.put(p, prefix_kv(spec, p))
        # Nothing can be found from the start of a clear; memory is freed in batches.
        seen = await stats_per_turn(c, c.clear)
        assert _between(seen, _host_chunks, 0, n)
        st = await c.stats()
        assert st["chunks"] == 0 and st["tiers"]["host"]["bytes_used"] == 0


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


async def test_a_long_put_is_evicted_from_its_leaf_back_to_its_root(spec):
    """Over several rounds of a put's placement, its chunks are left oldest at the leaf and
    newest at the root: each eviction after it takes the leaves first, so what stays is
    always a whole prefix."""
    n = 3 * BATCH + 5  # several planning rounds
    async with mc.Cache(_cfg(spec, n)) as c:
        toks = list(range(n * CH))
        await c.put(toks, prefix_kv(spec, toks))
        gone, fresh = 0, 10**6
        for k in (1, BATCH - 1, BATCH + 7, 50):  # evictions across the rounds
            other = list(range(fresh, fresh + k * CH))
            fresh += k * CH
            assert await c.put(other, prefix_kv(spec, other)) == k * CH
            gone += k
            assert await c.lookup(toks) == (n - gone) * CH, k


async def test_a_chunk_read_back_from_disk_is_promoted_and_then_served_from_host(spec,
                                                                               tmp_path):
    """After a restart every chunk is on disk only: a get serves them from there, and the
    promotions after it put them back in the host tier for the next get."""
    cfg = mc.CacheConfig(spec, "scale", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * 4),
        mc.DiskTier(path=str(tmp_path), capacity_bytes=spec.nbytes(CH) * 64,
                    write_through=True)))
    a = list(range(4 * CH))
    async with mc.Cache(cfg) as c:
        await c.put(a, prefix_kv(spec, a))
    async with mc.Cache(cfg) as c:
        assert (await c.stats())["tiers"]["host"]["chunks"] == 0
        hit = await c.get(a)
        assert hit.tiers == {"disk": 4 * CH}
        assert torch.equal(hit.kv, prefix_kv(spec, a))
        await c.flush()
        host = (await c.stats())["tiers"]["host"]
        assert host["chunks"] == 4 and host["promotions"] == 4
        hit = await c.get(a)
        assert hit.tiers == {"host": 4 * CH} and torch.equal(hit.kv, prefix_kv(spec, a))


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


async def test_an_eviction_with_nowhere_to_demote_gives_each_slot_to_the_new_put(spec):
    """With no tier below, an evicted chunk leaves at once and its slot serves the put that
    evicted it: a put of a whole tier's worth over a full tier is stored whole, in the same
    memory. (Its cost against a put with room: ``musacache bench scale``, eviction.)"""
    n = 4 * BATCH
    async with mc.Cache(_cfg(spec, n)) as c:
        a = list(range(n * CH))
        b = list(range(10**6, 10**6 + n * CH))
        await c.put(a, prefix_kv(spec, a))
        before = (await c.stats())["tiers"]["host"]
        assert await c.put(b, prefix_kv(spec, b)) == n * CH
        st = await c.stats()
        host = st["tiers"]["host"]
        assert host["evictions"] == n and host["chunks"] == n and st["chunks"] == n
        assert host["bytes_used"] == before["bytes_used"] == n * host["slot_bytes"]
        assert host["bytes_allocated"] == before["bytes_allocated"]
        assert await c.lookup(a) == 0
        hit = await c.get(b)
        assert hit.num_tokens == n * CH and torch.equal(hit.kv, prefix_kv(spec, b))
        assert (await c.stats())["pins"] == 0


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
        slot = spec.nbytes(CH)
        assert not mt.holds(e)
        # its slot kept for the reader
        assert (await c.stats())["tiers"]["host"]["bytes_used"] == 3 * slot
        assert torch.equal(data, before)
        eng.unpin(e)
        assert (await c.stats())["tiers"]["host"]["bytes_used"] == 2 * slot
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
