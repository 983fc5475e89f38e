"""ChunkMeta: what the directory knows of one chunk without reading it.

It lives on the ground floor because both the chunk object format (``codec``) and the tiers
speak it, and the codec sits below the tiers. ``musacache.tiers.base`` re-exports it, which is
where a storage-tier author finds it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkMeta"]


@dataclass(frozen=True, slots=True)  # slots: a listing may hold a million of them
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

