"""``WorkerThreads``: the disk tier's lane threads, handed work at the call."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from helpers import until_set
from musacache._errors import CacheClosedError
from musacache.tiers._workers import WorkerThreads


async def test_a_call_runs_on_a_daemon_thread_and_its_answer_comes_back() -> None:
    workers = WorkerThreads("t")
    try:
        where = await workers.submit(threading.current_thread)
        assert where is not threading.current_thread() and where.daemon
        assert where.name.startswith("t-")
        assert await workers.submit(lambda a, b: a + b, 2, 3) == 5
    finally:
        workers.close()


async def test_an_exception_of_the_call_is_raised_at_the_await() -> None:
    workers = WorkerThreads("t")
    try:
        def boom() -> None:
            raise ValueError("in the thread")

        with pytest.raises(ValueError, match="in the thread"):
            await workers.submit(boom)
    finally:
        workers.close()


async def test_the_call_starts_at_submit_without_a_turn_of_the_loop() -> None:
    workers = WorkerThreads("t")
    try:
        began = threading.Event()
        fut = workers.submit(began.set)
        # No await since the submit: the loop has not turned, and the thread runs anyway.
        assert began.wait(10)
        await fut
    finally:
        workers.close()


async def test_idle_threads_are_reused_and_busy_ones_are_not_waited_for() -> None:
    workers = WorkerThreads("t")
    try:
        for _ in range(20):  # one after another: one thread
            await workers.submit(lambda: None)
        assert workers.threads == 1
        release = threading.Event()
        busy = [workers.submit(release.wait, 10) for _ in range(3)]
        # Three calls at once: three threads, none waiting for another.
        assert await asyncio.gather(workers.submit(lambda: 7)) == [7]
        assert workers.threads == 4
        release.set()
        assert await asyncio.gather(*busy) == [True, True, True]
    finally:
        workers.close()


async def test_a_cancelled_call_is_abandoned_to_its_thread_and_its_answer_dropped() -> None:
    workers = WorkerThreads("t")
    try:
        release, ended = threading.Event(), threading.Event()

        def hang() -> int:
            release.wait(10)
            ended.set()
            return 1

        fut = workers.submit(hang)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), 0.05)
        fut.cancel()
        release.set()
        await until_set(ended)
        for _ in range(3000):  # until its thread is idle again
            if workers.idle:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # its answer, dropped: no error for the cancelled future
        assert fut.cancelled()
        # The thread is idle again, and takes the next call.
        assert await workers.submit(lambda: 2) == 2
        assert workers.threads == 1
    finally:
        workers.close()


async def test_close_refuses_new_calls_and_lets_the_threads_end() -> None:
    workers = WorkerThreads("t")
    release = threading.Event()
    busy = workers.submit(release.wait, 10)
    await workers.submit(lambda: None)
    assert workers.threads == 2
    workers.close()
    with pytest.raises(CacheClosedError):
        workers.submit(lambda: None)
    release.set()
    assert await busy is True
    for _ in range(1000):
        if not workers.threads:
            break
        await asyncio.sleep(0.01)
    assert workers.threads == 0


def test_a_forked_child_starts_its_own_threads() -> None:
    """fork() copies no thread: a child that inherited idle ones counted would hand its
    work to nobody. Its first call starts a thread of its own."""
    workers = WorkerThreads("t")

    async def once() -> int:
        return await asyncio.wait_for(workers.submit(lambda: 41), 10) + 1

    assert asyncio.run(once()) == 42 and workers.idle == 1
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
        workers.close()
