"""The engine over a storage tier: demotion, write-behind, write-through, restart, faults as
counted misses, and the fail-fast fingerprint check. Uses the in-memory MemStore."""

import asyncio
import time

import anyio
import pytest
import torch

import musacache as mc
from fake_store import MemStore
from helpers import prefix_kv
from musacache import codec

CH = 16


def seq(a, n):
    return list(range(a, a + n))


def cfg(spec, *tiers, namespace="store", **kw):
    return mc.CacheConfig(spec, namespace, tiers=tiers, chunk_size=CH, **kw)


async def test_host_evictions_are_demoted_to_storage_and_promoted_back(spec):
    store = MemStore()
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 2), store)) as c:
        a = seq(0, 80)
        assert await c.put(a, prefix_kv(spec, a)) == 80
        await c.flush()
        # The head stays in host (leaves first keeps a prefix whole), the rest goes below.
        assert store.writes == 3
        b = seq(5000, 32)
        assert await c.put(b, prefix_kv(spec, b)) == 32  # pushes a's head down
        await c.flush()
        st = (await c.stats())["tiers"]
        assert st["host"]["bytes_used"] <= spec.nbytes(CH) * 2
        assert st["mem"]["demotions"] == 2 and st["mem"]["chunks"] == 5
        assert await c.lookup(a) == 80
        hit = await c.get(a)
        assert hit.num_tokens == 80 and torch.equal(hit.kv, prefix_kv(spec, a))
        assert (await c.stats())["tiers"]["host"]["promotions"] >= 1
        assert (await c.stats())["tiers"]["mem"]["hits"] >= 1


async def test_write_through_and_restart_find_old_chunks(spec):
    objects: dict[bytes, bytes] = {}
    a = seq(0, 50)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8),
                            MemStore(objects, write_through=True))) as c:
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
    assert len(objects) == 4  # 3 full chunks and the tail
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), MemStore(objects))) as c2:
        assert await c2.lookup(a) == 50
        assert await c2.lookup(a + [7, 7]) == 50  # the tail is found by its parent
        hit = await c2.get(a)
        assert torch.equal(hit.kv, prefix_kv(spec, a))


async def test_other_namespace_or_tenant_never_hits_a_shared_store(spec):
    objects: dict[bytes, bytes] = {}
    a = seq(0, 40)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8),
                            MemStore(objects, write_through=True))) as c:
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
    for kw in (dict(namespace="another-model"), dict(tenant="tenant-b")):
        async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), MemStore(objects),
                                **kw)) as other:
            assert await other.lookup(a) == 0
            assert (await other.get(a)).num_tokens == 0


async def test_read_faults_are_counted_misses(spec):
    store = MemStore(timeout=0.2)
    async with mc.Cache(cfg(spec, store)) as c:
        a = seq(0, 48)
        assert await c.put(a, prefix_kv(spec, a)) == 48
        await c.flush()
        store.fail_reads = True
        hit = await c.get(a)
        assert hit.num_tokens == 0
        st = (await c.stats())["tiers"]["mem"]
        assert st["faults"] >= 1 and st["misses"] >= 1
        store.fail_reads = False
        hit = await c.get(a)  # recovery: correct data again
        assert hit.num_tokens == 48 and torch.equal(hit.kv, prefix_kv(spec, a))


async def test_slow_reads_never_hang_past_the_timeout(spec):
    store = MemStore(timeout=0.1)
    async with mc.Cache(cfg(spec, store)) as c:
        a = seq(0, 32)
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
        store.read_delay = 30
        t0 = time.monotonic()
        hit = await c.get(a)
        assert time.monotonic() - t0 < 2
        assert hit.num_tokens == 0 and (await c.stats())["tiers"]["mem"]["timeouts"] >= 1


async def test_corrupt_objects_are_misses_and_deleted(spec):
    store = MemStore()
    async with mc.Cache(cfg(spec, store)) as c:
        a = seq(0, 32)
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
        # the prompt's first chunk: the one whose parent is no chunk of it
        (first,) = [k for k in store.objects
                    if codec.read_header(store.objects[k]).parent not in store.objects]
        buf = bytearray(store.objects[first])
        buf[-10] ^= 0xFF
        store.objects[first] = bytes(buf)
        hit = await c.get(a)
        assert hit.num_tokens == 0
        await c.flush()
        assert (await c.stats())["tiers"]["mem"]["corrupt"] == 1
        assert first not in store.objects  # quarantined by deletion


async def test_foreign_chunk_is_a_counted_miss_naming_both_sides(spec, caplog):
    """Another model's object under our key (or another format version) is unreadable here:
    a miss counted as ``foreign``, with a warning naming both sides, never an exception."""
    objects: dict[bytes, bytes] = {}
    a = seq(0, 16)
    async with mc.Cache(cfg(spec, MemStore(objects))) as c:
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
        (key, obj), = objects.items()
        # An object stored under this cache's key but written for another model.
        from musacache._keys import Fingerprint
        other = Fingerprint("other-model", spec, CH)
        meta = codec.read_header(obj).meta()
        objects[key] = codec.encode_chunk(other, meta, prefix_kv(spec, a))
        with caplog.at_level("WARNING", logger="musacache"):
            hit = await c.get(a)
        assert hit.num_tokens == 0
        st = (await c.stats())["tiers"]["mem"]
        assert st["foreign"] == 1 and st["misses"] == 1 and st["corrupt"] == 0
        warned = " ".join(r.getMessage() for r in caplog.records)
        assert "other-model" in warned and "'store'" in warned
        assert key in objects  # not ours to delete
        assert await c.lookup(a) == 0  # forgotten: not read again on every lookup


async def test_write_faults_are_dropped_and_counted_never_block_put(spec):
    store = MemStore(write_through=True, name="wt")
    store.fail_writes = True
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), store)) as c:
        a = seq(0, 64)
        with anyio.fail_after(5):
            assert await c.put(a, prefix_kv(spec, a)) == 64
        await c.flush()
        assert (await c.stats())["tiers"]["wt"]["write_drops"] == 4
        assert await c.lookup(a) == 64  # still served from host


async def test_backpressure_bounds_queued_bytes(spec):
    store = MemStore(codec="raw")
    store.write_delay = 0.02
    obj_size = spec.nbytes(CH) + 4096
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH)), store,
                            write_queue_bytes=2 * obj_size)) as c:
        peak = 0
        done = anyio.Event()

        async def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, (await c.stats())["tiers"]["mem"]["pending_bytes"])
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            a = seq(0, 16 * 12)
            assert await c.put(a, prefix_kv(spec, a)) == 16 * 12
            await c.flush()
            done.set()
        assert 0 < peak <= 2 * obj_size
        assert torch.equal((await c.get(a)).kv, prefix_kv(spec, a))


async def test_bounded_storage_tier_evicts_leaves_first_and_never_exceeds(spec):
    one: dict[bytes, bytes] = {}  # the size of one raw chunk object, as the tier is given it
    async with mc.Cache(cfg(spec, mc.HostTier("1MiB"), MemStore(one, write_through=True,
                                                                codec="raw"))) as c:
        await c.put(seq(0, CH), prefix_kv(spec, seq(0, CH)))
    (objsize,) = map(len, one.values())
    store = MemStore(capacity_bytes=objsize * 3, codec="raw")
    async with mc.Cache(cfg(spec, store)) as c:
        a = seq(0, 48)
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
        b = seq(1000, 16)
        await c.put(b, prefix_kv(spec, b))
        await c.flush()
        st = (await c.stats())["tiers"]["mem"]
        assert st["bytes_used"] <= objsize * 3 and st["evictions"] == 1
        assert await c.lookup(a) == 32 and await c.lookup(b) == 16


async def test_refresh_on_miss_finds_chunks_written_by_another_node(spec):
    objects: dict[bytes, bytes] = {}
    a = seq(0, 64)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8),
                            MemStore(objects, shared=True), refresh_interval=0)) as reader:
        assert await reader.lookup(a) == 0
        async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8),
                                MemStore(objects, write_through=True))) as writer:
            await writer.put(a, prefix_kv(spec, a))
            await writer.flush()
        assert await reader.lookup(a) == 64
        assert torch.equal((await reader.get(a)).kv, prefix_kv(spec, a))


async def test_close_persists_memory_only_chunks_parents_first(spec):
    objects: dict[bytes, bytes] = {}
    a = seq(0, 70)
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), MemStore(objects))) as c:
        await c.put(a, prefix_kv(spec, a))
        assert objects == {}  # nothing was evicted, nothing written yet
    assert len(objects) == 5
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), MemStore(objects))) as c2:
        assert await c2.lookup(a) == 70
        assert torch.equal((await c2.get(a)).kv, prefix_kv(spec, a))
    # Opting out leaves the store as it was.
    fresh: dict[bytes, bytes] = {}
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), MemStore(fresh),
                            persist_on_close=False)) as c3:
        await c3.put(a, prefix_kv(spec, a))
    assert fresh == {}


async def test_a_prompt_far_larger_than_memory_is_staged_a_batch_at_a_time(spec, monkeypatch):
    from musacache.engine import core as _core

    # A staging area of three chunks: the 11 chunks go through it in several rounds.
    monkeypatch.setattr(_core, "_STAGE_BYTES", spec.nbytes(CH) * 3)
    store = MemStore()
    async with mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 2), store)) as c:
        a = seq(0, 16 * 10 + 5)
        assert await c.put(a, prefix_kv(spec, a)) == len(a)
        await c.flush()
        assert store.writes == 9
        hit = await c.get(a)
        assert hit.num_tokens == len(a) and torch.equal(hit.kv, prefix_kv(spec, a))


async def test_foreign_format_version_is_a_counted_miss_not_deleted(spec):
    """An intact object of another format version (a newer node on the same bucket) is
    unreadable here: a foreign miss, left in place, never an exception out of get."""
    import struct

    objects: dict[bytes, bytes] = {}
    a = seq(0, 16)
    async with mc.Cache(cfg(spec, MemStore(objects))) as c:
        await c.put(a, prefix_kv(spec, a))
        await c.flush()
        (key, obj), = objects.items()
        head = bytearray(obj)
        struct.pack_into("<H", head, 4, codec.FORMAT_VERSION + 1)
        struct.pack_into("<I", head, 8, codec._header_crc(head))
        objects[key] = bytes(head)
        hit = await c.get(a)
        assert hit.num_tokens == 0
        st = (await c.stats())["tiers"]["mem"]
        assert st["foreign"] == 1 and st["corrupt"] == 0
        await c.flush()
        assert objects[key] == bytes(head)


class _SlowClose(MemStore):
    """A tier whose ``aclose`` takes a while (a flush to a remote store)."""

    def __init__(self) -> None:
        super().__init__()
        self.closes = 0

    async def aclose(self) -> None:
        self.closes += 1
        await anyio.sleep(0.3)
        self.closed = True


async def _open_with(spec, store):
    c = mc.Cache(cfg(spec, mc.HostTier(spec.nbytes(CH) * 8), store, persist_on_close=False))
    await c.__aenter__()
    a = seq(0, 32)
    await c.put(a, prefix_kv(spec, a))
    await c.flush()
    assert (await c.stats())["tiers"]["host"]["bytes_allocated"] > 0
    return c


async def _closed_and_released(c: mc.Cache) -> bool:
    st = await c.stats()
    return bool(st["state"] == "closed" and st["tiers"]["host"]["bytes_allocated"] == 0)


async def test_aclose_cancelled_while_a_tier_closes_still_closes_and_releases(spec):
    """A plain task.cancel() of aclose (asyncio.wait_for) while a storage tier's aclose
    runs: the tier still closes, and the memory is still released (before, the cancel left
    both undone and the cache "closing" for good)."""
    store = _SlowClose()
    c = await _open_with(spec, store)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(c.aclose(), 0.05)
    assert store.closed and store.closes == 1
    assert await _closed_and_released(c)
    await c.aclose()
    assert store.closes == 1


async def test_a_close_cut_short_by_cancelling_every_task_closes_each_tier_once(spec):
    """A shutdown that cancels every task while a tier's aclose runs: the release is run
    again to its end, and the tier's aclose is not called a second time."""
    store = _SlowClose()
    c = await _open_with(spec, store)
    closer = asyncio.ensure_future(c.aclose())
    await asyncio.sleep(0.05)
    assert store.closes == 1
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            t.cancel()
    await asyncio.gather(closer, return_exceptions=True)
    assert closer.cancelled()
    assert store.closes == 1 and not store.closed  # its own aclose was the one cut short
    assert await _closed_and_released(c)
