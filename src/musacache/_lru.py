"""The LRU order of one memory tier, linked through its slot indices.

A memory tier's chunks each hold one slot, and slot indices are small dense ints, so the
recency list needs no per-chunk node: two int arrays (previous, next) and one list of entries,
all indexed by slot. That is 16 bytes per slot, against about 120 per chunk for an
``OrderedDict`` keyed by the chunk's key, and every operation is O(1).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._directory import Entry

__all__ = ["KeyLRU", "SlotLRU"]

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


# Keys per generation of a storage tier's recency order: growing one copies at most this many.
_GEN = 4096


class KeyLRU:
    """A storage tier's recency order, by key, oldest first (what an ``OrderedDict`` of the
    tier's chunks did, without one table of all of them).

    An ``OrderedDict`` grows by copying its whole table in one step: at 700,000 stored chunks
    (a restart learning a large listing, or a tier growing) that is a stall of the loop of
    about 0.1 s. Here the keys are kept in generations of at most ``_GEN``, oldest first, and
    which generation holds a key is kept in 256 dicts by the key's first byte: no table ever
    holds more than a small share of the tier. Order is exact: a key moved to the newest end
    goes to the newest generation, one moved to the oldest end to the front of the oldest.
    """

    __slots__ = ("_gens", "_n", "_newest", "_where")

    def __init__(self) -> None:
        # generation number -> its keys in order; a dict keeps the generations oldest first
        self._gens: dict[int, OrderedDict[bytes, Entry]] = {0: OrderedDict()}
        self._newest = 0
        self._where: list[dict[bytes, int]] = [{} for _ in range(256)]
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._where[key[0]]

    def __setitem__(self, key: bytes, e: Entry) -> None:
        """Record ``e`` under ``key``: the newest if new, in place if already there."""
        where = self._where[key[0]]
        g = where.get(key)
        if g is not None:
            self._gens[g][key] = e
            return
        self._append(key, e, where)
        self._n += 1

    def move_to_end(self, key: bytes, last: bool = True) -> None:
        where = self._where[key[0]]
        g = where[key]
        e = self._take(key, g)
        if last:
            self._append(key, e, where)
        else:
            oldest = next(iter(self._gens))
            gen = self._gens[oldest]
            gen[key] = e
            gen.move_to_end(key, last=False)
            where[key] = oldest

    def pop(self, key: bytes, default: Entry | None = None) -> Entry | None:
        where = self._where[key[0]]
        g = where.pop(key, None)
        if g is None:
            return default
        self._n -= 1
        return self._take(key, g)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """``(key, entry)`` from the oldest (the order must not change while iterating)."""
        for gen in list(self._gens.values()):
            yield from gen.items()

    def _take(self, key: bytes, g: int) -> Entry:
        gen = self._gens[g]
        e = gen.pop(key)
        if not gen and g != self._newest:
            del self._gens[g]
        return e

    def _append(self, key: bytes, e: Entry, where: dict[bytes, int]) -> None:
        gen = self._gens[self._newest]
        if len(gen) >= _GEN:
            self._newest += 1
            gen = self._gens[self._newest] = OrderedDict()
        gen[key] = e
        where[key] = self._newest
