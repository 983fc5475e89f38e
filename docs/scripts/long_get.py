"""The time of a get of one long prompt held by the host tier: the bench's tiny spec at
CHUNKS chunks (directory work dominates), and a model-sized spec (8 layers, 8 KV heads of
128, bf16; 256-token chunks) next to a torch ``copy_`` of the same bytes into the same
``out`` in the same run. Min and median of REPEATS. docs/benchmarks.md, "A long get by slot
address" (fifteenth round).

    python docs/scripts/long_get.py [CHUNKS] [REPEATS]
"""

import asyncio
import statistics
import sys
import time

import numpy as np
import torch

import musacache as mc
from musacache.bench import scale as S


def _ms(xs: list[float]) -> str:
    return f"min {min(xs) * 1e3:.2f} ms, median {statistics.median(xs) * 1e3:.2f} ms"


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    kv = torch.zeros(S.TINY.shape(n * S.CH), dtype=S.TINY.dtype)
    out = torch.empty_like(kv)
    (b,) = S._prompts(np.random.default_rng(1), 1, n)
    async with S._tiny_cache(n) as c:
        await c.put(b, kv)
        for name, op in (("get", lambda: c.get(b)), ("get(out=)", lambda: c.get(b, out=out))):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                hit = await op()
                times.append(time.perf_counter() - t0)
                assert hit.num_tokens == n * S.CH
            print(f"tiny spec, {name} of {n} chunks: {_ms(times)}, "
                  f"{min(times) / n * 1e6:.2f} us a chunk")
    spec = mc.KVSpec(8, 8, 128, torch.bfloat16)
    chunk, chunks = 256, 32
    toks = np.arange(chunk * chunks, dtype=np.int32)
    big = torch.randn(spec.shape(len(toks))).to(spec.dtype)
    dst = torch.empty_like(big)
    cfg = mc.CacheConfig(spec, "long-get", chunk_size=chunk,
                         tiers=(mc.HostTier(capacity_bytes=spec.nbytes(len(toks))),))
    async with mc.Cache(cfg) as c:
        await c.put(toks, big)
        get_s, copy_s = [], []
        for _ in range(repeats):  # alternated: a burst of other work lands on both
            t0 = time.perf_counter()
            hit = await c.get(toks, out=dst)
            get_s.append(time.perf_counter() - t0)
            assert hit.num_tokens == len(toks)
            t0 = time.perf_counter()
            dst.copy_(big)
            copy_s.append(time.perf_counter() - t0)
        assert torch.equal((await c.get(toks)).kv.view(torch.int16), big.view(torch.int16))
    mib = spec.nbytes(len(toks)) / 2**20
    print(f"{spec.describe()}, {chunks} chunks of {chunk} tokens ({mib:.0f} MiB): get(out=) "
          f"{_ms(get_s)}; torch copy_ of the same bytes {_ms(copy_s)}; ratio (copy / get) "
          f"{min(copy_s) / min(get_s):.2f} (min), "
          f"{statistics.median(copy_s) / statistics.median(get_s):.2f} (median)")


asyncio.run(main())
