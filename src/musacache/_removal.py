"""Removing many chunks without stalling the loop: ``delete`` of a prompt and ``clear``.

The part that makes chunks unfindable happens at once; the rest (freeing memory, scheduling
storage deletes) runs ``BATCH`` entries at a time with the loop free in between, shielded from
cancellation so that what was started finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio.lowlevel
import numpy as np

from ._directory import Directory
from ._placement import delete_roots, subtree_batches

if TYPE_CHECKING:
    from ._core import Engine

__all__ = ["clear", "delete"]


async def delete(eng: Engine, toks: np.ndarray, batch: int) -> int:
    """Remove the prompt's chunks at once (so nothing of it can be found), then what extends
    them, ``batch`` at a time: a prompt with a million descendants never stalls the loop.
    Returns the number of chunks removed."""
    roots, keys = delete_roots(eng.dir, eng.chain, toks)
    first = [e for k in roots if (e := eng.dir.get(k)) is not None]
    eng.remove(first)
    chain = set(keys)
    known = {e.key for e in first}
    removed = len(first)
    for part in subtree_batches(eng.dir, roots + keys, batch):
        live = [e for e in part if not e.dead]
        eng.remove(live)
        removed += len(live)
        known.update(e.key for e in live if e.key in chain)  # only the chain's are asked
        await anyio.lowlevel.cancel_shielded_checkpoint()
    for st in eng.stores:  # another node may have written the prompt's chunks
        if st.store.shared:
            for k in keys:
                if k not in known:
                    eng.cold.schedule_delete(st, k)
    return removed


async def clear(eng: Engine, batch: int) -> None:
    """Forget every chunk. The directory is swapped for an empty one at once (nothing can be
    found from then on); the old entries are freed ``batch`` at a time."""
    entries = eng.dir.entries
    eng.dir = Directory(eng.chain)
    while entries:
        part = [entries.popitem()[1] for _ in range(min(batch, len(entries)))]
        for e in part:
            e.kids = None  # no chain is freed in one step when its root goes
        eng.remove(part)
        await anyio.lowlevel.cancel_shielded_checkpoint()
