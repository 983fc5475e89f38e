"""Placement decisions: which chunks to evict, where a chunk goes, what a delete removes.

Pure functions over the directory and the tier states: no I/O and no awaits, so a decision
and the bookkeeping that records it happen in one step on the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from musacache.engine.children import Siblings
from musacache.engine.directory import Directory, Entry
from musacache.engine.tierstate import MemTier, StoreTier, Tier

__all__ = ["EntryQueue", "delete_roots", "memory_only_batches", "reserve_slot", "subtree_batches",
           "victims"]


def victims(t: Tier, directory: Directory, count: int) -> list[Entry]:
    """Up to ``count`` chunks to evict from ``t``: least recently used first, leaves first
    (a chunk whose child is still held here goes after that child), never a pinned one nor
    one whose write to ``t`` is still queued.

    Amortised O(1) per victim. Recency already puts a prompt's parents after its children (a
    touch moves the chain leaf first, root last), so the oldest entry is nearly always a
    leaf. One that is not (a prefix some later put extended) is moved to the newest end
    when it is passed over, so the next eviction does not walk past it again; and when a
    victim's parent was passed over earlier in this walk, the parent follows it at once (a
    chain is evicted leaf to root in one walk).
    """
    out: list[Entry] = []
    chosen: set[bytes] = set()
    passed: dict[bytes, Entry] = {}  # skipped because a child was still held here
    store = t if isinstance(t, StoreTier) else None
    # This walk runs for every chunk a full cache takes in: Directory._kids and a memory
    # tier's holds() are inlined, and a leaf (the common case) costs no call.
    tag = t.idx if isinstance(t, MemTier) else None
    shards = directory.entries._shards
    orphans = directory.children

    def kids_of(key: bytes) -> Entry | Siblings[Entry] | None:
        p = shards[key[0]].get(key)
        return p.kids if p is not None else orphans.get(key)

    def held(have: Entry | Siblings[Entry]) -> bool:
        """Whether one of these children is still held here (and not chosen)."""
        if isinstance(have, Siblings):
            return any(t.holds(c) and c.key not in chosen for c in have)
        if tag is not None:
            return have.slot_index(tag) is not None and have.key not in chosen
        return t.holds(have) and have.key not in chosen

    for key, e in t.lru.items():
        if len(out) >= count:
            break
        if e.pins or key in chosen or (store is not None and store.pending_obj(e) is not None):
            continue  # pinned by a reader, or its write to this tier is still queued
        p = shards[key[0]].get(key)
        have = p.kids if p is not None else orphans.get(key)
        if have is not None and held(have):
            passed[key] = e  # a suffix is worthless without its prefix
            continue
        out.append(e)
        chosen.add(key)
        if passed:
            parent = passed.get(e.parent)
            while parent is not None and len(out) < count:
                have = kids_of(parent.key)
                if have is not None and held(have):
                    break
                del passed[parent.key]
                out.append(parent)
                chosen.add(parent.key)
                parent = passed.get(parent.parent)
    for e in passed.values():
        t.touch(e)
    return out


def reserve_slot(mem: Sequence[MemTier], start: int = 0) -> tuple[MemTier, int] | None:
    """A free slot index in the hottest memory tier (from ``start``) that has one."""
    for t in mem[start:]:
        idx = t.pool.reserve()
        if idx is not None:
            return t, idx
    return None


def memory_only_batches(directory: Directory, stores: Sequence[StoreTier],
                        batch: int) -> Iterator[list[Entry]]:
    """The chunks held in memory and in no storage tier, parents first (every chunk after its
    parent), cut after every ``batch`` steps of the walk: the caller lets the loop run between
    batches, so a million entries are never looked at in one step.

    A depth-first walk down the parent links from the chunks whose parent is not cached: a
    parent is met before its children, so no sort (and no table of every key's depth) is
    needed. The walk keeps a stack of lists of children (each taken in one C call), never a
    list of every entry; a batch may be empty."""
    roots = list(directory.children.values())
    stack: list[Iterator[Entry | Siblings[Entry]]] = [iter(roots)]
    del roots
    out: list[Entry] = []
    steps = 0
    while stack:
        have = next(stack[-1], None)
        if have is None:
            stack.pop()
            continue
        steps += 1
        if isinstance(have, Siblings):
            stack.append(iter(have.snapshot()))
        else:
            if not have.dead and have.in_memory and not any(t.holds(have) for t in stores):
                out.append(have)
            if have.kids is not None:
                stack.append(iter((have.kids,)))
        if steps >= batch:
            yield out
            out = []
            steps = 0
    yield out


def delete_roots(directory: Directory, chain_keys: Iterable[tuple[int, int, bytes, bytes]],
                 toks: np.ndarray) -> tuple[list[bytes], list[bytes]]:
    """The roots of what ``delete(toks)`` removes, and the prompt's chain keys, for the
    chunks of ``chain_keys`` (``KeyChain.iter_keys(toks)``, all of it or a run of it: each
    chunk's roots depend on that chunk alone, so a long prompt is taken a run per step).

    The prompt's chunks are those keyed on its chain, plus, at the first position the chain
    is not cached whole, the chunks after the same prefix whose tokens are a prefix of the
    prompt's there or extend them (a cached partial tail, or a longer chunk that starts with
    the prompt's tail). Every chunk under a root or a chain key, to any depth, goes too
    (:func:`subtree_batches`): the prompt's first chunk is the root of everything deleted,
    so nothing built on it stays reachable.
    """
    keys: list[bytes] = []
    roots: list[bytes] = []
    for start, end, parent, key in chain_keys:
        keys.append(key)
        if directory.get(key) is not None:
            roots.append(key)
            continue
        roots.extend(c.key for c in directory.children_along(parent,
                                                             toks[start:end].tobytes()))
    # Orphans keyed on the chain (their parent was lost) are the prompt's chunks too. (A set
    # to ask: a list made this quadratic, 1.1 s for a prompt of 16,384 cached chunks.)
    have = set(roots)
    roots.extend(key for key in keys if key not in have and directory.get(key) is not None)
    return roots, keys


# A big index's last ``_TAIL * batch`` children are taken ``batch // _TAIL`` at a time.
_TAIL = 8


def subtree_batches(directory: Directory, roots: list[bytes], batch: int,
                    queued: set[bytes] | None = None) -> Iterator[list[Entry]]:
    """Every entry under ``roots`` (by parent links, to any depth), ``batch`` at a time.
    ``queued``, when given, is ``set(roots)`` and ``roots`` has no key twice: both are then
    the walk's own (the caller built them a batch at a time, each consumed here).

    The caller removes each batch before asking for the next, and may let other tasks run
    in between. A key's children leave the directory as a whole when the walk reaches it
    (:meth:`Directory.take_kids`, one step whatever their number) and are then taken out of
    their index ``batch`` at a time: no list of every child is built, and none is dropped at
    once (touching 200,000 entries in one step is a loop stall of 10 to 20 ms). A batch is
    cut after ``batch`` steps of work (an entry found, or a key looked at), so it may be
    short, or empty: looking at a million leaves for children is work too."""
    # Every entry has one parent, so below the roots this is a tree: only the roots (which
    # may extend one another) can be met twice. No set of every key walked is kept (freeing
    # a million of them at the end would be a stall of its own).
    if queued is None:
        queued = set(roots)
        stack = list(queued)
    else:
        stack = roots
    lost = directory.lost_under
    out: list[Entry] = []
    steps = 0
    limit = batch
    while stack:
        cur = stack.pop()
        steps += 1
        for k in directory.take_lost(cur):  # orphans under a chunk missing below cur
            if k not in queued:
                stack.append(k)
        have = directory.take_kids(cur)
        big = isinstance(have, Siblings) and len(have) > 4 * _TAIL * batch
        while have is not None:
            if isinstance(have, Siblings):
                # A big index's last children go a few per batch: freed in no particular
                # order, the last of them are the last objects of most of the allocator's
                # arenas, each given back to the OS as it empties (a delete of 200,000
                # children: 21 to 35 arenas of 1 MiB in its last batch, 4 to 6 ms).
                if big and len(have) <= _TAIL * batch:
                    limit = max(1, batch // _TAIL)
                kids = have.drain(limit)
                if not have:
                    have = None
            else:
                kids, have = [have], None
            for c in kids:
                steps += 1
                if c.key not in queued:
                    out.append(c)
                    if c.kids is not None or c.dead or c.key in lost:  # a leaf is not
                        # walked (no stack of 200,000 leaf keys); a removed entry's children
                        # wait under its key, and orphans under missing chunks below it
                        stack.append(c.key)
            # Once removed, an entry's last reference is the batch it went out in, so it is
            # freed with that batch.
            del kids
            if steps >= limit:
                yield out
                out, steps = [], 0
        limit = batch
        if steps >= batch:
            yield out
            out, steps = [], 0
    if out:
        yield out


class EntryQueue:
    """Entries, first in first out, held in numpy object arrays of ``block`` entries.

    Why not lists: Python's cyclic collector walks every reference of every container in the
    generation it collects, and each reference it walks is a cache miss on the object it
    names. A million entries queued in lists are all walked once more as those lists pass
    through the young generations: 4 to 9 ms per young collection here, on the loop, however
    small the lists (``persist`` at close, with a million chunks to write). An object array
    holds its references the same way but is not tracked by the collector, so no collection
    walks them.
    """

    def __init__(self, block: int = 4096) -> None:
        self._block = block
        self._blocks: list[np.ndarray] = []
        self._head = 0  # the next entry to take, in _blocks[0]
        self._tail = block  # the next free place, in _blocks[-1]

    def __len__(self) -> int:
        if not self._blocks:
            return 0
        return (len(self._blocks) - 1) * self._block + self._tail - self._head

    def extend(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if self._tail == self._block:
                self._blocks.append(np.empty(self._block, dtype=object))
                self._tail = 0
            self._blocks[-1][self._tail] = e
            self._tail += 1

    def take(self, n: int) -> list[Entry]:
        """The next ``n`` entries (fewer at the end); the queue lets go of them."""
        out: list[Entry] = []
        while len(out) < n and self._blocks:
            b = self._blocks[0]
            end = self._tail if len(self._blocks) == 1 else self._block
            stop = min(end, self._head + n - len(out))
            out.extend(b[self._head : stop].tolist())
            b[self._head : stop] = None
            self._head = stop
            if stop == end:
                self._drop_first()
        return out

    def drop_block(self) -> bool:
        """Let go of the oldest block's entries (a block per loop turn, not a million in one
        step); whether any are left."""
        if self._blocks:
            self._drop_first()
        return bool(self._blocks)

    def _drop_first(self) -> None:
        self._blocks.pop(0)
        self._head = 0
        if not self._blocks:
            self._tail = self._block
