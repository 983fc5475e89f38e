"""A peer's cleanup in the node server runs to its end whatever cancels it: anyio's scopes
and plain ``task.cancel()`` (asyncio.run's at shutdown) alike."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache.server import Server, ServerConfig

CH = 16


def _runs(task: asyncio.Task[Any], qualname: str) -> bool:
    """Whether ``task`` is inside a coroutine named ``qualname`` (at any depth)."""
    coro: Any = task.get_coro()
    while coro is not None:
        if getattr(coro, "__qualname__", None) == qualname:
            return True
        coro = getattr(coro, "cr_await", None)
    return False


async def test_a_plain_cancel_while_ops_end_still_releases_the_peer(tmp_path):
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 16),))
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        c = mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH)
        await c.__aenter__()
        toks = list(range(2 * CH))
        await c.put(toks, prefix_kv(spec, toks))  # opens the cache
        started, ending = asyncio.Event(), asyncio.Event()

        async def slow_to_end(peer: Any, msg: Any, fds: list[int]) -> Any:
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                # An op whose cleanup takes turns of the loop (a cache op letting go of
                # its pins in runs): the peer's end waits for it.
                ending.set()
                for _ in range(20):
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        pass

        srv._handlers["delete"] = slow_to_end  # (lookup and get may be answered at once)
        pending = asyncio.create_task(c.delete(toks))
        await started.wait()
        (peer,) = srv._peers
        (task,) = [t for t in asyncio.all_tasks() if _runs(t, "Server._serve_peer")]
        fds_before = len(os.listdir("/proc/self/fd"))
        task.cancel()  # lands where it waits for frames: its finally cancels the op
        await ending.wait()
        assert not task.done()  # waiting for the op to end
        task.cancel()  # a second plain cancel, meanwhile
        done, _ = await asyncio.wait([task], timeout=10)
        assert task in done and task.cancelled()
        assert peer not in srv._peers and not peer.buffers  # released
        assert len(os.listdir("/proc/self/fd")) < fds_before  # its socket closed
        done, _ = await asyncio.wait([pending], timeout=10)
        assert pending in done and isinstance(pending.exception(), mc.MusaCacheError)
        await c.aclose()
        srv.stop()
        await serving


async def test_a_call_cancelled_in_flight_never_lends_its_staging_buffer_to_the_next(tmp_path):
    """Found by a probe: a put (get, put_pages, get_pages) of private memory cancelled after
    its request went out gave its staging buffer back while the server still read (or wrote)
    it; the next call's KV was copied in, and stored under the first call's prompt."""
    import torch

    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 4096),))
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="ns",
                              chunk_size=CH) as client:
            for i in range(10):
                a = list(range(1000 * i, 1000 * i + 4 * CH))
                b = [x + 500 for x in a]
                kv_a, kv_b = prefix_kv(spec, a), prefix_kv(spec, b)
                put_a = asyncio.create_task(client.put(a, kv_a))
                await asyncio.sleep(0)  # its request is out
                put_a.cancel()
                await asyncio.gather(put_a, return_exceptions=True)
                await client.put(b, kv_b)
                await asyncio.sleep(0.02)  # the first put's server side ends
                hit = await client.get(a)
                assert torch.equal(hit.kv, kv_a.narrow(spec.token_dim, 0, hit.num_tokens))
                get_a = asyncio.create_task(client.get(a))
                await asyncio.sleep(0)
                get_a.cancel()
                await asyncio.gather(get_a, return_exceptions=True)
                c = [x + 700 for x in a]
                await client.put(c, prefix_kv(spec, c))
                await asyncio.sleep(0.02)
                hit = await client.get(c)
                assert torch.equal(hit.kv, prefix_kv(spec, c).narrow(spec.token_dim, 0,
                                                                     hit.num_tokens))
        srv.stop()
        await serving


async def test_calls_racing_a_reconnect_wait_for_its_hello_and_registrations(tmp_path):
    """Found by a probe: the client published a new connection before its hello was
    answered, so other tasks' calls went out first and were refused ("the first request on a
    connection must be hello"); and stores sent a registration's number from the old
    connection, which named other pages on the new one, or registered the pages again
    meanwhile. Each restart of the server here is met by many calls at once."""
    import torch

    from musacache import ipc

    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 4096),))
    client = mc.connect(cfg.socket_path, spec=spec, namespace="ns", chunk_size=CH,
                        connect_timeout=5)
    signed = []  # one registration all positive, one all negative
    for sign in (1.0, -1.0):
        pages = [ipc.empty_shared((2, 64, CH, spec.num_kv_heads, spec.head_dim), spec.dtype)
                 for _ in range(spec.num_layers)]
        for p in pages:
            p.copy_(sign * (torch.rand(p.shape) + 1.0))
        signed.append(pages)
    errors: list[str] = []
    stored: dict[tuple[int, int, int], list[int]] = {}
    checked = [0]
    for round_ in range(4):
        async with Server(cfg) as srv:
            serving = asyncio.create_task(srv.serve_forever())
            if round_ == 0:
                await client.__aenter__()
                for pages in signed:
                    await client.register_kv_caches(pages, "vllm")
            else:
                async def one(k: int, which: int, round_: int = round_) -> None:
                    toks = list(range(10**6 * round_ + 10**5 * which + 1000 * k,
                                      10**6 * round_ + 10**5 * which + 1000 * k + CH))
                    for _ in range(k):
                        await asyncio.sleep(0)
                    try:
                        assert await client.lookup(toks) == 0
                        if await client.store(toks, list(range(CH * (k % 64), CH * (k % 64 + 1))),
                                              reg=which) == CH:
                            stored[(round_, k, which)] = toks
                    except mc.CacheUnavailableError:
                        pass  # the old connection failing fast is fine
                    except mc.MusaCacheError as e:
                        errors.append(f"{type(e).__name__}: {e}")

                await asyncio.gather(*(one(k, w) for k in range(30) for w in (0, 1)))
                checked[0] += len(stored)
                for (_r, _k, which), toks in stored.items():
                    hit = await client.get(toks)
                    assert hit.num_tokens == CH
                    assert bool((hit.kv < 0).all() if which else (hit.kv > 0).all())
                stored.clear()
            srv.stop()
            await serving
    await client.aclose()
    assert errors == [] and checked[0] > 60


async def test_callers_waiting_on_a_server_that_never_answers_fail_together(tmp_path):
    """Found by a probe: against a server that accepts connections but never answers (a
    stopped process), each waiting caller tried to connect in turn, the k-th waiting k
    timeouts. Callers that waited for a failed attempt now share its error."""
    import contextlib
    import socket
    import time

    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 64),))
    client = mc.connect(cfg.socket_path, spec=spec, namespace="ns", chunk_size=CH,
                        timeout=0.5, connect_timeout=0.5)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        await client.__aenter__()
        assert await client.lookup([1, 2, 3]) == 0
        srv.stop()
        await serving
    # In its place, a socket the kernel accepts connections on and nobody reads.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cfg.socket_path)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(cfg.socket_path)
    hung.listen(64)
    try:
        async def one() -> float:
            t0 = time.monotonic()
            with pytest.raises(mc.CacheUnavailableError):
                await client.lookup([1, 2, 3])
            return time.monotonic() - t0

        waits = await asyncio.gather(*(one() for _ in range(12)))
        assert max(waits) < 3 * 0.5 + 1.0, waits  # one attempt's timeout, not twelve
        await client.aclose()
    finally:
        hung.close()
