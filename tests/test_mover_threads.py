"""The mover's worker-thread hop (``Mover.in_thread``): a caller cancelled while its
function runs in a copy thread waits for the function to end before the cancellation goes
on, since the function reads and writes memory the caller owns and may free next."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from musacache._executor import Executor
from musacache.engine.move import Mover


def _mover(copy_threads: int, inline_bytes: int) -> Mover:
    """A mover on a copy lane of its own executor, as a cache makes one."""
    return Mover(Executor("t").lane(copy_threads), inline_bytes)


class _Slow:
    """A function that runs 0.2 s in a copy thread, and when it started and ended."""

    def __init__(self) -> None:
        self.started, self.ended = threading.Event(), threading.Event()

    def __call__(self) -> str:
        self.started.set()
        time.sleep(0.2)
        self.ended.set()
        return "done"


@pytest.mark.asyncio
async def test_result_and_error_come_back() -> None:
    m = _mover(2, 0)
    try:
        assert await m.in_thread(lambda: threading.current_thread().name) != \
            threading.current_thread().name
        with pytest.raises(ZeroDivisionError):
            await m.in_thread(lambda: 1 // 0)
    finally:
        m.close()


@pytest.mark.asyncio
async def test_task_cancel_waits_for_the_thread() -> None:
    m, slow = _mover(1, 0), _Slow()
    try:
        task = asyncio.ensure_future(m.in_thread(slow))
        await anyio.to_thread.run_sync(slow.started.wait)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # cancelled again while it waits: still waits
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slow.ended.is_set()
    finally:
        m.close()


@pytest.mark.asyncio
async def test_cancel_scope_waits_for_the_thread() -> None:
    m, slow = _mover(1, 0), _Slow()
    try:
        t0 = time.monotonic()
        with anyio.move_on_after(0.02) as scope:
            await m.in_thread(slow)
        assert scope.cancelled_caught
        assert slow.ended.is_set()
        assert time.monotonic() - t0 >= 0.15
    finally:
        m.close()


@pytest.mark.asyncio
async def test_threads_bounded_by_copy_threads() -> None:
    m = _mover(2, 0)
    running = 0
    most = 0
    lock = threading.Lock()

    def fn() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
    try:
        await asyncio.gather(*(m.in_thread(fn) for _ in range(8)))
        assert most == 2
    finally:
        m.close()


@pytest.mark.asyncio
async def test_cancel_while_queued_takes_it_off_the_queue() -> None:
    """A caller cancelled while its function still waits for a busy thread does not wait for
    the queue to drain, and its function never runs."""
    m, slow = _mover(1, 0), _Slow()
    ran = threading.Event()
    try:
        busy = asyncio.ensure_future(m.in_thread(slow))
        await anyio.to_thread.run_sync(slow.started.wait)
        queued = asyncio.ensure_future(m.in_thread(ran.set))
        await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert not slow.ended.is_set()  # it did not wait for the thread ahead of it
        assert await busy == "done"
        await m.in_thread(lambda: None)  # the thread has run everything queued after it
        assert not ran.is_set()
    finally:
        m.close()


@pytest.mark.asyncio
async def test_quiesce_waits_for_running_moves_and_refuses_new_ones() -> None:
    """The cache's close: the moves under way end first (they may write memory the close
    frees next), and a move asked for afterwards is a typed error, before it runs."""
    from musacache import CacheClosedError

    m, slow = _mover(2, 1 << 20), _Slow()
    wrote = []
    try:
        running = asyncio.ensure_future(m.in_thread(slow))
        await anyio.to_thread.run_sync(slow.started.wait)
        await m.quiesce()
        assert slow.ended.is_set()
        assert await running == "done"
        with pytest.raises(CacheClosedError):
            await m.in_thread(lambda: wrote.append("thread"))
        with pytest.raises(CacheClosedError):  # a small move, done inline on the loop
            await m.run(lambda _s: wrote.append("inline"), device=None, nbytes=1)
        m.close()
        with pytest.raises(CacheClosedError):  # never the pool's bare RuntimeError
            await m.in_thread(lambda: wrote.append("closed"))
        assert wrote == []
    finally:
        m.close()


class _FakeDevice:
    """cuda's stream and event calls, faked: a copy queued on the copy stream ends 0.4 s
    after its event is recorded (a device busy with it), every other event at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fault: str | None = None) -> None:
        import contextlib

        from musacache import devices

        self.copies: list[threading.Event] = []
        self.fault = fault
        monkeypatch.setattr(devices, "current_stream", lambda d: "caller")
        monkeypatch.setattr(devices, "copy_stream", lambda d: "copy")
        monkeypatch.setattr(devices, "wait_for", lambda s, e: None)
        monkeypatch.setattr(devices, "record_event", self.record)
        monkeypatch.setattr(devices, "stream_context",
                            lambda d, s: contextlib.nullcontext())

    def record(self, device: object, stream: object) -> object:
        done = threading.Event()
        fault = self.fault if stream == "copy" else None
        if stream == "copy":
            self.copies.append(done)
            threading.Timer(0.4, done.set).start()
        else:
            done.set()

        class Event:
            def query(self) -> bool:
                return done.is_set()

            def synchronize(self) -> None:
                done.wait()
                if fault is not None:
                    raise RuntimeError(fault)

        return Event()


@pytest.mark.asyncio
@pytest.mark.parametrize("cancel_after", [0.05, 0.3])  # in the hop; in the event wait
async def test_a_cancelled_device_move_waits_for_its_copies(monkeypatch, cancel_after) -> None:
    """A device move is running until its copies end on the device, not when the hop that
    queued them returns: a caller cancelled (a plain task.cancel(), as asyncio.wait_for and
    the node server do) while the hop runs or while it waits for the copies' event still
    waits for them, and the mover counts it running until then (aclose frees nothing
    under it)."""
    import torch

    fake = _FakeDevice(monkeypatch)
    m = _mover(2, 0)
    try:
        task = asyncio.ensure_future(m.run(lambda _s: time.sleep(0.2),
                                           device=torch.device("cuda", 0), nbytes=1 << 20))
        await asyncio.sleep(cancel_after)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(fake.copies) == 1 and fake.copies[0].is_set()
        assert m._running == 0
        await m.quiesce()
    finally:
        m.close()
        await anyio.to_thread.run_sync(lambda: [c.wait() for c in fake.copies])


@pytest.mark.asyncio
async def test_a_split_host_copy_after_close_is_one_typed_error() -> None:
    """A host copy split over several copy threads, asked for once the cache closed: one
    CacheClosedError, never a group of them."""
    import torch

    from musacache import CacheClosedError

    m = _mover(4, 0)
    await m.quiesce()
    with pytest.raises(CacheClosedError):
        await m.copy([(torch.empty(1024), torch.ones(1024)) for _ in range(8)])
    m.close()


@pytest.mark.asyncio
async def test_a_device_fault_in_the_copies_event_reaches_the_caller(monkeypatch) -> None:
    """An error the device reports when the copies' event is waited on (an illegal memory
    access) is the move's error: never a move that returns as if its bytes were there."""
    import torch

    fake = _FakeDevice(monkeypatch, fault="CUDA error: an illegal memory access")
    m = _mover(2, 0)
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await m.run(lambda _s: None, device=torch.device("cuda", 0), nbytes=1 << 20)
        assert m._running == 0
    finally:
        m.close()
        await anyio.to_thread.run_sync(lambda: [c.wait() for c in fake.copies])
