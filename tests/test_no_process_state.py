"""A cache changes nothing of the process it runs in: Python's garbage collector stays as
the host set it (enabled, thresholds, nothing frozen) while a cache opens, works on a
directory of thousands of entries, learns a storage tier's listing and closes."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import musacache as mc
from musacache.bench.scale import _Listing, _listing
from musacache.engine.core import BATCH

CH = 16
TINY = mc.KVSpec(1, 1, 8, torch.float16)


def _gc_state() -> tuple[bool, tuple[int, ...], int]:
    return gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()


@pytest.fixture
def collector_on() -> Iterator[None]:
    # Only with the collector on would a cache have a reason to touch it.
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


async def _watched(work) -> list[tuple[bool, tuple[int, ...], int]]:
    """Run ``work`` while the collector's state is sampled at every loop turn; returns
    every state seen that differs from the one before it."""
    before = _gc_state()
    seen: list[tuple[bool, tuple[int, ...], int]] = []
    running = True

    async def watch() -> None:
        while running:
            now = _gc_state()
            if now != before and now not in seen:
                seen.append(now)
            await asyncio.sleep(0)

    task = asyncio.create_task(watch())
    try:
        await work()
    finally:
        running = False
        await task
    after = _gc_state()
    if after != before and after not in seen:
        seen.append(after)
    return seen


@pytest.mark.usefixtures("collector_on")
async def test_a_cache_at_thousands_of_entries_leaves_the_collector_as_it_was():
    n = 20_000  # chunks: past any period a cache could act on the collector at
    rng = np.random.default_rng(7)
    prompts = rng.integers(0, 128000, (n // 64, 64 * CH)).astype(np.int32)
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)

    async def work() -> None:
        cfg = mc.CacheConfig(TINY, "no-state", chunk_size=CH,
                             tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * n // 2),))
        async with mc.Cache(cfg) as c:
            for p in prompts:  # the second half evicts the first
                await c.put(p, kv)
            assert len(c._engine.dir) >= n // 4
            last = prompts[-1]
            assert await c.lookup(last) == len(last)
            assert (await c.get(last)).num_tokens == len(last)
            long = rng.integers(0, 128000, 2048 * CH).astype(np.int32)
            await c.put(long, torch.zeros(TINY.shape(len(long)), dtype=TINY.dtype))
            assert (await c.get(long)).num_tokens == len(long)
            await c.delete(last)
            await c.clear()

    assert await _watched(work) == []


@pytest.mark.usefixtures("collector_on")
async def test_a_restart_from_a_listing_leaves_the_collector_as_it_was():
    n = 64 * BATCH
    listing = _listing(n, 64)

    async def work() -> None:
        for as_list in (False, True):
            cfg = mc.CacheConfig(TINY, "bench-scale", chunk_size=CH,
                                 tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 64),
                                        _Listing(listing, as_list)))
            async with mc.Cache(cfg) as c:
                assert len(c._engine.dir) == n

    assert await _watched(work) == []


@pytest.mark.usefixtures("collector_on")
async def test_the_directory_gives_the_collector_nothing_per_entry_to_walk():
    """A full collection walks every tracked object of the process: the directory's entries
    and the tables holding them are not among them, so its pause does not grow with the
    directory (half a second at a million entries when each entry was walked)."""
    n = 8192
    rng = np.random.default_rng(8)
    prompts = rng.integers(0, 128000, (n // 64, 64 * CH)).astype(np.int32)
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    cfg = mc.CacheConfig(TINY, "no-state", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * n),))
    async with mc.Cache(cfg) as c:
        await c.put(prompts[0], kv)
        gc.collect()
        before = len(gc.get_objects())
        for p in prompts[1:]:
            await c.put(p, kv)
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert len(c._engine.dir) == n
    assert grown < n // 20, grown
    n = 16384
    cfg = mc.CacheConfig(TINY, "bench-scale", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 64),
                                _Listing(_listing(n, 64))))
    gc.collect()
    before = len(gc.get_objects())
    async with mc.Cache(cfg) as c:  # a storage tier's recency order holds every entry
        assert len(c._engine.dir) == n
        gc.collect()
        grown = len(gc.get_objects()) - before
    assert grown < n // 20, grown


async def test_an_embedded_server_leaves_the_switch_interval_and_file_limit_as_they_were(
        tmp_path):
    """Only ``musacache serve``, which owns its process, sets the GIL switch interval and
    raises RLIMIT_NOFILE; a Server embedded in another process changes neither."""
    import resource
    import sys

    from musacache.server import Server, ServerConfig

    before = sys.getswitchinterval(), resource.getrlimit(resource.RLIMIT_NOFILE)
    cfg = ServerConfig(str(tmp_path / "s" / "s.sock"), chunk_size=16,
                       tiers=(mc.HostTier(1 << 20),))
    async with Server(cfg) as srv:
        task = asyncio.create_task(srv.serve_forever())
        await asyncio.sleep(0.05)
        srv.stop()
        await task
    assert (sys.getswitchinterval(), resource.getrlimit(resource.RLIMIT_NOFILE)) == before
