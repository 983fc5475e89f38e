"""A chunk deleted and put again has the same key and other bytes: a read of the new one must
never join a promotion still running for the old one (found by a probe: a prefetch's
promotion, a delete, a put of new KV for the same tokens, and a get served the old KV)."""

from __future__ import annotations

import anyio
import numpy as np
import torch

import musacache as mc
from fake_store import MemStore
from helpers import prefix_kv, small_spec

CH = 4


class SnapshotStore(MemStore):
    """A read takes the object when it starts and returns it a while later, as a read of a
    file replaced meanwhile does."""

    async def read(self, meta: mc.ChunkMeta) -> bytes | None:
        obj = self.objects.get(meta.key)
        await anyio.sleep(self.read_delay)
        self.reads += 1
        return obj


def _cfg(spec: mc.KVSpec, store: mc.StorageTier) -> mc.CacheConfig:
    nbytes = spec.nbytes(CH) * 2
    return mc.CacheConfig(spec, "gens", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=nbytes, segment_bytes=nbytes), store))


async def test_a_get_of_a_chunk_put_again_never_joins_the_old_chunks_promotion():
    spec = small_spec()
    store = SnapshotStore()
    store.read_delay = 0.3
    toks = [1, 2, 3, 4]
    old = prefix_kv(spec, toks)
    new = old + 1000  # other bytes for the same tokens
    fill = [[100 + 10 * i + j for j in range(CH)] for i in range(4)]
    async with mc.Cache(_cfg(spec, store)) as c:
        await c.put(toks, old)
        for f in fill[:2]:  # the host tier holds two chunks: toks goes down to the store
            await c.put(f, prefix_kv(spec, f))
        await c.flush()
        (m,), _ = c._engine.dir.match(np.asarray(toks, dtype=np.int32))
        assert c._engine.hottest_mem(m.entry) is None  # only the store holds it
        await c.prefetch(toks)  # the old chunk's promotion starts: a slow read
        await anyio.sleep(0.01)
        assert c._engine.flights  # still reading
        await c.delete(toks)
        await c.put(toks, new)
        for f in fill[2:]:  # the new chunk goes down to the store too
            await c.put(f, prefix_kv(spec, f))
        hit = await c.get(toks)
        assert hit.num_tokens in (0, CH)
        if hit.num_tokens:
            assert torch.equal(hit.kv, new), "served the deleted chunk's bytes"
        await c.flush()
        hit = await c.get(toks)
        assert hit.num_tokens == CH and torch.equal(hit.kv, new)
