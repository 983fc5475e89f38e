"""The self-describing chunk object: a checksummed header, a block table, and the payload.

Every chunk that leaves memory (disk file, S3 object) is one of these objects, so any reader can
tell what it holds, and whether it is intact, without outside metadata::

    +---------------------------+  HEADER_SIZE (256) bytes, little-endian, see _HEADER
    | magic "MKVC", version,    |  the header checksum covers every header byte but itself,
    | header crc32, codec,      |  so a flipped length is caught before any length is trusted
    | fingerprint (namespace,   |
    | spec, chunk size, digest),|
    | key, parent, tokens,      |
    | raw / payload lengths,    |
    | block table crc32         |
    +---------------------------+
    | block table               |  num_blocks x (stored_len u32, crc u32)
    +---------------------------+
    | payload                   |  the blocks, back to back
    +---------------------------+

**Blocks.** The (shuffled) raw bytes are cut into independent blocks of ``block_size`` bytes
(1 MiB by default), so ``threads > 1`` can code and verify them in parallel.

**Codecs.** ``"lz4"`` (codec id 2, "tagged blocks"): the native byte-shuffle (one plane per
byte of an element, as blosc does), then each block is stored by one of three methods, named by
its first stored byte:

- ``2`` nibble table coder (native): the 15 most frequent bytes of a sample become 4-bit codes,
  the rest escapes with their positions. The exponent plane of Gaussian bf16 has about 12
  distinct bytes, so it halves (1.99x) at several GB/s, where lz4 gave 1.5x at 0.3 GB/s;
- ``1`` lz4 block, when the coder would not win and lz4 shrinks a 64 KiB sample of the block
  by 3% or more (and then the whole block);
- ``0`` raw, otherwise (the mantissa plane: noise), so decoding it is a copy.

The block table's ``stored_len`` counts the method byte. Gaussian bf16 ends at 1.33x. Objects
of codec id 1 (the first ``"lz4"``: shuffle + lz4 or raw blocks, zlib crc32 per block) are
still decoded; an unknown codec id or block method is a :class:`CorruptChunkError` (a miss).
``"raw"`` (codec id 3): no shuffle, every block stored raw, so the payload is the tensor's
bytes in order; still checksummed (CRC-32C). A reader with a file can read the payload
straight into the destination tensor (:func:`read_chunk_into`). Objects of codec id 0 (the
first ``"raw"``: zlib crc32 per block) are still decoded.

**Checksum.** Every stored block carries a checksum of its stored bytes: CRC-32C for codec
ids 2 and 3 (native, with the SSE4.2 instruction on three interleaved streams when the CPU has
it: 20 GB/s here against 3.8 for ``zlib.crc32``; both are 32-bit CRCs, which catch every burst
of up to 32 flipped bits, and the exact object length in the header catches truncation),
zlib.crc32 for ids 0 and 1. The header
and the block table use zlib.crc32. This guards against torn writes and bit rot, not against
an attacker (who could also rewrite the header), so a fast CRC is the right one. A block that
passes its checksum is still checked for being a valid coding of its raw length before it is
used.

**Decoding** is native (:mod:`musacache._native`): a tagged payload is checked, decoded (our
own bounds-checked LZ4 block decoder for method ``1``, into a reused buffer) and unshuffled
into the destination a 32 KiB strip at a time in one call, each strip copied on into a
caller's second destination (a :class:`~musacache._native.ChunkCopy`) while it is in cache.
From memory every block is checked before the destination is written; from a file each block
is read and checked just before the strips that need it.

``encode_chunk``/``decode_chunk`` (and ``encode_chunks`` for a batch, ``read_chunk_into`` from
an open file) are synchronous and CPU-bound (lz4, zlib.crc32, ``preadv`` and the native calls
release the GIL): the engine calls them in worker threads.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lz4.block
import numpy as np
import torch

from ._chunkmeta import ChunkMeta
from ._errors import (
    CorruptChunkError,
    DeviceError,
    FingerprintMismatchError,
    ForeignFormatError,
    InvalidInputError,
    ShapeError,
)
from ._executor import Executor
from ._keys import FORMAT_VERSION, KEY_BYTES, Fingerprint
from ._spec import dtype_name

if TYPE_CHECKING:
    from ._native import ChunkCopy

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "HEADER_MAX_BYTES",
    "HEADER_SIZE",
    "MAGIC",
    "ChunkHeader",
    "decode_chunk",
    "encode_chunk",
    "encode_chunks",
    "read_chunk_into",
    "read_chunk_to",
    "read_header",
]

CODECS: tuple[str, ...] = ("lz4", "raw")
MAGIC = b"MKVC"
DEFAULT_BLOCK_SIZE = 1 << 20

# Codec ids in the header. "lz4" writes id 2 (tagged blocks, crc32c) and "raw" id 3 (raw
# blocks, crc32c); objects of id 1 (the first lz4 format: shuffle + lz4, zlib crc32) and id 0
# (the first raw format, zlib crc32) are still decoded.
_CODEC_IDS = {"raw": 3, "lz4": 2}
_CODEC_NAMES = {0: "raw", 1: "lz4", 2: "lz4", 3: "raw"}
_ID_RAW_V1, _ID_LZ4_V1, _ID_TAGGED, _ID_RAW = 0, 1, 2, 3
_RAW_IDS = (_ID_RAW_V1, _ID_RAW)
# Block methods of codec id 2: the first stored byte of every block.
_TAG_RAW, _TAG_LZ4, _TAG_NIBBLE = 0, 1, 2
_TAG_BYTES = (bytes([_TAG_RAW]), bytes([_TAG_LZ4]), bytes([_TAG_NIBBLE]))
_TAG_CRCS: tuple[int, ...] = ()  # crc32c of each tag byte, filled on first use
# lz4 is tried on a sample from the start of a block the nibble coder rejected; when the
# sample does not shrink by this fraction the block is stored raw without compressing it all.
_LZ4_SAMPLE = 64 << 10
_LZ4_SAMPLE_GAIN = 0.97
_FLAG_MLA = 1

# magic, format_version, header_size, header_crc | codec, flags, itemsize, reserved |
# num_layers, num_kv_heads, head_dim, chunk_size, num_tokens, block_size, num_blocks, table_crc |
# raw_len, payload_len | fingerprint digest, key, parent, dtype name | namespace length, namespace
_HEADER = struct.Struct("<4sHHI4B8I2Q16s32s32s16sH94s")
HEADER_SIZE = _HEADER.size
#: The most bytes a tier must read to call :func:`read_header` (the header is fixed-size).
HEADER_MAX_BYTES = HEADER_SIZE
_CRC_OFFSET = 8  # the header crc covers [0:8] + [12:HEADER_SIZE]
_NAMESPACE_FIELD = 94
_BLOCK_ENTRY = struct.Struct("<II")
_U32_MAX = 2**32 - 1

if HEADER_SIZE != 256:  # a layout change must bump FORMAT_VERSION; this catches edits early
    raise ImportError(f"musacache.codec header layout is {HEADER_SIZE} bytes, expected 256")


@dataclass(frozen=True)
class ChunkHeader:
    """The verified header of a chunk object (:func:`read_header`)."""

    format_version: int
    codec: str
    namespace: str
    #: The namespace was longer than the header's field; ``namespace`` is its first bytes.
    namespace_truncated: bool
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    mla: bool
    itemsize: int
    chunk_size: int
    fingerprint_digest: bytes
    key: bytes
    parent: bytes
    num_tokens: int
    block_size: int
    num_blocks: int
    table_crc: int
    raw_len: int
    payload_len: int
    #: The codec id in the header (``"lz4"`` is 1 for the first format, 2 for tagged blocks).
    codec_id: int = -1

    @property
    def table_len(self) -> int:
        return self.num_blocks * _BLOCK_ENTRY.size

    @property
    def object_len(self) -> int:
        """The exact size of the whole object; any other size means truncation or garbage."""
        return HEADER_SIZE + self.table_len + self.payload_len

    def describe_fingerprint(self) -> str:
        """The writer's fingerprint, in the words of :meth:`Fingerprint.describe`."""
        kind = "mla" if self.mla else "mha"
        ns = repr(self.namespace) + ("..." if self.namespace_truncated else "")
        return (f"namespace={ns} spec=({kind} L={self.num_layers} H={self.num_kv_heads} "
                f"D={self.head_dim} {self.dtype}) chunk_size={self.chunk_size} "
                f"format=v{self.format_version}")

    def matches(self, fp: Fingerprint) -> bool:
        spec = fp.spec
        return (self.fingerprint_digest == fp.digest()
                and self.format_version == fp.format_version
                and (self.num_layers, self.num_kv_heads, self.head_dim, self.mla)
                == (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.mla)
                and self.dtype == dtype_name(spec.dtype)
                and self.chunk_size == fp.chunk_size)

    def meta(self, *, stored_bytes: int | None = None, last_used: float = 0.0) -> ChunkMeta:
        return ChunkMeta(key=self.key, parent=self.parent, num_tokens=self.num_tokens,
                         raw_bytes=self.raw_len,
                         stored_bytes=self.object_len if stored_bytes is None else stored_bytes,
                         last_used=last_used)


# -- header ------------------------------------------------------------------------------------


def _header_crc(head: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(head[_CRC_OFFSET + 4 : HEADER_SIZE], zlib.crc32(head[:_CRC_OFFSET]))


def _pack_header(fp: Fingerprint, meta: ChunkMeta, *, codec: str, itemsize: int, block_size: int,
                 num_blocks: int, table_crc: int, raw_len: int, payload_len: int) -> bytes:
    spec = fp.spec
    ns_full = fp.namespace.encode("utf-8")
    # Cut at a character boundary so the stored prefix still decodes; the digest, not this
    # text, decides a match: the text only names the writer in error messages.
    ns = ns_full[:_NAMESPACE_FIELD].decode("utf-8", "ignore").encode("utf-8")
    fields = (MAGIC, fp.format_version, HEADER_SIZE, 0,
              _CODEC_IDS[codec], _FLAG_MLA if spec.mla else 0, itemsize, 0,
              spec.num_layers, spec.num_kv_heads, spec.head_dim, fp.chunk_size, meta.num_tokens,
              block_size, num_blocks, table_crc, raw_len, payload_len,
              fp.digest(), meta.key, meta.parent, dtype_name(spec.dtype).encode("ascii"),
              min(len(ns_full), 0xFFFF), ns)
    head = bytearray(_HEADER.pack(*fields))
    struct.pack_into("<I", head, _CRC_OFFSET, _header_crc(head))
    return bytes(head)


def read_header(obj: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and verify the header of a chunk object (only its first :data:`HEADER_SIZE` bytes
    are needed, so a tier may pass a ranged read).

    Raises :class:`CorruptChunkError` for a short buffer, bad magic or a header checksum
    mismatch, and its subclass :class:`ForeignFormatError` for an intact header of another
    format version. It does not check the payload: :func:`decode_chunk` does.
    """
    view = memoryview(obj).cast("B") if isinstance(obj, memoryview) else memoryview(obj)
    if len(view) < HEADER_SIZE:
        raise CorruptChunkError(
            f"chunk object truncated: {len(view)} bytes, the header alone is {HEADER_SIZE}")
    head = view[:HEADER_SIZE]
    (magic, version, header_size, crc, codec_id, flags, itemsize, _reserved,
     num_layers, num_kv_heads, head_dim, chunk_size, num_tokens, block_size, num_blocks,
     table_crc, raw_len, payload_len, digest, key, parent, dtype_raw, ns_len,
     ns_raw) = _HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptChunkError(f"not a musacache chunk object: magic {bytes(magic)!r}, "
                                f"expected {MAGIC!r}")
    if crc != _header_crc(head):
        raise CorruptChunkError("chunk header checksum mismatch (the header is damaged)")
    if version != FORMAT_VERSION:
        raise ForeignFormatError(
            f"chunk object is format v{version}, this musacache reads format v{FORMAT_VERSION}")
    if header_size != HEADER_SIZE or codec_id not in _CODEC_NAMES:
        raise CorruptChunkError(
            f"chunk header is inconsistent (header_size={header_size}, codec id={codec_id})")
    namespace = bytes(ns_raw).rstrip(b"\0").decode("utf-8", "replace")
    return ChunkHeader(
        format_version=version, codec=_CODEC_NAMES[codec_id], namespace=namespace,
        namespace_truncated=ns_len > len(namespace.encode("utf-8")),
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=bytes(dtype_raw).rstrip(b"\0").decode("ascii", "replace"),
        mla=bool(flags & _FLAG_MLA), itemsize=itemsize, chunk_size=chunk_size,
        fingerprint_digest=bytes(digest), key=bytes(key), parent=bytes(parent),
        num_tokens=num_tokens, block_size=block_size, num_blocks=num_blocks,
        table_crc=table_crc, raw_len=raw_len, payload_len=payload_len, codec_id=codec_id)


# -- native shuffle ------------------------------------------------------------------------------


def _native() -> Any:
    # Imported on first use so that reading headers (tier start-up scans) never needs the
    # compiled module.
    from . import _native

    return _native


def _shuffle(src: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    _native().shuffle(src, itemsize, out=out)


def _unshuffle(src: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    _native().unshuffle(src, itemsize, out=out)


# -- scratch buffers -----------------------------------------------------------------------------

# A fresh 32 MiB buffer costs more in page faults than the shuffle that fills it (measured
# here: 5.6 ms fresh vs 2.9 ms reused), so the shuffle scratch is recycled. At most
# _SCRATCH_KEEP idle buffers are kept, which bounds the memory this holds.
_SCRATCH_KEEP = 8  # a file read holds two: the object read, and its shuffled planes
_scratch: list[np.ndarray] = []
_scratch_lock = threading.Lock()


def _take_scratch(nbytes: int) -> np.ndarray:
    with _scratch_lock:
        # The most recently returned buffer first: it is the likeliest to be in the cache.
        for i in range(len(_scratch) - 1, -1, -1):
            if _scratch[i].size >= nbytes:
                return _scratch.pop(i)[:nbytes]
    return np.empty(nbytes, dtype=np.uint8)


def _give_scratch(buf: np.ndarray) -> None:
    base = buf.base if isinstance(buf.base, np.ndarray) else buf
    with _scratch_lock:
        if len(_scratch) < _SCRATCH_KEEP:
            _scratch.append(base)
        else:
            # Keep the largest buffers: a small one would never serve a full chunk.
            smallest = min(range(len(_scratch)), key=lambda i: _scratch[i].size)
            if _scratch[smallest].size < base.size:
                _scratch[smallest] = base


# -- block fan-out -------------------------------------------------------------------------------

_default: Executor | None = None
_default_lock = threading.Lock()


def _fan_out() -> Executor:
    """Threads for a codec call made outside a cache with ``threads > 1`` (a cache passes its
    own ``executor``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Executor("musacache-codec")
        return _default


def _run_blocks(fn: Callable[[int], Any], num_blocks: int, threads: int,
                executor: Executor | None) -> list[Any]:
    """``[fn(i) for i in range(num_blocks)]``, split into up to ``threads`` contiguous groups.

    The calling thread runs the first group itself, the others run on ``executor``'s
    threads, so ``threads=2`` costs one more thread.
    """
    groups = max(1, min(threads, num_blocks))
    if groups == 1:
        return [fn(i) for i in range(num_blocks)]
    bounds = [num_blocks * g // groups for g in range(groups + 1)]

    def run(g: int) -> list[Any]:
        return [fn(i) for i in range(bounds[g], bounds[g + 1])]

    ex = executor if executor is not None else _fan_out()
    futures: list[Future[list[Any]]] = [ex.submit_blocking(run, g) for g in range(1, groups)]
    results = run(0)
    # Wait for every group even if one failed, so no worker still touches our buffers.
    errors: list[BaseException] = []
    for fut in futures:
        try:
            results.extend(fut.result())
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return results


# -- encode --------------------------------------------------------------------------------------


def _check_meta(fp: Fingerprint, meta: ChunkMeta) -> None:
    if fp.format_version != FORMAT_VERSION:
        raise InvalidInputError(f"this musacache writes chunk format v{FORMAT_VERSION}, the "
                                f"fingerprint says v{fp.format_version}")
    for name in ("key", "parent"):
        value = getattr(meta, name)
        if not isinstance(value, bytes) or len(value) != KEY_BYTES:
            raise InvalidInputError(f"ChunkMeta.{name} must be {KEY_BYTES} bytes, got {value!r}")
    if not 0 < meta.num_tokens <= min(fp.chunk_size, _U32_MAX):
        raise InvalidInputError(f"ChunkMeta.num_tokens must be in 1..{fp.chunk_size}, got "
                                f"{meta.num_tokens}")


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def encode_chunk(fp: Fingerprint, meta: ChunkMeta, data: torch.Tensor, codec: str = "lz4", *,
                 threads: int = 1, block_size: int = DEFAULT_BLOCK_SIZE,
                 executor: Executor | None = None) -> bytes:
    """Encode one chunk's dense KV as a self-describing object.

    ``data`` is a CPU tensor of ``fp.spec.shape(meta.num_tokens)`` and ``fp.spec.dtype``
    (a non-contiguous one is copied first). ``threads`` > 1 compresses blocks in parallel.
    Raises :class:`InvalidInputError` (or a subclass) for bad arguments; never touches ``data``.
    """
    if codec not in CODECS:
        raise InvalidInputError(f"unknown codec {codec!r}; use one of {CODECS}")
    if not 0 < block_size <= _U32_MAX:
        raise InvalidInputError(f"block_size must be in 1..{_U32_MAX}, got {block_size}")
    _check_meta(fp, meta)
    spec = fp.spec
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        raise DeviceError(f"encode_chunk needs a CPU tensor, got one on {data.device}")
    if spec.check_dense(data, what="chunk data") != meta.num_tokens:
        raise ShapeError(f"chunk data holds {data.shape[spec.token_dim]} tokens, the ChunkMeta "
                         f"says {meta.num_tokens}")
    raw_len = spec.nbytes(meta.num_tokens)
    if meta.raw_bytes != raw_len:
        raise InvalidInputError(f"ChunkMeta.raw_bytes is {meta.raw_bytes}, {meta.num_tokens} "
                                f"tokens of this spec are {raw_len} bytes")
    raw = _as_bytes(data.contiguous())
    itemsize = spec.itemsize
    if codec == "raw":
        return _encode_blocks(fp, meta, memoryview(raw.data), codec=codec, itemsize=itemsize,
                              block_size=block_size, threads=threads, executor=executor)
    # Tagged blocks: shuffled planes (one per byte of an element) cut into blocks, each
    # nibble-coded, lz4-compressed or stored raw, whichever is smallest by a cheap test.
    shuffled: np.ndarray | None = None
    if itemsize > 1:
        shuffled = _take_scratch(raw_len)
        _shuffle(raw, itemsize, out=shuffled)
        raw = shuffled
    coded = _take_scratch(raw_len)  # nibble-coded blocks land at their raw block's offset
    try:
        return _encode_tagged(fp, meta, raw, coded, itemsize=itemsize, block_size=block_size,
                              threads=threads, executor=executor)
    finally:
        _give_scratch(coded)
        if shuffled is not None:
            _give_scratch(shuffled)


def encode_chunks(fp: Fingerprint, items: Sequence[tuple[ChunkMeta, torch.Tensor]],
                  codec: str = "lz4", *, threads: int = 1,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  executor: Executor | None = None) -> list[bytes]:
    """:func:`encode_chunk` for a batch, in one call: up to ``threads`` chunks are encoded at
    once (the calling thread takes the first share), so a multi-chunk put or demotion makes
    one worker-thread hop and uses every core it is given. Every item is checked before any
    is encoded, so bad input raises before any work is done."""
    if codec not in CODECS:
        raise InvalidInputError(f"unknown codec {codec!r}; use one of {CODECS}")
    for meta, data in items:
        _check_meta(fp, meta)
        if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
            where = data.device if isinstance(data, torch.Tensor) else type(data).__name__
            raise DeviceError(f"encode_chunks needs CPU tensors, got one on {where}")
        if fp.spec.check_dense(data, what="chunk data") != meta.num_tokens:
            raise ShapeError(f"chunk data holds {data.shape[fp.spec.token_dim]} tokens, the "
                             f"ChunkMeta says {meta.num_tokens}")
    out: list[bytes] = _run_blocks(
        lambda i: encode_chunk(fp, items[i][0], items[i][1], codec, block_size=block_size),
        len(items), threads, executor)
    return out


def _tag_crc(tag: int) -> int:
    global _TAG_CRCS
    if not _TAG_CRCS:
        _TAG_CRCS = tuple(_native().crc32c(t) for t in _TAG_BYTES)
    return _TAG_CRCS[tag]


def _encode_tagged(fp: Fingerprint, meta: ChunkMeta, raw: np.ndarray, coded: np.ndarray, *,
                   itemsize: int, block_size: int, threads: int,
                   executor: Executor | None) -> bytes:
    native = _native()
    raw_len = raw.size
    num_blocks = -(-raw_len // block_size)
    view = memoryview(raw.data)

    def encode_block(i: int) -> tuple[int, bytes | memoryview, int]:
        start = i * block_size
        end = min(start + block_size, raw_len)
        block = view[start:end]
        tag: int = _TAG_RAW
        body: bytes | memoryview = block
        size = native.nib_encode(raw[start:end], coded[start:end])
        if size is not None:
            tag, body = _TAG_NIBBLE, memoryview(coded.data)[start : start + size]
        elif (len(block) < 2 * _LZ4_SAMPLE or len(lz4.block.compress(
                block[:_LZ4_SAMPLE], store_size=False)) < _LZ4_SAMPLE * _LZ4_SAMPLE_GAIN):
            packed = lz4.block.compress(block, store_size=False)
            if len(packed) < len(block):
                tag, body = _TAG_LZ4, packed
        return tag, body, native.crc32c(body, _tag_crc(tag))

    blocks = _run_blocks(encode_block, num_blocks, threads, executor)
    table = b"".join(_BLOCK_ENTRY.pack(1 + len(body), crc) for _tag, body, crc in blocks)
    payload_len = sum(1 + len(body) for _tag, body, _crc in blocks)
    header = _pack_header(fp, meta, codec="lz4", itemsize=itemsize, block_size=block_size,
                          num_blocks=num_blocks, table_crc=zlib.crc32(table), raw_len=raw_len,
                          payload_len=payload_len)
    pieces: list[bytes | memoryview] = [header, table]
    for tag, body, _crc in blocks:
        pieces.append(_TAG_BYTES[tag])
        pieces.append(body)
    return b"".join(pieces)


def _encode_blocks(fp: Fingerprint, meta: ChunkMeta, view: memoryview, *, codec: str,
                   itemsize: int, block_size: int, threads: int,
                   executor: Executor | None) -> bytes:
    raw_len = len(view)
    num_blocks = -(-raw_len // block_size)

    crc = _native().crc32c

    def encode_block(i: int) -> tuple[memoryview, int]:
        stored = view[i * block_size : (i + 1) * block_size]
        return stored, crc(stored)

    blocks = _run_blocks(encode_block, num_blocks, threads, executor)
    table = b"".join(_BLOCK_ENTRY.pack(len(stored), crc) for stored, crc in blocks)
    payload_len = sum(len(stored) for stored, _ in blocks)
    header = _pack_header(fp, meta, codec=codec, itemsize=itemsize, block_size=block_size,
                          num_blocks=num_blocks, table_crc=zlib.crc32(table), raw_len=raw_len,
                          payload_len=payload_len)
    return b"".join([header, table, *(stored for stored, _ in blocks)])


# -- decode --------------------------------------------------------------------------------------


def _check_out(out: torch.Tensor, fp: Fingerprint, num_tokens: int) -> None:
    spec = fp.spec
    if not isinstance(out, torch.Tensor):
        raise ShapeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.device.type != "cpu":
        raise DeviceError(f"decode_chunk writes CPU tensors only, out is on {out.device}")
    spec.check_dense(out, what="out")
    if tuple(out.shape) != spec.shape(num_tokens):
        raise ShapeError(f"out has shape {tuple(out.shape)}, the chunk holds "
                         f"{spec.shape(num_tokens)}")
    if not out.is_contiguous():
        raise ShapeError("out must be contiguous")


def _check_header(fp: Fingerprint, hdr: ChunkHeader, expect: ChunkMeta | None,
                  object_len: int) -> None:
    """Everything about a verified header that must hold before its lengths are used."""
    if not hdr.matches(fp):
        raise FingerprintMismatchError(
            f"chunk written for {hdr.describe_fingerprint()}, this cache is {fp.describe()}")
    if expect is not None and (expect.key != hdr.key or expect.parent != hdr.parent
                               or expect.num_tokens != hdr.num_tokens):
        # (Compared first, described only on a mismatch: this runs on every read.)
        checks: tuple[tuple[str, object, object], ...] = (
            ("key", expect.key.hex(), hdr.key.hex()),
            ("parent", expect.parent.hex(), hdr.parent.hex()),
            ("num_tokens", expect.num_tokens, hdr.num_tokens))
        for name, want, got in checks:
            if want != got:
                raise CorruptChunkError(f"chunk object holds {name} {got}, expected {want} "
                                        f"(misplaced or overwritten object)")
    if (not 0 < hdr.num_tokens <= hdr.chunk_size
            or hdr.raw_len != fp.spec.nbytes(hdr.num_tokens)
            or hdr.itemsize != fp.spec.itemsize or hdr.block_size == 0
            or hdr.num_blocks != -(-hdr.raw_len // hdr.block_size)):
        raise CorruptChunkError("chunk header lengths are inconsistent with its spec")
    if object_len != hdr.object_len:
        what = "truncated" if object_len < hdr.object_len else "trailing bytes"
        raise CorruptChunkError(f"chunk object is {object_len} bytes, its header says "
                                f"{hdr.object_len} ({what})")


def _block_layout(hdr: ChunkHeader, table: bytes | bytearray | memoryview,
                  ) -> tuple[Sequence[tuple[int, int]], list[int]]:
    """The verified block table: ``(stored_len, crc)`` per block, and each block's offset in
    the object (the last one is the object's length)."""
    if zlib.crc32(table) != hdr.table_crc:
        raise CorruptChunkError("chunk block table checksum mismatch")
    entries: Sequence[tuple[int, int]] = list(_BLOCK_ENTRY.iter_unpack(table))
    offsets = [HEADER_SIZE + hdr.table_len]
    tagged = hdr.codec_id == _ID_TAGGED
    raw = hdr.codec_id in _RAW_IDS
    for i, (stored_len, _crc) in enumerate(entries):
        raw_block = min(hdr.block_size, hdr.raw_len - i * hdr.block_size)
        if ((tagged and not 1 <= stored_len <= raw_block + 1)
                or (not tagged and stored_len > raw_block)
                or (raw and stored_len != raw_block)):
            raise CorruptChunkError(f"chunk block {i} is {stored_len} bytes stored for "
                                    f"{raw_block} raw bytes ({hdr.codec})")
        offsets.append(offsets[-1] + stored_len)
    if offsets[-1] != hdr.object_len:
        raise CorruptChunkError("chunk block lengths do not add up to the payload length")
    return entries, offsets


def _block_crc(hdr: ChunkHeader) -> Callable[[Any], int]:
    # The first formats (codec ids 0 and 1) used zlib.crc32, the later ones CRC-32C.
    return zlib.crc32 if hdr.codec_id in (_ID_RAW_V1, _ID_LZ4_V1) else _native().crc32c


def decode_chunk(fp: Fingerprint, obj: bytes | bytearray | memoryview, *,
                 expect: ChunkMeta | None = None, out: torch.Tensor | None = None,
                 threads: int = 1, executor: Executor | None = None,
                 ) -> tuple[ChunkMeta, torch.Tensor]:
    """Verify and decode a chunk object written by :func:`encode_chunk`.

    Returns the chunk's :class:`ChunkMeta` (``stored_bytes`` = ``len(obj)``) and its dense KV,
    written into ``out`` when given (a contiguous CPU tensor of the chunk's shape and dtype).

    Raises :class:`ForeignFormatError` for an object of another format version,
    :class:`FingerprintMismatchError` (naming both sides) when the object was written for
    another namespace, spec or chunk size, and :class:`CorruptChunkError`
    for bad magic, a damaged header or block table, truncation or trailing bytes, a payload
    checksum mismatch, or a key/parent/token count that differs from ``expect``. On any error
    ``out`` is left untouched.
    """
    view = memoryview(obj).cast("B") if isinstance(obj, memoryview) else memoryview(obj)
    hdr = read_header(view)
    _check_header(fp, hdr, expect, len(view))
    entries, offsets = _block_layout(hdr, view[HEADER_SIZE : HEADER_SIZE + hdr.table_len])
    spec = fp.spec
    if out is not None:
        _check_out(out, fp, hdr.num_tokens)
        dst = out
    else:
        dst = torch.empty(spec.shape(hdr.num_tokens), dtype=spec.dtype, device="cpu")
    dst_bytes = _as_bytes(dst)
    if hdr.codec_id == _ID_TAGGED:
        # Every block is verified and decoded before the native call writes dst at all.
        planes = _take_scratch(hdr.raw_len)
        try:
            _native().tagged_decode(
                view[offsets[0]:], view[HEADER_SIZE : offsets[0]], num_blocks=hdr.num_blocks,
                block_size=hdr.block_size, raw_len=hdr.raw_len, itemsize=hdr.itemsize,
                scratch=planes, out=dst_bytes)
        finally:
            _give_scratch(planes)
        return hdr.meta(stored_bytes=len(view)), dst
    shuffled = hdr.codec_id not in _RAW_IDS and hdr.itemsize > 1
    # A shuffled payload is rebuilt in scratch and only unshuffled into dst once every block
    # verified and decoded. So is an unshuffled compressed one for a caller's out: a block can
    # pass its checksum and still fail to decode (a buggy writer), and out must stay untouched.
    # Raw blocks land in dst directly, after every checksum was verified.
    staged = shuffled or (out is not None and hdr.codec_id not in _RAW_IDS)
    target = _take_scratch(hdr.raw_len) if staged else dst_bytes
    verify_first = out is not None and not staged
    try:
        _decode_blocks(view, hdr, offsets, entries, target, verify_first=verify_first,
                       threads=threads, executor=executor)
        if shuffled:
            _unshuffle(target, hdr.itemsize, out=dst_bytes)
        elif staged:
            np.copyto(dst_bytes, target)
    finally:
        if staged:
            _give_scratch(target)
    return hdr.meta(stored_bytes=len(view)), dst


def _pread_into(fd: int, buf: memoryview, offset: int, *more: memoryview) -> None:
    """Fill ``buf`` (then each of ``more``) from ``fd`` at ``offset``, in one ``preadv`` when
    the file allows; a file that ends first is a truncated object."""
    bufs = [b for b in (buf, *more) if len(b)]
    while bufs:
        got = os.preadv(fd, bufs, offset)
        if got == 0:
            raise CorruptChunkError(f"chunk file ended {sum(map(len, bufs))} bytes short of "
                                    f"what its header promised, at offset {offset} (truncated)")
        offset += got
        while got:  # drop what was filled
            if got >= len(bufs[0]):
                got -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][got:]
                got = 0


def read_chunk_into(fp: Fingerprint, fd: int, size: int, out: torch.Tensor, *,
                    expect: ChunkMeta | None = None, threads: int = 1,
                    on_block: Callable[[int, int], None] | None = None,
                    executor: Executor | None = None) -> ChunkMeta:
    """Read, verify and decode the chunk object in the open file ``fd`` (``size`` bytes, as
    its ``fstat`` says) into ``out``, a contiguous CPU tensor of the chunk's shape.

    A raw object's payload is the tensor's bytes in order, so it is read straight into
    ``out``, a block at a time, and each block's checksum is taken right after its read, while
    the block is still in the CPU's cache: one pass over the bytes, no buffer in between.
    Other codecs are read into a reused buffer and decoded as :func:`decode_chunk` does.

    ``on_block(start, end)``, when given, is called as soon as bytes ``[start, end)`` of
    ``out`` hold their final, verified value, from the thread that wrote them (for a raw
    object right after each block's checksum, while the block is in cache): a caller copies
    each range on to a second destination in the same pass. Ranges are disjoint, at most one
    block long, and cover ``out`` only if the read succeeds. An ``on_block`` with a
    ``native_copy`` attribute that is a :class:`~musacache._native.ChunkCopy` (the caller's
    tensor as runs of bytes, ``_tee.Tee.target``) is not called: the decode writes that copy
    itself, for a tagged object a strip at a time right after the same strip of ``out``.

    Raises what :func:`decode_chunk` raises, :class:`CorruptChunkError` when the file ends
    before its header says, and ``OSError`` from the file system. Unlike
    :func:`decode_chunk`, a failed read of a raw object leaves part of it in ``out``: pass a
    destination that is discarded on failure (a reserved slot), never a caller's tensor.
    """
    hdr = _file_header(fp, fd, size, expect)
    _check_out(out, fp, hdr.num_tokens)
    on_range = _range_sink(on_block, out)
    if hdr.codec_id == _ID_LZ4_V1:
        buf = _take_scratch(size)
        try:
            obj = memoryview(buf.data)
            _pread_into(fd, obj, 0)
            meta, _ = decode_chunk(fp, obj, expect=expect, out=out, threads=threads,
                                   executor=executor)
        finally:
            _give_scratch(buf)
        _ranges_done(on_range, hdr.raw_len, hdr.block_size)
        return meta
    table = bytearray(hdr.table_len)
    _pread_into(fd, memoryview(table), HEADER_SIZE)
    entries, offsets = _block_layout(hdr, table)
    if hdr.codec_id == _ID_TAGGED:
        _read_tagged_into(fd, hdr, table, offsets[0], out, on_block, on_range)
        return hdr.meta(stored_bytes=size)
    if hdr.codec_id == _ID_RAW and (on_block is None or on_range is not on_block):
        # No Python callable to report to: one native call reads, checks and copies on.
        _native().raw_read(fd, offsets[0], table, num_blocks=hdr.num_blocks,
                           block_size=hdr.block_size, out=_as_bytes(out),
                           copy=_copy_of(on_block))
        return hdr.meta(stored_bytes=size)
    dst = memoryview(_as_bytes(out).data)
    crc = _block_crc(hdr)

    def read_block(i: int) -> None:
        start = i * hdr.block_size
        block = dst[start : start + entries[i][0]]
        _pread_into(fd, block, offsets[i])
        if crc(block) != entries[i][1]:
            raise CorruptChunkError(f"chunk payload checksum mismatch in block {i}")
        if on_range is not None:
            on_range(start, start + entries[i][0])

    _run_blocks(read_block, hdr.num_blocks, threads, executor)
    return hdr.meta(stored_bytes=size)


def read_chunk_to(fp: Fingerprint, fd: int, size: int, copy: ChunkCopy, *,
                  expect: ChunkMeta | None = None) -> ChunkMeta:
    """Read, verify and decode the chunk object in the open file ``fd`` (``size`` bytes)
    straight into ``copy``'s runs (a caller's tensor, :class:`~musacache.engine.tee.Tee`), with no
    chunk-sized destination in between: a raw object a block at a time through one reused
    block buffer, a tagged one a 32 KiB strip at a time, each block checked before any of
    its bytes is copied. The runs then hold only verified bytes, whatever happens.

    The read stops early, without an error, once the copy's tee is closed: the caller tells
    a complete read by ``copy.written``. Raises what :func:`read_chunk_into` raises, and
    :class:`InvalidInputError` when ``copy`` does not take the chunk's bytes."""
    hdr = _file_header(fp, fd, size, expect)
    if copy.nbytes != hdr.raw_len or hdr.raw_len != fp.spec.nbytes(hdr.num_tokens):
        raise InvalidInputError(f"the destination takes {copy.nbytes} bytes, the chunk holds "
                                f"{hdr.raw_len} ({hdr.num_tokens} tokens)")
    if hdr.codec_id not in (_ID_TAGGED, _ID_RAW):
        # An older format version: decode into a chunk tensor, then copy (rare: no fast path).
        tmp = torch.empty(fp.spec.shape(hdr.num_tokens), dtype=fp.spec.dtype, device="cpu")
        read_chunk_into(fp, fd, size, tmp, expect=expect)
        copy.copy(_as_bytes(tmp), 0)
        return hdr.meta(stored_bytes=size)
    table = bytearray(hdr.table_len)
    _pread_into(fd, memoryview(table), HEADER_SIZE)
    _, offsets = _block_layout(hdr, table)
    if hdr.codec_id == _ID_RAW:
        block = _take_scratch(min(hdr.block_size, hdr.raw_len))
        try:
            _native().raw_read_runs(fd, offsets[0], table, num_blocks=hdr.num_blocks,
                                    block_size=hdr.block_size, raw_len=hdr.raw_len,
                                    scratch=block, copy=copy)
        finally:
            _give_scratch(block)
        return hdr.meta(stored_bytes=size)
    _tagged_from_file(fd, hdr, table, offsets[0], None, copy)
    return hdr.meta(stored_bytes=size)


def _ranges_done(on_block: Callable[[int, int], None] | None, nbytes: int,
                 block_size: int) -> None:
    """Report ``[0, nbytes)`` to ``on_block`` a block at a time (a codec whose last step, the
    unshuffle, writes the whole destination at once)."""
    if on_block is None:
        return
    for start in range(0, nbytes, block_size):
        on_block(start, min(nbytes, start + block_size))


def _copy_of(on_block: Callable[[int, int], None] | None) -> ChunkCopy | None:
    copy = getattr(on_block, "native_copy", None)
    return copy if copy is not None and isinstance(copy, _native().ChunkCopy) else None


def _range_sink(on_block: Callable[[int, int], None] | None,
                out: torch.Tensor) -> Callable[[int, int], None] | None:
    """``on_block`` for the paths that report whole verified ranges of ``out``: with a native
    copy, the ranges are copied from ``out`` in native code (no Python per element run)."""
    copy = _copy_of(on_block)
    if copy is None:
        return on_block
    flat = memoryview(_as_bytes(out).data)

    def copy_range(start: int, end: int) -> None:
        copy.copy(flat[start:end], start)

    return copy_range


def _read_tagged_into(fd: int, hdr: ChunkHeader, table: bytearray, payload_at: int,
                      out: torch.Tensor, on_block: Callable[[int, int], None] | None,
                      on_range: Callable[[int, int], None] | None) -> None:
    """The tagged payload of a file in one native call
    (:func:`~musacache._native.tagged_read`): the unshuffle into ``out`` goes a 32 KiB
    strip at a time, each strip copied on into a :class:`ChunkCopy` while it is in cache, and
    each block is read into a slot of a ring of a few blocks, checked and decoded there (raw
    ones used in place) just before the first strip that needs it, so the bytes are touched
    while they are in cache. Every strip written comes from verified blocks."""
    copy = _copy_of(on_block)
    _tagged_from_file(fd, hdr, table, payload_at, _as_bytes(out), copy)
    if copy is None:
        # The unshuffle wrote all of ``out`` at once: its ranges are final only now.
        _ranges_done(on_range, hdr.raw_len, hdr.block_size)


def _file_header(fp: Fingerprint, fd: int, size: int,
                 expect: ChunkMeta | None) -> ChunkHeader:
    """The header of the chunk object in the open file ``fd`` (``size`` bytes), checked
    against ``fp``, ``expect`` and the size."""
    head = bytearray(HEADER_SIZE)
    _pread_into(fd, memoryview(head), 0)
    hdr = read_header(head)
    _check_header(fp, hdr, expect, size)
    return hdr


def _tagged_from_file(fd: int, hdr: ChunkHeader, table: bytearray, payload_at: int,
                      out: np.ndarray | None, copy: ChunkCopy | None) -> None:
    """One native call (:func:`~musacache._native.tagged_read`) over the tagged payload at
    ``payload_at`` of the file ``fd``, into ``out`` (bytes) and/or ``copy``, through a reused
    ring of a few blocks."""
    n = _native()
    ring = _take_scratch(n.tagged_ring_bytes(num_blocks=hdr.num_blocks,
                                             block_size=hdr.block_size, itemsize=hdr.itemsize))
    try:
        n.tagged_read(fd, payload_at, table, payload_len=hdr.payload_len,
                      num_blocks=hdr.num_blocks, block_size=hdr.block_size,
                      raw_len=hdr.raw_len, itemsize=hdr.itemsize, ring=ring, out=out,
                      copy=copy)
    finally:
        _give_scratch(ring)


def _decode_blocks(view: memoryview, hdr: ChunkHeader, offsets: list[int],
                   entries: Sequence[tuple[int, int]], target: np.ndarray, *,
                   verify_first: bool, threads: int,
                   executor: Executor | None) -> None:
    crc = _block_crc(hdr)

    def check_block(i: int) -> memoryview:
        stored = view[offsets[i] : offsets[i + 1]]
        if crc(stored) != entries[i][1]:
            raise CorruptChunkError(f"chunk payload checksum mismatch in block {i}")
        return stored

    def decode_block(i: int) -> None:
        stored = view[offsets[i] : offsets[i + 1]] if verify_first else check_block(i)
        start = i * hdr.block_size
        raw_block = min(hdr.block_size, hdr.raw_len - start)
        if len(stored) == raw_block:
            target[start : start + raw_block] = np.frombuffer(stored, dtype=np.uint8)
            return
        try:
            _native().lz4_decode(stored, target[start : start + raw_block])
        except CorruptChunkError as e:
            raise CorruptChunkError(f"chunk block {i} does not decompress: {e}") from e

    if verify_first:
        _run_blocks(check_block, hdr.num_blocks, threads, executor)
    _run_blocks(decode_block, hdr.num_blocks, threads, executor)
