"""Chunks a put sends straight to storage are staged in host buffers that later puts reuse
(``musacache.engine.staging``): no fresh multi-MiB tensor, and its page faults, per chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache.engine.staging import StagePool

CH = 16


def _disk_only(spec: mc.KVSpec, path: Path) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "stage", chunk_size=CH, tiers=(
        mc.DiskTier(path=str(path), capacity_bytes="64MiB"),))


async def test_a_second_put_to_storage_leaves_the_first_puts_chunks_whole(
        tmp_path: Path) -> None:
    # The second put stages its chunks in the buffers the first one used and gave back: its
    # bytes must never reach the first put's chunks. (The cost a put saves: ``musacache
    # bench scale``, disk-only put.)
    spec = small_spec()
    async with mc.Cache(_disk_only(spec, tmp_path)) as c:
        rng = np.random.default_rng(0)
        a, b = ([int(x) for x in rng.integers(0, 50_000, 4 * CH)] for _ in range(2))
        kv_a, kv_b = prefix_kv(spec, a), prefix_kv(spec, b) + 1
        assert await c.put(a, kv_a) == 4 * CH
        assert await c.put(b, kv_b) == 4 * CH
        await c.flush()
        ha, hb = await c.get(a), await c.get(b)
        assert torch.equal(ha.kv, kv_a) and torch.equal(hb.kv, kv_b)
    async with mc.Cache(_disk_only(spec, tmp_path)) as c:  # and as written on disk
        ha, hb = await c.get(a), await c.get(b)
        assert torch.equal(ha.kv, kv_a) and torch.equal(hb.kv, kv_b)


def test_the_pool_keeps_at_most_its_bound_and_hands_out_the_right_shape() -> None:
    pool = StagePool(keep_bytes=3 * 64 * 4)
    ts = [pool.take((4, 16), torch.float32) for _ in range(4)]
    pool.give(ts)  # the fourth would pass the bound: three are kept
    t = pool.take((2, 8), torch.float32)
    assert t.shape == (2, 8) and t.is_contiguous()
    assert t.data_ptr() == ts[2].data_ptr()  # the newest idle buffer first
    again = [pool.take((4, 16), torch.float32) for _ in range(3)]
    ptrs = {x.data_ptr() for x in ts}
    assert sum(x.data_ptr() in ptrs for x in again) == 2  # the other two kept; one fresh
    other = pool.take((4, 16), torch.int64)
    assert other.dtype == torch.int64 and other.data_ptr() not in {x.data_ptr() for x in ts}


def test_the_stage_pool_keeps_and_counts_whole_buffers() -> None:
    # A put's whole chunk, then a prompt's 1-token tail: the tail took the newest idle buffer
    # (a whole chunk's) and came back as a 1-element view, counted at its own size while it
    # held the whole buffer, and useless for the next whole chunk, which allocated again: the
    # pool kept 402 MiB against its 64 MiB cap after 400 puts (found by a probe).
    from musacache.engine.staging import StagePool

    pool = StagePool(keep_bytes=4 * 1024)
    first = pool.take((256,), torch.float32)  # 1 KiB
    pool.give([first])
    for _ in range(50):
        tail = pool.take((1,), torch.float32)
        pool.give([tail])
        whole = pool.take((256,), torch.float32)
        # the one buffer, taken and given back each time: never a fresh one
        assert whole.data_ptr() == first.data_ptr()
        pool.give([whole])
