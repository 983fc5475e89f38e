"""What ``asyncio.gather`` costs per argument that is already done, against awaiting the same
futures one by one: 1,000 futures made done beforehand (so nothing of a get is in the
timing), the best of 300 rounds, per future. Under musacache's environment it also times its
completed answers (``_completed.Completed``, what a direct ``get`` returns); under any other
Python only plain ``asyncio.Future``s. docs/benchmarks.md, "Full runs at the end of the
twenty-second round".

    python docs/scripts/gather_floor.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

N = 1000
ROUNDS = 300


async def floor(make: Callable[[], asyncio.Future[Any]]) -> tuple[float, float]:
    futs = [make() for _ in range(N)]
    gathered = awaited = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        await asyncio.gather(*futs)
        gathered = min(gathered, time.perf_counter() - t)
        t = time.perf_counter()
        for f in futs:
            await f
        awaited = min(awaited, time.perf_counter() - t)
    return gathered / N * 1e6, awaited / N * 1e6


async def main() -> None:
    loop = asyncio.get_running_loop()

    def plain() -> asyncio.Future[Any]:
        f = loop.create_future()
        f.set_result(None)
        return f

    kinds: dict[str, Callable[[], asyncio.Future[Any]]] = {"asyncio.Future": plain}
    try:
        from musacache.engine.completed import Completed
    except ImportError:
        pass
    else:
        def completed() -> asyncio.Future[Any]:
            f: Completed[None] = Completed(loop=loop)
            f.set_result(None)
            return f

        kinds["musacache Completed"] = completed
    print(f"Python {sys.version.split()[0]}, {N} done futures, best of {ROUNDS}")
    for name, make in kinds.items():
        gathered, awaited = await floor(make)
        print(f"  {name:20s} gather {gathered:.3f} us per future, await {awaited:.3f} us")


if __name__ == "__main__":
    asyncio.run(main())
