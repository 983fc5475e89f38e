"""``WorkerThreads``: threads that take a function from the event loop at the call.

``anyio.to_thread.run_sync`` passes through the loop twice before its thread starts (a
checkpoint, then one more in the limiter's ``acquire``), each a turn in which every other
ready callback runs first: the second lane of a disk batch started 0.10 ms (median) after
the first, and with two lanes sharing a batch of equal chunks the batch ends that much later.
Here a function is queued to a thread in :meth:`WorkerThreads.submit` itself, and its answer
comes back as an ``asyncio`` future; the caller keeps its own bound on the threads in use
(the disk tier's thread tokens) and takes it before it submits.

Threads are daemons: one stuck in a hung file system (NFS) does not hold up the process's
exit. A thread is started when none is idle and never more than were ever busy at once; they
end once the owner is closed and they are idle. In a child made by ``fork()`` (which copies
none of them) the first call starts afresh.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import CacheClosedError

__all__ = ["WorkerThreads"]

_T = TypeVar("_T")
_Work = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]",
              asyncio.AbstractEventLoop]


class WorkerThreads:
    """Worker threads named ``name``, handed work at the call (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0        # threads waiting for work and not yet claimed by a submit
        self._threads = 0     # threads started and not ended
        self._closed = False
        self._pid = os.getpid()

    @property
    def threads(self) -> int:
        """Threads started and not yet ended (busy, stuck or idle)."""
        return self._threads

    @property
    def idle(self) -> int:
        """Threads done with their last call and not yet handed another."""
        return self._idle

    def submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """``fn(*args)`` in a worker thread, started now; its result (or exception) is the
        returned future's. Cancelling the future abandons the call: the thread runs it to
        its end all the same, and its answer is dropped."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()
        if os.getpid() != self._pid:
            self._forked()
        with self._lock:
            if self._closed:
                raise CacheClosedError(f"{self._name}: the worker threads are closed")
            start = not self._idle
            if start:
                self._threads += 1
            else:
                self._idle -= 1
        if start:
            try:
                threading.Thread(target=self._run, name=f"{self._name}-{self._threads}",
                                 daemon=True).start()
            except BaseException:
                with self._lock:
                    self._threads -= 1
                raise
        self._work.put((fn, args, fut, loop))
        return fut

    def _forked(self) -> None:
        # In a child process made by fork(): the parent's threads are not here, and an
        # idle one counted would be handed work nobody runs.
        self._work = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = self._threads = 0
        self._pid = os.getpid()

    def close(self) -> None:
        """Let every thread end once idle (a busy or stuck one ends when its call returns);
        :meth:`submit` raises from now on."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._work.put(None)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                break
            fn, args, fut, loop = work
            del work
            result: Any = None
            exc: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting side, as a thread pool does
                exc = e
            with self._lock:
                self._idle += 1
            try:
                loop.call_soon_threadsafe(_settle, fut, result, exc)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for the answer
                pass
            del fn, args, fut, loop, result, exc
        with self._lock:
            self._threads -= 1
            self._idle -= 1


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # abandoned by its caller
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
