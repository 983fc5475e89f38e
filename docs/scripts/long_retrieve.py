"""The time of a retrieve of one long prompt held by the host tier into host vLLM pages
(random blocks): the bench's tiny spec at CHUNKS chunks, and a model-sized spec (8 layers,
8 KV heads of 128, bf16; 256-token chunks, 16-token pages) next to a bare native scatter of
the same rows from one dense tensor (``transfer.scatter``) in the same run. Min and median
of REPEATS. docs/benchmarks.md, "A long get by slot address" (fifteenth round).

    python docs/scripts/long_retrieve.py [CHUNKS] [REPEATS]
"""

import asyncio
import statistics
import sys
import time

import numpy as np
import torch

import musacache as mc
from musacache import transfer
from musacache.bench import scale as S


def _ms(xs: list[float]) -> str:
    return f"min {min(xs) * 1e3:.2f} ms, median {statistics.median(xs) * 1e3:.2f} ms"


def _pages(spec: mc.KVSpec, tokens: int, block: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    nblocks = 2 * tokens // block
    pages = [torch.zeros(2, nblocks, block, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)
             for _ in range(spec.num_layers)]
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randperm(nblocks, generator=gen)[: tokens // block]
    slots = (blocks[:, None] * block + torch.arange(block)).reshape(-1).to(torch.int64)
    return pages, slots


async def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    tokens = n * S.CH
    pages, slots = _pages(S.TINY, tokens, 16)
    (b,) = S._prompts(np.random.default_rng(1), 1, n)
    async with S._tiny_cache(n) as c:
        await c.put(b, torch.zeros(S.TINY.shape(tokens), dtype=S.TINY.dtype))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert await c.retrieve(b, pages, slots, layout="vllm") == tokens
            times.append(time.perf_counter() - t0)
        print(f"tiny spec, retrieve of {n} chunks: {_ms(times)}, "
              f"{min(times) / n * 1e6:.2f} us a chunk")
    spec = mc.KVSpec(8, 8, 128, torch.bfloat16)
    chunk, chunks = 256, 32
    tokens = chunk * chunks
    toks = np.arange(tokens, dtype=np.int32)
    big = torch.randn(spec.shape(tokens)).to(spec.dtype)
    pages, slots = _pages(spec, tokens, 16)
    cfg = mc.CacheConfig(spec, "long-retrieve", chunk_size=chunk,
                         tiers=(mc.HostTier(capacity_bytes=spec.nbytes(tokens)),))
    async with mc.Cache(cfg) as c:
        await c.put(toks, big)
        ret_s, bare_s = [], []
        for _ in range(repeats):  # alternated: a burst of other work lands on both
            t0 = time.perf_counter()
            assert await c.retrieve(toks, pages, slots, layout="vllm") == tokens
            ret_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            transfer.scatter(big, pages, slots, "vllm")
            bare_s.append(time.perf_counter() - t0)
    mib = spec.nbytes(tokens) / 2**20
    print(f"{spec.describe()}, {chunks} chunks of {chunk} tokens ({mib:.0f} MiB): retrieve "
          f"{_ms(ret_s)}; a bare native scatter of the same rows {_ms(bare_s)}; ratio "
          f"(scatter / retrieve) {min(bare_s) / min(ret_s):.2f} (min), "
          f"{statistics.median(bare_s) / statistics.median(ret_s):.2f} (median)")


asyncio.run(main())
