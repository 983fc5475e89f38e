"""``musacache stats --socket PATH``: a live table of a node server's caches, tiers, hits and
bytes. It connects as a monitor: it reads counters and can do nothing else."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from musacache import ipc
from musacache._errors import CacheUnavailableError, MusaCacheError
from musacache.ipc import _wire as proto


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tier_kind(t: dict[str, Any]) -> str:
    """What a tier is ("host", "disk", "s3"...), never a class name."""
    kind = str(t.get("kind", "?"))
    # Older servers report a storage tier's class name (DiskStore, S3Store).
    if kind.endswith("Store") and len(kind) > len("Store"):
        return kind[: -len("Store")].lower()
    return kind


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _cache_lines(c: dict[str, Any], elapsed: float | None,
                 prev: dict[str, Any] | None) -> list[str]:
    tok = c.get("tokens", {})
    asked = tok.get("hit_tokens", 0) + tok.get("miss_tokens", 0)
    rate = f"{tok.get('hit_tokens', 0) / asked:.1%}" if asked else "-"
    tenant = f"  tenant={c['tenant']}" if c.get("tenant") else ""
    spec = f"  spec={c['spec']}" if c.get("spec") else ""
    lines = [
        f"cache namespace={c.get('namespace')}{tenant}  chunk={c.get('chunk_size')}{spec}  "
        f"device={c.get('device')}",
        f"chunks {c.get('chunks', 0)}  pins {c.get('pins', 0)}  token hit rate {rate}",
        f"  {'tier':<10}{'kind':<8}{'chunks':>8}{'used':>12}{'capacity':>12}{'hits':>9}"
        f"{'misses':>9}{'in':>12}{'out':>12}{'evict':>8}{'faults':>8}"
        + (f"{'out/s':>13}" if prev is not None and elapsed else ""),
    ]
    for name, t in c.get("tiers", {}).items():
        rate_col = ""
        if prev is not None and elapsed:
            before = prev.get("tiers", {}).get(name, {})
            moved = (t.get("bytes_out", 0) - before.get("bytes_out", 0)) / elapsed
            rate_col = f"{_size(moved) + '/s':>13}"
        lines.append(
            f"  {name:<10}{tier_kind(t)[:7]:<8}{t.get('chunks', 0):>8}"
            f"{_size(t.get('bytes_used')):>12}{_size(t.get('capacity_bytes')):>12}"
            f"{t.get('hits', 0):>9}{t.get('misses', 0):>9}{_size(t.get('bytes_in')):>12}"
            f"{_size(t.get('bytes_out')):>12}{t.get('evictions', 0):>8}"
            f"{t.get('faults', 0):>8}{rate_col}")
    inflight = c.get("in_flight", {})
    lines.append("  in flight: " + "  ".join(f"{k} {v}" for k, v in inflight.items()))
    return lines


def render(st: dict[str, Any], elapsed: float | None = None,
           prev: dict[str, Any] | None = None) -> str:
    """The table for one stats snapshot (``prev`` adds per-second rates)."""
    srv = st.get("server", {})
    # A monitor's snapshot lists every cache; a cache connection's is its own cache.
    caches = st.get("caches")
    if caches is None:
        caches = [st]
    lines = [
        f"musacache {srv.get('version', '?')} on {srv.get('socket', '?')}  "
        f"caches {srv.get('caches', len(caches))}/{srv.get('max_caches', '?')}",
        f"peers {srv.get('peers', 0)}  registrations {srv.get('registrations', 0)}  "
        f"requests {srv.get('requests', 0)}  errors {srv.get('errors', 0)}  "
        f"refused {srv.get('refused', 0)}  limited {srv.get('limited', 0)}  "
        f"bad frames {srv.get('bad_frames', 0)}  open mappings {srv.get('open_mappings', 0)}  "
        f"kept buffers {srv.get('buffers', 0)}  fds {srv.get('open_fds', 0)}",
    ]
    before = {_cache_id(c): c for c in (prev or {}).get("caches", [])} if prev else {}
    for c in caches:
        lines.append("")
        old = before.get(_cache_id(c)) if prev and "caches" in prev else prev
        lines += _cache_lines(c, elapsed, old)
    if not caches:
        lines += ["", "no caches yet: none opened at start, and no worker has connected"]
    return "\n".join(lines)


def _cache_id(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c.get("namespace"), c.get("spec"), c.get("chunk_size"), c.get("tenant"),
            c.get("uid"))


async def fetch_stats(path: str, timeout: float = 5.0) -> dict[str, Any]:
    """One stats snapshot from the server at ``path`` (a monitor connection: no spec needed)."""
    try:
        with anyio.fail_after(timeout):
            async with await proto.Connection.connect(path, expect="reply") as conn:
                await conn.send_request(1, "hello", {"protocol": proto.PROTOCOL_VERSION,
                                                     "monitor": True})
                await _reply(conn)
                await conn.send_request(2, "stats", {})
                return dict(await _reply(conn))
    except CacheUnavailableError:
        raise  # it names the path already (it is an OSError too: keep it from the next clause)
    except TimeoutError:
        raise CacheUnavailableError(f"the musacache server at {path} did not answer within "
                                    f"{timeout} s") from None
    except OSError as e:
        raise CacheUnavailableError(f"cannot reach musacache server at {path}: "
                                    f"{e.strerror or e}") from e


async def _reply(conn: proto.Connection) -> Any:
    frame = await conn.receive()
    if not isinstance(frame, proto.Reply):
        raise CacheUnavailableError("the server closed the connection")
    ipc.close_fds(frame.fds)
    return frame.unwrap()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musacache stats",
        description="Show a live table of a running node server: caches, tiers, hits, bytes, "
                    "peers.")
    p.add_argument("--socket", required=True, help="the server's Unix socket")
    p.add_argument("--interval", type=_positive_seconds, default=1.0,
                   help="seconds between refreshes (> 0)")
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
                print(json.dumps(st, indent=2, default=str), flush=True)
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
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): say so once, and keep Python from complaining
        # again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("musacache stats: the output was closed", file=sys.stderr)
        return 141
    except MusaCacheError as e:
        print(f"musacache stats: {e}", file=sys.stderr)
        return 1
