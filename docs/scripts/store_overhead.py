"""The paged store's time outside its copy, against a bare native gather's time outside its own
(the bench's `paged` part, 4096 tokens, 128 MiB), in alternated pairs. The copy is timed inside
each (the native call) and taken off. docs/benchmarks.md, "Paged store, disk reads".

    python docs/scripts/store_overhead.py [PAIRS]
"""

import asyncio
import sys
import time

import numpy as np

import musacache.engine.core as core
from musacache import Cache, transfer
from musacache.bench.scale import paged_setup

marks: dict[str, list[float]] = {}


def mark(k: str) -> None:
    marks.setdefault(k, []).append(time.perf_counter())


_gather = core._gather_checked


def timed_gather(*a, **k):  # the store's native call, timed in its worker thread
    mark("work0")
    _gather(*a, **k)
    mark("work1")


core._gather_checked = timed_gather


async def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    _spec, caches, slots, dense, toks, cfg = paged_setup(4096)
    bare = []
    async with Cache(cfg) as c:
        await c.store(toks, caches, slots)
        marks.clear()
        for _ in range(pairs):
            def gather() -> tuple[float, float]:
                t = time.perf_counter()
                transfer.gather(caches, slots, dense, "vllm")
                return t, time.perf_counter()
            t0 = time.perf_counter()
            a, b = await asyncio.to_thread(gather)
            bare.append(time.perf_counter() - t0 - (b - a))
            await c.delete(toks)
            mark("s0")
            await c.store(toks, caches, slots)
            mark("s1")
    m = {k: np.array(v) for k, v in marks.items()}
    store = (m["s1"] - m["s0"]) - (m["work1"] - m["work0"])
    b = np.array(bare)
    print(f"outside the copy, min / median ms: store {store.min() * 1e3:.2f} / "
          f"{np.median(store) * 1e3:.2f}; bare gather {b.min() * 1e3:.2f} / "
          f"{np.median(b) * 1e3:.2f}")


asyncio.run(main())
