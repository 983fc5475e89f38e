"""Evicting an idle cache whose deletes are still running never makes other clients wait:
the close runs outside the server's cache lock and never finishes the deletes on the loop.
Not timed: the CPU of the loop's longest turn while the evicting hello runs (as in
``test_server_budgets``), and the answers a client already connected got meanwhile."""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import numpy as np
import torch

import musacache as mc
from musacache.bench import hostile
from musacache.server import CacheKey, Server, ServerConfig
from test_server_budgets import TURN_CPU_S, most_cpu_per_turn

CH = hostile.CHUNK
SPEC = hostile.SPEC
PROMPTS = 4
CHUNKS = 4096  # per prompt: a delete of a few hundred loop turns
HANG_GUARD = 60.0


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 1 << 20, CHUNKS * CH).astype(np.int32) for _ in range(PROMPTS)]


async def _leave_deletes_running(sock: str, prompts: list[np.ndarray]) -> None:
    """Tenant ``a`` puts ``prompts``, sends a delete of each and goes away: the server's
    deletes go on in the cache's background."""
    kv = torch.zeros(SPEC.shape(CHUNKS * CH), dtype=SPEC.dtype)
    async with mc.connect(sock, spec=SPEC, namespace="evict", chunk_size=CH,
                          tenant="a") as a:
        for p in prompts:
            await a.put(p, kv)
        calls = [asyncio.ensure_future(a.delete(p)) for p in prompts]
        await asyncio.sleep(0.05)  # (on their way to the server)
    for t in calls:
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def _left_unused(srv: Server, sock: str) -> tuple[CacheKey, mc.Cache]:
    """Tenant ``a``'s key and cache, once it has left deletes running and the server has
    seen its connection end."""
    await _leave_deletes_running(sock, _prompts())
    key = next(k for k in srv.caches if k[3] == "a")
    with anyio.fail_after(HANG_GUARD):
        while key not in srv._caches.unused:  # noqa: ASYNC110 (the server's state)
            await asyncio.sleep(0.01)
    return key, srv.caches[key]


async def test_evicting_a_cache_with_deletes_running_keeps_other_clients_answered(tmp_path):
    sock = str(tmp_path / "e" / "s.sock")
    cfg = ServerConfig(sock, tiers=(mc.HostTier(SPEC.nbytes(CH) * PROMPTS * CHUNKS * 3),),
                       chunk_size=CH, max_caches=2,
                       cache_options={"close_timeout": 0.0})  # the deletes are cut at once
    toks = np.arange(CH * 4, dtype=np.int32)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(sock, spec=SPEC, namespace="polite", chunk_size=CH) as polite:
            await polite.put(toks, torch.ones(SPEC.shape(len(toks)), dtype=SPEC.dtype))
            _key, evicted = await _left_unused(srv, sock)
            assert (await evicted.stats())["in_flight"]["background"] > 0

            answers: list[int] = []
            during: list[int] = []  # answers that came while b's hello was open
            helloing = [True]

            async def lookups() -> None:
                while True:
                    answers.append(await polite.lookup(toks))
                    if helloing[0]:
                        during.append(answers[-1])
                    await asyncio.sleep(0)

            async def hello_b() -> None:
                try:
                    async with mc.connect(sock, spec=SPEC, namespace="evict", chunk_size=CH,
                                          tenant="b") as b:
                        assert await b.lookup(toks) == 0
                finally:
                    helloing[0] = False

            calls = asyncio.ensure_future(lookups())
            try:
                with anyio.fail_after(HANG_GUARD):
                    most = await most_cpu_per_turn(hello_b)
            finally:
                calls.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await calls
        srv.stop()
        await serving
        assert srv.counters.cache_evictions == 1
    close = (await evicted.stats())["close"]
    assert close["deletes_cut"] > 0, close  # the eviction cut the deletes short
    assert during and set(answers) == {len(toks)}
    assert most < TURN_CPU_S, f"one turn of the loop took {most * 1e3:.0f} ms of CPU"


async def test_a_hello_for_the_cache_being_closed_waits_and_opens_it_afresh(tmp_path):
    """Tenant ``a`` comes back while its cache is being evicted: its hello waits for that
    close (never the half-closed cache) and gets a new one."""
    sock = str(tmp_path / "f" / "s.sock")
    cfg = ServerConfig(sock, tiers=(mc.HostTier(SPEC.nbytes(CH) * PROMPTS * CHUNKS * 3),),
                       chunk_size=CH, max_caches=2, cache_options={"close_timeout": 0.0})
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(sock, spec=SPEC, namespace="evict", chunk_size=CH,
                              tenant="b"):
            key_a, old = await _left_unused(srv, sock)
            closing = srv._caches._evict()
            assert closing is not None and key_a not in srv.caches
            with anyio.fail_after(HANG_GUARD):
                async with mc.connect(sock, spec=SPEC, namespace="evict", chunk_size=CH,
                                      tenant="a") as a:
                    assert closing.done()  # the hello waited for the close
                    assert srv.caches[key_a] is not old
                    assert (await old.stats())["state"] == "closed"
                    assert await a.lookup(_prompts()[0]) == 0
        srv.stop()
        await serving
    assert not srv._caches.closing
