"""Shared by the scripts that time the event loop's steps: each step's CPU time on the loop
thread, for the steps ``watch(handle)`` picks."""

import time
from asyncio import events
from collections.abc import Callable

steps: list[float] = []
_run = events.Handle._run


def time_steps(watch: Callable[[events.Handle], bool]) -> None:
    """From now on, append the loop thread's CPU time of every step ``watch`` picks to
    ``steps``."""

    def timed_run(self: events.Handle) -> None:
        if not watch(self):
            return _run(self)
        c0 = time.thread_time()
        _run(self)
        steps.append(time.thread_time() - c0)

    events.Handle._run = timed_run  # type: ignore[method-assign]
