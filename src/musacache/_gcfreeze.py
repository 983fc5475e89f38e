"""Keeping Python's cyclic garbage collector off a large directory (``gc.freeze``).

CPython's collector runs a full collection whenever the objects that survived into its
oldest generation grew by a quarter, and a full collection walks every tracked object of the
process: with a million directory entries (one tracked object each) that is a pause of half
a second on the event loop, once at a restart that learns a million-object listing and again
every time the directory grows by a quarter. An entry cannot be untracked (every object of a
class is), so the directory moves what exists to the collector's permanent generation every
``CacheConfig.gc_freeze_every`` new entries: a full collection then walks only what was
allocated since the last freeze.

The trade-off is process-wide: a frozen object is never freed by the collector, only by its
reference count. Directory entries form no reference cycles (a parent holds its children, a
child names its parent by key), so a deleted entry is freed by its reference count alone,
frozen or not (``tests/test_loop_steps.py`` proves it). Before each freeze the young
generations are collected (a few thousand objects at most), so short-lived cyclic garbage is
not kept; what is kept is cyclic garbage of the host process that already sat in the oldest
generation at a freeze (the collector's own full collections, cheap and frequent once the
heap is frozen, clear that generation in between), and objects alive at a freeze that become
cyclic garbage later. A full collection before each freeze would keep nothing, but it walks
everything allocated since the last freeze: a restart's listing of a million objects is a
0.4 s pause. vLLM freezes its whole heap once after start-up for the same reason.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LONG_READ_CHUNKS", "collect_young", "freeze_heap", "full_collections_held",
           "long_read"]

# A threshold the oldest generation's counter (young collections since the last full one)
# never reaches.
_NEVER = 2**31 - 1
_held = 0
_saved_threshold = 0
_held_since = 0.0  # when full collections were last held after none were
#: The chunks from which a read holds full collections off while it runs (:func:`long_read`).
LONG_READ_CHUNKS = 1024
# How long full collections may stay held in a row before a long read no longer holds them
# (those holding them then still finish): reads that overlap for good never starve them.
_MAX_HELD_S = 1.0


def collect_young() -> None:
    """Collect the young generations now. A loop that makes tracked objects at a high rate
    for a long time (a restart learning a million entries, a batch per loop turn) calls this
    every few turns: each collection then walks a few turns' objects, where the collector's
    own schedule would let about 7,000 of them pile up in the middle generation and walk
    them in one pause (2 to 7 ms on the loop here, a cache miss per reference)."""
    if gc.isenabled():
        gc.collect(1)


def freeze_heap() -> None:
    """Collect the young generations, then freeze every tracked object of the process."""
    if not gc.isenabled():
        return  # the process runs without the collector: it never pauses, nothing to do
    gc.collect(1)
    gc.freeze()


@contextmanager
def full_collections_held() -> Iterator[None]:
    """No full collection while inside (the young generations are still collected).

    A storage tier that returns its listing as a list of a million ``ChunkMeta`` makes them
    in its own ``start``, and the collector's full collections fire as they pile up (one
    whenever the old generation grew by a quarter): each walks all of them, the last one a
    million, 150 ms with the GIL held whichever thread allocated them. The cache holds full
    collections off from ``start`` until it has read that list and freed it a batch per loop
    turn (``_coldpath``); the next full collection after that walks what is left, not the
    listing. Nothing is frozen here, but cyclic garbage made meanwhile that reaches the old
    generation is not collected either, and the restart's freeze that follows
    (``Directory.freeze_listing``) keeps it, once per open. Nests; restores the
    threshold it found (CPython 3.11 to 3.13: a full collection runs only when the oldest
    generation's counter passes its threshold).
    """
    global _held, _saved_threshold, _held_since
    if not _held:
        t0, t1, _saved_threshold = gc.get_threshold()
        gc.set_threshold(t0, t1, _NEVER)
        _held_since = time.monotonic()
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held:
            t0, t1, _ = gc.get_threshold()
            gc.set_threshold(t0, t1, _saved_threshold)


@contextmanager
def long_read(chunks: int) -> Iterator[None]:
    """No full collection during a read of ``chunks`` chunks when that is
    :data:`LONG_READ_CHUNKS` or more: :func:`full_collections_held`, unless full collections
    have been held for over a second in a row already (by reads that overlap), so that they
    always run again soon.

    A long read keeps its per-chunk objects alive until its copy is done (its matches, a
    view of each chunk's slot and of its part of the destination, a pair of them): about
    63,000 tracked objects at 16,384 chunks, and a full collection that fell inside it
    walked them all, 8.8 of a 10.9 ms loop gap (``bench scale``'s long get). Held off, the
    collection runs after the read, when they are gone. A short read makes too few of them
    for that to matter, and holds nothing."""
    if chunks < LONG_READ_CHUNKS or (_held and time.monotonic() - _held_since > _MAX_HELD_S):
        yield
        return
    with full_collections_held():
        yield
