"""Viewing 16 pool slots (MemoryPool.views, and one view each) in a loop, right after a 128 MiB
copy, and right after a 1 ms sleep. docs/benchmarks.md, "Paged store, disk reads".

    python docs/scripts/cold_views.py
"""

import statistics
import time
import timeit

import anyio
import torch

from musacache import KVSpec
from musacache.tiers.memory import MemoryPool

spec = KVSpec(8, 8, 128, torch.bfloat16)
nb = spec.nbytes(256)
pool = MemoryPool(capacity_bytes=nb * 17, slot_bytes=nb, device=torch.device("cpu"),
                  pinned=False, segment_bytes=nb * 17)
for _ in range(16):
    pool.reserve()
anyio.run(pool.materialize, 0)
idx = list(range(16))
shape = spec.shape(256)
a = torch.empty(128 << 20, dtype=torch.uint8)
b = torch.empty_like(a)


def runs() -> list[torch.Tensor]:
    return pool.views(idx, spec.dtype, shape)


def each() -> list[torch.Tensor]:
    return [pool.view(i, spec.dtype, shape) for i in idx]


for f in (runs, each):
    warm = min(timeit.repeat(f, number=200, repeat=5)) / 200
    after = {"copy": [], "sleep": []}
    for _ in range(20):
        b.copy_(a)
        t = time.perf_counter()
        f()
        after["copy"].append(time.perf_counter() - t)
        time.sleep(0.001)
        t = time.perf_counter()
        f()
        after["sleep"].append(time.perf_counter() - t)
    print(f"{f.__name__}: warm {warm * 1e6:.1f} us; " + "; ".join(
        f"after a {k}: min {min(v) * 1e6:.1f} med {statistics.median(v) * 1e6:.1f} us"
        for k, v in after.items()))
