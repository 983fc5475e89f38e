"""A restart learns a storage tier's listing in compact form (issue 12): ``ChunkListing``.

Not timings (``musacache bench scale --only stalls`` shows those): what is alive on the loop
while a listing is read and learned, and that the compact form learns exactly what a list of
``ChunkMeta`` does."""

from __future__ import annotations

import asyncio
import gc
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import musacache as mc
from musacache._errors import InvalidInputError
from musacache._keys import KEY_BYTES, Fingerprint, KeyChain
from musacache.bench.scale import _Listing, _listing
from musacache.codec import encode_chunk
from musacache.engine.core import BATCH
from musacache.tiers.base import ChunkListing, ChunkMeta, ListingBuilder, TierContext
from musacache.tiers.disk import DiskTier

CH = 16
TINY = mc.KVSpec(1, 1, 8, torch.float16)


def _shuffled_metas(n: int) -> list[ChunkMeta]:
    """A listing in no order, with ties in ``last_used`` (the sort must be stable) and rows
    that are no chunk of the spec (wrong size, too many tokens): those are never learned."""
    metas = list(_listing(n, 8))
    random.Random(3).shuffle(metas)
    out = []
    for i, m in enumerate(metas):
        if i % 3 == 0:
            m = ChunkMeta(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes, 7.0)
        elif i % 17 == 0:
            m = ChunkMeta(m.key, m.parent, m.num_tokens, m.raw_bytes + 1, m.stored_bytes, 1.0)
        elif i % 19 == 0:
            m = ChunkMeta(m.key, m.parent, CH + 1, TINY.nbytes(CH + 1), m.stored_bytes, 2.0)
        out.append(m)
    return out


def test_a_listing_round_trips_chunk_metas_and_sorts_like_a_stable_sort():
    metas = _shuffled_metas(3000)
    listing = ChunkListing.from_metas(metas)
    assert len(listing) == len(metas)
    assert list(listing) == metas
    assert listing == metas and listing == ChunkListing.from_metas(metas)
    assert list(listing.oldest_first()) == sorted(metas, key=lambda m: m.last_used)
    halves = ChunkListing.concat([ChunkListing.from_metas(metas[:1000]),
                                  ChunkListing.from_metas(metas[1000:])])
    assert halves == listing
    assert len(ChunkListing.empty()) == 0 and ChunkListing.empty() == []


def test_a_malformed_listing_is_refused_before_anything_is_learned():
    b = ListingBuilder()
    with pytest.raises(InvalidInputError, match="32 bytes"):
        b.add(b"short", bytes(KEY_BYTES), CH, 10)
    assert len(b) == 0
    keys = np.zeros((3, KEY_BYTES), np.uint8)
    ok = np.zeros(3, np.int64)
    with pytest.raises(InvalidInputError, match="parents"):
        ChunkListing(keys, np.zeros((3, 8), np.uint8), ok, ok, ok, ok.astype(float))
    with pytest.raises(InvalidInputError, match="stored_bytes"):
        ChunkListing(keys, keys, ok, ok, ok[:2], ok.astype(float))


def _learned(c: mc.Cache) -> tuple[set[tuple[bytes, bytes, int, int, int | None]], list[bytes]]:
    eng = c._engine
    st = eng.stores[0]
    entries = {(e.key, e.parent, e.num_tokens, e.raw_bytes, e.stored_size(st.idx))
               for e in eng.dir.entries.values()}
    return entries, [key for key, _ in st.lru.items()]


@pytest.mark.parametrize("n", [BATCH // 2, 10 * BATCH + 5])
async def test_a_compact_listing_learns_the_same_directory_as_a_list_of_chunk_metas(n):
    metas = _shuffled_metas(n)
    listing = ChunkListing.from_metas(metas)
    got = []
    for tier in (_Listing(listing), _Listing(listing, as_list=True)):
        cfg = mc.CacheConfig(TINY, "bench-scale", chunk_size=CH,
                             tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 64), tier))
        async with mc.Cache(cfg) as c:
            got.append(_learned(c))
    assert got[0] == got[1]
    entries, order = got[0]
    valid = [m for m in metas if m.raw_bytes == TINY.nbytes(m.num_tokens)
             and m.num_tokens <= CH]
    assert 0 < len(valid) < len(metas)
    assert entries == {(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes)
                       for m in valid}
    # The storage tier's recency order is the listing's, oldest first.
    assert order == [m.key for m in sorted(valid, key=lambda m: m.last_used)]


async def test_a_restart_from_disk_keeps_no_object_per_listed_chunk_on_the_loop(tmp_path: Path):
    """While a disk tier's files are listed and learned, no turn of the loop sees an object
    per listed chunk: the scan builds arrays in its worker threads, and learning makes a
    batch of rows at a time. Before, the scan returned a list of a ``ChunkMeta`` per file,
    alive (and walked by every young collection) through the sort and the whole learning."""
    n = 12 * BATCH
    fp = Fingerprint("listing", TINY, CH)
    chain = KeyChain(fp)
    tier = DiskTier(path=str(tmp_path / "cold"), capacity_bytes="64MiB")
    store = tier.build()
    await store.start(TierContext(fp))
    data = torch.zeros(TINY.shape(CH), dtype=TINY.dtype)
    parent = chain.seed
    for i in range(n):
        key = KeyChain.child(parent, np.full(CH, i, dtype="<i4").tobytes())
        meta = ChunkMeta(key, parent, CH, TINY.nbytes(CH))
        await store.write(meta, encode_chunk(fp, meta, data))
        parent = key if i % 8 else chain.seed
    await store.aclose()

    most = [0]
    turns = [0]
    running = True

    async def watch() -> None:
        # Sampled at every turn: the most ChunkMeta alive at once.
        while running:
            alive = sum(1 for o in gc.get_objects() if type(o) is ChunkMeta)
            most[0] = max(most[0], alive)
            turns[0] += 1
            await asyncio.sleep(0)

    cfg = mc.CacheConfig(TINY, "listing", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 64), tier))
    task = asyncio.create_task(watch())
    await asyncio.sleep(0)
    c = mc.Cache(cfg)
    try:
        await c.open()
    finally:
        running = False
        await task
    try:
        assert (await c.stats())["chunks"] == n
        assert turns[0] > n // BATCH  # the loop ran between the batches
        assert most[0] <= BATCH, most[0]
    finally:
        await c.aclose()


class _Counted(ChunkMeta):
    """A ``ChunkMeta`` that counts its own frees."""

    __slots__ = ()
    freed = 0

    def __del__(self) -> None:
        type(self).freed += 1


class _MadeInStart(_Listing):
    """A tier that makes its listing as a list of ``ChunkMeta`` in ``start``, as a tier
    written before ``ChunkListing`` does, and keeps no reference to it."""

    def __init__(self, listing: ChunkListing, on_start: object = None) -> None:
        super().__init__(listing)
        self.on_start = on_start

    async def start(self, ctx: TierContext) -> list[ChunkMeta]:  # type: ignore[override]
        out = [_Counted(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes,
                        m.last_used) for m in self.listing]
        if callable(self.on_start):
            self.on_start()
        return out


async def test_a_list_of_chunk_metas_is_freed_a_batch_per_loop_turn():
    """A tier's list of ``ChunkMeta`` is read a batch per loop turn and emptied as it is
    read, so its objects are freed a batch at a time. Before, the list was converted whole
    in a worker thread and dropped when ``open`` let go of it: every object freed in one
    step (about 60 ms for a million)."""
    n = 40 * BATCH
    tier = _MadeInStart(_listing(n, 8))
    freed_per_turn = [0]
    turns = [0]
    running = True

    async def watch() -> None:
        before = _Counted.freed
        while running:
            await asyncio.sleep(0)
            freed_per_turn[0] = max(freed_per_turn[0], _Counted.freed - before)
            before = _Counted.freed
            turns[0] += 1

    _Counted.freed = 0
    cfg = mc.CacheConfig(TINY, "bench-scale", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 64), tier))
    task = asyncio.create_task(watch())
    await asyncio.sleep(0)
    c = mc.Cache(cfg)
    try:
        await c.open()
    finally:
        running = False
        await task
    try:
        assert (await c.stats())["chunks"] == n
        assert _Counted.freed == n  # every one freed by the time open returns
        assert turns[0] > n // BATCH
        assert freed_per_turn[0] <= BATCH, freed_per_turn[0]
    finally:
        await c.aclose()


def test_a_listing_builder_never_grows_one_buffer_past_a_block(monkeypatch):
    """Rows are kept in blocks of at most ``_BLOCK_ROWS``, so appending a row never copies
    more than one block (a flat buffer of a million rows grows by copying all of it, with
    the GIL held: a loop stall whichever thread appends), and the built listing is the
    rows in order."""
    from musacache.tiers import listing as listing_mod

    monkeypatch.setattr(listing_mod, "_BLOCK_ROWS", 8)
    metas = list(_listing(8 * 5 + 3, 8))
    b = ListingBuilder()
    for m in metas:
        b.add(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes, m.last_used)
        assert len(b._tokens) < 8 and len(b._keys) < 8 * KEY_BYTES
    assert len(b) == len(metas)
    assert list(b.build()) == metas
    # Built, the rows left the builder (each block was let go of as it was copied).
    assert len(b) == 0 and not b._done and len(b.build()) == 0
    assert list(ListingBuilder().build()) == []


async def test_the_disk_and_s3_tiers_hand_their_listings_over(tmp_path: Path,
                                                             moto_endpoint: str):
    """Neither keeps the listing its ``start`` returns: it is the cache's to give back. A
    listing is not handed over unless its maker says so."""
    from musacache.tiers.s3 import S3Tier
    from s3_servers import unique_bucket

    fp = Fingerprint("listing", TINY, CH)
    for tier in (DiskTier(path=str(tmp_path / "cold"), capacity_bytes="64MiB"),
                 S3Tier(bucket=unique_bucket(), endpoint_url=moto_endpoint,
                        create_bucket=True)):
        store = tier.build()
        try:
            listing = await store.start(TierContext(fp))
            assert isinstance(listing, ChunkListing) and listing.given, tier
        finally:
            await store.aclose()
    assert not ChunkListing.empty().given and not ListingBuilder().build().given
