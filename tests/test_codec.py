"""The chunk object format: round trips, ratio, and every kind of damage is caught."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import lz4.block
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from musacache import _native
from musacache import codec as codec_mod
from musacache._errors import (
    CorruptChunkError,
    DTypeError,
    FingerprintMismatchError,
    ForeignFormatError,
    InvalidInputError,
    ShapeError,
)
from musacache._keys import FORMAT_VERSION, Fingerprint
from musacache._spec import KVSpec
from musacache.codec import (
    _BLOCK_ENTRY,
    CODECS,
    HEADER_MAX_BYTES,
    HEADER_SIZE,
    decode_chunk,
    encode_chunk,
    read_chunk_into,
    read_header,
)
from musacache.tiers.base import ChunkMeta

SMALL_BLOCK = 4096  # several blocks even for small test chunks


def _key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def _meta(spec: KVSpec, tokens: int, tag: str = "k") -> ChunkMeta:
    return ChunkMeta(key=_key(tag), parent=_key(tag + "-parent"), num_tokens=tokens,
                     raw_bytes=spec.nbytes(tokens))


def _data(spec: KVSpec, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.shape(tokens), generator=g, dtype=torch.float32)
    if spec.dtype in (torch.uint8, torch.int8):
        return (x * 40).to(spec.dtype)
    return x.to(spec.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, works for fp8)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


SPECS = [
    KVSpec(2, 2, 64, torch.bfloat16),
    KVSpec(3, 1, 32, torch.float16),
    KVSpec(2, 2, 16, torch.float32),
    KVSpec(2, 4, 32, torch.float8_e4m3fn),
    KVSpec(2, 1, 96, torch.bfloat16, mla=True),
]


@pytest.fixture
def fp() -> Fingerprint:
    return Fingerprint("model-a", KVSpec(2, 2, 64, torch.bfloat16), 32)


@pytest.fixture
def encoded(fp: Fingerprint) -> tuple[ChunkMeta, torch.Tensor, bytes]:
    meta = _meta(fp.spec, 32)
    data = _data(fp.spec, 32)
    return meta, data, encode_chunk(fp, meta, data, "lz4", block_size=SMALL_BLOCK)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "_"))
@pytest.mark.parametrize("tokens", [32, 7, 1])
def test_round_trip(spec: KVSpec, codec: str, tokens: int) -> None:
    fp = Fingerprint("ns", spec, 32)
    meta = _meta(spec, tokens)
    data = _data(spec, tokens)
    obj = encode_chunk(fp, meta, data, codec, block_size=SMALL_BLOCK)
    got_meta, got = decode_chunk(fp, obj, expect=meta)
    assert _same(got, data)
    assert got_meta.key == meta.key and got_meta.parent == meta.parent
    assert got_meta.num_tokens == tokens
    assert got_meta.raw_bytes == spec.nbytes(tokens)
    assert got_meta.stored_bytes == len(obj)
    hdr = read_header(obj)
    assert hdr.codec == codec and hdr.object_len == len(obj)


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_into_out_with_threads(fp: Fingerprint, codec: str) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32, seed=3)
    obj = encode_chunk(fp, meta, data, codec, threads=3, block_size=SMALL_BLOCK)
    assert obj == encode_chunk(fp, meta, data, codec, threads=1, block_size=SMALL_BLOCK)
    out = torch.zeros_like(data)
    _, got = decode_chunk(fp, obj, out=out, threads=3)
    assert got.data_ptr() == out.data_ptr()
    assert _same(out, data)


def test_non_contiguous_input_is_accepted(fp: Fingerprint) -> None:
    spec = fp.spec
    # A (L, T, 2, H, D) buffer permuted to (L, 2, T, H, D), as a HuggingFace cache view is.
    base = _data(KVSpec(2, 2, 64, torch.bfloat16), 32).permute(0, 2, 1, 3, 4).contiguous()
    view = base.permute(0, 2, 1, 3, 4)
    assert not view.is_contiguous()
    obj = encode_chunk(fp, _meta(spec, 32), view)
    assert _same(decode_chunk(fp, obj)[1], view.contiguous())


def test_shuffle_lz4_ratio_on_gaussian_bf16() -> None:
    # The format's promise: shuffled lz4 makes Gaussian bf16 at least 15% smaller, where
    # plain lz4 gains nothing. (The raw codec bounds the plain case: it never grows by more
    # than the header and table.)
    spec = KVSpec(4, 8, 128, torch.bfloat16)
    fp = Fingerprint("ratio", spec, 256)
    meta, data = _meta(spec, 256), _data(spec, 256, seed=7)
    lz4_obj = encode_chunk(fp, meta, data, "lz4")
    raw_obj = encode_chunk(fp, meta, data, "raw")
    assert spec.nbytes(256) / len(lz4_obj) >= 1.15
    assert len(raw_obj) - spec.nbytes(256) < HEADER_SIZE + 64


def test_incompressible_blocks_are_stored_raw(fp: Fingerprint) -> None:
    meta = _meta(fp.spec, 32)
    noise = torch.randint(0, 256, (fp.spec.nbytes(32),), dtype=torch.uint8)
    data = noise.view(torch.bfloat16).reshape(fp.spec.shape(32))
    obj = encode_chunk(fp, meta, data, "lz4", block_size=SMALL_BLOCK)
    hdr = read_header(obj)
    # No block shrank and none grew by more than its one-byte method tag.
    assert hdr.payload_len == hdr.raw_len + hdr.num_blocks
    assert _same(decode_chunk(fp, obj)[1], data)


def test_read_header_needs_only_the_header(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                          fp: Fingerprint) -> None:
    meta, _, obj = encoded
    assert HEADER_MAX_BYTES == HEADER_SIZE
    hdr = read_header(obj[:HEADER_MAX_BYTES])
    assert (hdr.key, hdr.parent, hdr.num_tokens) == (meta.key, meta.parent, 32)
    assert hdr.format_version == FORMAT_VERSION
    assert hdr.fingerprint_digest == fp.digest()
    assert hdr.namespace == "model-a" and not hdr.namespace_truncated
    assert (hdr.num_layers, hdr.num_kv_heads, hdr.head_dim, hdr.dtype, hdr.mla) == (
        2, 2, 64, "bfloat16", False)
    assert hdr.matches(fp)
    assert hdr.meta(last_used=5.0) == ChunkMeta(meta.key, meta.parent, 32, meta.raw_bytes,
                                                stored_bytes=len(obj), last_used=5.0)


# -- damage ------------------------------------------------------------------------------------


def _flip(obj: bytes, offset: int) -> bytes:
    b = bytearray(obj)
    b[offset] ^= 0x5A
    return bytes(b)


def test_every_header_byte_is_checked(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                      fp: Fingerprint) -> None:
    _, _, obj = encoded
    for offset in range(HEADER_SIZE):
        damaged = _flip(obj, offset)
        with pytest.raises(CorruptChunkError):
            read_header(damaged)
        with pytest.raises(CorruptChunkError):
            decode_chunk(fp, damaged)


def test_flipped_block_table_byte(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                  fp: Fingerprint) -> None:
    _, _, obj = encoded
    hdr = read_header(obj)
    assert hdr.num_blocks > 1
    for offset in range(HEADER_SIZE, HEADER_SIZE + hdr.table_len):
        with pytest.raises(CorruptChunkError):
            decode_chunk(fp, _flip(obj, offset))


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_payload_byte(fp: Fingerprint, codec: str) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    obj = encode_chunk(fp, meta, data, codec, block_size=SMALL_BLOCK)
    start = HEADER_SIZE + read_header(obj).table_len
    for offset in range(start, len(obj), max(1, (len(obj) - start) // 97)):
        out = torch.zeros_like(data)
        with pytest.raises(CorruptChunkError, match="checksum"):
            decode_chunk(fp, _flip(obj, offset), out=out)
        # A damaged object never leaves half a chunk in the caller's buffer.
        assert not out.view(torch.uint8).any()
    with pytest.raises(CorruptChunkError):
        decode_chunk(fp, _flip(obj, len(obj) - 1))


def test_truncation_at_many_offsets(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                    fp: Fingerprint) -> None:
    _, _, obj = encoded
    hdr = read_header(obj)
    cuts = {0, 1, 4, 12, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1,
            HEADER_SIZE + hdr.table_len, len(obj) - 1, len(obj) // 2}
    cuts |= set(range(HEADER_SIZE, len(obj), 211))
    for cut in sorted(cuts):
        with pytest.raises(CorruptChunkError):
            decode_chunk(fp, obj[:cut])
    with pytest.raises(CorruptChunkError, match="trailing"):
        decode_chunk(fp, obj + b"\0")


def test_wrong_key_parent_or_tokens(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                    fp: Fingerprint) -> None:
    meta, _, obj = encoded
    for other in (ChunkMeta(_key("other"), meta.parent, 32, meta.raw_bytes),
                  ChunkMeta(meta.key, _key("other"), 32, meta.raw_bytes),
                  ChunkMeta(meta.key, meta.parent, 31, fp.spec.nbytes(31))):
        with pytest.raises(CorruptChunkError, match="expected"):
            decode_chunk(fp, obj, expect=other)
    assert decode_chunk(fp, obj, expect=meta)[0].key == meta.key


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_any_single_byte_change_is_caught(data: st.DataObject) -> None:
    fp = Fingerprint("prop", KVSpec(2, 2, 16, torch.bfloat16), 16)
    tokens = data.draw(st.integers(1, 16))
    codec = data.draw(st.sampled_from(CODECS))
    meta, kv = _meta(fp.spec, tokens), _data(fp.spec, tokens, seed=tokens)
    obj = bytearray(encode_chunk(fp, meta, kv, codec, block_size=512))
    offset = data.draw(st.integers(0, len(obj) - 1))
    obj[offset] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptChunkError):
        decode_chunk(fp, bytes(obj), expect=meta)


# -- fingerprint mismatch ------------------------------------------------------------------------


def test_other_namespace_names_both_sides(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                          fp: Fingerprint) -> None:
    _, _, obj = encoded
    other = Fingerprint("model-b", fp.spec, fp.chunk_size)
    with pytest.raises(FingerprintMismatchError) as info:
        decode_chunk(other, obj)
    msg = str(info.value)
    assert "namespace='model-a'" in msg and "namespace='model-b'" in msg
    assert msg.index("model-a") < msg.index("model-b")  # "written for A, this cache is B"


def _with_version(obj: bytes, version: int) -> bytes:
    """``obj`` with another format version in an intact header (its checksum recomputed), as
    a musacache of that version would have written it."""
    head = bytearray(obj[:HEADER_SIZE])
    struct.pack_into("<H", head, 4, version)  # after the 4-byte magic
    crc = zlib.crc32(head[12:HEADER_SIZE], zlib.crc32(head[:8]))
    struct.pack_into("<I", head, 8, crc)
    return bytes(head) + obj[HEADER_SIZE:]


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_foreign_format_version_is_unreadable_not_a_mismatch(
        encoded: tuple[ChunkMeta, torch.Tensor, bytes], fp: Fingerprint, version: int) -> None:
    # Issue 10 item 16: an intact object of another format version is an unreadable cold
    # chunk (a counted miss, like a corrupt one), not a FingerprintMismatchError that the
    # engine lets escape from get().
    meta, _, obj = encoded
    foreign = _with_version(obj, version)
    for call in (lambda: read_header(foreign), lambda: decode_chunk(fp, foreign, expect=meta)):
        with pytest.raises(ForeignFormatError, match=f"format v{version}") as info:
            call()
        assert isinstance(info.value, CorruptChunkError)
        assert not isinstance(info.value, FingerprintMismatchError)
    # The same bytes with this musacache's version decode: only the version was foreign.
    assert _same(decode_chunk(fp, _with_version(foreign, FORMAT_VERSION))[1], encoded[1])


@pytest.mark.parametrize("other", [
    Fingerprint("model-a", KVSpec(3, 2, 64, torch.bfloat16), 32),
    Fingerprint("model-a", KVSpec(2, 2, 64, torch.float16), 32),
    Fingerprint("model-a", KVSpec(2, 2, 64, torch.bfloat16), 64),
])
def test_other_layout_or_chunk_size(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                    other: Fingerprint) -> None:
    _, _, obj = encoded
    with pytest.raises(FingerprintMismatchError) as info:
        decode_chunk(other, obj)
    msg = str(info.value)
    assert "L=2 H=2 D=64 bfloat16) chunk_size=32" in msg
    assert other.describe() in msg


def test_long_namespace_is_shown_truncated() -> None:
    spec = KVSpec(1, 1, 8, torch.bfloat16)
    long_ns = "org/" + "x" * 200
    fp = Fingerprint(long_ns, spec, 4)
    obj = encode_chunk(fp, _meta(spec, 4), _data(spec, 4))
    hdr = read_header(obj)
    assert hdr.namespace_truncated and long_ns.startswith(hdr.namespace)
    assert decode_chunk(fp, obj)[0].num_tokens == 4
    with pytest.raises(FingerprintMismatchError, match=r"xxx'\.\.\. spec"):
        decode_chunk(Fingerprint("short", spec, 4), obj)


# -- bad arguments -------------------------------------------------------------------------------


def test_bad_arguments(fp: Fingerprint) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    with pytest.raises(InvalidInputError, match="codec"):
        encode_chunk(fp, meta, data, "zstd")
    with pytest.raises(DTypeError):
        encode_chunk(fp, meta, data.float(), "lz4")
    with pytest.raises(ShapeError):
        encode_chunk(fp, meta, data[:, :, :16], "lz4")  # 16 tokens, meta says 32
    with pytest.raises(InvalidInputError, match="key"):
        encode_chunk(fp, ChunkMeta(b"short", meta.parent, 32, meta.raw_bytes), data)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        encode_chunk(fp, ChunkMeta(meta.key, meta.parent, 33, fp.spec.nbytes(33)),
                     _data(fp.spec, 33))
    obj = encode_chunk(fp, meta, data)
    with pytest.raises(ShapeError):
        decode_chunk(fp, obj, out=torch.empty(fp.spec.shape(31), dtype=torch.bfloat16))
    with pytest.raises(DTypeError):
        decode_chunk(fp, obj, out=torch.empty(fp.spec.shape(32), dtype=torch.float16))


# -- tagged blocks (codec id 2) ------------------------------------------------------------------


def _blocks(obj: bytes) -> list[bytes]:
    """The stored blocks of an object, each starting with its method tag."""
    hdr = read_header(obj)
    table = obj[HEADER_SIZE : HEADER_SIZE + hdr.table_len]
    pos, blocks = HEADER_SIZE + hdr.table_len, []
    for (stored_len, _crc) in _BLOCK_ENTRY.iter_unpack(table):
        blocks.append(obj[pos : pos + stored_len])
        pos += stored_len
    return blocks


def _mixed(spec: KVSpec, tokens: int) -> torch.Tensor:
    """bf16 whose shuffled planes give every block method: the exponent plane nibble-codes,
    the mantissa plane is noise in its first half (raw) and a repeating ramp of 64 values in
    its second half (lz4)."""
    data = _data(spec, tokens).contiguous()
    u8 = data.view(torch.uint8).reshape(-1, 2)
    n = u8.shape[0]
    g = torch.Generator().manual_seed(5)
    u8[: n // 2, 0] = torch.randint(0, 256, (n // 2,), generator=g, dtype=torch.uint8)
    u8[n // 2 :, 0] = (torch.arange(n - n // 2) % 64).to(torch.uint8)
    return data


def _rewrite_block(obj: bytes, index: int, stored: bytes) -> bytes:
    """Replace one stored block and fix every checksum, as a buggy writer would."""
    hdr = read_header(obj)
    blocks = _blocks(obj)
    blocks[index] = stored
    table = b"".join(_BLOCK_ENTRY.pack(len(b), _native.crc32c(b)) for b in blocks)
    head = bytearray(obj[:HEADER_SIZE])
    fields = list(codec_mod._HEADER.unpack(bytes(head)))
    fields[15] = zlib.crc32(table)  # table_crc
    fields[17] = sum(map(len, blocks))  # payload_len
    head = bytearray(codec_mod._HEADER.pack(*fields))
    head[8:12] = codec_mod._header_crc(head).to_bytes(4, "little")
    assert read_header(bytes(head)).num_blocks == hdr.num_blocks
    return bytes(head) + table + b"".join(blocks)


@pytest.fixture
def mixed(fp: Fingerprint) -> tuple[ChunkMeta, torch.Tensor, bytes]:
    meta, data = _meta(fp.spec, 32), _mixed(fp.spec, 32)
    return meta, data, encode_chunk(fp, meta, data, "lz4", block_size=SMALL_BLOCK)


def test_lz4_writes_codec_id_2_with_every_block_method(
        mixed: tuple[ChunkMeta, torch.Tensor, bytes], fp: Fingerprint) -> None:
    _, data, obj = mixed
    hdr = read_header(obj)
    assert hdr.codec == "lz4" and hdr.codec_id == 2
    tags = [b[0] for b in _blocks(obj)]
    assert {0, 1, 2} <= set(tags), tags
    assert tags[hdr.num_blocks // 2 :] == [2] * (hdr.num_blocks - hdr.num_blocks // 2)
    assert _same(decode_chunk(fp, obj)[1], data)


def test_flipped_byte_in_every_block_method(mixed: tuple[ChunkMeta, torch.Tensor, bytes],
                                            fp: Fingerprint) -> None:
    _, data, obj = mixed
    hdr = read_header(obj)
    pos = HEADER_SIZE + hdr.table_len
    for block in _blocks(obj):
        for offset in {pos, pos + 1, pos + len(block) // 2, pos + len(block) - 1}:
            out = torch.zeros_like(data)
            with pytest.raises(CorruptChunkError, match="checksum"):
                decode_chunk(fp, _flip(obj, offset), out=out)
            assert not out.view(torch.uint8).any()
        pos += len(block)


def test_truncation_of_tagged_blocks(mixed: tuple[ChunkMeta, torch.Tensor, bytes],
                                     fp: Fingerprint) -> None:
    _, _, obj = mixed
    for cut in range(HEADER_SIZE, len(obj), 97):
        with pytest.raises(CorruptChunkError):
            decode_chunk(fp, obj[:cut])


def test_bad_blocks_with_good_checksums_are_rejected(
        mixed: tuple[ChunkMeta, torch.Tensor, bytes], fp: Fingerprint) -> None:
    # The checksums match, but the blocks are not valid codings: still a miss, never garbage.
    _, data, obj = mixed
    blocks = _blocks(obj)
    nib = next(i for i, b in enumerate(blocks) if b[0] == 2)
    lz = next(i for i, b in enumerate(blocks) if b[0] == 1)
    raw = next(i for i, b in enumerate(blocks) if b[0] == 0)
    assert _same(decode_chunk(fp, _rewrite_block(obj, nib, blocks[nib]))[1], data)
    bad = {
        "unknown method": b"\x07" + blocks[raw][1:],
        "raw block one byte short": blocks[raw][:-1],
        "empty block": b"",
        "nibble block truncated": blocks[nib][:-1],
        "nibble escape count": blocks[nib][:17] + bytes([blocks[nib][17] ^ 1]) + blocks[nib][18:],
        "nibble marked raw": b"\x00" + blocks[nib][1:],
        "lz4 marked nibble": b"\x02" + blocks[lz][1:],
        "lz4 truncated": blocks[lz][:-3],
    }
    for name, stored in bad.items():
        index = raw if name in ("unknown method", "raw block one byte short", "empty block") \
            else nib if name.startswith("nibble") else lz
        out = torch.zeros_like(data)
        with pytest.raises(CorruptChunkError):
            decode_chunk(fp, _rewrite_block(obj, index, stored), out=out)
        assert not out.view(torch.uint8).any(), name


def test_bad_fp8_block_with_a_good_checksum_leaves_out_untouched() -> None:
    # fp8 is not shuffled; a block that passes its checksum but does not decode must still
    # never reach the caller's out.
    spec = KVSpec(2, 4, 32, torch.float8_e4m3fn)
    fp = Fingerprint("ns", spec, 32)
    meta = _meta(spec, 32)
    u8 = (torch.arange(spec.nbytes(32)) % 15).to(torch.uint8)  # every block nibble-codes
    u8[-1] = 200  # a 16th value: an escape
    data = u8.view(spec.dtype).reshape(spec.shape(32))
    obj = encode_chunk(fp, meta, data, "lz4", block_size=SMALL_BLOCK)
    blocks = _blocks(obj)
    assert all(b[0] == 2 for b in blocks)
    last = len(blocks) - 1
    bad = bytearray(blocks[last])
    bad[-1] ^= 1  # the escaped byte is fine, but move its position past the end:
    bad[-5:-1] = (SMALL_BLOCK + 1).to_bytes(4, "little")
    out = torch.zeros_like(data)
    with pytest.raises(CorruptChunkError):
        decode_chunk(fp, _rewrite_block(obj, last, bytes(bad)), out=out)
    assert not out.view(torch.uint8).any()
    decode_chunk(fp, obj, out=out)
    assert _same(out, data)


def _encode_v1(fp: Fingerprint, meta: ChunkMeta, data: torch.Tensor) -> bytes:
    """An object of the first lz4 format (codec id 1: shuffle, lz4 or raw blocks, zlib.crc32),
    built by hand as the old writer did."""
    raw = bytes(_native.shuffle(data.contiguous(), data.element_size()))
    blocks = []
    for i in range(0, len(raw), SMALL_BLOCK):
        block = raw[i : i + SMALL_BLOCK]
        packed = lz4.block.compress(block, store_size=False)
        blocks.append(packed if len(packed) < len(block) else block)
    table = b"".join(_BLOCK_ENTRY.pack(len(b), zlib.crc32(b)) for b in blocks)
    head = encode_chunk(fp, meta, data, "raw", block_size=SMALL_BLOCK)[:HEADER_SIZE]
    fields = list(codec_mod._HEADER.unpack(head))
    fields[4] = 1  # codec id
    fields[15] = zlib.crc32(table)
    fields[17] = sum(map(len, blocks))
    new_head = bytearray(codec_mod._HEADER.pack(*fields))
    new_head[8:12] = codec_mod._header_crc(new_head).to_bytes(4, "little")
    return bytes(new_head) + table + b"".join(blocks)


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.describe().replace(" ", "_"))
def test_objects_of_the_first_lz4_format_still_decode(spec: KVSpec) -> None:
    fp = Fingerprint("ns", spec, 32)
    meta, data = _meta(spec, 32), _data(spec, 32)
    old = _encode_v1(fp, meta, data)
    hdr = read_header(old)
    assert hdr.codec == "lz4" and hdr.codec_id == 1
    assert _same(decode_chunk(fp, old, expect=meta)[1], data)
    start = HEADER_SIZE + hdr.table_len
    with pytest.raises(CorruptChunkError, match="checksum"):
        decode_chunk(fp, _flip(old, start + 5))


def test_unknown_codec_id_is_a_miss(encoded: tuple[ChunkMeta, torch.Tensor, bytes],
                                    fp: Fingerprint) -> None:
    _, _, obj = encoded
    head = bytearray(obj[:HEADER_SIZE])
    head[12] = 9  # ids 0 to 3 are codecs (3: raw with CRC-32C)
    head[8:12] = codec_mod._header_crc(head).to_bytes(4, "little")
    with pytest.raises(CorruptChunkError, match="codec id=9"):
        decode_chunk(fp, bytes(head) + obj[HEADER_SIZE:])


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.describe().replace(" ", "_"))
@pytest.mark.parametrize("pattern", ["bits", "specials", "few"])
def test_arbitrary_bit_patterns_round_trip(spec: KVSpec, pattern: str) -> None:
    fp = Fingerprint("ns", spec, 32)
    meta = _meta(spec, 32)
    nbytes = spec.nbytes(32)
    g = torch.Generator().manual_seed(11)
    u8 = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    if pattern == "specials":  # NaN, +-inf, -0 and denormals among normal values
        specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, 0.0])
        values = _data(spec, 32).reshape(-1).clone()
        values[::7] = specials[torch.arange(values[::7].numel()) % 6].to(spec.dtype)
        u8 = values.view(torch.uint8).reshape(-1)
    elif pattern == "few":  # few distinct bytes: every plane nibble-codes, with escapes
        u8 = (u8 % 13).to(torch.uint8)
        u8[::1000] = 0xFF
    data = u8.view(spec.dtype).reshape(spec.shape(32))
    obj = encode_chunk(fp, meta, data, "lz4", block_size=SMALL_BLOCK)
    assert _same(decode_chunk(fp, obj)[1], data)
    out = torch.empty_like(data)
    decode_chunk(fp, obj, out=out, threads=2)
    assert _same(out, data)


# -- raw with CRC-32C (codec id 3), and reading a file straight into the destination -----------


def _encode_raw_v1(fp: Fingerprint, meta: ChunkMeta, data: torch.Tensor) -> bytes:
    """An object of the first raw format (codec id 0: raw blocks, zlib.crc32), built by hand
    as the old writer did."""
    new = encode_chunk(fp, meta, data, "raw", block_size=SMALL_BLOCK)
    hdr = read_header(new)
    payload = new[HEADER_SIZE + hdr.table_len :]
    blocks = [payload[i : i + SMALL_BLOCK] for i in range(0, len(payload), SMALL_BLOCK)]
    table = b"".join(_BLOCK_ENTRY.pack(len(b), zlib.crc32(b)) for b in blocks)
    fields = list(codec_mod._HEADER.unpack(new[:HEADER_SIZE]))
    fields[4] = 0  # codec id
    fields[15] = zlib.crc32(table)
    head = bytearray(codec_mod._HEADER.pack(*fields))
    head[8:12] = codec_mod._header_crc(head).to_bytes(4, "little")
    return bytes(head) + table + payload


def test_raw_writes_codec_id_3_with_crc32c_blocks(fp: Fingerprint) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    obj = encode_chunk(fp, meta, data, "raw", block_size=SMALL_BLOCK)
    hdr = read_header(obj)
    assert hdr.codec == "raw" and hdr.codec_id == 3
    table = obj[HEADER_SIZE : HEADER_SIZE + hdr.table_len]
    raw = data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    assert obj[HEADER_SIZE + hdr.table_len :] == raw  # the payload is the tensor's bytes
    for i, (stored_len, crc) in enumerate(_BLOCK_ENTRY.iter_unpack(table)):
        assert crc == _native.crc32c(raw[i * SMALL_BLOCK : i * SMALL_BLOCK + stored_len])


def test_objects_of_the_first_raw_format_still_decode(fp: Fingerprint, tmp_path: Path) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    old = _encode_raw_v1(fp, meta, data)
    hdr = read_header(old)
    assert hdr.codec == "raw" and hdr.codec_id == 0
    assert _same(decode_chunk(fp, old, expect=meta)[1], data)
    out = torch.empty_like(data)
    with _open(tmp_path, old) as fd:
        read_chunk_into(fp, fd, len(old), out, expect=meta)
    assert _same(out, data)
    bad = _flip(old, HEADER_SIZE + hdr.table_len + 5)
    with pytest.raises(CorruptChunkError, match="checksum"):
        decode_chunk(fp, bad)
    with _open(tmp_path, bad) as fd, pytest.raises(CorruptChunkError, match="checksum"):
        read_chunk_into(fp, fd, len(bad), torch.empty_like(data))


@contextlib.contextmanager
def _open(folder: Path, obj: bytes) -> Iterator[int]:
    path = folder / f"chunk-{hashlib.blake2b(obj, digest_size=8).hexdigest()}.kvc"
    path.write_bytes(obj)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "_"))
def test_read_chunk_into_round_trips(spec: KVSpec, codec: str, tmp_path: Path) -> None:
    fp = Fingerprint("ns", spec, 32)
    for tokens in (32, 7):  # a whole chunk and a tail
        meta, data = _meta(spec, tokens), _data(spec, tokens, seed=tokens)
        obj = encode_chunk(fp, meta, data, codec, block_size=SMALL_BLOCK)
        out = torch.full_like(data.view(torch.uint8), 0xAB).view(spec.dtype)
        with _open(tmp_path, obj) as fd:
            got = read_chunk_into(fp, fd, len(obj), out, expect=meta)
        assert _same(out, data)
        assert got == decode_chunk(fp, obj, expect=meta)[0]
        out = torch.zeros_like(data)
        with _open(tmp_path, obj) as fd:  # blocks read and checked by two threads at once
            read_chunk_into(fp, fd, len(obj), out, expect=meta, threads=2)
        assert _same(out, data)


@pytest.mark.parametrize("codec", CODECS)
def test_read_chunk_into_catches_a_flipped_payload_byte_in_every_block(
        codec: str, fp: Fingerprint, tmp_path: Path) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    obj = encode_chunk(fp, meta, data, codec, block_size=SMALL_BLOCK)
    hdr = read_header(obj)
    offsets = [HEADER_SIZE + hdr.table_len]
    table = obj[HEADER_SIZE : HEADER_SIZE + hdr.table_len]
    for stored_len, _ in _BLOCK_ENTRY.iter_unpack(table):
        offsets.append(offsets[-1] + stored_len)
    assert hdr.num_blocks > 1
    for i in range(hdr.num_blocks):
        for where in (offsets[i], offsets[i + 1] - 1):  # the first and the last byte
            bad = _flip(obj, where)
            with _open(tmp_path, bad) as fd, pytest.raises(CorruptChunkError):
                read_chunk_into(fp, fd, len(bad), torch.empty_like(data), expect=meta)


@pytest.mark.parametrize("codec", CODECS)
def test_read_chunk_into_catches_a_truncated_file(codec: str, fp: Fingerprint,
                                                  tmp_path: Path) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    obj = encode_chunk(fp, meta, data, codec, block_size=SMALL_BLOCK)
    for cut in (len(obj) - 1, len(obj) // 2, HEADER_SIZE + 3, 10):
        short = obj[:cut]
        # The size the file has now, and the size it had when it was opened (a file cut
        # while it is read): both are a miss, never a partial chunk served as whole.
        for size in (cut, len(obj)):
            with _open(tmp_path, short) as fd, \
                    pytest.raises(CorruptChunkError, match="truncated"):
                read_chunk_into(fp, fd, size, torch.empty_like(data), expect=meta)


def test_read_chunk_into_checks_key_fingerprint_and_out(fp: Fingerprint,
                                                        tmp_path: Path) -> None:
    meta, data = _meta(fp.spec, 32), _data(fp.spec, 32)
    obj = encode_chunk(fp, meta, data, "raw", block_size=SMALL_BLOCK)
    with _open(tmp_path, obj) as fd:
        with pytest.raises(CorruptChunkError, match="key"):
            read_chunk_into(fp, fd, len(obj), torch.empty_like(data),
                            expect=_meta(fp.spec, 32, tag="other"))
        other = Fingerprint("model-b", fp.spec, 32)
        with pytest.raises(FingerprintMismatchError):
            read_chunk_into(other, fd, len(obj), torch.empty_like(data))
        with pytest.raises(ShapeError):
            read_chunk_into(fp, fd, len(obj), torch.empty_like(data)[:, :, :5])
        with pytest.raises(CorruptChunkError, match="trailing"):
            read_chunk_into(fp, fd, len(obj) + 1, torch.empty_like(data))


def test_encode_chunks_matches_encode_chunk_and_checks_every_item_first(
        fp: Fingerprint, monkeypatch: pytest.MonkeyPatch) -> None:
    items = [(_meta(fp.spec, 32, tag=f"c{i}"), _data(fp.spec, 32, seed=i)) for i in range(5)]
    for codec in CODECS:
        got = codec_mod.encode_chunks(fp, items, codec, threads=2)
        assert got == [encode_chunk(fp, m, d, codec) for m, d in items]
    calls: list[int] = []
    encode = codec_mod.encode_chunk
    monkeypatch.setattr(codec_mod, "encode_chunk",
                        lambda *a, **k: calls.append(1) or encode(*a, **k))
    bad = [*items[:3], (_meta(fp.spec, 31, tag="short"), items[0][1])]
    with pytest.raises(ShapeError):
        codec_mod.encode_chunks(fp, bad, "raw", threads=2)
    with pytest.raises(InvalidInputError, match="codec"):
        codec_mod.encode_chunks(fp, items, "zstd")
    assert calls == []  # nothing was encoded before the bad item was found


def test_read_chunk_into_every_block_method(mixed: tuple[ChunkMeta, torch.Tensor, bytes],
                                            fp: Fingerprint, tmp_path: Path) -> None:
    # Raw blocks are read straight into the planes, lz4 and nibble blocks through a buffer:
    # each kind round-trips, and a flipped byte anywhere in any of them is caught.
    meta, data, obj = mixed
    out = torch.zeros_like(data)
    with _open(tmp_path, obj) as fd:
        read_chunk_into(fp, fd, len(obj), out, expect=meta)
    assert _same(out, data)
    hdr = read_header(obj)
    pos = HEADER_SIZE + hdr.table_len
    for block in _blocks(obj):
        for offset in {pos, pos + 1, pos + len(block) // 2, pos + len(block) - 1}:
            bad = _flip(obj, offset)
            with _open(tmp_path, bad) as fd, pytest.raises(CorruptChunkError, match="checksum"):
                read_chunk_into(fp, fd, len(bad), torch.empty_like(data), expect=meta)
        pos += len(block)
