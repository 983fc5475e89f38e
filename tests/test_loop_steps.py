"""What one step of the event loop may do during directory work (no loop stall over 10 ms).
Not timings: the memory a step allocates or frees (tracemalloc, the allocator's blocks),
what stats() shows changing in one turn of the loop, and that entries are freed by their
reference counts alone. Speed itself is shown by ``musacache bench scale --only stalls``."""

from __future__ import annotations

import gc
import itertools
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import StepMemory, most_per_turn, stats_per_turn
from musacache.bench.scale import _listing
from musacache.engine.core import BATCH
from musacache.engine.directory import Entry, KeyTable
from musacache.tiers.listing import ChunkListing

CH = 16
TINY = mc.KVSpec(1, 1, 8, torch.float16)
# A step removes or frees BATCH entries, of about 300 bytes each (the entry, its key and its
# token ids): a step that builds or drops a list of every child of a wide node is well past
# this (8 bytes a child: 160 KiB for the 20,000 children below).
STEP_BYTES = 64 * 1024
SIBLINGS = 20_000


def _cfg(chunks: int, **kw: object) -> mc.CacheConfig:
    return mc.CacheConfig(TINY, "steps", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * chunks),),
                          **kw)  # type: ignore[arg-type]


async def _wide(c: mc.Cache) -> np.ndarray:
    """A shared prefix with SIBLINGS conversations after it; returns the prefix."""
    return await _wide_of(c, SIBLINGS, seed=1)


async def _wide_of(c: mc.Cache, n: int, seed: int = 2) -> np.ndarray:
    """A shared prefix with ``n`` one-chunk conversations after it; returns the prefix."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 128000, CH).astype(np.int32)
    kv = torch.zeros(TINY.shape(2 * CH), dtype=TINY.dtype)
    await c.put(system, torch.zeros(TINY.shape(CH), dtype=TINY.dtype))
    for conv in rng.integers(0, 128000, (n, CH)).astype(np.int32):
        await c.put(np.concatenate([system, conv]), kv)
    return system


def _most_change(seen: list[dict[str, Any]], what: Callable[[dict[str, Any]], int]) -> int:
    """The most ``what`` rose or fell across one turn of the loop."""
    values = [what(st) for st in seen]
    return max((abs(b - a) for a, b in itertools.pairwise(values)), default=0)


def _pins(st: dict[str, Any]) -> int:
    return int(st["pins"])


def _host_chunks(st: dict[str, Any]) -> int:
    return int(st["tiers"]["host"]["chunks"])


async def _chunks(c: mc.Cache) -> int:
    return int((await c.stats())["chunks"])


async def test_deleting_a_prompt_with_many_descendants_frees_them_a_batch_per_step():
    """The walk takes a key's children out of the directory as a whole and then out of their
    index a batch at a time: no step builds a list of all of them (before: a snapshot of
    20,000 children in one step, 13 to 17 ms at 200,000), and none drops one."""
    async with mc.Cache(_cfg(SIBLINGS + 8)) as c:
        system = await _wide(c)
        assert await _chunks(c) == SIBLINGS + 1
        m = StepMemory()
        await m.measure(lambda: c.delete(system))
        assert await _chunks(c) == 0
        assert m.turns > SIBLINGS // BATCH  # it did run in batches
        assert m.grew < STEP_BYTES, m.grew
        assert m.shrank < STEP_BYTES, m.shrank


async def test_clearing_a_wide_directory_frees_it_a_batch_per_step():
    """``clear`` drains an index of many children in batches; before, dropping the shared
    prefix's entry dropped its index of 20,000 children in one step."""
    async with mc.Cache(_cfg(SIBLINGS + 8)) as c:
        await _wide(c)
        m = StepMemory()
        await m.measure(c.clear)
        assert await _chunks(c) == 0
        assert (await c.stats())["tiers"]["host"]["bytes_used"] == 0
        assert m.grew < STEP_BYTES, m.grew
        assert m.shrank < STEP_BYTES, m.shrank


@pytest.mark.parametrize("slow", [False, True])
async def test_a_clear_takes_fewer_entries_in_a_step_that_ran_long(monkeypatch, slow):
    """The last entries of a large directory are the last objects of most of the
    allocator's arenas, each unmapped as it empties: a batch of them was a step of 4 to
    7 ms at the end of a clear of 1.25 million. A step takes entries a few at a time until
    it has run long enough: here a clock that says every few entries took a second."""
    from musacache.engine import removal as _removal

    if slow:
        ticks = iter(range(10**9))
        monkeypatch.setattr(_removal, "_clock", lambda: float(next(ticks)))
    n = 5 * BATCH
    async with mc.Cache(_cfg(n)) as c:
        toks = np.random.default_rng(3).integers(0, 128000, n * CH).astype(np.int32)
        await c.put(toks, torch.zeros(TINY.shape(n * CH), dtype=TINY.dtype))
        seen = await stats_per_turn(c, c.clear)
        assert _host_chunks(seen[0]) == n and _host_chunks(seen[-1]) == 0
        most = _most_change(seen, _host_chunks)
        if slow:
            assert 0 < most < BATCH // 2, most
        else:  # a fast step takes a whole batch
            assert most == BATCH and len(seen) < 2 * n // BATCH


def test_a_key_table_behaves_as_a_dict():
    """The directory's key table is sharded (so that no one table of every entry grows in
    one step); to the directory and its readers it must be a plain dict, emptied by
    ``popitem`` as a clear or close takes it apart."""
    t, model = KeyTable(), {}
    rng = random.Random(8)
    keys = [rng.randbytes(16) for _ in range(3000)]
    for step in range(20_000):
        k = rng.choice(keys)
        op = rng.randrange(4)
        if op == 0:
            t[k] = model[k] = step  # type: ignore[assignment]
        elif op == 1 and k in model:
            del t[k], model[k]
        else:
            assert (k in t) == (k in model) and t.get(k) == model.get(k)
        assert len(t) == len(model)
        if step % 997 == 0:
            assert dict(t.items()) == model and set(t) == set(model)
            assert sorted(t.values()) == sorted(model.values())  # type: ignore[type-var]
    assert t.get(b"\x00" * 16) is None and b"" not in t
    while model:
        k, v = t.popitem()
        assert model.pop(k) == v
    assert len(t) == 0 and not list(t.items())


async def test_closing_a_large_cache_frees_its_directory_a_batch_per_step():
    """``aclose`` takes the directory apart a batch of entries per loop turn. Before, it
    cleared the key table in one step: a million entries freed at once (35 ms). Counted in
    the allocator's blocks freed per turn of the loop, not timed."""
    n = 32 * BATCH
    c = mc.Cache(_cfg(n + 64))
    await c.open()
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    for p in np.random.default_rng(3).integers(0, 128000, (n // 64, 64 * CH)):
        await c.put(p.astype(np.int32), kv)
    assert await _chunks(c) == n
    gc.collect()
    freed = await most_per_turn(c.aclose, sys.getallocatedblocks)
    assert await _chunks(c) == 0
    # A few blocks an entry (the entry, its key and token ids, its index): all of them at
    # once would be several times this.
    assert 0 < freed < n // 2, freed


async def test_closing_after_a_clear_frees_no_object_per_released_slot_in_one_step():
    """A pool's released slot numbers are kept in one flat buffer. They were a list of int
    objects: after a clear of a million chunks, the close dropped it in one step (36 to
    88 ms of loop). Counted by the interpreter's allocated blocks, not timed: no step of the
    close frees more than a few batches' worth of objects."""
    n = 20_480
    c = mc.Cache(_cfg(n + 64))
    await c.open()
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    for p in np.random.default_rng(4).integers(0, 128000, (n // 64, 64 * CH)):
        await c.put(p.astype(np.int32), kv)
    await c.clear()
    assert (await c.stats())["tiers"]["host"]["bytes_used"] == 0  # every slot released
    freed = await most_per_turn(c.aclose, sys.getallocatedblocks)
    assert freed < n // 4, freed


async def test_a_long_put_lets_go_of_its_chunks_a_batch_per_step():
    """A put keeps every chunk of its prompt pinned until it ends, then touches and unpins
    them. The unpins ran all in one step after the batched touches: about a microsecond a
    chunk, a 12 to 15 ms step at the end of a put of 16,384 chunks. Counted, not timed: no
    turn of the loop takes or lets go of more than a batch of pins."""
    n = 64 * BATCH
    kv = torch.zeros(TINY.shape(n * CH), dtype=TINY.dtype)
    a, b = np.random.default_rng(8).integers(0, 128000, (2, n * CH)).astype(np.int32)
    async with mc.Cache(_cfg(n)) as c:
        for p in (a, b):  # the second evicts all of the first
            seen = await stats_per_turn(c, lambda p=p: c.put(p, kv))
            # Pinned whole until its end (the first batch goes in the turn the last is taken).
            assert max(map(_pins, seen)) >= n - BATCH
            assert 0 < _most_change(seen, _pins) <= BATCH
            assert (await c.stats())["pins"] == 0
        assert await c.lookup(b) == n * CH and await c.lookup(a) == 0


async def test_deleted_entries_are_freed_by_reference_counts_alone():
    """Entries form no reference cycles, so a large directory never waits for the
    collector to be freed: with the collector off, the memory of a deleted prompt, its
    descendants and a cleared cache is given back as soon as the delete or clear returns
    (counted in the allocator's blocks)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        async with mc.Cache(_cfg(512)) as c:
            base = list(range(CH))
            kv = torch.zeros(TINY.shape(8 * CH), dtype=TINY.dtype)
            await c.put(base, kv[:, :, :CH])  # the cache's own first-use growth, then gone
            await c.delete(base)
            before = sys.getallocatedblocks()
            for i in range(40):
                await c.put(base + [1000 + i] * (7 * CH), kv)
            grown = sys.getallocatedblocks() - before
            assert await c.delete(base) == 40 * 7 + 1
            assert sys.getallocatedblocks() - before < grown // 4
            before = sys.getallocatedblocks()
            for i in range(40):
                await c.put([2000 + i] * (8 * CH), kv)
            grown = sys.getallocatedblocks() - before
            await c.clear()
            assert sys.getallocatedblocks() - before < grown // 4
    finally:
        if was:
            gc.enable()


def test_oldest_first_matches_a_stable_sort():
    metas = list(_listing(3000, 64))
    rng = random.Random(3)
    rng.shuffle(metas)
    metas = [m if i % 3 else type(m)(m.key, m.parent, m.num_tokens, m.raw_bytes,
                                      m.stored_bytes, 7.0) for i, m in enumerate(metas)]
    got = ChunkListing.from_metas(metas).oldest_first()
    assert list(got) == sorted(metas, key=lambda m: m.last_used)


def test_a_storage_tiers_recency_order_is_an_ordered_dicts(monkeypatch):
    """``KeyLRU`` keeps exactly an ``OrderedDict``'s order under random use. It keeps its
    order in generations of a bounded size (so that no table of the whole tier is copied
    when it grows): a small bound here puts keys through many of them."""
    from collections import OrderedDict

    from musacache.engine import lru as _lru

    monkeypatch.setattr(_lru, "_GEN", 8)
    rng = random.Random(5)
    lru, model = _lru.KeyLRU(), OrderedDict()
    keys = [bytes([rng.randrange(4)]) + rng.randbytes(15) for _ in range(300)]
    for step in range(20_000):
        k = rng.choice(keys)
        op = rng.randrange(5)
        if op == 0 or k not in model:
            e = Entry(k, b"p" * 16, CH, 64, None)
            lru[k] = e
            model[k] = e
        elif op == 1:
            lru.move_to_end(k)
            model.move_to_end(k)
        elif op == 2:
            lru.move_to_end(k, last=False)
            model.move_to_end(k, last=False)
        else:
            assert lru.pop(k) is model.pop(k)
        assert (k in lru) == (k in model) and len(lru) == len(model)
        if step % 97 == 0:
            assert list(lru.items()) == list(model.items())
    assert list(lru.items()) == list(model.items())
    assert lru.pop(b"\x00" * 16) is None


LONG = 4096  # chunks of one long prompt (65,536 tokens of this spec)


@pytest.mark.parametrize("op", ["lookup", "get", "get_out", "prefetch", "put_again", "delete"])
async def test_a_long_prompt_is_worked_on_a_run_of_chunks_per_step(op):
    """Each of these walked every chunk of a long prompt in one step of the loop: at 16,384
    chunks a lookup took 22 ms, a get 172 ms (a view and a narrow per chunk), a put of a
    prompt already cached 28 ms, a delete 1.1 s (a quadratic membership test) and then
    27 ms. Counted, not timed: each lets the loop turn several times over the prompt, and
    no turn pins, unpins or removes more than a run of its chunks."""
    toks = np.random.default_rng(9).integers(0, 128000, LONG * CH).astype(np.int32)
    kv = torch.zeros(TINY.shape(LONG * CH), dtype=TINY.dtype)
    out = torch.empty_like(kv)
    async with mc.Cache(_cfg(LONG)) as c:
        await c.put(toks, kv)
        ops = {"lookup": lambda: c.lookup(toks), "get": lambda: c.get(toks),
               "get_out": lambda: c.get(toks, out=out), "prefetch": lambda: c.prefetch(toks),
               "put_again": lambda: c.put(toks, kv), "delete": lambda: c.delete(toks)}
        seen = await stats_per_turn(c, ops[op])
        assert len(seen) > LONG // 1024, len(seen)
        assert _most_change(seen, _pins) <= 1024
        assert _most_change(seen, lambda st: int(st["chunks"])) <= 1024
        if op == "delete":
            assert await c.lookup(toks) == 0 and await _chunks(c) == 0
        else:
            assert await c.lookup(toks) == LONG * CH
            assert (await c.stats())["pins"] == 0


async def test_deleting_a_long_prompt_lets_go_of_it_a_batch_per_step():
    """The keys a delete of a long prompt held (the prompt's chain, one object a chunk) were
    all freed in the step it ended in: 8,225 objects at 4,096 chunks, 1.3 ms at 16,384.
    Counted in objects freed per turn of the loop (the allocator's blocks), not timed."""
    toks = np.random.default_rng(8).integers(0, 128000, LONG * CH).astype(np.int32)
    async with mc.Cache(_cfg(LONG)) as c:
        gc.collect()
        empty = sys.getallocatedblocks()
        await c.put(toks, torch.zeros(TINY.shape(LONG * CH), dtype=TINY.dtype))
        gc.collect()
        freed = await most_per_turn(lambda: c.delete(toks), sys.getallocatedblocks)
        assert await _chunks(c) == 0
        assert 0 < freed < LONG // 4, freed
        gc.collect()
        # and nothing a chunk is left behind (no mark or key per chunk of the prompt)
        assert sys.getallocatedblocks() - empty < LONG // 4


@pytest.mark.parametrize("promotion", ["sync", "background"])
async def test_promotions_of_a_long_prompt_go_a_few_at_a_time(tmp_path, promotion):
    """A get (or prefetch) of a prompt whose chunks sit on disk started a promotion per
    chunk, and every one reserved its slot and evicted for it in the same turn of the loop
    before any waited for a read (a loop gap of 130 ms at 1,000 chunks, 380 ms for a
    prefetch). Counted in what the host tier shows per turn: no more slots taken, nor
    chunks evicted, than the promotions the engine runs at once."""
    n = 300
    disk = mc.DiskTier(path=str(tmp_path / "d"), capacity_bytes=TINY.nbytes(CH) * 4 * n,
                       write_through=True)
    cfg = mc.CacheConfig(TINY, "steps", chunk_size=CH, promotion=promotion, tiers=(
        mc.HostTier(capacity_bytes=TINY.nbytes(CH) * n // 2), disk))
    toks = np.arange(n * CH, dtype=np.int32)
    kv = torch.randn(TINY.shape(n * CH)).to(TINY.dtype)
    async with mc.Cache(cfg) as c:
        await c.put(toks, kv)
    cap = max(8, 2 * disk.max_concurrency)
    assert cap < n // 4

    def slots(st: dict[str, Any]) -> int:
        host = st["tiers"]["host"]
        return int(host["bytes_used"] // host["slot_bytes"])

    def evicted(st: dict[str, Any]) -> int:
        return int(st["tiers"]["host"]["evictions"])

    async with mc.Cache(cfg) as c:  # restarted: every chunk on disk only
        async def get() -> None:
            hit = await c.get(toks)
            assert hit.num_tokens == n * CH and torch.equal(hit.kv, kv)
            await c.flush()

        async def prefetch() -> None:
            assert await c.prefetch(toks, timeout=30) >= 0
            await c.flush()

        for op in (get, prefetch):
            seen = await stats_per_turn(c, op)
            assert 0 < _most_change(seen, slots) + _most_change(seen, evicted)
            assert _most_change(seen, slots) <= cap and _most_change(seen, evicted) <= cap
