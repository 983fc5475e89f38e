"""The disk tier across faults and restarts (found by a probe): a file whose read hung, a
start-up scan that cannot open a file for a moment, a restart with a smaller capacity."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

import pytest
import torch

import musacache as mc
from musacache.tiers.disk import DiskTier

CH = 16
SPEC = mc.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _cfg(path: Path, capacity: int | str = 1 << 26, **disk: object) -> mc.CacheConfig:
    return mc.CacheConfig(spec=SPEC, namespace="faults", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=SPEC.nbytes(CH) * 2),
        DiskTier(path=str(path), capacity_bytes=capacity, write_through=True, **disk)))


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.kvc"))


def _prompt(i: int, chunks: int = 4) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + chunks * CH))


@pytest.mark.parametrize("how", ["delete", "clear"])
async def test_a_chunk_whose_read_hung_is_deleted_with_its_prompt(tmp_path: Path, how: str,
                                                                  monkeypatch) -> None:
    # A read that hung quarantines its file. The next read of it forgot the chunk and left
    # the file: delete and clear no longer reached it, and a restart served the deleted KV.
    a = _prompt(0)
    async with mc.Cache(_cfg(tmp_path, timeout=0.3)) as cache:
        await cache.put(a, torch.randn(SPEC.shape(len(a))))
        for i in range(1, 4):  # push A out of the host tier: it lives on disk only
            await cache.put(_prompt(i), torch.randn(SPEC.shape(4 * CH)))
        await cache.flush()
        real = os.open

        def hangs(p, flags, *args, **kw):  # type: ignore[no-untyped-def]
            if str(p).endswith(".kvc") and not flags & (os.O_WRONLY | os.O_RDWR):
                time.sleep(1.0)  # a file system stuck for a second (an NFS hiccup)
            return real(p, flags, *args, **kw)

        monkeypatch.setattr(os, "open", hangs)
        assert (await cache.get(a)).num_tokens < len(a)
        monkeypatch.setattr(os, "open", real)
        await asyncio.sleep(1.2)  # the stuck threads return
        assert (await cache.get(a)).num_tokens < len(a)  # quarantined: a miss
        stats = (await cache.stats())["tiers"]["disk"]
        assert stats["store_quarantined"] >= 1
        await cache.flush()
        # Forgotten, and its file gone with it: what the tier counts is what it holds.
        stats = (await cache.stats())["tiers"]["disk"]
        assert stats["bytes_used"] == sum(p.stat().st_size for p in _files(tmp_path))
        if how == "delete":
            await cache.delete(a)
        else:
            await cache.clear()
        await cache.flush()
    async with mc.Cache(_cfg(tmp_path)) as cache:
        assert (await cache.get(a)).num_tokens == 0


async def test_the_start_up_scan_keeps_a_file_it_cannot_open(tmp_path: Path,
                                                             monkeypatch) -> None:
    # A file the scan cannot open (out of fds for a moment, an I/O error) was removed as
    # corrupt: good chunks were lost for good.
    prompts = [_prompt(i) for i in range(6)]
    kvs = [torch.randn(SPEC.shape(4 * CH)) for _ in prompts]
    async with mc.Cache(_cfg(tmp_path)) as cache:
        for p, kv in zip(prompts, kvs, strict=True):
            await cache.put(p, kv)
        await cache.flush()
    before = _files(tmp_path)
    real = os.open
    once: list[str] = []
    always = str(before[3])

    def flaky(p, flags, *a, **k):  # type: ignore[no-untyped-def]
        p = str(p)
        if p.endswith(".kvc") and not once and p != always:
            once.append(p)
            raise OSError(errno.EMFILE, "Too many open files", p)
        if p == always:
            raise OSError(errno.EIO, "Input/output error", p)
        return real(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", flaky)
    async with mc.Cache(_cfg(tmp_path)) as cache:
        stats = (await cache.stats())["tiers"]["disk"]
        assert stats["store_scan_errors"] == 1  # the file that failed every try
        assert stats["store_removed_corrupt"] == 0
    monkeypatch.setattr(os, "open", real)
    assert _files(tmp_path) == before
    async with mc.Cache(_cfg(tmp_path)) as cache:
        for p, kv in zip(prompts, kvs, strict=True):
            hit = await cache.get(p)
            assert hit.num_tokens == len(p) and torch.equal(hit.kv, kv)


async def test_a_restart_with_a_smaller_capacity_is_within_it_at_once(tmp_path: Path) -> None:
    async with mc.Cache(_cfg(tmp_path, capacity="1MiB", codec="raw")) as cache:
        for i in range(40):
            await cache.put(_prompt(i), torch.randn(SPEC.shape(4 * CH)))
        await cache.flush()
    cap = 100_000
    assert sum(p.stat().st_size for p in _files(tmp_path)) > cap
    async with mc.Cache(_cfg(tmp_path, capacity=cap, codec="raw")) as cache:
        stats = (await cache.stats())["tiers"]["disk"]
        assert 0 < stats["bytes_used"] <= cap
        await cache.flush()  # the evicted chunks' files are deleted in the background
        assert sum(p.stat().st_size for p in _files(tmp_path)) == \
            (await cache.stats())["tiers"]["disk"]["bytes_used"]
