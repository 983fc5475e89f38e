"""``clear`` of a cache of 1.25M chunks (the bench's tiny spec, 64-chunk prompts): the last
step, from the last loop turn of taking the old directory apart to ``clear`` returning (where
the old directory is dropped), and the longest step of all. docs/benchmarks.md, "Growing puts
and clear".

    python docs/scripts/clear_last_step.py
"""

import asyncio
import time

import anyio.lowlevel
import numpy as np
import torch

import musacache.engine.removal as removal
from musacache.bench.scale import CH, TINY, _prompts, _tiny_cache

turns: list[float] = []
_checkpoint = anyio.lowlevel.cancel_shielded_checkpoint


async def timed_checkpoint() -> None:
    turns.append(time.perf_counter())  # a step ends here
    await _checkpoint()
    turns.append(time.perf_counter())  # the next one starts here


removal.anyio.lowlevel.cancel_shielded_checkpoint = timed_checkpoint


async def main() -> None:
    n = 1_250_000
    rng = np.random.default_rng(3)
    async with _tiny_cache(n + 128) as c:
        kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
        for p in _prompts(rng, n // 64, 64):
            await c.put(p, kv)
        turns.clear()
        t0 = time.perf_counter()
        await c.clear()
        end = time.perf_counter()
        during = list(turns)  # (closing the cache takes turns of its own after this)
    starts = [t0, *during[1::2]]
    ends = [*during[0::2], end]
    steps = [b - a for a, b in zip(starts, ends, strict=True)]
    print(f"clear of {n} chunks: {len(steps)} steps; last step {steps[-1] * 1e3:.3f} ms, "
          f"longest {max(steps) * 1e3:.3f} ms")


asyncio.run(main())
