"""The native chunk decode: our LZ4 block decoder against lz4.block and against malformed input,
the tagged decode that reads, checks, unshuffles and copies a chunk in one call, and the
closable copy into the caller's tensor (ChunkCopy)."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import lz4.block
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import musacache as mc
from musacache import _native, codec
from musacache._errors import CorruptChunkError
from musacache._keys import Fingerprint
from musacache._spec import KVSpec
from musacache.engine.tee import Tee
from musacache.tiers.base import ChunkMeta

GUARD = 64  # canary bytes on each side of a decode's destination


def _guarded(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A destination of n bytes inside a buffer whose guard bytes must stay 0xA5."""
    buf = np.full(n + 2 * GUARD, 0xA5, dtype=np.uint8)
    return buf, buf[GUARD : GUARD + n]


def _guards_intact(buf: np.ndarray) -> bool:
    return bool((buf[:GUARD] == 0xA5).all() and (buf[-GUARD:] == 0xA5).all())


# Data lz4 finds matches in (repeats, runs, short offsets) as well as noise.
_payloads = st.one_of(
    st.binary(max_size=3000),
    st.builds(lambda unit, reps, tail: unit * reps + tail,
              st.binary(min_size=1, max_size=40), st.integers(1, 300), st.binary(max_size=50)),
    st.builds(lambda b, n: bytes([b]) * n, st.integers(0, 255), st.integers(0, 70000)),
)


@settings(max_examples=300, deadline=None)
@given(data=_payloads)
def test_lz4_decode_agrees_with_lz4_block(data: bytes) -> None:
    for mode in ("default", "high_compression"):
        block = lz4.block.compress(data, mode=mode, store_size=False)
        buf, out = _guarded(len(data))
        _native.lz4_decode(block, out)
        assert out.tobytes() == data
        assert _guards_intact(buf)


@settings(max_examples=300, deadline=None)
@given(data=_payloads, cut=st.integers(0, 1 << 30), flips=st.lists(
    st.tuples(st.integers(0, 1 << 30), st.integers(1, 255)), max_size=4),
    size_delta=st.integers(-20, 20))
def test_lz4_decode_of_damaged_input_raises_or_fills_exactly_never_writes_outside(
        data: bytes, cut: int, flips: list[tuple[int, int]], size_delta: int) -> None:
    block = bytearray(lz4.block.compress(data, store_size=False))
    for at, x in flips:
        block[at % len(block)] ^= x
    block = block[: cut % (len(block) + 1)]
    size = max(0, len(data) + size_delta)
    buf, out = _guarded(size)
    try:
        _native.lz4_decode(bytes(block), out)
    except CorruptChunkError:
        pass
    else:
        # Accepted: then lz4's own decoder, when it accepts the block at this size, agrees.
        try:
            want = lz4.block.decompress(bytes(block), uncompressed_size=size)
        except lz4.block.LZ4BlockError:
            want = None
        if want is not None and len(want) == size:
            assert out.tobytes() == want
    assert _guards_intact(buf)


@settings(max_examples=300, deadline=None)
@given(block=st.binary(max_size=400), size=st.integers(0, 2000))
def test_lz4_decode_of_random_bytes_never_writes_outside(block: bytes, size: int) -> None:
    buf, out = _guarded(size)
    try:
        _native.lz4_decode(block, out)
    except CorruptChunkError:
        pass
    assert _guards_intact(buf)


@pytest.mark.parametrize(("block", "size"), [
    (b"", 0),                       # no token at all
    (b"\x10", 1),                   # one literal promised, none there
    (b"\x00\x01\x00", 4),           # a match before any output (offset 1 > 0 written)
    (b"\x10a\x00\x00", 5),          # offset 0
    (b"\x10a\x01\x00", 4),          # the match runs past the destination
    (b"\xf0\xff", 300),             # a literal length that never ends
    (b"\x20ab", 1),                 # more literals than the destination holds
    (b"\x10a", 2),                  # ends short of the destination
])
def test_lz4_decode_rejects_malformed_blocks(block: bytes, size: int) -> None:
    buf, out = _guarded(size)
    with pytest.raises(CorruptChunkError):
        _native.lz4_decode(block, out)
    assert _guards_intact(buf)


def test_lz4_decode_copies_overlapping_matches() -> None:
    # Offsets 1, 2, 3 and 17 with long matches: run-length repeats and the 16-byte path.
    for unit in (b"a", b"ab", b"abc", bytes(range(17))):
        data = unit * 500 + b"end-of-block"
        block = lz4.block.compress(data, store_size=False)
        out = bytearray(len(data))
        _native.lz4_decode(block, out)
        assert bytes(out) == data


# -- tagged chunks -------------------------------------------------------------------------


def _key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def _chunk(spec: KVSpec, tokens: int, *, block_size: int = 4096, seed: int = 0,
           ) -> tuple[Fingerprint, ChunkMeta, torch.Tensor, bytes]:
    fp = Fingerprint("native-decode", spec, tokens)
    meta = ChunkMeta(key=_key("k"), parent=_key("p"), num_tokens=tokens,
                     raw_bytes=spec.nbytes(tokens))
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(spec.shape(tokens), generator=g).to(spec.dtype)
    obj = codec.encode_chunk(fp, meta, data, "lz4", block_size=block_size)
    return fp, meta, data, obj


def _file(tmp_path: Path, obj: bytes) -> int:
    path = tmp_path / "chunk.kvc"
    path.write_bytes(obj)
    return os.open(path, os.O_RDONLY)


def _methods(obj: bytes) -> list[int]:
    hdr = codec.read_header(obj)
    _entries, offsets = codec._block_layout(
        hdr, obj[codec.HEADER_SIZE : codec.HEADER_SIZE + hdr.table_len])
    return [obj[offsets[i]] for i in range(hdr.num_blocks)]


@pytest.mark.parametrize(("spec", "tokens", "block_size"), [
    (KVSpec(2, 2, 16, torch.bfloat16), 37, 4096),    # planes that do not start on a block
    (KVSpec(2, 2, 16, torch.float32), 64, 1000),     # four planes, odd block size
    (KVSpec(2, 8, 128, torch.bfloat16), 256, 1 << 20),  # 2 MiB: the streaming-store path
])
def test_read_chunk_into_writes_the_slot_and_the_callers_view_in_one_call(
        tmp_path: Path, spec: KVSpec, tokens: int, block_size: int) -> None:
    fp, meta, data, obj = _chunk(spec, tokens, block_size=block_size)
    assert {0, 2} <= set(_methods(obj))  # raw mantissa planes, nibble-coded exponents
    # The caller's tensor is a strided view (a chunk of a longer out): runs, not one block.
    big = torch.zeros(spec.shape(3 * tokens), dtype=spec.dtype)
    view = big.narrow(spec.token_dim, tokens, tokens)
    tee = Tee(view)
    sink = tee.target(torch.empty(0))
    assert sink.native_copy is not None  # type: ignore[attr-defined]
    called: list[tuple[int, int]] = []

    def on_block(start: int, end: int) -> None:
        called.append((start, end))

    on_block.native_copy = sink.native_copy  # type: ignore[attr-defined]
    slot = torch.empty_like(data)
    fd = _file(tmp_path, obj)
    try:
        codec.read_chunk_into(fp, fd, len(obj), slot, expect=meta, on_block=on_block)
    finally:
        os.close(fd)
    assert called == []  # the native decode wrote the view itself
    assert tee.complete
    assert torch.equal(slot.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(view.view(torch.uint8), data.view(torch.uint8))
    rest = torch.cat([big.narrow(spec.token_dim, 0, tokens),
                      big.narrow(spec.token_dim, 2 * tokens, tokens)])
    assert not rest.view(torch.uint8).any()


def test_a_damaged_block_read_from_a_file_never_reaches_the_callers_view(tmp_path: Path) -> None:
    spec = KVSpec(2, 2, 16, torch.bfloat16)
    fp, meta, data, obj = _chunk(spec, 64, block_size=1024)
    hdr = codec.read_header(obj)
    _entries, offsets = codec._block_layout(
        hdr, obj[codec.HEADER_SIZE : codec.HEADER_SIZE + hdr.table_len])
    for bad in range(hdr.num_blocks):
        damaged = bytearray(obj)
        damaged[(offsets[bad] + offsets[bad + 1]) // 2] ^= 0x10
        sentinel = 0x5A
        view = torch.full(data.shape, 0, dtype=spec.dtype)
        view.view(torch.uint8).fill_(sentinel)
        tee = Tee(view)
        fd = _file(tmp_path, bytes(damaged))
        try:
            with pytest.raises(CorruptChunkError, match=f"block {bad}"):
                codec.read_chunk_into(fp, fd, len(obj), torch.empty_like(data), expect=meta,
                                      on_block=tee.target(torch.empty(0)))
        finally:
            os.close(fd)
        got, want = view.view(torch.uint8), data.view(torch.uint8)
        # Whatever was written came from verified blocks: the data's own bytes.
        assert bool(((got == sentinel) | (got == want)).all()), bad
        assert not tee.complete


def test_decode_chunk_leaves_out_untouched_when_a_late_block_is_bad() -> None:
    spec = KVSpec(2, 2, 16, torch.bfloat16)
    fp, meta, data, obj = _chunk(spec, 64, block_size=1024)
    damaged = bytearray(obj)
    damaged[-3] ^= 1  # the last block
    out = torch.zeros_like(data)
    with pytest.raises(CorruptChunkError, match="checksum"):
        codec.decode_chunk(fp, bytes(damaged), expect=meta, out=out)
    assert not out.view(torch.uint8).any()


def test_a_closed_chunk_copy_writes_nothing() -> None:
    dst = torch.zeros(4, 64, dtype=torch.float32)
    tee = Tee(dst)
    copy = tee.target(torch.empty(0)).native_copy  # type: ignore[attr-defined]
    assert copy is not None
    src = np.arange(4 * 64, dtype=np.float32)
    copy.copy(src[:64], 0)
    assert copy.written == 256 and torch.equal(dst[0], torch.arange(64, dtype=torch.float32))
    tee.close()
    copy.copy(src[64:], 256)
    assert copy.closed and copy.written == 256 and not dst[1:].any()
    assert not tee.complete


def test_chunk_copy_runs_follow_the_views_strides() -> None:
    # A permuted cache (HuggingFace's heads-before-tokens): runs of one head_dim row each.
    base = torch.zeros(2, 2, 3, 5, 32, dtype=torch.bfloat16)  # (L, 2, H, T, D)
    view = base.permute(0, 1, 3, 2, 4)  # logical (L, 2, T, H, D)
    tee = Tee(view)
    copy = tee.target(torch.empty(0)).native_copy  # type: ignore[attr-defined]
    assert copy is not None
    src = torch.randn(view.shape).to(torch.bfloat16)
    copy.copy(src.contiguous().view(torch.uint8).numpy().reshape(-1), 0)
    assert tee.complete and torch.equal(view, src)
    # An innermost dimension that is not contiguous has runs of one element: no native copy.
    assert Tee(base.transpose(3, 4)).target(torch.empty(0)).native_copy is None  # type: ignore[attr-defined]


def test_a_raw_chunk_is_read_checked_and_copied_on_in_one_native_call(tmp_path: Path) -> None:
    spec = KVSpec(2, 2, 32, torch.bfloat16)
    fp = Fingerprint("native-decode", spec, 64)
    meta = ChunkMeta(key=_key("k"), parent=_key("p"), num_tokens=64,
                     raw_bytes=spec.nbytes(64))
    data = torch.randn(spec.shape(64)).to(spec.dtype)
    obj = codec.encode_chunk(fp, meta, data, "raw", block_size=4096)
    payload_at = len(obj) - meta.raw_bytes
    for bad in (None, 0, 2):
        damaged = bytearray(obj)
        if bad is not None:
            damaged[payload_at + bad * 4096 + 7] ^= 0x40
        view = torch.empty_like(data)
        view.view(torch.uint8).fill_(0x5A)
        tee = Tee(view)
        fd = _file(tmp_path, bytes(damaged))
        try:
            if bad is None:
                codec.read_chunk_into(fp, fd, len(obj), torch.empty_like(data), expect=meta,
                                      on_block=tee.target(torch.empty(0)))
            else:
                with pytest.raises(CorruptChunkError, match=f"block {bad}"):
                    codec.read_chunk_into(fp, fd, len(obj), torch.empty_like(data),
                                          expect=meta, on_block=tee.target(torch.empty(0)))
        finally:
            os.close(fd)
        got, want = view.view(torch.uint8).reshape(-1), data.view(torch.uint8).reshape(-1)
        if bad is None:
            assert tee.complete and torch.equal(got, want)
        else:
            # The blocks before the bad one were copied on, nothing from it or after it.
            assert torch.equal(got[: bad * 4096], want[: bad * 4096])
            assert bool((got[bad * 4096 :] == 0x5A).all()) and not tee.complete


def test_a_failed_block_read_is_an_oserror_with_its_errno(tmp_path: Path) -> None:
    spec = KVSpec(2, 2, 16, torch.bfloat16)
    _fp, _meta, _data, obj = _chunk(spec, 64, block_size=1024)
    hdr = codec.read_header(obj)
    table = obj[codec.HEADER_SIZE : codec.HEADER_SIZE + hdr.table_len]
    dirfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # pread fails: EISDIR
    try:
        with pytest.raises(OSError) as info:
            _native.tagged_read(dirfd, 0, table, payload_len=hdr.payload_len,
                                num_blocks=hdr.num_blocks, block_size=hdr.block_size,
                                raw_len=hdr.raw_len, itemsize=hdr.itemsize,
                                ring=bytearray(hdr.raw_len + 4096), out=bytearray(hdr.raw_len))
        assert info.value.errno == errno.EISDIR
    finally:
        os.close(dirfd)


# -- the ring a file read goes through ----------------------------------------------------------


def _tagged_payload(data: bytes, itemsize: int, block_size: int, tags: list[int],
                    ) -> tuple[bytes, bytes]:
    """A tagged payload of ``data`` built here, independently of the encoder: planes (byte j of
    each whole element), then the bytes past the last whole element, cut into blocks each
    stored raw or coded as ``tags`` asks (0 raw, 1 lz4, 2 nibble; a coding that does not
    make the block smaller falls back to raw), and its table."""
    n = len(data) // itemsize
    whole = np.frombuffer(data[: n * itemsize], dtype=np.uint8).reshape(n, itemsize)
    shuffled = whole.T.tobytes() + data[n * itemsize :]
    payload, table = bytearray(), bytearray()
    for b, start in enumerate(range(0, len(shuffled), block_size)):
        raw = shuffled[start : start + block_size]
        stored = b"\0" + raw
        tag = tags[b % len(tags)]
        if tag == 1:
            coded = lz4.block.compress(raw, store_size=False)
            if len(coded) < len(raw):
                stored = b"\1" + coded
        elif tag == 2 and len(raw) <= _native.NIB_MAX_BYTES:
            out = bytearray(len(raw))
            size = _native.nib_encode(raw, out)
            if size is not None:
                stored = b"\2" + bytes(out[:size])
        payload += stored
        table += codec._BLOCK_ENTRY.pack(len(stored), _native.crc32c(stored))
    return bytes(payload), bytes(table)


# Data whose blocks code in every way: runs and repeats (lz4), small bytes (nibble), noise.
_chunk_bytes = st.builds(
    lambda parts: b"".join(parts),
    st.lists(st.one_of(st.binary(max_size=700),
                       st.builds(lambda b, n: bytes([b]) * n, st.integers(0, 255),
                                 st.integers(1, 900)),
                       st.builds(lambda xs: bytes(x & 15 for x in xs), st.binary(max_size=800))),
             min_size=1, max_size=8))


@settings(max_examples=250, deadline=None)
@given(data=_chunk_bytes, itemsize=st.sampled_from([1, 2, 3, 4, 8, 16]),
       block_size=st.integers(16, 700), tags=st.lists(st.integers(0, 2), min_size=1,
                                                      max_size=5),
       bad=st.one_of(st.none(), st.integers(0, 1 << 20)), with_copy=st.booleans())
def test_a_read_through_the_ring_gives_what_a_decode_from_memory_gives(
        tmp_path_factory: pytest.TempPathFactory, data: bytes, itemsize: int, block_size: int,
        tags: list[int], bad: int | None, with_copy: bool) -> None:
    """The file read reuses a ring of itemsize + 1 block slots, so with many blocks every slot
    is taken over again and again, and a block holding the end of one plane and the start of
    the next is read twice. Whatever the geometry, it must give the bytes of the decode from
    memory (every block held at once), write nothing outside out and the ring, and on a
    damaged block raise naming it, with only verified bytes written before."""
    payload, table = _tagged_payload(data, itemsize, block_size, tags)
    num_blocks = len(table) // 8
    geometry = {"num_blocks": num_blocks, "block_size": block_size, "raw_len": len(data),
                "itemsize": itemsize}
    mem_buf, mem_out = _guarded(len(data))
    _native.tagged_decode(payload, table, **geometry, scratch=bytearray(len(data)),
                          out=mem_out)
    assert mem_out.tobytes() == data and _guards_intact(mem_buf)
    damaged = bytearray(payload)
    bad_block = None
    if bad is not None and num_blocks:
        bad_block = bad % num_blocks
        start = sum(int.from_bytes(table[8 * i : 8 * i + 4], "little") for i in range(bad_block))
        damaged[start + bad % int.from_bytes(table[8 * bad_block : 8 * bad_block + 4],
                                               "little")] ^= 0x20
    lead = b"header bytes before the payload"
    path = tmp_path_factory.mktemp("ring") / "chunk"
    path.write_bytes(lead + bytes(damaged))
    ring_len = _native.tagged_ring_bytes(num_blocks=num_blocks, block_size=block_size,
                                         itemsize=itemsize)
    assert ring_len <= (itemsize + 1) * (2 * block_size + 128)
    ring_buf, ring = _guarded(ring_len)
    out_buf, out = _guarded(len(data))
    out[:] = 0x5A
    copy_buf, copy_dst = _guarded(len(data))
    copy_dst[:] = 0x5A
    copy = None
    if with_copy and data:
        copy = _native.ChunkCopy(np.array([copy_dst.ctypes.data], dtype=np.uint64), len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        if bad_block is None:
            _native.tagged_read(fd, len(lead), table, payload_len=len(payload), **geometry,
                                ring=ring, out=out, copy=copy)
        else:
            with pytest.raises(CorruptChunkError, match=f"block {bad_block}"):
                _native.tagged_read(fd, len(lead), table, payload_len=len(payload),
                                    **geometry, ring=ring, out=out, copy=copy)
    finally:
        os.close(fd)
    assert _guards_intact(ring_buf) and _guards_intact(out_buf) and _guards_intact(copy_buf)
    want = np.frombuffer(data, dtype=np.uint8)
    for got in [out] + ([copy_dst] if copy is not None else []):
        if bad_block is None:
            assert got.tobytes() == data
        else:
            # Written strips came from verified blocks only: the data's own bytes.
            assert bool(((got == 0x5A) | (got == want)).all())
    if copy is not None:
        assert (copy.written == len(data)) == (bad_block is None)


def test_the_ring_is_a_few_blocks_whatever_the_chunk() -> None:
    mib = 1 << 20
    for itemsize in (1, 2, 4):
        ring = _native.tagged_ring_bytes(num_blocks=32, block_size=mib, itemsize=itemsize)
        assert ring == (itemsize + 1) * (mib + 64 + mib)
    # No more slots than blocks: a one-block chunk needs one.
    assert _native.tagged_ring_bytes(num_blocks=1, block_size=mib, itemsize=4) == 2 * mib + 64
    with pytest.raises(mc.InvalidInputError):
        _native.tagged_ring_bytes(num_blocks=1, block_size=0, itemsize=2)


def test_a_ring_too_small_or_a_payload_too_long_for_its_slot_is_refused(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    payload, table = _tagged_payload(data, 2, 1000, [0])
    geometry = {"num_blocks": len(table) // 8, "block_size": 1000, "raw_len": len(data),
                "itemsize": 2}
    fd = _file(tmp_path, payload)
    try:
        need = _native.tagged_ring_bytes(num_blocks=len(table) // 8, block_size=1000,
                                         itemsize=2)
        out = bytearray(len(data))
        with pytest.raises(mc.InvalidInputError, match="ring"):
            _native.tagged_read(fd, 0, table, payload_len=len(payload), **geometry,
                                ring=bytearray(need - 1), out=out)
        assert not any(out)
        # The ring inside out, a table of another length, an out of another length, neither
        # out nor copy: each refused before a byte is read or written.
        both = np.zeros(need + len(data), dtype=np.uint8)
        with pytest.raises(mc.InvalidInputError, match="must not overlap"):
            _native.tagged_read(fd, 0, table, payload_len=len(payload), **geometry,
                                ring=both[:need], out=both[need // 2 : need // 2 + len(data)])
        assert not both.any()
        for bad_table, bad_out, match in ((table[:-8], out, "table holds"),
                                          (table, bytearray(len(data) - 1), "out holds"),
                                          (table, None, "out or copy")):
            with pytest.raises(mc.InvalidInputError, match=match):
                _native.tagged_read(fd, 0, bad_table, payload_len=len(payload), **geometry,
                                    ring=bytearray(need), out=bad_out)
            assert bad_out is None or not any(bad_out)
        # A table whose first block claims more than a block and its tag (the lengths still
        # add up: the second claims only its tag): corrupt, and nothing read into the ring.
        long_table = bytearray(table)
        first = int.from_bytes(table[:4], "little") + int.from_bytes(table[8:12], "little") - 1
        long_table[:4] = first.to_bytes(4, "little")
        long_table[8:12] = (1).to_bytes(4, "little")
        with pytest.raises(CorruptChunkError):
            _native.tagged_read(fd, 0, bytes(long_table), payload_len=len(payload),
                                **geometry, ring=bytearray(need), out=out)
        assert not any(out)
    finally:
        os.close(fd)
