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

__all__ = ["freeze_heap"]


def freeze_heap() -> None:
    """Collect the young generations, then freeze every tracked object of the process."""
    if not gc.isenabled():
        return  # the process runs without the collector: it never pauses, nothing to do
    gc.collect(1)
    gc.freeze()
