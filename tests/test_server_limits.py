"""The node server's server-wide limits, found by a probe: fds parked in incomplete frames,
memory mappings, staging and frame-buffer bytes, cache and connection slots, and a second
hello. Each test fails on the server before its fix."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Any

import torch

import musacache as mc
from helpers import small_spec
from musacache import ipc
from musacache.ipc import _wire as proto
from musacache.server import Server, ServerConfig
from server_utils import pages_for
from test_server_hardening import CH, RawPeer, error_type, tok_bytes

NB, BS = 16, 4


def config(tmp_path, **limits: Any) -> ServerConfig:
    spec = small_spec()
    return ServerConfig(str(tmp_path / "l" / "s.sock"),
                        tiers=(mc.HostTier(spec.nbytes(CH) * 64),), chunk_size=CH, **limits)


async def until(check, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never came")


def ended_with(peer: RawPeer) -> str:
    """The type of the error a closed connection was told, then its end."""
    reply = peer.recv()
    assert reply.id is None
    kind = error_type(reply)
    try:
        end = peer.sock.recv(1)
    except ConnectionResetError:  # (it had sent bytes the server never read)
        end = b""
    assert end == b""
    return kind


def park_fds(peer: RawPeer, n: int) -> None:
    """A frame header that declares ``n`` fds, sent with them, and a body that never comes."""
    header = b"MK" + bytes([proto.PROTOCOL_VERSION, n]) + struct.pack(">I", 1 << 16)
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
    socket.send_fds(peer.sock, [header[:1]], fds)
    peer.sock.sendall(header[1:])
    ipc.close_fds(fds)


async def test_fds_of_incomplete_frames_are_bounded_and_timed_out(tmp_path):
    """Frames whose header declared 253 fds and whose body never came held their fds outside
    the fd budget, for ever: 9 connections filled the server's fd table, and it accepted
    nobody. Now incomplete frames hold at most half the budget (a connection past it is told
    ServerLimitError and closed), requests keep the other half, and a frame incomplete for
    ``frame_timeout`` closes its connection."""
    spec = small_spec()
    cfg = config(tmp_path, frame_timeout=0.6)
    async with Server(cfg) as srv:
        srv.fd_budget = 40  # incomplete frames may hold 20 fds
        serving = asyncio.create_task(srv.serve_forever())

        def attack() -> tuple[str, str]:
            first = RawPeer(cfg.socket_path)
            first.hello(spec)
            park_fds(first, 15)
            second = RawPeer(cfg.socket_path)
            second.hello(spec)
            park_fds(second, 15)  # 30 > 20: refused
            refused = ended_with(second)
            # A request bringing fds is still admitted (it fails for its own reason).
            good = RawPeer(cfg.socket_path)
            good.hello(spec)
            ev = ipc.IpcEvent.create("cpu")
            wire, efds = ev.export()
            reply = good.call("store", {"tokens": tok_bytes([1]), "slots": struct.pack("<q", 0),
                                        "reg": 1, "ready": wire}, list(efds))
            ev.close()
            timed_out = first.sock.recv(1, socket.MSG_PEEK)  # waits for frame_timeout
            for p in (first, second, good):
                p.close()
            return refused, (error_type(reply), timed_out)

        refused, (answer, timed_out) = await asyncio.to_thread(attack)
        assert refused == "ServerLimitError"
        assert answer == "InvalidInputError"  # "no registration 1": admitted, not limited
        assert timed_out == b""
        assert srv.counters.frame_timeouts == 1
        await until(lambda: not srv._peers)
        assert srv.parked_fds == 0 and srv.held_fds == 0
        srv.stop()
        await serving


async def test_memory_mappings_are_bounded_per_connection_and_in_all(tmp_path):
    """Registrations were unbounded: one client's 65k registered memfds filled the server's
    vm.max_map_count, and every mmap of the server failed for every tenant."""
    spec = small_spec()  # two layers: a registration maps two storages
    cfg = config(tmp_path, max_mappings_per_peer=4, max_mappings=6)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def register(peer: RawPeer) -> proto.Reply:
            pages = pages_for(spec, NB, BS)
            handles = [ipc.share(p) for p in pages]
            return peer.call("register", {"layout": "vllm",
                                          "handles": [h.to_wire() for h in handles]},
                             [h.fds[0] for h in handles])

        def attack() -> list[str]:
            a, b = RawPeer(cfg.socket_path), RawPeer(cfg.socket_path)
            a.hello(spec)
            b.hello(spec)
            out = []
            assert register(a).ok and register(a).ok
            out.append(register(a).error["message"])  # a fifth mapping for a
            assert register(b).ok
            out.append(register(b).error["message"])  # a seventh for the server
            assert a.call("unregister", {"reg": 1}).ok
            out.append("ok" if register(b).ok else "refused")
            a.close()
            b.close()
            return out

        out = await asyncio.to_thread(attack)
        assert "max_mappings_per_peer=4" in out[0]
        assert "max_mappings=6" in out[1]
        assert out[2] == "ok"
        srv.stop()
        await serving


async def test_staging_and_incomplete_frames_are_bounded_in_all(tmp_path):
    """Each connection could hold a max_stage_bytes staging buffer and a max-size
    incomplete frame, with nothing bounding them together: 3 idle connections took 3.2 GiB
    of the server, 512 would have had it OOM-killed."""
    spec = small_spec()
    kib = 1024
    cfg = config(tmp_path, max_stage_bytes=1024 * kib, max_frame_size=256 * kib,
                 max_buffered_bytes=1300 * kib)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def partial_frame(peer: RawPeer) -> None:
            header = b"MK" + bytes([proto.PROTOCOL_VERSION, 0]) + struct.pack(">I", 250 * kib)
            peer.sock.sendall(header + b"\0" * (200 * kib))

        def attack() -> tuple[str, str, list[RawPeer]]:
            a, b, c = (RawPeer(cfg.socket_path) for _ in range(3))
            for p in (a, b, c):
                p.hello(spec)
            assert a.call("stage_bytes", {"total": 1024 * kib, "offset": 0,
                                          "data": b"x" * 1024}).ok
            staged = b.call("stage_bytes", {"total": 1024 * kib, "offset": 0, "data": b""})
            partial_frame(b)  # 1224 KiB in all: kept
            partial_frame(c)  # 1424 KiB: c is told and closed
            return error_type(staged), ended_with(c), [a, b, c]

        staged, closed, peers = await asyncio.to_thread(attack)
        assert staged == "ServerLimitError" and closed == "ServerLimitError"
        assert srv.usage.staged == 1024 * kib
        for p in peers:
            p.close()
        await until(lambda: not srv._peers)
        assert srv.usage.staged == 0 and srv.usage.partial == 0
        srv.stop()
        await serving


async def test_a_cache_no_connection_uses_makes_room_for_another(tmp_path):
    """Hellos with made-up tenants opened caches that were never closed, so max_caches of
    them refused every other tenant until a restart. A cache no connection uses is now
    closed when a hello needs its slot; caches in use never are."""
    spec = small_spec()
    cfg = config(tmp_path, max_caches=2)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def slots() -> tuple[str, list[RawPeer]]:
            for tenant in ("junk-1", "junk-2"):
                p = RawPeer(cfg.socket_path)
                p.hello(spec, tenant=tenant)
                p.close()
            kept = []
            for tenant in ("victim", "other"):  # each closes an unused cache
                p = RawPeer(cfg.socket_path)
                p.hello(spec, tenant=tenant)
                kept.append(p)
            late = RawPeer(cfg.socket_path)
            reply = late.call("hello", {"protocol": proto.PROTOCOL_VERSION, "namespace": "srv",
                                        "spec": spec.to_dict(), "chunk_size": CH,
                                        "tenant": "late"})
            return error_type(reply), [*kept, late]

        kind, peers = await asyncio.to_thread(slots)
        assert kind == "ServerLimitError"  # both caches are in use
        assert srv.counters.cache_evictions == 2
        assert sorted(k[3] for k in srv.caches) == ["other", "victim"]
        for p in peers:
            p.close()
        srv.stop()
        await serving


async def test_an_idle_connection_is_closed_and_its_client_reconnects(tmp_path):
    """Connections that said hello and then nothing held their slots for ever (hello_timeout
    covers only the time before hello): max_connections of them locked everyone out. One
    with no request in flight that sends nothing for ``idle_timeout`` is closed; the client
    reconnects at its next call."""
    spec = small_spec()
    cfg = config(tmp_path, idle_timeout=0.3)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        idle = await asyncio.to_thread(RawPeer, cfg.socket_path)
        await asyncio.to_thread(idle.hello, spec)
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            assert await c.lookup([1, 2, 3]) == 0
            await asyncio.sleep(0.8)
            assert await asyncio.to_thread(idle.sock.recv, 1) == b""
            assert await c.lookup([1, 2, 3]) == 0
            assert c.reconnects == 1
        assert srv.counters.idle_timeouts >= 2
        idle.close()
        srv.stop()
        await serving


async def test_a_refused_connection_is_told_why(tmp_path):
    spec = small_spec()
    cfg = config(tmp_path, max_connections=1)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def connect() -> str:
            first = RawPeer(cfg.socket_path)
            first.hello(spec)
            second = RawPeer(cfg.socket_path)
            kind = ended_with(second)
            first.close()
            second.close()
            return kind

        assert await asyncio.to_thread(connect) == "ServerLimitError"
        srv.stop()
        await serving


async def test_a_second_hello_sent_at_once_is_refused(tmp_path):
    """Two hellos sent back to back were both accepted (the first had not finished when the
    second was checked), and the connection ended up bound to whichever cache opened last."""
    spec = small_spec()
    cfg = config(tmp_path)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def hellos() -> list[proto.Reply]:
            peer = RawPeer(cfg.socket_path)
            args = [{"protocol": proto.PROTOCOL_VERSION, "namespace": ns, "spec": s.to_dict(),
                     "chunk_size": CH, "tenant": None}
                    for ns, s in (("A", spec), ("B", small_spec(dtype=torch.float16)))]
            peer.send_raw(proto.encode_request(1, "hello", args[0])
                          + proto.encode_request(2, "hello", args[1]))
            replies = [peer.recv(), peer.recv()]
            peer.close()
            return replies

        replies = await asyncio.to_thread(hellos)
        assert sorted(r.ok for r in replies) == [False, True]
        assert [error_type(r) for r in replies if not r.ok] == ["ProtocolError"]
        assert len(srv.caches) == 1
        srv.stop()
        await serving


def test_the_new_limits_are_read_and_checked(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[tiers]]\nkind = "host"\ncapacity = 1048576\n[server]\n'
                    'max_mappings_per_peer = 8\nmax_mappings = 64\nidle_timeout = 30.0\n'
                    'frame_timeout = 2.0\nmax_buffered_bytes = 134217728\n')
    cfg = ServerConfig.from_toml(path, socket_path=str(tmp_path / "s.sock"))
    assert (cfg.max_mappings_per_peer, cfg.max_mappings, cfg.idle_timeout, cfg.frame_timeout,
            cfg.max_buffered_bytes) == (8, 64, 30.0, 2.0, 1 << 27)
    default = config(tmp_path)
    assert default.max_buffered_bytes == 2 * (default.max_stage_bytes + default.max_frame_size)
    for bad in ({"idle_timeout": 0}, {"frame_timeout": float("inf")}, {"max_mappings": 0},
                {"max_buffered_bytes": 1024}):
        try:
            config(tmp_path, **bad)
        except mc.ConfigError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


# -- found by a review probe of the limits above ---------------------------------------------


async def test_registers_at_once_cannot_pass_max_mappings_together(tmp_path) -> None:
    # Each register counted the others' mappings once, then opened its handles one by one in
    # worker threads: six registers at once all passed a limit of 8 and held 48.
    layers = 8
    spec = mc.KVSpec(num_layers=layers, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cfg = ServerConfig(str(tmp_path / "m" / "s.sock"), tiers=(mc.HostTier(spec.nbytes(CH) * 64),),
                       chunk_size=CH, max_mappings=layers, max_mappings_per_peer=layers)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        clients = [mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH)
                   for _ in range(6)]
        try:
            for c in clients:
                await c.open()

            def pages() -> list[torch.Tensor]:
                shape = (2, NB, BS, spec.num_kv_heads, spec.head_dim)
                return [ipc.empty_shared(shape, spec.dtype) for _ in range(layers)]

            got = await asyncio.gather(*[c.register_kv_caches(pages()) for c in clients],
                                       return_exceptions=True)
            assert sum(not isinstance(r, BaseException) for r in got) == 1
            assert all(isinstance(r, mc.ServerLimitError) for r in got
                       if isinstance(r, BaseException))
            assert srv._server_stats()["open_mappings"] <= cfg.max_mappings
        finally:
            for c in clients:
                await c.aclose()
            srv.stop()
            await serving


async def test_a_busy_connection_is_not_closed_by_frame_timeout(tmp_path) -> None:
    # frame_timeout measured how long the connection had had some frame incomplete, not the
    # age of the frame: a client whose every send ends inside a frame (each whole ~2 ms
    # later) was closed after frame_timeout.
    cfg = config(tmp_path, frame_timeout=0.5)
    spec = small_spec()
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def client() -> tuple[int, int]:
            import threading
            import time

            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(cfg.socket_path)
            sock.settimeout(10)
            decoder = proto.FrameDecoder(expect="reply")
            answered = [0]

            def read() -> None:  # replies read as they come, so neither side blocks
                while True:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    decoder.feed(data)
                    while decoder.next_frame() is not None:
                        answered[0] += 1

            reader = threading.Thread(target=read)
            reader.start()
            sock.sendall(proto.encode_request(1, "hello", {
                "protocol": proto.PROTOCOL_VERSION, "namespace": "srv",
                "spec": spec.to_dict(), "chunk_size": CH}))
            sent, carry, start = 0, b"", time.monotonic()
            while time.monotonic() - start < 1.5:
                frame = proto.encode_request(2 + sent, "lookup",
                                           {"tokens": struct.pack("<4i", 1, 2, 3, sent)})
                sock.sendall(carry + frame[: len(frame) // 2])
                carry = frame[len(frame) // 2:]
                sent += 1
                time.sleep(0.002)
            sock.sendall(carry)
            deadline = time.monotonic() + 10
            while answered[0] < sent + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            sock.shutdown(socket.SHUT_RDWR)
            reader.join()
            sock.close()
            return sent, answered[0]

        try:
            sent, answered = await asyncio.to_thread(client)
            assert answered == sent + 1
            assert srv.counters.frame_timeouts == 0
        finally:
            srv.stop()
            await serving


async def test_an_eviction_whose_hello_is_cancelled_still_persists(tmp_path) -> None:
    # The eviction ran in the hello's task: the evicting peer went away, its task was
    # cancelled, and the evicted cache's persist was cut short (its chunks were lost).
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "e" / "s.sock"),
                       tiers=(mc.HostTier(spec.nbytes(CH) * 4000),
                              mc.DiskTier(str(tmp_path / "disk"), 1 << 30)),
                       chunk_size=CH, max_caches=1)
    seqs = [list(range(i * 100000, i * 100000 + CH * 40)) for i in range(30)]
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        try:
            async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH,
                                  tenant="victim") as c:
                for s in seqs:
                    assert await c.put(s, torch.randn(spec.shape(len(s)))) == len(s)
            await until(lambda: not srv._caches.users)  # the victim's cache is unused now
            peer = RawPeer(cfg.socket_path)
            peer.send("hello", {"protocol": proto.PROTOCOL_VERSION, "namespace": "srv",
                                "spec": spec.to_dict(), "chunk_size": CH, "tenant": "other"})
            await asyncio.sleep(0.05)
            peer.sock.close()  # gone while the eviction persists
            await until(lambda: srv.counters.cache_evictions == 1, 60)
            async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH,
                                  tenant="victim") as c:
                for s in seqs:
                    assert await c.lookup(s) == len(s)
        finally:
            srv.stop()
            await serving
