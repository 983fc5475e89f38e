"""Part ``server`` of ``musacache bench scale``: the node server's goals.

One run starts the real ``musacache serve`` (:func:`musacache.server.spawn`) and a bare echo
server, each in its own process on a Unix socket, and times from this process:

* lookup latency (p50, p99) of a one-chunk prompt against an echo round trip of the same bytes;
* ops/s with N requests in flight on one connection: lookups and dense one-chunk gets (into
  a shared ``out`` buffer, reused as a worker reuses its buffers) against the echo's;
* the latency of a one-chunk put as the server's directory holds 1k to 1M chunks.

The echo is the plainest asyncio echo that can carry concurrent requests: a 4-byte length
prefix, an 8-byte request id, and as payload the exact bytes of a lookup request frame; the
server writes each frame back without decoding it, the client routes answers to waiting
futures by id. It is the floor of any asyncio round trip over this socket; everything
musacache adds (msgpack, validation, the cache) is counted against it.

Everything uses a tiny spec (1 layer, 1 KV head, head dim 8, fp16; 16-token chunks: 512 bytes
of KV per chunk), so a million chunks fit in 512 MiB and no byte copy hides the request path.
Each figure is the min and the median over the repeats (a latency: the repeat's p50 or p99).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from musacache.server.client import Client
from musacache.server.spawn import spawn

from .. import ipc
from .._spec import KVSpec
from ..ipc import _wire as proto

CH = 16
TINY = KVSpec(1, 1, 8, torch.float16)
_FILL_CHUNKS = 1024          # chunks per put while the directory is filled
_PUT_SAMPLES = 200           # timed one-chunk puts per repeat and size
_LAT_SAMPLES = 2000          # timed sequential requests per repeat
_OPS_PER_TASK = 200          # requests per concurrent task per repeat
TASKS = 32                   # requests in flight for the ops/s figures
ECHO_FORM = ("asyncio streams, 4-byte length prefix + 8-byte request id, payload = the bytes "
             "of a lookup request frame, written back undecoded; the client routes answers by "
             "id to futures, as musacache's client does")


# -- the echo ---------------------------------------------------------------------------------


def echo_main(path: str) -> None:
    """Serve the echo on ``path`` until killed (run in a process of its own)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(head, "big"))
                writer.write(head + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_unix_server(handle, path)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


class _EchoClient:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._task: asyncio.Task[None] | None = None

    async def open(self, path: str) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(path)
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        reader = self._reader
        while True:
            head = await reader.readexactly(4)
            body = await reader.readexactly(int.from_bytes(head, "big"))
            fut = self._pending.pop(int.from_bytes(body[:8], "big"), None)
            if fut is not None and not fut.done():
                fut.set_result(body[8:])

    async def call(self, payload: bytes) -> bytes:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        body = rid.to_bytes(8, "big") + payload
        self._writer.write(len(body).to_bytes(4, "big") + body)
        return await fut

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._writer.close()


def _start_echo(path: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-c",
         f"from musacache.bench._scale_server import echo_main; echo_main({path!r})"],
        env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the echo server did not start")
        time.sleep(0.02)
    return proc


# -- timing -----------------------------------------------------------------------------------


def _mm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


def _cpu_ns(pid: int) -> int:
    """Nanoseconds ``pid`` has run on a CPU (the scheduler's own account)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


async def _latencies(call: Callable[[], Awaitable[Any]], n: int, server_pid: int,
                     ) -> tuple[float, float, float, float]:
    """p50 and p99 of ``n`` sequential calls, and the CPU time per call of this process and
    of the server's, all in microseconds. The CPU times say where a round trip goes on a
    machine whose cores are shared: the wall time also holds the waits for a core."""
    times = []
    clock = time.perf_counter
    me = os.getpid()
    c0, s0 = _cpu_ns(me), _cpu_ns(server_pid)
    for _ in range(n):
        t0 = clock()
        await call()
        times.append(clock() - t0)
    c1, s1 = _cpu_ns(me), _cpu_ns(server_pid)
    times.sort()
    return (times[n // 2] * 1e6, times[min(n - 1, (n * 99) // 100)] * 1e6,
            (c1 - c0) / n / 1e3, (s1 - s0) / n / 1e3)


async def _ops(call: Callable[[int], Awaitable[Any]], tasks: int, per_task: int) -> float:
    """Calls per second with ``tasks`` callers, each making ``per_task`` calls in a row."""
    return (await _ops_cpu(call, tasks, per_task, None))[0]


async def _ops_cpu(call: Callable[[int], Awaitable[Any]], tasks: int, per_task: int,
                   server_pid: int | None) -> tuple[float, float, float]:
    """:func:`_ops`, and the CPU time per call of this process and of ``server_pid`` (µs;
    0 without a pid): with many calls in flight the wall time is shared by both sides and
    by whatever else runs on the machine, the CPU time is each side's own."""

    async def one(i: int) -> None:
        for _ in range(per_task):
            await call(i)

    me = os.getpid()
    c0, s0 = _cpu_ns(me), _cpu_ns(server_pid) if server_pid else 0
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(tasks)))
    wall = time.perf_counter() - t0
    c1, s1 = _cpu_ns(me), _cpu_ns(server_pid) if server_pid else 0
    n = tasks * per_task
    return n / wall, (c1 - c0) / n / 1e3, (s1 - s0) / n / 1e3


def _config(path: Path, capacity_chunks: int) -> None:
    spec = TINY.to_dict()
    spec_lines = "\n".join(f"{k} = {v!r}" if not isinstance(v, bool) else f"{k} = {str(v).lower()}"
                           for k, v in spec.items()).replace("'", '"')
    path.write_text(
        f'namespace = "bench-server"\nchunk_size = {CH}\n\n[spec]\n{spec_lines}\n\n'
        f'[[tiers]]\nkind = "host"\ncapacity = {TINY.nbytes(CH) * capacity_chunks}\n\n'
        f"[server]\nmax_caches = 1\n")


def _prompt(i: int, chunks: int) -> np.ndarray:
    # Distinct first tokens: every prompt is a new child of the root.
    base = np.arange(chunks * CH, dtype=np.int32)
    base[0] = (1 << 30) + i
    return base


# -- the parts --------------------------------------------------------------------------------


async def _request_path(client: Client, echo: _EchoClient, repeats: int, tasks: int,
                        server_pid: int, echo_pid: int) -> dict[str, Any]:
    toks = _prompt(0, 1)
    kv = ipc.empty_shared(TINY.shape(CH), TINY.dtype)
    kv.copy_(torch.randn(TINY.shape(CH)).to(TINY.dtype))
    await client.put(toks, kv)
    outs = [ipc.empty_shared(TINY.shape(CH), TINY.dtype) for _ in range(tasks)]
    payload = proto.encode_request(1, "lookup", {"tokens": toks.tobytes()})[proto.HEADER_SIZE:]
    hit = await client.get(toks, out=outs[0])
    if hit.num_tokens != CH or not torch.equal(outs[0], kv):
        raise RuntimeError("the server's get did not return the chunk that was put")

    async def lookup() -> Any:
        return await client.lookup(toks)

    async def get() -> Any:
        return await client.get(toks, out=outs[0])

    async def bounce() -> Any:
        return await echo.call(payload)

    res: dict[str, list[Any]] = {k: [] for k in (
        "echo_lat", "lookup_lat", "get_lat", "echo_ops", "lookup_ops", "get_ops")}
    pids = {"echo": echo_pid, "lookup": server_pid, "get": server_pid}
    for name, fn in (("echo", bounce), ("lookup", lookup), ("get", get)):
        await _latencies(fn, 200, pids[name])  # warm: first mappings, allocator, caches
    for o in outs[1:]:  # each caller's out is mapped by the server once, before the timing
        await client.get(toks, out=o)
    for _ in range(repeats):
        for name, fn in (("echo", bounce), ("lookup", lookup), ("get", get)):
            res[f"{name}_lat"].append(await _latencies(fn, _LAT_SAMPLES, pids[name]))
        res["echo_ops"].append(await _ops_cpu(lambda i: echo.call(payload), tasks,
                                              _OPS_PER_TASK, echo_pid))
        res["lookup_ops"].append(await _ops_cpu(lambda i: client.lookup(toks), tasks,
                                                _OPS_PER_TASK, server_pid))
        res["get_ops"].append(await _ops_cpu(lambda i: client.get(toks, out=outs[i]), tasks,
                                             _OPS_PER_TASK, server_pid))
    out: dict[str, Any] = {"tasks": tasks, "echo_form": ECHO_FORM,
                           "payload_bytes": len(payload)}
    for name in ("echo", "lookup", "get"):
        out[f"{name}_p50_us"] = _mm([r[0] for r in res[f"{name}_lat"]])
        out[f"{name}_p99_us"] = _mm([r[1] for r in res[f"{name}_lat"]])
        out[f"{name}_client_cpu_us"] = _mm([r[2] for r in res[f"{name}_lat"]])
        out[f"{name}_server_cpu_us"] = _mm([r[3] for r in res[f"{name}_lat"]])
        out[f"{name}_ops"] = _mm([r[0] for r in res[f"{name}_ops"]])
        out[f"{name}_ops_client_cpu_us"] = _mm([r[1] for r in res[f"{name}_ops"]])
        out[f"{name}_ops_server_cpu_us"] = _mm([r[2] for r in res[f"{name}_ops"]])
    # Ratios of the repeat-wise figures (same repeat, same machine state), then min/median.
    lat = [lk[0] / ec[0] for lk, ec in zip(res["lookup_lat"], res["echo_lat"], strict=True)]
    gops = [g[0] / e[0] for g, e in zip(res["get_ops"], res["echo_ops"], strict=True)]
    lops = [g[0] / e[0] for g, e in zip(res["lookup_ops"], res["echo_ops"], strict=True)]
    out["lookup_p50_vs_echo"] = {"best": min(lat), "median": statistics.median(lat)}
    out["get_ops_vs_echo"] = {"best": max(gops), "median": statistics.median(gops)}
    out["lookup_ops_vs_echo"] = {"best": max(lops), "median": statistics.median(lops)}
    return out


async def _put_curve(client: Client, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    fill_kv = ipc.empty_shared(TINY.shape(_FILL_CHUNKS * CH), TINY.dtype)
    fill_kv.zero_()
    one_kv = ipc.empty_shared(TINY.shape(CH), TINY.dtype)
    one_kv.zero_()
    rows = []
    filled = 0
    prompts = itertools.count(1_000_000)
    warm = [_prompt(next(prompts), 1) for _ in range(50)]  # first puts pay one-time costs
    for toks in warm:
        await client.put(toks, one_kv)
    for toks in warm:
        await client.delete(toks)
    for size in sorted(sizes):
        t0 = time.perf_counter()
        while filled < size:
            n = min(_FILL_CHUNKS, size - filled)
            got = await client.put(_prompt(next(prompts), n), fill_kv.narrow(
                TINY.token_dim, 0, n * CH))
            filled += got // CH
        fill_s = time.perf_counter() - t0
        cached = int((await client.stats())["chunks"])
        medians = []
        for _ in range(repeats):
            samples = []
            batch = [_prompt(next(prompts), 1) for _ in range(_PUT_SAMPLES)]
            for toks in batch:
                t1 = time.perf_counter()
                await client.put(toks, one_kv)
                samples.append(time.perf_counter() - t1)
            for toks in batch:  # the directory goes back to its size for the next repeat
                await client.delete(toks)
            medians.append(statistics.median(samples) * 1e6)
        rows.append({"cached_chunks": cached, "put_us": _mm(medians), "fill_s": fill_s})
    return rows


async def server_part(sizes: list[int], repeats: int, tasks: int = TASKS) -> dict[str, Any]:
    """Every server goal in one run (see the module's docstring)."""
    capacity = max(sizes) + _FILL_CHUNKS + _PUT_SAMPLES + 64
    with tempfile.TemporaryDirectory(prefix="mc-bench-srv-") as d:
        run = Path(d) / "run"
        run.mkdir(mode=0o700)
        cfg = Path(d) / "server.toml"
        _config(cfg, capacity)
        sock, echo_sock = str(run / "s.sock"), str(run / "echo.sock")
        echo_proc = _start_echo(echo_sock)
        try:
            with spawn(cfg, sock, log=Path(d) / "server.log") as server:
                if server.pid is None:
                    raise RuntimeError(f"a server already listens on {sock}")
                echo = _EchoClient()
                await echo.open(echo_sock)
                try:
                    async with Client(sock, spec=TINY, namespace="bench-server",
                                      chunk_size=CH) as client:
                        path = await _request_path(client, echo, repeats, tasks,
                                                   server.pid, echo_proc.pid)
                        curve = await _put_curve(client, sizes, repeats)
                finally:
                    await echo.aclose()
        finally:
            echo_proc.kill()
            echo_proc.wait(10)
    lo, hi = curve[0], curve[-1]
    ratio = hi["put_us"]["min"] / lo["put_us"]["min"]
    return {**path, "put_curve": curve, "put_flat_ratio": ratio}


def report(sv: dict[str, Any]) -> None:
    def mm(d: dict[str, float], unit: str) -> str:
        return f"{d['min']:.1f} / {d['median']:.1f}{unit}"

    print("\nthe node server (musacache serve, its own process) against a bare echo on the "
          "same kind of socket")
    print(f"  echo: {sv['echo_form']}; {sv['payload_bytes']} payload bytes")
    print("  (min / median over the repeats; a ratio is taken within each repeat)")
    print(f"  {'request':<22} {'p50 us':>15} {'p99 us':>15} {'CPU us, client':>15} "
          f"{'CPU us, server':>15} {'ops/s, ' + str(sv['tasks']) + ' in flight':>20}")
    for name, label in (("echo", "echo round trip"), ("lookup", "lookup, one chunk"),
                        ("get", "get(out=), one chunk")):
        ops = sv[f"{name}_ops"]
        print(f"  {label:<22} {mm(sv[f'{name}_p50_us'], ''):>15} "
              f"{mm(sv[f'{name}_p99_us'], ''):>15} "
              f"{mm(sv[f'{name}_client_cpu_us'], ''):>15} "
              f"{mm(sv[f'{name}_server_cpu_us'], ''):>15} "
              f"{ops['min']:>11.0f} / {ops['median']:.0f}")
    print(f"  with {sv['tasks']} in flight, CPU us per call (min / median): client, server")
    for name, label in (("echo", "echo round trip"), ("lookup", "lookup, one chunk"),
                        ("get", "get(out=), one chunk")):
        if f"{name}_ops_client_cpu_us" in sv:
            print(f"  {label:<22} {mm(sv[f'{name}_ops_client_cpu_us'], ''):>15} "
                  f"{mm(sv[f'{name}_ops_server_cpu_us'], ''):>15}")
    r = sv["lookup_p50_vs_echo"]
    print(f"  lookup p50 / echo p50: {r['best']:.2f} best, {r['median']:.2f} median "
          f"(goal <= 2)")
    r = sv["lookup_ops_vs_echo"]
    print(f"  lookup ops/s / echo ops/s: {r['best']:.2f} best, {r['median']:.2f} median")
    r = sv["get_ops_vs_echo"]
    print(f"  get ops/s / echo ops/s: {r['best']:.2f} best, {r['median']:.2f} median "
          f"(goal >= 0.4)")
    print("  one-chunk put latency over the server's directory size (median of "
          f"{_PUT_SAMPLES} puts per repeat)")
    print("    cached chunks | put us (min / median) | filled in s")
    for row in sv["put_curve"]:
        print(f"    {row['cached_chunks']:>13} | {mm(row['put_us'], ''):>21} | "
              f"{row['fill_s']:.1f}")
    lo, hi = sv["put_curve"][0], sv["put_curve"][-1]
    print(f"  put at {hi['cached_chunks']} / put at {lo['cached_chunks']}: "
          f"{sv['put_flat_ratio']:.2f} (goal <= 1.5)")
