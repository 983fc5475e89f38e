"""A soak of the node server (issue 10): clients that misbehave (memory they shrink, ready
events they never set, huge and amplifying frames, garbage, fd floods) run next to a
well-behaved client that keeps getting correct bytes. Afterwards the server's fds, threads
and RSS are back to their baseline. Loopback only; bounded in time."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import threading
import time

import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import ipc
from musacache.ipc import _wire as proto
from server_utils import ServerProcess, pages_for, write_tiers_config
from test_server_hardening import BS, CH, NB, RawPeer, empty_array_flood, tok_bytes, unsealed_pages

SOAK_SECONDS = 10.0


def shrinker(sock: str, spec: mc.KVSpec) -> None:
    fd, wires, _ = unsealed_pages(spec)
    peer = RawPeer(sock)
    try:
        peer.hello(spec, tenant="shrinker")
        reply = peer.call("register", {"layout": "vllm", "handles": wires},
                          [os.dup(fd) for _ in wires])
        assert not reply.ok
        os.ftruncate(fd, 0)
        peer.call("store", {"tokens": tok_bytes([1]), "slots": struct.pack("<q", 0), "reg": 1})
    finally:
        os.close(fd)
        peer.close()


def never_set(sock: str, spec: mc.KVSpec, pages: list[torch.Tensor]) -> None:
    handles = [ipc.share(p) for p in pages]
    peer = RawPeer(sock)
    events = [ipc.IpcEvent.create("cpu") for _ in range(8)]
    try:
        peer.hello(spec, tenant="hanger")
        reg = peer.call("register", {"layout": "vllm", "handles": [h.to_wire() for h in handles]},
                        [h.fds[0] for h in handles])
        assert reg.ok, reg.error
        for i, ev in enumerate(events):
            wire, efds = ev.export()
            peer.send("store", {"tokens": tok_bytes([i]), "slots": struct.pack("<q", i),
                                "reg": reg.result["reg"], "ready": wire}, list(efds))
        time.sleep(0.2)
    finally:
        peer.close()  # walk away with the stores still waiting
        for ev in events:
            ev.close()


def huge_frames(sock: str, spec: mc.KVSpec) -> None:
    peer = RawPeer(sock)
    try:
        peer.hello(spec, tenant="huge")
        peer.send_raw(empty_array_flood(4 * 1024**2))
        assert not peer.recv().ok
        # A header that announces a 2 GiB body: the server hangs up.
        peer.send_raw(struct.pack(">2sBBI", proto.MAGIC, proto.PROTOCOL_VERSION, 0, 2**31))
        try:
            peer.recv()
        except (ConnectionError, OSError):
            pass
    finally:
        peer.close()


def garbage(sock: str, rng: random.Random) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(sock)
        s.sendall(rng.randbytes(rng.randrange(1, 4096)))
        try:
            s.recv(4096)
        except (TimeoutError, OSError):
            pass
    finally:
        s.close()


def fd_flood(sock: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    fds = [os.eventfd(0) for _ in range(200)]
    try:
        s.connect(sock)
        frame = proto.encode_request(1, "lookup", {"tokens": b""})  # declares no fds
        socket.send_fds(s, [frame], fds)
        try:
            s.recv(4096)
        except (TimeoutError, OSError):
            pass
    finally:
        s.close()
        for fd in fds:
            os.close(fd)


def misbehave_once(sock: str, spec: mc.KVSpec, pages: list[torch.Tensor],
                   rng: random.Random) -> None:
    shrinker(sock, spec)
    never_set(sock, spec, pages)
    huge_frames(sock, spec)
    garbage(sock, rng)
    fd_flood(sock)


def test_misbehaving_clients_cannot_hurt_a_good_one_or_leak(tmp_path):
    spec = small_spec()
    cfg = write_tiers_config(tmp_path / "server.toml", spec.nbytes(CH) * 256 * 4,
                             "max_caches = 4\nready_timeout = 1.0\nmax_fds_per_peer = 16")
    log = tmp_path / "server.log"
    proc = ServerProcess(str(tmp_path / "run" / "s.sock"), cfg, log=log).start()
    pages = pages_for(spec, NB, BS)
    rng = random.Random(10)

    async def good_client(stop: threading.Event, until: float | None) -> int:
        served = 0
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="good", timeout=20) as c:
            while not stop.is_set() and (until is None or time.monotonic() < until):
                toks = [rng.randrange(30000) for _ in range(40)]
                kv = prefix_kv(spec, toks)
                assert await c.put(toks, kv) == 40
                hit = await c.get(toks)
                assert hit.num_tokens == 40 and torch.equal(hit.kv, kv)
                served += 1
                await asyncio.sleep(0.01)
        return served

    def settle(baseline_fds: int | None = None) -> None:
        # Hanging stores end after ready_timeout (1 s); give the server time to let go.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.25)
            if baseline_fds is None or proc.open_fds() <= baseline_fds:
                return

    try:
        # Warm up every path once so the baseline includes what is allocated for good.
        asyncio.run(good_client(threading.Event(), time.monotonic() + 1))
        misbehave_once(proc.sock, spec, pages, rng)
        settle()
        base_fds, base_threads = proc.open_fds(), proc.status("Threads")
        base_rss = proc.status("VmRSS")

        stop = threading.Event()

        def misbehavers() -> int:
            rounds = 0
            while not stop.is_set():
                misbehave_once(proc.sock, spec, pages, rng)
                rounds += 1
            return rounds

        async def soak() -> tuple[int, int]:
            bad = asyncio.create_task(asyncio.to_thread(misbehavers))
            try:
                good = await good_client(stop, time.monotonic() + SOAK_SECONDS)
            finally:
                stop.set()
            return good, await bad

        good, rounds = asyncio.run(soak())
        assert proc.alive(), log.read_text()
        assert good >= 10 and rounds >= 2, (good, rounds)

        settle(base_fds)
        fds, threads, rss = proc.open_fds(), proc.status("Threads"), proc.status("VmRSS")
        assert fds <= base_fds, (fds, base_fds)
        assert threads <= base_threads + 4, (threads, base_threads)
        assert rss <= base_rss + 64 * 1024, f"RSS grew {(rss - base_rss) / 1024:.0f} MiB"
        assert "Traceback" not in log.read_text()
    finally:
        proc.stop()
