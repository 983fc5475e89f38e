"""The two-stream relay (``musacache.transfer.relay``) on a simulated device.

The fake accelerator module queues every copy, event record and event wait on the stream
that was current, as a device would; ``Device.drain`` then runs the streams in a random
interleaving that honours only the event waits (a stream runs its own queue in order).
A missing wait shows as wrong bytes under some interleaving: a buffer of the ring refilled
before its last item left it, a half started before the other half was done, or the
caller's stream finishing before the side stream.
"""

from __future__ import annotations

import random
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from musacache import devices, transfer
from musacache.transfer import relay as _relay
from musacache.transfer import triton as _kernels
from test_transfer_chunks import (
    NUM_SLOTS,
    chunk_tensors,
    concat,
    flat,
    make_caches,
    reference_gather,
    reference_scatter,
)

CUDA = torch.device("cuda", 0)


class Event:
    def __init__(self, **kw: Any) -> None:
        self.pending = 0  # records queued and not yet run
        self.done = False

    def record(self, stream: Stream) -> None:
        self.pending += 1
        stream.queue.append(("record", self))

    def query(self) -> bool:
        return self.done and not self.pending


class Stream:
    def __init__(self, dev: Device, device: Any = None) -> None:
        self.queue: list[tuple[Any, ...]] = []
        dev.streams.append(self)

    def wait_event(self, event: Event) -> None:
        if event.pending or event.done:  # a never-recorded event is no wait (as on cuda)
            self.queue.append(("wait", event))


class Device:
    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.current: list[Stream] = []
        self.draining = False
        self.copies_done = 0
        self.ran_on: list[tuple[Stream, torch.Tensor]] = []  # (stream, dst) of every copy
        self.main = Stream(self)
        self.module = types.SimpleNamespace(
            is_available=lambda: True, device_count=lambda: 1,
            Stream=lambda device=None: Stream(self, device), Event=Event,
            current_stream=lambda device=None: self.current[-1] if self.current else self.main,
            stream=self.stream)

    @contextmanager
    def stream(self, s: Stream) -> Iterator[None]:
        self.current.append(s)
        try:
            yield
        finally:
            self.current.pop()

    def set_stream(self, s: Stream) -> None:
        if self.current:
            self.current[-1] = s
        else:
            self.current.append(s)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.draining:  # inside a queued half: this is the device running it
            self.ran_on.append((self.current[-1], dst))
            dst.copy_(src)
            self.copies_done += 1
        else:
            self.enqueue(lambda: self.copy(dst, src))

    def enqueue(self, fn: Any) -> None:
        if self.draining:
            fn()
        else:
            self.module.current_stream().queue.append(("call", fn))

    def step(self, rng: random.Random) -> None:
        ready = [s for s in self.streams if s.queue and self._ready(s.queue[0])]
        assert ready, "deadlock: every stream waits for an event nobody will record"
        stream = rng.choice(ready)
        op = stream.queue.pop(0)
        if op[0] == "call":
            self.draining = True
            self.current.append(stream)
            try:
                op[1]()
            finally:
                self.current.pop()
                self.draining = False
        elif op[0] == "record":
            op[1].pending -= 1
            op[1].done = True

    def drain(self, rng: random.Random) -> None:
        """Run every queue to its end, a random ready stream's next step at a time."""
        while any(s.queue for s in self.streams):
            self.step(rng)

    @staticmethod
    def _ready(op: tuple[Any, ...]) -> bool:
        return op[0] != "wait" or op[1].query()


def simulate(monkeypatch: pytest.MonkeyPatch, *, set_stream: bool = True) -> Device:
    """A simulated device installed as "cuda", the relay queueing its work on it."""
    dev = Device()
    if set_stream:  # the cheap switch (devices.stream_switch)
        dev.module.set_stream = dev.set_stream
    monkeypatch.setitem(devices._module_overrides, "cuda", dev.module)
    monkeypatch.setattr(devices, "_copy_streams", {})
    devices._reset_probes()
    monkeypatch.setattr(_relay, "_copy", dev.copy)
    monkeypatch.setattr(_relay, "_enqueue", dev.enqueue)
    return dev


@pytest.fixture(params=["set_stream", "stream contexts"])
def device(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Device:
    yield simulate(monkeypatch, set_stream=request.param == "set_stream")
    devices._reset_probes()


def host_tensors(monkeypatch: pytest.MonkeyPatch, host: list[torch.Tensor]) -> None:
    """Only these tensors (and views of their memory) stand for host memory; every other
    CPU tensor stands for device memory."""
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in host]

    def host_side(t: torch.Tensor) -> bool:
        p = t.untyped_storage().data_ptr()
        return any(a <= p < a + n for a, n in spans)

    monkeypatch.setattr(_relay, "host_side", host_side)


def _prompt(layers: int = 3, tokens: int = 40) -> torch.Tensor:
    return torch.randn(layers, 2, tokens, 2, 8).to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(6))
def test_device_to_host_relay_moves_every_chunk_under_any_interleaving(
        device: Device, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    kv = torch.zeros(3, 2, 40, 2, 8, dtype=torch.bfloat16)  # "on the device"
    produced = _prompt()
    host = [torch.zeros(3, 2, n, 2, 8, dtype=torch.bfloat16) for n in (8, 8, 8, 8, 8)]
    host_tensors(monkeypatch, host)
    pairs = [(h, kv.narrow(2, 8 * i, 8)) for i, h in enumerate(host)]
    with device.stream(device.main):
        device.copy(kv, produced)  # the caller's kernel that makes the KV, still queued
        _relay.queue_copies(pairs, CUDA, device.main)
        end = devices.record_event(CUDA, device.main)
    side = devices.side_stream(CUDA)
    device.drain(random.Random(seed))
    assert end.query()
    # The bus copies (into host memory) ran on the main stream, the dense-making on the side.
    bus = [s for s, dst in device.ran_on if _relay.host_side(dst)]
    dense = [s for s, dst in device.ran_on[1:] if not _relay.host_side(dst)]
    assert bus == [device.main] * 5 and dense == [side] * 5
    for i, h in enumerate(host):
        assert torch.equal(h, produced.narrow(2, 8 * i, 8))


@pytest.mark.parametrize("seed", range(6))
def test_host_to_device_relay_writes_every_chunk_before_the_main_stream_ends(
        device: Device, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    out = torch.zeros(3, 2, 48, 2, 8, dtype=torch.bfloat16)  # "on the device"
    host = [_prompt(tokens=n) for n in (16, 16, 12)]
    host_tensors(monkeypatch, host)
    starts = [0, 16, 32]
    pairs = [(out.narrow(2, a, h.shape[2]), h) for a, h in zip(starts, host)]
    copies_at_end: list[int] = []
    with device.stream(device.main):
        _relay.queue_copies(pairs, CUDA, device.main)
        end = devices.record_event(CUDA, device.main)
    rng = random.Random(seed)
    while not end.query():  # run until the caller's event is reached: all must be done then
        device.step(rng)
    copies_at_end.append(device.copies_done)
    device.drain(rng)
    # 3 bus copies + 3 scatters were done when the main stream's event completed.
    assert copies_at_end == [6]
    for a, h in zip(starts, host):
        assert torch.equal(out.narrow(2, a, h.shape[2]), h)
    assert not out.narrow(2, 44, 4).any()  # past the last chunk: untouched


def test_a_ring_shorter_than_the_request_reuses_buffers_only_after_they_are_emptied(
        device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine chunks through three buffers, in many interleavings: each buffer is used three
    times, and no item reads a buffer another item has refilled."""
    kv = _prompt(tokens=72)
    host = [torch.zeros(3, 2, 8, 2, 8, dtype=torch.bfloat16) for _ in range(9)]
    host_tensors(monkeypatch, host)
    for seed in range(20):
        for h in host:
            h.zero_()
        with device.stream(device.main):
            _relay.queue_copies([(h, kv.narrow(2, 8 * i, 8)) for i, h in enumerate(host)],
                                CUDA, device.main)
        device.drain(random.Random(seed))
        assert all(torch.equal(h, kv.narrow(2, 8 * i, 8)) for i, h in enumerate(host)), seed


def test_contiguous_and_device_pairs_are_plain_copies_on_the_main_stream(
        device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _prompt()
    host_whole = torch.zeros_like(kv)
    other = torch.zeros_like(kv)  # "on the device"
    host_tensors(monkeypatch, [host_whole])
    one_host = host_whole.narrow(2, 0, 8)
    pairs = [(host_whole, kv),  # the device side is one run: one bus copy
             (other.narrow(2, 0, 8), kv.narrow(2, 0, 8))]  # device to device
    with device.stream(device.main):
        _relay.queue_copies(pairs, CUDA, device.main)
    assert devices.side_stream(CUDA).queue == []
    assert [op[0] for op in device.main.queue] == ["call", "call"]
    device.drain(random.Random(0))
    assert [dst.dtype for _, dst in device.ran_on] == [torch.int64, torch.int64]  # as words
    assert torch.equal(host_whole, kv) and torch.equal(other.narrow(2, 0, 8), kv.narrow(2, 0, 8))
    # A single strided pair one way is one copy_ too: nothing to overlap it with.
    with device.stream(device.main):
        _relay.queue_copies([(one_host, kv.narrow(2, 8, 8))], CUDA, device.main)
    assert devices.side_stream(CUDA).queue == []


def test_words_views_as_wide_integers_only_where_the_layout_allows() -> None:
    x = _prompt(tokens=16)
    bits = x.view(torch.int16)
    bits[0, 0, 0, 0, :4] = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001], dtype=torch.int16)
    for src in (x.narrow(2, 3, 5), x[..., 4:8], x):
        dst = torch.empty_like(src)
        a, b = _relay.words(dst, src)
        assert a.dtype == b.dtype and a.element_size() > 2
        a.copy_(b)
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))  # NaN payloads too
    assert _relay.words(torch.empty(2, 2, 2, 2, 7, dtype=torch.bfloat16),
                        x[:2, :, :2, :, :7])[0].dtype == torch.bfloat16  # odd row
    assert _relay.words(torch.empty(3, 2, 16, 2, 3, dtype=torch.bfloat16),
                        x[..., 1:4])[0].dtype == torch.bfloat16  # odd offset
    f = torch.zeros(3, 4)
    assert _relay.words(f, torch.zeros(3, 4, dtype=torch.float64))[0] is f  # other dtype
    assert _relay.words(torch.zeros(2, 4), x.view(-1)[:8].view(2, 4).float())[0].dtype \
        == torch.int64


# -- paged store and retrieve with chunks in host memory: the piped path of transfer ---------


@pytest.fixture
def paged(device: Device, monkeypatch: pytest.MonkeyPatch) -> Device:
    """CPU pages taken for cuda ones (torch ops move them: no Triton), on the simulated
    device; windows of at most eight tokens of three layers."""
    monkeypatch.setattr(transfer, "_device_type", lambda tensor: "cuda")
    monkeypatch.setattr(_kernels, "available", lambda: False)
    monkeypatch.setattr(transfer, "PIPE_WINDOW_BYTES", 8 * 3 * 2 * 2 * 8 * 2)
    return device


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("layout", ["vllm", "sglang", "vllm-mla"])
def test_piped_gather_of_host_chunks_matches_the_reference(
        paged: Device, monkeypatch: pytest.MonkeyPatch, layout: str, seed: int) -> None:
    caches = make_caches(layout, 3)
    sizes = [3, 3, 3, 3, 3, 1]  # windows of eight tokens: three, through two buffers
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(seed))
    dsts = chunk_tensors(layout, 3, sizes, [False] * 6)
    host_tensors(monkeypatch, dsts)
    before = concat([d.clone() for d in dsts], layout)
    relayed: list[int] = []
    real = _relay.relay
    monkeypatch.setattr(_relay, "relay", lambda *a, **k: (relayed.append(len(a[2])),
                                                           real(*a, **k))[1])
    with paged.stream(paged.main):
        transfer.gather_chunks(caches, slots, dsts, layout, stream=paged.main)
        end = devices.record_event(CUDA, paged.main)
    assert relayed == [3]
    paged.drain(random.Random(seed))
    assert end.query()
    assert torch.equal(concat(dsts, layout),
                       reference_gather(caches, layout, slots.tolist(), before))


@pytest.mark.parametrize("seed", range(5))
def test_piped_scatter_of_host_chunks_skips_minus_one_and_ends_on_the_main_stream(
        paged: Device, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    caches = make_caches("vllm", 3)
    sizes = [3, 3, 3, 3, 2]
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(seed))[:14]
    slots[5] = slots[11] = -1
    srcs = chunk_tensors("vllm", 3, sizes, [False] * 5)
    host_tensors(monkeypatch, srcs)
    expected = reference_scatter(concat(srcs, "vllm"), caches, "vllm", slots.tolist())
    with paged.stream(paged.main):
        transfer.scatter_chunks(srcs, caches, slots, "vllm", stream=paged.main)
        end = devices.record_event(CUDA, paged.main)
    rng = random.Random(seed)
    while not end.query():
        paged.step(rng)
    # Every page write was done when the caller's stream reached its event.
    assert all(torch.equal(a, b) for a, b in zip(flat(caches), flat(expected), strict=True))
    paged.drain(rng)


def test_a_gather_that_skips_tokens_fits_one_window_or_has_strided_chunks_is_not_piped(
        paged: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = make_caches("vllm", 3)
    relayed: list[int] = []
    monkeypatch.setattr(_relay, "relay", lambda *a, **k: relayed.append(1))
    for sizes, slots, permuted in (
            ([4, 4, 4], [0, 1, 2, -1, 4, 5, 6, 7, 8, 9, 10, 11], [False] * 3),  # a skip
            ([4], [3, 2, 1, 0], [False]),  # one window
            ([4, 4, 4], list(range(12)), [False, True, False])):  # a chunk not contiguous
        dsts = chunk_tensors("vllm", 3, sizes, permuted)
        host_tensors(monkeypatch, dsts)
        before = concat([d.clone() for d in dsts], "vllm")
        with paged.stream(paged.main):
            transfer.gather_chunks(caches, torch.tensor(slots), dsts, "vllm",
                                   stream=paged.main)
        paged.drain(random.Random(0))
        assert torch.equal(concat(dsts, "vllm"),
                           reference_gather(caches, "vllm", slots, before))
    assert relayed == []


# -- runs: consecutive pairs merged into one strided copy ------------------------------------


def _pool_and_prompt(chunks: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    pool = torch.zeros(chunks + 2, 3, 2, 4, 2, 8, dtype=torch.bfloat16)
    kv = _prompt(tokens=4 * chunks)
    slots = list(pool.unbind(0))  # views of one base, a slot's bytes apart
    return pool, kv, slots


def test_runs_merge_a_prompt_going_into_consecutive_slots_into_one_copy() -> None:
    pool, kv, slots = _pool_and_prompt(6)
    pairs = [(slots[1 + k], kv.narrow(2, 4 * k, 4)) for k in range(6)]
    merged = _relay.runs(pairs)
    assert len(merged) == 1 and merged[0][0].shape == (6, 3, 2, 4, 2, 8)
    for d, s in merged:
        d.copy_(s)
    assert all(torch.equal(slots[1 + k], kv.narrow(2, 4 * k, 4)) for k in range(6))
    assert not pool[0].any() and not pool[7].any()  # nothing outside the slots written


def test_runs_keep_apart_what_is_not_one_strided_copy() -> None:
    pool, kv, slots = _pool_and_prompt(6)
    other = torch.zeros_like(pool)
    chunk = [kv.narrow(2, 4 * k, 4) for k in range(6)]
    cases = {
        "falling slots": [(slots[6 - k], chunk[k]) for k in range(6)],
        "uneven step": [(slots[k if k < 3 else k + 1], chunk[k]) for k in range(5)],
        "two bases": [(slots[1], chunk[0]), (other[2], chunk[1])],
        "a base tensor itself": [(pool, pool.clone()), (pool, pool.clone())],
        "other dtypes": [(slots[1].float(), chunk[0]), (slots[2].float(), chunk[1])],
        "a shorter tail": [(slots[1], chunk[0]), (slots[2][:, :, :3], chunk[1][:, :, :3])],
    }
    want = {"falling slots": 6, "uneven step": 2, "two bases": 2, "a base tensor itself": 2,
            "other dtypes": 2, "a shorter tail": 2}
    for name, pairs in cases.items():
        assert len(_relay.runs(pairs)) == want[name], name


@pytest.mark.parametrize("seed", range(8))
def test_runs_copy_exactly_what_the_pairs_copy(seed: int) -> None:
    """Random slot orders (runs of consecutive slots, breaks, reversals): the merged copies
    write every slot as the pairs would, and nothing else."""
    rng = random.Random(seed)
    n = 12
    pool, kv, slots = _pool_and_prompt(n)
    order = list(range(1, n + 1))
    cut = sorted(rng.sample(range(1, n), 3))
    pieces = [order[a:b] for a, b in zip([0, *cut], [*cut, n])]
    rng.shuffle(pieces)
    order = [i for p in pieces for i in (p if rng.random() < 0.7 else p[::-1])]
    pairs = [(slots[i], kv.narrow(2, 4 * k, 4)) for k, i in enumerate(order)]
    expected = pool.clone()
    for k, i in enumerate(order):
        expected[i] = kv.narrow(2, 4 * k, 4)
    merged = _relay.runs(pairs)
    assert len(merged) <= len(pairs)
    for d, s in merged:
        d.copy_(s)
    assert torch.equal(pool, expected)


def test_device_pairs_into_consecutive_slots_are_one_launch(
        device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    host_tensors(monkeypatch, [])  # everything stands for device memory
    _pool, kv, slots = _pool_and_prompt(6)
    with device.stream(device.main):
        _relay.queue_copies([(slots[1 + k], kv.narrow(2, 4 * k, 4)) for k in range(6)],
                            CUDA, device.main)
    assert len(device.main.queue) == 1  # one copy, of all six chunks
    device.drain(random.Random(0))
    assert [dst.dtype for _, dst in device.ran_on] == [torch.int64]
    assert all(torch.equal(slots[1 + k], kv.narrow(2, 4 * k, 4)) for k in range(6))


@pytest.mark.parametrize("error", ["torch", "plain"])
def test_no_room_for_the_ring_moves_the_pairs_the_old_way(
        device: Device, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    """An engine may hold nearly all of the device's memory: when the relay's buffers cannot
    be had, the pairs are copied one by one (torch stages each itself), still exactly."""
    kv = _prompt()
    host = [torch.zeros(3, 2, 8, 2, 8, dtype=torch.bfloat16) for _ in range(5)]
    host_tensors(monkeypatch, host)
    real_empty = torch.empty

    def no_room(*a: Any, **k: Any) -> torch.Tensor:
        if k.get("dtype") is torch.uint8:
            raise (torch.OutOfMemoryError("CUDA out of memory") if error == "torch"
                   else RuntimeError("MUSA error: out of memory"))
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", no_room)
    with device.stream(device.main):
        _relay.queue_copies([(h, kv.narrow(2, 8 * i, 8)) for i, h in enumerate(host)], CUDA,
                            device.main)
    assert devices.side_stream(CUDA).queue == []  # nothing relayed
    device.drain(random.Random(0))
    assert all(torch.equal(h, kv.narrow(2, 8 * i, 8)) for i, h in enumerate(host))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("some other failure")))
    with pytest.raises(RuntimeError, match="some other failure"):
        _relay.buffers(8, torch.device("cpu"), 2)


def test_no_room_for_two_windows_leaves_a_store_to_the_kernel(
        paged: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    caches = make_caches("vllm", 3)
    sizes = [3, 3, 3, 3, 3, 1]
    slots = torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(1))
    dsts = chunk_tensors("vllm", 3, sizes, [False] * 6)
    host_tensors(monkeypatch, dsts)
    before = concat([d.clone() for d in dsts], "vllm")
    monkeypatch.setattr(_relay, "buffers", lambda *a: None)
    relayed: list[int] = []
    monkeypatch.setattr(_relay, "relay", lambda *a, **k: relayed.append(1))
    with paged.stream(paged.main):
        transfer.gather_chunks(caches, slots, dsts, "vllm", stream=paged.main)
    paged.drain(random.Random(0))
    assert relayed == []
    assert torch.equal(concat(dsts, "vllm"),
                       reference_gather(caches, "vllm", slots.tolist(), before))
