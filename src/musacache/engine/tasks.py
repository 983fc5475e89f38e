"""Background work with an owner: a task group the cache holds for its whole life.

The cache's promotions, writes, deletes and pool growth run in one anyio task group, opened by
``open()`` and closed by ``aclose()``, so no task outlives the cache. The group lives in a
task of its own (the supervisor) because ``open()`` and ``aclose()`` may be called from
different tasks (the node server does), and a task group must be entered and left by one task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from musacache._errors import CacheClosedError

if TYPE_CHECKING:
    import numpy as np

    from musacache.engine.directory import Directory

__all__ = ["CutWork", "TaskOwner", "run_steps"]

log = logging.getLogger("musacache")


class TaskOwner:
    def __init__(self) -> None:
        self._tg: TaskGroup | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stop = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self.running = 0

    async def start(self) -> None:
        ready = anyio.Event()

        async def supervise() -> None:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
            self._tg = None

        self._supervisor = asyncio.get_running_loop().create_task(supervise())
        await ready.wait()

    def running_group(self) -> bool:
        """Whether :meth:`spawn` can start work now."""
        return self._tg is not None and not self._stop.is_set()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background; a failure is logged, never lost. Refused
        once :meth:`aclose` has begun: the group is being cancelled, and a task started in
        it then would never be (anyio delivers a group's cancellation once), so the close
        would wait for it for ever."""
        if self._tg is None or self._stop.is_set():
            raise CacheClosedError("the cache is closed: no background work can start")
        self._begun()
        self._tg.start_soon(self._run, fn, args)

    def spawn_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """:meth:`spawn`, with the task started at the loop's next turn instead of in the
        call: for work a caller about to return starts, off the caller's own time (a task
        costs about 25 µs on the loop here). Running from the call on (:meth:`drain` waits
        for it); never started if the cache begins to close meanwhile."""
        if self._tg is None or self._stop.is_set():
            raise CacheClosedError("the cache is closed: no background work can start")
        self._begun()
        asyncio.get_running_loop().call_soon(self._start, fn, args)

    def _start(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        if self._tg is None or self._stop.is_set():
            self._ended()
            return
        self._tg.start_soon(self._run, fn, args)

    def _begun(self) -> None:
        self.running += 1
        if self._idle.is_set():
            self._idle = anyio.Event()

    def _ended(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            log.exception("musacache background task failed")
        finally:
            self._ended()

    async def drain(self) -> None:
        """Wait until no background work is left (work may start more work)."""
        while self.running:
            await self._idle.wait()

    async def aclose(self) -> None:
        """Cancel what is still running and wait for the group to end."""
        self._stop.set()
        if self._supervisor is not None:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(self._supervisor, return_exceptions=True)
            self._supervisor = None


    def abandon(self) -> None:
        """Let go of the group of an event loop that has closed: its tasks ended with that
        loop (or never will run again), and its events can no longer be set or awaited
        from any other loop. Nothing can be spawned from now on."""
        self._tg = None
        self._supervisor = None
        self.running = 0


async def run_steps(steps: Iterator[object], tasks: TaskOwner | None,
                    abandon: Callable[[Iterator[object]], None] | None = None) -> None:
    """Drive ``steps`` (work that yields between its batches) to its end, the loop free
    between batches. Work that must finish once started (a delete, taking a directory
    apart): if the caller is cancelled meanwhile, the rest runs in a background task of
    ``tasks`` and the cancellation is raised. Left half done, a delete would leave chunks
    chained under a removed parent for a later put to chain onto.

    Once ``tasks`` is closing (or without one), the rest is handed to ``abandon`` when
    given (the cache closes: what is left is noted for the next open, or goes with the
    memory, see ``engine.notes``), else run at once. Run at once at a close, a million
    steps held the loop for seconds."""
    for _ in steps:
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:
            if tasks is not None and tasks.running_group():
                tasks.spawn(_finish_steps, steps, abandon)
            else:
                _stop_steps(steps, abandon)
            raise


async def _finish_steps(steps: Iterator[object],
                        abandon: Callable[[Iterator[object]], None] | None) -> None:
    for _ in steps:
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:  # the cache closes
            _stop_steps(steps, abandon)
            raise


def _stop_steps(steps: Iterator[object],
                abandon: Callable[[Iterator[object]], None] | None) -> None:
    """Hand the rest of ``steps`` to ``abandon``, or (without one) run it now."""
    if abandon is not None:
        abandon(steps)
        return
    for _ in steps:
        pass


class CutWork:
    """The deletes and clears running now, and the steps a close abandoned: what
    ``engine.notes.note_cut`` notes and lets go of."""

    def __init__(self) -> None:
        self.prompts: dict[int, np.ndarray] = {}  # deletes running, by ticket
        self.cleared: dict[int, Directory] = {}  # directories a clear is taking apart
        self.steps: list[Iterator[object]] = []  # work abandoned at a close
        self.noted = False  # note_cut has run (a close run again notes nothing twice)
        self._tickets = iter(range(1 << 62))

    def deleting(self, toks: np.ndarray, steps: Iterator[None]) -> Iterator[None]:
        """``steps`` of a delete of ``toks``, registered while they run (left registered
        when abandoned, so that the close notes the prompt)."""
        ticket = next(self._tickets)
        self.prompts[ticket] = toks
        yield from steps
        del self.prompts[ticket]

    def clearing(self, old: Directory, steps: Iterator[None]) -> Iterator[None]:
        """``steps`` taking ``old`` apart, registered as :meth:`deleting` registers."""
        ticket = next(self._tickets)
        self.cleared[ticket] = old
        yield from steps
        del self.cleared[ticket]

    def abandon(self, steps: Iterator[object]) -> None:
        """Keep ``steps`` to let go of at the close (never run on)."""
        self.steps.append(steps)
