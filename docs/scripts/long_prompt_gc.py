"""The cyclic collector's full collections during each operation on one long prompt: how
many ran, the most objects one of them walked (those tracked when it began),
and its longest pause (the thread's CPU time), as in ``bench scale``'s stall rows: a put of
N chunks into an empty cache of the bench's tiny spec, one that evicts all of it, then
lookup, get and a put of it again (all cached). Each operation runs ``REPEATS`` times in a
fresh cache (the collector's schedule decides whether a full collection falls inside it).
docs/benchmarks.md, "The event loop during directory work" (fourteenth round).

    python docs/scripts/long_prompt_gc.py [CHUNKS] [REPEATS]
"""

import asyncio
import gc
import sys
import time

import numpy as np
import torch

from musacache.bench import scale as S

full: list[tuple[int, float]] = []
_began = [0, 0.0]


def _watch(phase: str, info: dict[str, int]) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _began[0] = len(gc.get_objects())  # every generation's
        _began[1] = time.thread_time()
    else:
        full.append((_began[0], (time.thread_time() - _began[1]) * 1e3))


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    kv = torch.zeros(S.TINY.shape(n * S.CH), dtype=S.TINY.dtype)
    seen: dict[str, list[tuple[int, float]]] = {}
    gc.callbacks.append(_watch)
    for r in range(repeats):
        a, b = S._prompts(np.random.default_rng(r), 2, n)
        async with S._tiny_cache(n) as c:
            for name, op in (("put", lambda c=c, a=a: c.put(a, kv)),
                             ("evicting put", lambda c=c, b=b: c.put(b, kv)),
                             ("lookup", lambda c=c, b=b: c.lookup(b)),
                             ("get", lambda c=c, b=b: c.get(b)),
                             ("put again (all cached)", lambda c=c, b=b: c.put(b, kv))):
                full.clear()
                await op()
                seen.setdefault(name, []).extend(full)
        gc.collect()
    gc.callbacks.remove(_watch)
    print(f"{n} chunks, {repeats} repeats: full collections inside each operation")
    print(f"{'operation':<24} {'count':>5} {'most objects':>13} {'longest, ms CPU':>16}")
    for name, got in seen.items():
        most = max((k for k, _ in got), default=0)
        longest = max((t for _, t in got), default=0.0)
        print(f"{name:<24} {len(got):>5} {most:>13,} {longest:>16.2f}")


asyncio.run(main())
