"""A node server under hostile clients: the round trips of a well-behaved client while one
hostile client runs, against its round trips on an idle server, and the server's memory per
in-flight request against that request's frame.

Each hostile client is a process of its own that speaks the protocol directly (so that it
can send what no ``Client`` would): floods of pipelined lookups, requests of the largest size
the protocol admits, long deletes at the smallest chunk size, and tenants churned with
deletes left running. The well-behaved client is a ``musacache.connect`` client in this
process, looking up a short prompt one call at a time. Goals: its p99 at most 5x its idle p99
under every pattern, and the server's growth per in-flight request at most 4x that
request's frame bytes (or ``max_request_bytes_per_peer``, whichever is smaller).

``aclose`` (not a client): an embedded cache with a disk tier closes while long deletes at the
smallest chunk size run in its background, far more than ``close_timeout`` lets finish; goal:
``aclose()`` returns within ``close_timeout`` + 0.5 s, the rest noted for the next open.

    musacache bench hostile [--seconds S] [--only flood,big_lookup,...,aclose] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from .. import Cache, CacheConfig, DiskTier, HostTier, KVSpec, connect
from ..ipc import _wire as proto
from ..server.spawn import spawn
from . import emit

#: The spec of every pattern: small, so that the bookkeeping, not copies, is what is shown.
SPEC = KVSpec(2, 2, 16, torch.float16)
CHUNK = 16
#: Tokens of the largest request the protocol admits (``MAX_TOKENS``), and of a page request.
MAX_TOKENS = 16 * 1024 * 1024
PAGE_KEYS = 32_000
DELETE_TOKENS = 4 * 1024 * 1024
#: Deletes of DELETE_TOKENS one long_delete client keeps in flight.
DELETES_IN_FLIGHT = 8
GOAL_P99 = 5.0
GOAL_MEMORY = 4.0
#: ``aclose``: its deletes (chunks each), its close_timeout (s), and the goal's margin (s).
ACLOSE_DELETES = 8
ACLOSE_CHUNKS = 16384
ACLOSE_TIMEOUT = 0.5
GOAL_ACLOSE_MARGIN = 0.5


class RawClient:
    """A blocking protocol client that sends whatever it is told to."""

    def __init__(self, path: str, timeout: float = 120.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(timeout)
        self.decoder = proto.FrameDecoder(expect="reply")
        self.ids = itertools.count(1)

    def send(self, op: str, args: dict[str, Any]) -> int:
        rid = next(self.ids)
        self.sock.sendall(proto.encode_request(rid, op, args, max_frame_size=1 << 31))
        return rid

    def recv(self) -> proto.Reply:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                assert isinstance(frame, proto.Reply)
                return frame
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.decoder.feed(data)

    def call(self, op: str, args: dict[str, Any]) -> proto.Reply:
        self.send(op, args)
        return self.recv()

    def hello(self, tenant: str | None = None, chunk_size: int = CHUNK) -> proto.Reply:
        return self.call("hello", {"protocol": proto.PROTOCOL_VERSION, "namespace": "hostile",
                                   "spec": SPEC.to_dict(), "chunk_size": chunk_size,
                                   "tenant": tenant})

    def close(self) -> None:
        self.sock.close()


def _tokens(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 1 << 20, n, dtype=np.int32).tobytes()


def _pipelined(op: str, make_args: Callable[[], dict[str, Any]], depth: int, path: str,
               seconds: float) -> None:
    """``op`` with the same arguments, ``depth`` of them in flight, for ``seconds``."""
    c = RawClient(path)
    c.hello()
    args = make_args()
    until = time.monotonic() + seconds  # (from here: the process took seconds to start)
    while time.monotonic() < until:
        for _ in range(depth):
            c.send(op, args)
        for _ in range(depth):
            c.recv()


def _token_args(n: int) -> dict[str, Any]:
    return {"tokens": _tokens(n)}


def _page_args() -> dict[str, Any]:
    return {"keys": [os.urandom(32) for _ in range(PAGE_KEYS)]}


def _tenant_churn(path: str, seconds: float) -> None:
    until = time.monotonic() + seconds

    async def churn() -> None:
        kv = torch.zeros(SPEC.shape(CHUNK * 256), dtype=SPEC.dtype)
        for i in itertools.count():
            if time.monotonic() >= until:
                return
            async with connect(path, spec=SPEC, namespace="hostile", chunk_size=CHUNK,
                               tenant=f"churn-{i}") as c:
                toks = np.frombuffer(_tokens(CHUNK * 256, seed=i), dtype=np.int32)
                await c.put(toks, kv)
                # Cut short: the server's delete goes on in the cache's background, and
                # the connection ends with it pending.
                with anyio.move_on_after(0.001):
                    await c.delete(toks)

    asyncio.run(churn())


#: The patterns that keep the same request in flight: its op, its arguments, how many.
PIPELINED: dict[str, tuple[str, Callable[[], dict[str, Any]], int]] = {
    "flood": ("lookup", partial(_token_args, CHUNK * 4), 64),
    "big_lookup": ("lookup", partial(_token_args, MAX_TOKENS), 1),
    "big_pages": ("exists_pages", _page_args, 1),
    "long_delete": ("delete", partial(_token_args, DELETE_TOKENS), DELETES_IN_FLIGHT),
}
PATTERNS: dict[str, Callable[[str, float], None]] = {
    **{name: partial(_pipelined, *how) for name, how in PIPELINED.items()},
    "tenant_churn": _tenant_churn,
}
#: What ``--only`` may name: the hostile clients, and the close of an embedded cache.
MEASURES = (*PATTERNS, "aclose")


async def aclose_pending_deletes(root: str) -> dict[str, Any]:
    """``aclose()`` of an embedded cache (host and disk tiers) while ``ACLOSE_DELETES``
    deletes of ``ACLOSE_CHUNKS`` chunks each run in its background: its wall time, and the
    longest gap between turns of the loop meanwhile."""
    cfg = CacheConfig(SPEC, "hostile", chunk_size=CHUNK, close_timeout=ACLOSE_TIMEOUT,
                      persist_on_close=False,
                      tiers=(HostTier(SPEC.nbytes(CHUNK) * ACLOSE_DELETES * ACLOSE_CHUNKS * 2),
                             DiskTier(root, SPEC.nbytes(CHUNK) * 1024)))
    cache = Cache(cfg)
    await cache.open()
    kv = torch.zeros(SPEC.shape(ACLOSE_CHUNKS * CHUNK), dtype=SPEC.dtype)
    prompts = [np.frombuffer(_tokens(ACLOSE_CHUNKS * CHUNK, seed=i), dtype=np.int32)
               for i in range(ACLOSE_DELETES)]
    for p in prompts:
        await cache.put(p, kv)
    calls = [asyncio.ensure_future(cache.delete(p)) for p in prompts]
    await asyncio.sleep(0.05)
    for t in calls:  # cut off, as a server's request is: the deletes go on in the background
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    gaps = [0.0]
    closing = [True]

    async def watch() -> None:
        last = time.perf_counter()
        while closing[0]:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    await cache.aclose()
    wall = time.perf_counter() - t0
    closing[0] = False
    await watcher
    close = (await cache.stats())["close"]
    return {"aclose_s": wall, "close_timeout_s": ACLOSE_TIMEOUT,
            "over_timeout_s": wall - ACLOSE_TIMEOUT, "longest_loop_gap_ms": gaps[0] * 1e3,
            "deletes_cut": close["deletes_cut"], "deletes_noted": close["deletes_noted"],
            "deletes_abandoned": close["deletes_abandoned"]}


def in_flight_frame_bytes(name: str) -> int:
    """The bytes of the frames a pipelined pattern keeps in flight."""
    op, make_args, depth = PIPELINED[name]
    return depth * len(proto.encode_request(1, op, make_args(), max_frame_size=1 << 31))


def run_hostile(pattern: str, path: str, seconds: float) -> Any:
    """Start ``pattern``'s client in a process of its own: it runs for ``seconds`` once
    connected."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=PATTERNS[pattern], args=(path, seconds), daemon=True)
    proc.start()
    return proc


async def round_trips(path: str, seconds: float) -> list[float]:
    """A well-behaved client's lookup round trips (seconds) for ``seconds``."""
    toks = np.frombuffer(_tokens(256, seed=99), dtype=np.int32)
    times: list[float] = []
    async with connect(path, spec=SPEC, namespace="polite", chunk_size=CHUNK) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            await c.lookup(toks)
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(0.002)  # a client with other work: one call every few ms
    return times


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _watch_rss(pid: int, hostile: Any, peak: list[int]) -> None:
    """Keep the server's largest RSS (KiB) in ``peak[0]`` while ``hostile`` runs."""
    while hostile.is_alive():
        peak[0] = max(peak[0], _rss_kib(pid))
        await asyncio.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    names = [p for p in (args.only.split(",") if args.only else MEASURES) if p]
    patterns = [p for p in names if p in PATTERNS]
    res: dict[str, Any] = {"patterns": {}}
    if patterns:
        res.update(await _measure_server(args, patterns))
    if "aclose" in names:
        with tempfile.TemporaryDirectory() as tmp:
            res["aclose"] = await aclose_pending_deletes(tmp)
    return res


async def _measure_server(args: argparse.Namespace, patterns: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "s.sock")
        cfg = Path(tmp) / "server.toml"
        cfg.write_text(f"[[tiers]]\nkind = \"host\"\ncapacity = {256 * 1024**2}\n"
                       f"[server]\nmax_caches = 2\n")
        server = spawn(cfg, sock, timeout=60)
        assert server.proc is not None
        pid = server.proc.pid
        try:
            idle = await round_trips(sock, args.seconds)
            res: dict[str, Any] = {"idle": {"p50_ms": _pct(idle, 0.5) * 1e3,
                                            "p99_ms": _pct(idle, 0.99) * 1e3,
                                            "calls": len(idle)}, "patterns": {}}
            idle_p99 = _pct(idle, 0.99)
            for name in patterns:
                base_rss = _rss_kib(pid)
                hostile = run_hostile(name, sock, args.seconds + 1.0)
                await asyncio.sleep(0.5)  # (its first requests on their way)
                peak = [base_rss]
                watcher = asyncio.create_task(_watch_rss(pid, hostile, peak))
                times = await round_trips(sock, args.seconds)
                await asyncio.to_thread(hostile.join, 60)
                watcher.cancel()
                row = {"p50_ms": _pct(times, 0.5) * 1e3, "p99_ms": _pct(times, 0.99) * 1e3,
                       "calls": len(times), "p99_vs_idle_p99": _pct(times, 0.99) / idle_p99,
                       "rss_growth_MiB": (peak[0] - base_rss) / 1024,
                       # what stays after the hostile client is gone
                       "rss_kept_MiB": (_rss_kib(pid) - base_rss) / 1024}
                if name in PIPELINED:
                    row["growth_vs_frame_bytes"] = \
                        (peak[0] - base_rss) * 1024 / in_flight_frame_bytes(name)
                res["patterns"][name] = row
        finally:
            server.kill()
    return res


def _print(res: dict[str, Any]) -> None:
    if "idle" in res:
        _print_server(res)
    if "aclose" in res:
        a = res["aclose"]
        goal = a["close_timeout_s"] + GOAL_ACLOSE_MARGIN
        print(f"aclose() with pending deletes: {a['aclose_s']:.2f} s against close_timeout "
              f"{a['close_timeout_s']:.2f} s (goal <= close_timeout + {GOAL_ACLOSE_MARGIN} s): "
              f"{'met' if a['aclose_s'] <= goal else 'NOT met'}")
        print(f"{'':<14}longest loop gap {a['longest_loop_gap_ms']:.1f} ms; "
              f"{a['deletes_cut']} deletes cut, {a['deletes_noted']} noted, "
              f"{a['deletes_abandoned']} abandoned")


def _print_server(res: dict[str, Any]) -> None:
    idle = res["idle"]
    print(f"idle server: well-behaved lookup p50 {idle['p50_ms']:.2f} ms, p99 "
          f"{idle['p99_ms']:.2f} ms ({idle['calls']} calls)")
    print(f"{'pattern':<14}{'p50 ms':>9}{'p99 ms':>9}{'p99/idle':>10}{'RSS +MiB':>10}")
    for name, r in res["patterns"].items():
        verdict = "met" if r["p99_vs_idle_p99"] <= GOAL_P99 else "NOT met"
        print(f"{name:<14}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['p99_vs_idle_p99']:>10.2f}"
              f"{r['rss_growth_MiB']:>10.1f}  goal p99 <= {GOAL_P99}x idle: {verdict}")
        if "growth_vs_frame_bytes" in r:
            g = r["growth_vs_frame_bytes"]
            print(f"{'':<14}RSS growth / the frame bytes in flight: {g:.2f} "
                  f"(goal <= {GOAL_MEMORY}): {'met' if g <= GOAL_MEMORY else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musacache bench hostile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="each pattern's run")
    p.add_argument("--only", default="", help=f"comma list of: {','.join(MEASURES)}")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    unknown = sorted({x for x in args.only.split(",") if x} - set(MEASURES))
    if unknown:
        p.error(f"--only: no pattern named {', '.join(unknown)}")
    if not args.seconds > 0:
        p.error("--seconds must be > 0")
    return emit(asyncio.run(_measure(args)), args.json, _print)


if __name__ == "__main__":
    raise SystemExit(main())
