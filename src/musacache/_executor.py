"""The cache's worker threads, and how work that must finish survives a cancellation.

One :class:`Executor` per cache runs every blocking call the cache makes: copies, the codec,
native gathers and scatters, file reads and writes, listings, pinned allocations. A
:class:`Lane` bounds how many calls of one kind run at once (the Mover's copies to
``copy_threads``) without threads of its own: all lanes share the executor's threads, which
are started when none is idle and end once it is closed. A disk tier bounds its calls by a
capacity limiter instead: a read abandoned to a hung file gives its token back, while its
thread stays in the call.

A call is handed to a thread in the call that submits it, with no turn of the event loop in
between, and its answer comes back as an ``asyncio`` future. Threads are daemons: one stuck
in a hung file system does not hold up the process's exit. In a child made by ``fork()``
(which copies no thread) the first call starts afresh.

:func:`outlive` is the one way a coroutine waits for work that must finish (memory the work
writes is about to be freed, pins must be let go of) whatever cancels it meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from musacache._errors import CacheClosedError

__all__ = ["Executor", "Lane", "finish", "outlive"]

_T = TypeVar("_T")

# States of a call: waiting for a thread (it may still be taken back), running, taken back.
_QUEUED, _RUNNING, _TAKEN_BACK = 0, 1, 2


class _Call:
    __slots__ = ("args", "done", "fn", "lane", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 done: Callable[[Any, BaseException | None], None], lane: Lane | None) -> None:
        self.fn, self.args, self.done, self.lane = fn, args, done, lane
        self.state = _QUEUED


def _future_settler(loop: asyncio.AbstractEventLoop,
                    fut: asyncio.Future[Any]) -> Callable[[Any, BaseException | None], None]:
    def settle(result: Any, exc: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(_settle, fut, result, exc)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the answer
            pass
    return settle


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # abandoned by its caller
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class Executor:
    """Worker threads named ``name``: see the module docstring."""

    def __init__(self, name: str = "musacache") -> None:
        self.name = name
        self._lanes: list[Lane] = []
        self._reset()
        self._closed = False

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a lane's call ended
        for lane in self._lanes:
            lane._running = 0
            lane._waiting.clear()
        self._work: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._idle = 0      # threads waiting for work and not yet claimed by a call
        self._threads = 0   # threads started and not ended
        self._pid = os.getpid()

    @property
    def threads(self) -> int:
        """Threads started and not yet ended (busy, stuck or idle)."""
        return self._threads

    @property
    def idle(self) -> int:
        """Threads done with their last call and not yet handed another."""
        return self._idle

    @property
    def closed(self) -> bool:
        return self._closed

    def lane(self, limit: int) -> Lane:
        """A lane of this executor that runs at most ``limit`` of its calls at once."""
        lane = Lane(self, limit)
        self._lanes.append(lane)
        return lane

    def submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """``fn(*args)`` in a thread, started now; its result or exception is the returned
        future's. Cancelling the future abandons the call (it runs to its end all the same,
        its answer dropped); :meth:`run` is the way to wait for it instead."""
        fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._hand(_Call(fn, args, _future_settler(fut.get_loop(), fut), None))
        return fut

    def submit_blocking(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """``fn(*args)`` in a thread, from any thread (the codec's fan-out of a chunk's
        blocks); a ``concurrent.futures.Future`` of its answer."""
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def settle(result: Any, exc: BaseException | None) -> None:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        self._hand(_Call(fn, args, settle, None))
        return fut

    async def run(self, fn: Callable[..., _T], *args: Any, abandon: bool = False) -> _T:
        """``await`` of ``fn(*args)`` in a thread. A caller cancelled while ``fn`` runs
        waits for it to end, then is cancelled (``fn`` touches memory the caller owns and
        may free next), unless ``abandon`` (a read that may hang: its answer is dropped).
        One cancelled before a thread took ``fn`` takes it back instead."""
        return await _run(self, None, fn, args, abandon)

    def _hand(self, call: _Call) -> None:
        if os.getpid() != self._pid:
            self._reset()  # a child of fork(): the parent's threads and lock are not here
        with self._lock:
            if self._closed:
                raise CacheClosedError(f"{self.name}: the worker threads are closed")
            start = not self._idle
            if start:
                self._threads += 1
            else:
                self._idle -= 1
        if start:
            try:
                threading.Thread(target=self._main, name=f"{self.name}-{self._threads}",
                                 daemon=True).start()
            except BaseException:
                with self._lock:
                    self._threads -= 1
                raise
        self._work.put(call)

    def _take_back(self, call: _Call) -> bool:
        """Whether ``call`` was taken back before a thread began it."""
        with self._lock:
            if call.state != _QUEUED:
                return False
            call.state = _TAKEN_BACK
            if call.lane is not None and call in call.lane._waiting:
                call.lane._waiting.remove(call)  # else handed to a thread, which skips it
        return True

    def _main(self) -> None:
        while True:
            call = self._work.get()
            if call is None:
                break
            while call is not None:
                call = self._one(call)
        with self._lock:
            self._threads -= 1
            self._idle -= 1

    def _one(self, call: _Call) -> _Call | None:
        """Run ``call``; return the next call of its lane that waited for it, if any (this
        thread runs it: the lane stays full), else count the thread idle."""
        with self._lock:
            skip = call.state == _TAKEN_BACK
            call.state = _RUNNING
        result: Any = None
        exc: BaseException | None = None
        if not skip:
            try:
                result = call.fn(*call.args)
            except BaseException as e:  # handed to the awaiting side, as a thread pool does
                exc = e
        lane = call.lane
        nxt: _Call | None = None
        with self._lock:
            if lane is not None:
                if lane._waiting:
                    nxt = lane._waiting.popleft()
                else:
                    lane._running -= 1
                    self._changed.notify_all()
            if nxt is None:
                # Idle before the answer is out: a call its caller makes next finds the
                # thread free instead of starting another.
                self._idle += 1
        if not skip:
            call.done(result, exc)
        return nxt

    def close(self) -> None:
        """Let every thread end once idle (a busy or stuck one ends when its call returns);
        calls raise :class:`CacheClosedError` from now on."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._work.put(None)


class Lane:
    """At most ``limit`` calls at once on an executor's threads; the rest wait their turn,
    in order, and the thread that ends one call takes the next (no turn of the loop)."""

    def __init__(self, executor: Executor, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a lane runs at least one call at once, got {limit}")
        self.executor = executor
        self.limit = limit
        self._running = 0
        self._waiting: collections.deque[_Call] = collections.deque()

    @property
    def running(self) -> int:
        """Calls of this lane begun and not ended."""
        return self._running

    def wait_idle(self) -> None:
        """Block until no call of the lane runs or waits (closed first: none can start)."""
        with self.executor._changed:
            self.executor._changed.wait_for(lambda: not self._running and not self._waiting)

    def submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """:meth:`Executor.submit` within the lane's limit."""
        fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._hand(_Call(fn, args, _future_settler(fut.get_loop(), fut), self))
        return fut

    async def run(self, fn: Callable[..., _T], *args: Any, abandon: bool = False) -> _T:
        """:meth:`Executor.run` within the lane's limit."""
        return await _run(self.executor, self, fn, args, abandon)

    def _hand(self, call: _Call) -> None:
        ex = self.executor
        if os.getpid() != ex._pid:
            ex._reset()
        with ex._lock:
            if ex._closed:
                raise CacheClosedError(f"{ex.name}: the worker threads are closed")
            if self._running >= self.limit:
                self._waiting.append(call)
                return
            self._running += 1
        try:
            ex._hand(call)
        except BaseException:
            with ex._lock:
                self._running -= 1
            raise


async def _run(ex: Executor, lane: Lane | None, fn: Callable[..., _T], args: tuple[Any, ...],
               abandon: bool) -> _T:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()
    call = _Call(fn, args, _future_settler(loop, fut), lane)
    (lane or ex)._hand(call)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if not ex._take_back(call) and not abandon:
            await outlive(fut)
        raise


async def outlive(fut: asyncio.Future[Any]) -> BaseException | None:
    """Wait until ``fut`` is done, whatever cancels the caller meanwhile (anyio's scopes and
    a plain ``task.cancel()`` alike); the first cancellation that came, for the caller to
    raise once it may."""
    came: BaseException | None = None
    with anyio.CancelScope(shield=True):  # anyio's scopes would re-cancel every turn
        while not fut.done():
            try:
                await asyncio.wait((fut,))
            except asyncio.CancelledError as e:
                came = came or e
    if not fut.cancelled():
        fut.exception()  # seen: asyncio would log it as never retrieved
    return came


async def finish(work: Awaitable[_T]) -> _T:
    """Run ``work`` to its end whatever cancels the caller meanwhile (letting go of pins a
    run per turn of the loop), then raise the first cancellation that came."""
    task = asyncio.ensure_future(work)
    came = await outlive(task)
    if came is not None:
        try:
            raise came
        finally:
            del came  # (a local would keep its traceback in a cycle)
    # An anyio scope cancelled meanwhile was held off by outlive's shield: raised here.
    await anyio.lowlevel.checkpoint_if_cancelled()
    return task.result()
