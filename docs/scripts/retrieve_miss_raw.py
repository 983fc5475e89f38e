"""A retrieve that misses, with raw per-layer caches (32 layers): what checking and describing
the caches costs per call. docs/benchmarks.md, "Paged store, disk reads", eighth round.

    python docs/scripts/retrieve_miss_raw.py
"""

import asyncio
import statistics
import time

import numpy as np
import torch

from musacache import Cache, CacheConfig, HostTier, KVSpec


async def main() -> None:
    layers, tokens = 32, 256
    spec = KVSpec(layers, 8, 128, torch.bfloat16)
    caches = [torch.zeros((2, 64, 16, 8, 128), dtype=spec.dtype) for _ in range(layers)]
    slots = torch.arange(tokens, dtype=torch.int64)
    toks = np.arange(tokens, dtype=np.int32) + 1_000_000  # never stored: a miss
    cfg = CacheConfig(spec, "s", chunk_size=256,
                      tiers=(HostTier(capacity_bytes=spec.nbytes(tokens) * 4),))
    async with Cache(cfg) as c:
        per_call = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(200):
                await c.retrieve(toks, caches, slots)
            per_call.append((time.perf_counter() - t0) / 200)
    print(f"retrieve miss (raw list, {layers} layers): min {min(per_call) * 1e6:.1f} "
          f"med {statistics.median(per_call) * 1e6:.1f} us")


asyncio.run(main())
