"""The cold tiers through the Cache API: demotion, restart, faults as counted misses, and two
nodes sharing one bucket."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache._keys import Fingerprint, KeyChain, as_tokens
from musacache.tiers.base import TierContext
from musacache.tiers.disk import DiskTier, file_name
from musacache.tiers.s3 import S3Tier
from s3_servers import FaultProxy, unique_bucket

CHUNK = 16


def _config(spec: mc.KVSpec, cold: Any, host_chunks: int = 2,
            promotion: Literal["background", "sync"] = "background") -> mc.CacheConfig:
    host = mc.HostTier(capacity_bytes=spec.nbytes(CHUNK) * host_chunks)
    return mc.CacheConfig(spec=spec, namespace="cold-engine", chunk_size=CHUNK,
                          tiers=(host, cold), promotion=promotion)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed))


def _chunk_keys(spec: mc.KVSpec, toks: torch.Tensor) -> list[tuple[int, int, bytes, bytes]]:
    """``(start, end, parent, key)`` per chunk, as a cache of ``_config`` computes them."""
    return KeyChain(Fingerprint("cold-engine", spec, CHUNK)).keys(as_tokens(toks))


async def _tier_stats(cache: mc.Cache, name: str) -> dict[str, Any]:
    stats: dict[str, Any] = (await cache.stats())["tiers"][name]
    return stats


# -- disk ----------------------------------------------------------------------------------------


async def test_disk_demotion_and_restart(tmp_path: Path) -> None:
    spec = small_spec()
    toks = _prompt(8 * CHUNK + 5)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True)
    async with mc.Cache(_config(spec, disk)) as cache:
        assert await cache.put(toks, kv) == len(toks)
        await cache.flush()
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)
        stats = await _tier_stats(cache, "disk")
        assert stats["store_writes"] == 9 and stats["write_drops"] == 0
    # A new cache on the same folder finds every chunk, and serves them all from disk.
    async with mc.Cache(_config(spec, disk)) as cache:
        assert await cache.lookup(toks) == len(toks)
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)
        assert (await _tier_stats(cache, "disk"))["hits"] >= 9


async def test_disk_corrupt_file_is_a_counted_miss(tmp_path: Path) -> None:
    spec = small_spec()
    toks = _prompt(6 * CHUNK, seed=1)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True)
    async with mc.Cache(_config(spec, disk)) as cache:
        await cache.put(toks, kv)
        await cache.flush()
        root = Path((await _tier_stats(cache, "disk"))["store_path"])
    # Damage the 4th chunk's file while no cache holds the folder.
    _, _, parent, key = _chunk_keys(spec, toks)[3]
    path = root / key[:1].hex() / file_name(key, parent, CHUNK)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a payload byte: only the checksum can tell
    path.write_bytes(raw)

    async with mc.Cache(_config(spec, disk)) as cache:
        hit = await cache.get(toks)
        assert hit.num_tokens == 3 * CHUNK  # the prefix before the damaged chunk, no further
        assert torch.equal(hit.kv, kv[:, :, : 3 * CHUNK])
        assert (await _tier_stats(cache, "disk"))["corrupt"] == 1
        # Recovery: the chunk is put again and the whole prompt is served.
        await cache.put(toks, kv)
        await cache.flush()
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)


@pytest.mark.parametrize("promotion", ["sync", "background"])
@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("damage", ["payload byte", "truncated"])
async def test_disk_read_into_the_top_slot_turns_damage_into_a_counted_miss(
        tmp_path: Path, codec: str, damage: str,
        promotion: Literal["background", "sync"]) -> None:
    # Promotions read a chunk file straight into a reserved top-tier slot (a raw payload
    # lands there before its checksum is known), and by default a get reads it straight into
    # its own tensor first: a damaged file must still be a counted miss, the slot must go
    # back to the pool, and no damaged byte may reach the caller.
    spec = small_spec()
    toks = _prompt(6 * CHUNK, seed=5)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", codec=codec,
                    write_through=True)
    config = _config(spec, disk, host_chunks=8, promotion=promotion)
    async with mc.Cache(config) as cache:
        await cache.put(toks, kv)
    async with mc.Cache(config) as cache:  # restarted: every chunk only on disk
        root = Path((await _tier_stats(cache, "disk"))["store_path"])
        path = _disk_path(root, spec, toks, 3)
        raw = bytearray(path.read_bytes())
        if damage == "payload byte":
            raw[-3] ^= 0x40
        else:
            raw = raw[: len(raw) - 100]
        path.write_bytes(raw)
        assert (await _tier_stats(cache, "host"))["bytes_used"] == 0
        out = torch.zeros_like(kv)
        hit = await cache.get(toks, out=out)
        assert hit.num_tokens == 3 * CHUNK
        assert torch.equal(hit.kv, kv[:, :, : 3 * CHUNK])
        await cache.flush()  # background promotions done
        assert (await _tier_stats(cache, "disk"))["corrupt"] == 1
        # The chunks are fetched concurrently: all but the damaged one were promoted, and
        # the damaged one's slot went back to the pool.
        host = await _tier_stats(cache, "host")
        assert host["chunks"] == 5 and host["bytes_used"] == 5 * host["slot_bytes"]
        hit = await cache.get(toks)
        assert hit.num_tokens == 3 * CHUNK and torch.equal(hit.kv, kv[:, :, : 3 * CHUNK])


async def test_disk_timed_out_read_keeps_its_slot_until_its_thread_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A read that times out is abandoned to its thread, which may still write into the top
    # slot it reads into. That slot must not go back to the pool (and to another chunk)
    # until the thread returns.
    from musacache.tiers.disk import DiskStore

    spec = small_spec()
    hung_toks, b, c = (_prompt(CHUNK, seed=s) for s in (6, 7, 8))
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", codec="raw",
                    timeout=0.2, write_through=True)
    config = _config(spec, disk, host_chunks=3, promotion="sync")
    async with mc.Cache(config) as cache:
        for toks in (hung_toks, b, c):
            await cache.put(toks, prefix_kv(spec, toks))
        root = Path((await _tier_stats(cache, "disk"))["store_path"])
    stuck = str(_disk_path(root, spec, hung_toks, 0))
    release = threading.Event()
    returned = threading.Event()
    read_into = DiskStore._read_regular_into

    def hung(path: Path, fp: Any, meta: Any, out: torch.Tensor, *rest: Any) -> object:
        if str(path) == stuck:
            release.wait(30)  # a stuck network file system
            out.view(torch.uint8).fill_(0xEE)  # the late write the slot must be kept for
            returned.set()
        return read_into(path, fp, meta, out, *rest)

    async def slots_used() -> int:
        host = await _tier_stats(cache, "host")
        return int(host["bytes_used"] // host["slot_bytes"])

    async with mc.Cache(config) as cache:  # restarted: every chunk only on disk
        monkeypatch.setattr(DiskStore, "_read_regular_into", staticmethod(hung))
        try:
            assert (await cache.get(hung_toks)).num_tokens == 0
            assert await slots_used() == 1  # parked, not released
            # Another chunk read meanwhile takes a slot of its own, not the parked one.
            assert (await cache.get(b)).num_tokens == CHUNK
            assert await slots_used() == 2
        finally:
            release.set()
        with anyio.fail_after(30):
            while not returned.is_set() or await _stuck_reads(cache):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        # The thread has returned: the next read from disk gives its slot back.
        hit = await cache.get(c)
        assert hit.num_tokens == CHUNK and torch.equal(hit.kv, prefix_kv(spec, c))
        assert await slots_used() == 2
        hit = await cache.get(b)  # untouched by the late write
        assert hit.tiers == {"host": CHUNK} and torch.equal(hit.kv, prefix_kv(spec, b))


async def _stuck_reads(cache: mc.Cache) -> int:
    return int((await _tier_stats(cache, "disk"))["store_stuck_reads"])


def _disk_path(root: Path, spec: mc.KVSpec, toks: torch.Tensor, i: int) -> Path:
    _, end, parent, key = _chunk_keys(spec, toks)[i]
    n = end - _chunk_keys(spec, toks)[i][0]
    return root / key[:1].hex() / file_name(key, parent, n)


async def test_disk_fifo_under_a_chunk_name_is_a_counted_miss(tmp_path: Path) -> None:
    # Issue 10 item 11: a chunk file replaced by a FIFO; 20 gets left 19 threads blocked.
    spec = small_spec()
    toks = _prompt(6 * CHUNK, seed=5)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True,
                    timeout=1.0, max_concurrency=2)
    async with mc.Cache(_config(spec, disk, host_chunks=1)) as cache:
        await cache.put(toks, kv)
        await cache.flush()
        root = Path((await _tier_stats(cache, "disk"))["store_path"])
        fifo = _disk_path(root, spec, toks, 2)
        fifo.unlink()
        os.mkfifo(fifo)
        baseline = threading.active_count()
        try:
            with anyio.fail_after(60):  # a hang detector, not a speed test
                hits = [await cache.get(toks) for _ in range(20)]
        finally:
            if fifo.is_fifo():  # unblock readers stuck in open() (before the fix)
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
        for hit in hits:
            assert hit.num_tokens == 2 * CHUNK  # the prefix before the FIFO, no further
            assert torch.equal(hit.kv, kv[:, :, : 2 * CHUNK])
        stats = await _tier_stats(cache, "disk")
        assert stats["misses"] >= 1 and stats["store_removed_not_files"] == 1
        assert threading.active_count() <= baseline + disk.max_concurrency
        # Put again: the whole prompt is served once more.
        await cache.put(toks, kv)
        await cache.flush()
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)


async def test_disk_foreign_format_object_is_a_counted_miss(tmp_path: Path) -> None:
    # Issue 10 item 16: an intact object of another format version made get() raise
    # FingerprintMismatchError; every unreadable cold chunk is a counted miss.
    import struct
    import zlib

    from musacache.codec import HEADER_SIZE

    spec = small_spec()
    toks = _prompt(6 * CHUNK, seed=6)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True)
    async with mc.Cache(_config(spec, disk, host_chunks=1)) as cache:
        await cache.put(toks, kv)
        await cache.flush()
        path = _disk_path(Path((await _tier_stats(cache, "disk"))["store_path"]), spec, toks, 3)
        raw = bytearray(path.read_bytes())
        struct.pack_into("<H", raw, 4, 99)  # format v99, with an intact header checksum
        struct.pack_into("<I", raw, 8, zlib.crc32(raw[12:HEADER_SIZE], zlib.crc32(raw[:8])))
        path.write_bytes(raw)
        hit = await cache.get(toks)
        assert hit.num_tokens == 3 * CHUNK and torch.equal(hit.kv, kv[:, :, : 3 * CHUNK])
        stats = await _tier_stats(cache, "disk")
        # Intact but not ours: counted as foreign, and left in place (another writer's object).
        assert (stats["foreign"], stats["corrupt"]) == (1, 0)
        assert path.exists()


async def test_tenants_on_one_disk_folder_keep_their_chunks(tmp_path: Path) -> None:
    # Issue 10 item 3: tenant B's clear() deleted tenant A's chunks on a shared folder.
    spec = small_spec()
    toks = _prompt(4 * CHUNK, seed=7)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True)

    def config(tenant: str) -> mc.CacheConfig:
        host = mc.HostTier(capacity_bytes=spec.nbytes(CHUNK))
        return mc.CacheConfig(spec=spec, namespace="cold-engine", chunk_size=CHUNK,
                              tiers=(host, disk), tenant=tenant)

    async with mc.Cache(config("a")) as cache_a:
        await cache_a.put(toks, kv)
        await cache_a.flush()
    async with mc.Cache(config("b")) as cache_b:
        assert (await cache_b.stats())["chunks"] == 0  # A's chunks are not even listed
        await cache_b.clear()
    async with mc.Cache(config("a")) as cache_a:
        hit = await cache_a.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)


# -- S3 (moto behind a fault proxy) --------------------------------------------------------------


async def _seed_bucket(endpoint: str, bucket: str, spec: mc.KVSpec, toks: torch.Tensor,
                       kv: torch.Tensor) -> None:
    s3 = S3Tier(bucket=bucket, endpoint_url=endpoint, create_bucket=True, write_through=True)
    async with mc.Cache(_config(spec, s3)) as cache:
        assert await cache.put(toks, kv) == len(toks)
        await cache.flush()
        assert (await _tier_stats(cache, "s3"))["store_writes"] == -(-len(toks) // CHUNK)


async def test_s3_restart_and_prefetch(moto_endpoint: str) -> None:
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(4 * CHUNK + 3, seed=2)
    kv = prefix_kv(spec, toks)
    await _seed_bucket(moto_endpoint, bucket, spec, toks, kv)
    s3 = S3Tier(bucket=bucket, endpoint_url=moto_endpoint)
    async with mc.Cache(_config(spec, s3, host_chunks=8)) as cache:
        assert await cache.lookup(toks) == len(toks)
        # Promote the whole prefix into host memory, then serve it from there.
        assert await cache.prefetch(toks, timeout=10.0) == len(toks)
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)
        assert hit.tiers == {"host": len(toks)}


async def test_s3_faults_are_counted_misses(moto_endpoint: str,
                                            fault_proxy: FaultProxy) -> None:
    # Every fault is injected, never raced: a healthy read gets a timeout far beyond any
    # machine's speed, and the timeout fault holds requests until released, so a short
    # timeout is certain to expire (it raced a 0.5 s timeout against real reads before, and
    # failed under load).
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(5 * CHUNK, seed=3)
    kv = prefix_kv(spec, toks)
    await _seed_bucket(moto_endpoint, bucket, spec, toks, kv)
    healthy = 60.0
    store = S3Tier(bucket=bucket, endpoint_url=fault_proxy.endpoint_url, timeout=healthy,
                   connect_timeout=healthy, read_timeout=healthy, retries=1,
                   retry_backoff=0.01).build()
    # A host tier of one chunk: nearly every get must go to S3.
    host = mc.HostTier(capacity_bytes=spec.nbytes(CHUNK))
    config = mc.CacheConfig(spec=spec, namespace="cold-engine", chunk_size=CHUNK,
                            tiers=(host, store))
    async with mc.Cache(config) as cache:
        assert await cache.lookup(toks) == len(toks)

        async def get_checked() -> int:
            with anyio.fail_after(healthy):  # a fault is a miss, never a hang
                hit = await cache.get(toks)
            assert torch.equal(hit.kv, kv[:, :, : hit.num_tokens])  # never wrong data
            return hit.num_tokens

        async def counted() -> int:
            stats = await _tier_stats(cache, "s3")
            return int(stats["faults"]) + int(stats["timeouts"])

        fault_proxy.stop()  # server down: connections refused
        assert await get_checked() < len(toks)
        down = await counted()
        assert down >= 1
        fault_proxy.start()
        assert await get_checked() == len(toks)

        fault_proxy.throttle = 1000  # throttled: 503 SlowDown
        assert await get_checked() < len(toks)
        throttled = await counted()
        assert throttled > down
        fault_proxy.throttle = 0
        assert await get_checked() == len(toks)

        fault_proxy.hang()  # no answer at all: only the timeout ends a read
        store.timeout = 0.2
        try:
            assert await get_checked() < len(toks)
        finally:
            store.timeout = healthy
            fault_proxy.release()
        assert await counted() > throttled
        assert await get_checked() == len(toks)

        assert (await cache.stats())["state"] == "open"


async def test_s3_corrupt_object_is_a_counted_miss(moto_endpoint: str) -> None:
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(4 * CHUNK, seed=4)
    kv = prefix_kv(spec, toks)
    await _seed_bucket(moto_endpoint, bucket, spec, toks, kv)
    s3 = S3Tier(bucket=bucket, endpoint_url=moto_endpoint)
    # Flip one byte of the 3rd chunk's object, through a store of our own.
    _, _, parent, key = _chunk_keys(spec, toks)[2]
    store = s3.build()
    await store.start(TierContext(Fingerprint("cold-engine", spec, CHUNK)))
    try:
        meta = mc.ChunkMeta(key, parent, CHUNK, spec.nbytes(CHUNK))
        raw = bytearray(await store.read(meta) or b"")
        assert raw
        raw[len(raw) // 2] ^= 0x01
        await store.client.put_object(Bucket=bucket, Key=store.object_name(key, parent, CHUNK),
                                      Body=bytes(raw))
    finally:
        await store.aclose()
    async with mc.Cache(_config(spec, s3, host_chunks=1)) as cache:
        hit = await cache.get(toks)
        assert hit.num_tokens == 2 * CHUNK and torch.equal(hit.kv, kv[:, :, : 2 * CHUNK])
        assert (await _tier_stats(cache, "s3"))["corrupt"] == 1


# -- two nodes on Swift --------------------------------------------------------------------------

_NODE = textwrap.dedent("""
    import json, sys
    import anyio, torch
    import musacache as mc
    from musacache.tiers.s3 import S3Tier

    role, endpoint, key, secret, bucket = sys.argv[1:6]
    spec = mc.KVSpec(4, 2, 64, torch.bfloat16)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 32000, (4096,), generator=gen)
    kv = torch.randn(spec.shape(4096), generator=gen).to(torch.bfloat16)
    s3 = S3Tier(bucket=bucket, endpoint_url=endpoint, access_key_id=key,
                secret_access_key=secret, create_bucket=True, write_through=True)
    host = mc.HostTier(capacity_bytes=spec.nbytes(256) * 2)  # two chunks: S3 holds the rest
    config = mc.CacheConfig(spec=spec, namespace="two-nodes", chunk_size=256, tiers=(host, s3))

    async def main():
        async with mc.Cache(config) as cache:
            if role == "writer":
                stored = await cache.put(tokens, kv)
                await cache.flush()
                s = (await cache.stats())["tiers"]["s3"]
                print(json.dumps({"stored": stored, "writes": s["store_writes"],
                                  "drops": s["write_drops"]}))
            else:
                found = await cache.lookup(tokens)
                hit = await cache.get(tokens)
                same = bool(torch.equal(hit.kv.view(torch.int16),
                                        kv[:, :, :hit.num_tokens].view(torch.int16)))
                print(json.dumps({"lookup": found, "served": hit.num_tokens, "equal": same,
                                  "tiers": hit.tiers}))

    anyio.run(main)
""")


def _node(role: str, swift: Any, bucket: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _NODE, role, swift.endpoint_url,
                           swift.access_key, swift.secret_key, bucket],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{role} failed:\n{proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.swift
def test_two_nodes_share_one_bucket(swift_server: Any) -> None:
    bucket = unique_bucket()
    wrote = _node("writer", swift_server, bucket)
    assert wrote == {"stored": 4096, "writes": 16, "drops": 0}
    # Node B starts after A has exited: everything it serves came through Swift.
    read = _node("reader", swift_server, bucket)
    assert read["lookup"] == 4096 and read["served"] == 4096 and read["equal"] is True


@pytest.mark.parametrize("failures", [1, 99])
async def test_a_delete_the_store_refuses_is_retried_or_never_learned_again(
        moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, failures: int) -> None:
    """Found by a probe: a delete that S3 answered with a 500 was counted and forgotten; the
    next miss listed the bucket, learned the chunk again and served it, and a put of new KV
    for the prompt did nothing (the chunk was "cached"). Now a failed delete is tried again,
    and one that keeps failing leaves a tombstone until a new object is written."""
    from botocore.exceptions import ClientError

    from musacache.engine import storage as _coldpath

    monkeypatch.setattr(_coldpath, "_DELETE_RETRY_PAUSES", (0.01, 0.01))
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(CHUNK, seed=11)
    old, new = prefix_kv(spec, toks), prefix_kv(spec, toks) + 1
    await _seed_bucket(moto_endpoint, bucket, spec, toks, old)
    store = S3Tier(bucket=bucket, endpoint_url=moto_endpoint).build()
    # (every miss lists the bucket again: the listing that would learn the chunk back)
    cfg = dataclasses.replace(_config(spec, store, host_chunks=1), refresh_interval=0)
    async with mc.Cache(cfg) as cache:
        assert await cache.lookup(toks) == CHUNK
        left = [failures]
        real = store.client.delete_object

        async def flaky(**kw: Any) -> Any:
            if left[0]:
                left[0] -= 1
                raise ClientError({"Error": {"Code": "InternalError", "Message": "down"},
                                   "ResponseMetadata": {"HTTPStatusCode": 500}},
                                  "DeleteObject")
            return await real(**kw)

        monkeypatch.setattr(store.client, "delete_object", flaky)
        await cache.delete(toks)
        await cache.flush()
        stats = await _tier_stats(cache, "s3")
        assert stats["faults"] == min(failures, 3)
        assert await cache.lookup(toks) == 0  # a miss lists the bucket: not learned again
        left[0] = 0
        assert await cache.put(toks, new) == CHUNK
        hit = await cache.get(toks)
        assert hit.num_tokens == CHUNK and torch.equal(hit.kv, new)


@pytest.mark.parametrize("damaged", ["on its way", "in the bucket"])
async def test_a_corrupt_read_deletes_a_shared_object_only_if_it_is_damaged_there(
        moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, damaged: str) -> None:
    """Found by a probe: one pass of bodies damaged in transit (a proxy's error page with a
    200) deleted every chunk it touched from the bucket, every node's. A shared tier's object
    is now read again first, and deleted only if it is still unreadable."""
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(CHUNK, seed=12)
    kv = prefix_kv(spec, toks)
    await _seed_bucket(moto_endpoint, bucket, spec, toks, kv)
    store = S3Tier(bucket=bucket, endpoint_url=moto_endpoint).build()
    cfg = dataclasses.replace(_config(spec, store, host_chunks=1), refresh_interval=0)
    async with mc.Cache(cfg) as cache:
        [name] = [o["Key"] for o in (await store.client.list_objects_v2(
            Bucket=bucket))["Contents"]]
        if damaged == "in the bucket":
            await store.client.put_object(Bucket=bucket, Key=name, Body=b"\0" * 600)
        else:
            real, bad = store.read, [1]

            async def damaging(meta: Any) -> Any:
                obj = await real(meta)
                if bad[0]:
                    bad[0] = 0
                    return obj[:-8] + b"\xff" * 8  # its last block's checksum fails
                return obj

            monkeypatch.setattr(store, "read", damaging)
        assert (await cache.get(toks)).num_tokens == 0  # a counted miss either way
        await cache.flush()
        assert (await _tier_stats(cache, "s3"))["corrupt"] == 1
        left = (await store.client.list_objects_v2(Bucket=bucket)).get("Contents", [])
        if damaged == "in the bucket":
            assert left == []
        else:
            assert [o["Key"] for o in left] == [name]
            hit = await cache.get(toks)  # learned again from the listing, and served
            assert hit.num_tokens == CHUNK and torch.equal(hit.kv, kv)
