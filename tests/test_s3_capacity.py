"""A bounded S3 tier never ends above its capacity.

Many seeds of concurrent put batches (write-behind demotions from a small host tier, and
write-through) over an S3 tier on moto whose requests take random times, with restarts over
the same bucket: after every ``flush()`` the tier's ``bytes_used`` is at most its capacity, the
objects in the bucket add up to no more than that either, and every hit serves the bytes that
were put.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache.tiers.s3 import S3Store, S3Tier
from s3_servers import unique_bucket

CH = 8
SEEDS = range(12)


class _Delayed:
    """One S3 client call, sent after a random delay (so uploads finish out of order)."""

    def __init__(self, call: Any, rng: random.Random) -> None:
        self.call, self.rng = call, rng

    async def __call__(self, **kwargs: Any) -> Any:
        await anyio.sleep(self.rng.uniform(0, 0.02))
        return await self.call(**kwargs)


class SlowS3(S3Store):
    """An S3 store whose puts and deletes wait a random while before they are sent."""

    def __init__(self, config: S3Tier, rng: random.Random) -> None:
        super().__init__(config)
        self.rng = rng

    async def start(self, ctx: mc.TierContext) -> Any:
        listing = await super().start(ctx)
        self.client.put_object = _Delayed(self.client.put_object, self.rng)
        self.client.delete_object = _Delayed(self.client.delete_object, self.rng)
        return listing


def tokens_of(prompt: int, chunks: int) -> list[int]:
    return [prompt * 10_000 + j for j in range(chunks * CH)]


async def bucket_bytes(store: S3Store) -> int:
    total = 0
    paginator = store.client.get_paginator("list_objects_v2")
    async for page in paginator.paginate(Bucket=store.config.bucket, Prefix=store._base):
        total += sum(int(obj["Size"]) for obj in page.get("Contents", ()))
    return total


async def check(cache: mc.Cache, store: S3Store, spec: mc.KVSpec, capacity: int,
                put: dict[int, int], report: dict[str, Any]) -> None:
    await cache.flush()
    s3 = (await cache.stats())["tiers"]["s3"]
    report["max_used"] = max(report["max_used"], s3["bytes_used"])
    report["max_bucket"] = max(report["max_bucket"], await bucket_bytes(store))
    if s3["bytes_used"] > capacity:
        report["over"] += 1
    for prompt, chunks in put.items():
        toks = tokens_of(prompt, chunks)
        hit = await cache.get(toks)
        if hit.num_tokens:
            want = prefix_kv(spec, toks[:hit.num_tokens])
            if not torch.equal(hit.kv, want):
                report["wrong"] += 1


async def put_one(cache: mc.Cache, spec: mc.KVSpec, prompt: int, chunks: int) -> None:
    toks = tokens_of(prompt, chunks)
    await cache.put(toks, prefix_kv(spec, toks))


async def run_seed(endpoint: str, seed: int, capacity: int, write_through: bool,
                   restarts: bool) -> dict[str, Any]:
    spec = small_spec()
    rng = random.Random(seed)
    bucket = unique_bucket()
    stores: list[S3Store] = []

    def config() -> mc.CacheConfig:
        tier = S3Tier(bucket=bucket, endpoint_url=endpoint, create_bucket=True,
                      capacity_bytes=capacity, write_through=write_through, name="s3")
        store = SlowS3(tier, rng)
        stores.append(store)
        # A write queue of two chunks: puts wait for room in it while others make theirs.
        return mc.CacheConfig(spec, "s3-capacity", chunk_size=CH, close_timeout=60,
                              write_queue_bytes=spec.nbytes(CH) * 2,
                              tiers=(mc.HostTier(spec.nbytes(CH) * 2), store))

    report: dict[str, Any] = {"over": 0, "wrong": 0, "max_used": 0, "max_bucket": 0}
    put: dict[int, int] = {}
    cache = mc.Cache(config())
    await cache.open()
    try:
        for step in range(4):
            batch = [(rng.randrange(12), rng.randint(1, 3)) for _ in range(rng.randint(3, 6))]

            async with anyio.create_task_group() as tg:
                for prompt, chunks in batch:
                    tg.start_soon(put_one, cache, spec, prompt, chunks)
            for prompt, chunks in batch:
                put[prompt] = max(put.get(prompt, 0), chunks)
            await check(cache, stores[-1], spec, capacity, put, report)
            if restarts and step % 2 == 1:
                await cache.aclose()
                cache = mc.Cache(config())
                await cache.open()
                await check(cache, stores[-1], spec, capacity, put, report)
    finally:
        await cache.aclose()
    return report


@pytest.mark.parametrize("restarts", [False, True], ids=["no-restart", "restarts"])
@pytest.mark.parametrize("write_through", [False, True], ids=["behind", "through"])
@pytest.mark.parametrize("capacity", [9000, 12000])
async def test_s3_tier_stays_within_its_capacity(moto_endpoint: str, capacity: int,
                                                 write_through: bool, restarts: bool) -> None:
    reports = {}
    for seed in SEEDS:
        reports[seed] = await run_seed(moto_endpoint, seed, capacity, write_through, restarts)
    bad = {s: r for s, r in reports.items()
           if r["over"] or r["wrong"] or r["max_bucket"] > capacity}
    worst = max(r["max_used"] for r in reports.values())
    assert not bad, f"{len(bad)} of {len(reports)} seeds failed, up to {worst} bytes: {bad}"


async def test_chunks_learned_from_another_node_keep_the_tier_within_its_capacity(
        moto_endpoint: str) -> None:
    """A refresh on a miss learns what other nodes wrote to the shared bucket: a tier that
    learns past its capacity makes room, as it does when it opens."""
    spec = small_spec()
    bucket = unique_bucket()
    capacity = spec.nbytes(CH) * 3  # about three encoded chunks and a half

    def config(name: str) -> mc.CacheConfig:
        tier = S3Tier(bucket=bucket, endpoint_url=endpoint_url, create_bucket=True,
                      capacity_bytes=capacity, write_through=True, name="s3")
        return mc.CacheConfig(spec, "s3-learn", chunk_size=CH, refresh_interval=0.0,
                              tiers=(mc.HostTier(spec.nbytes(CH) * 64), tier))

    endpoint_url = moto_endpoint
    async with mc.Cache(config("reader")) as reader:
        prompts = [tokens_of(p, 2) for p in range(4)]
        for toks in prompts:  # another node writes each prompt, then this one asks for it
            async with mc.Cache(config("writer")) as writer:
                await writer.put(toks, prefix_kv(spec, toks))
                await writer.flush()
            hit = await reader.get(toks)
            assert hit.num_tokens in (0, CH, 2 * CH)
            if hit.num_tokens:
                assert torch.equal(hit.kv, prefix_kv(spec, toks[:hit.num_tokens]))
            await reader.flush()
            used = (await reader.stats())["tiers"]["s3"]["bytes_used"]
            assert used <= capacity, f"{used} bytes used of {capacity}"
