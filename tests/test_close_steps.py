"""What one step of the event loop may do while a cache grows and closes (no loop stall over
10 ms). Not timings: the memory a step allocates, and the entries a close takes up per
step as stats() shows them. Speed (and the collector's pauses, and the pool freed off the
loop) is shown by ``musacache bench scale --only stalls``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import StepMemory, stats_per_turn
from musacache.bench.scale import _Listing
from musacache.engine.core import BATCH
from musacache.engine.directory import Entry
from musacache.engine.lru import PAGE, SlotLRU
from musacache.engine.placement import EntryQueue
from musacache.tiers.listing import ListingBuilder

CH = 16
TINY = mc.KVSpec(1, 1, 8, torch.float16)
# What a step of a put of 64 chunks allocates: its entries, keys and token ids (about 300
# bytes each), as in tests/test_loop_steps.py.
STEP_BYTES = 64 * 1024


def _cfg(chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(TINY, "steps", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * chunks),))


def _prompts(chunks: int, seed: int = 3) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 128000, (chunks // 64, 64 * CH))
                .astype(np.int32))


async def _fill(c: mc.Cache, chunks: int, seed: int = 3,
                prompts: list[np.ndarray] | None = None) -> None:
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    for p in _prompts(chunks, seed) if prompts is None else prompts:
        await c.put(p, kv)


async def test_a_growing_cache_never_copies_its_slot_tables():
    """Puts that take a pool's slots for the first time allocate at most one new page of the
    recency table per step. Before, its two ``array``s and its list grew by ``extend``: the
    reallocation copied the whole table in one step (6.4 ms at a million slots; here, at
    24,576 slots, 130 KiB allocated in one step)."""
    n = 384 * 64
    async with mc.Cache(_cfg(n + 64)) as c:
        await _fill(c, n // 2)
        more = _prompts(n // 2, seed=4)  # drawn before the steps are measured
        m = StepMemory()
        await m.measure(lambda: _fill(c, n // 2, prompts=more))
        assert (await c.stats())["chunks"] == n
        assert m.grew < STEP_BYTES + 8 * PAGE, m.grew


def test_a_slot_lru_over_several_pages_keeps_its_order():
    """Slots added across pages of the recency table (newest last), one touched and one
    removed: the order stays exact."""
    lru = SlotLRU(3 * PAGE)
    es = [Entry(i.to_bytes(32, "little"), b"\0" * 32, CH, 512, None) for i in range(3 * PAGE)]
    for i in reversed(range(3 * PAGE)):
        lru.add(i, es[i])
    lru.touch(3 * PAGE - 1)
    lru.remove(5, es[5])
    order = [e for _k, e in lru.items()]
    assert len(order) == len(lru) == 3 * PAGE - 1
    assert order[0] is es[3 * PAGE - 2] and order[-1] is es[3 * PAGE - 1]
    assert 5 not in lru and 6 in lru and 3 * PAGE not in lru


def _with_store(chunks: int, **kw: object) -> mc.CacheConfig:
    store = _Listing(ListingBuilder().build())  # an empty listing; writes are dropped
    return mc.CacheConfig(TINY, "steps", chunk_size=CH,
                          tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * chunks), store),
                          **kw)  # type: ignore[arg-type]


async def test_persisting_on_close_looks_at_a_batch_of_entries_per_step():
    """With ``persist_on_close`` and a storage tier, ``aclose`` finds what to write a batch of
    entries per loop turn. Before, it looked at every entry of the directory in one step (and
    sorted them all): 0.8 to 1.2 s of loop time at a million entries. Seen in stats(): the
    chunks it has found to persist grow by at most a batch a turn."""
    n = 40 * 64
    # A close_timeout no loaded machine reaches: stats() sampled every turn slows the close.
    c = mc.Cache(_with_store(n + 64, close_timeout=300))
    await c.open()
    await _fill(c, n)
    found = [st["close"]["to_persist"] for st in await stats_per_turn(c, c.aclose)]
    close = (await c.stats())["close"]
    assert close["to_persist"] == close["persisted"] == n
    most = max(b - a for a, b in itertools.pairwise(found))
    assert 0 < most <= BATCH, most


async def test_persisting_on_close_writes_parents_first():
    """A chunk is never written before its parent (a close cut short leaves whole chains)."""
    written: list[tuple[bytes, bytes]] = []  # (key, parent), in the order written

    class Recording(_Listing):
        async def write(self, meta: mc.ChunkMeta, obj: bytes) -> None:
            written.append((meta.key, meta.parent))

    store = Recording(ListingBuilder().build())
    cfg = mc.CacheConfig(TINY, "steps", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * 512), store))
    async with mc.Cache(cfg) as c:
        rng = np.random.default_rng(9)
        system = rng.integers(0, 128000, 3 * CH).astype(np.int32)
        kv = torch.zeros(TINY.shape(8 * CH), dtype=TINY.dtype)
        for _ in range(20):
            await c.put(np.concatenate([system, rng.integers(0, 128000, 5 * CH)
                                        .astype(np.int32)]), kv)
        chunks = (await c.stats())["chunks"]
    at = {key: i for i, (key, _) in enumerate(written)}
    assert len(at) == len(written) == chunks  # every chunk, once
    # Only the shared prefix's first chunk has no parent among them.
    assert sum(parent not in at for _, parent in written) == 1
    assert all(at[parent] < at[key] for key, parent in written if parent in at)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("extend"), st.integers(0, 40)),
                              st.tuples(st.just("take"), st.integers(0, 40)),
                              st.tuples(st.just("drop"), st.just(0))), max_size=40),
       block=st.integers(1, 9))
def test_the_persist_queue_is_first_in_first_out_and_lets_go_of_what_it_gave(ops, block):
    """``EntryQueue`` against a deque, over blocks of any size: the same entries in the same
    order, the same length, and nothing it gave out or dropped still referenced by it."""
    q = EntryQueue(block)
    model: deque[object] = deque()
    made = 0
    for op, n in ops:
        if op == "extend":
            items = [_Item(made + i) for i in range(n)]
            made += n
            q.extend(items)  # type: ignore[arg-type]
            model.extend(items)
        elif op == "take":
            got = q.take(n)
            assert got == [model.popleft() for _ in range(min(n, len(model)))]
            held = {id(y) for b in q._blocks for y in b if y is not None}
            assert not any(id(x) in held for x in got)  # given out: no longer held
        else:
            before = len(q)
            left = q.drop_block()
            # The oldest block (a partly taken one included) is let go of, from the front.
            assert before - len(q) <= block and (before == 0 or len(q) < before)
            while len(model) > len(q):
                gone = model.popleft()
                assert all(y is not gone for b in q._blocks for y in b)
            assert left == bool(model)
        assert len(q) == len(model)
    assert q.take(len(model) + 5) == list(model)
    assert len(q) == 0 and not q.drop_block()


class _Item:
    __slots__ = ("__weakref__", "n")

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"_Item({self.n})"


async def test_aclose_while_puts_queue_storage_writes_returns(tmp_path) -> None:
    # A put still running at close queued a storage write after the close had begun: the
    # write's task, started in the group being cancelled, was never cancelled, spun at its
    # first checkpoint, and aclose waited for it forever (found by a probe).
    spec = mc.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    cs = 16
    for trial in range(40):
        cfg = mc.CacheConfig(spec, "spin", chunk_size=cs, tiers=(
            mc.HostTier(spec.nbytes(cs)),
            mc.DiskTier(str(tmp_path / str(trial)), spec.nbytes(cs) * 400)))
        cache = mc.Cache(cfg)
        await cache.open()

        async def putter(k: int, c: mc.Cache = cache) -> None:
            with contextlib.suppress(mc.CacheClosedError):
                for j in range(1000):
                    toks = [k, j, *range(600)]
                    await c.put(toks, torch.zeros(spec.shape(len(toks))))

        puts = [asyncio.ensure_future(putter(k)) for k in range(8)]
        await asyncio.sleep(0.002 * (trial % 10))
        await cache.aclose()
        await asyncio.gather(*puts, return_exceptions=True)
