"""The loop steps of each operation on one long prompt, each step timed by the loop thread's
CPU clock: a put of N chunks into an empty cache of the bench's tiny spec, one that evicts
all of it, then lookup, get, get(out=), prefetch, a put of it again (all cached), delete,
and a put and clear. Only the operation's own task is timed (its steps, not the script's).
docs/benchmarks.md, "The event loop during directory work" (eleventh round).

    python docs/scripts/long_prompt_steps.py [CHUNKS]
"""

import asyncio
import sys

import numpy as np
import torch
from _loop_steps import steps, time_steps

from musacache.bench import scale as S

watched: asyncio.Future | None = None
time_steps(lambda h: watched is not None and getattr(h._callback, "__self__", None) is watched)


async def main() -> None:
    global watched
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    kv = torch.zeros(S.TINY.shape(n * S.CH), dtype=S.TINY.dtype)
    out = torch.empty_like(kv)
    a, b = S._prompts(np.random.default_rng(1), 2, n)
    async with S._tiny_cache(n) as c:
        ops = (("put", lambda: c.put(a, kv)), ("evicting put", lambda: c.put(b, kv)),
               ("lookup", lambda: c.lookup(b)), ("get", lambda: c.get(b)),
               ("get(out=)", lambda: c.get(b, out=out)), ("prefetch", lambda: c.prefetch(b)),
               ("put again (all cached)", lambda: c.put(b, kv)),
               ("delete", lambda: c.delete(b)), ("put after it", lambda: c.put(b, kv)),
               ("clear", lambda: c.clear()))
        for name, op in ops:
            steps.clear()

            async def run(op=op) -> object:
                return await op()

            watched = asyncio.ensure_future(run())
            await watched
            watched = None
            ms = np.array(steps) * 1e3
            print(f"{name} of {n} chunks: {len(ms)} steps, largest {ms.max():.2f} ms of loop "
                  f"CPU, all {ms.sum():.1f}")


asyncio.run(main())
