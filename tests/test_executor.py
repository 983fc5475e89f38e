"""The cache's worker threads (``Executor``) and their lanes: work handed over at the call,
bounds per lane, and what a cancellation does to a call that must finish."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from helpers import until_set
from musacache._errors import CacheClosedError
from musacache._executor import Executor


async def test_a_call_runs_on_a_daemon_thread_and_its_answer_comes_back() -> None:
    ex = Executor("t")
    try:
        where = await ex.submit(threading.current_thread)
        assert where is not threading.current_thread() and where.daemon
        assert where.name.startswith("t-")
        assert await ex.submit(lambda a, b: a + b, 2, 3) == 5
    finally:
        ex.close()


async def test_an_exception_of_the_call_is_raised_at_the_await() -> None:
    ex = Executor("t")
    try:
        def boom() -> None:
            raise ValueError("in the thread")

        with pytest.raises(ValueError, match="in the thread"):
            await ex.submit(boom)
    finally:
        ex.close()


async def test_the_call_starts_at_submit_without_a_turn_of_the_loop() -> None:
    ex = Executor("t")
    try:
        began = threading.Event()
        fut = ex.submit(began.set)
        # No await since the submit: the loop has not turned, and the thread runs anyway.
        assert began.wait(10)
        await fut
    finally:
        ex.close()


async def test_idle_threads_are_reused_and_busy_ones_are_not_waited_for() -> None:
    ex = Executor("t")
    try:
        for _ in range(20):  # one after another: one thread
            await ex.submit(lambda: None)
        assert ex.threads == 1
        release = threading.Event()
        busy = [ex.submit(release.wait, 10) for _ in range(3)]
        # Three calls at once: three threads, none waiting for another.
        assert await asyncio.gather(ex.submit(lambda: 7)) == [7]
        assert ex.threads == 4
        release.set()
        assert await asyncio.gather(*busy) == [True, True, True]
    finally:
        ex.close()


async def test_a_cancelled_call_is_abandoned_to_its_thread_and_its_answer_dropped() -> None:
    ex = Executor("t")
    try:
        release, ended = threading.Event(), threading.Event()

        def hang() -> int:
            release.wait(10)
            ended.set()
            return 1

        fut = ex.submit(hang)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), 0.05)
        fut.cancel()
        release.set()
        await until_set(ended)
        for _ in range(3000):  # until its thread is idle again
            if ex.idle:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # its answer, dropped: no error for the cancelled future
        assert fut.cancelled()
        # The thread is idle again, and takes the next call.
        assert await ex.submit(lambda: 2) == 2
        assert ex.threads == 1
    finally:
        ex.close()


async def test_close_refuses_new_calls_and_lets_the_threads_end() -> None:
    ex = Executor("t")
    release = threading.Event()
    busy = ex.submit(release.wait, 10)
    await ex.submit(lambda: None)
    assert ex.threads == 2
    ex.close()
    with pytest.raises(CacheClosedError):
        ex.submit(lambda: None)
    release.set()
    assert await busy is True
    for _ in range(1000):
        if not ex.threads:
            break
        await asyncio.sleep(0.01)
    assert ex.threads == 0


def test_a_forked_child_starts_its_own_threads() -> None:
    """fork() copies no thread: a child that inherited idle ones counted would hand its
    work to nobody. Its first call starts a thread of its own."""
    ex = Executor("t")

    async def once() -> int:
        return await asyncio.wait_for(ex.submit(lambda: 41), 10) + 1

    assert asyncio.run(once()) == 42 and ex.idle == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its answer through the pipe, then out without cleanup
        try:
            os.write(w, str(asyncio.run(once())).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            got = f.read()
        assert got == b"42", got
    finally:
        os.waitpid(pid, 0)
        ex.close()


async def test_a_lane_runs_at_most_its_limit_in_order() -> None:
    ex = Executor("t")
    lane = ex.lane(2)
    try:
        lock = threading.Lock()
        running = most = 0
        order: list[int] = []

        def fn(i: int) -> None:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            time.sleep(0.01)
            with lock:
                running -= 1
                order.append(i)

        await asyncio.gather(*(lane.run(fn, i) for i in range(8)))
        assert most == 2
        # Begun in the order they came (two at a time): the first two end before the last.
        assert set(order[:2]) <= {0, 1, 2} and set(order[-2:]) <= {5, 6, 7}
        assert lane.running == 0
    finally:
        ex.close()


async def test_a_lane_call_waiting_for_its_turn_is_taken_back_when_cancelled() -> None:
    ex = Executor("t")
    lane = ex.lane(1)
    try:
        release, ran = threading.Event(), threading.Event()
        busy = asyncio.ensure_future(lane.run(release.wait, 10))
        queued = asyncio.ensure_future(lane.run(ran.set))
        await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued  # at once: it never began, so nothing to wait for
        release.set()
        assert await busy is True
        await lane.run(lambda: None)  # the lane has run everything queued after the first
        assert not ran.is_set()
    finally:
        ex.close()


async def test_a_cancelled_run_waits_for_its_call_unless_abandoned() -> None:
    ex = Executor("t")
    try:
        for abandon in (False, True):
            began, ended, release = threading.Event(), threading.Event(), threading.Event()

            def slow(began: threading.Event = began, ended: threading.Event = ended,
                     release: threading.Event = release) -> None:
                began.set()
                release.wait(10)
                ended.set()

            task = asyncio.ensure_future(ex.run(slow, abandon=abandon))
            await until_set(began)
            task.cancel()
            await asyncio.sleep(0.05)
            # A call that must finish holds its caller until it has; an abandoned one not.
            assert task.done() is abandon
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until_set(ended)
    finally:
        ex.close()


def test_the_idle_wait_of_a_lane_returns_once_its_calls_end() -> None:
    ex = Executor("t")
    lane = ex.lane(1)
    release = threading.Event()

    async def go() -> None:
        fut = lane.submit(release.wait, 10)
        lane.submit(lambda: None)
        threading.Timer(0.05, release.set).start()
        await asyncio.to_thread(lane.wait_idle)
        assert fut.done() and lane.running == 0

    try:
        asyncio.run(go())
    finally:
        ex.close()
