"""Capacity, LRU leaves-first eviction, demotion, promotion, and the lazy pool."""

import os

import anyio
import anyio.lowlevel
import pytest
import torch

import musacache as mc
from helpers import prefix_kv

CH = 16


def cfg(spec, *tiers, **kw):
    return mc.CacheConfig(spec, "evict", tiers=tiers, chunk_size=CH, **kw)


def seq(start, n):
    return list(range(start, start + n))


async def test_capacity_is_never_exceeded_under_concurrency(spec):
    cap = spec.nbytes(CH) * 5
    violations = []
    async with mc.Cache(cfg(spec, mc.HostTier(cap))) as c:
        pool = c._mem[0].pool
        stop = anyio.Event()

        async def monitor():
            while not stop.is_set():
                if pool.bytes_used > cap or pool.bytes_allocated > cap:
                    violations.append((pool.bytes_used, pool.bytes_allocated))
                await anyio.lowlevel.checkpoint()

        async def worker(i):
            toks = seq(1000 * (i % 7), 16 * (1 + i % 4) + i % 5)
            await c.put(toks, prefix_kv(spec, toks))
            hit = await c.get(toks)
            assert torch.equal(hit.kv, prefix_kv(spec, toks[: hit.num_tokens]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor)
            async with anyio.create_task_group() as workers:
                for i in range(60):
                    workers.start_soon(worker, i)
            stop.set()
        assert violations == []
        assert (await c.stats())["tiers"]["host"]["evictions"] > 0


async def test_eviction_is_leaves_first(spec):
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 4))) as c:
        a = seq(0, 64)  # exactly 4 chunks: fills the tier
        await c.put(a, prefix_kv(spec, a))
        b = seq(5000, 16)
        assert await c.put(b, prefix_kv(spec, b)) == 16
        # The LRU-oldest chunk is a's first, but it has children: its leaf goes first.
        assert await c.lookup(a) == 48
        assert await c.lookup(b) == 16
        assert (await c.stats())["tiers"]["host"]["evictions"] == 1


async def test_eviction_is_lru_among_leaves(spec):
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 3))) as c:
        p = [seq(100 * i, 16) for i in range(3)]
        for s in p:
            await c.put(s, prefix_kv(spec, s))
        await c.get(p[0])  # p[1] is now the least recently used
        new = seq(9000, 16)
        await c.put(new, prefix_kv(spec, new))
        assert [await c.lookup(s) for s in p] == [16, 0, 16]


async def test_evicted_chunks_are_demoted_and_promoted_back(spec):
    top = mc.DeviceTier(spec.nbytes(CH) * 2, device="cpu", name="dev")
    low = mc.HostTier(spec.nbytes(CH) * 16)
    async with mc.Cache(cfg(spec, top, low)) as c:
        a = seq(0, 80)  # 5 chunks: 2 fit on top, the rest land below
        assert await c.put(a, prefix_kv(spec, a)) == 80
        st = (await c.stats())["tiers"]
        assert st["dev"]["bytes_used"] <= spec.nbytes(CH) * 2
        assert st["host"]["chunks"] >= 3
        b = seq(7000, 32)
        await c.put(b, prefix_kv(spec, b))  # pushes a's chunks down
        assert (await c.stats())["tiers"]["dev"]["evictions"] >= 1
        assert (await c.stats())["tiers"]["host"]["demotions"] >= 1
        assert await c.lookup(a) == 80
        hit = await c.get(a[:32])
        assert torch.equal(hit.kv, prefix_kv(spec, a[:32]))
        st = (await c.stats())["tiers"]
        assert st["dev"]["promotions"] >= 1 and st["host"]["hits"] >= 1
        assert hit.tiers == {"host": 32}  # says which tier served the tokens


async def push_top_tier_down(c):
    """Evict every chunk of the top tier (demoting it to the next), as a full tier would."""
    mt = c._mem[0]
    await c._engine.evict(mt, len(mt.lru))
    assert not mt.lru


async def test_concurrent_gets_join_one_promotion(spec):
    top = mc.DeviceTier(spec.nbytes(CH) * 8, device="cpu", name="dev")
    low = mc.HostTier(spec.nbytes(CH) * 8)
    async with mc.Cache(cfg(spec, top, low)) as c:
        a = seq(0, 32)
        await c.put(a, prefix_kv(spec, a))
        await push_top_tier_down(c)
        assert (await c.stats())["tiers"]["dev"]["chunks"] == 0
        results = []

        async def reader():
            results.append(await c.get(a))

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(reader)
        assert all(torch.equal(h.kv, prefix_kv(spec, a)) for h in results)
        assert (await c.stats())["tiers"]["dev"]["promotions"] == 2  # one per chunk, not per reader


async def test_prefetch_promotes_and_reports(spec):
    top = mc.DeviceTier(spec.nbytes(CH) * 8, device="cpu", name="dev")
    low = mc.HostTier(spec.nbytes(CH) * 8)
    async with mc.Cache(cfg(spec, top, low)) as c:
        a = seq(0, 40)
        await c.put(a, prefix_kv(spec, a))
        await push_top_tier_down(c)
        assert await c.prefetch(a) == 40  # scheduled, returns at once
        await c.flush()
        assert (await c.stats())["tiers"]["dev"]["chunks"] == 3
        assert await c.prefetch(a, timeout=5) == 40
        assert await c.prefetch(seq(999, 10), timeout=1) == 0


async def test_host_pool_grows_lazily(spec):
    big = mc.KVSpec(32, 8, 128)  # 32 MiB per 256-token chunk
    before = _rss()
    async with mc.Cache(mc.CacheConfig(big, "lazy", tiers=(mc.HostTier("16GiB"),))) as c:
        st = (await c.stats())["tiers"]["host"]
        assert st["capacity_bytes"] == 16 * 1024**3
        assert st["bytes_allocated"] == 0 and st["bytes_used"] == 0
        assert _rss() - before < 64 * 1024**2
        toks = list(range(300))
        kv = torch.zeros(big.shape(300), dtype=big.dtype)
        await c.put(toks, kv)
        st = (await c.stats())["tiers"]["host"]
        # Two slots used; only the first segment exists, not 16 GiB.
        assert st["bytes_used"] == 2 * big.nbytes(256)
        assert 0 < st["bytes_allocated"] <= 256 * 1024**2


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_top_tier_smaller_than_a_chunk_falls_through(spec):
    # Zero bytes is a config error (issue 10); a tier too small for one chunk still falls through.
    with pytest.raises(mc.ConfigError, match="capacity_bytes must be at least 1"):
        mc.DeviceTier(0, device="cpu")
    small = mc.DeviceTier(spec.nbytes(CH) - 1, device="cpu")
    async with mc.Cache(cfg(spec, small, mc.HostTier(spec.nbytes(CH) * 4))) as c:
        a = seq(0, 20)
        assert await c.put(a, prefix_kv(spec, a)) == 20
        assert torch.equal((await c.get(a)).kv, prefix_kv(spec, a))


async def test_prompt_larger_than_every_tier_stores_its_head(spec):
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 3))) as c:
        a = seq(0, 100)
        assert await c.put(a, prefix_kv(spec, a)) == 48
        assert await c.lookup(a) == 48
        assert torch.equal((await c.get(a)).kv, prefix_kv(spec, a[:48]))
