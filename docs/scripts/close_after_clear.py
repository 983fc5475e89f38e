"""The loop's steps while a cache closes right after a `clear` of 1.25M chunks (the bench's
tiny spec, as `bench scale --only stalls` fills it): the largest step's CPU time and all
steps' together, each step timed by the loop thread's CPU clock. docs/benchmarks.md, "The
event loop during directory work" (tenth round).

    python docs/scripts/close_after_clear.py
"""

import asyncio

import numpy as np
import torch
from _loop_steps import steps, time_steps

from musacache.bench import scale as S

watching = False
time_steps(lambda _handle: watching)


async def main() -> None:
    global watching
    chunks = 1_250_000
    c = S._tiny_cache(chunks + 128)
    await c.open()
    kv = torch.zeros(S.TINY.shape(64 * S.CH), dtype=S.TINY.dtype)
    for p in S._prompts(np.random.default_rng(5), chunks // 64, 64):
        await c.put(p, kv)
    await c.clear()  # every slot released
    watching = True
    await c.aclose()
    watching = False
    ms = np.array(steps) * 1e3
    print(f"aclose after a clear of {chunks} chunks: {len(ms)} steps, largest {ms.max():.2f} ms"
          f" of loop CPU, all {ms.sum():.1f} ms")


asyncio.run(main())
