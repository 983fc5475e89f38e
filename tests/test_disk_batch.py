"""A get hands every chunk it reads straight from disk to the disk tier as one batch
(``DiskStore.read_to_many``): a few worker threads each take the next chunk as soon as they are
done with one, with no event-loop turn between chunks. These tests pin what a batch must keep
from the reads one by one: each chunk's own outcome (served, absent, damaged, quarantined), a
read that hangs is abandoned within the timeout and quarantined while the others are served,
and a chunk the batch never started is read on its own."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import pytest
import torch

import musacache as mc
from helpers import (
    flip_byte,
    hang_direct_reads,
    on_disk_only,
    prefix_kv,
    random_tokens,
    small_spec,
    until_set,
)
from musacache import devices
from musacache._errors import CorruptChunkError
from musacache.engine.tee import Tee
from musacache.tiers import disk as disk_mod
from musacache.tiers.base import NOT_TRIED, QuarantinedError

CH = 16


@contextlib.asynccontextmanager
async def _on_disk(tmp_path: Path, chunks: int, *, seed: int, codec: str = "lz4",
                   timeout: float = 10.0, max_concurrency: int = 4,
                   ) -> AsyncIterator[tuple[mc.Cache, mc.KVSpec, list[int], torch.Tensor]]:
    spec = small_spec()
    toks = random_tokens(chunks * CH, seed=seed)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec=codec,
                       timeout=timeout, max_concurrency=max_concurrency)
    cfg = mc.CacheConfig(spec, "batch", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * (chunks + 2)), disk))
    async with mc.Cache(cfg) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        yield c, spec, toks, kv


def _file_of_chunk(c: mc.Cache, root: Path, toks: list[int], i: int) -> Path:
    key = c._chain.keys(np.asarray(toks, dtype=np.int32))[i][3]
    hits = [p for p in root.rglob("*.kvc") if p.name.startswith(key.hex())]
    assert len(hits) == 1, hits
    return hits[0]


def _store(c: mc.Cache) -> Any:
    return c._engine.stores[0].store


async def _get_with_a_hung_file(c: mc.Cache, root: Path, toks: list[int], kv: torch.Tensor,
                                monkeypatch: pytest.MonkeyPatch, chunk: int,
                                ) -> tuple[Any, torch.Tensor, float, threading.Event]:
    """A get of ``toks`` into a zeroed ``out`` while the file of ``chunk`` hangs (released
    once the get returns): ``(hit, out, seconds the get took, set when the read returned)``."""
    _started, release, returned = hang_direct_reads(
        monkeypatch, under=_file_of_chunk(c, root, toks, chunk).resolve())
    out = torch.zeros_like(kv)
    t0 = time.monotonic()
    try:
        hit = await c.get(toks, out=out)
    finally:
        elapsed = time.monotonic() - t0
        release.set()
    return hit, out, elapsed, returned


async def test_a_get_of_many_disk_chunks_is_one_batch_on_a_few_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, 6, seed=1, max_concurrency=2) as (c, _spec, toks, kv):
        store = _store(c)
        calls = {"to": 0, "batches": 0, "items": 0, "threads": 0}
        read_to, read_to_many = store.read_to, store.read_to_many
        submit = store._executor.submit

        async def spy_to(*a: Any, **kw: Any) -> Any:
            calls["to"] += 1
            return await read_to(*a, **kw)

        async def spy_many(items: Any, *a: Any, **kw: Any) -> Any:
            calls["batches"] += 1
            calls["items"] += len(items)
            return await read_to_many(items, *a, **kw)

        def spy_thread(*a: Any) -> Any:
            calls["threads"] += 1
            return submit(*a)

        monkeypatch.setattr(store, "read_to", spy_to)
        monkeypatch.setattr(store, "read_to_many", spy_many)
        monkeypatch.setattr(store._executor, "submit", spy_thread)
        # One slice per lane however slow the machine (slices are tested below), and as
        # many lanes as max_concurrency however few its CPUs (lanes by CPUs: below).
        monkeypatch.setattr(disk_mod, "_LANE_SLICE", 60.0)
        monkeypatch.setattr(devices, "usable_cpus", lambda: 64)
        out = torch.full_like(kv, float("nan"))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(out, kv)
        # One batch of all six chunks, run by two worker threads (one hand-off each), where
        # the reads one by one made six hand-offs and six loop turns.
        assert calls == {"to": 0, "batches": 1, "items": 6, "threads": 2}
        await c.flush()
        st = await c.stats()
        assert st["tiers"]["disk"]["hits"] == 6 and st["tiers"]["host"]["promotions"] == 6


async def test_a_batch_answers_for_each_chunk_on_its_own(tmp_path: Path) -> None:
    async with _on_disk(tmp_path, 4, seed=2) as (c, spec, toks, kv):
        eng = c._engine
        st = eng.stores[0]
        matches = await eng.match(np.asarray(toks, dtype=np.int32))
        flip_byte(_file_of_chunk(c, tmp_path, toks, 1), -3)  # damaged
        _file_of_chunk(c, tmp_path, toks, 2).unlink()  # gone behind the cache's back
        st.store._quarantined.add(matches[3].entry.key)  # hung before: refused
        outs = [torch.full(spec.shape(CH), float("nan"), dtype=spec.dtype) for _ in matches]
        tees = [Tee(o) for o in outs]
        misses = st.store.stats()["read_misses"]
        got = await st.store.read_to_many(
            [(st.meta(m.entry), t.native) for m, t in zip(matches, tees, strict=True)],
            eng.fingerprint)
        assert isinstance(got[0], int) and got[0] > 0
        assert isinstance(got[1], CorruptChunkError)
        assert got[2] is None
        assert isinstance(got[3], QuarantinedError)  # the engine deletes it
        assert torch.equal(outs[0], kv.narrow(spec.token_dim, 0, CH))
        assert tees[0].complete and not tees[1].complete and not tees[2].complete
        assert torch.isnan(outs[3]).all()  # a quarantined file is never opened
        assert st.store.stats()["read_misses"] == misses + 1


async def test_a_hung_read_in_a_batch_is_abandoned_and_the_others_are_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, 4, seed=3, timeout=0.3) as (c, spec, toks, kv):
        hit, out, elapsed, returned = await _get_with_a_hung_file(
            c, tmp_path, toks, kv, monkeypatch, 1)
        assert elapsed < 5  # bounded by the timeout, not by the hung read (30 s)
        assert hit.num_tokens == CH and hit.tiers == {"disk": CH}
        td = spec.token_dim
        assert torch.equal(out.narrow(td, 0, CH), kv.narrow(td, 0, CH))
        # The chunks after the hung one were read by the other lanes meanwhile, into their
        # stage: out past the hit is left as it was.
        assert _store(c).stats()["reads"] == 3
        await until_set(returned)
        await anyio.sleep(0.05)
        assert not out.narrow(td, CH, 3 * CH).any()  # the abandoned read wrote nothing
        stats = (await c.stats())["tiers"]["disk"]
        assert stats["timeouts"] == 1
        store = _store(c).stats()
        assert store["read_timeouts"] == 1 and store["quarantined"] == 1
        assert store["stuck_reads"] == 0  # its thread came back
        monkeypatch.undo()
        # Quarantined: read as absent until it is written again.
        assert (await c.get(toks)).num_tokens == CH


async def test_a_hung_first_read_abandons_the_lane_the_get_runs_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's first lane runs in the get's own task (its first read starts with no loop
    turn before it): a read there that hangs is abandoned within the timeout all the same,
    the other lane reads the rest, and the get is a miss from chunk 0 on."""
    async with _on_disk(tmp_path, 4, seed=13, timeout=0.3, max_concurrency=2) as (
            c, _spec, toks, kv):
        hit, out, elapsed, returned = await _get_with_a_hung_file(
            c, tmp_path, toks, kv, monkeypatch, 0)
        assert elapsed < 5
        assert hit.num_tokens == 0
        assert _store(c).stats()["reads"] == 3  # the rest, into their stage
        await until_set(returned)
        await anyio.sleep(0.05)
        assert not out.any()  # the abandoned read wrote nothing, nor did the others
        store = _store(c).stats()
        assert store["read_timeouts"] == 1 and store["quarantined"] == 1
        assert store["stuck_reads"] == 0


async def test_a_chunk_the_batch_never_started_is_read_on_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, 5, seed=4) as (c, _spec, toks, kv):
        store = _store(c)
        read_to_many = store.read_to_many
        singles = {"to": 0}
        read_to = store.read_to

        async def cut_short(items: Any, fp: Any) -> list[Any]:
            # A batch cut short: only its even items were started.
            got = await read_to_many(items[::2], fp)
            out: list[Any] = [NOT_TRIED] * len(items)
            out[::2] = got
            return out

        async def spy_to(*a: Any, **kw: Any) -> Any:
            singles["to"] += 1
            return await read_to(*a, **kw)

        monkeypatch.setattr(store, "read_to_many", cut_short)
        monkeypatch.setattr(store, "read_to", spy_to)
        out = torch.full_like(kv, float("nan"))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(out, kv)
        assert singles["to"] == 2
        await c.flush()
        assert (await c.stats())["tiers"]["disk"]["hits"] == 5


async def test_a_batch_that_fails_whole_is_a_counted_miss_for_each_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, 3, seed=5) as (c, _spec, toks, kv):
        store = _store(c)

        async def broken(items: Any, fp: Any) -> list[Any]:
            raise OSError("the tier's own bug")

        monkeypatch.setattr(store, "read_to_many", broken)
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        # Every direct read missed, and the promotion that follows skips the tier.
        assert hit.num_tokens == 0 and not out.any()
        st = (await c.stats())["tiers"]["disk"]
        assert st["faults"] == 3 and st["misses"] >= 3
        monkeypatch.undo()
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and torch.equal(out, kv)


@pytest.mark.parametrize("answer", ["too few", "not a size"])
async def test_a_batch_answered_wrongly_is_a_counted_fault_never_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    async with _on_disk(tmp_path, 3, seed=6) as (c, _spec, toks, kv):
        store = _store(c)
        read_to_many = store.read_to_many

        async def wrong(items: Any, fp: Any) -> list[Any]:
            got = await read_to_many(items, fp)
            return got[:-1] if answer == "too few" else ["junk", *got[1:]]

        monkeypatch.setattr(store, "read_to_many", wrong)
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)  # a plug-in tier's bug is a miss, not the caller's
        assert hit.num_tokens == 0
        st = (await c.stats())["tiers"]["disk"]
        assert st["faults"] == (3 if answer == "too few" else 1)


@pytest.mark.parametrize("batched", [True, False])
async def test_an_io_error_in_a_batch_is_counted_as_the_read_alone_counts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool) -> None:
    async with _on_disk(tmp_path, 3, seed=7) as (c, _spec, toks, kv):
        store = _store(c)
        if not batched:
            monkeypatch.setattr(type(store), "reads_to_many", False)
        bad = str(_file_of_chunk(c, tmp_path, toks, 1).resolve())
        read = disk_mod.read_chunk_to

        def failing(fp: Any, fd: int, size: int, copy: Any, **kw: Any) -> Any:
            if os.readlink(f"/proc/self/fd/{fd}") == bad:  # a failing disk's pread
                raise OSError(errno.EIO, "Input/output error")
            return read(fp, fd, size, copy, **kw)

        monkeypatch.setattr(disk_mod, "read_chunk_to", failing)
        faults = store.stats()["read_faults"]
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == CH
        assert (await c.stats())["tiers"]["disk"]["faults"] == 1
        st = store.stats()
        assert st["read_faults"] == faults + 1 and "Input/output error" in st["last_error"]


async def test_one_hung_file_costs_a_batch_one_timeout_not_two(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read of a batch is bounded by the timeout as a read alone is: the lane stuck in
    the hung file is abandoned when that read reaches it, while the other lanes have long
    finished the rest (a watch over the batch's progress as a whole would wait a second
    timeout)."""
    timeout = 1.0
    async with _on_disk(tmp_path, 4, seed=8, timeout=timeout) as (c, _spec, toks, kv):
        hit, out, elapsed, returned = await _get_with_a_hung_file(
            c, tmp_path, toks, kv, monkeypatch, 0)
        assert hit.num_tokens == 0
        assert elapsed < 1.8 * timeout, elapsed
        await until_set(returned)
        store = _store(c).stats()
        assert store["read_timeouts"] == 1 and store["quarantined"] == 1
        assert store["stuck_reads"] == 0
        # The abandoned lane's thread token went back with it, the others' as they ended.
        assert _store(c)._limiter.borrowed_tokens == 0
        # The other three were read meanwhile by the other lanes, into their stage: out past
        # the hit is left as it was.
        assert store["reads"] >= 3  # (and their promotions' reads since)
        assert not out.any()


async def test_a_batch_whose_lanes_wait_for_threads_still_reads_with_one(
        tmp_path: Path) -> None:
    """Three of the tier's four thread tokens are held by other work (slow writes, say): the
    one left reads the whole batch, one chunk after another."""
    async with _on_disk(tmp_path, 4, seed=9, timeout=5.0) as (c, _spec, toks, kv):
        store = _store(c)
        holders = [object() for _ in range(3)]
        for h in holders:
            await store._limiter.acquire_on_behalf_of(h)
        try:
            out = torch.zeros_like(kv)
            hit = await c.get(toks, out=out)
        finally:
            for h in holders:
                store._limiter.release_on_behalf_of(h)
        assert hit.num_tokens == len(toks) and torch.equal(out, kv)
        # A lane that waited for a token got one once the other lane ended, and gave it back.
        assert store._limiter.borrowed_tokens == 0 and not store._limiter.statistics().tasks_waiting


async def test_a_long_batch_takes_turns_with_another_gets_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy batch longer than the timeout (a long prompt on a slow disk) gives its thread
    slots back every slice, so a get that comes meanwhile is read in turn, not starved into
    a timeout (its lanes waiting a whole timeout for a slot looked like a stall)."""
    spec = small_spec()
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec="raw", timeout=0.3,
                       max_concurrency=2)
    cfg = mc.CacheConfig(spec, "turns", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * 128), disk))
    long, short = random_tokens(80 * CH, seed=10), random_tokens(4 * CH, seed=11)
    async with mc.Cache(cfg) as c:
        await c.put(long, prefix_kv(spec, long))
        await c.put(short, prefix_kv(spec, short))
        await on_disk_only(c)
        read = disk_mod.read_chunk_to

        def slow(*a: Any, **kw: Any) -> Any:  # 20 ms a chunk: 0.8 s for the long batch
            time.sleep(0.02)
            return read(*a, **kw)

        monkeypatch.setattr(disk_mod, "read_chunk_to", slow)

        async def later() -> Any:
            await anyio.sleep(0.05)
            return await c.get(short)

        with anyio.fail_after(30):
            a, b = await asyncio.gather(c.get(long), later())
        assert a.num_tokens == len(long) and torch.equal(a.kv, prefix_kv(spec, long))
        assert b.num_tokens == len(short) and torch.equal(b.kv, prefix_kv(spec, short))
        st = (await c.stats())["tiers"]["disk"]
        assert st["timeouts"] == 0 and st["faults"] == 0


async def test_a_get_the_cache_closes_under_raises_the_closed_error_not_a_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that misses on disk falls back to a promotion, which a closed cache cannot
    start: the get raises ``CacheClosedError`` (a ``MusaCacheError``), as any call on a
    closed cache does, not the task group's ``ExceptionGroup`` of them."""
    spec = small_spec()
    cfg = mc.CacheConfig(spec, "closing", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * 64),
        mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", timeout=5, max_concurrency=2)))
    toks = random_tokens(6 * CH, seed=12)
    c = mc.Cache(cfg)
    await c.open()
    await c.put(toks, prefix_kv(spec, toks))
    await on_disk_only(c)
    _file_of_chunk(c, tmp_path, toks, 4).unlink()
    started, release, returned = hang_direct_reads(monkeypatch)
    outcome: list[BaseException | None] = []

    async def get() -> None:
        try:
            await c.get(toks, out=torch.zeros(spec.shape(len(toks))))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(get)
            await until_set(started)
            await c.aclose()
            release.set()
        await until_set(returned)
    assert len(outcome) == 1
    assert outcome[0] is None or isinstance(outcome[0], mc.CacheClosedError), repr(outcome[0])



@pytest.mark.parametrize("split", [True, False])
async def test_a_get_over_two_disk_tiers_reads_each_as_its_batch_and_falls_back_below(
        tmp_path: Path, split: bool) -> None:
    """Every chunk is on both disks (``lower`` written through). ``split``: the directory
    forgets the odd chunks on ``upper``, so the get reads two batches at once (one per
    tier, in a task group); else one batch from ``upper`` (awaited by the get itself),
    where two damaged files miss and are read from ``lower`` instead. Either way ``out`` is
    the KV put and each tier counts what it served."""
    spec = small_spec()
    chunks = 6
    upper = mc.DiskTier(path=str(tmp_path / "upper"), capacity_bytes="64MiB", name="upper")
    lower = mc.DiskTier(path=str(tmp_path / "lower"), capacity_bytes="64MiB", name="lower",
                        write_through=True)
    cfg = mc.CacheConfig(spec, "two-batches", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * (chunks + 2)), upper, lower))
    toks = random_tokens(chunks * CH, seed=21)
    kv = prefix_kv(spec, toks)
    async with mc.Cache(cfg) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        eng = c._engine
        up = eng.tier_by_name["upper"]
        matches = await eng.match(np.asarray(toks, dtype=np.int32))
        assert all(up.holds(m.entry) for m in matches)
        batches: list[int] = []
        for st in eng.stores:
            many = st.store.read_to_many

            async def spy(items: Any, fp: Any, many: Any = many) -> list[Any]:
                batches.append(len(items))
                return cast(list[Any], await many(items, fp))

            st.store.read_to_many = spy
        if split:
            for m in matches[1::2]:
                eng.cold.forget(up, m.entry)
        else:
            for i in (1, 4):
                flip_byte(_file_of_chunk(c, tmp_path / "upper", toks, i), -3)
        out = torch.full_like(kv, float("nan"))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks)
        assert torch.equal(out, kv)
        if split:
            assert sorted(batches) == [chunks // 2, chunks // 2]
            assert hit.tiers == {"upper": chunks // 2 * CH, "lower": chunks // 2 * CH}
        else:
            assert batches == [chunks]  # the two that missed: each read alone, from lower
            assert hit.tiers == {"upper": (chunks - 2) * CH, "lower": 2 * CH}
            assert (await c.stats())["tiers"]["upper"]["corrupt"] == 2


@pytest.mark.parametrize("batched", [True, False])
async def test_a_read_that_hangs_in_a_replaced_file_does_not_quarantine_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool) -> None:
    """The key is deleted and put again (new KV, a new file under the same name) while a read
    hangs in the old file: when that read times out, the key is not quarantined, since the
    file that hung is gone. A later get serves the new KV from disk."""
    async with _on_disk(tmp_path, 4, seed=13, codec="raw", timeout=1.0,
                        max_concurrency=2) as (c, _spec, toks, kv):
        store = _store(c)
        if not batched:
            monkeypatch.setattr(type(store), "reads_to_many", False)
        started, release, returned = hang_direct_reads(
            monkeypatch, under=_file_of_chunk(c, tmp_path, toks, 0).resolve())
        got: list[Any] = []

        async def racing_get() -> None:
            got.append(await c.get(toks, out=torch.zeros_like(kv)))

        kv2 = kv + 1000
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(racing_get)
                await until_set(started)
                await c.delete(toks)
                await c.put(toks, kv2)
                await on_disk_only(c)  # the new KV in new files, under the same names
            release.set()
            await until_set(returned)
        assert got[0].num_tokens == 0  # its first chunk's read hung
        assert store.stats()["quarantined"] == 0
        monkeypatch.undo()
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(out, kv2)


_BLOB = bytes(256 << 10)


_REAL_READ = disk_mod._read_file_to


def _reads_at_once(monkeypatch: pytest.MonkeyPatch, *, wait: float = 0.0,
                   spin: float = 0.0) -> dict[str, int]:
    """Count the reads of chunk files in progress at once (``most``) and in all (``reads``),
    each read taking ``wait`` seconds asleep (a disk) and ``spin`` seconds on a CPU first."""
    seen = {"now": 0, "most": 0, "reads": 0}
    lock = threading.Lock()
    real = _REAL_READ

    def counted(*a: Any, **kw: Any) -> Any:
        with lock:
            seen["now"] += 1
            seen["reads"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            # Work that lets go of the GIL, as a decode does, so that lanes share the CPUs
            # and not the interpreter.
            until = time.thread_time() + spin
            while time.thread_time() < until:
                hashlib.sha256(_BLOB)
            time.sleep(wait)
            return real(*a, **kw)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(disk_mod, "_read_file_to", counted)
    return seen


async def test_a_batch_of_reads_on_the_cpus_has_a_lane_per_cpu_and_one_that_waits_has_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From a warm page cache a read is a copy and a decode: lanes past the CPUs would only
    # take turns on them. Reads that wait on the disk want every lane: a batch whose reads
    # wait starts the others as its first lane ends a slice, and the next batch starts them
    # all; once reads stop waiting, batches go back to a lane per CPU.
    monkeypatch.setattr(devices, "usable_cpus", lambda: 1)
    monkeypatch.setattr(disk_mod, "_LANE_SLICE", 0.0)  # a slice is one read
    async with _on_disk(tmp_path, 8, seed=21, max_concurrency=4) as (c, _spec, toks, kv):
        store = _store(c)

        async def get(**cost: float) -> dict[str, int]:
            seen = _reads_at_once(monkeypatch, **cost)
            out = torch.zeros_like(kv)
            hit = await c.get(toks, out=out)
            assert hit.tiers == {"disk": len(toks)} and torch.equal(out, kv)
            await on_disk_only(c)
            return seen

        # Reads on a CPU (5 ms of spinning each): one lane, one read at a time.
        seen = await get(spin=0.005)
        assert seen["reads"] == 8 and seen["most"] == 1 and not store._reads_wait
        # Reads that sleep 30 ms on a "disk": the first lane's first read starts the others.
        seen = await get(wait=0.03)
        assert seen["reads"] == 8 and seen["most"] == 4 and store._reads_wait
        # The next batch starts every lane at once (even with reads that no longer wait), and
        # its reads, on the CPU, set the one after back to one lane.
        seen = await get(spin=0.005)
        assert seen["most"] > 1 and not store._reads_wait
        seen = await get(spin=0.005)
        assert seen["most"] == 1


def test_a_read_is_judged_by_the_blocks_it_read_or_the_share_of_its_time_on_a_cpu() -> None:
    lanes = disk_mod._BatchRead(None, [], None)  # its judging alone: no store needed
    assert not lanes.io_bound  # no read judged yet
    lanes.judge(0.010, 0.009, 0)  # on a CPU: warm
    lanes.judge(0.010, 0.009, 8)  # read 8 blocks from storage
    assert not lanes.io_bound  # one of two: not most
    lanes.judge(0.010, 0.001, 0)  # asleep for most of it (a network file system)
    assert lanes.io_bound and (lanes.judged, lanes.waited) == (3, 2)


async def test_every_lane_of_a_batch_is_handed_its_first_read_before_a_turn_of_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane started a loop turn after the others (anyio's ``to_thread`` passes through the
    loop twice before its thread starts) ends a batch of equal chunks that much later: every
    lane's first slice is on its thread before the loop runs anything else."""
    monkeypatch.setattr(devices, "usable_cpus", lambda: 64)
    async with _on_disk(tmp_path, 6, seed=31, max_concurrency=3) as (c, _spec, toks, kv):
        store = _store(c)
        submit = store._executor.submit
        turns = [0]
        at_submit: list[int] = []

        def spy(*a: Any) -> Any:
            at_submit.append(turns[0])
            return submit(*a)

        def turn() -> None:  # counts the loop's turns while the get runs
            turns[0] += 1
            if turns[0] < 1000:
                asyncio.get_running_loop().call_soon(turn)

        monkeypatch.setattr(store._executor, "submit", spy)
        asyncio.get_running_loop().call_soon(turn)
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.tiers == {"disk": len(toks)} and torch.equal(out, kv)
        # Three lanes, each handed its first (and, slices being long, only) read in the
        # same step of the get, before the loop turned.
        assert len(at_submit) == 3 and len(set(at_submit)) == 1, at_submit
        assert store._limiter.borrowed_tokens == 0


async def test_a_get_cancelled_while_its_lanes_wait_for_tokens_leaves_no_token_behind(
        tmp_path: Path) -> None:
    """Every thread token of the tier is held by other work: the batch's lanes wait for
    one. The get is cancelled meanwhile: its waits end, and neither a token nor a waiter of
    the batch is left in the tier's limiter."""
    async with _on_disk(tmp_path, 4, seed=12, timeout=5.0) as (c, _spec, toks, kv):
        store = _store(c)
        holders = [object() for _ in range(store.max_concurrency)]
        for h in holders:
            await store._limiter.acquire_on_behalf_of(h)
        try:
            with anyio.move_on_after(0.2) as scope:
                await c.get(toks, out=torch.zeros_like(kv))
            assert scope.cancelled_caught
            await asyncio.sleep(0.05)  # the cancelled waits end at the loop's next turns
            stats = store._limiter.statistics()
            assert stats.borrowed_tokens == len(holders) and stats.tasks_waiting == 0
        finally:
            for h in holders:
                store._limiter.release_on_behalf_of(h)
        assert store._limiter.borrowed_tokens == 0
        # The tier reads again: nothing of the cancelled batch is stuck.
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and torch.equal(out, kv)
