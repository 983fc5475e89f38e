"""A private asyncio loop on a daemon thread, for engines whose hooks are synchronous.

vLLM and SGLang call their connectors from plain threads; musacache's client is async. Each
connector owns one loop thread and submits coroutines to it. A hook that must have an answer
waits with a timeout (:meth:`LoopThread.run`); a hook that must not block at all keeps the
future and looks at it on a later call (:meth:`LoopThread.submit`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .._errors import CacheUnavailableError

T = TypeVar("T")

__all__ = ["MAX_TIMEOUT_S", "SETTLE_S", "LoopThread"]

log = logging.getLogger("musacache")

#: How long :meth:`LoopThread.run` waits, past its timeout, for a cancelled call to end (its
#: copies stop at the next block or page: milliseconds).
SETTLE_S = 10.0
#: The longest timeout :meth:`LoopThread.run` can bound a call by: its wait and the grace
#: after it (SETTLE_S) must both be a timeout threading accepts.
MAX_TIMEOUT_S = threading.TIMEOUT_MAX - SETTLE_S


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """``coro`` bounded by ``timeout`` on the loop: cancelled when it runs over, and
    :class:`TimeoutError` raised once it has unwound (the cancellation runs through it
    before the ``async with`` ends). A ``TimeoutError`` of its own passes as it is."""
    bound = asyncio.timeout(timeout)
    try:
        async with bound:
            return await coro
    except TimeoutError:
        if bound.expired():
            raise TimeoutError(f"musacache call did not finish within {timeout} s") from None
        raise


class LoopThread:
    """One event loop running on one daemon thread until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future may be polled or waited on."""
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise CacheUnavailableError("the musacache loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` and wait at most ``timeout`` seconds for its result.

        On timeout the coroutine is cancelled and :class:`TimeoutError` is raised only once
        it has ended: a cancelled read into the engine's memory (a host pool page, a KV
        block) stops writing there before the engine hears of the miss and reuses that
        memory for another request. A coroutine that has not ended :data:`SETTLE_S` seconds
        after its cancellation is left running and logged; the error says so. Its own
        exceptions propagate.
        """
        return self.result(self.start(coro, timeout), timeout)

    def start(self, coro: Coroutine[Any, Any, T], timeout: float,
              ) -> concurrent.futures.Future[T]:
        """Start ``coro`` bounded by ``timeout`` (cancelled when it runs over) without
        waiting; :meth:`result` waits for it as :meth:`run` does."""
        return self.submit(_bounded(coro, timeout))

    def result(self, fut: concurrent.futures.Future[T], timeout: float) -> T:
        """The result of a call :meth:`start` began, waited for at most ``timeout`` seconds
        (what is left of its bound) plus :data:`SETTLE_S` for it to end once cancelled."""
        try:
            return fut.result(max(0.0, timeout) + SETTLE_S)
        except concurrent.futures.TimeoutError:  # (the builtin TimeoutError on 3.11+)
            if fut.done():
                raise  # _bounded's: the call ran over its timeout and has ended
            # The loop did not even end the call within its grace: it is stuck (a blocked
            # loop thread). Nothing more can be done from here than to say so.
            fut.cancel()
            log.error("musacache: a call cancelled after %s s did not end within %s s more; "
                      "it may still write into the memory it was given", timeout, SETTLE_S)
            raise TimeoutError(f"musacache call did not finish within {timeout} s, nor end "
                               f"{SETTLE_S} s after it was cancelled") from None

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs, stop the loop and join the thread."""
        if self._loop.is_closed():
            return

        async def _cancel_all() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result(timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
