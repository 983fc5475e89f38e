"""The shape of the data path, shown on the CPU with a fake accelerator module that counts calls.

The engine is told its tensors live on ``cuda:0`` (``accelerator_of`` is patched) while the
bytes stay in host memory, so every stream, event and synchronize call goes through the fake
module and is counted, and the data is still checked byte for byte. Per request:

* one move (one worker-thread hop) and one event wait, awaited on the loop by polling;
* the copy stream waits on the caller's stream through an event (no host block); no stream
  or device is ever synchronized, and the one event wait is never made on the loop's thread;
* ``store`` gathers every new chunk in one ``gather_chunks`` call and ``retrieve`` scatters in
  one ``scatter_chunks`` call, so the launches a device backend makes are a function of the
  layers, not of the chunks.
"""

from __future__ import annotations

import random
import threading
import types
from typing import Any

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import cache as _engine
from musacache import devices
from musacache.engine import core as _core
from musacache.engine import move as _move
from test_store_retrieve import BS, make_pages, random_slots, read_dense, write_dense

CH = 16
CUDA = torch.device("cuda", 0)


class Calls:
    def __init__(self) -> None:
        self.synchronize: list[int] = []
        self.event_syncs: list[int] = []  # threads that waited for an event
        self.wait_stream = 0
        self.records = 0
        self.gather_chunks: list[int] = []
        self.scatter_chunks: list[int] = []


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls = Calls()

    class Stream:
        def __init__(self, device: Any = None) -> None:
            self.device = device

        def wait_event(self, event: Any) -> None:
            calls.wait_stream += 1

        def synchronize(self) -> None:
            calls.synchronize.append(threading.get_ident())

    class Event:
        def __init__(self, **kw: Any) -> None:
            self.polls = 0

        def record(self, stream: Any = None) -> None:
            calls.records += 1

        def query(self) -> bool:
            self.polls += 1
            return self.polls >= 2  # not done at the first look: the loop must poll

        def synchronize(self) -> None:
            calls.event_syncs.append(threading.get_ident())
            self.polls = 2

    class Ctx:
        def __init__(self, s: Any) -> None:
            self.s = s

        def __enter__(self) -> None:
            return None

        def __exit__(self, *a: Any) -> bool:
            return False

    compute = Stream()
    mod = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, Stream=Stream, Event=Event,
        current_stream=lambda device=None: compute, stream=Ctx,
        synchronize=lambda device=None: calls.synchronize.append(threading.get_ident()))
    monkeypatch.setitem(devices._module_overrides, "cuda", mod)
    monkeypatch.setattr(devices, "_copy_streams", {})
    devices._reset_probes()
    as_cuda = lambda tensors: CUDA  # noqa: E731
    for module in (_core, _engine, _move):
        monkeypatch.setattr(module, "accelerator_of", as_cuda)
    monkeypatch.setattr(_core, "_host_memory", lambda pool: False)  # the slots are "on cuda"
    real_gather, real_scatter = _core._gather_checked, _engine._scatter_own

    def gather(kv: Any, slots: torch.Tensor, dsts: Any, counts: Any, *,
               stream: Any = None) -> None:
        calls.gather_chunks.append(len(dsts))
        real_gather(kv, slots, dsts, counts, stream=stream)

    def scatter(srcs: Any, kv: Any, slots: torch.Tensor, *, stream: Any = None) -> None:
        calls.scatter_chunks.append(len(srcs))
        real_scatter(srcs, kv, slots, stream=stream)

    monkeypatch.setattr(_core, "_gather_checked", gather)
    monkeypatch.setattr(_engine, "_scatter_own", scatter)
    yield calls
    devices._reset_probes()


def _config(spec: mc.KVSpec, chunks: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "structure", chunk_size=CH,
                          tiers=(mc.HostTier(spec.nbytes(CH) * chunks, pinned=False),))


@pytest.mark.parametrize("chunks", [1, 8])
async def test_store_and_retrieve_are_one_move_each(fake_cuda: Calls, chunks: int) -> None:
    spec = small_spec()
    rng = random.Random(chunks)
    n = chunks * CH
    nb = 4 * n // BS
    toks = [rng.randrange(5000) for _ in range(n)]
    dense = prefix_kv(spec, toks)
    pages = make_pages(spec, "vllm", nb)
    slots = random_slots(n, nb, rng)
    write_dense(spec, "vllm", pages, slots, dense)
    async with mc.Cache(_config(spec, 2 * chunks)) as c:
        mover = c._engine.mover
        moves, waits = mover.moves, mover.event_waits
        assert await c.store(toks, pages, slots) == n
        assert (mover.moves - moves, mover.event_waits - waits) == (1, 1)
        assert fake_cuda.gather_chunks == [chunks]  # every chunk in one call

        out_pages = make_pages(spec, "vllm", nb)
        out_slots = random_slots(n, nb, rng)
        moves, waits = mover.moves, mover.event_waits
        assert await c.retrieve(toks, out_pages, out_slots) == n
        assert (mover.moves - moves, mover.event_waits - waits) == (1, 1)
        assert fake_cuda.scatter_chunks == [chunks]
        assert torch.equal(read_dense(spec, "vllm", out_pages, out_slots), dense)

        moves, waits = mover.moves, mover.event_waits
        hit = await c.get(toks)
        assert torch.equal(hit.kv, dense)
        more = [t + 1 for t in toks]
        assert await c.put(more, prefix_kv(spec, more)) == n
        assert (mover.moves - moves, mover.event_waits - waits) == (2, 2)
    # The copy stream waits on the caller's stream once per move (an event recorded on
    # each, plus one at the end of the move); no stream or device is ever synchronized; and
    # the one event wait per move happens in a waiter thread, never on the loop's thread.
    assert fake_cuda.wait_stream == 4 and fake_cuda.records == 8
    assert fake_cuda.synchronize == []
    assert len(fake_cuda.event_syncs) <= 4
    assert threading.get_ident() not in fake_cuda.event_syncs


async def test_evictions_batch_their_copies(fake_cuda: Calls) -> None:
    """A put that evicts k chunks to a lower tier moves them as one batch, not k moves."""
    spec = small_spec()
    config = mc.CacheConfig(spec, "structure", chunk_size=CH, tiers=(
        mc.DeviceTier(spec.nbytes(CH) * 8, device="cpu", name="dev"),
        mc.HostTier(spec.nbytes(CH) * 32, pinned=False)))
    async with mc.Cache(config) as c:
        a = list(range(8 * CH))
        await c.put(a, prefix_kv(spec, a))
        mover = c._engine.mover
        moves = mover.moves
        b = list(range(10000, 10000 + 8 * CH))
        assert await c.put(b, prefix_kv(spec, b)) == 8 * CH  # evicts all 8 of a's chunks
        assert mover.moves - moves == 2  # the 8 demotions in one move, then the put's own
        assert (await c.stats())["tiers"]["dev"]["evictions"] == 8
        hit = await c.get(a)
        assert torch.equal(hit.kv, prefix_kv(spec, a))
    assert fake_cuda.synchronize == []


async def test_device_tokens_and_slots_are_read_off_the_loop_after_ready() -> None:
    """Tokens and slot_mapping on a device are not touched on the loop thread (which would
    block it until the engine's stream produced them) nor before ``ready`` is set."""
    import anyio

    spec = small_spec()
    rng = random.Random(5)
    n = 2 * CH
    nb = 4 * n // BS
    toks = [rng.randrange(5000) for _ in range(n)]
    pages = make_pages(spec, "vllm", nb)
    slots = random_slots(n, nb, rng)
    write_dense(spec, "vllm", pages, slots, prefix_kv(spec, toks))
    ready = anyio.Event()
    reads: list[tuple[int, bool]] = []

    class OnDevice(torch.Tensor):
        @property  # type: ignore[misc]
        def device(self) -> torch.device:
            return CUDA

        def to(self, *args: Any, **kw: Any) -> torch.Tensor:  # type: ignore[override]
            reads.append((threading.get_ident(), ready.is_set()))
            return self.as_subclass(torch.Tensor).clone()

    dev_toks = torch.tensor(toks).as_subclass(OnDevice)
    dev_slots = slots.as_subclass(OnDevice)
    async with mc.Cache(_config(spec, 8)) as c:
        async with anyio.create_task_group() as tg:
            async def later() -> None:
                await anyio.sleep(0.05)
                ready.set()

            tg.start_soon(later)
            assert await c.store(dev_toks, pages, dev_slots, ready=ready) == n
        assert await c.lookup(toks) == n
    assert len(reads) == 2
    assert all(thread != threading.get_ident() and was_ready for thread, was_ready in reads)


async def test_a_put_and_a_get_into_consecutive_slots_are_one_copy_each(
        fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device, a copy launch costs more than a chunk's copy: a prompt whose chunks go
    into slots that follow each other is one strided copy (``_relay.runs``), and so is a
    get of it into a dense ``out``."""
    from musacache.transfer import relay as _relay

    copies: list[torch.Tensor] = []
    real = _relay._copy
    monkeypatch.setattr(_relay, "_copy", lambda d, s: (copies.append(d), real(d, s))[1])
    monkeypatch.setattr(_relay, "host_side", lambda t: False)  # all of it on "the device"
    spec = small_spec()
    config = mc.CacheConfig(spec, "structure", chunk_size=CH, tiers=(
        mc.DeviceTier(spec.nbytes(CH) * 16, device="cpu", name="dev"),))
    async with mc.Cache(config) as c:
        toks = list(range(8 * CH))
        kv = prefix_kv(spec, toks)
        assert await c.put(toks, kv) == 8 * CH
        assert len(copies) == 1 and copies[0].shape[0] == 8
        out = torch.zeros_like(kv)
        copies.clear()
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 8 * CH and torch.equal(out, kv)
        assert len(copies) == 1
