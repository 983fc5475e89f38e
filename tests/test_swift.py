"""The S3 tier against a real server: OpenStack Swift with s3api, started for the session."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from musacache._keys import Fingerprint
from musacache._spec import KVSpec
from musacache.codec import decode_chunk, encode_chunk
from musacache.tiers.base import ChunkMeta, TierContext
from musacache.tiers.s3 import S3Store, S3Tier
from s3_servers import unique_bucket

pytestmark = pytest.mark.swift

SPEC = KVSpec(4, 8, 128, torch.bfloat16)
FP = Fingerprint("swift-test", SPEC, 64)
CTX = TierContext(FP)


def _key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def _chunk(i: int, parent: bytes, tokens: int = 64) -> tuple[ChunkMeta, torch.Tensor, bytes]:
    meta = ChunkMeta(_key(f"swift-{i}"), parent, tokens, SPEC.nbytes(tokens))
    data = torch.randn(SPEC.shape(tokens), generator=torch.Generator().manual_seed(i))
    data = data.to(SPEC.dtype)
    return meta, data, encode_chunk(FP, meta, data)


@pytest.fixture
async def make_store(swift_server: Any) -> AsyncIterator[Callable[..., Any]]:
    bucket = unique_bucket()
    stores: list[S3Store] = []

    async def make(**kw: Any) -> S3Store:
        kw.setdefault("bucket", bucket)
        kw.setdefault("create_bucket", True)
        store = S3Tier(endpoint_url=swift_server.endpoint_url,
                       access_key_id=swift_server.access_key,
                       secret_access_key=swift_server.secret_key, **kw).build()
        await store.start(CTX)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


async def test_round_trip(make_store: Callable[..., Any]) -> None:
    store = await make_store()
    meta, data, obj = _chunk(1, _key("root"))
    await store.write(meta, obj)
    got = await store.read(meta)
    assert got == obj
    assert torch.equal(decode_chunk(FP, got, expect=meta)[1].view(torch.int16),
                       data.view(torch.int16))
    assert await store.read(_chunk(2, _key("root"))[0]) is None
    await store.delete(meta.key)  # one DELETE per key: Swift's DeleteObjects wants Content-MD5
    assert await store.read(meta) is None
    assert store.stats()["read_faults"] == 0


async def test_two_stores_share_one_bucket(make_store: Callable[..., Any]) -> None:
    node_a = await make_store()
    root = _key("root")
    chain: list[tuple[ChunkMeta, torch.Tensor, bytes]] = []
    parent = root
    for i in range(3):
        chain.append(_chunk(10 + i, parent))
        parent = chain[-1][0].key
    tail = _chunk(99, parent, tokens=17)
    for meta, _, obj in [*chain, tail]:
        await node_a.write(meta, obj)

    node_b = await make_store(create_bucket=False)  # a second node, started afterwards
    assert node_b.stats()["known_objects"] == 4
    listed = {m.key: m for m in await node_b.refresh()}
    for meta, data, obj in [*chain, tail]:
        got = listed[meta.key]
        assert (got.parent, got.num_tokens, got.stored_bytes) == (
            meta.parent, meta.num_tokens, len(obj))
        _, decoded = decode_chunk(FP, await node_b.read(got), expect=meta)
        assert torch.equal(decoded.view(torch.int16), data.view(torch.int16))

    # A's later write is found by B through its parent.
    late = _chunk(200, tail[0].key, tokens=3)
    await node_a.write(late[0], late[2])
    assert [(m.key, m.num_tokens) for m in await node_b.refresh(tail[0].key)] == [
        (late[0].key, 3)]
    assert [m.key for m in await node_b.refresh(root)] == [chain[0][0].key]


async def test_multipart_and_ranged_reads(make_store: Callable[..., Any]) -> None:
    store = await make_store(multipart_threshold="5MiB", part_size="5MiB")
    meta = ChunkMeta(_key("big"), _key("big-parent"), 64, SPEC.nbytes(64))
    obj = bytes(range(251)) * (11 * 1024**2 // 251)  # 3 parts, the last one short
    await store.write(meta, obj)
    assert store.stats()["multipart_writes"] == 1
    listed = await store.refresh(meta.parent)
    assert [m.stored_bytes for m in listed] == [len(obj)]
    assert await store.read(listed[0]) == obj
    assert store.stats()["ranged_reads"] == 1


async def test_existing_bucket_and_idempotent_writes(make_store: Callable[..., Any]) -> None:
    first = await make_store()
    meta, _, obj = _chunk(5, _key("root"))
    await first.write(meta, obj)
    second = await make_store()  # create_bucket on a bucket that exists is fine
    await second.write(meta, obj)  # listed at start, and still sent: the last write wins
    assert second.stats()["writes"] == 1
    third = await make_store(create_bucket=False)
    third._known.clear()  # as if it had never seen it: the overwrite is harmless
    await third.write(meta, obj)
    assert await first.read(meta) == obj
