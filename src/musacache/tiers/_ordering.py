"""Per-key ordering of a storage tier's writes and deletes.

A write and a delete of the same key that run at once can land in either order at the
backend: a delete that started first can remove the file or object that a newer write just
put there, or miss it and leave a deleted chunk to come back after a restart. Holding one lock
per key makes each key's operations take effect one at a time, in the order they were called
(anyio's lock hands over to its waiters first in, first out, and an uncontended acquire takes
the lock before the caller's first await).

Reads do not take the lock: a hung read must never hold up the writes and deletes behind it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

__all__ = ["KeyOrder"]


class KeyOrder:
    """One FIFO lock per key, created on demand and dropped when nobody holds or waits."""

    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[anyio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: bytes) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (anyio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]

    def __len__(self) -> int:
        """Keys with an operation running or waiting (0 when the tier is idle)."""
        return len(self._locks)
