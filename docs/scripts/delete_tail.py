"""A delete of a prompt with 200,000 one-chunk conversations after it (the bench's
"delete (200000 descendants)" stall row): the loop's largest gap and what the loop thread's
CPU counted within it, the longest step of the delete, and its last step. The last batches
free the last objects of most of the allocator's arenas (docs/architecture.md, "A delete's
last children go a few per step"). docs/benchmarks.md, "A delete's last batch".

    python docs/scripts/delete_tail.py [CHILDREN]
"""

import asyncio
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from musacache import _removal
from musacache.bench import scale

STEPS: list[float] = []
_real = _removal._delete_steps


def _timed(*args: object, **kw: object) -> Iterator[None]:
    it = _real(*args, **kw)  # type: ignore[arg-type]
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            STEPS.append(time.perf_counter() - t0)
            return
        STEPS.append(time.perf_counter() - t0)
        yield


_removal._delete_steps = _timed  # type: ignore[assignment]


async def main(children: int) -> None:
    rng = np.random.default_rng(5)
    system = rng.integers(0, scale.VOCAB, scale.CH).astype(np.int32)
    kv = torch.zeros(scale.TINY.shape(2 * scale.CH), dtype=scale.TINY.dtype)
    async with scale._tiny_cache(children + 8) as c:
        await c.put(system, kv)
        for conv in rng.integers(0, scale.VOCAB, (children, scale.CH)).astype(np.int32):
            await c.put(np.concatenate([system, conv]), kv)
        async with scale._Gaps() as g:
            removed = await c.delete(system)
    if removed != children + 1:
        raise RuntimeError(f"removed {removed}, not {children + 1}")
    print(f"{len(STEPS)} steps; longest step {max(STEPS) * 1e3:.2f} ms, last step "
          f"{STEPS[-1] * 1e3:.2f} ms; largest loop gap {g.max * 1e3:.2f} ms "
          f"(loop CPU {g.at_max.cpu * 1e3:.2f} ms)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000))
