"""Puts that grow a directory of 1M chunks by a quarter (the bench's tiny spec, 64-chunk
prompts), watched as `bench scale --only stalls` watches them: the largest loop gap (with the
loop thread's CPU in it) and the longest collection of the cyclic garbage collector.
docs/benchmarks.md, "Growing puts and clear".

    python docs/scripts/grow_gc.py
"""

import asyncio
import time

import numpy as np
import torch

from musacache.bench.scale import CH, TINY, _Gaps, _prompts, _tiny_cache


async def main() -> None:
    rng = np.random.default_rng(3)
    entries = 1_000_000
    grow = entries // 4
    async with _tiny_cache(entries + grow + 128) as c:
        kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
        for p in _prompts(rng, entries // 64, 64):
            await c.put(p, kv)
        more = _prompts(rng, grow // 64, 64)
        t0 = time.perf_counter()
        async with _Gaps() as g:
            for p in more:
                await c.put(p, kv)
        took = time.perf_counter() - t0
    print(f"{len(more)} puts in {took:.2f} s: largest gap {g.max * 1e3:.2f} ms (loop CPU "
          f"{g.cpu_at_max * 1e3:.2f} ms), longest collection {g.gc_max * 1e3:.2f} ms, "
          f"{len(g.pauses)} collections")


asyncio.run(main())
