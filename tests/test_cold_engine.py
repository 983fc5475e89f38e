"""The cold tiers through the Cache API: demotion, restart, faults as counted misses, and two
nodes sharing one bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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
MARGIN = 1.5  # seconds of slack on a loaded 2-core machine


def _config(spec: mc.KVSpec, cold: Any, host_chunks: int = 2) -> mc.CacheConfig:
    host = mc.HostTier(capacity_bytes=spec.nbytes(CHUNK) * host_chunks)
    return mc.CacheConfig(spec=spec, namespace="cold-engine", chunk_size=CHUNK,
                          tiers=(host, cold))


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(seed))


def _chunk_keys(spec: mc.KVSpec, toks: torch.Tensor) -> list[tuple[int, int, bytes, bytes]]:
    """``(start, end, parent, key)`` per chunk, as a cache of ``_config`` computes them."""
    return KeyChain(Fingerprint("cold-engine", spec, CHUNK)).keys(as_tokens(toks))


def _tier_stats(cache: mc.Cache, name: str) -> dict[str, Any]:
    stats: dict[str, Any] = cache.stats()["tiers"][name]
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
        stats = _tier_stats(cache, "disk")
        assert stats["store_writes"] == 9 and stats["write_drops"] == 0
    # A new cache on the same folder finds every chunk, and serves them all from disk.
    async with mc.Cache(_config(spec, disk)) as cache:
        assert await cache.lookup(toks) == len(toks)
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)
        assert _tier_stats(cache, "disk")["hits"] >= 9


async def test_disk_corrupt_file_is_a_counted_miss(tmp_path: Path) -> None:
    spec = small_spec()
    toks = _prompt(6 * CHUNK, seed=1)
    kv = prefix_kv(spec, toks)
    disk = DiskTier(path=str(tmp_path / "disk"), capacity_bytes="64MiB", write_through=True)
    async with mc.Cache(_config(spec, disk)) as cache:
        await cache.put(toks, kv)
        await cache.flush()
        root = Path(_tier_stats(cache, "disk")["store_path"])
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
        assert _tier_stats(cache, "disk")["corrupt"] == 1
        # Recovery: the chunk is put again and the whole prompt is served.
        await cache.put(toks, kv)
        await cache.flush()
        hit = await cache.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)


# -- S3 (moto behind a fault proxy) --------------------------------------------------------------


async def _seed_bucket(endpoint: str, bucket: str, spec: mc.KVSpec, toks: torch.Tensor,
                       kv: torch.Tensor) -> None:
    s3 = S3Tier(bucket=bucket, endpoint_url=endpoint, create_bucket=True, write_through=True)
    async with mc.Cache(_config(spec, s3)) as cache:
        assert await cache.put(toks, kv) == len(toks)
        await cache.flush()
        assert _tier_stats(cache, "s3")["store_writes"] == -(-len(toks) // CHUNK)


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
    spec = small_spec()
    bucket = unique_bucket()
    toks = _prompt(5 * CHUNK, seed=3)
    kv = prefix_kv(spec, toks)
    await _seed_bucket(moto_endpoint, bucket, spec, toks, kv)
    s3 = S3Tier(bucket=bucket, endpoint_url=fault_proxy.endpoint_url, timeout=0.5,
                connect_timeout=0.5, retries=1, retry_backoff=0.01)
    # A host tier of one chunk: nearly every get must go to S3.
    async with mc.Cache(_config(spec, s3, host_chunks=1)) as cache:
        assert await cache.lookup(toks) == len(toks)

        async def get_checked() -> tuple[int, float]:
            start = time.monotonic()
            hit = await cache.get(toks)
            elapsed = time.monotonic() - start
            assert torch.equal(hit.kv, kv[:, :, : hit.num_tokens])  # never wrong data
            return hit.num_tokens, elapsed

        def faults() -> int:
            return int(_tier_stats(cache, "s3")["faults"])

        fault_proxy.stop()  # server down
        served, elapsed = await get_checked()
        assert served < len(toks) and elapsed < 0.5 + MARGIN
        down_faults = faults()
        assert down_faults >= 1
        fault_proxy.start()
        assert (await get_checked())[0] == len(toks)

        fault_proxy.throttle = 1000  # throttled
        served, elapsed = await get_checked()
        assert served < len(toks) and elapsed < 0.5 + MARGIN
        assert faults() > down_faults
        fault_proxy.throttle = 0
        assert (await get_checked())[0] == len(toks)

        fault_proxy.delay = 3.0  # every call slower than the timeout
        before = int(_tier_stats(cache, "s3")["timeouts"]) + faults()
        served, elapsed = await get_checked()
        assert served < len(toks) and elapsed < 0.5 + MARGIN
        assert int(_tier_stats(cache, "s3")["timeouts"]) + faults() > before
        fault_proxy.delay = 0.0
        assert (await get_checked())[0] == len(toks)

        assert cache.stats()["state"] == "open"


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
        assert _tier_stats(cache, "s3")["corrupt"] == 1


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
                s = cache.stats()["tiers"]["s3"]
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
