"""A get of 8 chunks that live only on disk (lz4), read straight into the caller's tensor: its
wall time and the event-loop thread's CPU time within it, min / median of N gets, for a tiny
spec (8 KiB chunks: the cost is the cache's own) and the bench's disk spec (8 MiB chunks).
docs/benchmarks.md, "Disk gets as one batch".

    python docs/scripts/disk_gets.py [N]
"""

import asyncio
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import musacache as mc


async def gets(spec: mc.KVSpec, n: int) -> tuple[list[float], list[float]]:
    tokens = 8 * 256
    kv = torch.randn(spec.shape(tokens)).to(spec.dtype)
    toks = np.arange(tokens, dtype=np.int32)
    with tempfile.TemporaryDirectory() as path:
        cfg = mc.CacheConfig(spec, "disk-gets", chunk_size=256, tiers=(
            mc.HostTier(capacity_bytes=spec.nbytes(tokens)),
            mc.DiskTier(path=path, capacity_bytes=spec.nbytes(tokens) * 2, codec="lz4")))
        async with mc.Cache(cfg) as c:
            eng = c._engine
            top = eng.mem[0]
            await c.put(toks, kv)
            out = torch.empty_like(kv)
            wall, cpu = [], []
            for i in range(n + 2):
                await eng.evict(top, len(top.lru))  # the chunks are on disk only
                await c.flush()
                c0, t0 = time.thread_time(), time.perf_counter()
                hit = await c.get(toks, out=out)
                t1, c1 = time.perf_counter(), time.thread_time()
                if hit.tiers.get("disk") != tokens:
                    raise RuntimeError(f"served {hit.tiers}, not {tokens} tokens from disk")
                await c.flush()  # the background promotions, outside the timing
                if i >= 2:
                    wall.append(t1 - t0)
                    cpu.append(c1 - c0)
            if not torch.equal(out.view(torch.uint8), kv.view(torch.uint8)):
                raise RuntimeError("the get returned other bytes than were put")
    return wall, cpu


def fmt(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.2f} / {statistics.median(xs) * 1e3:.2f} ms"


async def main(n: int) -> None:
    for name, spec in (("tiny, 8 KiB chunks", mc.KVSpec(1, 1, 8, torch.bfloat16)),
                       ("8 MiB chunks", mc.KVSpec(8, 8, 128, torch.bfloat16))):
        wall, cpu = await gets(spec, n)
        print(f"{name}: get {fmt(wall)}, loop CPU {fmt(cpu)} (min / median of {n})")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
