"""The indexed directory (children sorted by tokens, listed ones by length) finds the same
longest match as a plain scan over every sibling, on random tries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musacache.engine.children as children_mod
from musacache._keys import Fingerprint, KeyChain
from musacache._spec import KVSpec
from musacache.engine.directory import Directory, Entry

CHUNK = 6
SPEC = KVSpec(1, 1, 2, torch.float16)
# Few symbols so siblings share long prefixes; negative and multi-byte ids so that the byte
# order of int32 tokens differs from their numeric order.
token = st.sampled_from([0, 1, 2, 256, -1, 2**31 - 1])
run = st.lists(token, min_size=1, max_size=CHUNK)


def _plain_scan(d: Directory, parent: bytes, want: np.ndarray) -> int:
    """The longest match the old scan finds: every live child of ``parent``, one by one."""
    best = 0
    for c in list(d.child_entries(parent)):
        if c.dead:
            continue
        if c.tokens is not None:
            have = np.frombuffer(c.tokens, dtype="<i4")
            k = min(len(have), len(want))
            diff = np.flatnonzero(have[:k] != want[:k])
            best = max(best, int(diff[0]) if diff.size else k)
        elif c.num_tokens <= len(want) and \
                KeyChain.child(parent, want[: c.num_tokens].tobytes()) == c.key:
            best = max(best, c.num_tokens)
    return best


def _entry(parent: bytes, toks: list[int], listed: bool) -> Entry:
    arr = np.asarray(toks, dtype="<i4")
    key = KeyChain.child(parent, arr.tobytes())
    return Entry(key, parent, len(toks), SPEC.nbytes(len(toks)), None if listed else arr)


@pytest.fixture(autouse=True)
def _tiny_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs of 2 (split at 4): a few siblings already span many runs and their boundaries.
    monkeypatch.setattr(children_mod, "_RUN", 2)


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "list", "remove", "kill"]), run,
                         st.integers(0, 50)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops, st.lists(run, min_size=1, max_size=10))
def test_sibling_index_matches_plain_scan(operations, queries):
    chain = KeyChain(Fingerprint("idx", SPEC, CHUNK))
    d = Directory(chain)
    parent = chain.seed
    live: list[Entry] = []
    for op, toks, pick in operations:
        if op in ("add", "list"):
            e = _entry(parent, toks, listed=op == "list")
            d.add(e)
            live = [x for x in live if x.key != e.key] + [e]
        elif live and op == "remove":
            d.remove(live.pop(pick % len(live)))
        elif live:  # a dead entry still indexed must be skipped, never served
            live[pick % len(live)].dead = True
        # The index holds exactly the entries the directory holds.
        assert sorted(c.key for c in d.child_entries(parent)) == sorted(x.key for x in live)
    for q in queries:
        want = np.asarray(q, dtype="<i4")
        wb = want.tobytes()
        along = [x.key for x in live if x.tokens is not None
                 and (wb.startswith(x.tokens) or x.tokens.startswith(wb))]
        assert sorted(c.key for c in d.children_along(parent, wb)) == sorted(along)
        expect = _plain_scan(d, parent, want)
        got = d._best_prefix_child(parent, want, 0, len(want))
        if expect == 0:
            assert got is None
            continue
        assert got is not None
        assert got.num_tokens == expect
        assert got.entry in live and not got.entry.dead
        have = np.frombuffer(got.entry.tokens, dtype="<i4")
        assert np.array_equal(have[:expect], want[:expect])


prompts = st.lists(st.lists(st.sampled_from([0, 1, 256]), min_size=1, max_size=4 * CHUNK),
                   min_size=1, max_size=12)


class _ScanDirectory(Directory):
    """The directory as it was: ``_best_prefix_child`` scans every child."""

    def _best_prefix_child(self, parent, tokens, start, end):  # type: ignore[no-untyped-def]
        from musacache.engine.directory import Match

        want = tokens[start:end]
        m = _plain_scan(self, parent, want)
        if m == 0:
            return None
        for c in self.child_entries(parent):
            if c.dead:
                continue
            if c.tokens is None and KeyChain.child(parent, want[:m].tobytes()) == c.key:
                self._learn_tokens(c, want[:m].tobytes())
            if c.tokens is not None:
                have = np.frombuffer(c.tokens, dtype="<i4")
                if len(have) >= m and np.array_equal(have[:m], want[:m]):
                    return Match(start, m, c)
        raise AssertionError("unreachable: the scan found a match")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompts, st.lists(st.booleans(), min_size=12, max_size=12), prompts)
def test_indexed_match_equals_scanning_match_on_random_tries(stored, listed, queries):
    chain = KeyChain(Fingerprint("idx", SPEC, CHUNK))
    indexed, scanning = Directory(chain), _ScanDirectory(chain)
    for i, p in enumerate(stored):
        arr = np.asarray(p, dtype="<i4")
        for start, end, parent, key in chain.iter_keys(arr):
            toks = None if listed[i] else arr[start:end]
            for d in (indexed, scanning):
                if d.get(key) is None:
                    d.add(Entry(key, parent, end - start, SPEC.nbytes(end - start), toks))
    for q in queries:
        arr = np.asarray(q, dtype="<i4")
        got, stop = indexed.match(arr)
        want, want_stop = scanning.match(arr)
        assert [(m.start, m.num_tokens) for m in got] == [(m.start, m.num_tokens) for m in want]
        assert stop == want_stop
        for m in got:
            have = np.frombuffer(m.entry.tokens, dtype="<i4")
            assert np.array_equal(have[: m.num_tokens], arr[m.start : m.start + m.num_tokens])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from([0, 1]), min_size=1,
                                                  max_size=3 * CHUNK)), min_size=1,
                max_size=40),
       st.lists(st.integers(0, 10**6), max_size=20))
def test_children_stay_findable_as_parents_come_and_go(steps, removals):
    """Children live on their parent's entry, or in the directory while the parent is
    absent (learned first, or removed before them): each is always found by its parent key."""
    chain = KeyChain(Fingerprint("idx", SPEC, CHUNK))
    d = Directory(chain)
    model: dict[bytes, Entry] = {}
    for listed, p in steps:
        arr = np.asarray(p, dtype="<i4")
        keys = chain.keys(arr)
        # Add the prompt's chunks leaf first, so children often come before their parent.
        for start, end, parent, key in reversed(keys):
            if key not in model:
                e = Entry(key, parent, end - start, SPEC.nbytes(end - start),
                          None if listed else arr[start:end])
                d.add(e)
                model[key] = e
        for r in removals[: len(model) // 2]:
            victim = sorted(model)[r % len(model)]
            d.remove(model.pop(victim))
    parents = {e.parent for e in model.values()} | set(model)
    for k in parents:
        want = sorted(e.key for e in model.values() if e.parent == k)
        assert sorted(c.key for c in d.child_entries(k)) == want
        assert sorted(c.key for c in d.child_list(k)) == want
    assert set(d.entries) == set(model)


# A forest of chains over a few symbols: chunk i of a prompt has the chunk before it as its
# parent, so a prompt's chunks form a path and prompts sharing a head share its chunks.
forest_ops = st.lists(st.tuples(st.sampled_from(["put", "put", "remove", "remove", "readd"]),
                                st.lists(st.sampled_from([0, 1]), min_size=1, max_size=5),
                                st.integers(0, 100)), min_size=1, max_size=50)


@settings(max_examples=300, deadline=None)
@given(forest_ops, st.lists(st.sampled_from([0, 1]), min_size=1, max_size=5))
def test_a_delete_walk_reaches_every_chunk_under_its_root_through_missing_ones(operations,
                                                                              root_path):
    """Chunks leave the directory in any order (a parent evicted from one tier while its
    child lives in another), and come back. Every chunk still there whose chain passes
    through a root must be in the root's subtree walk, however many of the chunks between
    them are missing: found by a probe, a delete missed the chunks below a missing one, and
    a later put of that one brought them back."""
    from musacache.engine.placement import subtree_batches

    chain = KeyChain(Fingerprint("walk", SPEC, CHUNK))
    d = Directory(chain)
    up: dict[bytes, bytes] = {}  # the model: every chunk's parent, by key
    made: dict[bytes, list[int]] = {}  # every chunk's tokens, by key

    def keys_of(path: list[int]) -> list[tuple[bytes, bytes, list[int]]]:
        out, parent = [], chain.seed
        for sym in path:
            toks = [sym] * CHUNK
            key = KeyChain.child(parent, np.asarray(toks, "<i4").tobytes())
            out.append((parent, key, toks))
            parent = key
        return out

    for op, path, pick in operations:
        if op == "put":
            for parent, key, toks in keys_of(path):
                up[key], made[key] = parent, toks
                if d.get(key) is None:
                    d.add(_entry(parent, toks, listed=False))
        elif op == "remove" and len(d):
            keys = sorted(d.entries.keys())
            d.remove(d.entries.get(keys[pick % len(keys)]))
        elif op == "readd" and made:
            # A put brings a chunk back under its parent: the parent is cached, or the put
            # commits it first (and holds it). (A chunk learned from a listing without its
            # parent has no known ancestry.)
            key = sorted(made)[pick % len(made)]
            if d.get(key) is None and (up[key] == chain.seed or d.get(up[key]) is not None):
                d.add(_entry(up[key], made[key], listed=False))

        # Links are kept exactly while orphans wait under a missing chunk: no leak.
        for k, parent in d.lost_parent.items():
            assert d.entries.get(k) is None and (k in d.children or k in d.lost_under)
            assert k in d.lost_under[parent] and up[k] == parent
        assert sum(map(len, d.lost_under.values())) == len(d.lost_parent)

    root = keys_of(root_path)[-1][1]

    def under(key: bytes) -> bool:
        while key in up:
            key = up[key]
            if key == root:
                return True
        return False

    expect = sorted(k for k in d.entries.keys() if under(k))
    assert sorted(e.key for e in d.subtree([root])) == expect
    got = [e.key for part in subtree_batches(d, [root], 3) for e in part]
    assert sorted(got) == expect
