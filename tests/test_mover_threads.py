"""The mover's worker-thread hop (``Mover.in_thread``): a caller cancelled while its
function runs in a copy thread waits for the function to end before the cancellation goes
on, since the function reads and writes memory the caller owns and may free next."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from musacache._move import Mover


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
    m = Mover(2, 0)
    try:
        assert await m.in_thread(lambda: threading.current_thread().name) != \
            threading.current_thread().name
        with pytest.raises(ZeroDivisionError):
            await m.in_thread(lambda: 1 // 0)
    finally:
        m.close()


@pytest.mark.asyncio
async def test_task_cancel_waits_for_the_thread() -> None:
    m, slow = Mover(1, 0), _Slow()
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
    m, slow = Mover(1, 0), _Slow()
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
    m = Mover(2, 0)
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
    m, slow = Mover(1, 0), _Slow()
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

    m, slow = Mover(2, 1 << 20), _Slow()
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
