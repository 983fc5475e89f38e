"""``musacache bench codec``: the cold-tier chunk codec on Gaussian bf16 KV, in one run.

Three ways to store a chunk, each timed on one thread (compress, decompress, and both):

- ``raw``: the chunk format without compression (header, per-block crc32, a copy);
- ``plain-lz4``: lz4 on the unshuffled bytes, in the same 1 MiB blocks (no format around it);
- ``shuffle-lz4``: the ``lz4`` codec (native byte-shuffle, then per block the native nibble
  table coder, lz4 or raw, crc32c, header).

Goals for ``shuffle-lz4`` on one thread: ratio >= 1.15 and >= 0.8 GB/s for compress plus
decompress together. Decompression writes into a preallocated tensor (as into a host-tier slot);
``decompress_alloc`` is the same with a fresh tensor per call, whose page faults are part of
the cost. ``--threads N`` adds runs with N block threads. Every figure is the best of
``--repeats`` after a warm-up; compare figures of one run, not across machines.

The default chunk is 32 layers x 2 x 256 tokens x 8 heads x 128 dims of bf16 (32 MiB).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import lz4.block
import numpy as np
import torch

from .._keys import Fingerprint, KeyChain
from .._spec import KVSpec, dtype_from_name
from ..codec import DEFAULT_BLOCK_SIZE, decode_chunk, encode_chunk
from ..tiers.base import ChunkMeta
from . import emit

GOAL_RATIO = 1.15
GOAL_BOTH_GBPS = 0.8


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="musacache bench codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens in the chunk")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=0,
                   help="also time shuffle-lz4 with N block threads (0: skip)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the best is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first touch of pages, lazy imports, scratch buffers
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _plain_lz4(raw: memoryview) -> tuple[Callable[[], object], Callable[[], object], int]:
    blocks = [raw[i : i + DEFAULT_BLOCK_SIZE] for i in range(0, len(raw), DEFAULT_BLOCK_SIZE)]
    packed = [lz4.block.compress(b, store_size=False) for b in blocks]

    def compress() -> object:
        return [lz4.block.compress(b, store_size=False) for b in blocks]

    def decompress() -> object:
        return [lz4.block.decompress(p, uncompressed_size=len(b)) for p, b in zip(packed, blocks)]

    return compress, decompress, sum(map(len, packed))


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = KVSpec(args.layers, args.heads, args.head_dim, dtype_from_name(args.dtype))
    fp = Fingerprint("bench-codec", spec, args.tokens)
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randn(spec.shape(args.tokens), generator=gen).to(spec.dtype)
    chain = KeyChain(fp)
    meta = ChunkMeta(key=chain.child(chain.seed, b"bench"), parent=chain.seed,
                     num_tokens=args.tokens, raw_bytes=spec.nbytes(args.tokens))
    nbytes = spec.nbytes(args.tokens)
    out = torch.empty_like(data).fill_(0)
    results: dict[str, Any] = {
        "chunk": {"shape": list(spec.shape(args.tokens)), "dtype": str(spec.dtype),
                  "bytes": nbytes},
        "codecs": {},
    }

    def record(name: str, stored: int, t_c: float, t_d: float,
               t_d_alloc: float | None = None) -> None:
        row = {"ratio": nbytes / stored, "compress_gbps": nbytes / t_c / 1e9,
               "decompress_gbps": nbytes / t_d / 1e9,
               "both_gbps": nbytes / (t_c + t_d) / 1e9}
        if t_d_alloc is not None:
            row["decompress_alloc_gbps"] = nbytes / t_d_alloc / 1e9
        results["codecs"][name] = row

    # memcpy of the same bytes: the yardstick for every other figure of this run.
    t_copy = _best_seconds(lambda: out.copy_(data), args.repeats)
    results["memcpy_gbps"] = nbytes / t_copy / 1e9

    raw_obj = encode_chunk(fp, meta, data, "raw")
    record("raw", len(raw_obj),
           _best_seconds(lambda: encode_chunk(fp, meta, data, "raw"), args.repeats),
           _best_seconds(lambda: decode_chunk(fp, raw_obj, out=out), args.repeats),
           _best_seconds(lambda: decode_chunk(fp, raw_obj), args.repeats))

    flat = data.reshape(-1).view(torch.uint8).numpy()
    compress, decompress, stored = _plain_lz4(memoryview(flat.data))
    record("plain-lz4", stored, _best_seconds(compress, args.repeats),
           _best_seconds(decompress, args.repeats))

    def shuffled(threads: int) -> None:
        obj = encode_chunk(fp, meta, data, "lz4", threads=threads)
        t_c = _best_seconds(lambda: encode_chunk(fp, meta, data, "lz4", threads=threads),
                            args.repeats)
        t_d = _best_seconds(lambda: decode_chunk(fp, obj, out=out, threads=threads),
                            args.repeats)
        t_a = _best_seconds(lambda: decode_chunk(fp, obj, threads=threads), args.repeats)
        if not torch.equal(out.view(torch.uint8), data.view(torch.uint8)):
            raise SystemExit("shuffle-lz4 did not round-trip: this is a bug")
        record("shuffle-lz4" if threads == 1 else f"shuffle-lz4-{threads}threads", len(obj),
               t_c, t_d, t_a)

    results["crc32c"] = _crc_paths(flat, args.repeats)
    shuffled(1)
    if args.threads > 1:
        shuffled(args.threads)
    best = results["codecs"]["shuffle-lz4"]
    results["goals"] = {
        "ratio": {"goal": GOAL_RATIO, "got": best["ratio"], "met": best["ratio"] >= GOAL_RATIO},
        "both_gbps_one_thread": {"goal": GOAL_BOTH_GBPS, "got": best["both_gbps"],
                                 "met": best["both_gbps"] >= GOAL_BOTH_GBPS},
    }
    return results


def _crc_paths(flat: np.ndarray, repeats: int) -> dict[str, dict[str, float]]:
    """CRC-32C in GB/s at each SIMD level this CPU has, on one 1 MiB block (the format's
    block: in the L2 cache, as a read checks it) and on the whole chunk (from memory). The
    levels pick the path: ``avx512`` folds by carry-less multiplies, ``sse2``/``avx2`` run
    three crc32 chains, ``none`` a table."""
    from .. import _native

    block = memoryview(flat.data)[: 1 << 20]
    whole = memoryview(flat.data)
    before = _native.get_simd_level()
    levels = _native.SIMD_LEVELS[: _native.SIMD_LEVELS.index(_native.max_simd_level()) + 1]
    out: dict[str, dict[str, float]] = {}
    try:
        for level in levels:
            _native.set_simd_level(level)
            t_block = _best_seconds(lambda: [_native.crc32c(block) for _ in range(16)], repeats)
            t_whole = _best_seconds(lambda: _native.crc32c(whole), repeats)
            out[level] = {"block_gbps": 16 * len(block) / t_block / 1e9,
                          "chunk_gbps": len(whole) / t_whole / 1e9}
    finally:
        _native.set_simd_level(before)
    return out


def _print(results: dict[str, Any]) -> None:
    chunk = results["chunk"]
    print(f"chunk {tuple(chunk['shape'])} {chunk['dtype']}: {chunk['bytes'] / 2**20:.1f} MiB; "
          f"memcpy {results['memcpy_gbps']:.2f} GB/s")
    print(f"{'codec':<26}{'ratio':>7}{'compress':>10}{'decomp':>9}{'both':>8}"
          f"{'decomp+alloc':>14}   (GB/s of raw bytes)")
    for name, row in results["codecs"].items():
        alloc = row.get("decompress_alloc_gbps")
        print(f"{name:<26}{row['ratio']:>7.3f}{row['compress_gbps']:>10.2f}"
              f"{row['decompress_gbps']:>9.2f}{row['both_gbps']:>8.2f}"
              f"{'' if alloc is None else f'{alloc:.2f}':>14}")
    print("crc32c by SIMD level, GB/s on a 1 MiB block (cached) / on the chunk: " + "; ".join(
        f"{lvl} {r['block_gbps']:.1f} / {r['chunk_gbps']:.1f}"
        for lvl, r in results["crc32c"].items()))
    for name, goal in results["goals"].items():
        verdict = "met" if goal["met"] else "NOT met"
        print(f"goal {name}: {goal['got']:.3f} (goal {goal['goal']}) {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return emit(run(args), args.json, _print)


if __name__ == "__main__":
    raise SystemExit(main())
