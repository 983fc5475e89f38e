"""A close never finishes deletes on the loop: what ``close_timeout`` cuts short is noted by
the disk tier and done at the next open, before the first read, or (memory only) goes with
the cache. Not timings: the entries removed in one turn of the loop while ``aclose`` runs,
what ``stats()["close"]`` counts, and what a reopened cache serves. The wall bound is only a
guard against a hang."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import numpy as np
import torch

import musacache as mc
from fake_store import MemStore
from helpers import most_per_turn
from musacache.engine.core import BATCH
from musacache.engine.notes import DeleteNote, decode, encode
from musacache.tiers.disk import NOTES_FILE, DiskStore

CH = 16
TINY = mc.KVSpec(1, 1, 8, torch.float16)
PROMPTS = 6
CHUNKS = 1024  # per prompt: a delete of hundreds of loop turns
CLOSE_TIMEOUT = 0.0  # the deadline cuts the deletes at once, however fast the machine
HANG_GUARD = CLOSE_TIMEOUT + 5.0
# Entries one turn of the loop may remove: a batch from each delete running at once (every
# ready task runs once a turn); the rest of a prompt run at once is a whole prompt's.
TURN_MOST = (PROMPTS + 1) * BATCH


class HungDeletes(DiskStore):
    """A disk tier whose deletes never return (a hung file system): every delete queued is
    still pending when the close cuts it."""

    async def delete(self, key: bytes) -> None:
        await anyio.sleep_forever()


def _prompts(seed: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128000, CHUNKS * CH).astype(np.int32) for _ in range(PROMPTS + 1)]


def _cfg(*stores: mc.StorageTier | mc.DiskTier) -> mc.CacheConfig:
    return mc.CacheConfig(TINY, "close", chunk_size=CH, close_timeout=CLOSE_TIMEOUT,
                          tiers=(mc.HostTier(TINY.nbytes(CH) * (PROMPTS + 1) * CHUNKS * 2),
                                 *stores))


async def _fill(c: mc.Cache, prompts: list[np.ndarray]) -> None:
    kv = torch.zeros(TINY.shape(CHUNKS * CH), dtype=TINY.dtype)
    for p in prompts:
        await c.put(p, kv)
    await c.flush()


async def _deletes_to_background(c: mc.Cache, prompts: list[np.ndarray]) -> None:
    """Start a delete of each prompt, let each take its first batches, then cancel the
    callers: the rest runs in the cache's background (as a server's cut-off request's)."""
    calls = [asyncio.ensure_future(c.delete(p)) for p in prompts]
    for _ in range(3):
        await asyncio.sleep(0)
    for t in calls:
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert (await c.stats())["in_flight"]["background"] >= len(prompts)


async def _close_counting(c: mc.Cache) -> int:
    """``aclose``; the most directory entries it removed in one turn of the loop."""
    eng = c._engine
    removed = [0]
    remove = eng.remove

    def counting(doomed):  # type: ignore[no-untyped-def]
        removed[0] += len(doomed)
        return remove(doomed)

    eng.remove = counting  # type: ignore[method-assign]
    with anyio.fail_after(HANG_GUARD):
        return await most_per_turn(c.aclose, lambda: -removed[0])


def _notes(root: Path) -> list[Path]:
    return list(root.rglob(NOTES_FILE))


async def test_close_notes_cut_deletes_on_disk_and_the_next_open_does_them(tmp_path):
    """Deletes queued on a disk tier that never finishes them: the close returns after the
    deadline without running them, notes them, and the next open deletes the prompts before
    its first read. Before, the objects stayed and the deleted prefixes came back as hits."""
    prompts = _prompts()
    deleted, kept = prompts[:PROMPTS], prompts[PROMPTS]
    disk = mc.DiskTier(str(tmp_path), TINY.nbytes(CH) * 4 * len(prompts) * CHUNKS,
                       write_through=True)
    c = mc.Cache(_cfg(HungDeletes(disk)))
    await c.open()
    await _fill(c, prompts)
    await _deletes_to_background(c, deleted)
    most = await _close_counting(c)
    close = (await c.stats())["close"]
    assert close["timed_out"] == 1
    assert close["deletes_cut"] == PROMPTS
    assert close["deletes_noted"] >= PROMPTS and close["deletes_abandoned"] == 0
    assert most <= TURN_MOST, most
    assert len(_notes(tmp_path)) == 1

    async with mc.Cache(_cfg(disk)) as again:
        for p in deleted:
            assert await again.lookup(p) == 0  # never served: the note ran before any read
        assert await again.lookup(kept) == len(kept)
        st = (await again.stats())["tiers"][disk.name]
        assert st["notes_replayed"] >= PROMPTS
        await again.flush()  # the deletes the note caused have run: the note is dropped
        assert _notes(tmp_path) == []
    async with mc.Cache(_cfg(disk)) as third:
        assert (await third.stats())["tiers"][disk.name]["notes_replayed"] == 0
        for p in deleted:
            assert await third.lookup(p) == 0
        assert await third.lookup(kept) == len(kept)


async def _cut_every_delete(*stores: mc.StorageTier) -> dict[str, int]:
    """A cache over ``stores`` closed with a delete of every prompt in its background: its
    close counters, once no turn removed more than ``TURN_MOST`` entries."""
    c = mc.Cache(_cfg(*stores))
    await c.open()
    prompts = _prompts()
    await _fill(c, prompts)
    await _deletes_to_background(c, prompts)
    most = await _close_counting(c)
    assert most <= TURN_MOST, most
    close: dict[str, int] = (await c.stats())["close"]
    assert close["timed_out"] == 1
    assert close["deletes_cut"] == len(prompts)
    return close


async def test_a_memory_only_close_drops_cut_deletes_without_a_stall():
    """Without a storage tier, deletes the close cuts short are dropped with the memory: at
    most a batch per delete removed per turn. Before, their rest ran in one step of
    the loop (every entry still to remove, here thousands)."""
    close = await _cut_every_delete()
    assert close["deletes_noted"] == close["deletes_abandoned"] == 0


async def test_a_tier_without_notes_counts_the_deletes_it_abandons():
    """A storage tier that keeps no notes (S3, a plug-in): the deletes cut short are counted
    as abandoned, and the close still never runs them."""
    close = await _cut_every_delete(MemStore(write_through=True))
    assert close["deletes_abandoned"] >= PROMPTS + 1 and close["deletes_noted"] == 0


def test_a_delete_note_reads_back_and_a_torn_one_is_refused():
    note = DeleteNote([np.arange(5, dtype=np.int32), np.zeros(0, dtype=np.int32)],
                      [bytes(range(32)), b"\xff" * 32])
    blob = encode(note)
    back = decode(blob)
    assert [p.tolist() for p in back.prompts] == [p.tolist() for p in note.prompts]
    assert back.keys == note.keys
    for torn in (blob[:-1], blob[:40], b"", blob[:-3] + b"abc"):
        try:
            decode(torn)
        except ValueError:
            continue
        raise AssertionError(f"a torn note of {len(torn)} bytes was read")


async def test_a_large_directory_is_taken_apart_after_aclose_returns(monkeypatch):
    """Past CLOSE_INLINE entries, ``aclose`` does not wait for the directory to be taken
    apart a batch per turn of the loop (a million entries were 1.5 s past any
    ``close_timeout``): a thread of its own frees them all, and ends."""
    import threading

    from musacache.engine import removal

    taken: list[tuple[int, int]] = []  # (thread, entries) of each part taken apart
    take_apart = removal._take_apart

    def counted(*args: object) -> int:
        n = take_apart(*args)  # type: ignore[arg-type]
        taken.append((threading.get_ident(), n))
        return n

    monkeypatch.setattr(removal, "_take_apart", counted)
    chunks = removal.CLOSE_INLINE + 4 * 64
    cfg = mc.CacheConfig(TINY, "large-close", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=TINY.nbytes(CH) * (chunks + 64)),))
    cache = mc.Cache(cfg)
    await cache.open()
    rng = np.random.default_rng(5)
    kv = torch.zeros(TINY.shape(64 * CH), dtype=TINY.dtype)
    for _ in range(chunks // 64):
        await cache.put(rng.integers(0, 1 << 20, 64 * CH).astype(np.int32), kv)
    assert (await cache.stats())["chunks"] == chunks
    await cache.aclose()
    for t in [t for t in threading.enumerate() if t.name == "musacache-dismantle"]:
        await asyncio.to_thread(t.join, HANG_GUARD)
        assert not t.is_alive()
    loop_thread = threading.get_ident()
    assert sum(n for who, n in taken if who == loop_thread) == 0
    assert sum(n for _, n in taken) == chunks
