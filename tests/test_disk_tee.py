"""A get that promotes chunks from disk writes each chunk into its top-tier slot and into the
get's own tensor in the same read, block by block (``musacache.engine.tee``): the later move copies
only what that read did not write (a caller's ``out`` is written by the move alone). That is ``promotion="sync"``; the default read straight
into the caller's tensor is tests/test_disk_direct.py's. Speed is shown by ``musacache bench scale --only disk``."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import (
    flip_byte,
    on_disk_only,
    prefix_kv,
    random_tokens,
    slow_and_backup_disks,
    small_spec,
)
from musacache import codec
from musacache._keys import KEY_BYTES, Fingerprint, as_tokens
from musacache.engine.tee import Tee, _as_numpy, fill_flat
from musacache.tiers.base import ChunkMeta, StorageTier, TierContext
from musacache.tiers.disk import DiskStore

CH = 16


def _cfg(spec: mc.KVSpec, cold: Any, host_chunks: int = 8) -> mc.CacheConfig:
    # promotion="sync": the read through the top-tier slot that these tests are about (the
    # default reads a disk chunk straight into the get's tensor: tests/test_disk_direct.py).
    return mc.CacheConfig(spec, "tee", chunk_size=CH, promotion="sync", tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * host_chunks), cold))


def _spy_moves(c: mc.Cache) -> list[int]:
    """The storage address of each destination handed to the engine's move."""
    calls: list[int] = []
    mover = c._engine.mover
    copy = mover.copy

    async def spy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        calls.extend(d.untyped_storage().data_ptr() for d, _ in pairs)
        await copy(pairs)

    mover.copy = spy  # type: ignore[method-assign]
    return calls


def _spy_resident(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The chunks of each copy by slot address (musacache.engine.resident)."""
    from musacache import _native

    calls: list[int] = []
    scatter = _native.scatter_rows

    def spy(*a: Any, **k: Any) -> None:
        calls.append(len(k["chunk_starts"]) - 1)
        scatter(*a, **k)

    monkeypatch.setattr(_native, "scatter_rows", spy)
    return calls


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
async def test_a_disk_promotion_writes_out_in_its_read_and_is_not_moved_again(
        tmp_path: Path, codec_name: str) -> None:
    spec = small_spec()
    toks = random_tokens(6 * CH)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec=codec_name)
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        moves = _spy_moves(c)
        # The get's own tensor (no ``out``: a caller's ``out`` is written by the move alone,
        # so that a chunk that fails part-way leaves nothing in it past the hit).
        hit = await c.get(toks)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(hit.kv, kv)
        assert hit.kv.untyped_storage().data_ptr() not in moves  # written once


async def test_a_sync_get_into_out_is_written_by_the_move_from_the_slots(
        tmp_path: Path) -> None:
    """Into a caller's ``out`` a chunk from disk is staged in its top-tier slot (its
    promotion), with no tee: ``out`` gets only chunks all read, by the one move."""
    spec = small_spec()
    toks = random_tokens(4 * CH, seed=2)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB")
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        moves = _spy_moves(c)
        # A strided destination (a permuted view): the move writes it in its logical order.
        base = torch.zeros(spec.shape(len(toks))[::-1])
        out = base.permute(*reversed(range(base.dim())))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(out, kv)
        assert moves.count(base.untyped_storage().data_ptr()) == 4


async def test_chunks_served_from_memory_still_go_through_the_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = small_spec()
    toks = random_tokens(6 * CH, seed=1)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB")
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        await c.get(toks[: 2 * CH])  # the first two chunks back in host memory
        moves = _spy_moves(c)
        by_address = _spy_resident(monkeypatch)
        hit = await c.get(toks)
        assert hit.num_tokens == len(toks)
        assert hit.tiers == {"host": 2 * CH, "disk": 4 * CH}
        assert torch.equal(hit.kv, kv)
        # exactly the two chunks the disk read did not write: the leading ones, which the
        # host tier holds, copied by slot address (musacache.engine.resident), none by the move
        assert by_address == [2]
        assert moves.count(hit.kv.untyped_storage().data_ptr()) == 0


async def test_a_tee_is_made_only_for_the_chunks_read_from_below(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tee (20 to 55 µs to make) is made as a chunk's fetch from storage starts, never for
    the chunks a get serves from memory (before: one per chunk of every get, 6 here)."""
    from musacache import cache as _engine

    made: list[Tee] = []

    class CountedTee(Tee):
        def __init__(self, dst: torch.Tensor) -> None:
            super().__init__(dst)
            made.append(self)

    monkeypatch.setattr(_engine, "Tee", CountedTee)
    spec = small_spec()
    toks = random_tokens(6 * CH, seed=5)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB")
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        await c.get(toks[: 2 * CH])  # the first two chunks back in host memory
        made.clear()
        hit = await c.get(toks)
        assert hit.tiers == {"host": 2 * CH, "disk": 4 * CH}
        assert torch.equal(hit.kv, kv)
        assert len(made) == 4
        made.clear()
        hit = await c.get(toks)  # all in memory now
        assert hit.tiers == {"host": len(toks)}
        assert made == []


async def test_get_pages_from_disk_serves_each_page_exact(tmp_path: Path) -> None:
    # Pages read from storage are staged (test_out_tail: a page that fails part-way leaves
    # its out as it was), then copied on in the get's one move.
    spec = small_spec()
    pages = [torch.randn(spec.shape(CH)) for _ in range(3)]
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB")
    async with mc.Cache(_cfg(spec, disk)) as c:
        keys = [b"p0", b"p1", b"p2"]
        assert await c.put_pages(keys, pages) == 3
        await on_disk_only(c)
        outs = [torch.zeros(spec.nbytes(CH) // 4) for _ in range(3)]  # flat pages
        assert await c.get_pages(keys, outs) == [True, True, True]
        assert all(torch.equal(o, p.reshape(-1)) for o, p in zip(outs, pages, strict=True))


async def test_a_damaged_chunk_ends_the_hit_before_it_with_the_served_bytes_exact(
        tmp_path: Path) -> None:
    spec = small_spec()
    toks = random_tokens(4 * CH, seed=2)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec="raw")
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        matches = await c._engine.match(as_tokens(toks))
        key = matches[2].entry.key.hex()
        path, = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                 if f.startswith(key + ".")]
        flip_byte(path, -3)  # in the last block of chunk 2's payload
        out = torch.full_like(kv, 7.0)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 2 * CH
        assert torch.equal(hit.kv, kv[:, :, : 2 * CH])
        assert torch.equal(out[:, :, : 2 * CH], kv[:, :, : 2 * CH])


async def test_an_abandoned_read_writes_nothing_into_out_after_the_get(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A read that times out is left to its thread; the get returns a miss. When the thread
    # finally reads the file, its verified blocks must not land in the caller's tensor.
    spec = small_spec()
    toks = random_tokens(CH, seed=3)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec="raw", timeout=0.2)
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        release, returned = threading.Event(), threading.Event()
        read = DiskStore._read_regular_into

        def hung(*args: Any) -> object:
            release.wait(30)
            try:
                return read(*args)
            finally:
                returned.set()

        monkeypatch.setattr(DiskStore, "_read_regular_into", staticmethod(hung))
        out = torch.zeros_like(kv)
        try:
            assert (await c.get(toks, out=out)).num_tokens == 0
        finally:
            release.set()
        with anyio.fail_after(30):
            while not returned.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert not out.any()


class _SpyTier(StorageTier):
    """An in-memory tier that reads into tensors and records how many reads overlap."""

    name = "spy"
    reads_into = True
    codec = "raw"
    max_concurrency = 3

    def __init__(self) -> None:
        self.objs: dict[bytes, bytes] = {}
        self.metas: dict[bytes, ChunkMeta] = {}
        self.active = 0
        self.peak = 0
        self.gate = anyio.Event()

    async def start(self, ctx: TierContext) -> list[ChunkMeta]:
        return []

    async def aclose(self) -> None:
        pass

    async def write(self, meta: ChunkMeta, obj: bytes) -> None:
        self.objs[meta.key] = obj

    async def read(self, meta: ChunkMeta) -> bytes | None:
        return self.objs.get(meta.key)

    async def delete(self, key: bytes) -> None:
        self.objs.pop(key, None)

    async def read_into(self, meta: ChunkMeta, fingerprint: Any, out: torch.Tensor, *,
                        on_block: Any = None) -> int | None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            with anyio.move_on_after(0.5):  # until all the reads allowed at once are waiting
                await self.gate.wait()
            if self.active >= self.max_concurrency:
                self.gate.set()
            obj = self.objs.get(meta.key)
            if obj is None:
                return None
            codec.decode_chunk(fingerprint, obj, expect=meta, out=out)
            return len(obj)
        finally:
            self.active -= 1


async def test_the_chunks_of_one_get_are_read_concurrently_within_the_tier_bound() -> None:
    spec = small_spec()
    toks = random_tokens(8 * CH, seed=4)
    kv = prefix_kv(spec, toks)
    spy = _SpyTier()
    async with mc.Cache(_cfg(spec, spy)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        hit = await c.get(toks)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, kv)
        assert spy.peak == spy.max_concurrency  # overlapping, and never more than allowed


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
def test_read_chunk_into_reports_each_verified_range_once(
        tmp_path: Path, codec_name: str) -> None:
    spec = small_spec()
    fp = Fingerprint("tee", spec, 64)
    data = prefix_kv(spec, random_tokens(64, seed=5))
    meta = ChunkMeta(b"k" * KEY_BYTES, b"p" * KEY_BYTES, 64, spec.nbytes(64))
    obj = codec.encode_chunk(fp, meta, data, codec_name, block_size=4096)
    path = tmp_path / "c"
    path.write_bytes(obj)
    fd = os.open(path, os.O_RDONLY)
    try:
        got: list[tuple[int, int]] = []
        out = torch.empty_like(data)
        codec.read_chunk_into(fp, fd, len(obj), out, on_block=lambda a, b: got.append((a, b)))
        assert sorted(got) == [(a, min(a + 4096, meta.raw_bytes))
                               for a in range(0, meta.raw_bytes, 4096)]
        assert torch.equal(out, data)
    finally:
        os.close(fd)
    if codec_name == "raw":
        # A damaged block: the blocks before it were reported, it and those after were not.
        hdr = codec.read_header(obj[: codec.HEADER_SIZE])
        damaged = bytearray(obj)
        damaged[len(obj) - meta.raw_bytes + 2 * 4096 + 5] ^= 1
        path.write_bytes(bytes(damaged))
        fd = os.open(path, os.O_RDONLY)
        try:
            got.clear()
            with pytest.raises(mc.CorruptChunkError):
                codec.read_chunk_into(fp, fd, len(obj), out,
                                      on_block=lambda a, b: got.append((a, b)))
            assert got == [(0, 4096), (4096, 8192)]
        finally:
            os.close(fd)
        assert hdr.num_blocks > 3


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_fill_flat_writes_a_range_in_logical_order_for_any_strides(
        shape: list[int], data: st.DataObject) -> None:
    n = int(np.prod(shape))
    perm = data.draw(st.permutations(range(len(shape))))
    base = torch.zeros([shape[p] for p in perm], dtype=torch.int32)
    dst = base.permute(*np.argsort(perm).tolist())  # logical shape `shape`, permuted strides
    assert list(dst.shape) == shape
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    src = torch.arange(n, dtype=torch.int32) + 1
    fill_flat(_as_numpy(dst), _as_numpy(src)[lo:hi], lo)
    want = torch.zeros(n, dtype=torch.int32)
    want[lo:hi] = src[lo:hi]
    assert torch.equal(dst.reshape(-1), want)


def test_a_closed_tee_writes_nothing_and_is_not_complete() -> None:
    src = torch.arange(8, dtype=torch.float32)
    dst = torch.zeros(8)
    tee = Tee(dst)
    tee.put(src, 0, 16)
    assert not tee.complete and torch.equal(dst[:4], src[:4]) and not dst[4:].any()
    tee.put(src, 16, 32)
    assert tee.complete and torch.equal(dst, src)
    tee.close()
    assert not tee.complete
    dst.zero_()
    tee.put(src, 0, 32)
    assert not dst.any()


async def test_a_read_that_missed_cannot_complete_its_tee_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first disk's read times out and the chunk is served by the second disk. The first
    # read's thread then finishes before the get checks its tee: that late copy must not count
    # as the chunk's delivery, so the chunk still goes through the move.
    spec = small_spec()
    toks = random_tokens(CH, seed=6)
    kv = prefix_kv(spec, toks)
    d1 = tmp_path / "d1"
    cfg = slow_and_backup_disks(spec, tmp_path, CH, promotion="sync")
    async with mc.Cache(cfg) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        assert [t.holds(e) for t in c._engine.stores
                for e in c._engine.dir.entries.values()] == [True, True]
        release, returned = threading.Event(), threading.Event()
        read = DiskStore._read_regular_into

        def racing(path: Path, *rest: Any) -> object:
            if str(path).startswith(str(d1)):
                release.wait(30)
                try:
                    return read(path, *rest)
                finally:
                    returned.set()
            release.set()  # the slow read finishes now, while the backup is read
            returned.wait(30)
            return read(path, *rest)

        monkeypatch.setattr(DiskStore, "_read_regular_into", staticmethod(racing))
        moves = _spy_moves(c)
        out = torch.zeros_like(kv)
        try:
            hit = await c.get(toks, out=out)
        finally:
            release.set()
        assert hit.num_tokens == CH and hit.tiers == {"backup": CH}
        assert returned.is_set() and torch.equal(out, kv)
        assert moves.count(out.untyped_storage().data_ptr()) == 1


async def test_a_promotion_that_outlives_a_cancelled_get_leaves_out_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A promotion is a background task: a get cancelled while the chunk is being read does
    # not stop it, and the read then finishes into the top tier, but not into the caller's
    # tensor, which the caller owns again once the get has returned.
    spec = small_spec()
    toks = random_tokens(2 * CH, seed=7)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec="raw")
    async with mc.Cache(_cfg(spec, disk)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        started, release = threading.Event(), threading.Event()
        read = DiskStore._read_regular_into

        def slow(*args: Any) -> object:
            started.set()
            release.wait(30)
            return read(*args)

        monkeypatch.setattr(DiskStore, "_read_regular_into", staticmethod(slow))
        out = torch.zeros_like(kv)
        with anyio.move_on_after(0.3) as scope:
            await c.get(toks, out=out)
        assert scope.cancelled_caught and started.is_set()
        release.set()
        with anyio.fail_after(30):
            while len(c._engine.mem[0].lru) < 2:  # noqa: ASYNC110  (promotions finish)
                await anyio.sleep(0.01)
        assert not out.any()
        monkeypatch.setattr(DiskStore, "_read_regular_into", staticmethod(read))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 2 * CH and torch.equal(out, kv)
