"""Work that must finish once started, cancelled by a plain ``task.cancel()`` (what the node
server does to the ops of a peer that went away, and ``asyncio.wait_for`` on a timeout):
anyio's shield does not hold that off. Found by a review: a long get or put cancelled while
letting go of its pins kept the rest pinned for good, and a delete cancelled between its
batches left the prompt's later chunks live, for a put of new KV to chain onto (a get then
served deleted KV after the new)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import small_spec

CH, N = 2, 700


def _cfg(spec: mc.KVSpec, chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "cancel", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * chunks),))


async def _cancel_after(coro: object, turns: int) -> None:
    task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.mark.parametrize("op", ["get", "put"])
async def test_a_long_read_or_put_cancelled_anywhere_lets_go_of_every_pin(op):
    spec = small_spec()
    toks = np.arange(1, N * CH + 1, dtype=np.int32)
    kv = torch.randn(spec.shape(N * CH))
    for turns in range(0, 60):
        async with mc.Cache(_cfg(spec, 2 * N + 50)) as c:
            if op == "get":
                await c.put(toks, kv)
                await _cancel_after(c.get(toks), turns)
            else:
                await _cancel_after(c.put(toks, kv), turns)
            await asyncio.sleep(0.01)
            assert c._engine.pins_held == 0, (op, turns, c._engine.pins_held)
            assert all(e.pins == 0 for e in c._engine.dir.entries.values())


async def test_a_delete_cancelled_anywhere_still_removes_all_of_the_prompt():
    spec = small_spec()
    n = 300
    toks = np.arange(1, n * CH + 1, dtype=np.int32)
    old = torch.randn(spec.shape(n * CH))
    new = old + 1000
    for turns in range(1, 16):
        async with mc.Cache(_cfg(spec, 2 * n + 50)) as c:
            await c.put(toks, old)
            await _cancel_after(c.delete(toks), turns)
            await c.flush()  # the rest of the delete ran in the background
            assert len(c._engine.dir) == 0, turns
            assert await c.lookup(toks) == 0
            await c.put(toks, new)
            hit = await c.get(toks)
            assert hit.num_tokens == n * CH and torch.equal(hit.kv, new), turns
