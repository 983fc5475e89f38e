"""The location directory: which chunks exist, where they live, and how they chain.

Pure bookkeeping, no I/O and no awaits, so every method is atomic on the event loop. The engine
pins an entry (``pins``) for as long as it reads it; a pinned entry is never evicted, and a
deleted one keeps its memory until the last reader unpins it (``dead``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ._keys import KEY_BYTES, KeyChain
from .tiers.memory import Slot

__all__ = ["Directory", "Entry", "Match"]


class Entry:
    """One chunk: its place in the chain, and its residency in each tier."""

    __slots__ = ("blocks", "dead", "detached", "gen", "key", "num_tokens", "parent", "pending",
                 "pins", "raw_bytes", "stored", "tokens")

    _generations = itertools.count(1)

    def __init__(self, key: bytes, parent: bytes, num_tokens: int, raw_bytes: int,
                 tokens: np.ndarray | None) -> None:
        self.key = key
        # A chunk deleted and put again is a new entry with a new generation: every storage
        # operation names the generation it is for, never the bare key.
        self.gen = next(Entry._generations)
        self.parent = parent
        self.num_tokens = num_tokens
        self.raw_bytes = raw_bytes
        # The chunk's own token ids, when known: lets a lookup match a *prefix* of the chunk.
        self.tokens = tokens
        self.blocks: dict[int, Slot] = {}   # memory tier index -> slot holding the KV
        self.stored: dict[int, int] = {}    # storage tier index -> stored object bytes
        self.pending: set[int] = set()      # storage tiers with a write in flight
        self.detached: list[tuple[int, Slot]] = []  # blocks dropped while pinned
        self.pins = 0
        self.dead = False

    @property
    def resident(self) -> bool:
        return bool(self.blocks or self.stored or self.pending)

    def __repr__(self) -> str:
        return (f"Entry({self.key.hex()[:8]}, n={self.num_tokens}, blocks={sorted(self.blocks)}, "
                f"stored={sorted(self.stored)}, pending={sorted(self.pending)}, pins={self.pins})")


class Match(NamedTuple):
    """``num_tokens`` tokens of a prompt, starting at ``start``, served by ``entry``.

    ``num_tokens`` may be less than ``entry.num_tokens``: a prefix of a stored chunk whose
    leading tokens equal the prompt's (the KV of a token depends only on the tokens before it).
    """

    start: int
    num_tokens: int
    entry: Entry


class Directory:
    def __init__(self, chain: KeyChain) -> None:
        self.chain = chain
        self.entries: dict[bytes, Entry] = {}
        self.children: dict[bytes, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Entry | None:
        e = self.entries.get(key)
        return None if e is None or e.dead else e

    def add(self, e: Entry) -> None:
        self.entries[e.key] = e
        self.children.setdefault(e.parent, set()).add(e.key)

    def remove(self, e: Entry) -> None:
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
            kids = self.children.get(e.parent)
            if kids is not None:
                kids.discard(e.key)
                if not kids:
                    del self.children[e.parent]

    def child_entries(self, key: bytes) -> Iterator[Entry]:
        for ck in self.children.get(key, ()):
            c = self.entries.get(ck)
            if c is not None:
                yield c

    def descendants(self, e: Entry) -> list[Entry]:
        return self.subtree([e.key])

    def subtree(self, roots: list[bytes]) -> list[Entry]:
        """Every entry that extends one of ``roots`` (by parent links, whether or not the
        root itself is known), each once."""
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
        return out

    # -- matching -------------------------------------------------------------------------

    def match(self, tokens: np.ndarray) -> tuple[list[Match], bytes | None]:
        """The longest cached prefix of ``tokens``, chunk by chunk.

        Returns the matches and, if the prompt was not fully matched, the parent key at which
        matching stopped (where a refresh of a shared tier would look for more).
        """
        # The hot loop of every lookup: hashing is inlined and attribute lookups hoisted,
        # because a 128k-token prompt walks 512 chunks here.
        out: list[Match] = []
        entries = self.entries
        view = memoryview(tokens).cast("B")  # type: ignore[arg-type]
        blake2b = hashlib.blake2b
        step = self.chain.chunk_size
        n = len(tokens)
        parent = self.chain.seed
        for start in range(0, n, step):
            end = min(start + step, n)
            h = blake2b(parent, digest_size=KEY_BYTES)
            h.update(view[start * 4 : end * 4])
            key = h.digest()
            e = entries.get(key)
            if e is not None and not e.dead:
                if e.tokens is None:
                    e.tokens = tokens[start:end].copy()  # the key proves these are its tokens
                out.append(Match(start, end - start, e))
                parent = key
                continue
            best = self._best_prefix_child(parent, tokens, start, end)
            if best is not None:
                out.append(best)
            return out, parent
        return out, None

    def _best_prefix_child(self, parent: bytes, tokens: np.ndarray, start: int,
                           end: int) -> Match | None:
        want = tokens[start:end]
        best: Entry | None = None
        best_len = 0
        for c in self.child_entries(parent):
            if c.dead:
                continue
            if c.tokens is not None:
                k = min(len(c.tokens), len(want))
                if k <= best_len:
                    continue
                diff = np.flatnonzero(c.tokens[:k] != want[:k])
                m = int(diff[0]) if diff.size else k
            else:
                # A chunk learned from a storage listing: only its whole token run can be
                # checked, by hashing the prompt's tokens of that length.
                m = c.num_tokens
                if m > len(want) or m <= best_len:
                    continue
                if KeyChain.child(parent, want[:m].tobytes()) != c.key:
                    continue
                c.tokens = want[:m].copy()
            if m > best_len:
                best, best_len = c, m
        return Match(start, best_len, best) if best is not None else None
