"""``musacache bench cache``: the embedded cache's host tier against plain torch copies.

Reports, in one run: put and get throughput as a ratio to ``copy_`` of the same bytes,
``lookup`` time for a long prompt, and the largest event-loop gap during a large put and get.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import torch

from musacache import Cache, CacheConfig, HostTier, KVSpec


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def _abest(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def run(tokens: int, lookup_tokens: int, gap_mib: int, repeats: int) -> dict[str, Any]:
    spec = KVSpec(32, 8, 128, torch.bfloat16)
    nbytes = spec.nbytes(tokens)
    kv = torch.empty(spec.shape(tokens), dtype=spec.dtype)
    kv.view(torch.int16).random_()
    toks = torch.arange(tokens)
    dst = torch.empty_like(kv)
    dst.copy_(kv)  # touch every page once, so neither side pays first-touch faults

    copy_s = _best(lambda: dst.copy_(kv), repeats)
    res: dict[str, Any] = {"tokens": tokens, "bytes": nbytes, "threads": torch.get_num_threads(),
                           "copy_GBps": _gbps(nbytes, copy_s)}
    cfg = CacheConfig(spec, "bench", tiers=(HostTier(capacity_bytes=nbytes + spec.nbytes(256)),))
    async with Cache(cfg) as cache:
        await cache.put(toks, kv)  # warm the pool's pages

        async def put() -> None:
            await cache.delete(toks)  # frees the slots; the next put reuses them
            await cache.put(toks, kv)

        # delete costs microseconds; timing it with the put makes the ratio conservative.
        put_s = await _abest(put, repeats)
        out = torch.empty_like(kv)
        out.copy_(kv)

        async def get_out() -> None:
            hit = await cache.get(toks, out=out)
            if hit.num_tokens != tokens:
                raise RuntimeError("bench: the prompt should be fully cached")

        get_s = await _abest(get_out, repeats)

        async def get_alloc() -> None:
            await cache.get(toks)

        get_alloc_s = await _abest(get_alloc, repeats)
        alloc_copy_s = _best(lambda: torch.empty_like(kv).copy_(kv), repeats)
        if not torch.equal(out.view(torch.int16), kv.view(torch.int16)):
            raise RuntimeError("bench: get returned different bytes")
    res.update({
        "put_GBps": _gbps(nbytes, put_s), "put_ratio": copy_s / put_s,
        "get_out_GBps": _gbps(nbytes, get_s), "get_out_ratio": copy_s / get_s,
        "get_alloc_GBps": _gbps(nbytes, get_alloc_s),
        "alloc_copy_GBps": _gbps(nbytes, alloc_copy_s),
        "get_alloc_ratio": alloc_copy_s / get_alloc_s,
    })

    # Short gets at the same spec: one full chunk, and a tail of 16 tokens, each against a
    # copy_ of its own bytes. Here the per-request cost shows, not the bus.
    for n in (256, 16):
        part = kv[:, :, :n].clone()
        part_out = torch.empty_like(part)
        part_toks = torch.arange(10_000_000, 10_000_000 + n)
        part_cfg = CacheConfig(spec, f"bench-{n}", tiers=(HostTier(capacity_bytes="64MiB"),))
        async with Cache(part_cfg) as cache:
            await cache.put(part_toks, part)
            gets, copies = [], []
            for _ in range(max(50, repeats * 20)):
                t0 = time.perf_counter()
                hit = await cache.get(part_toks, out=part_out)
                t1 = time.perf_counter()
                part_out.copy_(part)
                copies.append(time.perf_counter() - t1)
                gets.append(t1 - t0)
                if hit.num_tokens != n:
                    raise RuntimeError("bench: the short prompt should be fully cached")
        res.update({f"get{n}_us_min": min(gets) * 1e6,
                    f"get{n}_us_median": statistics.median(gets) * 1e6,
                    f"copy{n}_us_min": min(copies) * 1e6,
                    f"get{n}_time_ratio": min(gets) / min(copies)})

    # lookup cost does not depend on the spec: use a tiny one to fit 131072 tokens.
    small = KVSpec(1, 1, 8, torch.float16)
    long_toks = torch.randint(0, 128000, (lookup_tokens,))
    small_cfg = CacheConfig(small, "bench-lookup",
                            tiers=(HostTier(capacity_bytes=small.nbytes(lookup_tokens) * 2),))
    async with Cache(small_cfg) as cache:
        await cache.put(long_toks, torch.zeros(small.shape(lookup_tokens), dtype=small.dtype))
        times = []
        for _ in range(max(20, repeats * 5)):
            t0 = time.perf_counter()
            n = await cache.lookup(long_toks)
            times.append(time.perf_counter() - t0)
        if n != lookup_tokens:
            raise RuntimeError("bench: lookup should see the whole prompt")
        miss = long_toks.clone()
        miss[0] += 1
        t0 = time.perf_counter()
        await cache.lookup(miss)
        miss_s = time.perf_counter() - t0
    res.update({"lookup_tokens": lookup_tokens, "lookup_ms_min": min(times) * 1e3,
                "lookup_ms_median": statistics.median(times) * 1e3,
                "lookup_miss_ms": miss_s * 1e3})

    # The loop's largest gap while a large put and get run.
    gap_tokens = gap_mib * 1024**2 // spec.bytes_per_token
    big = torch.empty(spec.shape(gap_tokens), dtype=spec.dtype)
    big.view(torch.int16).random_()
    gaps: list[float] = []
    cfg = CacheConfig(spec, "bench-gap", tiers=(HostTier(capacity_bytes=spec.nbytes(gap_tokens)),))
    async with Cache(cfg) as cache:
        done = asyncio.Event()

        async def heartbeat() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        hb = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await cache.put(torch.arange(gap_tokens), big)
        await cache.get(torch.arange(gap_tokens))
        elapsed = time.perf_counter() - t0
        done.set()
        await hb
    res.update({"gap_MiB": gap_mib, "gap_put_get_s": elapsed, "max_loop_gap_ms": max(gaps) * 1e3,
                "heartbeats": len(gaps)})
    return res


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (0 or a negative count would time nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musacache bench cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="prompt length for put/get (32 layers, 8 heads, 128 dim, bf16)")
    p.add_argument("--lookup-tokens", type=positive_int, default=131072)
    p.add_argument("--gap-mib", type=positive_int, default=512,
                   help="size of the put/get for the loop gap")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--json", action="store_true", help="print machine-readable results")
    args = p.parse_args(argv)
    res = asyncio.run(run(args.tokens, args.lookup_tokens, args.gap_mib, args.repeats))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    mib = res["bytes"] / 1024**2
    print(f"host tier, {res['tokens']} tokens = {mib:.0f} MiB, torch threads={res['threads']}")
    print(f"  torch copy_ (preallocated)  {res['copy_GBps']:7.2f} GB/s")
    print(f"  cache.put                   {res['put_GBps']:7.2f} GB/s   ratio "
          f"{res['put_ratio']:.2f}  (goal >= 0.9)")
    print(f"  cache.get(out=...)          {res['get_out_GBps']:7.2f} GB/s   ratio "
          f"{res['get_out_ratio']:.2f}  (goal >= 0.9)")
    print(f"  cache.get() allocating      {res['get_alloc_GBps']:7.2f} GB/s   ratio "
          f"{res['get_alloc_ratio']:.2f} vs empty_like+copy_ {res['alloc_copy_GBps']:.2f} GB/s")
    for n, goal in ((256, "<= 1.18x, i.e. >= 0.85 of copy_ speed"), (16, "<= 1.5x")):
        print(f"  get(out=) of {n:3d} tokens   min {res[f'get{n}_us_min']:7.1f} us, median "
              f"{res[f'get{n}_us_median']:7.1f} us; copy_ {res[f'copy{n}_us_min']:7.1f} us; "
              f"time ratio {res[f'get{n}_time_ratio']:.2f}x  (goal {goal})")
    print(f"lookup, {res['lookup_tokens']} tokens cached: min {res['lookup_ms_min']:.2f} ms, "
          f"median {res['lookup_ms_median']:.2f} ms (goal < 2 ms); "
          f"miss {res['lookup_miss_ms']:.2f} ms")
    print(f"event loop during a {res['gap_MiB']} MiB put+get ({res['gap_put_get_s'] * 1e3:.0f} ms):"
          f" largest gap {res['max_loop_gap_ms']:.1f} ms over {res['heartbeats']} heartbeats")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
