"""Background work with an owner: a task group the cache holds for its whole life.

The cache's promotions, writes, deletes and pool growth run in one anyio task group, opened by
``open()`` and closed by ``aclose()``, so no task outlives the cache. The group lives in a
task of its own (the supervisor) because ``open()`` and ``aclose()`` may be called from
different tasks (the node server does), and a task group must be entered and left by one task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._errors import CacheClosedError

__all__ = ["TaskOwner"]

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

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background; a failure is logged, never lost."""
        if self._tg is None:
            raise CacheClosedError("the cache is closed: no background work can start")
        self.running += 1
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._tg.start_soon(self._run, fn, args)

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            log.exception("musacache background task failed")
        finally:
            self.running -= 1
            if self.running == 0:
                self._idle.set()

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
