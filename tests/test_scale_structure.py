"""Structure of the control plane at scale (issue 12): what the bookkeeping holds per chunk,
and what a stats() call may touch. Speed itself is shown by ``musacache bench scale``."""

from __future__ import annotations

import sys

import torch

import musacache as mc
from helpers import prefix_kv

CH = 16


def _cfg(spec: mc.KVSpec, chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "scale", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * chunks),))


class _NoWalk(dict):  # type: ignore[type-arg]
    """A directory whose entries may be looked up but not walked."""

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats() walked every directory entry")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("stats() walked every directory entry")


async def test_stats_counts_pins_without_walking_the_directory(spec):
    async with mc.Cache(_cfg(spec, 64)) as c:
        toks = list(range(5 * CH))
        await c.put(toks, prefix_kv(spec, toks))
        eng = c._engine
        eng.dir.entries = _NoWalk(eng.dir.entries)
        assert c.stats()["pins"] == 0
        m = eng.dir.get(next(iter(dict.values(eng.dir.entries))).key)
        eng.pin(m)
        eng.pin(m)
        assert c.stats()["pins"] == 2
        eng.unpin(m)
        eng.unpin(m)
        assert c.stats()["pins"] == 0
        eng.dir.entries = dict(eng.dir.entries)


async def test_a_cached_chunk_holds_no_tensor_dict_or_set(spec):
    async with mc.Cache(_cfg(spec, 64)) as c:
        toks = list(range(3 * CH))
        await c.put(toks, prefix_kv(spec, toks))
        for e in c._engine.dir.entries.values():
            assert not hasattr(e, "__dict__")
            values = [getattr(e, name) for name in type(e).__slots__]
            assert not any(isinstance(v, (dict, set, list, torch.Tensor)) for v in values), e
            # One memory tier holds it: its residency is one int (slot index and tier).
            assert isinstance(e._mem, int)
            (idx, index), = e.slots()
            assert isinstance(index, int)
            assert isinstance(e.tokens, bytes) and len(e.tokens) == 4 * e.num_tokens
            # The slot's bytes are still reachable, as a view made on demand.
            view = c._engine.view(c._mem[idx], e)
            assert view.shape == spec.shape(CH)
        sizes = {id(e.raw_bytes) for e in c._engine.dir.entries.values()}
        assert len(sizes) == 1  # one shared int per chunk size
        assert sys.getsizeof(next(iter(c._engine.dir.entries.values()))) <= 160
        # The tier's recency list is linked through slot indices: no node per chunk.
        assert not hasattr(c._mem[0].lru, "__dict__")
