"""Cache.store / Cache.retrieve: the engine API over paged KV caches, one key space with
put/get, checked before anything is written."""

import asyncio
import random
import threading

import anyio
import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import devices

CH = 16
BS = 4  # tokens per page


def make_pages(spec, layout, num_blocks):
    L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    slots = num_blocks * BS
    if layout == "vllm":
        return [torch.full((2, num_blocks, BS, H, D), -7.0, dtype=spec.dtype) for _ in range(L)]
    if layout == "vllm-mla":
        return [torch.full((num_blocks, BS, D), -7.0, dtype=spec.dtype) for _ in range(L)]
    if layout == "sglang":
        return ([torch.full((slots, H, D), -7.0, dtype=spec.dtype) for _ in range(L)],
                [torch.full((slots, H, D), -7.0, dtype=spec.dtype) for _ in range(L)])
    if layout == "sglang-mla":
        return [torch.full((slots, 1, D), -7.0, dtype=spec.dtype) for _ in range(L)]
    raise AssertionError(layout)


def random_slots(n, num_blocks, rng):
    """Slots for n tokens in randomly chosen pages (a block table), as an engine assigns them."""
    blocks = rng.sample(range(num_blocks), (n + BS - 1) // BS)
    return torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)], dtype=torch.int64)


def write_dense(spec, layout, pages, slots, dense):
    """Reference scatter, element by element."""
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, BS)
        for layer in range(spec.num_layers):
            if layout == "vllm":
                pages[layer][:, b, o] = dense[layer, :, i]
            elif layout == "vllm-mla":
                pages[layer][b, o] = dense[layer, i]
            elif layout == "sglang":
                pages[0][layer][s] = dense[layer, 0, i]
                pages[1][layer][s] = dense[layer, 1, i]
            else:
                pages[layer][s, 0] = dense[layer, i]


def read_dense(spec, layout, pages, slots):
    out = torch.empty(spec.shape(len(slots)), dtype=spec.dtype)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, BS)
        for layer in range(spec.num_layers):
            if layout == "vllm":
                out[layer, :, i] = pages[layer][:, b, o]
            elif layout == "vllm-mla":
                out[layer, i] = pages[layer][b, o]
            elif layout == "sglang":
                out[layer, 0, i] = pages[0][layer][s]
                out[layer, 1, i] = pages[1][layer][s]
            else:
                out[layer, i] = pages[layer][s, 0]
    return out


def paged_request(spec, layout, n, num_blocks, rng):
    """``n`` random tokens, their reference KV, and pages holding it at random slots."""
    toks = [rng.randrange(1000) for _ in range(n)]
    dense = prefix_kv(spec, toks)
    pages = make_pages(spec, layout, num_blocks)
    slots = random_slots(n, num_blocks, rng)
    write_dense(spec, layout, pages, slots, dense)
    return toks, dense, pages, slots


def flat(pages):
    if isinstance(pages, tuple):
        return [t.clone() for t in pages[0] + pages[1]]
    return [t.clone() for t in pages]


LAYOUTS = ["vllm", "vllm-mla", "sglang", "sglang-mla"]


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_store_then_retrieve_into_other_pages_is_byte_exact(layout):
    rng = random.Random(3)
    spec = small_spec(mla=layout.endswith("mla"))
    toks = [rng.randrange(1000) for _ in range(45)]
    dense = prefix_kv(spec, toks)
    src_pages = make_pages(spec, layout, 32)
    src_slots = random_slots(45, 32, rng)
    write_dense(spec, layout, src_pages, src_slots, dense)
    cfg = mc.CacheConfig(spec, "paged", tiers=(mc.HostTier(spec.nbytes(CH) * 16),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        assert await c.store(toks, src_pages, src_slots, layout=layout) == 45
        dst_pages = make_pages(spec, layout, 40)
        dst_slots = random_slots(45, 40, rng)
        assert await c.retrieve(toks, dst_pages, dst_slots, layout=layout) == 45
        assert torch.equal(read_dense(spec, layout, dst_pages, dst_slots), dense)
        # One key space: what store put, get serves, and the reverse.
        assert torch.equal((await c.get(toks)).kv, dense)
        other = toks[:30] + [5, 6, 7]
        await c.put(other, prefix_kv(spec, other))
        pages3 = make_pages(spec, layout, 40)
        slots3 = random_slots(33, 40, rng)
        assert await c.retrieve(other, pages3, slots3, layout=layout) == 33
        assert torch.equal(read_dense(spec, layout, pages3, slots3), prefix_kv(spec, other))


async def test_skip_prefix_is_neither_read_nor_overwritten():
    layout = "vllm"
    rng = random.Random(5)
    spec = small_spec()
    toks = list(range(40))
    dense = prefix_kv(spec, toks)
    pages = make_pages(spec, layout, 16)
    slots = random_slots(40, 16, rng)
    write_dense(spec, layout, pages, slots, dense)
    cfg = mc.CacheConfig(spec, "skip", tiers=(mc.HostTier(spec.nbytes(CH) * 16),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        assert await c.store(toks, pages, slots, layout=layout) == 40
        dst = make_pages(spec, layout, 16)
        dslots = random_slots(40, 16, rng)
        before = flat(dst)
        assert await c.retrieve(toks, dst, dslots, layout=layout, skip_prefix=20) == 20
        got = read_dense(spec, layout, dst, dslots)
        assert torch.equal(got[:, :, 20:], dense[:, :, 20:])
        assert torch.all(got[:, :, :20] == -7.0)  # untouched
        assert len(before) == len(flat(dst))
        # store with skip_prefix: the skipped tokens are already cached, the rest is added.
        more = toks + [77, 78, 79, 80]
        dense2 = prefix_kv(spec, more)
        pages2 = make_pages(spec, layout, 16)
        slots2 = random_slots(44, 16, rng)
        write_dense(spec, layout, pages2, slots2[32:], dense2[:, :, 32:])  # only the new tail
        assert await c.store(more, pages2, slots2, layout=layout, skip_prefix=32) == 44
        assert torch.equal((await c.get(more)).kv, dense2)


async def test_minus_one_slots_end_a_store_and_are_skipped_by_retrieve():
    spec = small_spec()
    rng = random.Random(9)
    toks = list(range(48))
    dense = prefix_kv(spec, toks)
    pages = make_pages(spec, "vllm", 16)
    slots = random_slots(48, 16, rng)
    write_dense(spec, "vllm", pages, slots, dense)
    slots[35] = -1  # a padding token inside chunk 2
    cfg = mc.CacheConfig(spec, "holes", tiers=(mc.HostTier(spec.nbytes(CH) * 16),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        assert await c.store(toks, pages, slots, layout="vllm") == 35
        assert await c.lookup(toks) == 35
        dst = make_pages(spec, "vllm", 16)
        dslots = random_slots(35, 16, rng)
        dslots[3] = -1
        assert await c.retrieve(toks[:35], dst, dslots, layout="vllm") == 35
        got = read_dense(spec, "vllm", dst, dslots.clamp(min=0))
        keep = [i for i in range(35) if i != 3]
        assert torch.equal(got[:, :, keep], dense[:, :, keep])


@pytest.mark.parametrize("mutate,err", [
    (lambda s: s.__setitem__(5, 10**6), mc.SlotRangeError),
    (lambda s: s.__setitem__(0, -2), mc.SlotRangeError),
])
async def test_bad_slots_raise_before_any_page_changes(mutate, err):
    spec = small_spec()
    rng = random.Random(1)
    toks = list(range(32))
    pages = make_pages(spec, "vllm", 16)
    slots = random_slots(32, 16, rng)
    cfg = mc.CacheConfig(spec, "bad", tiers=(mc.HostTier(spec.nbytes(CH) * 8),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        await c.put(toks, prefix_kv(spec, toks))
        mutate(slots)
        before = flat(pages)
        with pytest.raises(err):
            await c.retrieve(toks, pages, slots, layout="vllm")
        assert all(torch.equal(a, b) for a, b in zip(before, flat(pages)))
        with pytest.raises(err):
            await c.store(list(range(500, 532)), pages, slots, layout="vllm")
        assert await c.lookup(list(range(500, 532))) == 0


async def test_bad_paged_arguments_are_typed_errors():
    spec = small_spec()
    toks = list(range(16))
    cfg = mc.CacheConfig(spec, "bad2", tiers=(mc.HostTier(spec.nbytes(CH) * 8),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        pages = make_pages(spec, "vllm", 8)
        slots = torch.arange(16)
        with pytest.raises(mc.ShapeError):
            await c.store(toks, pages, slots[:10], layout="vllm")  # length disagrees
        with pytest.raises(mc.DTypeError):
            await c.store(toks, pages, slots.int(), layout="vllm")
        with pytest.raises(mc.LayoutError):
            await c.store(toks, pages, slots, layout="nope")
        wrong = make_pages(small_spec(dtype=torch.float16), "vllm", 8)
        with pytest.raises(mc.InvalidInputError):
            await c.store(toks, wrong, slots, layout="vllm")
        with pytest.raises(mc.InvalidInputError):
            await c.retrieve(toks, pages, slots, layout="vllm", skip_prefix=99)
        assert (await c.stats())["chunks"] == 0


async def test_ready_event_is_awaited_before_reading_pages():
    spec = small_spec()
    toks = list(range(16))
    pages = make_pages(spec, "vllm", 8)
    slots = torch.arange(16)
    write_dense(spec, "vllm", pages, slots, prefix_kv(spec, toks))
    cfg = mc.CacheConfig(spec, "ready", tiers=(mc.HostTier(spec.nbytes(CH) * 8),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        ev = devices.HostEvent()
        with pytest.raises(mc.ReadyTimeoutError):
            await c.store(toks, pages, slots, layout="vllm", ready=ev, ready_timeout=0.05)
        assert await c.lookup(toks) == 0
        ev.set()
        assert await c.store(toks, pages, slots, layout="vllm", ready=ev) == 16


async def test_store_after_a_hit_that_ends_inside_a_chunk_extends_it():
    """The vLLM-connector pattern: retrieve n tokens (ending mid-chunk, a partial tail), then
    store the longer prompt with skip_prefix=n. The chunk that holds token n is new; its head
    comes from the cache (the pages there must not be read), its rest from the pages."""
    spec = small_spec()
    rng = random.Random(12)
    t = [rng.randrange(1000) for _ in range(40)]
    dense = prefix_kv(spec, t)
    cfg = mc.CacheConfig(spec, "extend", tiers=(mc.HostTier(spec.nbytes(CH) * 16),),
                         chunk_size=CH)
    async with mc.Cache(cfg) as c:
        pages = make_pages(spec, "vllm", 32)
        slots = random_slots(40, 32, rng)
        write_dense(spec, "vllm", pages, slots[:20], dense[:, :, :20])
        assert await c.store(t[:20], pages, slots[:20], layout="vllm") == 20
        # Next turn: a fresh set of pages; the engine retrieves what the cache holds ...
        pages2 = make_pages(spec, "vllm", 32)
        slots2 = random_slots(30, 32, rng)
        n = await c.retrieve(t[:29], pages2, slots2[:29], layout="vllm")
        assert n == 20
        # ... computes tokens 20..29 itself, and pokes garbage where it must not be read.
        write_dense(spec, "vllm", pages2, slots2[20:30], dense[:, :, 20:30])
        write_dense(spec, "vllm", pages2, slots2[16:20],
                    torch.full(spec.shape(4), 999.0, dtype=spec.dtype))
        assert await c.store(t[:30], pages2, slots2, layout="vllm", skip_prefix=n) == 30
        assert await c.lookup(t) == 30
        assert torch.equal((await c.get(t[:30])).kv, dense[:, :, :30])


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_store_from_host_pages_then_a_longer_one_over_its_tail(layout):
    """From host pages a store's bytes are exact, a short tail chunk included; a longer
    prompt stored after it grows that tail chunk, whose cached head stays (skip_prefix
    inside it). How fast against a bare native gather: ``musacache bench scale``, paged."""
    rng = random.Random(11)
    spec = small_spec(mla=layout.endswith("mla"))
    toks, dense, pages, slots = paged_request(spec, layout, 57, 32, rng)  # a 9-token tail
    cfg = mc.CacheConfig(spec, "paged", tiers=(mc.HostTier(spec.nbytes(CH) * 16),), chunk_size=CH)
    async with mc.Cache(cfg) as c:
        assert await c.store(toks, pages, slots, layout=layout) == 57
        assert torch.equal((await c.get(toks)).kv, dense)
        more = toks + [rng.randrange(1000) for _ in range(5)]
        dense2 = prefix_kv(spec, more)
        pages2 = make_pages(spec, layout, 32)
        slots2 = random_slots(62, 32, rng)
        write_dense(spec, layout, pages2, slots2, dense2)
        assert await c.store(more, pages2, slots2, layout=layout, skip_prefix=57) == 62
        assert torch.equal((await c.get(more)).kv, dense2)
        assert (await c.stats())["pins"] == 0


@pytest.mark.parametrize("chunks", [40, 64, 100])
async def test_a_store_of_many_chunks_is_byte_exact(chunks):
    # A long store is gathered in parts: each part's chunks, and the seams between them.
    rng = random.Random(chunks)
    spec = small_spec()
    n = chunks * CH
    toks, dense, pages, slots = paged_request(spec, "vllm", n, 2 * n // BS, rng)
    cfg = mc.CacheConfig(spec, "paged", tiers=(mc.HostTier(spec.nbytes(CH) * chunks),),
                         chunk_size=CH)
    async with mc.Cache(cfg) as c:
        assert await c.store(toks, pages, slots, layout="vllm") == n
        assert torch.equal((await c.get(toks)).kv, dense)


async def test_close_during_a_store_frees_no_slot_the_store_is_writing(monkeypatch):
    """A store from host pages writes the cache's slots by address, which keeps no memory
    segment alive: aclose must wait for the copy before it frees the segments (it used to
    free them under the copy thread: a use after free). The store ends or fails typed."""
    import time

    from musacache.engine import core as _core
    from musacache.engine import removal as _removal

    events: list[str] = []
    started = threading.Event()
    real_gather, real_release = _core._gather_checked, _removal.release_memory

    def slow_gather(pages, slots, dsts, counts, *, stream=None):
        started.set()
        time.sleep(0.3)
        if "release" in events:  # the segments are gone: writing them would crash
            events.append("gather after release")
            return None
        events.append("gather")
        return real_gather(pages, slots, dsts, counts, stream=stream)

    async def release(mt):
        events.append("release")
        return await real_release(mt)

    monkeypatch.setattr(_core, "_gather_checked", slow_gather)
    monkeypatch.setattr(_removal, "release_memory", release)
    rng = random.Random(5)
    spec = small_spec()
    toks, _, pages, slots = paged_request(spec, "vllm", 4 * CH, 16, rng)
    cfg = mc.CacheConfig(spec, "paged", tiers=(mc.HostTier(spec.nbytes(CH) * 8),), chunk_size=CH)
    c = mc.Cache(cfg)
    await c.__aenter__()
    task = asyncio.ensure_future(c.store(toks, pages, slots, layout="vllm"))
    await anyio.to_thread.run_sync(started.wait)
    await c.aclose()
    assert events == ["gather", "release"]
    try:
        assert await task == 4 * CH
    except mc.CacheClosedError:
        pass
    # After the close, a store is refused typed, before it moves anything.
    with pytest.raises(mc.CacheClosedError):
        await c.store(toks, pages, slots, layout="vllm")


def _copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("musacache-")}


async def _until_copy_threads_end(before: set[threading.Thread]) -> None:
    """Wait until only the copy threads in ``before`` (other caches') are left: a closed
    cache's threads end once idle."""
    with anyio.fail_after(10):
        while _copy_threads() - before:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def _store_under_way(monkeypatch, seconds):
    """An open cache, and a task storing 4 chunks from host pages whose copy takes
    ``seconds`` in its thread: returned once the copy has started."""
    import time

    from musacache.engine import core as _core

    started = threading.Event()
    real = _core._gather_checked

    def slow_gather(*a, **k):
        started.set()
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(_core, "_gather_checked", slow_gather)
    spec = small_spec()
    toks, _, pages, slots = paged_request(spec, "vllm", 4 * CH, 16, random.Random(5))
    cfg = mc.CacheConfig(spec, "paged", tiers=(mc.HostTier(spec.nbytes(CH) * 8),), chunk_size=CH)
    c = mc.Cache(cfg)
    await c.__aenter__()
    task = asyncio.ensure_future(c.store(toks, pages, slots, layout="vllm"))
    await anyio.to_thread.run_sync(started.wait)
    return c, task


async def test_aclose_cancelled_by_wait_for_still_releases_everything(monkeypatch):
    """aclose cut off by a plain task.cancel() (asyncio.wait_for) while it waits for a
    running store's copy: the release goes on to its end (anyio's shield holds off only
    anyio's own scopes; before, the memory and the copy threads stayed held for good, and a
    later aclose could not finish it). A put that outlived the close is refused typed and
    grows no memory back."""
    others = _copy_threads()
    c, task = await _store_under_way(monkeypatch, 0.4)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(c.aclose(), 0.05)
    try:
        assert await task == 4 * CH
    except mc.CacheClosedError:
        pass
    st = await c.stats()
    assert st["state"] == "closed"
    assert st["tiers"]["host"]["bytes_allocated"] == 0
    await _until_copy_threads_end(others)
    toks = list(range(4 * CH))
    with pytest.raises(mc.CacheClosedError):
        await c.put(toks, prefix_kv(small_spec(), toks))
    st = await c.stats()
    assert st["tiers"]["host"]["bytes_allocated"] == st["tiers"]["host"]["bytes_used"] == 0


async def test_a_close_cut_short_by_cancelling_every_task_still_releases(monkeypatch):
    """A shutdown that cancels every task (a SIGTERM handler's loop over all_tasks())
    while aclose waits for a running store cancels aclose's release task too: it is run
    again, to its end (before, the memory and copy threads stayed held, and a second
    aclose only marked the cache closed)."""
    others = _copy_threads()
    c, store = await _store_under_way(monkeypatch, 0.3)
    closer = asyncio.ensure_future(c.aclose())
    await asyncio.sleep(0.05)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            t.cancel()
    await asyncio.gather(store, closer, return_exceptions=True)
    assert closer.cancelled()
    st = await c.stats()
    assert st["state"] == "closed" and st["tiers"]["host"]["bytes_allocated"] == 0
    await _until_copy_threads_end(others)
