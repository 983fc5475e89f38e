"""``musacache bench ipc``: a worker's store through the node server, zero-copy against bytes.

One run, one server (a subprocess), one worker (this process):

* **zero-copy**: the worker's paged KV (vllm layout, in shared memory) is registered once;
  ``store`` sends tokens and slots, the server gathers straight from the pages into its tier.
* **baseline**: the worker gathers the same KV into a buffer, sends the bytes over the same
  socket in 32 MiB frames, and the server copies them into a staging tensor and ``put``s it.

It prints both times, their ratio, and the bytes each path copied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from musacache.server.client import connect
from musacache.server.spawn import SpawnedServer, spawn

from .. import ipc, transfer
from .._spec import KVSpec
from .cache import positive_int

_FRAME = 32 * 1024**2


def _progress(text: str) -> None:
    """Progress on stderr, so ``--json`` stdout stays one JSON object."""
    print(f"bench ipc: {text}", file=sys.stderr, flush=True)


def _start_server(tmp: Path, spec: KVSpec, capacity: int) -> tuple[SpawnedServer, str]:
    cfg = tmp / "server.toml"
    cfg.write_text(
        f'namespace = "bench-ipc"\n[spec]\nnum_layers = {spec.num_layers}\n'
        f"num_kv_heads = {spec.num_kv_heads}\nhead_dim = {spec.head_dim}\n"
        f'dtype = "bfloat16"\n[[tiers]]\nkind = "host"\ncapacity = {capacity}\n'
        # the byte baseline stages a whole prompt at once
        f"[server]\nmax_stage_bytes = {max(capacity, 1)}\n")
    sock = str(tmp / "run" / "bench.sock")
    return spawn(cfg, sock), sock


async def _run(tokens: int, repeats: int) -> dict[str, Any]:
    spec = KVSpec(32, 8, 128, torch.bfloat16)
    block = 16
    nblocks = (tokens + block - 1) // block + 8
    nbytes = spec.nbytes(tokens)
    with tempfile.TemporaryDirectory() as tmp:
        _progress("starting the node server")
        proc, sock = _start_server(Path(tmp), spec, capacity=int(nbytes * 1.2))
        try:
            _progress(f"filling {spec.num_layers} layers of paged KV "
                      f"({nbytes / 1024**3:.2f} GiB to store per run)")
            pages = [ipc.empty_shared((2, nblocks, block, 8, 128), spec.dtype)
                     for _ in range(spec.num_layers)]
            for p in pages:
                p.view(torch.int16).random_()
            perm = torch.randperm(nblocks)[: (tokens + block - 1) // block]
            slots = (perm.repeat_interleave(block) * block
                     + torch.arange(block).repeat(len(perm)))[:tokens].contiguous()
            async with connect(sock, spec=spec, namespace="bench-ipc", timeout=600) as c:
                await c.register_kv_caches(pages, "vllm")
                zero: list[float] = []
                base: list[float] = []
                copied_zero = copied_base = 0
                gather_s: list[float] = []
                for r in range(repeats):
                    _progress(f"run {r + 1}/{repeats}: zero-copy store")
                    toks = torch.arange(tokens) + r * 10_000_000
                    ready = ipc.IpcEvent.create("cpu")
                    ready.set()
                    before = (await c.stats())["server"]["bytes_copied"]
                    t0 = time.perf_counter()
                    n = await c.store(toks, slots, ready=ready)
                    zero.append(time.perf_counter() - t0)
                    copied_zero = (await c.stats())["server"]["bytes_copied"] - before
                    ready.close()
                    if n != tokens:
                        raise RuntimeError(f"store kept {n} of {tokens} tokens")
                    await c.delete(toks)

                    _progress(f"run {r + 1}/{repeats}: baseline, bytes through the socket")
                    toks = toks + 5_000_000
                    before = (await c.stats())["server"]["bytes_copied"]
                    t0 = time.perf_counter()
                    buf = torch.empty(spec.shape(tokens), dtype=spec.dtype)
                    g0 = time.perf_counter()
                    await asyncio.to_thread(transfer.gather, pages, slots, buf, "vllm")
                    gather_s.append(time.perf_counter() - g0)
                    raw = buf.view(-1).view(torch.uint8).numpy()
                    window = asyncio.Semaphore(4)  # several frames in flight, as a fair baseline

                    async def send(off: int, window: asyncio.Semaphore = window,
                                   raw: Any = raw) -> None:
                        async with window:
                            piece = raw[off:off + _FRAME].tobytes()  # serialised for the socket
                            await c._call("stage_bytes", {"total": nbytes, "offset": off,
                                                          "data": piece})

                    await asyncio.gather(*(send(off) for off in range(0, nbytes, _FRAME)))
                    n = await c._call("put_staged", {"tokens": toks.int().numpy().tobytes()})
                    base.append(time.perf_counter() - t0)
                    # worker gather + bytes through the socket, then what the server copied
                    copied_base = nbytes + nbytes + (
                        (await c.stats())["server"]["bytes_copied"] - before)
                    if n != tokens:
                        raise RuntimeError(f"baseline put kept {n} of {tokens} tokens")
                    await c.delete(toks)
            _progress("timing a bare socket transfer of the same bytes")
            raw_socket_s = _raw_socket_seconds(nbytes, min(gather_s))
        finally:
            proc.stop(30)
    return {"raw_socket_s": raw_socket_s, "raw_socket_ratio": raw_socket_s / min(zero),
            "tokens": tokens, "bytes": nbytes, "zero_copy_s": min(zero),
            "baseline_s": min(base), "ratio": min(base) / min(zero),
            "zero_copy_GBps": nbytes / min(zero) / 1e9, "baseline_GBps": nbytes / min(base) / 1e9,
            "bytes_copied_zero_copy": copied_zero, "bytes_copied_baseline": copied_base,
            "worker_gather_s": min(gather_s), "cpu_count": os.cpu_count()}


def _sink(sock: socket.socket, nbytes: int) -> None:
    """Receive ``nbytes`` into one preallocated buffer: the least any socket path must do."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    sock.sendall(b"r")  # ready: the timing must not include this process's start-up
    got = 0
    while got < nbytes:
        got += sock.recv_into(view[got:], min(nbytes - got, 8 * 1024**2))
    sock.sendall(b"k")


def _raw_socket_seconds(nbytes: int, gather_s: float) -> float:
    """Best case for sending bytes: the worker's gather plus a bare socket transfer between
    two processes, with no framing or serialisation at all."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = socket.socketpair()
    child = ctx.Process(target=_sink, args=(b, nbytes))
    child.start()
    payload = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
    a.recv(1)
    t0 = time.perf_counter()
    a.sendall(payload)
    a.recv(1)
    elapsed = time.perf_counter() - t0
    child.join(30)
    a.close()
    b.close()
    return gather_s + elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musacache bench ipc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="prompt length; 8192 tokens of 32x8x128 bf16 = 1 GiB")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = asyncio.run(_run(args.tokens, args.repeats))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    gib = res["bytes"] / 1024**3
    print(f"store of {res['tokens']} tokens ({gib:.2f} GiB) from a worker to the node server")
    gib_zero = res["bytes_copied_zero_copy"] / 1024**3
    gib_base = res["bytes_copied_baseline"] / 1024**3
    print(f"  zero-copy (memory IPC + event):  {res['zero_copy_s'] * 1e3:8.1f} ms  "
          f"{res['zero_copy_GBps']:6.2f} GB/s  copied {gib_zero:.2f} GiB")
    print(f"  baseline (bytes over socket):    {res['baseline_s'] * 1e3:8.1f} ms  "
          f"{res['baseline_GBps']:6.2f} GB/s  copied {gib_base:.2f} GiB")
    print(f"  time ratio baseline/zero-copy: {res['ratio']:.2f}x  (goal >= 2x)")
    print(f"  bound for any byte path (gather + a bare socket, no framing): "
          f"{res['raw_socket_s'] * 1e3:.1f} ms, {res['raw_socket_ratio']:.2f}x the zero-copy time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
