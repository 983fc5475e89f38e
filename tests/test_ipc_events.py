"""Event IPC: host eventfd events (in-process and across processes) and device events with
their capability probe, the device side exercised with fake torch device modules."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from musacache._errors import IPCError, ProtocolError
from musacache.ipc import IpcEvent, _events, event_ipc_capability
from musacache.ipc._wire import Connection, Request


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def fresh_capabilities():
    _events._reset_capability_cache()
    yield
    _events._reset_capability_cache()


# -- host events, one process ------------------------------------------------------------


def test_set_clear_counts_and_level_semantics() -> None:
    with IpcEvent.create() as event:
        assert event.mode == "host" and event.device_kind == "cpu"
        assert not event.is_set()
        assert event.clear() == 0
        event.set()
        event.set()
        assert event.is_set() and event.is_set()  # looking does not consume
        assert event.clear() == 2
        assert not event.is_set()
    assert event.closed
    with pytest.raises(IPCError, match="closed"):
        event.set()


async def test_wait_times_out_without_blocking_the_loop() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.005)

    with IpcEvent.create() as event:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            started = time.monotonic()
            assert await event.wait(timeout=0.2) is False
            elapsed = time.monotonic() - started
            tg.cancel_scope.cancel()
    assert 0.19 <= elapsed < 2
    assert ticks >= 10
    assert await anyio.to_thread.run_sync(lambda: True)  # loop still healthy


async def test_set_wakes_every_waiter_and_wait_does_not_consume() -> None:
    results: list[bool] = []
    with IpcEvent.create() as event:

        async def waiter() -> None:
            results.append(await event.wait(timeout=5))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(waiter)
                await anyio.sleep(0.05)
                assert results == []
                event.set()
        assert results == [True] * 5
        assert event.is_set()
        assert await event.wait(timeout=0) is True
        assert await event.wait() is True


async def test_set_from_a_thread_wakes_the_loop() -> None:
    with IpcEvent.create() as event:
        timer = threading.Timer(0.05, event.set)
        timer.start()
        started = time.monotonic()
        assert await event.wait(timeout=5)
        assert time.monotonic() - started < 2
        timer.join()


async def test_cancelled_waits_leave_no_fds() -> None:
    with IpcEvent.create() as event:
        before = open_fd_count()
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(event.wait)
            await anyio.sleep(0.05)
            assert open_fd_count() == before + 3  # one private dup per waiter
            tg.cancel_scope.cancel()
        assert open_fd_count() == before
        assert not event._waiters


async def test_close_while_waiting_raises() -> None:
    event = IpcEvent.create()
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await event.wait(timeout=5)
        except IPCError as exc:
            errors.append(exc)

    before = open_fd_count()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            event.close()
    assert len(errors) == 1 and "closed" in str(errors[0])
    assert open_fd_count() == before - 1  # the event's own fd, and the waiter's dup


async def test_export_and_import_share_one_counter() -> None:
    a, b = socket.socketpair()
    with IpcEvent.create() as producer:
        wire, fds = producer.export()
        async with Connection(a) as tx, Connection(b) as rx:
            await tx.send_request(1, "event", {"event": wire}, fds=fds)
            frame = await rx.receive()
        assert isinstance(frame, Request) and len(frame.fds) == 1
        with IpcEvent.from_wire(frame.args["event"], frame.fds) as consumer:
            assert consumer.fileno() != producer.fileno()
            producer.set()
            assert await consumer.wait(timeout=1)
            assert consumer.clear() == 1
            assert not producer.is_set()


def test_from_wire_rejects_bad_input_and_closes_fds() -> None:
    r, w = os.pipe()
    with pytest.raises(IPCError, match="not an eventfd"):
        IpcEvent.from_wire({"mode": "host", "kind": "cpu", "nfds": 1}, [r])
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)
    bad: list[Any] = [
        [],
        {"mode": "host", "kind": "cpu", "nfds": 1},  # no fd
        {"mode": "smoke", "kind": "cpu"},
        {"mode": "host", "kind": "tpu", "nfds": 1},
        {"mode": "device", "kind": "cuda", "handle": "not bytes"},
    ]
    for wire in bad:
        fd = os.eventfd(0)
        fds = [fd] if wire != {"mode": "host", "kind": "cpu", "nfds": 1} else []
        with pytest.raises(ProtocolError):
            IpcEvent.from_wire(wire, fds)
        if fds:
            with pytest.raises(OSError):
                os.fstat(fd)
        else:
            os.close(fd)


async def test_cpu_record_sets_and_device_mode_is_refused_for_cpu() -> None:
    with IpcEvent.create("cpu") as event:
        await event.record()
        assert event.is_set()
    with pytest.raises(IPCError, match="no device form"):
        IpcEvent.create("cpu", mode="device")


# -- host events across processes --------------------------------------------------------


def _event_child(path: str) -> None:
    anyio.run(_event_child_main, path)


async def _event_child_main(path: str) -> None:
    async with await Connection.connect(path) as conn:
        frame = await conn.receive()
        assert isinstance(frame, Request)
        parents = IpcEvent.from_wire(frame.args["event"], frame.fds)
        mine = IpcEvent.create()
        wire, fds = mine.export()
        await conn.send_reply(frame.id, {"event": wire}, fds=fds)
        # The parent's set() wakes this await; answering proves the wake-up crossed over.
        if await parents.wait(timeout=30):
            mine.set()
        await conn.receive()  # until the parent hangs up


async def _accept(listener: socket.socket) -> socket.socket:
    await anyio.wait_readable(listener)
    sock, _ = listener.accept()
    return sock


async def test_host_events_wake_waiters_in_another_process(tmp_path) -> None:
    path = str(tmp_path / "ev.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    child = multiprocessing.get_context("spawn").Process(target=_event_child, args=(path,))
    child.start()
    try:
        with anyio.fail_after(60):
            async with Connection(await _accept(listener)) as conn:
                with IpcEvent.create() as ours:
                    wire, fds = ours.export()
                    await conn.send_request(1, "event", {"event": wire}, fds=fds)
                    reply = await conn.receive()
                    assert reply is not None and not isinstance(reply, Request)
                    with IpcEvent.from_wire(reply.unwrap()["event"], reply.fds) as theirs:
                        assert await theirs.wait(timeout=0.2) is False
                        ours.set()
                        assert await theirs.wait(timeout=30) is True
        child.join(20)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        listener.close()


# -- device events, with fake torch device modules ---------------------------------------


class FakeStream:
    def __init__(self, on_sync: Any = None) -> None:
        self.on_sync = on_sync
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1
        if self.on_sync is not None:
            self.on_sync()


def make_device_module(uuids: tuple[str, ...], *, exportable: bool = True,
                       queries_until_done: int = 0) -> SimpleNamespace:
    """A stand-in for torch.cuda / torch.musa that logs what the library calls."""
    mod = SimpleNamespace(calls=[], created=0, guard=[], stream=FakeStream())

    class Event:
        def __init__(self, interprocess: bool = False) -> None:
            mod.created += 1
            self.interprocess = interprocess
            self.queries = 0
            mod.calls.append(("Event", interprocess))

        def ipc_handle(self) -> bytes:
            if not exportable or not self.interprocess:
                raise RuntimeError("interprocess events are not supported")
            return b"H" * 64

        def record(self, stream: Any = None) -> None:
            mod.calls.append(("record", stream))

        def query(self) -> bool:
            self.queries += 1
            return self.queries > queries_until_done

        @classmethod
        def from_ipc_handle(cls, device: int, handle: bytes) -> Event:
            mod.calls.append(("from_ipc_handle", device, handle))
            return cls(interprocess=True)

    @contextlib.contextmanager
    def device(index: int):
        mod.guard.append(index)
        yield

    mod.Event = Event
    mod.device = device
    mod.is_available = lambda: True
    mod.device_count = lambda: len(uuids)
    mod.current_device = lambda: 0
    mod.current_stream = lambda index=None: mod.stream
    mod.get_device_properties = lambda i: SimpleNamespace(uuid=uuids[i])
    return mod


def test_capability_probe_is_cached(monkeypatch) -> None:
    fake = make_device_module(("GPU-a",))
    monkeypatch.setattr(torch, "cuda", fake)
    assert event_ipc_capability("cuda") == "device"
    assert event_ipc_capability("cuda") == "device"
    assert fake.created == 1
    # One probe, the device layer's: it records an interprocess event and exports it.
    assert fake.calls == [("Event", True), ("record", None)]
    assert event_ipc_capability("cpu") == "host-fallback"


def test_capability_falls_back_when_export_fails_or_musa_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(torch, "musa", make_device_module(("M-0",), exportable=False),
                        raising=False)
    assert event_ipc_capability("musa") == "host-fallback"
    _events._reset_capability_cache()
    monkeypatch.delattr(torch, "musa")
    monkeypatch.setitem(sys.modules, "torch_musa", None)  # makes `import torch_musa` fail
    assert event_ipc_capability("musa") == "host-fallback"
    _events._reset_capability_cache()
    unavailable = make_device_module(("GPU-a",))
    unavailable.is_available = lambda: False
    monkeypatch.setattr(torch, "cuda", unavailable)
    assert event_ipc_capability("cuda") == "host-fallback"
    assert unavailable.created == 0


async def test_device_event_export_import_and_polled_wait(monkeypatch) -> None:
    producer_side = make_device_module(("GPU-a", "GPU-b"))
    monkeypatch.setattr(torch, "cuda", producer_side)
    event = IpcEvent.create("cuda:1")
    assert event.mode == "device" and producer_side.guard == [1]
    await event.record("stream-1")
    assert ("record", "stream-1") in producer_side.calls
    wire, fds = event.export()
    assert fds == () and wire["handle"] == b"H" * 64 and wire["uuid"] == "GPU-b"
    with pytest.raises(IPCError, match="record"):
        event.set()

    # The consumer sees the same GPU as its device 0 (another CUDA_VISIBLE_DEVICES).
    consumer_side = make_device_module(("GPU-b",), queries_until_done=3)
    monkeypatch.setattr(torch, "cuda", consumer_side)
    imported = IpcEvent.from_wire(wire)
    assert ("from_ipc_handle", 0, b"H" * 64) in consumer_side.calls
    assert await imported.wait(timeout=5) is True

    never = make_device_module(("GPU-b",), queries_until_done=10**9)
    monkeypatch.setattr(torch, "cuda", never)
    stuck = IpcEvent.from_wire(wire)
    started = time.monotonic()
    assert await stuck.wait(timeout=0.1) is False
    assert time.monotonic() - started < 2

    monkeypatch.setattr(torch, "cuda", make_device_module(("GPU-z",)))
    with pytest.raises(IPCError, match="not visible"):
        IpcEvent.from_wire(wire)


async def test_host_fallback_synchronises_the_stream_in_a_thread(monkeypatch) -> None:
    fake = make_device_module(("M-0",), exportable=False)
    monkeypatch.setattr(torch, "musa", fake, raising=False)
    event = IpcEvent.create("musa:0")
    assert event.mode == "host" and event.device_kind == "musa"
    wire, fds = event.export()
    assert wire["mode"] == "host" and len(fds) == 1
    seen: list[tuple[int, bool]] = []
    stream = FakeStream(lambda: seen.append((threading.get_ident(), event.is_set())))
    event.set()  # a stale signal from the previous step must not survive a record
    await event.record(stream)
    assert seen == [(seen[0][0], False)] and seen[0][0] != threading.get_ident()
    assert event.is_set()
    event.record_blocking()  # default: the device's current stream
    assert fake.stream.syncs == 1 and event.is_set()
    with pytest.raises(IPCError, match="mode='host'"):
        IpcEvent.create("musa:0", mode="device")
    event.close()


def test_ipc_uses_the_device_layer_and_its_overrides(monkeypatch) -> None:
    """One device layer: ipc finds accelerator modules through ``devices`` (whose test
    overrides it therefore honours) and shares its capability probe."""
    from musacache import devices
    from musacache.ipc import _events, _memory

    assert not hasattr(_memory, "device_module") and not hasattr(_events, "device_module")
    fake = make_device_module(("GPU-o",))
    monkeypatch.setitem(devices._module_overrides, "cuda", fake)
    _events._reset_capability_cache()
    assert event_ipc_capability("cuda") == "device"
    assert devices.capabilities("cuda").event_ipc
    monkeypatch.setitem(devices._module_overrides, "cuda", None)
    _events._reset_capability_cache()
    assert event_ipc_capability("cuda") == "host-fallback"
    _events._reset_capability_cache()
