"""``musacache bench tiers``: the S3 tier against raw aiobotocore, same bytes, same concurrency.

``--objects`` encoded chunks (Gaussian bf16, the ``lz4`` codec; by default a 32 MiB chunk of
32 layers x 2 x 256 tokens x 8 heads x 128 dims) are written and read back through
:class:`~musacache.tiers.s3.S3Store`, and the same bytes through a bare aiobotocore client
(``put_object``/``get_object``) with the same client settings and ``--concurrency``. The
verdict is the ratio store/raw of each (goal: >= 0.9, the tier adds little over the SDK).
``--multipart`` also times the store with multipart uploads and ranged parallel GETs.

With no ``--endpoint-url`` it starts a one-node OpenStack Swift with s3api in a temporary folder
(see ``.ci/swift-install.sh``), and stops it at the end. Every figure is the best of
``--repeats``; phases alternate their order so neither side always runs first.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import torch

from .._keys import Fingerprint
from .._spec import KVSpec, dtype_from_name
from ..codec import encode_chunk
from ..tiers.base import ChunkMeta, TierContext
from ..tiers.s3 import S3Store, S3Tier
from . import emit
from .cache import positive_int

GOAL_RATIO = 0.9


def _progress(text: str) -> None:
    """Progress on stderr, so ``--json`` stdout stays one JSON object."""
    print(f"bench tiers: {text}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="musacache bench tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint-url", default=None,
                   help="an S3 endpoint (default: start a local Swift)")
    p.add_argument("--bucket", default=None, help="default: a new bucket per run")
    p.add_argument("--access-key", default=None)
    p.add_argument("--secret-key", default=None)
    p.add_argument("--region", default=None)
    p.add_argument("--objects", type=positive_int, default=8, help="objects per phase")
    p.add_argument("--concurrency", type=positive_int, default=4)
    p.add_argument("--layers", type=positive_int, default=32)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--tokens", type=positive_int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--multipart", action="store_true",
                   help="also time multipart uploads + ranged GETs (parts of --part-size)")
    p.add_argument("--part-size", default="8MiB")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs; the best is kept")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


async def _timed(jobs: list[Callable[[], Awaitable[object]]], concurrency: int) -> float:
    limiter = anyio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[object]]) -> None:
        async with limiter:
            await job()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(one, job)
    return time.perf_counter() - start


async def _raw_put(client: Any, bucket: str, name: str, obj: bytes) -> None:
    await client.put_object(Bucket=bucket, Key=name, Body=obj)


async def _raw_get(client: Any, bucket: str, name: str) -> bytes:
    response = await client.get_object(Bucket=bucket, Key=name)
    async with response["Body"] as body:
        return bytes(await body.read())


async def _bench(args: argparse.Namespace, endpoint: str, access_key: str | None,
                 secret_key: str | None) -> dict[str, Any]:
    from aiobotocore.session import get_session

    spec = KVSpec(args.layers, args.heads, args.head_dim, dtype_from_name(args.dtype))
    fp = Fingerprint("bench-tiers", spec, args.tokens)
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(spec.shape(args.tokens), generator=gen).to(spec.dtype)
    parent = hashlib.blake2b(b"bench-parent", digest_size=32).digest()

    def meta_of(tag: str) -> ChunkMeta:
        return ChunkMeta(hashlib.blake2b(tag.encode(), digest_size=32).digest(), parent,
                         args.tokens, spec.nbytes(args.tokens))

    obj = await anyio.to_thread.run_sync(
        lambda: encode_chunk(fp, meta_of("template"), data, "lz4"))
    bucket = args.bucket or f"mc-bench-{uuid.uuid4().hex[:12]}"
    common: dict[str, Any] = {"bucket": bucket, "endpoint_url": endpoint, "region": args.region,
                              "access_key_id": access_key, "secret_access_key": secret_key,
                              "max_concurrency": args.concurrency, "create_bucket": True,
                              "timeout": 120.0, "read_timeout": 120.0, "write_timeout": 120.0}
    stores: dict[str, S3Store] = {"store": S3Tier(**common).build()}
    if args.multipart:
        stores["store-multipart"] = S3Tier(multipart_threshold=args.part_size,
                                           part_size=args.part_size, **common).build()
    ctx = TierContext(fp)
    for store in stores.values():
        await store.start(ctx)
    base = stores["store"]
    # The same client settings as the store's (path-style, no botocore retries, no payload
    # hashing, no CRC trailers), so the ratio measures the tier and nothing else.
    raw_cm = get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=args.region or "us-east-1",
        aws_access_key_id=access_key, aws_secret_access_key=secret_key,
        config=base.client.meta.config)
    best: dict[str, dict[str, float]] = {}
    try:
        async with raw_cm as raw:
            for rep in range(args.repeats):
                phases: list[tuple[str, S3Store | None]] = [("raw", None), *stores.items()]
                if rep % 2:
                    phases.reverse()
                for name, phase_store in phases:
                    _progress(f"run {rep + 1}/{args.repeats}: {name}, {args.objects} puts "
                              f"then gets")
                    metas = [meta_of(f"{name}-{rep}-{i}") for i in range(args.objects)]
                    names = [base.object_name(m.key, m.parent, m.num_tokens) for m in metas]
                    if phase_store is None:
                        put = await _timed([partial(_raw_put, raw, bucket, n, obj)
                                            for n in names], args.concurrency)
                        get = await _timed([partial(_raw_get, raw, bucket, n) for n in names],
                                           args.concurrency)
                    else:
                        put = await _timed([partial(phase_store.write, m, obj) for m in metas],
                                           args.concurrency)
                        # stored_bytes as a listing would report it: it picks ranged GETs.
                        sized = [ChunkMeta(m.key, m.parent, m.num_tokens, m.raw_bytes,
                                           stored_bytes=len(obj)) for m in metas]
                        get = await _timed([partial(phase_store.read, m) for m in sized],
                                           args.concurrency)
                    total = len(obj) * args.objects
                    row = best.setdefault(name, {"put_mbps": 0.0, "get_mbps": 0.0})
                    row["put_mbps"] = max(row["put_mbps"], total / put / 1e6)
                    row["get_mbps"] = max(row["get_mbps"], total / get / 1e6)
                    for n in names:  # keep the server's disk use bounded
                        await raw.delete_object(Bucket=bucket, Key=n)
    finally:
        for store in stores.values():
            await store.aclose()
    results: dict[str, Any] = {
        "endpoint": endpoint, "object_bytes": len(obj), "objects": args.objects,
        "concurrency": args.concurrency, "repeats": args.repeats, "throughput": best,
        "ratio": {name: {"put": best[name]["put_mbps"] / best["raw"]["put_mbps"],
                         "get": best[name]["get_mbps"] / best["raw"]["get_mbps"]}
                  for name in stores},
    }
    store_ratio = results["ratio"]["store"]
    results["goal"] = {"goal": GOAL_RATIO, "met": min(store_ratio.values()) >= GOAL_RATIO}
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint_url:
        return anyio.run(_bench, args, args.endpoint_url, args.access_key, args.secret_key)
    from .._testing.swift import SwiftServer

    _progress("starting a local Swift with s3api (about 20 s; --endpoint-url skips this)")
    with SwiftServer() as swift:
        _progress(f"Swift is up at {swift.endpoint_url}")
        results = anyio.run(_bench, args, swift.endpoint_url, swift.access_key,
                            swift.secret_key)
    results["server"] = "swift (started by the benchmark)"
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"{results.get('server', results['endpoint'])}: {results['objects']} objects of "
          f"{results['object_bytes'] / 2**20:.1f} MiB, concurrency {results['concurrency']}, "
          f"best of {results['repeats']}")
    print(f"{'client':<18}{'put MB/s':>10}{'get MB/s':>10}{'put ratio':>11}{'get ratio':>11}")
    for name, row in results["throughput"].items():
        ratio = results["ratio"].get(name)
        tail = f"{ratio['put']:>11.2f}{ratio['get']:>11.2f}" if ratio else ""
        print(f"{name:<18}{row['put_mbps']:>10.1f}{row['get_mbps']:>10.1f}{tail}")
    goal = results["goal"]
    print(f"goal store/raw >= {goal['goal']}: {'met' if goal['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return emit(run(args), args.json, _print)


if __name__ == "__main__":
    raise SystemExit(main())
