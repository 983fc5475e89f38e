"""The S3 storage tier against moto, with faults injected by a proxy in front of it.

Every fault test asserts the typed outcome (None, or TierError within the timeout plus a
margin) and that the data is right again once the fault is gone.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from musacache._errors import ConfigError, CorruptChunkError, TierError
from musacache._keys import Fingerprint
from musacache._spec import KVSpec
from musacache._testing.tier_model import check_tier_model
from musacache.codec import decode_chunk, encode_chunk
from musacache.tiers.base import ChunkMeta, StorageTier, TierContext
from musacache.tiers.s3 import S3Store, S3Tier
from s3_servers import FaultProxy, unique_bucket

SPEC = KVSpec(2, 2, 16, torch.bfloat16)
FP = Fingerprint("s3-test", SPEC, 16)
CTX = TierContext(FP)
MARGIN = 1.0  # seconds of slack on a loaded 2-core machine


def _key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def _chunk(i: int, tokens: int = 16, parent: bytes | None = None) -> tuple[ChunkMeta, bytes]:
    meta = ChunkMeta(_key(f"k{i}"), parent if parent is not None else _key(f"k{i - 1}"), tokens,
                     SPEC.nbytes(tokens))
    data = torch.randn(SPEC.shape(tokens), generator=torch.Generator().manual_seed(i))
    return meta, encode_chunk(FP, meta, data.to(SPEC.dtype))


StoreFactory = Callable[..., Any]


@pytest.fixture
async def make_store(moto_endpoint: str) -> AsyncIterator[StoreFactory]:
    """``await make_store(endpoint=..., bucket=..., **S3Tier fields)`` -> a started S3Store;
    all are closed at the end. Each test gets its own bucket."""
    bucket = unique_bucket()
    stores: list[S3Store] = []

    async def make(endpoint: str = moto_endpoint, ctx: TierContext = CTX,
                   **kw: Any) -> S3Store:
        kw.setdefault("bucket", bucket)
        kw.setdefault("create_bucket", True)
        store = S3Tier(endpoint_url=endpoint, **kw).build()
        await store.start(ctx)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


# -- config --------------------------------------------------------------------------------------


def test_config_fields_and_build() -> None:
    tier = S3Tier(bucket="b", prefix="/a/b/", access_key_id="id", secret_access_key="secret",
                  multipart_threshold="16MiB", capacity_bytes="1GiB")
    assert tier.prefix == "a/b" and tier.multipart_threshold == 16 * 1024**2
    assert "secret" not in repr(tier)
    store = tier.build()
    assert isinstance(store, StorageTier)
    assert (store.name, store.shared, store.capacity_bytes, store.codec, store.timeout,
            store.max_concurrency, store.write_through) == (
        "s3", True, 1024**3, "lz4", 10.0, 16, False)
    assert S3Tier(bucket="b").build().capacity_bytes is None


@pytest.mark.parametrize("kwargs", [
    {"bucket": ""},
    {"codec": "gzip"},
    {"timeout": 0},
    {"retries": -1},
    {"retries": 1.5},
    {"max_concurrency": 0},
    {"part_size": "1MiB"},
    {"multipart_threshold": -1},
    {"access_key_id": "only-the-id"},
    {"create_bucket": "yes"},
    {"capacity_bytes": -5},
    {"endpoint_url": 5},
])
def test_config_rejects(kwargs: dict[str, Any]) -> None:
    args = {"bucket": "b", **kwargs}
    with pytest.raises(ConfigError):
        S3Tier(**args)


# -- behaviour -----------------------------------------------------------------------------------


async def test_write_read_delete(make_store: StoreFactory) -> None:
    store = await make_store()
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    assert await store.read(meta) == obj
    assert await store.read(_chunk(2)[0]) is None  # absent: a miss, not a fault
    await store.write(meta, obj)  # sent again: the last write wins
    await store.delete(meta.key)
    assert await store.read(meta) is None
    await store.delete(meta.key)
    stats = store.stats()
    assert (stats["writes"], stats["reads"], stats["read_misses"], stats["read_faults"],
            stats["deletes"], stats["bytes_in"], stats["bytes_out"]) == (
        2, 1, 2, 0, 1, 2 * len(obj), len(obj))
    assert store.kind == stats["kind"] == "s3"


async def test_listing_finds_other_nodes_chunks(make_store: StoreFactory) -> None:
    node_a = await make_store()
    root = _key("root")
    chain = [_chunk(1, parent=root)]
    for i in range(2, 5):
        chain.append(_chunk(i, parent=chain[-1][0].key))
    tail = _chunk(99, tokens=5, parent=chain[-1][0].key)  # a partial tail chunk
    for meta, obj in [*chain, tail]:
        await node_a.write(meta, obj)
    # Not ours: another fingerprint's chunk in the same bucket, and a stray object.
    other = Fingerprint("other-model", SPEC, 16)
    await (await make_store(ctx=TierContext(other))).write(*_chunk(7))
    await node_a.client.put_object(Bucket=node_a.config.bucket, Key="musacache/stray.txt",
                                   Body=b"x")

    node_b = await make_store()
    found = {m.key: m for m in await node_b.refresh()}
    assert set(found) == {m.key for m, _ in [*chain, tail]}
    for meta, obj in [*chain, tail]:
        got = found[meta.key]
        assert (got.parent, got.num_tokens, got.raw_bytes, got.stored_bytes) == (
            meta.parent, meta.num_tokens, meta.raw_bytes, len(obj))
        assert abs(got.last_used - time.time()) < 300
        assert await node_b.read(got) == obj
    # One parent's children: the next full chunk and, under the last, the tail.
    assert [m.key for m in await node_b.refresh(root)] == [chain[0][0].key]
    assert [(m.key, m.num_tokens) for m in await node_b.refresh(chain[-1][0].key)] == [
        (tail[0].key, 5)]
    assert await node_b.refresh(_key("nobody")) == []
    # A chunk written after B started is found by refreshing its parent.
    late = _chunk(50, parent=tail[0].key)
    await node_a.write(*late)
    assert [m.key for m in await node_b.refresh(tail[0].key)] == [late[0].key]


async def test_start_returns_existing_chunks(make_store: StoreFactory) -> None:
    first = await make_store()
    chunks = [_chunk(i) for i in range(3)]
    for meta, obj in chunks:
        await first.write(meta, obj)
    again = await make_store()
    # start() already listed: the restart finds every chunk without a refresh.
    assert again.stats()["known_objects"] == 3
    await again.write(*chunks[0])
    assert again.stats()["writes"] == 1  # listed is not proof of the same bytes: sent


def _raw_chunk(meta: ChunkMeta, value: float) -> bytes:
    """An object of ``meta`` filled with ``value``: the same size for every value."""
    return encode_chunk(FP, meta, torch.full(SPEC.shape(meta.num_tokens), value,
                                             dtype=SPEC.dtype), "raw")


async def test_a_rewrite_after_a_delete_is_uploaded(make_store: StoreFactory) -> None:
    # Issue 10 item 1: S3Store.write skipped the upload because _known said the object
    # existed. A key re-put after a delete may carry new KV of the very same size.
    store = await make_store()
    meta = _chunk(1)[0]
    old, new = _raw_chunk(meta, 1.0), _raw_chunk(meta, 2.0)
    assert len(old) == len(new) and old != new
    await store.write(meta, old)
    again = await make_store()  # learns the object from its start-up listing
    await again.write(meta, new)
    assert await store.read(meta) == new
    await again.delete(meta.key)
    await again.write(meta, old)
    assert await store.read(meta) == old


class _SlowPuts:
    """Holds every put_object of a store's client for ``delay`` seconds before sending it."""

    def __init__(self, store: S3Store, delay: float) -> None:
        self.put = store.client.put_object
        self.delay = delay
        store.client.put_object = self

    async def __call__(self, **kwargs: Any) -> Any:
        await anyio.sleep(self.delay)
        return await self.put(**kwargs)


async def test_a_delete_after_a_slow_write_removes_it(make_store: StoreFactory) -> None:
    # Issue 10 item 1: a delete called while the write of the same key was still in flight
    # found no name in _known, did nothing, and the write then landed: the deleted chunk came
    # back after a restart. Writes and deletes of one key now take effect in call order.
    store = await make_store()
    meta, obj = _chunk(1)
    _SlowPuts(store, 0.3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.write, meta, obj)
        await anyio.lowlevel.checkpoint()  # the write is under way
        tg.start_soon(store.delete, meta.key)
    assert await store.read(meta) is None
    restarted = await make_store()
    assert await restarted.refresh() == []
    # And the other way round: a write called after a delete is the one that stays.
    await store.write(meta, obj)
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.delete, meta.key)
        await anyio.lowlevel.checkpoint()
        tg.start_soon(store.write, meta, obj)
    assert [m.key for m in await (await make_store()).refresh()] == [meta.key]


async def test_tenants_on_one_bucket_never_touch_each_other(make_store: StoreFactory) -> None:
    # Issue 10 item 3: the prefix named the fingerprint only, so tenant B listed A's chunks
    # and its clear() deleted them. Each tenant now lists, reads and deletes under its own.
    tenant_a = await make_store(ctx=TierContext(FP, tenant="a"))
    chunks = [_chunk(i) for i in range(3)]
    for meta, obj in chunks:
        await tenant_a.write(meta, obj)
    tenant_b = await make_store(ctx=TierContext(FP, tenant="b"))
    assert tenant_b.stats()["known_objects"] == 0 and await tenant_b.refresh() == []
    assert await tenant_b.refresh(chunks[0][0].parent) == []
    # B stores the same keys (the worst case: keys are salted per tenant, so this never happens
    # through a Cache), then clears them: A's objects stay whole.
    for meta, obj in chunks:
        await tenant_b.write(meta, obj[:-1] + bytes([obj[-1] ^ 1]))
    for meta, _ in chunks:
        await tenant_b.delete(meta.key)
    assert await tenant_b.refresh() == []
    restarted_a = await make_store(ctx=TierContext(FP, tenant="a"))
    assert {m.key for m in await restarted_a.refresh()} == {m.key for m, _ in chunks}
    for meta, obj in chunks:
        assert await restarted_a.read(meta) == obj
    # A cache without a tenant sees neither tenant's objects, and keeps its old prefix.
    plain = await make_store()
    assert await plain.refresh() == []
    assert plain.object_name(*_KEYS).startswith(f"musacache/{FP.digest().hex()}/")


_KEYS = (_key("k"), _key("p"), 16)


async def test_listings_kept_for_reuse_are_bounded(make_store: StoreFactory) -> None:
    # Issue 10 item 12: every distinct refresh(parent) was kept forever (about 2.6 KB per
    # distinct miss on a shared tier).
    from musacache.tiers.s3 import _MAX_LISTINGS

    reusing = await make_store(refresh_interval=30.0)
    never = await make_store()  # refresh_interval=0: a listing is never reused
    for i in range(_MAX_LISTINGS + 40):
        await reusing.refresh(_key(f"miss-{i}"))
        await never.refresh(_key(f"miss-{i}"))
    assert reusing.stats()["listings_kept"] == _MAX_LISTINGS
    assert never.stats()["listings_kept"] == 0
    # The most recent listings are the ones kept, and are still reused.
    lists = reusing.stats()["lists"]
    await reusing.refresh(_key(f"miss-{_MAX_LISTINGS + 39}"))
    assert reusing.stats()["lists"] == lists


async def test_refresh_interval_reuses_a_listing(make_store: StoreFactory) -> None:
    store = await make_store(refresh_interval=30.0)
    await store.write(*_chunk(1))
    lists = store.stats()["lists"]
    assert len(await store.refresh()) == 1
    assert len(await store.refresh()) == 1
    assert store.stats()["lists"] == lists + 1


async def test_multipart_and_ranged_reads(make_store: StoreFactory) -> None:
    store = await make_store(multipart_threshold="5MiB", part_size="5MiB")
    meta = ChunkMeta(_key("big"), _key("big-parent"), 16, SPEC.nbytes(16))
    obj = bytes(range(256)) * (12 * 1024**2 // 256) + b"tail"  # 3 parts, the last short
    await store.write(meta, obj)
    assert store.stats()["multipart_writes"] == 1
    listed = await store.refresh(meta.parent)
    assert listed[0].stored_bytes == len(obj)
    assert await store.read(listed[0]) == obj
    assert store.stats()["ranged_reads"] == 1
    # Below the threshold (or with stored_bytes unknown) a read is a single GET.
    small_meta, small = _chunk(1)
    await store.write(small_meta, small)
    assert await store.read(small_meta) == small
    assert store.stats()["multipart_writes"] == 1


async def test_damaged_objects_are_caught_by_the_codec(make_store: StoreFactory) -> None:
    store = await make_store()
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    name = store.object_name(meta.key, meta.parent, meta.num_tokens)
    bucket = store.config.bucket
    flipped = bytearray(obj)
    flipped[len(obj) // 2] ^= 0x01
    await store.client.put_object(Bucket=bucket, Key=name, Body=bytes(flipped))
    got = await store.read(meta)
    assert got == bytes(flipped)  # the tier moves bytes; verification is the codec's
    with pytest.raises(CorruptChunkError):
        decode_chunk(FP, got, expect=meta)
    await store.client.put_object(Bucket=bucket, Key=name, Body=obj[: len(obj) - 100])
    with pytest.raises(CorruptChunkError):
        decode_chunk(FP, await store.read(meta), expect=meta)
    await store.client.put_object(Bucket=bucket, Key=name, Body=obj)
    assert decode_chunk(FP, await store.read(meta), expect=meta)[0].key == meta.key


# -- faults --------------------------------------------------------------------------------------


async def _timed(coro: Any) -> tuple[float, BaseException | None, Any]:
    start = time.monotonic()
    try:
        result = await coro
    except Exception as e:
        return time.monotonic() - start, e, None
    return time.monotonic() - start, None, result


async def test_endpoint_down_then_back(make_store: StoreFactory,
                                       fault_proxy: FaultProxy) -> None:
    store = await make_store(endpoint=fault_proxy.endpoint_url, timeout=2.0, retries=2,
                             retry_backoff=0.05, connect_timeout=1.0)
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    assert await store.read(meta) == obj

    fault_proxy.stop()  # the server goes away mid-run
    elapsed, err, _ = await _timed(store.read(meta))
    assert isinstance(err, TierError) and elapsed < 2.0 + MARGIN
    meta2, obj2 = _chunk(2)
    elapsed, err, _ = await _timed(store.write(meta2, obj2))
    assert isinstance(err, TierError) and "3 attempt" in str(err)
    with pytest.raises(TierError):
        await store.refresh(meta.parent)
    stats = store.stats()
    assert stats["read_faults"] == 1 and stats["write_retries"] == 2
    assert stats["write_failures"] == 1 and stats["list_faults"] == 1
    assert "unreachable" in stats["last_error"]

    fault_proxy.start()  # back on the same port
    assert await store.read(meta) == obj
    await store.write(meta2, obj2)
    assert await store.read(meta2) == obj2
    assert [m.key for m in await store.refresh(meta2.parent)] == [meta2.key]


async def test_start_while_unreachable(make_store: StoreFactory,
                                       fault_proxy: FaultProxy) -> None:
    seeded = await make_store()
    meta, obj = _chunk(1)
    await seeded.write(meta, obj)
    fault_proxy.stop()
    store = await make_store(endpoint=fault_proxy.endpoint_url, create_bucket=True,
                             timeout=2.0, connect_timeout=1.0)
    # Unreachable is not a configuration error: the tier starts empty and learns later.
    assert store.stats()["list_faults"] == 1 and store.stats()["known_objects"] == 0
    fault_proxy.start()
    assert [m.key for m in await store.refresh()] == [meta.key]
    assert await store.read(meta) == obj


async def test_missing_bucket_fails_start(moto_endpoint: str) -> None:
    store = S3Tier(bucket=unique_bucket(), endpoint_url=moto_endpoint).build()
    with pytest.raises(TierError, match="NoSuchBucket"):
        await store.start(CTX)
    await store.aclose()


async def test_throttling(make_store: StoreFactory, fault_proxy: FaultProxy) -> None:
    store = await make_store(endpoint=fault_proxy.endpoint_url, retries=3, retry_backoff=0.05)
    meta, obj = _chunk(1)
    await store.write(meta, obj)

    fault_proxy.throttle = 1
    with pytest.raises(TierError, match="throttled"):
        await store.read(meta)  # reads never retry: the engine counts a miss
    assert await store.read(meta) == obj

    fault_proxy.throttle = 2
    meta2, obj2 = _chunk(2)
    await store.write(meta2, obj2)  # two 503s, then it goes through
    assert store.stats()["write_retries"] == 2
    assert await store.read(meta2) == obj2

    fault_proxy.throttle = 100
    meta3, obj3 = _chunk(3)
    with pytest.raises(TierError, match="throttled"):
        await store.write(meta3, obj3)
    stats = store.stats()
    assert stats["write_retries"] == 5 and stats["write_failures"] == 1
    assert stats["read_faults"] == 1
    fault_proxy.throttle = 0
    assert await store.read(meta3) is None  # the failed write left nothing behind


async def test_slow_server_never_holds_a_read_past_timeout(make_store: StoreFactory,
                                                           fault_proxy: FaultProxy) -> None:
    store = await make_store(endpoint=fault_proxy.endpoint_url, timeout=0.5, retries=1,
                             write_timeout=0.5, retry_backoff=0.01)
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    fault_proxy.delay = 3.0
    elapsed, err, _ = await _timed(store.read(meta))
    assert isinstance(err, TierError) and "timeout" in str(err)
    assert elapsed < 0.5 + MARGIN
    elapsed, err, _ = await _timed(store.write(*_chunk(2)))
    assert isinstance(err, TierError) and elapsed < 2 * 0.5 + 0.01 + MARGIN
    fault_proxy.delay = 0.0
    assert await store.read(meta) == obj


async def test_fault_logs_are_rate_limited(make_store: StoreFactory, fault_proxy: FaultProxy,
                                           caplog: pytest.LogCaptureFixture) -> None:
    store = await make_store(endpoint=fault_proxy.endpoint_url, log_interval=60.0)
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    fault_proxy.throttle = 5
    with caplog.at_level(logging.WARNING, logger="musacache.s3"):
        for _ in range(5):
            with pytest.raises(TierError):
                await store.read(meta)
    lines = [r for r in caplog.records if r.name == "musacache.s3"]
    assert len(lines) == 1 and "SlowDown" in lines[0].getMessage()
    assert store.stats()["read_faults"] == 5


def test_config_from_the_cache_loader() -> None:
    from musacache._config import CacheConfig

    env = {"MUSACACHE_NAMESPACE": "m", "MUSACACHE_SPEC__NUM_LAYERS": "2",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "2", "MUSACACHE_SPEC__HEAD_DIM": "16",
           "MUSACACHE_TIERS__0__KIND": "host", "MUSACACHE_TIERS__0__CAPACITY_BYTES": "1MiB",
           "MUSACACHE_TIERS__1__KIND": "s3", "MUSACACHE_TIERS__1__BUCKET": "20240101",
           "MUSACACHE_TIERS__1__PREFIX": "", "MUSACACHE_TIERS__1__TIMEOUT": "2",
           "MUSACACHE_TIERS__1__WRITE_THROUGH": "true",
           "MUSACACHE_TIERS__1__ENDPOINT_URL": "http://127.0.0.1:9000"}
    tier = CacheConfig.from_env(env).tiers[1]
    assert isinstance(tier, S3Tier)
    assert (tier.bucket, tier.prefix, tier.timeout, tier.write_through, tier.endpoint_url) == (
        "20240101", "", 2.0, True, "http://127.0.0.1:9000")


# -- model check ---------------------------------------------------------------------------------


class _RandomDelay:
    """Wraps one S3 client call with a random delay before it is sent."""

    def __init__(self, call: Any, rng: random.Random) -> None:
        self.call, self.rng = call, rng

    async def __call__(self, **kwargs: Any) -> Any:
        await anyio.sleep(self.rng.uniform(0, 0.02))
        return await self.call(**kwargs)


def _slow_s3(store: StorageTier, rng: random.Random) -> None:
    assert isinstance(store, S3Store)
    store.client.put_object = _RandomDelay(store.client.put_object, rng)
    store.client.delete_object = _RandomDelay(store.client.delete_object, rng)


@pytest.mark.parametrize(("seed", "tenant"), [(1, None), (2, "t")])
async def test_model_check_loses_and_resurrects_nothing(moto_endpoint: str, seed: int,
                                                        tenant: str | None) -> None:
    # Issue 10 items 1 and 8: random writes, deletes and re-writes of a few keys with slow
    # requests, each round ended by a restart (a new store over the bucket), against the model
    # of the tier contract.
    tier = S3Tier(bucket=unique_bucket(), endpoint_url=moto_endpoint, create_bucket=True)

    async def make() -> StorageTier:
        return tier.build()

    report = await check_tier_model(make, _slow_s3, seed=seed, tenant=tenant)
    assert report.ok, report
    assert report.rounds == 3 and report.writes and report.deletes
    assert report.max_overlap >= 3  # the operations of one key really overlapped


async def test_a_delete_removes_every_name_listed_for_its_key(make_store: StoreFactory) -> None:
    """Found by a probe: an object named with a real chunk's key under another parent's
    folder (a stray or forged name) was the name a restarted node kept for the key, so a
    delete removed the stray one and the served chunk came back at the next miss."""
    first = await make_store()
    meta, obj = _chunk(7)
    await first.write(meta, obj)
    stray = first.object_name(meta.key, _key("another parent"), meta.num_tokens)
    await first.client.put_object(Bucket=first.config.bucket, Key=stray, Body=b"not a chunk")
    restarted = await make_store()  # lists both names
    await restarted.delete(meta.key)
    listed = await restarted.client.list_objects_v2(Bucket=restarted.config.bucket)
    assert [o["Key"] for o in listed.get("Contents", [])] == []
    assert restarted.stats()["deletes"] == 2
