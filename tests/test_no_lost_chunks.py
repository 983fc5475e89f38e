"""Issue 10, items 1 and 2: no chunk is lost, none comes back after a delete.

A model check runs random puts, deletes, re-puts (with new KV), evictions, flushes and restarts
over slow storage tiers (a plug-in, disk, S3 on moto) whose writes and deletes finish in random
order, and compares every lookup and every byte served against a model of what must be cached.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

import musacache as mc
from fake_store import MemStore
from helpers import prefix_kv, small_spec
from musacache.tiers.disk import DiskTier
from musacache.tiers.s3 import S3Tier
from s3_servers import unique_bucket

CH = 8
BLOCKS = 4  # distinct chunk contents: prompts are 1..4 chunks drawn from them


class Slow(mc.StorageTier):
    """Wraps a storage tier; every write, delete and read first sleeps a random while, so
    operations on one key finish out of order unless the engine orders them."""

    def __init__(self, inner: mc.StorageTier, rng: random.Random, max_delay: float) -> None:
        self.inner = inner
        self.rng = rng
        self.max_delay = max_delay
        for name in ("name", "capacity_bytes", "write_through", "codec", "timeout",
                     "max_concurrency", "shared"):
            setattr(self, name, getattr(inner, name))
        self.timeout = 30.0

    async def _nap(self) -> None:
        await anyio.sleep(self.rng.random() * self.max_delay)

    async def start(self, ctx: mc.TierContext) -> list[mc.ChunkMeta]:
        return await self.inner.start(ctx)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def write(self, meta: mc.ChunkMeta, obj: bytes) -> None:
        await self._nap()
        await self.inner.write(meta, obj)

    async def read(self, meta: mc.ChunkMeta) -> bytes | None:
        await self._nap()
        return await self.inner.read(meta)

    async def delete(self, key: bytes) -> None:
        await self._nap()
        await self.inner.delete(key)

    async def refresh(self, parent: bytes | None = None) -> list[mc.ChunkMeta]:
        return await self.inner.refresh(parent)


def tokens_of(blocks: tuple[int, ...]) -> list[int]:
    return [b * 1000 + i * 10 + j for i, b in enumerate(blocks) for j in range(CH)]


def kv_of(spec: mc.KVSpec, blocks: tuple[int, ...], versions: list[int]) -> torch.Tensor:
    """KV of a prompt whose chunk i was put at version ``versions[i]`` (new KV on re-put)."""
    kv = prefix_kv(spec, tokens_of(blocks))
    per_token = torch.tensor([v for v in versions for _ in range(CH)], dtype=kv.dtype)
    shape = [1] * kv.dim()
    shape[spec.token_dim] = -1
    return kv + per_token.view(shape) * 100000


class Model:
    """What must be cached: each chunk (a tuple of blocks) and the version it was put at."""

    def __init__(self) -> None:
        self.alive: dict[tuple[int, ...], int] = {}

    def put(self, blocks: tuple[int, ...], version: int) -> None:
        for i in range(1, len(blocks) + 1):
            self.alive.setdefault(blocks[:i], version)

    def delete(self, blocks: tuple[int, ...]) -> None:
        # The prompt's chunks and every chunk that extends them: all under its first chunk.
        for k in [k for k in self.alive if k[0] == blocks[0]]:
            del self.alive[k]

    def cached(self, blocks: tuple[int, ...]) -> list[int]:
        out = []
        for i in range(1, len(blocks) + 1):
            if blocks[:i] not in self.alive:
                break
            out.append(self.alive[blocks[:i]])
        return out


async def check(cache: mc.Cache, spec: mc.KVSpec, model: Model,
                prompts: list[tuple[int, ...]], report: dict[str, int]) -> None:
    await cache.flush()
    for p in prompts:
        want = model.cached(p)
        got = await cache.lookup(tokens_of(p))
        if got < len(want) * CH:
            report["lost"] += 1
        elif got > len(want) * CH:
            report["resurrected"] += 1
        hit = await cache.get(tokens_of(p))
        n = min(hit.num_tokens, len(want) * CH)
        if n and not torch.equal(hit.kv.narrow(spec.token_dim, 0, n),
                                 kv_of(spec, p[:len(want)], want).narrow(spec.token_dim, 0, n)):
            report["wrong"] += 1


async def model_check(make_store: Callable[[], mc.StorageTier], seed: int, steps: int) -> None:
    spec = small_spec()
    rng = random.Random(seed)
    prompts = sorted({tuple(rng.randrange(BLOCKS) for _ in range(rng.randint(1, 4)))
                      for _ in range(40)})

    def config() -> mc.CacheConfig:
        store = Slow(make_store(), rng, 0.01)
        return mc.CacheConfig(spec, "model-check", chunk_size=CH, close_timeout=60,
                              tiers=(mc.HostTier(spec.nbytes(CH) * 3), store))

    model = Model()
    report = {"lost": 0, "resurrected": 0, "wrong": 0}
    version = 0
    cache = mc.Cache(config())
    await cache.open()
    try:
        for _ in range(steps):
            op = rng.random()
            p = rng.choice(prompts)
            if op < 0.5:
                version += 1
                versions = [model.alive.get(p[:i + 1], version) for i in range(len(p))]
                assert await cache.put(tokens_of(p), kv_of(spec, p, versions)) == len(p) * CH
                model.put(p, version)
            elif op < 0.8:
                await cache.delete(tokens_of(p))
                model.delete(p)
                # Gone at once, before any storage delete has run.
                assert await cache.lookup(tokens_of(p)) == 0
            elif op < 0.95:
                await check(cache, spec, model, prompts, report)
            else:
                await cache.aclose()
                assert (await cache.stats())["close"]["not_persisted"] == 0
                cache = mc.Cache(config())
                await cache.open()
        await check(cache, spec, model, prompts, report)
        await cache.aclose()
        cache = mc.Cache(config())
        await cache.open()
        await check(cache, spec, model, prompts, report)
    finally:
        await cache.aclose()
    assert report == {"lost": 0, "resurrected": 0, "wrong": 0}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_model_check_plugin_tier(seed: int) -> None:
    objects: dict[bytes, bytes] = {}
    await model_check(lambda: MemStore(objects), seed, steps=120)


@pytest.mark.parametrize("seed", [4, 5])
async def test_model_check_disk_tier(tmp_path: Path, seed: int) -> None:
    def make() -> mc.StorageTier:
        store: mc.StorageTier = DiskTier(path=str(tmp_path / "disk"),
                                         capacity_bytes="1GiB").build()
        return store
    await model_check(make, seed, steps=80)


async def test_model_check_s3_tier(moto_endpoint: str) -> None:
    bucket = unique_bucket()

    def make() -> mc.StorageTier:
        store: mc.StorageTier = S3Tier(bucket=bucket, endpoint_url=moto_endpoint,
                                       create_bucket=True).build()
        return store
    await model_check(make, 6, steps=60)


# -- the sequences from the issue, one by one ------------------------------------------------


def _cfg(spec: mc.KVSpec, store: mc.StorageTier) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "issue10", chunk_size=CH,
                          tiers=(mc.HostTier(spec.nbytes(CH)), store))


class SlowDeletes(MemStore):
    """Writes take 50 ms, deletes 200 ms: a delete scheduled before a write lands after it
    unless the engine orders the two."""

    async def delete(self, key: bytes) -> None:
        await anyio.sleep(0.2)
        await super().delete(key)


async def test_stale_delete_never_removes_the_newer_copy() -> None:
    """put(p); put(q) evicts p (write pending); delete(p); put(p); put(r) evicts the new p;
    flush; get(p) must hit, with the new bytes."""
    spec = small_spec()
    store = SlowDeletes()
    store.write_delay = 0.05
    p, q, r = (0,), (1,), (2,)
    async with mc.Cache(_cfg(spec, store)) as c:
        await c.put(tokens_of(p), kv_of(spec, p, [1]))
        await c.put(tokens_of(q), kv_of(spec, q, [1]))  # p goes down, its write is queued
        await c.delete(tokens_of(p))
        await c.put(tokens_of(p), kv_of(spec, p, [2]))
        await c.put(tokens_of(r), kv_of(spec, r, [1]))  # the new p goes down
        await c.flush()
        hit = await c.get(tokens_of(p))
        assert hit.num_tokens == CH and torch.equal(hit.kv, kv_of(spec, p, [2]))
    # And a restarted cache over the same objects finds it too.
    async with mc.Cache(_cfg(spec, MemStore(store.objects))) as c:
        hit = await c.get(tokens_of(p))
        assert hit.num_tokens == CH and torch.equal(hit.kv, kv_of(spec, p, [2]))


async def test_delete_removes_sibling_subtrees_everywhere(tmp_path: Path) -> None:
    """put(X+Y), put(X+Z), delete(X+Y), re-put X with new KV: X+Z must not hit Z, now or
    after a restart."""
    spec = small_spec()
    x, xy, xz = (0, 0), (0, 0, 1), (0, 0, 2)

    def config() -> mc.CacheConfig:
        return mc.CacheConfig(spec, "issue10", chunk_size=CH, tiers=(
            mc.HostTier(spec.nbytes(CH) * 2),
            DiskTier(path=str(tmp_path / "d"), capacity_bytes="1GiB")))

    async with mc.Cache(config()) as c:
        await c.put(tokens_of(xy), kv_of(spec, xy, [1, 1, 1]))
        await c.put(tokens_of(xz), kv_of(spec, xz, [1, 1, 1]))
        await c.flush()
        assert await c.delete(tokens_of(xy)) == 4  # X's two chunks, Y, and Z
        await c.put(tokens_of(x), kv_of(spec, x, [2, 2]))
        assert await c.lookup(tokens_of(xz)) == 2 * CH
    async with mc.Cache(config()) as c:
        assert await c.lookup(tokens_of(xz)) == 2 * CH
        hit = await c.get(tokens_of(xz))
        assert torch.equal(hit.kv, kv_of(spec, x, [2, 2]))


@pytest.mark.parametrize("doomed", [(3, 1), (3, 0, 0, 0)], ids=["cached", "uncached-tail"])
async def test_delete_forgets_the_same_through_a_cached_or_uncached_tail(
        doomed: tuple[int, ...]) -> None:
    """Deleting through a prompt that is cached whole forgets as much as through one whose
    tail was never cached: everything under the prompt's first chunk."""
    spec = small_spec()
    a, ab, ac = (3,), (3, 1), (3, 2, 2)
    async with mc.Cache(mc.CacheConfig(spec, "issue10", chunk_size=CH,
                                       tiers=(mc.HostTier(spec.nbytes(CH) * 8), MemStore()))) as c:
        for p in (ab, ac):
            await c.put(tokens_of(p), kv_of(spec, p, [1] * len(p)))
        assert await c.delete(tokens_of(doomed)) == 4
        for p in (a, ab, ac):
            assert await c.lookup(tokens_of(p)) == 0


async def test_delete_of_a_partial_tail_takes_the_chunk_that_extends_it() -> None:
    spec = small_spec()
    toks = list(range(2 * CH))
    async with mc.Cache(_cfg(spec, MemStore())) as c:
        await c.put(toks, prefix_kv(spec, toks))
        assert await c.delete(toks[: CH + 3]) == 2  # chunk 0, and chunk 1 that extends it
        assert await c.lookup(toks) == 0


async def test_a_shared_tier_listing_never_brings_back_a_chunk_being_deleted() -> None:
    """On a shared tier a miss lists what other nodes wrote. A chunk deleted here whose object
    delete has not finished yet is still in that listing: it must not be learned again."""
    spec = small_spec()
    store = SlowDeletes(shared=True, write_through=True)
    p = (5, 1)
    config = mc.CacheConfig(spec, "issue10", chunk_size=CH, refresh_interval=0,
                            tiers=(mc.HostTier(spec.nbytes(CH) * 4), store))
    async with mc.Cache(config) as c:
        await c.put(tokens_of(p), kv_of(spec, p, [1, 1]))
        await c.flush()
        assert len(store.objects) == 2
        await c.delete(tokens_of(p))
        assert await c.lookup(tokens_of(p)) == 0  # the deletes are still running
        await c.flush()
        assert store.objects == {}
        assert await c.lookup(tokens_of(p)) == 0
