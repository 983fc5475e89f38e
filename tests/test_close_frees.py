"""A closed cache is freed by reference counting alone, with everything it held.

A cycle among a cache's own objects (the engine and its cold path naming each other) would
keep the engine, its tiers, the directory's skeleton, the recency arrays and every entry a
storage tier's recency order still names until a full collection found it, and a full
collection walks every tracked object of the process. Each test here runs with the
collector off, so only reference counts free anything."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import musacache as mc
import musacache.cache as engine_module
from musacache.tiers.base import StorageTier, TierContext

CH = 16
SPEC = mc.KVSpec(2, 2, 8, torch.float16)


@pytest.fixture
def no_collector() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[object]]:
    """Every engine a cache makes, by weak reference."""
    made: list[weakref.ref[object]] = []

    class Recorded(engine_module.Engine):
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, **k)  # type: ignore[arg-type]
            made.append(weakref.ref(self))

    monkeypatch.setattr(engine_module, "Engine", Recorded)
    return made


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, n * CH).astype(np.int32)


async def _work(cache: mc.Cache, chunks: int) -> None:
    a, b = _prompt(chunks, 1), _prompt(chunks, 2)
    kv = torch.randn(SPEC.shape(chunks * CH)).to(SPEC.dtype)
    assert await cache.put(a, kv) == len(a)
    assert await cache.put(b, kv) == len(b)  # evicts a from the host tier where it is small
    got = await cache.get(a)
    assert got.num_tokens == len(a) or cache.config.tiers[1:] == ()
    assert await cache.lookup(b) > 0
    await cache.delete(b)


@pytest.mark.asyncio
async def test_host_cache_freed_when_dropped(no_collector: None,
                                            engines: list[weakref.ref[object]]) -> None:
    cache = mc.Cache(mc.CacheConfig(SPEC, "frees", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=SPEC.nbytes(CH) * 64),)))
    async with cache:
        await _work(cache, 8)
    pool = weakref.ref(cache._engine.mem[0].pool)
    del cache
    assert [r() for r in engines] == [None]
    assert pool() is None


@pytest.mark.asyncio
async def test_cache_with_disk_tier_freed_with_its_entries(
        no_collector: None, engines: list[weakref.ref[object]], tmp_path: object) -> None:
    cache = mc.Cache(mc.CacheConfig(SPEC, "frees", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=SPEC.nbytes(CH) * 12),
        mc.DiskTier(path=str(tmp_path), capacity_bytes=SPEC.nbytes(CH) * 256))))
    async with cache:
        await _work(cache, 8)
        await cache.flush()
        stored = cache._engine.stores[0]
        assert len(stored.lru) > 0  # the disk tier's recency order names entries
        store = weakref.ref(stored.store)
    assert len(stored.lru) == 0  # let go of at close, a generation per loop turn
    del cache, stored
    assert [r() for r in engines] == [None]
    assert store() is None


class _FailingStart(StorageTier):
    name = "failing"
    capacity_bytes = None

    async def start(self, ctx: TierContext) -> list[object]:
        raise OSError("the tier cannot start")

    async def write(self, meta: object, obj: bytes) -> None:
        raise AssertionError("never written")

    async def read(self, meta: object) -> bytes | None:
        return None

    async def delete(self, key: bytes) -> None:
        return None

    async def aclose(self) -> None:
        return None


@pytest.mark.asyncio
async def test_engine_of_a_failed_open_is_freed(no_collector: None,
                                                engines: list[weakref.ref[object]]) -> None:
    cache = mc.Cache(mc.CacheConfig(SPEC, "frees", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=SPEC.nbytes(CH) * 8), _FailingStart())))
    with pytest.raises(OSError, match="cannot start"):
        await cache.open()
    assert len(engines) == 1
    del cache
    assert engines[0]() is None
