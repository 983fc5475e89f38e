"""The location directory: which chunks exist, where they live, and how they chain.

Pure bookkeeping, no I/O and no awaits, so every method is atomic on the event loop. The engine
pins an entry (``pins``) for as long as it reads it; a pinned entry is never evicted, and a
deleted one keeps its memory until the last reader unpins it (``dead``).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import numpy as np

from musacache._keys import KEY_BYTES, KeyChain
from musacache.engine.children import Siblings, common_tokens

__all__ = ["Directory", "Entry", "KeyTable", "Match", "untrack"]


def _c_untrack() -> Callable[[object], None] | None:
    try:
        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except AttributeError:  # not CPython: no such call, and objects stay as they are
        return None
    fn.argtypes = (ctypes.py_object,)
    fn.restype = None
    return fn


_UNTRACK = _c_untrack()


def untrack(obj: object) -> None:
    """Take one of the directory's own objects off the cyclic collector's lists.

    A full collection walks every tracked object of the process and what each refers to: at
    a million entries, and the tables that hold them, that is a pause of about half a second
    on the event loop, every time the process's long-lived objects grew by a quarter. The
    directory's objects form no reference cycles (an entry names its parent by key, and
    holds only its children), so reference counting alone frees them, and the collector has
    nothing to find among them. Only the object passed is affected: the process's collector
    keeps its settings and still walks every other object. A dict is tracked again by the
    interpreter when an entry is inserted into it, so a table holding entries is untracked
    after each insert."""
    if _UNTRACK is not None:
        _UNTRACK(obj)


# Residency is packed into ints: ``value << 8 | tier index`` (with a flag in the tier byte),
# where the value is the slot index in a memory tier, or the stored object's bytes in a storage
# tier. Most chunks live in one tier of each kind, so each is one int (a tuple of them
# otherwise), not a dict and a set per entry. A directory of a million chunks is a million of
# these: every field counts (the goal: at most 400 bytes per entry beyond its data).
_TIER_BITS = 8
_TIER_MASK = (1 << _TIER_BITS) - 1
# In ``_mem``, a slot dropped while readers still hold the entry (freed by the last unpin).
_DETACHED = 0x80
# In ``_stored``, a write to that storage tier in flight (the value is unused).
_PENDING = 0x80
# One int object per distinct chunk size, shared by every entry of that size.
_SIZES: dict[int, int] = {}
# The key chain's hash with its parameters set (``match`` copies it per chunk).
_EMPTY_HASH = hashlib.blake2b(digest_size=KEY_BYTES)

_Packed = int | tuple[int, ...] | None


def _find(packed: _Packed, tag: int) -> int | None:
    if packed is None:
        return None
    if isinstance(packed, int):
        return packed >> _TIER_BITS if packed & _TIER_MASK == tag else None
    for code in packed:
        if code & _TIER_MASK == tag:
            return code >> _TIER_BITS
    return None


def _without(packed: _Packed, tag: int) -> _Packed:
    if packed is None or isinstance(packed, int):
        return None if packed is None or packed & _TIER_MASK == tag else packed
    rest = tuple(c for c in packed if c & _TIER_MASK != tag)
    return rest[0] if len(rest) == 1 else rest or None


def _plus(packed: _Packed, code: int) -> _Packed:
    if packed is None:
        return code
    return (packed, code) if isinstance(packed, int) else (*packed, code)


def _with(packed: _Packed, tag: int, value: int) -> _Packed:
    return _plus(_without(packed, tag), value << _TIER_BITS | tag)


def _pairs(packed: _Packed, flag: int) -> list[tuple[int, int]]:
    """``(tier, value)`` of the codes with (``flag``) or without (0) the flag."""
    if packed is None:
        return []
    codes = (packed,) if isinstance(packed, int) else packed
    return [(c & _TIER_MASK & ~_DETACHED, c >> _TIER_BITS) for c in codes
            if c & flag == flag and (flag or not c & _DETACHED)]


class Entry:
    """One chunk: its place in the chain, and its residency in each tier."""

    __slots__ = ("_gen", "_mem", "_stored", "key", "kids", "num_tokens", "parent", "pins",
                 "raw_bytes", "tokens")

    _generations = itertools.count(1)

    def __init__(self, key: bytes, parent: bytes, num_tokens: int, raw_bytes: int,
                 tokens: np.ndarray | bytes | None) -> None:
        self.key = key
        self.parent = parent
        self.num_tokens = num_tokens
        self.raw_bytes = _SIZES.setdefault(raw_bytes, raw_bytes)
        # The chunk's own token ids (int32 bytes), when known: lets a lookup match a *prefix*
        # of the chunk. Bytes, not an array: 33 bytes of header instead of about 130.
        self.tokens = tokens.tobytes() if isinstance(tokens, np.ndarray) else tokens
        self._mem: _Packed = None      # memory tiers: slot index per tier (and detached slots)
        self._stored: _Packed = None   # storage tiers: object bytes per tier (and pending writes)
        self.pins = 0
        # The generation, drawn on first use; negative once the entry is dead.
        self._gen = 0
        # This chunk's children, kept by the directory: the only one, or an index of them.
        self.kids: Entry | Siblings[Entry] | None = None
        untrack(self)

    @property
    def gen(self) -> int:
        """A chunk deleted and put again is a new entry with a new generation: every storage
        operation names the generation it is for, never the bare key. Drawn on first use (a
        chunk that never reaches storage never needs one)."""
        if not self._gen:
            self._gen = next(Entry._generations)
        return abs(self._gen)

    @property
    def dead(self) -> bool:
        """Deleted: never served again; its memory is freed by the last reader's unpin."""
        return self._gen < 0

    @dead.setter
    def dead(self, value: bool) -> None:
        if value != (self._gen < 0):
            self._gen = -self.gen if value else self.gen

    # -- memory tiers ----------------------------------------------------------------------

    def slot_index(self, idx: int) -> int | None:
        """The slot holding this chunk in memory tier ``idx``, or None."""
        return _find(self._mem, idx)

    def set_slot(self, idx: int, index: int) -> None:
        self._mem = _with(self._mem, idx, index)

    def pop_slot(self, idx: int) -> int | None:
        m = self._mem
        if m.__class__ is int and m & _TIER_MASK == idx:  # the one slot it has (eviction)
            self._mem = None
            return m >> _TIER_BITS
        index = _find(m, idx)
        if index is not None:
            self._mem = _without(self._mem, idx)
        return index

    def slots(self) -> list[tuple[int, int]]:
        """``(memory tier index, slot index)`` for every memory tier holding this chunk."""
        return _pairs(self._mem, 0)

    def detach_slot(self, idx: int, index: int) -> None:
        """Keep slot ``index`` of tier ``idx`` until :meth:`take_detached` (the last unpin)."""
        self._mem = _plus(self._mem, index << _TIER_BITS | idx | _DETACHED)

    @property
    def owes_memory(self) -> bool:
        """Its last unpin has slots to give back: it is dead, or holds a detached slot. False
        for almost every unpin, which then costs a few attribute reads, not a list of pairs
        (a put unpins every chunk of its prompt as it ends)."""
        if self._gen < 0:
            return True
        m = self._mem
        if m is None:
            return False
        if isinstance(m, int):
            return bool(m & _DETACHED)
        return any(c & _DETACHED for c in m)

    def take_detached(self) -> list[tuple[int, int]]:
        """The ``(tier, slot)`` pairs detached so far, forgotten here."""
        out = _pairs(self._mem, _DETACHED)
        if out:
            codes = (self._mem,) if isinstance(self._mem, int) else self._mem or ()
            rest = tuple(c for c in codes if not c & _DETACHED)
            self._mem = rest[0] if len(rest) == 1 else rest or None
        return out

    @property
    def in_memory(self) -> bool:
        return bool(self.slots()) if isinstance(self._mem, tuple) else (
            self._mem is not None and not self._mem & _DETACHED)

    @property
    def blocks(self) -> dict[int, int]:
        """A snapshot, memory tier index -> slot index (for inspection)."""
        return dict(self.slots())

    # -- storage tiers ---------------------------------------------------------------------

    def stored_size(self, idx: int) -> int | None:
        """The bytes of this chunk's object in storage tier ``idx``, or None."""
        return _find(self._stored, idx)

    def set_stored(self, idx: int, size: int) -> None:
        self._stored = _with(self._stored, idx, size)

    def pop_stored(self, idx: int) -> int | None:
        size = _find(self._stored, idx)
        if size is not None:
            self._stored = _without(self._stored, idx)
        return size

    @property
    def stored(self) -> dict[int, int]:
        """A snapshot, storage tier index -> stored object bytes."""
        return dict(_pairs(self._stored, 0))

    def is_pending(self, idx: int) -> bool:
        return _find(self._stored, idx | _PENDING) is not None

    def set_pending(self, idx: int, pending: bool) -> None:
        """A write of this chunk to storage tier ``idx`` is (or is no longer) in flight."""
        self._stored = _without(self._stored, idx | _PENDING)
        if pending:
            self._stored = _plus(self._stored, idx | _PENDING)

    @property
    def pending(self) -> int:
        """Bit i: a write to storage tier i is in flight."""
        return sum(1 << i for i, _ in _pairs(self._stored, _PENDING))

    @property
    def resident(self) -> bool:
        return self._stored is not None or (self._mem is not None and self.in_memory)

    def __repr__(self) -> str:
        return (f"Entry({self.key.hex()[:8]}, n={self.num_tokens}, blocks={self.blocks}, "
                f"stored={self.stored}, pending={self.pending:b}, pins={self.pins})")


class Match(NamedTuple):
    """``num_tokens`` tokens of a prompt, starting at ``start``, served by ``entry``.

    ``num_tokens`` may be less than ``entry.num_tokens``: a prefix of a stored chunk whose
    leading tokens equal the prompt's (the KV of a token depends only on the tokens before it).
    """

    start: int
    num_tokens: int
    entry: Entry


class KeyTable:
    """The directory's entries by key, as 256 dicts (one per first byte of the key).

    A dict grows by copying its whole table into one three times the size of its contents,
    in one step: 80 ms at 700,000 entries and 250 ms at 1.4 million here, a stall of the
    event loop in the middle of a put or of learning a listing. Keys are hash digests, so
    the shards grow evenly, and each one is 1/256 of the directory: a shard's growth at a
    million entries copies about 4,000 of them. The dict methods the directory and its
    readers use are here; a lookup costs one more indexing than a plain dict's.
    """

    __slots__ = ("_cursor", "_n", "_shards")

    def __init__(self) -> None:
        self._shards: list[dict[bytes, Entry]] = [{} for _ in range(256)]
        self._n = 0
        self._cursor = 0  # the first shard ``popitem`` looks at (all before it are empty)

    def get(self, key: bytes, default: Entry | None = None) -> Entry | None:
        return self._shards[key[0]].get(key, default)

    def __getitem__(self, key: bytes) -> Entry:
        return self._shards[key[0]][key]

    def __setitem__(self, key: bytes, e: Entry) -> None:
        shard = self._shards[key[0]]
        n = len(shard)
        shard[key] = e
        untrack(shard)
        self._n += len(shard) - n

    def __delitem__(self, key: bytes) -> None:
        del self._shards[key[0]][key]
        self._n -= 1

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and len(key) > 0 and key in self._shards[key[0]]

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[bytes]:
        return itertools.chain.from_iterable(self._shards)

    def keys(self) -> Iterator[bytes]:
        return iter(self)

    def values(self) -> Iterator[Entry]:
        return itertools.chain.from_iterable(d.values() for d in self._shards)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        return itertools.chain.from_iterable(d.items() for d in self._shards)

    def popitem(self) -> tuple[bytes, Entry]:
        if not self._n:
            raise KeyError("popitem(): the directory is empty")
        shards = self._shards
        while not shards[self._cursor]:
            self._cursor = (self._cursor + 1) & 0xFF
        self._n -= 1
        shard = shards[self._cursor]
        item = shard.popitem()
        if not shard:
            # A dict keeps its table when emptied: the 256 tables of a directory taken
            # apart (clear) were all freed in the step that dropped it (0.22 to 0.24 ms in
            # a clear of 1.25M entries, up to 4.9 ms in a bare loop of pops); each goes
            # here, in the step that emptied it.
            shards[self._cursor] = {}
        return item

    def clear(self) -> None:
        for d in self._shards:
            d.clear()
        self._n = 0
        self._cursor = 0


class Directory:
    def __init__(self, chain: KeyChain) -> None:
        self.chain = chain
        self.entries = KeyTable()
        # The children of a parent are kept on the parent's entry (``Entry.kids``): a chain
        # of chunks needs no dict entry per link. Here only those of parents without an
        # entry: the chain's seed, and the parents of orphans (learned before, or kept
        # after, their parent). Either way: the only child, or an index of the children
        # (see ``_children``).
        self.children: dict[bytes, Entry | Siblings[Entry]] = {}
        # Where an orphan group's missing parent hung: the key of a chunk that left the
        # directory while it had children -> its own parent's key, and back. A delete that
        # reaches that parent reaches the orphans through it (take_lost): without it, a
        # delete of a prompt whose middle chunk had been evicted missed the chunks after it,
        # and a later put of the middle chunk brought them back.
        self.lost_parent: dict[bytes, bytes] = {}
        self.lost_under: dict[bytes, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Entry | None:
        e = self.entries.get(key)
        return None if e is None or e._gen < 0 else e  # not dead (the property, inlined)

    def _kids(self, parent: bytes) -> Entry | Siblings[Entry] | None:
        p = self.entries.get(parent)
        return p.kids if p is not None else self.children.get(parent)

    def _set_kids(self, parent: bytes, kids: Entry | Siblings[Entry] | None) -> None:
        p = self.entries.get(parent)
        if p is not None:
            p.kids = kids
        elif kids is not None:
            self.children[parent] = kids
        else:
            self.children.pop(parent, None)
            if self.lost_parent and parent not in self.lost_under:
                self._found(parent)  # no orphan waits under it any more

    def emptied(self) -> Directory:
        """A new, empty directory with the same settings."""
        return Directory(self.chain)

    def add(self, e: Entry) -> None:
        old = self.entries.get(e.key)
        if old is e:
            return
        if old is not None:
            self._unlink(old)
            e.kids, old.kids = old.kids, None
        else:
            e.kids = self.children.pop(e.key, None)  # orphans waiting for this parent
            if self.lost_parent:
                self._found(e.key)
        self.entries[e.key] = e
        have = self._kids(e.parent)
        if have is None:
            self._set_kids(e.parent, e)
        elif isinstance(have, Siblings):
            have.add(e)
        else:
            sib: Siblings[Entry] = Siblings()
            sib.add(have)
            sib.add(e)
            self._set_kids(e.parent, sib)

    def remove(self, e: Entry) -> None:
        # Every evicted chunk comes here: the key table's shards are indexed in place, and
        # the common unlink (the parent's only child, the parent present) is done inline.
        key = e.key
        table = self.entries
        shard = table._shards[key[0]]
        if shard.get(key) is not e:
            return
        parent = e.parent
        if e.kids is not None or key in self.lost_under:
            # Orphans will wait under this key (its children, or some further down under
            # missing chunks): linked to its parent first, so that the unlink below sees
            # that something still waits under a missing parent.
            self._lose(key, parent)
        p = table._shards[parent[0]].get(parent)
        if p is not None and p.kids is e:
            p.kids = None
        else:
            self._unlink(e)
        del shard[key]
        table._n -= 1
        if e.kids is not None:  # they stay findable by their parent key
            self.children[key] = e.kids
            e.kids = None

    def cut_links(self, doomed: Sequence[Entry], removed: AbstractSet[bytes]) -> None:
        """``doomed`` are about to be removed, and so are the keys of ``removed`` (by the
        same caller, later): the link of each doomed entry to its only child, when that child
        is to be removed too, is dropped first. The entry then leaves with no child, and no
        orphan is marked as waiting under it (see ``lost_parent``): a chain removed from its
        first chunk down leaves no marks to clear in one step at its end."""
        for e in doomed:
            kid = e.kids
            if kid is not None and not isinstance(kid, Siblings) and kid.key in removed:
                e.kids = None

    def take_kids(self, key: bytes) -> Entry | Siblings[Entry] | None:
        """Detach the children of ``key`` from the directory, in one step whatever their
        number: the caller owns them from then on (a delete dismantles them in batches)."""
        p = self.entries.get(key)
        if p is not None:
            kids, p.kids = p.kids, None
            return kids
        if self.lost_parent and key not in self.lost_under:
            self._found(key)
        return self.children.pop(key, None)

    def take_lost(self, key: bytes) -> list[bytes]:
        """The keys of missing children of ``key`` under which orphans wait (see
        ``lost_parent``), forgotten as such: a walk of ``key``'s subtree goes on through them
        (:meth:`take_kids` of each)."""
        below = self.lost_under.pop(key, None)
        if not below:
            return []
        for k in below:
            self.lost_parent.pop(k, None)
        return list(below)

    def _lose(self, key: bytes, parent: bytes) -> None:
        self.lost_parent[key] = parent
        below = self.lost_under.get(parent)
        if below is None:
            self.lost_under[parent] = {key}
        else:
            below.add(key)

    def _found(self, key: bytes) -> None:
        """``key`` is back in the directory, or no orphan waits under it any more; nor, then,
        under the missing chunks above it that only it kept linked."""
        while True:
            parent = self.lost_parent.pop(key, None)
            if parent is None:
                return
            below = self.lost_under[parent]
            below.discard(key)
            if below:
                return
            del self.lost_under[parent]
            if parent in self.children or parent in self.entries:
                return  # orphans of its own wait under it, or it is back
            key = parent

    def _unlink(self, e: Entry) -> None:
        have = self._kids(e.parent)
        if have is e:
            self._set_kids(e.parent, None)
        elif isinstance(have, Siblings) and have.discard(e) and len(have) == 1:
            self._set_kids(e.parent, have.only())

    def _learn_tokens(self, e: Entry, tokens: bytes) -> None:
        """Give a chunk learned from a listing its token ids (the key proved them)."""
        have = self._kids(e.parent)
        if isinstance(have, Siblings) and have.discard(e):
            e.tokens = tokens
            have.add(e)
        else:
            e.tokens = tokens

    def child_entries(self, key: bytes) -> Iterator[Entry]:
        have = self._kids(key)
        if have is None:
            return iter(())
        if isinstance(have, Siblings):
            return iter(have)
        return iter((have,))

    def child_list(self, key: bytes) -> list[Entry]:
        """The children of ``key``, as a list (safe to hold while the directory changes)."""
        have = self._kids(key)
        if have is None:
            return []
        return have.snapshot() if isinstance(have, Siblings) else [have]

    def children_along(self, parent: bytes, want: bytes) -> list[Entry]:
        """The children of ``parent`` whose token ids (int32 bytes) are a prefix of ``want``
        or start with it; children without token ids are not among them."""
        have = self._kids(parent)
        if have is None:
            return []
        if isinstance(have, Siblings):
            return have.along(want)
        t = have.tokens
        return [have] if t is not None and (want.startswith(t) or t.startswith(want)) else []

    def descendants(self, e: Entry) -> list[Entry]:
        return self.subtree([e.key])

    def subtree(self, roots: list[bytes]) -> list[Entry]:
        """Every entry that extends one of ``roots`` (by parent links, whether or not the
        root itself is known, and through missing chunks that orphans wait under), each
        once."""
        out: list[Entry] = []
        seen: set[bytes] = set(roots)
        stack = list(roots)
        while stack:
            cur = stack.pop()
            for c in self.child_entries(cur):
                if c.key not in seen:
                    seen.add(c.key)
                    out.append(c)
                    stack.append(c.key)
            for k in self.lost_under.get(cur, ()):
                if k not in seen:
                    seen.add(k)
                    stack.append(k)
        return out

    # -- matching -------------------------------------------------------------------------

    def match(self, tokens: np.ndarray) -> tuple[list[Match], bytes | None]:
        """The longest cached prefix of ``tokens``, chunk by chunk.

        Returns the matches and, if the prompt was not fully matched, the parent key at which
        matching stopped (where a refresh of a shared tier would look for more).
        """
        out, stop, _ = self.match_from(tokens, 0, self.chain.seed, None)
        return out, stop

    def match_from(self, tokens: np.ndarray, begin: int, parent: bytes, limit: int | None,
                   ) -> tuple[list[Match], bytes | None, bool]:
        """:meth:`match` from the chunk at token ``begin`` (chunk-aligned), whose parent key
        is ``parent``, for at most ``limit`` chunks. The third value is True when it stopped
        at the limit with more of the prompt to match (a long prompt is matched a run of
        chunks per turn of the loop)."""
        # The hot loop of every lookup: hashing is inlined and attribute lookups hoisted,
        # because a 128k-token prompt walks 512 chunks here.
        out: list[Match] = []
        shards = self.entries._shards  # KeyTable's shards, indexed here: one call less a chunk
        view = memoryview(tokens).cast("B")  # type: ignore[arg-type]
        empty = _EMPTY_HASH
        step = self.chain.chunk_size
        n = len(tokens)
        stop = n if limit is None else min(n, begin + limit * step)
        for start in range(begin, stop, step):
            end = min(start + step, n)
            h = empty.copy()  # a copy of a hasher costs less than making one
            h.update(parent)
            h.update(view[start * 4 : end * 4])
            key = h.digest()
            e = shards[key[0]].get(key)
            if e is not None and e._gen >= 0:  # not dead
                if e.tokens is None:  # the key proves these are its tokens
                    self._learn_tokens(e, view[start * 4 : end * 4].tobytes())
                out.append(Match(start, end - start, e))
                parent = key
                continue
            best = self._best_prefix_child(parent, tokens, start, end)
            if best is not None:
                out.append(best)
            return out, parent, False
        return out, None, stop < n

    def _best_prefix_child(self, parent: bytes, tokens: np.ndarray, start: int,
                           end: int) -> Match | None:
        """The child of ``parent`` whose token ids share the longest prefix with
        ``tokens[start:end]``, found through the index of ``parent``'s children (no scan)."""
        have = self._kids(parent)
        if have is None:
            return None
        want = tokens[start:end].tobytes()
        best: Entry | None = None
        best_len = 0
        if isinstance(have, Siblings):
            best, best_len = have.longest(want)
            for n in have.tokenless_lengths():
                if n <= best_len:
                    break
                if n * 4 > len(want):
                    continue
                # A chunk learned from a storage listing: only its whole token run can be
                # checked, by hashing the prompt's tokens of that length.
                c = have.tokenless(n, KeyChain.child(parent, want[: n * 4]))
                if c is not None and not c.dead:
                    self._learn_tokens(c, want[: n * 4])
                    best, best_len = c, n
        elif not have.dead:
            if have.tokens is not None:
                best_len = common_tokens(have.tokens, want)
            elif have.num_tokens * 4 <= len(want) and \
                    KeyChain.child(parent, want[: have.num_tokens * 4]) == have.key:
                best_len = have.num_tokens
                self._learn_tokens(have, want[: best_len * 4])
            best = have
        if best is None or best_len == 0:
            return None
        return Match(start, best_len, best)
