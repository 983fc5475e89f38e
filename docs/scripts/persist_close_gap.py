"""The largest event-loop gap while a cache of the bench's tiny spec closes with
``persist_on_close``, as ``bench scale``'s row of that name (ENTRIES chunks, default 1M), and
what the clocks counted in it. docs/benchmarks.md, "One long prompt (eleventh round)".

    python docs/scripts/persist_close_gap.py [ENTRIES]
"""

import asyncio
import sys

import numpy as np
import torch

from musacache import Cache, CacheConfig, HostTier
from musacache.tiers.listing import ListingBuilder
from musacache.bench import scale as S


async def main() -> None:
    entries = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rng = np.random.default_rng(11)
    pool = HostTier(capacity_bytes=S.TINY.nbytes(S.CH) * (entries + 64))
    persist = Cache(CacheConfig(S.TINY, "bench-scale", chunk_size=S.CH, close_timeout=3.0,
                                tiers=(pool, S._Listing(ListingBuilder().build()))))
    await persist.open()
    kv64 = torch.zeros(S.TINY.shape(64 * S.CH), dtype=S.TINY.dtype)
    for p in S._prompts(rng, max(1, entries // 64), 64):
        await persist.put(p, kv64)
    async with S._Gaps() as g:
        await persist.aclose()
    print(f"aclose with persist: largest gap {g.max * 1e3:.2f} ms; within it {g.at_max}")


asyncio.run(main())
