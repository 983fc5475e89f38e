"""A get reads a chunk that lives only on disk straight into its own tensor, with no top-tier
slot in between, and promotes it by a second read after the get has returned
(``CacheConfig.promotion = "background"``, the default). Speed is shown by ``musacache bench
scale --only disk``; these tests pin what must hold: the bytes, the counts, the promotion,
what a damaged or missing file does, and that nothing is written into the caller's tensor
that a read did not verify."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

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
    slow_and_backup_disks,
    small_spec,
    until_set,
)
from musacache import codec
from musacache._errors import ConfigError, CorruptChunkError
from musacache._keys import Fingerprint
from musacache.engine.tee import Tee

CH = 16


def _cfg(spec: mc.KVSpec, cold: Any, *, host_chunks: int = 8, **kw: Any) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "direct", chunk_size=CH, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(CH) * host_chunks), cold), **kw)


@contextlib.asynccontextmanager
async def _on_disk(tmp_path: Path, num_tokens: int, *, seed: int, codec: str = "raw",
                   timeout: float = 10.0, promotion: Literal["background", "sync"] = "background",
                   ) -> AsyncIterator[tuple[mc.Cache, mc.KVSpec, list[int], torch.Tensor]]:
    """A cache whose ``num_tokens`` put tokens (chunks of ``CH``) live on disk only."""
    spec = small_spec()
    toks = random_tokens(num_tokens, seed=seed)
    kv = prefix_kv(spec, toks)
    disk = mc.DiskTier(path=str(tmp_path), capacity_bytes="64MiB", codec=codec,
                       timeout=timeout)
    async with mc.Cache(_cfg(spec, disk, promotion=promotion)) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        yield c, spec, toks, kv


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvc"))


def _file_of_chunk(c: mc.Cache, root: Path, toks: list[int], i: int) -> Path:
    """The file that holds chunk ``i`` of ``toks``."""
    key = c._chain.keys(np.asarray(toks, dtype=np.int32))[i][3]
    hits = [p for p in _chunk_files(root) if p.name.startswith(key.hex())]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
@pytest.mark.parametrize("with_out", [True, False])
async def test_a_disk_get_reads_into_its_tensor_then_promotes_in_the_background(
        tmp_path: Path, codec_name: str, with_out: bool) -> None:
    async with _on_disk(tmp_path, 5 * CH, seed=0, codec=codec_name) as (c, _spec, toks, kv):
        out = torch.full_like(kv, float("nan")) if with_out else None
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(hit.kv, kv)
        if out is not None:
            assert torch.equal(out, kv)
        await c.flush()  # waits for the promotions: each a second read into a slot
        st = await c.stats()
        assert st["tiers"]["host"]["promotions"] == 5
        assert st["tiers"]["disk"]["hits"] == 5
        again = await c.get(toks)
        assert again.tiers == {"host": len(toks)} and torch.equal(again.kv, kv)


async def test_sync_promotion_keeps_the_read_through_the_slot(tmp_path: Path) -> None:
    async with _on_disk(tmp_path, 4 * CH, seed=1, promotion="sync") as (c, _spec, toks, kv):
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.tiers == {"disk": len(toks)} and torch.equal(out, kv)
        # resident when the get returns, with no flush
        host = (await c.stats())["tiers"]["host"]
        assert host["chunks"] == host["promotions"] == 4
        again = await c.get(toks)
        assert again.tiers == {"host": len(toks)} and torch.equal(again.kv, kv)


def test_promotion_setting_is_checked() -> None:
    spec = small_spec()
    with pytest.raises(ConfigError, match="promotion"):
        mc.CacheConfig(spec, "x", promotion="later")  # type: ignore[arg-type]
    env = {"MUSACACHE_NAMESPACE": "x", "MUSACACHE_SPEC__NUM_LAYERS": "2",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "2", "MUSACACHE_SPEC__HEAD_DIM": "8",
           "MUSACACHE_TIERS__0__KIND": "host", "MUSACACHE_TIERS__0__CAPACITY": "1MiB",
           "MUSACACHE_PROMOTION": "sync"}
    assert mc.CacheConfig.from_env(env).promotion == "sync"


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
async def test_a_damaged_chunk_ends_the_hit_and_out_past_it_is_left_as_it_was(
        tmp_path: Path, codec_name: str) -> None:
    async with _on_disk(tmp_path, 4 * CH, seed=2, codec=codec_name) as (c, spec, toks, kv):
        bad = _file_of_chunk(c, tmp_path, toks, 2)
        flip_byte(bad, -3)  # inside the last block's payload
        out = torch.full_like(kv, float("nan"))
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 2 * CH
        td = spec.token_dim
        assert torch.equal(out.narrow(td, 0, 2 * CH), kv.narrow(td, 0, 2 * CH))
        # Neither the damaged chunk nor the one after it wrote a byte of out.
        assert bool(torch.isnan(out.narrow(td, 2 * CH, 2 * CH)).all())
        await c.flush()
        st = await c.stats()
        assert st["tiers"]["disk"]["corrupt"] == 1


async def test_a_file_gone_behind_the_cache_is_a_counted_miss(tmp_path: Path) -> None:
    async with _on_disk(tmp_path, 3 * CH, seed=3, codec="raw") as (c, spec, toks, kv):
        _file_of_chunk(c, tmp_path, toks, 1).unlink()
        out = torch.zeros_like(kv)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == CH
        assert torch.equal(out.narrow(spec.token_dim, 0, CH), kv.narrow(spec.token_dim, 0, CH))
        await c.flush()
        assert (await c.stats())["tiers"]["disk"]["misses"] >= 1


async def test_a_chunk_deleted_before_its_background_promotion_is_not_promoted(
        tmp_path: Path) -> None:
    async with _on_disk(tmp_path, 2 * CH, seed=4) as (c, _spec, toks, kv):
        hit = await c.get(toks, out=torch.zeros_like(kv))
        assert hit.num_tokens == len(toks)
        await c.delete(toks)  # before the promotions ran: they must not bring it back
        await c.flush()
        assert (await c.lookup(toks)) == 0
        st = await c.stats()
        host = st["tiers"]["host"]
        assert st["chunks"] == 0 and host["chunks"] == 0 and host["bytes_used"] == 0
        assert host["promotions"] == 0


async def test_a_tensor_that_is_no_native_target_is_read_into_a_stage(tmp_path: Path) -> None:
    """A destination whose innermost dimension is strided has runs too short for the native
    copy: each chunk is read straight into a stage of the get's own (as into any ``out``),
    the move writes ``out`` from there, and the bytes are exact."""
    async with _on_disk(tmp_path, 3 * CH, seed=6) as (c, spec, toks, kv):
        base = torch.zeros(spec.shape(len(toks))[::-1])
        out = base.permute(*reversed(range(base.dim())))  # innermost stride is not 1
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and hit.tiers == {"disk": len(toks)}
        assert torch.equal(out, kv)


# -- the codec and native reads underneath -------------------------------------------------------


def _encoded_file(tmp_path: Path, codec_name: str, *, block_size: int,
                  tokens: int = 64) -> tuple[Path, Fingerprint, torch.Tensor, codec.ChunkMeta]:
    spec = mc.KVSpec(2, 4, 64, torch.bfloat16)
    fp = Fingerprint("direct", spec, tokens)
    data = torch.randn(spec.shape(tokens)).to(spec.dtype)
    meta = codec.ChunkMeta(b"k" * 32, b"p" * 32, tokens, spec.nbytes(tokens))
    obj = codec.encode_chunk(fp, meta, data, codec_name, block_size=block_size)
    path = tmp_path / f"chunk-{codec_name}.kvc"
    path.write_bytes(obj)
    return path, fp, data, meta


def _read_to(path: Path, fp: Fingerprint, dst: torch.Tensor,
             meta: codec.ChunkMeta | None = None, tee: Tee | None = None) -> Tee:
    tee = tee or Tee(dst)
    assert tee.native is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        codec.read_chunk_to(fp, fd, os.path.getsize(path), tee.native, expect=meta)
    finally:
        os.close(fd)
    return tee


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
@pytest.mark.parametrize("block_size", [4096, 1 << 20])
def test_read_chunk_to_writes_the_exact_bytes_into_a_strided_view(
        tmp_path: Path, codec_name: str, block_size: int) -> None:
    path, fp, data, meta = _encoded_file(tmp_path, codec_name, block_size=block_size)
    spec = fp.spec
    # the chunk as a slice of a larger tensor along tokens: runs of contiguous bytes
    big = torch.zeros(spec.shape(3 * 64), dtype=spec.dtype)
    dst = big.narrow(spec.token_dim, 64, 64)
    tee = _read_to(path, fp, dst, meta)
    assert tee.complete
    assert torch.equal(dst, data)
    assert not big.narrow(spec.token_dim, 0, 64).any()
    assert not big.narrow(spec.token_dim, 128, 64).any()


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
def test_read_chunk_to_copies_no_block_after_a_damaged_one(tmp_path: Path,
                                                           codec_name: str) -> None:
    path, fp, data, meta = _encoded_file(tmp_path, codec_name, block_size=4096)
    flip_byte(path, -2)  # the last block
    dst = torch.full(fp.spec.shape(64), float("nan"), dtype=fp.spec.dtype)
    with pytest.raises(CorruptChunkError):
        _read_to(path, fp, dst, meta)
    flat, want = dst.reshape(-1), data.reshape(-1)
    written = ~torch.isnan(flat)
    assert torch.equal(flat[written], want[written])
    assert not bool(written.all())


def test_read_chunk_to_checks_the_destination_size(tmp_path: Path) -> None:
    path, fp, _data, meta = _encoded_file(tmp_path, "raw", block_size=4096)
    small = torch.zeros(fp.spec.shape(32), dtype=fp.spec.dtype)
    with pytest.raises(mc.InvalidInputError, match="takes"):
        _read_to(path, fp, small, meta)
    assert not small.any()


@pytest.mark.parametrize("codec_name", ["raw", "lz4"])
def test_read_chunk_to_writes_nothing_once_the_tee_is_closed(tmp_path: Path,
                                                             codec_name: str) -> None:
    path, fp, _data, meta = _encoded_file(tmp_path, codec_name, block_size=4096)
    dst = torch.zeros(fp.spec.shape(64), dtype=fp.spec.dtype)
    tee = Tee(dst)
    tee.close()
    _read_to(path, fp, dst, meta, tee=tee)
    assert not dst.any()
    assert tee.native is not None and tee.native.written == 0 and not tee.complete


# -- reads that hang, time out or outlive their get ----------------------------------------------


async def test_a_timed_out_direct_read_writes_nothing_into_out_after_the_get(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, CH, seed=7, codec="raw", timeout=0.2) as (c, _spec, toks, kv):
        _started, release, returned = hang_direct_reads(monkeypatch)
        out = torch.zeros_like(kv)
        try:
            hit = await c.get(toks, out=out)
        finally:
            release.set()
        assert hit.num_tokens == 0  # the retry skips the tier whose read timed out
        await until_set(returned)
        assert not out.any()
        assert (await c.stats())["tiers"]["disk"]["timeouts"] == 1


async def test_a_cancelled_get_leaves_out_alone_after_its_direct_read_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _on_disk(tmp_path, 2 * CH, seed=8, codec="lz4") as (c, _spec, toks, kv):
        started, release, returned = hang_direct_reads(monkeypatch)
        out = torch.zeros_like(kv)
        with anyio.move_on_after(0.3) as scope:
            await c.get(toks, out=out)
        assert scope.cancelled_caught and started.is_set()
        release.set()
        await until_set(returned)
        await c.flush()
        assert not out.any()
        monkeypatch.undo()
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 2 * CH and torch.equal(out, kv)


async def test_a_slow_tier_times_out_and_the_next_one_serves_through_the_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first disk's direct read times out; the chunk comes from the second disk by the
    promoting read, and the move copies it. The first read's thread, released meanwhile,
    writes nothing into the caller's tensor: its tee was closed when its read timed out."""
    spec = small_spec()
    toks = random_tokens(CH, seed=9)
    kv = prefix_kv(spec, toks)
    d1 = tmp_path / "d1"
    cfg = slow_and_backup_disks(spec, tmp_path, CH)
    async with mc.Cache(cfg) as c:
        await c.put(toks, kv)
        await on_disk_only(c)
        _started, release, returned = hang_direct_reads(monkeypatch, under=d1.resolve())
        out = torch.zeros_like(kv)
        try:
            hit = await c.get(toks, out=out)
        finally:
            release.set()
        assert hit.num_tokens == CH and hit.tiers == {"backup": CH}
        assert torch.equal(out, kv)
        await until_set(returned)
        out.zero_()
        await anyio.sleep(0.05)
        assert not out.any()


@pytest.mark.parametrize("runs", [1, 16, 300])
def test_a_tee_over_many_or_few_runs_writes_exactly_its_view(runs: int) -> None:
    """A tee's runs are worked out with plain ints up to a few hundred and with numpy above:
    both must give every run of the view, and only those."""
    big = torch.zeros(runs, 3, 32, dtype=torch.float32)  # a run: 32 floats, 128 bytes
    dst = big[:, 1]  # one run of 128 bytes in every 384
    tee = Tee(dst)
    assert tee.native is not None and tee.native.nbytes == dst.numel() * 4
    src = torch.arange(dst.numel(), dtype=torch.float32).reshape(dst.shape) + 1
    tee.native.copy(src.reshape(-1).numpy().view(np.uint8), 0)
    assert tee.complete and torch.equal(dst, src)
    assert not big[:, 0].any() and not big[:, 2].any()


@pytest.mark.parametrize("rows", [4, 300])
def test_a_tee_over_overlapping_or_repeated_runs_has_no_native_copy(rows: int) -> None:
    base = torch.zeros(16 * rows + 32)
    assert Tee(base.as_strided((rows, 32), (16, 1))).native is None  # rows overlap
    assert Tee(torch.zeros(1, 32).expand(rows, 32)).native is None  # all the same row


def test_native_reads_into_runs_refuse_bad_arguments_before_writing(tmp_path: Path) -> None:
    """The native reads without a slot check their buffers first: nothing is read or
    written for a scratch smaller than a block, a table of the wrong size, or a
    tagged decode given neither a destination nor a copy."""
    from musacache import _native

    path, fp, _data, _meta = _encoded_file(tmp_path, "raw", block_size=4096)
    raw = path.read_bytes()
    hdr = codec.read_header(raw[: codec.HEADER_SIZE])
    table = raw[codec.HEADER_SIZE : codec.HEADER_SIZE + hdr.table_len]
    dst = torch.zeros(fp.spec.shape(64), dtype=fp.spec.dtype)
    tee = Tee(dst)
    assert tee.native is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(mc.InvalidInputError, match="scratch"):
            _native.raw_read_runs(fd, codec.HEADER_SIZE + hdr.table_len, table,
                                  num_blocks=hdr.num_blocks, block_size=hdr.block_size,
                                  raw_len=hdr.raw_len, scratch=bytearray(100), copy=tee.native)
        with pytest.raises(mc.InvalidInputError, match="table"):
            _native.raw_read_runs(fd, codec.HEADER_SIZE + hdr.table_len, table[:-8],
                                  num_blocks=hdr.num_blocks, block_size=hdr.block_size,
                                  raw_len=hdr.raw_len, scratch=bytearray(4096),
                                  copy=tee.native)
    finally:
        os.close(fd)
    with pytest.raises(mc.InvalidInputError, match="out or copy"):
        _native.tagged_decode(bytearray(16), b"", num_blocks=0, block_size=4096, raw_len=0,
                              itemsize=2, scratch=bytearray(16), out=None)
    assert not dst.any() and tee.native.written == 0
