"""The children of one parent key, indexed so that a lookup never scans its siblings.

Every conversation that shares a system prompt is a child of that prompt's last chunk, so one
parent can have hundreds of thousands of children. A lookup that misses needs the child whose
token ids share the longest prefix with the prompt's chunk at that position.

Children with known token ids are kept sorted by their tokens (as bytes). In a sorted list, the
string sharing the longest prefix with a query sits right next to where the query would be
inserted, so one bisection and two comparisons find it, whatever the number of siblings. The
list is cut into runs of a few hundred, so an insertion or removal moves a few hundred
pointers, not all of them.

Children learned from a storage listing have no token ids: only their whole token run can
match, and only by hashing the prompt's tokens of that length. They are kept by length, so a
lookup hashes once per distinct length (at most ``chunk_size``), never once per child.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import chain
from operator import attrgetter
from typing import Generic, Protocol, TypeVar

__all__ = ["Child", "Siblings", "common_tokens"]


class Child(Protocol):
    """What the index reads of a child (a directory ``Entry``; this module imports none)."""

    key: bytes
    num_tokens: int
    tokens: bytes | None

    @property
    def dead(self) -> bool: ...


Entry = TypeVar("Entry", bound=Child)

# Children per sorted run; a run is split in two when it reaches twice this.
_RUN = 256

_tokens_of = attrgetter("tokens")


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading int32 tokens two token strings (int32 bytes) have in common."""
    k = min(len(a), len(b))
    if a[:k] == b[:k]:
        return k >> 2
    # The first differing byte is the highest set bit of the big-endian XOR: two C calls,
    # instead of a Python loop over up to 1 KiB.
    x = int.from_bytes(a[:k], "big") ^ int.from_bytes(b[:k], "big")
    return (k - ((x.bit_length() + 7) >> 3)) >> 2


class Siblings(Generic[Entry]):
    """Two or more children of one parent (a parent with one child stores the child itself)."""

    __slots__ = ("_maxes", "_n", "_runs", "_tokenless")

    def __init__(self) -> None:
        self._runs: list[list[Entry]] = []   # sorted by tokens, each run non-empty
        self._maxes: list[bytes] = []        # the last (largest) tokens of each run
        self._tokenless: dict[int, dict[bytes, Entry]] = {}  # num_tokens -> key -> entry
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Entry]:
        for run in self._runs:
            yield from run
        for by_key in self._tokenless.values():
            yield from by_key.values()

    def snapshot(self) -> list[Entry]:
        """Every child, as a list built in C (a million children in milliseconds)."""
        out = list(chain.from_iterable(self._runs))
        for by_key in self._tokenless.values():
            out.extend(by_key.values())
        return out

    def only(self) -> Entry:
        """The single child left (call when ``len(self) == 1``)."""
        return next(iter(self))

    # -- changes ---------------------------------------------------------------------------

    def add(self, e: Entry) -> None:
        t = e.tokens
        self._n += 1
        if t is None:
            self._tokenless.setdefault(e.num_tokens, {})[e.key] = e
            return
        runs, maxes = self._runs, self._maxes
        if not runs:
            runs.append([e])
            maxes.append(t)
            return
        r = bisect_left(maxes, t)
        if r == len(runs):
            r -= 1
        run = runs[r]
        run.insert(bisect_left(run, t, key=_tokens_of), e)
        maxes[r] = run[-1].tokens  # type: ignore[assignment]
        if len(run) >= 2 * _RUN:
            runs[r : r + 1] = [run[:_RUN], run[_RUN:]]
            maxes[r : r + 1] = [run[_RUN - 1].tokens, run[-1].tokens]  # type: ignore[list-item]

    def discard(self, e: Entry) -> bool:
        """Remove ``e`` (found by its tokens, or its key if it has none); False if absent."""
        t = e.tokens
        if t is None:
            by_key = self._tokenless.get(e.num_tokens)
            if by_key is None or by_key.get(e.key) is not e:
                return False
            del by_key[e.key]
            if not by_key:
                del self._tokenless[e.num_tokens]
            self._n -= 1
            return True
        r = bisect_left(self._maxes, t)
        if r == len(self._runs):
            return False
        run = self._runs[r]
        p = bisect_left(run, t, key=_tokens_of)
        if p == len(run) or run[p] is not e:
            return False  # siblings never share tokens: their keys would be equal
        del run[p]
        if run:
            self._maxes[r] = run[-1].tokens  # type: ignore[assignment]
        else:
            del self._runs[r], self._maxes[r]
        self._n -= 1
        return True

    def drain(self, n: int) -> list[Entry]:
        """Take up to ``n`` children out of the index (any order). Dismantling a big index
        this way, a batch at a time, frees its children with their batches: dropping an index
        of 200,000 children at once touches every one of them in one step (a loop stall of
        10 to 20 ms)."""
        out: list[Entry] = []
        runs, maxes = self._runs, self._maxes
        while runs and len(out) < n:
            run = runs[-1]
            k = n - len(out)
            out += run[-k:]
            del run[-k:]
            if run:
                maxes[-1] = run[-1].tokens  # type: ignore[assignment]
            else:
                runs.pop()
                maxes.pop()
        tokenless = self._tokenless
        while tokenless and len(out) < n:
            length = next(iter(tokenless))
            by_key = tokenless[length]
            while by_key and len(out) < n:
                out.append(by_key.popitem()[1])
            if not by_key:
                del tokenless[length]
        self._n -= len(out)
        return out

    # -- matching --------------------------------------------------------------------------

    def longest(self, want: bytes) -> tuple[Entry | None, int]:
        """The live child with token ids whose common prefix with ``want`` is longest, and
        its length in tokens."""
        runs, maxes = self._runs, self._maxes
        if not runs:
            return None, 0
        r = bisect_left(maxes, want)
        p = bisect_left(runs[r], want, key=_tokens_of) if r < len(runs) else 0
        best: Entry | None = None
        best_len = 0
        # The common prefix with the query only shrinks going away from its insertion point,
        # so the nearest live child on each side is the best on that side.
        for c in (self._step(r, p, -1), self._step(r, p, 0)):
            if c is not None:
                m = common_tokens(c.tokens, want)  # type: ignore[arg-type]
                if m > best_len:
                    best, best_len = c, m
        return best, best_len

    def along(self, want: bytes) -> list[Entry]:
        """The children with token ids that are a prefix of ``want`` or start with it."""
        out: list[Entry] = []
        runs = self._runs
        for k in range(4, len(want), 4):  # proper prefixes: one bisection each
            e = self._find(want[:k])
            if e is not None:
                out.append(e)
        r = bisect_left(self._maxes, want)
        p = bisect_left(runs[r], want, key=_tokens_of) if r < len(runs) else 0
        while r < len(runs):  # those starting with ``want`` follow it in sorted order
            run = runs[r]
            while p < len(run):
                if not run[p].tokens.startswith(want):  # type: ignore[union-attr]
                    return out
                out.append(run[p])
                p += 1
            r += 1
            p = 0
        return out

    def _find(self, tokens: bytes) -> Entry | None:
        r = bisect_left(self._maxes, tokens)
        if r == len(self._runs):
            return None
        run = self._runs[r]
        p = bisect_left(run, tokens, key=_tokens_of)
        return run[p] if p < len(run) and run[p].tokens == tokens else None

    def _step(self, r: int, p: int, direction: int) -> Entry | None:
        """The first live child at or after (``direction`` 0) or before (-1) run ``r``,
        position ``p``."""
        runs = self._runs
        if direction < 0:
            p -= 1
            while r >= 0:
                if r < len(runs):
                    run = runs[r]
                    while p >= 0:
                        if not run[p].dead:
                            return run[p]
                        p -= 1
                r -= 1
                p = len(runs[r]) - 1 if r >= 0 else -1
            return None
        while r < len(runs):
            run = runs[r]
            while p < len(run):
                if not run[p].dead:
                    return run[p]
                p += 1
            r += 1
            p = 0
        return None

    def tokenless_lengths(self) -> list[int]:
        """Distinct lengths of the children without token ids, longest first."""
        return sorted(self._tokenless, reverse=True)

    def tokenless(self, num_tokens: int, key: bytes) -> Entry | None:
        by_key = self._tokenless.get(num_tokens)
        return by_key.get(key) if by_key is not None else None
