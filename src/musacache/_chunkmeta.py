"""ChunkMeta: what the directory knows of one chunk without reading it.

It lives on the ground floor because both the chunk object format (``codec``) and the tiers
speak it, and the codec sits below the tiers. ``musacache.tiers.base`` re-exports it, which is
where a storage-tier author finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkMeta", "oldest_first"]


@dataclass(frozen=True)
class ChunkMeta:
    """What the directory knows of one chunk without reading it.

    ``key`` commits to the whole token prefix up to the end of this chunk; ``parent`` is the key
    of the chunk before it (the chain seed for the first chunk). ``raw_bytes`` is the size of the
    dense KV; ``stored_bytes`` the size of the encoded object in a storage tier (0 if unknown).
    ``last_used`` is a wall-clock time used to rebuild LRU order after a restart (0 if unknown).
    """

    key: bytes
    parent: bytes
    num_tokens: int
    raw_bytes: int
    stored_bytes: int = 0
    last_used: float = 0.0


def oldest_first(metas: Sequence[ChunkMeta]) -> list[ChunkMeta]:
    """``metas`` by ``last_used``, oldest first (stable), for a worker thread.

    Python's ``sorted`` holds the GIL through its whole merge (about 0.2 s for a million
    listed objects, a stall of the event loop even from another thread); numpy's sort gives
    the GIL up, and the Python loops around it give it back every switch interval."""
    used = np.fromiter((m.last_used for m in metas), dtype=np.float64, count=len(metas))
    order = np.argsort(used, kind="stable")
    return [metas[i] for i in order]
