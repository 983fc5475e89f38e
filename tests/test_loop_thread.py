"""The private loop an engine's synchronous hooks run musacache on (integrations._loop)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from musacache.integrations._loop import LoopThread


def test_a_timed_out_call_has_ended_before_the_engine_hears_of_it() -> None:
    # A read into the engine's memory that ran over its timeout is cancelled; its copy ends
    # a moment later (the mover waits for it). run() must not return before that: the
    # engine reuses the memory of a failed load for another request at once.
    wrote_late = threading.Event()

    async def slow_read() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            # The copy in flight, still writing when the cancellation comes.
            await asyncio.to_thread(time.sleep, 0.3)
            wrote_late.set()
            raise

    loop = LoopThread("test-loop")
    try:
        with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
            loop.run(slow_read(), 0.05)
        assert wrote_late.is_set()
    finally:
        loop.close()


def test_results_and_errors_come_back_as_they_are() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fails() -> None:
        raise ValueError("its own")

    async def own_timeout() -> None:
        raise TimeoutError("raised by the call itself")

    loop = LoopThread("test-loop")
    try:
        assert loop.run(answer(), 5.0) == 42
        with pytest.raises(ValueError, match="its own"):
            loop.run(fails(), 5.0)
        with pytest.raises(TimeoutError, match="by the call itself"):
            loop.run(own_timeout(), 5.0)
    finally:
        loop.close()
