"""``TaskOwner.spawn_soon``: background work started at the loop's next turn, counted as
running from the call."""

from __future__ import annotations

import asyncio

import pytest

from musacache._errors import CacheClosedError
from musacache.engine.tasks import TaskOwner


async def test_work_spawned_soon_starts_after_the_caller_and_drain_waits_for_it() -> None:
    owner = TaskOwner()
    await owner.start()
    try:
        ran: list[str] = []

        async def work(tag: str) -> None:
            await asyncio.sleep(0.01)
            ran.append(tag)

        owner.spawn_soon(work, "a")
        # Counted from the call, before its task exists: a flush (drain) right after the
        # caller returns waits for it.
        assert owner.running == 1 and ran == []
        await owner.drain()
        assert ran == ["a"] and owner.running == 0
    finally:
        await owner.aclose()


async def test_work_spawned_soon_is_dropped_when_the_owner_closes_first() -> None:
    owner = TaskOwner()
    await owner.start()
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")

    owner.spawn_soon(work)
    await owner.aclose()
    await asyncio.sleep(0)
    assert ran == [] and owner.running == 0
    with pytest.raises(CacheClosedError):
        owner.spawn_soon(work)
