"""The node server's request path (issue 12, server goals): what a request may touch, and the
client buffers the server keeps mapped. Speed itself is shown by ``musacache bench scale
--only server``."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import weakref
from typing import Any

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import ipc
from musacache.engine.directory import KeyTable
from musacache.ipc import _table
from musacache.ipc import _wire as proto
from musacache.server import Server, ServerConfig
from test_server_hardening import RawPeer

CH = 16


def _config(tmp_path, spec: mc.KVSpec, **kw: Any) -> ServerConfig:
    return ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                        tiers=(mc.HostTier(spec.nbytes(CH) * 64),), **kw)


class _NoWalk(KeyTable):
    """A directory whose entries may be looked up but not walked (it shares the real
    table's shards, so lookups and inserts land in the real directory)."""

    def __init__(self, real: KeyTable) -> None:
        super().__init__()
        self._shards, self._n, self._cursor = real._shards, real._n, real._cursor

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a request walked every directory entry")

    def items(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a request walked every directory entry")

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a request walked every directory entry")


async def test_server_requests_never_walk_the_directory(tmp_path):
    """Issue 12 item 3: a server put called stats() twice, which summed the pins of every
    directory entry. Requests now count bytes from their answers and pins with a counter:
    with a directory that refuses to be walked, every dense op still works."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            await c.put(list(range(CH)), prefix_kv(spec, list(range(CH))))  # opens the cache
            eng = srv.cache._engine
            real = eng.dir.entries
            eng.dir.entries = _NoWalk(real)
            try:
                toks = list(range(100, 100 + 3 * CH))
                assert await c.put(toks, prefix_kv(spec, toks)) == 3 * CH
                assert await c.lookup(toks) == 3 * CH
                hit = await c.get(toks)
                assert hit.num_tokens == 3 * CH
                assert torch.equal(hit.kv, prefix_kv(spec, toks))
                assert (await c.stats())["pins"] == 0
            finally:
                real._n = eng.dir.entries._n  # the puts above counted in the wrapper
                eng.dir.entries = real
        srv.stop()
        await serving


async def test_a_reused_get_buffer_is_mapped_once_without_a_thread(tmp_path, monkeypatch):
    """A dense get used to map the client's buffer in a worker thread on every call. The
    server now keeps the mapping for the connection: the first get maps it (inline, for
    CPU memory), the next ones name it by id."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    opened: list[str] = []
    real_open, real_aopen = _table.MappingTable.open_tensor, _table.MappingTable.aopen_tensor

    def counting_open(self, handle, fds=()):  # type: ignore[no-untyped-def]
        opened.append("inline")
        return real_open(self, handle, fds)

    async def counting_aopen(self, handle, fds=()):  # type: ignore[no-untyped-def]
        opened.append("thread")
        return await real_aopen(self, handle, fds)

    monkeypatch.setattr(_table.MappingTable, "open_tensor", counting_open)
    monkeypatch.setattr(_table.MappingTable, "aopen_tensor", counting_aopen)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(2 * CH))
            kv = ipc.to_shared(prefix_kv(spec, toks))
            assert await c.put(toks, kv) == 2 * CH
            out = ipc.empty_shared(spec.shape(2 * CH), spec.dtype)
            opened.clear()
            for _ in range(5):
                out.zero_()
                hit = await c.get(toks, out=out)
                assert hit.num_tokens == 2 * CH and torch.equal(out, kv)
            assert opened == ["inline"]
            (peer,) = srv._peers
            assert len(peer.buffers) == 2  # the put's kv and the get's out
            assert (await c.stats())["server"]["buffers"] == 2
        srv.stop()
        await serving


async def test_kept_buffers_are_bounded_and_released_when_freed(tmp_path):
    spec = small_spec()
    cfg = _config(tmp_path, spec, max_buffers_per_peer=3)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(CH))
            kv = prefix_kv(spec, toks)
            assert await c.put(toks, ipc.to_shared(kv)) == CH
            (peer,) = srv._peers
            outs = [ipc.empty_shared(spec.shape(CH), spec.dtype) for _ in range(6)]
            for round_ in range(2):
                for out in outs:
                    out.zero_()
                    assert (await c.get(toks, out=out)).num_tokens == CH
                    assert torch.equal(out, kv), round_
                    assert len(peer.buffers) <= 3  # the server's limit, learnt at hello
            # A freed buffer is released with the next request; the rest stay correct.
            del outs
            gc.collect()
            assert await c.lookup(toks) == CH
            out = ipc.empty_shared(spec.shape(CH), spec.dtype)
            assert (await c.get(toks, out=out)).num_tokens == CH and torch.equal(out, kv)
            assert len(peer.buffers) <= 3
            assert srv.counters.errors == 0
        srv.stop()
        await serving


async def test_buffer_ids_are_checked_and_never_crash_the_server(tmp_path):
    spec = small_spec()
    cfg = _config(tmp_path, spec, max_buffers_per_peer=1)
    out = ipc.empty_shared(spec.shape(CH), spec.dtype)
    other = ipc.empty_shared(spec.shape(CH), spec.dtype)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())

        def attack() -> list[proto.Reply]:
            peer = RawPeer(cfg.socket_path)
            assert peer.hello(spec).ok
            toks = bytes(range(4 * CH))
            h, h2 = ipc.share(out), ipc.share(other)
            replies = [
                # a buffer this connection never sent
                peer.call("get", {"tokens": toks, "buf": 7}),
                # mapped and kept as buffer 1
                peer.call("get", {"tokens": toks, "out": h.to_wire(), "buf": 1}, list(h.fds)),
                # the same id again
                peer.call("get", {"tokens": toks, "out": h.to_wire(), "buf": 1}, list(h.fds)),
                # past max_buffers_per_peer
                peer.call("get", {"tokens": toks, "out": h2.to_wire(), "buf": 2}, list(h2.fds)),
                # malformed ids
                peer.call("get", {"tokens": toks, "buf": -1}),
                peer.call("get", {"tokens": toks, "buf": 1, "release": ["x"]}),
                # by id alone: works (a miss)
                peer.call("get", {"tokens": toks, "buf": 1}),
                # released, then gone
                peer.call("get", {"tokens": toks, "buf": 1, "release": [1]}),
            ]
            peer.sock.close()
            return replies

        r = await asyncio.to_thread(attack)
        assert r[0].error["type"] == "InvalidInputError" and "no buffer 7" in r[0].error["message"]
        assert r[1].ok
        assert r[2].error["type"] == "ProtocolError"
        assert r[3].error["type"] == "ServerLimitError"
        assert r[4].error["type"] == "ProtocolError" and r[5].error["type"] == "ProtocolError"
        assert r[6].ok and r[6].result["num_tokens"] == 0
        assert r[7].error["type"] == "InvalidInputError"
        for _ in range(100):
            if not srv._peers:
                break
            await asyncio.sleep(0.02)
        assert not srv._peers
        # The server still serves.
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            assert await c.lookup(list(range(CH))) == 0
        srv.stop()
        await serving


async def test_a_silent_server_times_out(tmp_path):
    """The client's deadline is a timer on the reply: a server that reads but never answers
    still fails the call within the timeout, and the next call reconnects."""
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.setblocking(False)
    conns: list[proto.Connection] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            conn = proto.Connection(sock, expect="request")
            conns.append(conn)
            hello = await conn.receive()
            assert isinstance(hello, proto.Request)
            await conn.send_reply(hello.id, {"protocol": proto.PROTOCOL_VERSION})

    serving = asyncio.create_task(serve())
    try:
        async with mc.connect(path, spec=small_spec(), namespace="s", timeout=0.5) as c:
            t0 = time.monotonic()
            with pytest.raises(mc.CacheUnavailableError, match="did not answer lookup"):
                await c.lookup(list(range(CH)))
            assert time.monotonic() - t0 < 5
            with pytest.raises(mc.CacheUnavailableError, match="did not answer lookup"):
                await c.lookup(list(range(CH)))
            assert c.reconnects == 1
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        for conn in conns:
            await conn.aclose()
        listener.close()


async def test_views_cycling_past_the_limit_stay_correct_and_bounded(tmp_path):
    """Gets without a shared ``out`` go through one staging buffer, a view of another shape
    for each length: more views than the server keeps. Each comes back right, and the
    client watches each memory once, however often its views come and go."""
    spec = small_spec()
    cfg = _config(tmp_path, spec, max_buffers_per_peer=2)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(5 * CH))
            kv = prefix_kv(spec, toks)
            assert await c.put(toks, kv) == 5 * CH
            finalizers = len(weakref.finalize._registry)  # type: ignore[attr-defined]
            for _ in range(10):
                for n in range(1, 6):
                    hit = await c.get(toks[:n * CH])
                    assert hit.num_tokens == n * CH
                    assert torch.equal(hit.kv, prefix_kv(spec, toks[:n * CH]))
            (peer,) = srv._peers
            assert len(peer.buffers) <= 2
            assert len(weakref.finalize._registry) <= finalizers + 2  # type: ignore[attr-defined]
            assert srv.counters.errors == 0
        srv.stop()
        await serving


async def test_lookup_and_kept_buffer_get_answer_right(tmp_path):
    """A lookup, and a get into a buffer the connection keeps, answer the cached prefix; a
    partial chunk's prefix is matched too, and many may be in flight at once."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(2 * CH))
            kv = ipc.to_shared(prefix_kv(spec, toks))
            assert await c.put(toks, kv) == 2 * CH
            out = ipc.empty_shared(spec.shape(3 * CH), spec.dtype)
            longer = [*toks, *range(1000, 1000 + CH)]
            for _ in range(3):
                assert await c.lookup(longer) == 2 * CH
                assert await c.lookup([7, 7, 7]) == 0
                out.zero_()
                hit = await c.get(longer, out=out)
                assert hit.num_tokens == 2 * CH and hit.tiers == {"host": 2 * CH}
                assert torch.equal(out.narrow(spec.token_dim, 0, 2 * CH), kv)
                assert not out.narrow(spec.token_dim, 2 * CH, CH).any()
                assert await asyncio.gather(*(c.lookup(toks[:n]) for n in (CH, CH + 3, 5))) \
                    == [CH, CH + 3, 5]
            counters = (await c.stats())["server"]
            assert counters["requests"] >= 1 + 1 + 3 * 6 and counters["errors"] == 0
        srv.stop()
        await serving


async def test_request_errors_are_typed_replies(tmp_path, monkeypatch):
    """A failure inside a request is answered as a musacache error with its type, a server
    bug as MusaCacheError (and logged); the connection and the server go on."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(CH))
            assert await c.put(toks, prefix_kv(spec, toks)) == CH
            failures = iter([mc.InvalidInputError("refused here"), RuntimeError("a bug")])

            async def failing(tokens):  # type: ignore[no-untyped-def]
                raise next(failures)

            monkeypatch.setattr(srv.cache, "lookup", failing)
            with pytest.raises(mc.InvalidInputError, match="refused here"):
                await c.lookup(toks)
            with pytest.raises(mc.MusaCacheError, match="RuntimeError: a bug"):
                await c.lookup(toks)
            monkeypatch.undo()
            assert await c.lookup(toks) == CH
            assert (await c.stats())["server"]["errors"] == 2
        srv.stop()
        await serving


async def test_a_flood_of_lookups_is_paced_by_the_in_flight_limit(tmp_path):
    """A peer that keeps its socket full of lookups cannot hold the loop: each is a request
    in flight, and those past ``max_requests_per_peer`` are refused with a typed error that
    names the limit. Every frame is answered, and another connection is served meanwhile."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(CH))
            assert await c.put(toks, prefix_kv(spec, toks)) == CH
            raw = torch.tensor(toks, dtype=torch.int32).numpy().tobytes()

            def flood() -> list[proto.Reply]:
                peer = RawPeer(cfg.socket_path)
                assert peer.hello(spec).ok
                frames = b"".join(proto.encode_request(i, "lookup", {"tokens": raw})
                                  for i in range(100, 1100))
                peer.send_raw(frames)
                replies = [peer.recv() for _ in range(1000)]
                peer.sock.close()
                return replies

            flooding = asyncio.create_task(asyncio.to_thread(flood))
            served = 0
            while not flooding.done():
                assert await c.lookup(toks) == CH  # the other connection is served
                served += 1
            replies = await flooding
            assert sorted(r.id for r in replies) == list(range(100, 1100))
            ok = [r for r in replies if r.ok]
            assert ok and all(r.result == CH for r in ok)
            for r in replies:
                if not r.ok:
                    assert "max_requests_per_peer" in str(r.error), r
            assert served >= 1
        srv.stop()
        await serving
