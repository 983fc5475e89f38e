"""Removing many chunks without stalling the loop: ``delete`` of a prompt and ``clear``.

Both run ``BATCH`` entries at a time with the loop free in between: a delete takes the
prompt's first chunk in its first batch of removals (nothing after it can be found from
then on), a clear swaps the directory for an empty one at once and takes the old one apart.
What was started finishes: a cancelled delete or dismantling goes on in a background task
(``engine.tasks.run_steps``), until the cache closes: what is left then is noted for the next
open (``engine.notes``), never run on the loop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

import anyio.lowlevel
import numpy as np

from musacache.engine.children import Siblings
from musacache.engine.directory import Directory, Entry, KeyTable
from musacache.engine.placement import delete_roots, subtree_batches
from musacache.engine.tasks import TaskOwner, run_steps
from musacache.engine.tierstate import MemTier, StoreTier

if TYPE_CHECKING:
    from musacache.engine.core import Engine

__all__ = ["clear", "delete", "dismantle", "release_memory", "release_store"]

_clock = time.perf_counter
# A step of taking a directory apart stops taking entries once it has run this long (s), and
# takes them _FEW at a time to see that.
_STEP_S = 0.001
_FEW = 8


async def delete(eng: Engine, toks: np.ndarray, batch: int) -> int:
    """Remove the prompt's chunks, then what extends them, ``batch`` at a time: a long
    prompt, or one with a million descendants, never stalls the loop. Returns the number of
    chunks removed. Once started it finishes: cancelled, it goes on in the background
    (:func:`run_steps`)."""
    removed = [0]
    await run_steps(eng.cut.deleting(toks, _delete_steps(eng, toks, batch, removed)),
                    eng.tasks, eng.cut.abandon)
    return removed[0]


def _delete_steps(eng: Engine, toks: np.ndarray, batch: int,
                  removed: list[int]) -> Iterator[None]:
    """:func:`delete`'s work, yielding between its batches; ``removed[0]`` counts."""
    # The prompt's chain hashed and looked up a run of chunks per step (all at once was a
    # step of 27 ms at 16,384 chunks); the walk's start (roots, then chain keys, each once)
    # and the chain's keys as a set grow a run per step too.
    roots: list[bytes] = []
    keys: list[bytes] = []
    chain: set[bytes] = set()
    start: list[bytes] = []
    queued: set[bytes] = set()

    def walk_from(ks: list[bytes]) -> None:  # each key once, in order
        for k in ks:
            if k not in queued:
                queued.add(k)
                start.append(k)

    chain_keys = eng.chain.iter_keys(toks)
    while run := list(itertools.islice(chain_keys, batch)):
        run_roots, run_keys = delete_roots(eng.dir, run, toks)
        roots += run_roots
        keys += run_keys
        chain.update(run_keys)
        walk_from(run_roots)
        if len(run) == batch:
            yield
    # In prompt order, a batch per step: the first batch takes the prompt's first cached
    # chunk, and every later chunk of the prompt is keyed on it, so from then on no lookup
    # of the prompt finds any of them. (All at once was a step of 0.1 s at 16,384 chunks.)
    # A root's link to the next root goes with it (``cut_links``): kept, each root left the
    # directory with a child and was marked as one under which orphans wait, and the last
    # root's removal then cleared the marks of the whole chain in one step (4 ms at 16,384
    # chunks, and growing with the prompt).
    known: set[bytes] = set()
    for i in range(0, len(roots), batch):
        live = [e for k in roots[i : i + batch]
                if (e := eng.dir.get(k)) is not None and not e.dead]
        eng.dir.cut_links(live, queued)
        eng.remove(live)
        removed[0] += len(live)
        known.update(e.key for e in live)
        if i + batch < len(roots):
            yield
    for i in range(0, len(keys), batch):  # the walk starts at the chain keys too
        walk_from(keys[i : i + batch])
        yield
    for part in subtree_batches(eng.dir, start, batch, queued):
        live = [e for e in part if not e.dead]
        eng.remove(live)
        removed[0] += len(live)
        known.update(e.key for e in live if e.key in chain)  # only the chain's are asked
        yield
    shared = [st for st in eng.stores if st.store.shared]
    # Another node may have written the prompt's chunks: their objects are deleted too. The
    # keys this delete held are let go of a batch per step as well (all at once, a step of
    # 1.3 ms at 16,384 chunks, and growing with the prompt).
    while keys:
        last = keys[-batch:]
        del keys[-batch:]
        for key in last:
            if key in known:
                known.discard(key)
            else:
                for st in shared:
                    eng.cold.schedule_delete(st, key)
        del last
        for held in (chain, queued):
            for _ in range(min(batch, len(held))):
                held.pop()
        del roots[-batch:]
        yield


async def clear(eng: Engine, batch: int) -> None:
    """Forget every chunk. The directory is swapped for an empty one at once (nothing can be
    found from then on); the old one is dismantled ``batch`` entries at a time, each batch
    removed from every tier."""
    old = eng.dir
    eng.dir = old.emptied()
    await run_steps(eng.cut.clearing(old, _dismantle_steps(old, batch, eng.remove)),
                    eng.tasks, eng.cut.abandon)


async def dismantle(old: Directory, batch: int,
                    each: Callable[[list[Entry]], object] = lambda part: None,
                    tasks: TaskOwner | None = None) -> None:
    """Take apart a directory no longer in use, ``batch`` entries per loop turn (it must
    finish: cancelled, it goes on in a background task of ``tasks``, see
    :func:`run_steps`), calling ``each`` on every batch of its entries; they are freed with
    their batch. An index of many children is taken apart in batches too, never dropped
    whole: dropping one of 200,000 children touches every one of them in one step, and
    dropping the key table of a million entries frees them all in one step (35 ms)."""
    await run_steps(_dismantle_steps(old, batch, each), tasks)


#: Entries of a closed cache's directory taken apart before ``aclose`` returns; a larger one
#: is taken apart in a thread of its own afterwards (a million entries are about 1.5 s of
#: batches, which ``close_timeout`` must not wait for).
CLOSE_INLINE: Final = 65_536


async def dismantle_closed(old: Directory, batch: int) -> None:
    """Take apart the directory of a closing cache: a small one as :func:`dismantle` does,
    a large one in a daemon thread that yields the GIL between its batches, so that neither
    the loop nor ``aclose`` waits for it. Nothing else references its entries any more."""
    if len(old.entries) <= CLOSE_INLINE:
        await dismantle(old, batch)
        return
    steps = _dismantle_steps(old, batch, lambda part: None)
    del old  # (the thread's steps hold the last reference)

    def run() -> None:
        for _ in steps:
            time.sleep(0)  # the loop takes the GIL between batches

    threading.Thread(target=run, name="musacache-dismantle", daemon=True).start()


def _dismantle_steps(old: Directory, batch: int,
                     each: Callable[[list[Entry]], object]) -> Iterator[None]:
    entries, orphans = old.entries, old.children
    big: list[Siblings[Entry]] = []  # indexes of more than ``batch`` children, kept to drain

    def keep(kids: Entry | Siblings[Entry] | None) -> None:
        if isinstance(kids, Siblings) and len(kids) > batch:
            big.append(kids)

    while entries or orphans or big:
        if big:
            big[-1].drain(batch)  # what it returns is dropped: freed a batch at a time
            if not big[-1]:
                big.pop()
        elif orphans:
            keep(orphans.popitem()[1])
        else:
            # Up to ``batch`` entries, a few at a time until a step has taken _STEP_S: the
            # last entries of a large directory are the last objects of most of the
            # allocator's arenas, each unmapped as it empties (a batch of them was a step of
            # 4 to 7 ms at the end of a clear of 1.25 million).
            began = _clock()
            taken = _take_apart(entries, min(_FEW, batch), keep, each)
            while entries and taken < batch and _clock() - began < _STEP_S:
                taken += _take_apart(entries, min(_FEW, batch - taken), keep, each)
        yield


def _take_apart(entries: KeyTable, n: int, keep: Callable[[Entry | Siblings[Entry] | None], None],
                each: Callable[[list[Entry]], object]) -> int:
    """Take ``n`` entries out of ``entries`` and hand them to ``each``; they are freed on
    return (their last reference). Returns how many."""
    part = [entries.popitem()[1] for _ in range(min(n, len(entries)))]
    for e in part:
        kids, e.kids = e.kids, None
        keep(kids)
        del kids
    each(part)
    return len(part)


async def release_memory(mt: MemTier) -> None:
    """Let go of a memory tier on close: its recency table a page of slots per loop turn
    (a million references dropped at once is a step of its own), then its segments in a
    worker thread (:meth:`MemoryPool.aclear_memory`). Shielded: this must finish."""
    pages = mt.lru.take_pages()
    while pages:
        pages.pop()
        await anyio.lowlevel.cancel_shielded_checkpoint()
    await mt.pool.aclear_memory()


async def release_store(st: StoreTier) -> None:
    """Let go of a storage tier's recency order on close, a generation of it per loop turn.
    Dropped in one step, its references would free every stored entry at once: a stall
    of the loop as long as the directory is large."""
    gens = st.lru.take_generations()
    while gens:
        gens.pop()
        await anyio.lowlevel.cancel_shielded_checkpoint()
