"""Bounded waits and resources in the engine (issue 10, items 10, 12, 13), the task group the
cache owns (issue 9), the host pool's growth ahead of need and ``prealloc``, and
``CacheConfig.device``."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import torch

import musacache as mc
from fake_store import MemStore
from helpers import prefix_kv
from musacache.engine import tierstate as _tierstate

CH = 16
HANG = 3600.0  # a storage call that never comes back within any test


def seq(a: int, n: int) -> list[int]:
    return list(range(a, a + n))


def cfg(spec: mc.KVSpec, *tiers: object, **kw: object) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "bounds", tiers=tiers, chunk_size=CH, **kw)  # type: ignore[arg-type]


async def test_hung_storage_tier_sheds_writes_and_never_stalls_put(spec: mc.KVSpec) -> None:
    """Item 10: with the write queue full and the tier hung, a put sheds the demotion (and
    counts it) instead of waiting for the tier."""
    store = MemStore(timeout=0.2, codec="raw")
    store.write_delay = HANG
    obj = spec.nbytes(CH) + 4096
    config = cfg(spec, mc.HostTier(spec.nbytes(CH)), store, write_queue_bytes=obj,
                 close_timeout=0.5)
    async with mc.Cache(config) as c:
        with anyio.fail_after(60):  # a hang guard, not a timing: the put would never return
            for i in range(8):
                toks = seq(1000 * i, CH)
                assert await c.put(toks, prefix_kv(spec, toks)) == CH
        st = (await c.stats())["tiers"]["mem"]
        assert st["write_sheds"] >= 5 and st["pending_writes"] == 1
        assert (await c.stats())["tiers"]["host"]["drops"] >= 5
    assert (await c.stats())["close"]["writes_abandoned"] == 1


async def test_close_with_an_unreachable_tier_ends_by_its_deadline(spec: mc.KVSpec) -> None:
    """Item 13: persist-on-close against a hung tier gives up at ``close_timeout`` and counts
    what was not persisted."""
    store = MemStore()
    store.write_delay = HANG
    c = mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), store, close_timeout=0.3))
    await c.open()
    toks = seq(0, 4 * CH)
    await c.put(toks, prefix_kv(spec, toks))
    with anyio.fail_after(60):  # a hang guard: without the deadline this waits for HANG
        await c.aclose()
    close = (await c.stats())["close"]
    assert close["to_persist"] == 4 and close["timed_out"] == 1
    assert close["not_persisted"] + close["writes_abandoned"] >= 4
    assert store.objects == {}


async def test_refresh_bookkeeping_is_bounded(spec: mc.KVSpec,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 12: every distinct miss on a shared tier is remembered, but only so many."""
    monkeypatch.setattr(_tierstate, "REFRESH_MEMORY", 16)
    store = MemStore(shared=True)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 128), store,
                            refresh_interval=3600)) as c:
        for i in range(100):  # 100 misses, each below a different cached chunk
            head = seq(100 * i, CH)
            await c.put(head, prefix_kv(spec, head))
            assert await c.lookup(head + [7] * CH) == CH
        assert len(c._stores[0].refreshed) <= 16
        assert (await c.stats())["tiers"]["mem"]["refreshes"] == 100


async def test_refresh_bookkeeping_forgets_what_it_would_ask_again(spec: mc.KVSpec) -> None:
    store = MemStore(shared=True)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 4), store,
                            refresh_interval=0)) as c:
        for i in range(50):
            head = seq(100 * i, CH)
            await c.put(head, prefix_kv(spec, head))
            await c.lookup(head + [7] * CH)
        assert len(c._stores[0].refreshed) <= 1


async def test_no_background_task_outlives_the_cache(spec: mc.KVSpec) -> None:
    """Promotions, writes and deletes run in the cache's own task group: after ``aclose()``
    (even with work hung in a tier) none of them is left."""
    before = set(asyncio.all_tasks())
    store = MemStore(timeout=HANG)
    c = mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH)), store, close_timeout=0.2))
    await c.open()
    a, b = seq(0, CH), seq(500, CH)
    await c.put(a, prefix_kv(spec, a))
    await c.put(b, prefix_kv(spec, b))  # a goes down to the store
    await c.flush()
    store.read_delay = HANG
    store.write_delay = HANG
    with anyio.move_on_after(0.1):
        await c.get(a)  # its promotion hangs in the store's read
    assert (await c.stats())["in_flight"]["background"] >= 1
    await c.aclose()
    await asyncio.sleep(0)
    assert set(asyncio.all_tasks()) - before == {asyncio.current_task()} - before


async def test_prealloc_pins_up_front_and_the_pool_grows_ahead(spec: mc.KVSpec) -> None:
    slot = spec.nbytes(CH)
    host = mc.HostTier(slot * 16, segment_bytes=slot * 4, prealloc=slot * 4)
    async with mc.Cache(cfg(spec, host)) as c:
        pool = c._mem[0].pool
        assert pool.bytes_allocated == slot * 4  # one segment, before any put
        toks = seq(0, 3 * CH)
        await c.put(toks, prefix_kv(spec, toks))  # 3 of segment 0's 4 slots
        await c.flush()
        # The next segment is there before any put needs it.
        assert pool.slots_in_use == 3 and pool.bytes_allocated == slot * 8
    lazy = mc.HostTier(slot * 16, segment_bytes=slot * 4)
    async with mc.Cache(cfg(spec, lazy)) as c:
        assert c._mem[0].pool.bytes_allocated == 0  # start-up allocates nothing


def test_prealloc_beyond_capacity_is_refused() -> None:
    with pytest.raises(mc.ConfigError, match="prealloc"):
        mc.HostTier("1MiB", prealloc="2MiB")


async def test_device_setting_says_where_hits_land(spec: mc.KVSpec) -> None:
    top = mc.DeviceTier(spec.nbytes(CH) * 4, device="cpu", name="dev")
    async with mc.Cache(cfg(spec, top, device="cpu")) as c:
        toks = seq(0, CH)
        await c.put(toks, prefix_kv(spec, toks))
        hit = await c.get(toks)
        assert c.device == torch.device("cpu") and hit.kv.device == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(mc.DeviceError):
            async with mc.Cache(cfg(spec, top, device="cuda")):
                pass


def test_close_timeout_must_be_a_number() -> None:
    from helpers import small_spec

    for bad in ("x", -1, float("nan"), True):
        with pytest.raises(mc.ConfigError, match="close_timeout"):
            mc.CacheConfig(small_spec(), "x", close_timeout=bad)  # type: ignore[arg-type]
