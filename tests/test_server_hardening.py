"""The node server against misbehaving and hostile clients (issue 10, items 4-9): tenants kept
apart, stats-only monitors, shrinkable memory, fd exhaustion, msgpack amplification,
malformed requests, and the socket's folder. Each test fails on the server before the fix."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import ipc
from musacache.ipc import _wire as proto
from musacache.server import Server, ServerConfig, _listen
from server_utils import ServerProcess, pages_for, write_config, write_tiers_config

CH = 16
NB, BS = 16, 4


# -- a raw protocol peer: says exactly what a test tells it to -------------------------------


class RawPeer:
    """A blocking protocol client that sends whatever frames a test builds."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(timeout)
        self.decoder = proto.FrameDecoder(expect="reply")
        self.ids = itertools.count(1)

    def send(self, op: str, args: dict[str, Any], fds: list[int] = ()) -> int:  # type: ignore[assignment]
        rid = next(self.ids)
        frame = proto.encode_request(rid, op, args, nfds=len(fds))
        self.send_raw(frame, fds)
        return rid

    def send_raw(self, data: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        if fds:
            socket.send_fds(self.sock, [data[:1]], list(fds))
            self.sock.sendall(data[1:])
        else:
            self.sock.sendall(data)

    def recv(self) -> proto.Reply:
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                ipc.close_fds(frame.fds)
                assert isinstance(frame, proto.Reply)
                return frame
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.decoder.feed(data, fds)

    def call(self, op: str, args: dict[str, Any], fds: list[int] = ()) -> proto.Reply:  # type: ignore[assignment]
        rid = self.send(op, args, fds)
        reply = self.recv()
        assert reply.id == rid
        return reply

    def hello(self, spec: mc.KVSpec | None = None, namespace: str = "srv",
              tenant: str | None = None) -> proto.Reply:
        args: dict[str, Any] = {"protocol": proto.PROTOCOL_VERSION}
        if spec is None:
            args["monitor"] = True
        else:
            args.update(namespace=namespace, spec=spec.to_dict(), chunk_size=CH, tenant=tenant)
        reply = self.call("hello", args)
        assert reply.ok, reply.error
        return reply

    def close(self) -> None:
        self.sock.close()


def error_type(reply: proto.Reply) -> str:
    assert reply.error is not None, f"expected an error, got {reply.result!r}"
    return reply.error["type"]


def unsealed_pages(spec: mc.KVSpec) -> tuple[int, list[dict[str, Any]], int]:
    """A memfd without seals holding vllm pages: (fd, handle wires, nbytes)."""
    shape = (2, NB, BS, spec.num_kv_heads, spec.head_dim)
    per = torch.empty(shape, dtype=spec.dtype)
    nbytes = per.numel() * per.element_size()
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes * spec.num_layers)
    wires = []
    for layer in range(spec.num_layers):
        handle = ipc.TensorHandle("cpu", None, None, (), spec.dtype, shape,
                                  tuple(per.stride()), layer * per.numel(),
                                  nbytes * spec.num_layers)
        wires.append(handle.to_wire())
    return fd, wires, nbytes * spec.num_layers


def tok_bytes(toks: list[int]) -> bytes:
    return struct.pack(f"<{len(toks)}i", *toks)


@pytest.fixture
def tiers_only(tmp_path):
    """A server whose config is only its tiers: every cache is named by its clients."""
    spec = small_spec()
    cfg = write_tiers_config(tmp_path / "server.toml", spec.nbytes(CH) * 64 * 4,
                             "max_caches = 4\nready_timeout = 2.0")
    proc = ServerProcess(str(tmp_path / "run" / "s.sock"), cfg, log=tmp_path / "server.log",
                         log_level="INFO").start()
    yield proc, spec, tmp_path / "server.log"
    proc.stop()


@pytest.fixture
def one_cache(tmp_path):
    """A server configured for one cache (namespace and spec in its file), as before tenants."""
    spec = small_spec()
    cfg = write_config(tmp_path / "server.toml", spec, "srv", CH, spec.nbytes(CH) * 64)
    cfg.write_text(cfg.read_text() + "[server]\nready_timeout = 2.0\n")
    proc = ServerProcess(str(tmp_path / "run" / "s.sock"), cfg, log=tmp_path / "server.log",
                         log_level="INFO").start()
    yield proc, spec, tmp_path / "server.log"
    proc.stop()


# -- item 4: tenants and monitors ---------------------------------------------------------------


def test_tenants_never_see_each_others_kv(tiers_only):
    proc, spec, _ = tiers_only
    toks = list(range(100, 140))

    async def run():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="alice") as alice:
            assert await alice.put(toks, prefix_kv(spec, toks)) == 40
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="bob") as bob:
            assert await bob.lookup(toks) == 0
            hit = await bob.get(toks)
            assert hit.num_tokens == 0
            await bob.clear()  # bob's clear is bob's alone
            assert await bob.delete(toks) == 0
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH) as nobody:
            assert await nobody.lookup(toks) == 0
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="alice") as alice_again:
            hit = await alice_again.get(toks)
            assert hit.num_tokens == 40 and torch.equal(hit.kv, prefix_kv(spec, toks))

    asyncio.run(run())


def test_one_server_serves_several_models_from_a_tiers_only_config(tiers_only):
    proc, spec, _ = tiers_only
    other = small_spec(dtype=torch.float16)
    toks = list(range(50))

    async def run():
        async with mc.connect(proc.sock, spec=spec, namespace="llama", chunk_size=CH) as a, \
                mc.connect(proc.sock, spec=other, namespace="qwen", chunk_size=CH) as b:
            assert await a.put(toks, prefix_kv(spec, toks)) == 50
            assert await b.put(toks, prefix_kv(other, toks)) == 50
            assert torch.equal((await a.get(toks)).kv, prefix_kv(spec, toks))
            assert torch.equal((await b.get(toks)).kv, prefix_kv(other, toks))
            st = await a.stats()
            # Capacity is the node's total, split evenly over max_caches caches.
            assert st["tiers"]["host"]["capacity_bytes"] == spec.nbytes(CH) * 64
            assert st["server"]["caches"] == 2

    asyncio.run(run())


def test_a_monitor_connection_reads_stats_and_nothing_else(tiers_only):
    proc, spec, _ = tiers_only
    toks = list(range(30))

    async def put():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="secret-tenant") as c:
            await c.put(toks, prefix_kv(spec, toks))

    asyncio.run(put())
    peer = RawPeer(proc.sock)
    peer.hello()  # monitor
    for op in ("lookup", "delete", "prefetch"):
        assert error_type(peer.call(op, {"tokens": tok_bytes(toks)})) == "PermissionDeniedError"
    for op in ("clear", "flush"):
        assert error_type(peer.call(op, {})) == "PermissionDeniedError"
    st = peer.call("stats", {})
    assert st.ok
    text = json.dumps(st.result, default=str)
    assert "secret-tenant" not in text  # tenants are shown as digests only
    (cache,) = st.result["caches"]
    assert cache["chunks"] == 2 and cache["tenant"].startswith("#")
    peer.close()

    async def still_there():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                              tenant="secret-tenant") as c:
            assert await c.lookup(toks) == 30

    asyncio.run(still_there())


# -- item 5: memory that can shrink --------------------------------------------------------------


def test_shrinkable_memory_is_refused_and_cannot_kill_the_server(one_cache):
    proc, spec, _ = one_cache
    fd, wires, nbytes = unsealed_pages(spec)
    peer = RawPeer(proc.sock)
    peer.hello(spec)
    reply = peer.call("register", {"layout": "vllm", "handles": wires},
                      [os.dup(fd) for _ in wires])
    assert error_type(reply) == "IPCError" and "sealed" in reply.error["message"]
    # The attack: shrink the memory, then ask for a store through it (or a dense put).
    os.ftruncate(fd, 0)
    store = peer.call("store", {"tokens": tok_bytes([1, 2, 3]),
                                "slots": struct.pack("<3q", 0, 1, 2), "reg": 1})
    assert error_type(store) == "InvalidInputError"
    dense = ipc.TensorHandle("cpu", None, None, (), spec.dtype, spec.shape(4),
                             tuple(torch.empty(spec.shape(4)).stride()), 0, nbytes)
    put = peer.call("put", {"tokens": tok_bytes([1, 2, 3, 4]), "kv": dense.to_wire()}, [fd])
    assert error_type(put) == "IPCError"
    os.close(fd)
    peer.close()
    assert proc.alive()

    async def others_are_served():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(20))
            # torch's share_memory_() memory is shareable but not sealed: the client refuses
            # to register it, and copies a dense put through sealed staging memory instead.
            unsealed = [p.clone().share_memory_() for p in pages_for(spec, NB, BS)]
            with pytest.raises(mc.IPCError, match="sealed"):
                await c.register_kv_caches(unsealed, "vllm")
            kv = prefix_kv(spec, toks).share_memory_()
            assert await c.put(toks, kv) == 20
            assert torch.equal((await c.get(toks)).kv, kv)

    asyncio.run(others_are_served())
    assert proc.alive()


# -- item 6: fds --------------------------------------------------------------------------------


def test_accept_backs_off_on_emfile_and_keeps_serving(tmp_path):
    spec = small_spec()
    cfg = write_tiers_config(tmp_path / "server.toml", spec.nbytes(CH) * 64)
    proc = ServerProcess(str(tmp_path / "run" / "s.sock"), cfg, nofile=96,
                         log=tmp_path / "server.log").start()
    try:
        # Each accepted connection costs the server one fd: run it out of them.
        idle = []
        for _ in range(110):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(proc.sock)
            idle.append(s)
        time.sleep(1.5)
        assert proc.alive(), Path(tmp_path / "server.log").read_text()
        for s in idle:
            s.close()

        async def served():
            async with mc.connect(proc.sock, spec=spec, namespace="srv", chunk_size=CH,
                                  connect_timeout=20) as c:
                toks = list(range(40))
                assert await c.put(toks, prefix_kv(spec, toks)) == 40
                return (await c.stats())["server"]

        st = asyncio.run(served())
        assert st["accept_backoffs"] >= 1
        assert proc.alive()
    finally:
        proc.stop()


def _registered_peer(path, spec, handles):
    """A raw connection that said hello and registered ``handles`` (vLLM pages)."""
    peer = RawPeer(path)
    peer.hello(spec)
    reg = peer.call("register", {"layout": "vllm", "handles": [h.to_wire() for h in handles]},
                    [h.fds[0] for h in handles])
    assert reg.ok, reg.error
    return peer, reg


async def test_requests_and_fds_per_peer_are_bounded(tmp_path):
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, max_requests_per_peer=3, max_fds_per_peer=4,
                       ready_timeout=30)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        pages = pages_for(spec, NB, BS)
        handles = [ipc.share(p) for p in pages]
        fds_before = len(os.listdir("/proc/self/fd"))

        def attack() -> list[str]:
            peer, reg = _registered_peer(cfg.socket_path, spec, handles)
            never = [ipc.IpcEvent.create("cpu") for _ in range(6)]
            errors = []
            for i, ev in enumerate(never):
                wire, efds = ev.export()
                peer.send("store", {"tokens": tok_bytes([i]), "slots": struct.pack("<q", i),
                                    "reg": reg.result["reg"], "ready": wire}, list(efds))
            # Three stores hang on their events; the next three are refused at once.
            for _ in range(3):
                errors.append(peer.recv().error["message"])
            peer.close()
            for ev in never:
                ev.close()
            return errors

        errors = await asyncio.to_thread(attack)
        assert all("max_requests_per_peer=3" in m for m in errors), errors
        assert srv.counters.limited == 3
        # The peer is gone: its hanging stores were cancelled and every fd released.
        for _ in range(100):
            if not srv._peers:
                break
            await asyncio.sleep(0.05)
        assert len(os.listdir("/proc/self/fd")) <= fds_before

        def fd_attack() -> str:
            peer = RawPeer(cfg.socket_path)
            peer.hello(spec)
            evs = [ipc.IpcEvent.create("cpu") for _ in range(5)]
            pairs = [e.export() for e in evs]
            reply = peer.call("store", {"tokens": tok_bytes([1]), "slots": struct.pack("<q", 0),
                                        "reg": 1, "ready": pairs[0][0]},
                              [fd for _, f in pairs for fd in f])
            peer.close()
            for e in evs:
                e.close()
            return error_type(reply), reply.error["message"]

        kind, message = await asyncio.to_thread(fd_attack)
        assert kind == "ServerLimitError" and "max_fds_per_peer=4" in message
        srv.stop()
        await serving


async def test_the_fds_all_requests_hold_are_bounded_by_the_open_file_limit(tmp_path):
    """Found by a probe: per-peer limits let 8 connections of never-set ready events hold
    1024 of the server's 1024 fds (each held fd is also duplicated by its wait), and the
    server then accepted nobody. Now the requests in flight of all connections together
    hold at most what RLIMIT_NOFILE leaves them; past it, a request bringing fds is refused
    (typed), and the server keeps accepting and answering."""
    from musacache.server import _fd_budget

    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, ready_timeout=30)
    soft = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0]
    assert _fd_budget(cfg) == max(64, min(soft, 1 << 20) - cfg.max_connections - 256)
    async with Server(cfg) as srv:
        srv.fd_budget = 20  # ten fds in flight, each counted with its wait's duplicate
        serving = asyncio.create_task(srv.serve_forever())
        pages = pages_for(spec, NB, BS)
        handles = [ipc.share(p) for p in pages]

        def attack() -> list[str]:
            peers, errors, events = [], [], []
            for _ in range(3):
                peer, reg = _registered_peer(cfg.socket_path, spec, handles)
                for i in range(4):
                    ev = ipc.IpcEvent.create("cpu")
                    events.append(ev)
                    wire, efds = ev.export()
                    peer.send("store", {"tokens": tok_bytes([i]),
                                        "slots": struct.pack("<q", i),
                                        "reg": reg.result["reg"], "ready": wire}, list(efds))
                peers.append(peer)
            # Ten stores hang on their events; the last two are refused at once.
            errors += [peers[2].recv().error["message"] for _ in range(2)]
            # Meanwhile a newcomer is accepted, answered, and refused fds past the budget.
            late = RawPeer(cfg.socket_path)
            late.hello(spec)
            assert late.call("lookup", {"tokens": tok_bytes([1, 2])}).ok
            ev = ipc.IpcEvent.create("cpu")
            wire, efds = ev.export()
            errors.append(late.call("store", {"tokens": tok_bytes([9]), "slots":
                                              struct.pack("<q", 9), "reg": 1, "ready": wire},
                                    list(efds)).error["message"])
            held.append(srv.held_fds)  # (an int, read while the peers still hold them)
            for p in [*peers, late]:
                p.close()
            for e in [*events, ev]:
                e.close()
            return errors

        held: list[int] = []
        errors = await asyncio.to_thread(attack)
        assert len(errors) == 3 and all("RLIMIT_NOFILE" in m for m in errors), errors
        assert held == [20]
        for _ in range(100):  # the peers are gone: their stores cancelled, their fds counted out
            if not srv._peers:
                break
            await asyncio.sleep(0.05)
        assert srv.held_fds == 0
        srv.stop()
        await serving


def test_musacache_serve_raises_its_open_file_limit_to_the_hard_one():
    import subprocess
    import sys

    code = ("import resource\n"
            "from musacache.server import _raise_open_file_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
            "_raise_open_file_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE), min(hard, 1 << 20))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    soft, hard, want = (int(x) for x in out)
    assert soft == want and hard >= soft


async def test_a_peer_that_never_reads_its_replies_cannot_grow_the_server(tmp_path):
    """A request counts as in flight until its reply is sent. It stopped counting once its
    reply was made, so a peer that sent requests and never read the replies had every one
    admitted, each reply held by a task behind the full socket: the server grew by 12 MiB/s
    under 40 such peers (found by a probe). Now the stuck replies fill the peer's quota and
    the rest are refused."""
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "n" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, max_requests_per_peer=4)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        peer = await asyncio.to_thread(RawPeer, cfg.socket_path)
        await asyncio.to_thread(peer.hello, spec)
        idle = len([t for t in asyncio.all_tasks() if not t.done()])
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.sock.setblocking(False)
        # stats: a reply of kilobytes, so the socket fills after a few dozen of them
        frames = b"".join(proto.encode_request(i + 10, "stats", {}) for i in range(400))
        sent = 0
        for _ in range(300):  # a few seconds of sending, never reading
            try:
                sent += peer.sock.send(frames[sent % len(frames):])
            except BlockingIOError:
                pass
            await asyncio.sleep(0.01)
        assert srv.counters.limited > 0  # the quota refused requests
        (p,) = srv._peers
        assert p.in_flight <= cfg.max_requests_per_peer
        # Each admitted request whose reply is stuck is a task: no more than the quota
        # (before: one more every refusal, without end).
        held = len([t for t in asyncio.all_tasks() if not t.done()]) - idle
        assert held <= cfg.max_requests_per_peer, held
        peer.close()
        for _ in range(100):
            if not srv._peers:
                break
            await asyncio.sleep(0.05)
        assert not srv._peers
        srv.stop()
        await serving


async def test_a_connection_that_never_says_hello_is_closed(tmp_path):
    """Silent sockets held every connection slot for as long as they stayed open (found by a
    probe: 512 of them locked every worker out). One that has not said hello within
    ``hello_timeout`` is closed; one that has is kept however long it idles."""
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "h" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, hello_timeout=0.3)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        silent = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        talker = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        await asyncio.to_thread(talker.hello, spec)
        await asyncio.sleep(0.8)
        assert await asyncio.to_thread(silent.sock.recv, 1) == b""  # closed by the server
        assert srv.counters.hello_timeouts == 1
        assert (await asyncio.to_thread(talker.call, "stats", {})).ok  # still served
        silent.close()
        talker.close()
        srv.stop()
        await serving


def _open_caches_slowly(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every cache the server opens takes ``seconds`` longer to open (a disk tier's scan)."""
    from musacache import server as srvmod

    real_open = srvmod.Cache.open

    async def slow_open(self: mc.Cache) -> None:
        await asyncio.sleep(seconds)
        await real_open(self)

    monkeypatch.setattr(srvmod.Cache, "open", slow_open)


async def test_a_hello_whose_cache_is_slow_to_open_is_not_cut_off(tmp_path, monkeypatch):
    """The first hello of a namespace opens its cache, which may take longer than
    ``hello_timeout`` (a disk tier's scan, an S3 listing). A hello that came in counts:
    closing the connection would cancel the open, at every retry (found by a review). A hello
    that fails starts the clock again."""
    spec = small_spec()
    _open_caches_slowly(monkeypatch, 0.6)
    cfg = ServerConfig(str(tmp_path / "o" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, hello_timeout=0.3)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        peer = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        assert (await asyncio.to_thread(peer.hello, spec)).ok
        assert srv.counters.hello_timeouts == 0 and len(srv.caches) == 1
        peer.close()
        # A hello that fails (a protocol it does not speak) leaves the clock running.
        bad = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        reply = await asyncio.to_thread(bad.call, "hello", {"protocol": 999})
        assert not reply.ok
        await asyncio.sleep(0.9)
        assert await asyncio.to_thread(bad.sock.recv, 1) == b""
        assert srv.counters.hello_timeouts == 1
        bad.close()
        srv.stop()
        await serving


async def test_a_hello_refused_at_the_door_leaves_the_hello_clock_running(tmp_path):
    """A hello refused before it runs (past a limit) is no hello in progress: the connection
    is still closed when ``hello_timeout`` passes, or refused hellos would hold its slot."""
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "d" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, hello_timeout=0.3, max_fds_per_peer=1)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        peer = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        fds = [os.eventfd(0) for _ in range(2)]
        try:
            reply = await asyncio.to_thread(
                peer.call, "hello", {"protocol": proto.PROTOCOL_VERSION, "monitor": True}, fds)
        finally:
            for fd in fds:
                os.close(fd)
        assert error_type(reply) == "ServerLimitError"
        await asyncio.sleep(0.9)
        assert await asyncio.to_thread(peer.sock.recv, 1) == b""  # closed by the server
        assert srv.counters.hello_timeouts == 1
        peer.close()
        srv.stop()
        await serving


async def test_a_second_hello_refused_while_the_first_opens_its_cache_keeps_the_first(
        tmp_path, monkeypatch):
    """Of two hellos sent back to back, the second is refused while the first still opens
    its cache; that refusal is not the first hello failing, so ``hello_timeout`` does not
    cut the first one's open short."""
    spec = small_spec()
    _open_caches_slowly(monkeypatch, 0.6)
    cfg = ServerConfig(str(tmp_path / "t" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                       chunk_size=CH, hello_timeout=0.3)
    args = {"protocol": proto.PROTOCOL_VERSION, "namespace": "srv", "spec": spec.to_dict(),
            "chunk_size": CH}
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        peer = await asyncio.to_thread(RawPeer, cfg.socket_path, 5.0)
        first = peer.send("hello", args)
        second = peer.send("hello", args)
        replies = {r.id: r for r in [await asyncio.to_thread(peer.recv) for _ in range(2)]}
        assert error_type(replies[second]) == "ProtocolError"
        assert replies[first].ok, replies[first].error
        assert srv.counters.hello_timeouts == 0 and len(srv.caches) == 1
        assert (await asyncio.to_thread(peer.call, "stats", {})).ok  # still served
        peer.close()
        srv.stop()
        await serving


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "10"])
def test_hello_timeout_is_checked(tmp_path, bad):
    with pytest.raises(mc.ConfigError, match="hello_timeout"):
        ServerConfig(str(tmp_path / "s.sock"), tiers=(mc.HostTier(1 << 20),), chunk_size=CH,
                     hello_timeout=bad)


def _fill_backlog(path: str) -> list[socket.socket]:
    """Connects that the kernel queues on a listener that accepts none, until it refuses."""
    fillers = []
    for _ in range(4):
        f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        f.setblocking(False)
        try:
            f.connect(path)
        except BlockingIOError:
            f.close()
            break
        fillers.append(f)
    assert fillers
    return fillers


async def test_a_connect_waits_out_a_full_listen_backlog(tmp_path):
    """On a Unix socket a non-blocking connect into a full backlog fails with EAGAIN and
    does nothing; the client took it for a connect in progress and handed back a socket
    that was never connected (found by a probe: 28 of 300 workers starting together failed
    their hello). It retries until the server accepts, or gives up with a typed error."""
    from musacache.ipc import _fdpass

    path = str(tmp_path / "l.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(0)
    fillers = _fill_backlog(path)
    connecting = asyncio.create_task(_fdpass.connect_unix(path))
    await asyncio.sleep(0.2)
    assert not connecting.done()  # still retrying: the backlog is full
    lsock.setblocking(False)
    accepted = []
    for _ in range(200):  # the server catches up
        try:
            accepted.append(lsock.accept()[0])
        except BlockingIOError:
            if connecting.done():
                break
            await asyncio.sleep(0.01)
    sock = await connecting
    assert sock.getpeername() == path
    sock.sendall(b"x")  # connected: a send works
    for s_ in (sock, *fillers, *accepted):
        s_.close()
    # Nobody ever accepts: a typed error once the wait is over.
    fillers = _fill_backlog(path)
    _fdpass.CONNECT_BACKLOG_WAIT, old = 0.2, _fdpass.CONNECT_BACKLOG_WAIT
    try:
        with pytest.raises(mc.CacheUnavailableError, match="backlog"):
            await _fdpass.connect_unix(path)
    finally:
        _fdpass.CONNECT_BACKLOG_WAIT = old
        for f in fillers:
            f.close()
        lsock.close()


# -- items 7 and 8: hostile frames and malformed requests ------------------------------------


def empty_array_flood(n: int) -> bytes:
    """A lookup whose tokens are an array of n empty arrays: n bytes that unpack to n lists."""
    body = (b"\x83" + msgpack.packb("id") + msgpack.packb(7) + msgpack.packb("op")
            + msgpack.packb("lookup") + msgpack.packb("args") + b"\x81"
            + msgpack.packb("tokens") + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
    return struct.pack(">2sBBI", proto.MAGIC, proto.PROTOCOL_VERSION, 0, len(body)) + body


def test_a_frame_cannot_amplify_into_server_memory(one_cache):
    proc, spec, _ = one_cache
    peer = RawPeer(proc.sock)
    peer.hello(spec)
    peak_before = proc.status("VmHWM")
    for _ in range(3):
        peer.send_raw(empty_array_flood(8 * 1024**2))  # 8 MiB
        reply = peer.recv()
        assert error_type(reply) == "ProtocolError" and "refused" in reply.error["message"]
    deep = b"\x91" * 5000 + b"\xc0"
    body = (b"\x83" + msgpack.packb("id") + msgpack.packb(8) + msgpack.packb("op")
            + msgpack.packb("stats") + msgpack.packb("args") + deep)
    peer.send_raw(struct.pack(">2sBBI", proto.MAGIC, proto.PROTOCOL_VERSION, 0, len(body)) + body)
    assert error_type(peer.recv()) == "ProtocolError"
    growth_mib = (proc.status("VmHWM") - peak_before) / 1024
    assert growth_mib < 64, f"the server's peak RSS grew by {growth_mib:.0f} MiB"
    assert peer.call("stats", {}).ok  # the connection is still usable
    peer.close()


def test_malformed_requests_are_protocol_errors_without_tracebacks(one_cache):
    proc, spec, log = one_cache
    peer = RawPeer(proc.sock)
    peer.hello(spec)
    toks = tok_bytes(list(range(8)))
    shared = ipc.empty_shared(spec.shape(8), spec.dtype)
    handle = ipc.share(shared)
    bad = {
        # a handle that claims an fd the frame did not carry
        "fd not sent": ("put", {"tokens": toks, "kv": handle.to_wire()}),
        "ready as a list": ("store", {"tokens": toks, "slots": struct.pack("<8q", *range(8)),
                                      "reg": 1, "ready": [1, 2]}),
        "a 1 TiB staging buffer": ("stage_bytes", {"total": 2**40, "offset": 0, "data": b"x"}),
        "tokens as a list": ("lookup", {"tokens": [1, 2, 3]}),
        "a bool where an int goes": ("unregister", {"reg": True}),
        "a string timeout": ("prefetch", {"tokens": toks, "timeout": "soon"}),
        "handles not a list": ("register", {"layout": "vllm", "handles": "all of them"}),
        "slots for other tokens": ("retrieve", {"tokens": toks, "slots": b"\0" * 8, "reg": 1}),
        "a second hello": ("hello", {"protocol": proto.PROTOCOL_VERSION, "monitor": True}),
    }
    for what, (op, args) in bad.items():
        reply = peer.call(op, args)
        assert error_type(reply) == "ProtocolError", (what, reply.error)
    peer.close()
    hello = RawPeer(proc.sock)
    assert error_type(hello.call("hello", {"protocol": proto.PROTOCOL_VERSION,
                                           "namespace": "x", "spec": "no"})) == "ProtocolError"
    hello.close()
    assert proc.alive()
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text


# -- item 9: the socket's folder ---------------------------------------------------------------


def test_an_open_folder_is_refused_and_never_chmodded(tmp_path):
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    with pytest.raises(mc.ConfigError, match="writable by others"):
        _listen(str(shared / "x.sock"))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert not (shared / "x.sock").exists()


def test_a_relative_path_leaves_the_current_folder_alone(tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    os.chmod(here, 0o755)
    monkeypatch.chdir(here)
    sock = _listen("x.sock")
    try:
        assert stat.S_IMODE(os.stat(here).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(here / "x.sock").st_mode) == 0o600
    finally:
        sock.close()


def test_a_symlinked_parent_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    os.chmod(target, 0o755)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(mc.ConfigError, match="symlink"):
        _listen(str(tmp_path / "link" / "x.sock"))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755


def test_a_missing_folder_is_created_private(tmp_path):
    sock = _listen(str(tmp_path / "new" / "deeper" / "x.sock"))
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700
    finally:
        sock.close()


def test_is_sealed_tells_empty_shared_from_share_memory():
    assert ipc.is_sealed(ipc.empty_shared((4,), torch.float32))
    plain = torch.zeros(4).share_memory_()
    assert ipc.is_shareable(plain) and not ipc.is_sealed(plain)


async def test_puts_and_stores_count_bytes_without_asking_for_stats(tmp_path, monkeypatch):
    """The server counts what its requests moved from their answers: asking every tier for its
    counters twice per put was most of a small put's cost (issue 12, item 3)."""
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 16),),
                       chunk_size=CH)
    calls = []
    real = mc.Cache.stats

    async def counting(self):
        calls.append(1)
        return await real(self)

    monkeypatch.setattr(mc.Cache, "stats", counting)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            pages = pages_for(spec, NB, BS)
            await c.register_kv_caches(pages, "vllm")
            toks = list(range(40))
            assert await c.put(toks, prefix_kv(spec, toks)) == 40
            ready = ipc.IpcEvent.create("cpu")
            ready.set()
            assert await c.store(list(range(100, 140)), list(range(40)), ready=ready) == 40
            ready.close()
            assert calls == []
            assert srv.counters.bytes_copied == 2 * spec.nbytes(40)
        srv.stop()
        await serving


@pytest.mark.parametrize("kwargs", [{"tenant": 123}, {"tenant": b"abc"}, {"tenant": ""},
                                    {"namespace": ""}, {"chunk_size": 0},
                                    {"chunk_size": True}])
def test_connect_refuses_bad_names_before_connecting(kwargs):
    args = {"spec": small_spec(), "namespace": "srv", **kwargs}
    with pytest.raises(mc.InvalidInputError):
        mc.connect("/nonexistent/s.sock", **args)


async def test_tenants_on_one_server_keep_apart_on_disk_across_a_restart(tmp_path):
    """Two tenants of one namespace share a server and its disk folder: each reaches only its
    own chunks, before and after the server restarts (and persists to disk on the way)."""
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH, max_caches=2,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 16),
                              mc.DiskTier(str(tmp_path / "disk"), "16MiB")))
    toks = list(range(500, 548))

    async def session(check):
        async with Server(cfg) as srv:
            serving = asyncio.create_task(srv.serve_forever())
            async with mc.connect(cfg.socket_path, spec=spec, namespace="srv",
                                  tenant="a") as a, \
                    mc.connect(cfg.socket_path, spec=spec, namespace="srv",
                               tenant="b") as b:
                await check(a, b)
            srv.stop()
            await serving

    async def first(a, b):
        assert await a.put(toks, prefix_kv(spec, toks)) == 48
        assert await b.lookup(toks) == 0
        await b.clear()

    async def after_restart(a, b):
        hit = await a.get(toks)
        assert hit.num_tokens == 48 and torch.equal(hit.kv, prefix_kv(spec, toks))
        assert await b.lookup(toks) == 0

    await session(first)
    await session(after_restart)


def test_a_spec_whose_sizes_overflow_is_refused():
    # Found by a probe: a hello with dims of 2**31 - 1 opened a cache whose stats held a slot
    # size of about 1e31, which msgpack cannot carry; every stats request then went unanswered.
    with pytest.raises(mc.ConfigError, match="bytes per token"):
        mc.KVSpec(2**31 - 1, 2**31 - 1, 2**31 - 1)
    assert mc.KVSpec(126, 8, 128).bytes_per_token < 2**20  # a 405B model's, far inside
    with pytest.raises(mc.ConfigError, match="smaller chunk_size"):
        mc.CacheConfig(spec=mc.KVSpec(2**12, 2**10, 2**7, torch.float32), namespace="n",
                       chunk_size=2**9)


async def test_a_result_the_wire_cannot_carry_is_answered_with_an_error(tmp_path):
    spec = small_spec()
    config = mc.CacheConfig(spec, "wire", tiers=(mc.HostTier(spec.nbytes(16) * 8),),
                            chunk_size=16)
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), config)
    async with Server(cfg) as srv:
        async def unencodable(peer, msg, fds):
            return {"slot_bytes": 2**70}  # past msgpack's 64-bit ints

        srv._handlers["stats"] = unencodable
        task = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="wire") as client:
            with pytest.raises(mc.ProtocolError, match="cannot encode"):
                await asyncio.wait_for(client.stats(), 10)
            assert await client.lookup(list(range(16))) == 0  # and it keeps serving
        srv.stop()
        await task
