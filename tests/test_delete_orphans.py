"""A delete reaches every chunk of the prompts it names, also one whose parent has left the
directory (an orphan), and a put in flight across a clear leaves no chunk behind that no
delete can reach. Found by a probe: in both cases a later put of the missing parent brought
the deleted chunk back, served live and after a restart (the probe's versioned oracle)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import musacache as mc
from musacache.engine import storage as _coldpath

CS = 8
SPEC = mc.KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
A, B, C = list(range(0, 8)), list(range(110, 118)), list(range(220, 228))
X, Y = list(range(300, 308)), list(range(500, 508))


def kv(n: int, version: int) -> torch.Tensor:
    return torch.full(SPEC.shape(n), float(version))


def versions(hit: mc.Hit) -> list[int]:
    """The version each chunk of the hit was put with (one value per chunk)."""
    return [int(v) for v in hit.kv[0, 0, : hit.num_tokens : CS, 0, 0].tolist()]


def config(tmp_path, host_slots: float, disk_slots: float) -> mc.CacheConfig:
    slot = SPEC.nbytes(CS)
    return mc.CacheConfig(spec=SPEC, namespace="orphans", chunk_size=CS, promotion="sync",
                          tiers=(mc.HostTier(capacity_bytes=int(slot * host_slots)),
                                 mc.DiskTier(path=str(tmp_path / "d"),
                                             capacity_bytes=int(slot * disk_slots), codec="raw")))


async def test_a_delete_reaches_a_chunk_whose_parent_was_evicted_first(tmp_path):
    cfg = config(tmp_path, host_slots=2, disk_slots=1.5)  # one object fits on disk, not two
    async with mc.Cache(cfg) as cache:
        await cache.put(A + B, kv(16, 1))  # host: A, B
        await cache.put(X, kv(8, 9))  # host evicts B: disk B
        await cache.flush()
        await cache.put(A + B + C, kv(24, 1))  # host: A, C
        await cache.flush()
        # Host evicts C to the disk, which makes room by evicting B (C is not there yet, so
        # B is a leaf on disk): C is left with its parent missing.
        await cache.put(Y, kv(8, 9))
        await cache.flush()
        # The orphan this test is about: three chunks held, A and Y in host memory, and
        # on disk one that no lookup reaches (not X, and B is gone from after A): C.
        st = await cache.stats()
        assert st["chunks"] == 3 and st["tiers"]["host"]["chunks"] == 2
        assert await cache.lookup(Y) == CS and await cache.lookup(X) == 0
        assert await cache.lookup(A + B + C) == CS
        await cache.delete(A)  # every chunk after A goes, C too
        await cache.flush()
        await cache.put(A + B, kv(16, 2))
        hit = await cache.get(A + B + C)
        assert versions(hit) == [2, 2]
        await cache.flush()
    async with mc.Cache(cfg) as cache:
        assert 1 not in versions(await cache.get(A + B + C))


async def test_a_put_across_a_clear_leaves_no_chunk_a_delete_cannot_reach(tmp_path,
                                                                            monkeypatch):
    reached, gate = asyncio.Event(), asyncio.Event()
    encode = _coldpath.ColdPath.encode
    c_tokens = np.asarray(C, dtype=np.int32).tobytes()

    async def slow_encode(self, t, items):  # C's encode waits while the clear runs
        if any(e.tokens == c_tokens for e, _ in items):
            reached.set()
            await gate.wait()
        return await encode(self, t, items)

    monkeypatch.setattr(_coldpath.ColdPath, "encode", slow_encode)
    cfg = config(tmp_path, host_slots=2, disk_slots=20)  # A, B in memory; C goes to disk
    async with mc.Cache(cfg) as cache:
        put = asyncio.create_task(cache.put(A + B + C, kv(24, 1)))
        await reached.wait()  # A and B committed, C being encoded
        clear = asyncio.create_task(cache.clear())
        await asyncio.sleep(0)  # the clear has swapped in a new directory
        gate.set()
        assert await put == 16  # C is not put into the new directory without its parents
        await clear
        await cache.flush()
        await cache.delete(A + X)
        await cache.flush()
        await cache.put(A + B, kv(16, 2))
        assert versions(await cache.get(A + B + C)) == [2, 2]
        await cache.flush()
    async with mc.Cache(cfg) as cache:
        assert 1 not in versions(await cache.get(A + B + C))


@pytest.mark.parametrize("order", ["leaf first", "parent first"])
async def test_the_orphan_links_go_once_nothing_waits(tmp_path, order):
    # Links are kept only while an orphan waits under a missing chunk: chunks evicted in
    # either order leave none behind once all are gone.
    cfg = config(tmp_path, host_slots=8, disk_slots=0.5)  # nothing fits on disk
    async with mc.Cache(cfg) as cache:
        await cache.put(A + B + C, kv(24, 1))
        d = cache._engine.dir
        chunks = [d.get(k) for k in sorted(d.entries.keys())]
        chunks.sort(key=lambda e: e.tokens[:4])
        by_tok = {int(np.frombuffer(e.tokens, "<i4")[0]): e for e in chunks}
        doomed = [by_tok[220], by_tok[110], by_tok[0]]
        if order == "parent first":
            doomed.reverse()
        for e in doomed:
            d.remove(e)
            if order == "parent first" and e is not doomed[-1]:
                assert d.lost_parent
        assert not d.lost_parent and not d.lost_under and not d.children.keys() - {
            cache._engine.chain.seed}


async def test_a_clear_never_deletes_what_was_put_again_while_it_ran(tmp_path, monkeypatch):
    """Found by a probe: a clear takes the old directory apart a batch per loop turn, and
    each old chunk's delete, by key, was chained after the write of the same chunk put again
    meanwhile, so it removed the new file (lost at the next restart)."""
    from musacache.engine import removal as _removal

    gate, swapped = asyncio.Event(), asyncio.Event()
    dismantle = _removal._dismantle_steps

    def held(old, batch, each):  # the old directory is taken apart once the gate opens
        swapped.set()  # (the clear has swapped in a new one before it starts this)
        while not gate.is_set():
            yield
        yield from dismantle(old, batch, each)

    monkeypatch.setattr(_removal, "_dismantle_steps", held)
    slot = SPEC.nbytes(CS)
    cfg = mc.CacheConfig(spec=SPEC, namespace="orphans", chunk_size=CS,
                         tiers=(mc.HostTier(capacity_bytes=slot * 8),
                                mc.DiskTier(path=str(tmp_path / "d"), capacity_bytes=slot * 8,
                                            write_through=True)))
    async with mc.Cache(cfg) as cache:
        await cache.put(A + B, kv(16, 1))
        await cache.flush()
        clear = asyncio.create_task(cache.clear())
        await swapped.wait()
        assert await cache.lookup(A + B) == 0  # cleared
        assert await cache.put(A + B, kv(16, 1)) == 16
        await cache.flush()  # its write-through is on disk
        gate.set()
        await clear
        await cache.flush()
        assert await cache.lookup(A + B) == 16
    async with mc.Cache(cfg) as cache:
        assert await cache.lookup(A + B) == 16
