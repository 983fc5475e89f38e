"""``musacache stats --socket PATH``: a live table of a node server's tiers, hits and bytes."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from . import ipc
from ._errors import CacheUnavailableError, MusaCacheError


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(st: dict[str, Any], elapsed: float | None = None,
           prev: dict[str, Any] | None = None) -> str:
    """The table for one stats snapshot (``prev`` adds per-second rates)."""
    srv = st.get("server", {})
    tok = st.get("tokens", {})
    asked = tok.get("hit_tokens", 0) + tok.get("miss_tokens", 0)
    lines = [
        f"musacache {srv.get('version', '?')} on {srv.get('socket', '?')}  "
        f"namespace={st.get('namespace')}  chunk={st.get('chunk_size')}  "
        f"device={st.get('device')}",
        f"peers {srv.get('peers', 0)}  registrations {srv.get('registrations', 0)}  "
        f"requests {srv.get('requests', 0)}  errors {srv.get('errors', 0)}  "
        f"refused {srv.get('refused', 0)}  bad frames {srv.get('bad_frames', 0)}  "
        f"open mappings {srv.get('open_mappings', 0)}  fds {srv.get('open_fds', 0)}",
        f"chunks {st.get('chunks', 0)}  pins {st.get('pins', 0)}  "
        f"token hit rate {tok.get('hit_tokens', 0) / asked:.1%}" if asked else
        f"chunks {st.get('chunks', 0)}  pins {st.get('pins', 0)}  token hit rate -",
        "",
        f"{'tier':<10}{'kind':<12}{'chunks':>8}{'used':>12}{'capacity':>12}{'hits':>9}"
        f"{'misses':>9}{'in':>12}{'out':>12}{'evict':>8}{'faults':>8}",
    ]
    for name, t in st.get("tiers", {}).items():
        rate = ""
        if prev is not None and elapsed:
            before = prev.get("tiers", {}).get(name, {})
            moved = (t.get("bytes_out", 0) - before.get("bytes_out", 0)) / elapsed
            rate = f"  {_size(moved)}/s out"
        lines.append(
            f"{name:<10}{str(t.get('kind', '?'))[:11]:<12}{t.get('chunks', 0):>8}"
            f"{_size(t.get('bytes_used')):>12}{_size(t.get('capacity_bytes')):>12}"
            f"{t.get('hits', 0):>9}{t.get('misses', 0):>9}{_size(t.get('bytes_in')):>12}"
            f"{_size(t.get('bytes_out')):>12}{t.get('evictions', 0):>8}"
            f"{t.get('faults', 0):>8}{rate}")
    inflight = st.get("in_flight", {})
    lines.append("")
    lines.append("in flight: " + "  ".join(f"{k} {v}" for k, v in inflight.items()))
    return "\n".join(lines)


async def fetch_stats(path: str, timeout: float = 5.0) -> dict[str, Any]:
    """One stats snapshot from the server at ``path`` (a monitor connection: no spec needed)."""
    try:
        with anyio.fail_after(timeout):
            async with await ipc.Connection.connect(path, expect="reply") as conn:
                await conn.send_request(1, "hello", {"protocol": ipc.PROTOCOL_VERSION,
                                                     "monitor": True})
                await _reply(conn)
                await conn.send_request(2, "stats", {})
                return dict(await _reply(conn))
    except (OSError, TimeoutError) as e:
        raise CacheUnavailableError(f"cannot reach musacache server at {path}: {e}") from e


async def _reply(conn: ipc.Connection) -> Any:
    frame = await conn.receive()
    if not isinstance(frame, ipc.Reply):
        raise CacheUnavailableError("the server closed the connection")
    ipc.close_fds(frame.fds)
    return frame.unwrap()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musacache stats",
        description="Show a live table of a running node server: tiers, hits, bytes, peers.")
    p.add_argument("--socket", required=True, help="the server's Unix socket")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true",
                   help="print the raw stats as JSON (implies --once)")
    args = p.parse_args(list(argv) if argv is not None else None)

    async def run() -> int:
        prev: dict[str, Any] | None = None
        last = time.monotonic()
        tty = sys.stdout.isatty()
        while True:
            st = await fetch_stats(args.socket)
            now = time.monotonic()
            if args.json:
                print(json.dumps(st, indent=2, default=str))
                return 0
            text = render(st, now - last if prev else None, prev)
            if tty and not args.once:
                sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
            print(text, flush=True)
            if args.once:
                return 0
            prev, last = st, now
            await asyncio.sleep(args.interval)

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    except MusaCacheError as e:
        print(f"musacache stats: {e}", file=sys.stderr)
        return 1
