"""Many tasks at once, readers under eviction, cancellation at random points, and a loop
that is never starved by large copies."""

import random
import time

import anyio
import pytest
import torch

import musacache as mc
from helpers import prefix_kv

CH = 16


def cfg(spec, chunks, **kw):
    return mc.CacheConfig(spec, "conc", tiers=(mc.HostTier(spec.nbytes(CH) * chunks),),
                          chunk_size=CH, **kw)


async def test_200_concurrent_puts_and_gets_of_overlapping_prompts(spec):
    rng = random.Random(7)
    bases = [[rng.randrange(50) for _ in range(120)] for _ in range(4)]
    errors = []
    async with mc.Cache(cfg(spec, 40)) as c:
        async def one(i):
            b = bases[i % 4]
            toks = b[: rng.randrange(1, 120)]
            if i % 2:
                await c.put(toks, prefix_kv(spec, toks))
            hit = await c.get(toks)
            if not torch.equal(hit.kv, prefix_kv(spec, toks[: hit.num_tokens])):
                errors.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
        assert errors == []
        st = await c.stats()
        assert st["pins"] == 0 and st["tiers"]["host"]["bytes_used"] <= spec.nbytes(CH) * 40


class _HeldRead:
    """Holds a get's copy until ``gate`` is set (``entered`` says it got there), on either of
    its paths: by slot address (``_resident``, through ``Mover.run``) or the general one
    (``Mover.copy``, every chunk a view: forced by a resident minimum no get reaches)."""

    def __init__(self, c, path, monkeypatch):
        import musacache.cache as engine_mod

        self.gate, self.entered = anyio.Event(), anyio.Event()
        self.mover = c._engine.mover
        self.name = "run" if path == "resident" else "copy"
        self.real = getattr(self.mover, self.name)
        if path == "general":
            monkeypatch.setattr(engine_mod, "RESIDENT_MIN", 1 << 62)

    def hold(self):
        async def held(*a, **k):
            if not self.gate.is_set():
                self.entered.set()
                await self.gate.wait()
            await self.real(*a, **k)

        setattr(self.mover, self.name, held)

    def restore(self):
        setattr(self.mover, self.name, self.real)


@pytest.mark.parametrize("path", ["resident", "general"])
async def test_a_chunk_being_read_is_not_evicted_under_its_reader(spec, path, monkeypatch):
    # Copies above inline_copy_bytes go through a worker thread: a read that yields while it
    # holds its chunks (a small read from the host tier never yields, see _fastpath).
    async with mc.Cache(cfg(spec, 2, inline_copy_bytes=0)) as c:
        a = list(range(32))
        await c.put(a, prefix_kv(spec, a))
        held = _HeldRead(c, path, monkeypatch)
        held.hold()
        result = {}

        async def reader():
            result["hit"] = await c.get(a)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await held.entered.wait()
            # The tier is full and both chunks are pinned by the reader: nothing can go.
            b = list(range(500, 532))
            held.restore()
            assert await c.put(b, prefix_kv(spec, b)) == 0
            assert (await c.stats())["pins"] == 2
            held.gate.set()
        assert torch.equal(result["hit"].kv, prefix_kv(spec, a))
        assert result["hit"].tiers == {"host": 32}
        # Once the reader is gone the same put evicts and succeeds.
        b = list(range(500, 532))
        assert await c.put(b, prefix_kv(spec, b)) == 32


@pytest.mark.parametrize("path", ["resident", "general"])
async def test_deleted_while_read_is_freed_after_the_reader(spec, path, monkeypatch):
    async with mc.Cache(cfg(spec, 4, inline_copy_bytes=0)) as c:  # a read that yields
        a = list(range(32))
        await c.put(a, prefix_kv(spec, a))
        held = _HeldRead(c, path, monkeypatch)
        held.hold()
        out = {}
        async with anyio.create_task_group() as tg:
            async def reader():
                out["hit"] = await c.get(a)
            tg.start_soon(reader)
            await held.entered.wait()
            await c.delete(a)
            assert (await c.stats())["tiers"]["host"]["bytes_used"] == spec.nbytes(CH) * 2  # still held
            held.gate.set()
        held.restore()
        assert torch.equal(out["hit"].kv, prefix_kv(spec, a))
        assert (await c.stats())["tiers"]["host"]["bytes_used"] == 0


async def test_random_cancellation_leaks_nothing(spec):
    rng = random.Random(11)
    top = mc.DeviceTier(spec.nbytes(CH) * 3, device="cpu", name="dev")
    low = mc.HostTier(spec.nbytes(CH) * 6)
    config = mc.CacheConfig(spec, "cancel", tiers=(top, low), chunk_size=CH,
                            inline_copy_bytes=0)  # every copy goes through a thread
    bases = [[rng.randrange(40) for _ in range(96)] for _ in range(3)]
    async with mc.Cache(config) as c:
        async def op(i):
            toks = bases[i % 3][: rng.randrange(1, 96)]
            with anyio.move_on_after(rng.choice([0, 1e-5, 1e-4, 5e-4, 2e-3, 1.0])):
                kind = i % 3
                if kind == 0:
                    await c.put(toks, prefix_kv(spec, toks))
                elif kind == 1:
                    hit = await c.get(toks)
                    assert torch.equal(hit.kv, prefix_kv(spec, toks[: hit.num_tokens]))
                else:
                    await c.prefetch(toks, timeout=rng.choice([None, 0.001]))

        for _round in range(6):
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(op, i)
        await c.flush()
        st = await c.stats()
        assert st["pins"] == 0
        assert all(v == 0 for k, v in st["in_flight"].items()), st["in_flight"]
        # Every slot in use holds a chunk the tier serves: no leaked memory.
        for name, t in st["tiers"].items():
            if "slot_bytes" in t:
                assert t["bytes_used"] == t["chunks"] * t["slot_bytes"], (name, t)
        for b in bases:
            hit = await c.get(b)
            assert torch.equal(hit.kv, prefix_kv(spec, b[: hit.num_tokens]))


async def test_heartbeat_is_not_starved_by_a_512mib_put_and_get():
    spec = mc.KVSpec(32, 8, 128)  # 128 KiB per token
    n = 4096  # 512 MiB
    kv = torch.empty(spec.shape(n), dtype=spec.dtype)
    kv.view(torch.int16).random_()
    toks = list(range(n))
    gaps = []
    async with mc.Cache(mc.CacheConfig(spec, "hb", tiers=(mc.HostTier("1GiB"),))) as c:
        done = anyio.Event()

        async def heartbeat():
            last = time.perf_counter()
            while not done.is_set():
                await anyio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            await anyio.sleep(0.01)
            assert await c.put(toks, kv) == n
            hit = await c.get(toks)
            done.set()
        assert hit.num_tokens == n
    # Compare bits: random bf16 bit patterns include NaNs, which never compare equal.
    assert torch.equal(hit.kv.view(torch.int16), kv.view(torch.int16))
    # Generous: the copies take ~100 ms in all; a blocked loop would show one gap that long.
    assert max(gaps) < 0.25, f"largest loop gap {max(gaps) * 1000:.1f} ms"
