"""The LRU order of one memory tier, linked through its slot indices.

A memory tier's chunks each hold one slot, and slot indices are small dense ints, so the
recency list needs no per-chunk node: two int arrays (previous, next) and one list of entries,
all indexed by slot. That is 16 bytes per slot, against about 120 per chunk for an
``OrderedDict`` keyed by the chunk's key, and every operation is O(1).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._directory import Entry

__all__ = ["SlotLRU"]

_NIL = -1


class SlotLRU:
    """Entries by slot index, oldest first."""

    __slots__ = ("_entry", "_head", "_n", "_next", "_prev", "_tail")

    def __init__(self) -> None:
        self._prev = array("i")  # int32: a pool never has 2**31 slots
        self._next = array("i")
        self._entry: list[Entry | None] = []
        self._head = _NIL  # oldest
        self._tail = _NIL  # newest
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __contains__(self, index: int) -> bool:
        return 0 <= index < len(self._entry) and self._entry[index] is not None

    def add(self, index: int, e: Entry) -> None:
        """``e`` now holds slot ``index``: it becomes the newest."""
        grow = index + 1 - len(self._entry)
        if grow > 0:
            self._prev.extend([_NIL] * grow)
            self._next.extend([_NIL] * grow)
            self._entry.extend([None] * grow)
        elif self._entry[index] is not None:
            self._unlink(index)
            self._n -= 1
        self._entry[index] = e
        self._n += 1
        self._link_newest(index)

    def remove(self, index: int, e: Entry | None = None) -> None:
        """Forget slot ``index`` (only if it holds ``e``, when given)."""
        if index not in self:
            return
        if e is not None and self._entry[index] is not e:
            return
        self._unlink(index)
        self._entry[index] = None
        self._n -= 1

    def touch(self, index: int) -> None:
        """Slot ``index`` becomes the newest."""
        # (``in self``, inlined: a get touches every chunk it serves)
        if index != self._tail and 0 <= index < len(self._entry) \
                and self._entry[index] is not None:
            self._unlink(index)
            self._link_newest(index)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """``(key, entry)`` from the oldest; the current item may be removed meanwhile."""
        i = self._head
        while i != _NIL:
            nxt = self._next[i]
            e = self._entry[i]
            if e is not None:
                yield e.key, e
            i = nxt

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    def _unlink(self, i: int) -> None:
        p, n = self._prev[i], self._next[i]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p

    def _link_newest(self, i: int) -> None:
        t = self._tail
        self._prev[i] = t
        self._next[i] = _NIL
        if t == _NIL:
            self._head = i
        else:
            self._next[t] = i
        self._tail = i
