"""A put racing a delete, a clear or its own cancellation: nothing deleted
or cleared is ever served afterwards, and nothing is left in the directory that no tier
holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import musacache as mc
from fake_store import MemStore
from musacache.engine import removal as _removal

CS = 4
SPEC = mc.KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def _kv(n: int, v: float) -> torch.Tensor:
    return torch.full(SPEC.shape(n), float(v))


def _values(hit: Any) -> set[float]:
    return set(hit.kv[0, 0, :, 0, 0].tolist())


async def test_a_chunk_put_again_during_a_clear_never_gets_the_old_kv(monkeypatch) -> None:
    # clear() swaps in an empty directory and takes the old one apart a batch per loop turn;
    # an old chunk not reached yet was still demoted, and its object landed after that of
    # the same key put again since: get served the KV put before the clear.
    real = _removal._dismantle_steps
    held = [True]

    def long_dismantle(old: Any, batch: int, each: Any) -> Iterator[None]:
        while held[0]:  # turns of the loop before this chunk's batch: a large directory's
            yield
        yield from real(old, batch, each)

    monkeypatch.setattr(_removal, "_dismantle_steps", long_dismantle)
    store = MemStore(codec="raw")
    cfg = mc.CacheConfig(SPEC, "r", chunk_size=CS, inline_copy_bytes=1 << 30,
                         tiers=(mc.HostTier(SPEC.nbytes(CS) * 2), store))
    k, c2 = [1, 2, 3, 4], [5, 6, 7, 8]
    async with mc.Cache(cfg) as c:
        await c.put(k + c2, _kv(8, 1))
        await c.put([100] * 4, _kv(4, 7))  # evicts the leaf to the store
        await c.flush()
        store.read_delay = 0.2
        get = asyncio.create_task(c.get(k + c2))  # pins k while the leaf is read slowly
        await asyncio.sleep(0.01)
        clear = asyncio.create_task(c.clear())
        await asyncio.sleep(0)  # the directory is swapped
        await c.put(k, _kv(4, 2))  # k again, new KV
        await c.put([101] * 4, _kv(4, 7))  # the new k demoted to the store
        await c.flush()
        await get  # the old k unpinned
        store.read_delay = 0
        await c.put([102] * 4, _kv(4, 7))
        await c.put([103] * 4, _kv(4, 7))  # the old k leaves memory: not written
        await c.flush()
        held[0] = False
        await clear
        await c.flush()
        hit = await c.get(k)
        assert hit.num_tokens == 4 and _values(hit) == {2.0}


async def test_a_put_racing_a_delete_leaves_nothing_to_come_back() -> None:
    # A delete while a long put moved its second round: the round was committed under the
    # deleted chunks, and a later put of the prompt (new KV) adopted it: get served the
    # deleted KV for it.
    cfg = mc.CacheConfig(SPEC, "r", chunk_size=CS, inline_copy_bytes=0,  # moves in threads
                         tiers=(mc.HostTier(SPEC.nbytes(CS) * 64),))
    toks = list(range(20 * CS))  # two rounds of a put: 16 chunks, then 4
    async with mc.Cache(cfg) as c:
        put = asyncio.create_task(c.put(toks, _kv(len(toks), 1)))
        # The first round committed, the second moving (polled: no event tells it).
        while await c.lookup(toks) < 16 * CS:  # noqa: ASYNC110
            await asyncio.sleep(0)
        await c.delete(toks)
        assert await put <= 16 * CS  # the second round is not committed
        await c.flush()
        assert await c.lookup(toks) == 0
        assert await c.put(toks, _kv(len(toks), 2)) == len(toks)
        hit = await c.get(toks)
        assert hit.num_tokens == len(toks) and _values(hit) == {2.0}


def _storage_cfg(store: MemStore) -> mc.CacheConfig:
    # One chunk of memory, and a write queue that one pending write fills: a put's later
    # chunks wait for room in it.
    return mc.CacheConfig(SPEC, "r", chunk_size=CS, write_queue_bytes=1024,
                          tiers=(mc.HostTier(SPEC.nbytes(CS)), store))


async def _consistent(c: mc.Cache, toks: list[int], kept: set[float]) -> None:
    """Every chunk in the directory is held by a tier, so a put of the prompt stores what
    lookup and get then agree on."""
    eng = c._eng
    assert eng is not None
    assert not [e for e in eng.dir.entries.values() if e.dead]
    assert all(any(t.holds(e) for t in eng.tiers) for e in eng.dir.entries.values())
    n = await c.put(toks, _kv(len(toks), 3))
    await c.flush()
    hit = await c.get(toks)
    assert n == len(toks) == await c.lookup(toks) == hit.num_tokens
    assert _values(hit) <= {3.0} | kept


async def test_a_put_cancelled_while_waiting_for_storage_leaves_no_phantom() -> None:
    store = MemStore(codec="raw")
    store.write_delay = 0.3
    toks = list(range(4 * CS))
    async with mc.Cache(_storage_cfg(store)) as c:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.put(toks, _kv(len(toks), 1)), 0.1)
        await c.flush()
        store.write_delay = 0
        await _consistent(c, toks, {1.0})  # what the cancelled put committed stays


async def test_a_delete_while_a_put_waits_for_storage_is_not_undone() -> None:
    store = MemStore(codec="raw")
    store.write_delay = 0.3
    toks = list(range(4 * CS))
    async with mc.Cache(_storage_cfg(store)) as c:
        put = asyncio.create_task(c.put(toks, _kv(len(toks), 1)))
        await asyncio.sleep(0.1)  # the put waits for room in the write queue
        await c.delete(toks)
        await put
        await c.flush()
        assert await c.lookup(toks) == 0
        store.write_delay = 0
        await _consistent(c, toks, set())
