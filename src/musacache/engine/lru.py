"""The LRU order of one memory tier, linked through its slot indices.

A memory tier's chunks each hold one slot, and slot indices are small dense ints, so the
recency list needs no per-chunk node: two int arrays (previous, next) and one list of entries,
all indexed by slot. That is 16 bytes per slot, against about 120 per chunk for an
``OrderedDict`` keyed by the chunk's key, and every operation is O(1).
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from musacache.engine.directory import untrack

if TYPE_CHECKING:
    from musacache.engine.directory import Entry

__all__ = ["KeyLRU", "SlotLRU", "int32_table"]

_NIL = -1
# Slots per page of a SlotLRU's entry table: a new page is one allocation of 32 KiB, and no
# page is ever copied.
PAGE = 4096
_SHIFT = 12
_MASK = PAGE - 1


def int32_table(n: int) -> memoryview:
    """``n`` int32s in an anonymous private mapping: address space reserved once, pages
    committed by the kernel (zero-filled) only when first written. A table sized by a pool's
    slot capacity up front then costs memory only for the slots in use, and never grows: an
    ``array`` or list grown by ``extend`` copies its whole table in one step when it
    reallocates (6.4 ms of loop time at a million slots). ``MAP_NORESERVE``: a tier of tiny
    slots and a large capacity reserves address space, not swap, for slots it may never use."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
    return memoryview(mmap.mmap(-1, max(1, n) * 4, flags=flags)).cast("i")


class SlotLRU:
    """Entries by slot index, oldest first, for a pool of at most ``max_slots`` slots.

    The links are two int32 tables reserved for every slot at once (:func:`int32_table`); the
    entries are in pages of ``PAGE`` slots, added as slots are first used. Nothing grows by
    copying, so no step of a growing cache copies more than one new page.
    """

    __slots__ = ("_entry", "_head", "_n", "_next", "_prev", "_size", "_tail")

    def __init__(self, max_slots: int) -> None:
        self._size = max_slots
        self._prev = int32_table(max_slots)  # int32: a pool never has 2**31 slots
        self._next = int32_table(max_slots)
        self._entry: list[list[Entry | None]] = []  # pages of PAGE slots
        self._head = _NIL  # oldest
        self._tail = _NIL  # newest
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __contains__(self, index: int) -> bool:
        pages = self._entry
        return 0 <= index and (index >> _SHIFT) < len(pages) \
            and pages[index >> _SHIFT][index & _MASK] is not None

    def add(self, index: int, e: Entry) -> None:
        """``e`` now holds slot ``index``: it becomes the newest."""
        if not 0 <= index < self._size:
            raise IndexError(f"slot {index} outside a pool of {self._size}")
        pages = self._entry
        while len(pages) <= index >> _SHIFT:
            pages.append([None] * PAGE)
        page = pages[index >> _SHIFT]
        if page[index & _MASK] is not None:
            self._unlink(index)
            self._n -= 1
        page[index & _MASK] = e
        self._n += 1
        self._link_newest(index)

    def remove(self, index: int, e: Entry | None = None) -> None:
        """Forget slot ``index`` (only if it holds ``e``, when given)."""
        if index not in self:
            return
        page = self._entry[index >> _SHIFT]
        if e is not None and page[index & _MASK] is not e:
            return
        self._unlink(index)
        page[index & _MASK] = None
        self._n -= 1

    def touch(self, index: int) -> None:
        """Slot ``index`` becomes the newest."""
        # (``in self``, inlined: a get touches every chunk it serves)
        if index != self._tail and 0 <= index:
            pages = self._entry
            if (index >> _SHIFT) < len(pages) and pages[index >> _SHIFT][index & _MASK] is not None:
                self._unlink(index)
                self._link_newest(index)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """``(key, entry)`` from the oldest; the current item may be removed meanwhile."""
        i = self._head
        pages = self._entry
        while i != _NIL:
            nxt = self._next[i]
            e = pages[i >> _SHIFT][i & _MASK]
            if e is not None:
                yield e.key, e
            i = nxt

    def table_bytes(self) -> int:
        """Memory of the tables for the slots used so far (the links' untouched pages cost
        nothing)."""
        used = len(self._entry) * PAGE
        return used * 8 + len(self._entry) * (56 + 8 * PAGE)

    def take_pages(self) -> list[list[Entry | None]]:
        """Forget every entry, and hand back the pages that held them: dropping a million
        references is a step of its own, which the caller spreads over loop turns."""
        pages = self._entry
        self._entry = []
        self._head = self._tail = _NIL
        self._n = 0
        return pages

    def clear(self) -> None:
        self.take_pages()

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
        # generation number -> its keys in order; a dict keeps the generations oldest first.
        # Each generation is untracked after every insert, or a full collection would walk
        # every entry the tier holds.
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
            gen = self._gens[g]
            gen[key] = e
            untrack(gen)
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
            untrack(gen)
            gen.move_to_end(key, last=False)
            where[key] = oldest

    def get(self, key: bytes) -> Entry | None:
        g = self._where[key[0]].get(key)
        return None if g is None else self._gens[g][key]

    def pop(self, key: bytes, default: Entry | None = None) -> Entry | None:
        where = self._where[key[0]]
        g = where.pop(key, None)
        if g is None:
            return default
        self._n -= 1
        return self._take(key, g)

    def take_generations(self) -> list[OrderedDict[bytes, Entry]]:
        """Forget every key, and hand back the generations that held them (as
        :meth:`SlotLRU.take_pages`: the caller drops them over several loop turns)."""
        gens = list(self._gens.values())
        self._gens = {0: OrderedDict()}
        self._newest = 0
        self._where = [{} for _ in range(256)]
        self._n = 0
        return gens

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
        untrack(gen)
        where[key] = self._newest
