"""One worker-thread hop of a no-op, right after a 64 MiB write has left the CPU's caches
cold (as a store's hop follows its copy): anyio's ``to_thread.run_sync`` with a limiter (the
mover's hop before the twelfth round), the loop's ``run_in_executor`` on a pool of its own
(the mover's hop now), and ``asyncio.to_thread`` (the bench's bare gather). Min / median of
REPEATS each, alternated. docs/benchmarks.md, "Paged store, disk reads".

    python docs/scripts/thread_hop.py [REPEATS]
"""

import asyncio
import concurrent.futures
import statistics
import sys
import time

import anyio
import anyio.to_thread
import numpy as np

BUF = np.zeros(64 << 20, dtype=np.uint8)


def nothing() -> None:
    pass


async def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    limiter = anyio.CapacityLimiter(2)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    loop = asyncio.get_running_loop()
    hops = {
        "anyio to_thread": lambda: anyio.to_thread.run_sync(nothing, limiter=limiter),
        "run_in_executor": lambda: loop.run_in_executor(pool, nothing),
        "asyncio.to_thread": lambda: asyncio.to_thread(nothing),
    }
    took: dict[str, list[float]] = {name: [] for name in hops}
    for i in range(repeats):
        for name, hop in hops.items():
            BUF[:] = i % 200
            t0 = time.perf_counter()
            await hop()
            took[name].append(time.perf_counter() - t0)
    pool.shutdown()
    for name, xs in took.items():
        med = statistics.median(xs)
        print(f"{name:18s} min {min(xs) * 1e6:6.1f} us, median {med * 1e6:6.1f} us")


asyncio.run(main())
