"""``musacache bench metrics``: what scraping ``/metrics`` costs a node server.

One run, one server (a ``musacache serve --metrics`` subprocess), one client (this process)
sending small lookups, in rounds that alternate without and with a scraper that fetches
``/metrics`` every ``--interval`` seconds:

* **paced**: ``--rate`` lookups a second (1000 by default); the server's CPU seconds per
  request with the scraper, against without (the share a scrape takes of the load's cost).
* **saturated**: as many lookups as ``--depth`` requests in flight let through; the
  throughput with the scraper over the throughput without (goal: >= 0.98, a scrape costs
  less than 2% of the server's request throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from musacache.server.client import Client, connect
from musacache.server.spawn import spawn

from .._spec import KVSpec
from . import emit
from .cache import positive_int

CHUNK = 16
_SPEC = KVSpec(2, 2, 8, torch.float32)


def _progress(text: str) -> None:
    """Progress on stderr, so ``--json`` stdout stays one JSON object."""
    print(f"bench metrics: {text}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    """The user and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SCRAPER = """
import sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
n = size = 0
while sys.stdin.readable():
    time.sleep(interval)
    with urllib.request.urlopen(url, timeout=30) as r:
        size = len(r.read())
    n += 1
    print(n, size, flush=True)
"""


class _Scraper:
    """Fetches ``url`` every ``interval`` seconds, as Prometheus would, from a process of its
    own: a thread of this one would take the GIL from the client and slow the load."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url, interval
        self.scrapes = 0
        self.bytes = 0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> _Scraper:
        self._proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, self.url,
                                       str(self.interval)], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=60)
        last = out.split()[-2:]
        if len(last) == 2:
            self.scrapes, self.bytes = int(last[0]), int(last[1])


async def _paced(client: Client, tokens: list[int], rate: float, seconds: float) -> int:
    """Send ``rate`` lookups a second for ``seconds``; return how many were sent (each is
    answered before this returns)."""
    pending: set[asyncio.Task[int]] = set()
    start = time.perf_counter()
    n = 0
    while (due := start + n / rate) < start + seconds:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        task = asyncio.ensure_future(client.lookup(tokens))
        pending.add(task)
        task.add_done_callback(pending.discard)
        n += 1
    if pending:
        await asyncio.wait(pending)
    return n


async def _saturated(client: Client, tokens: list[int], depth: int, seconds: float) -> int:
    """Keep ``depth`` lookups in flight for ``seconds``; return how many were answered."""
    end = time.perf_counter() + seconds
    counts = [0] * depth

    async def lane(i: int) -> None:
        while time.perf_counter() < end:
            await client.lookup(tokens)
            counts[i] += 1

    await asyncio.gather(*(lane(i) for i in range(depth)))
    return sum(counts)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "server.toml"
        cfg.write_text(f'namespace = "bench-metrics"\nchunk_size = {CHUNK}\n[spec]\n'
                       f"num_layers = {_SPEC.num_layers}\nnum_kv_heads = {_SPEC.num_kv_heads}\n"
                       f'head_dim = {_SPEC.head_dim}\ndtype = "float32"\n'
                       f'[[tiers]]\nkind = "host"\ncapacity = {64 * 1024**2}\n')
        port = _free_port()
        url = f"http://127.0.0.1:{port}/metrics"
        server = spawn(cfg, str(Path(tmp) / "run" / "s.sock"),
                       args=["--metrics", f"127.0.0.1:{port}"])
        assert server.proc is not None
        pid = server.proc.pid
        rows: dict[str, dict[str, list[float]]] = {
            mode: {"off": [], "on": []} for mode in ("paced_cpu_per_request", "saturated_rps")}
        scrape_bytes = scrapes = 0
        try:
            async with connect(server.socket_path, spec=_SPEC, namespace="bench-metrics",
                               chunk_size=CHUNK) as client:
                tokens = list(range(4 * CHUNK))
                await client.put(tokens, torch.zeros(_SPEC.shape(len(tokens))))
                await _saturated(client, tokens, args.depth, 0.5)  # warm up
                for r in range(args.rounds):
                    for scrape in ("off", "on") if r % 2 == 0 else ("on", "off"):
                        _progress(f"round {r + 1}/{args.rounds}, scraper {scrape}")
                        scraper = _Scraper(url, args.interval) if scrape == "on" else None
                        with scraper or contextlib.nullcontext():
                            cpu0 = _cpu_s(pid)
                            n = await _paced(client, tokens, args.rate, args.seconds)
                            cpu = _cpu_s(pid) - cpu0
                            rows["paced_cpu_per_request"][scrape].append(cpu / n)
                            t0 = time.perf_counter()
                            n = await _saturated(client, tokens, args.depth, args.seconds)
                            rows["saturated_rps"][scrape].append(n / (time.perf_counter() - t0))
                        if scraper is not None:
                            scrape_bytes = scraper.bytes
                            scrapes = scraper.scrapes
        finally:
            server.stop()
    paced = rows["paced_cpu_per_request"]
    sat = rows["saturated_rps"]
    return {
        "rate": args.rate, "interval_s": args.interval, "seconds": args.seconds,
        "rounds": args.rounds, "depth": args.depth, "scrape_bytes": scrape_bytes,
        "scrapes_per_round": scrapes,
        "paced_cpu_us_per_request": {k: sum(v) / len(v) * 1e6 for k, v in paced.items()},
        "paced_cpu_ratio": sum(paced["on"]) / sum(paced["off"]),
        "saturated_rps": {k: sum(v) / len(v) for k, v in sat.items()},
        "saturated_ratio": sum(sat["on"]) / sum(sat["off"]),
    }


def _print(res: dict[str, Any]) -> None:
    print(f"node server, lookups of {4 * CHUNK} tokens, a scrape of /metrics "
          f"({res['scrape_bytes']} bytes) every {res['interval_s'] * 1e3:.0f} ms "
          f"({res['scrapes_per_round']} in the last round), "
          f"{res['rounds']} rounds of {res['seconds']} s each way")
    cpu = res["paced_cpu_us_per_request"]
    print(f"  paced at {res['rate']:.0f}/s: server CPU {cpu['off']:.1f} us/request without "
          f"the scraper, {cpu['on']:.1f} with: {res['paced_cpu_ratio']:.3f}x")
    rps = res["saturated_rps"]
    print(f"  saturated ({res['depth']} in flight): {rps['off']:.0f} requests/s without, "
          f"{rps['on']:.0f} with: throughput ratio {res['saturated_ratio']:.3f} "
          f"(goal >= 0.98)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musacache bench metrics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=positive_int, default=1000, help="paced lookups a second")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each measurement")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="rounds, each without and with the scraper (order alternating)")
    p.add_argument("--depth", type=positive_int, default=8,
                   help="lookups in flight in the saturated measurement")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return emit(asyncio.run(_run(args)), args.json, _print)


if __name__ == "__main__":
    raise SystemExit(main())
