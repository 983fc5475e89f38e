"""Checked wrappers over the native module ``musacache._native_lib``.

The C code trusts its arguments, so every bound (buffer extents, row sizes, slot ranges,
lengths, thread counts) is checked here before C is called, and a C status code is turned
into :class:`NativeError`. cffi's API mode releases the GIL around every call, so the copies
and the shuffle run in parallel with Python threads (the cache's ``Executor``).

The module is loaded and its version checked at import, as cryptography does: a missing or
stale build raises :class:`NativeBuildError` that says how to rebuild.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar, overload

import numpy as np

from . import _version
from ._errors import (
    ConfigError,
    CorruptChunkError,
    InvalidInputError,
    NativeBuildError,
    NativeError,
    SlotRangeError,
)

__all__ = [
    "MAX_THREADS",
    "SIMD_LEVELS",
    "built_version",
    "check_build_version",
    "check_slots",
    "crc32c",
    "gather_rows",
    "get_num_threads",
    "get_simd_level",
    "get_streaming_threshold",
    "get_thread_min_bytes",
    "has_streaming_stores",
    "lz4_decode",
    "max_simd_level",
    "nib_decode",
    "nib_encode",
    "nib_size",
    "raw_read",
    "raw_read_runs",
    "runs_copy",
    "scatter_rows",
    "set_num_threads",
    "set_simd_level",
    "set_streaming_threshold",
    "set_thread_min_bytes",
    "shuffle",
    "tagged_decode",
    "tagged_read",
    "tagged_ring_bytes",
    "unshuffle",
    "ChunkCopy",
]

#: Ints the row copies take: a sequence, or an int array (a request's table of addresses).
Ints = Sequence[int] | np.ndarray[Any, Any]

REBUILD_HINT = "rebuild it from the source tree with `pip install -e .` (or `pip install .`)"

try:
    from ._native_lib import ffi, lib
except ImportError as exc:
    raise NativeBuildError(
        f"the native module musacache._native_lib is missing or cannot be loaded ({exc}); "
        f"{REBUILD_HINT}"
    ) from exc

#: The most threads one call may use (the C side caps at the same number).
MAX_THREADS = 256
#: Names of the SIMD levels accepted by :func:`set_simd_level`, lowest first.
SIMD_LEVELS = ("none", "sse2", "avx2", "avx512")
_DEFAULT_MAX_THREADS = 8
_THREADS_ENV = "MUSACACHE_NATIVE_THREADS"

_STATUS_NAMES = {
    lib.MC_ERR_ARGUMENT: "invalid argument",
    lib.MC_ERR_SLOT_RANGE: "slot out of range",
    lib.MC_ERR_NO_MEMORY: "out of memory",
    lib.MC_ERR_NO_GAIN: "no gain",
    lib.MC_ERR_CORRUPT: "corrupt input",
    lib.MC_ERR_CHECKSUM: "checksum mismatch",
    lib.MC_ERR_IO: "read failed",
    lib.MC_ERR_TRUNCATED: "truncated",
}


# -- build check ----------------------------------------------------------------------------


def built_version() -> str:
    """The musacache version the native module was compiled from."""
    return str(ffi.string(lib.mc_version()).decode("ascii"))


def check_build_version(expected: str | None = None) -> None:
    """Raise NativeBuildError unless the native module was built from this package version."""
    want = _version.__version__ if expected is None else expected
    built = built_version()
    if built != want:
        raise NativeBuildError(
            f"the native module musacache._native_lib was built for musacache {built}, but the "
            f"package is {want}; {REBUILD_HINT}"
        )


check_build_version()


def _check_status(status: int, what: str) -> None:
    if status != lib.MC_OK:
        name = _STATUS_NAMES.get(status, "unknown status")
        raise NativeError(f"native {what} failed with status {status} ({name})")


# -- threads --------------------------------------------------------------------------------

_num_threads: int | None = None


def _check_thread_count(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise InvalidInputError(f"{what} must be an int in [1, {MAX_THREADS}], got {n!r}")
    return n


def _default_threads() -> int:
    raw = os.environ.get(_THREADS_ENV)
    if raw is None or raw.strip() == "":
        return max(1, min(os.cpu_count() or 1, _DEFAULT_MAX_THREADS))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_THREADS:
        raise ConfigError(f"{_THREADS_ENV}={raw!r} must be an int in [1, {MAX_THREADS}]")
    return value


def get_num_threads() -> int:
    """Threads a gather/scatter call uses when it is not told otherwise.

    Defaults to ``os.cpu_count()`` capped at 8; ``MUSACACHE_NATIVE_THREADS`` overrides that.
    """
    global _num_threads
    if _num_threads is None:
        _num_threads = _default_threads()
    return _num_threads


def set_num_threads(n: int) -> None:
    """Set the default thread count of gather/scatter calls (1 to ``MAX_THREADS``)."""
    global _num_threads
    _num_threads = _check_thread_count(n, "the number of native threads")


# -- settings -------------------------------------------------------------------------------


def has_streaming_stores() -> bool:
    """Whether large copies can use non-temporal stores on this CPU and build."""
    out = ffi.new("int *")
    _check_status(lib.mc_has_streaming_stores(out), "has_streaming_stores")
    return bool(out[0])


def get_streaming_threshold() -> int:
    """Total bytes above which one gather/scatter call uses streaming stores."""
    out = ffi.new("int64_t *")
    _check_status(lib.mc_get_streaming_threshold(out), "get_streaming_threshold")
    return int(out[0])


def set_streaming_threshold(nbytes: int | None) -> None:
    """Set the streaming-store threshold in bytes; ``None`` restores the cache-size default."""
    if nbytes is None:
        value = -1
    elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidInputError(f"the streaming threshold must be an int >= 0, got {nbytes!r}")
    else:
        value = nbytes
    _check_status(lib.mc_set_streaming_threshold(value), "set_streaming_threshold")


def get_thread_min_bytes() -> int:
    """A call uses at most one thread per this many bytes it copies."""
    out = ffi.new("int64_t *")
    _check_status(lib.mc_get_thread_min_bytes(out), "get_thread_min_bytes")
    return int(out[0])


def set_thread_min_bytes(nbytes: int | None) -> None:
    """Set the bytes each extra thread must have to copy; ``None`` restores the default
    (2 MiB), 0 lets small calls use every thread (tests use it to reach the threaded path)."""
    if nbytes is None:
        value = -1
    elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidInputError(f"the thread minimum must be an int >= 0, got {nbytes!r}")
    else:
        value = nbytes
    _check_status(lib.mc_set_thread_min_bytes(value), "set_thread_min_bytes")


def max_simd_level() -> str:
    """The best SIMD level the CPU supports (one of ``SIMD_LEVELS``)."""
    out = ffi.new("int *")
    _check_status(lib.mc_max_simd_level(out), "max_simd_level")
    return SIMD_LEVELS[out[0]]


def get_simd_level() -> str:
    """The SIMD level the kernels use now (one of ``SIMD_LEVELS``)."""
    out = ffi.new("int *")
    _check_status(lib.mc_get_simd_level(out), "get_simd_level")
    return SIMD_LEVELS[out[0]]


def set_simd_level(level: str) -> str:
    """Cap the SIMD level (tests use it to reach every kernel); returns the level in effect."""
    if level not in SIMD_LEVELS:
        raise InvalidInputError(f"unknown SIMD level {level!r}; use one of {SIMD_LEVELS}")
    _check_status(lib.mc_set_simd_level(SIMD_LEVELS.index(level)), "set_simd_level")
    return get_simd_level()


# -- paged <-> dense rows -------------------------------------------------------------------


def _check_nonneg(name: str, value: object, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def slot_range_at(ptr: int, n: int) -> tuple[int, int] | None:
    """The least and greatest of ``n >= 1`` int64 values at address ``ptr`` (memory the
    caller holds), or None from a module built before ``mc_slot_range``."""
    fn = getattr(lib, "mc_slot_range", None)
    if fn is None:
        return None
    out = ffi.new("int64_t[2]")
    _check_status(fn(ptr, n, out, out + 1), "slot_range")
    return int(out[0]), int(out[1])


def check_slots(slots: np.ndarray[Any, Any], num_slots: int) -> bool:
    """Check a slot array: 1-D C-contiguous int64 with every entry -1 or in [0, num_slots).
    Returns whether any entry is -1 (a token with no slot), which the check's minimum tells
    for free.

    Raises SlotRangeError naming the first bad index and its value.
    """
    if not isinstance(slots, np.ndarray) or slots.dtype != np.int64 or slots.ndim != 1:
        raise InvalidInputError(
            f"slots must be a 1-D int64 numpy array, got {type(slots).__name__}"
            + (f" {slots.dtype} of rank {slots.ndim}" if isinstance(slots, np.ndarray) else "")
        )
    if not slots.flags.c_contiguous:
        raise InvalidInputError("slots must be C-contiguous")
    if slots.size == 0:
        return False
    lo = int(slots.min())
    if lo >= -1 and int(slots.max()) < num_slots:
        return lo == -1
    bad = np.flatnonzero((slots < -1) | (slots >= num_slots))
    first = int(bad[0])
    raise SlotRangeError(
        f"slot_mapping[{first}] = {int(slots[first])} is outside the paged cache "
        f"[0, {num_slots}) (only -1 may mean skip)"
    )


def _max_row_offset(num_slots: int, block_size: int, block_stride: int, slot_stride: int) -> int:
    """The largest byte offset of a row of any slot in [0, num_slots), from the plane base.

    Offsets grow with the offset inside a block and with the block index, so the largest is
    the last slot's or the last slot of the block before it.
    """
    def offset(slot: int) -> int:
        return (slot // block_size) * block_stride + (slot % block_size) * slot_stride

    last = num_slots - 1
    best = offset(last)
    before_last_block = last - last % block_size - 1
    if before_last_block >= 0:
        best = max(best, offset(before_last_block))
    return best


def _int_array(name: str, values: int | Ints, count: int) -> np.ndarray[Any, Any]:
    """``values`` (one int for all, or one per plane) as a 1-D int64 array of ``count``."""
    if isinstance(values, bool):
        raise InvalidInputError(f"{name} must be ints, got {values!r}")
    array = np.full(count, values, dtype=np.int64) if isinstance(values, int) else (
        np.asarray(values))
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError(f"{name} must be a sequence of ints, got {array.dtype} "
                                f"of shape {array.shape}")
    if array.shape[0] != count:
        raise InvalidInputError(f"{name} has {array.shape[0]} entries, expected {count}")
    return array.astype(np.int64, copy=False)


def _plane_array(name: str, planes: Ints, count: int) -> Any:
    """The plane addresses as a C ``uintptr_t[]`` (kept alive by the returned array)."""
    array = _int_array(name, planes, count)
    if array.size and int(array.min()) <= 0:
        first = int(np.flatnonzero(array <= 0)[0])
        raise InvalidInputError(f"{name}[{first}] must be a non-null address, got "
                                f"{int(array[first])}")
    return array.astype(np.uint64)


def _check_extents(name: str, extents: int | Ints, count: int, need: int,
                   what: str) -> None:
    array = _int_array(name, extents, count)
    if array.size and int(array.min()) < need:
        first = int(np.flatnonzero(array < need)[0])
        raise InvalidInputError(f"{name}[{first}] is {int(array[first])} bytes but {what} "
                                f"reach byte {need}")


def _transfer_rows(
    fn: Any,
    what: str,
    paged_planes: Ints,
    dense_planes: Ints,
    slots: np.ndarray[Any, Any],
    *,
    row_bytes: int,
    num_slots: int,
    paged_extents: int | Ints,
    dense_extents: int | Ints,
    block_size: int,
    block_stride: int | None,
    slot_stride: int | None,
    dense_row_stride: int | None,
    threads: int | None,
    chunk_starts: Ints | None = None,
    check_only: bool = False,
) -> None:
    num_planes = len(paged_planes)
    _check_nonneg("row_bytes", row_bytes)
    _check_nonneg("num_slots", num_slots)
    _check_nonneg("block_size", block_size, minimum=1)
    slot_stride = row_bytes if slot_stride is None else _check_nonneg("slot_stride", slot_stride)
    block_stride = (block_size * slot_stride if block_stride is None
                    else _check_nonneg("block_stride", block_stride))
    dense_row_stride = (row_bytes if dense_row_stride is None
                        else _check_nonneg("dense_row_stride", dense_row_stride))
    nthreads = get_num_threads() if threads is None else _check_thread_count(threads, "threads")
    check_slots(slots, num_slots)
    num_tokens = int(slots.shape[0])

    # Rows that overlap each other would make a scatter depend on copy order.
    if block_size > 1 and slot_stride < row_bytes:
        raise InvalidInputError(f"slot_stride {slot_stride} is smaller than row_bytes {row_bytes}")
    if num_slots > block_size and block_stride < (block_size - 1) * slot_stride + row_bytes:
        raise InvalidInputError(
            f"block_stride {block_stride} is smaller than one block of rows "
            f"({block_size} x {slot_stride}-byte stride, {row_bytes}-byte rows)"
        )
    if num_tokens > 1 and dense_row_stride < row_bytes:
        raise InvalidInputError(
            f"dense_row_stride {dense_row_stride} is smaller than row_bytes {row_bytes}"
        )

    starts = _chunk_starts(chunk_starts, num_tokens)
    num_chunks = len(starts) - 1
    paged = _plane_array("paged_planes", paged_planes, num_planes)
    dense = _plane_array("dense_planes", dense_planes, num_planes * num_chunks)
    if num_slots > 0 and row_bytes > 0:
        need = _max_row_offset(num_slots, block_size, block_stride, slot_stride) + row_bytes
        _check_extents("paged_extents", paged_extents, num_planes, need, "slot rows")
    else:
        _int_array("paged_extents", paged_extents, num_planes)
    # Each chunk's dense planes must hold that chunk's rows.
    rows = np.repeat(np.diff(starts), num_planes)
    need_dense = np.where(rows > 0, (rows - 1) * dense_row_stride + row_bytes, 0)
    extents = _int_array("dense_extents", dense_extents, num_planes * num_chunks)
    short = np.flatnonzero(extents < need_dense) if row_bytes > 0 else np.empty(0)
    if short.size:
        first = int(short[0])
        raise InvalidInputError(f"dense_extents[{first}] is {int(extents[first])} bytes but "
                                f"{int(rows[first])} rows reach byte {int(need_dense[first])}")
    if check_only:
        return

    copy = ffi.new("mc_row_copy *")
    paged_buf = ffi.from_buffer("uintptr_t[]", paged)
    dense_buf = ffi.from_buffer("uintptr_t[]", dense)
    copy.paged_planes = ffi.cast("char *const *", paged_buf)
    copy.dense_planes = ffi.cast("char *const *", dense_buf)
    copy.num_planes = num_planes
    copy.row_bytes = row_bytes
    copy.block_size = block_size
    copy.block_stride = block_stride
    copy.slot_stride = slot_stride
    copy.num_slots = num_slots
    copy.dense_row_stride = dense_row_stride
    slot_buf = ffi.from_buffer("int64_t[]", slots)
    copy.slots = slot_buf
    copy.num_tokens = num_tokens
    copy.num_chunks = num_chunks
    starts_buf = ffi.from_buffer("int64_t[]", starts)
    copy.chunk_starts = starts_buf if num_chunks > 1 else ffi.NULL
    _check_status(fn(copy, nthreads), what)


def _chunk_starts(chunk_starts: Ints | None, num_tokens: int) -> np.ndarray[Any, Any]:
    """The chunk boundaries as a checked int64 array from 0 to ``num_tokens``."""
    if chunk_starts is None:
        return np.array([0, num_tokens], dtype=np.int64)
    starts = np.ascontiguousarray(_int_array("chunk_starts", chunk_starts, len(chunk_starts)))
    if starts.size < 2:
        raise InvalidInputError(f"chunk_starts needs at least 2 entries (0 and the token "
                                f"count), got {starts.size}")
    if int(starts[0]) != 0 or int(starts[-1]) != num_tokens:
        raise InvalidInputError(f"chunk_starts must run from 0 to {num_tokens} tokens, got "
                                f"{int(starts[0])} to {int(starts[-1])}")
    if bool((np.diff(starts) < 0).any()):
        raise InvalidInputError("chunk_starts must not decrease")
    return starts


def gather_rows(
    paged_planes: Ints,
    dense_planes: Ints,
    slots: np.ndarray[Any, Any],
    *,
    row_bytes: int,
    num_slots: int,
    paged_extents: int | Ints,
    dense_extents: int | Ints,
    block_size: int = 1,
    block_stride: int | None = None,
    slot_stride: int | None = None,
    dense_row_stride: int | None = None,
    threads: int | None = None,
    chunk_starts: Ints | None = None,
    check_only: bool = False,
) -> None:
    """Copy paged rows to dense rows for every plane in one call (many layers, K and V).

    Plane ``p`` is a pair of addresses: ``paged_planes[p]`` (row of slot ``s`` at
    ``(s // block_size) * block_stride + (s % block_size) * slot_stride``) and
    ``dense_planes[p]`` (row of token ``t`` at ``t * dense_row_stride``). Token ``t`` copies
    ``row_bytes`` bytes from slot ``slots[t]``; a slot of -1 is skipped and its dense row is
    left as it was. ``paged_extents``/``dense_extents`` are the bytes addressable from each
    base (one int for all planes, or one per plane); every row the call can touch is checked
    against them first. Strides default to packed rows. Byte copies, so any dtype works.

    ``chunk_starts`` (``0 = s_0 <= s_1 <= ... <= s_C = len(slots)``) splits the tokens into
    ``C`` chunks with their own dense buffers: ``dense_planes`` then holds ``C * P`` addresses
    (chunk-major: chunk ``k``'s plane ``p`` at ``k * P + p``) and so does ``dense_extents``;
    token ``t`` of chunk ``k`` is row ``t - s_k`` of that chunk's planes. One call moves a
    whole request into its chunk tensors.

    ``check_only``: check every argument as the copy would, and copy nothing (a caller making
    several calls checks them all before the first copies).
    """
    _transfer_rows(lib.mc_gather_rows, "gather", paged_planes, dense_planes, slots,
                   row_bytes=row_bytes, num_slots=num_slots, paged_extents=paged_extents,
                   dense_extents=dense_extents, block_size=block_size,
                   block_stride=block_stride, slot_stride=slot_stride,
                   dense_row_stride=dense_row_stride, threads=threads,
                   chunk_starts=chunk_starts, check_only=check_only)


def scatter_rows(
    paged_planes: Ints,
    dense_planes: Ints,
    slots: np.ndarray[Any, Any],
    *,
    row_bytes: int,
    num_slots: int,
    paged_extents: int | Ints,
    dense_extents: int | Ints,
    block_size: int = 1,
    block_stride: int | None = None,
    slot_stride: int | None = None,
    dense_row_stride: int | None = None,
    threads: int | None = None,
    chunk_starts: Ints | None = None,
    check_only: bool = False,
) -> None:
    """The reverse of :func:`gather_rows`: dense rows to paged rows.

    Threads split the work by plane only, so when a slot repeats, the last token wins.
    """
    _transfer_rows(lib.mc_scatter_rows, "scatter", paged_planes, dense_planes, slots,
                   row_bytes=row_bytes, num_slots=num_slots, paged_extents=paged_extents,
                   dense_extents=dense_extents, block_size=block_size,
                   block_stride=block_stride, slot_stride=slot_stride,
                   dense_row_stride=dense_row_stride, threads=threads,
                   chunk_starts=chunk_starts, check_only=check_only)


# -- byte shuffle ---------------------------------------------------------------------------

BufferT = TypeVar("BufferT")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _releases_buffers(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Let go of every buffer ``fn`` took through :func:`_buffer` when it raises.

    A buffer taken with ``ffi.from_buffer`` on a memoryview is an export of that memoryview,
    held by ``fn``'s locals. On an error the traceback keeps those frames alive (an exception
    kept by a future, a log record), and CPython 3.11 crashes when its garbage collector
    clears a memoryview that still has an export (CPython gh-77894: its tp_clear drops the
    view's buffer, and the export's later release reads through NULL); a corrupt chunk
    object decoded from a memoryview did, in a later collection. So the frames of a call
    that raised are cleared (``traceback.clear_frames``), which releases the buffers at once.
    A call that returns frees its locals itself."""

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    return call


def _buffer(obj: object, *, writable: bool, what: str) -> tuple[Any, int, int]:
    """(uint8_t pointer, byte length, address) of a C-contiguous CPU buffer or torch tensor.
    Its caller is wrapped in :func:`_releases_buffers`."""
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "is_contiguous"):
        # A torch tensor: no buffer protocol, and bf16 has no numpy dtype, so use its pointer.
        # The caller holds the tensor for the duration of the call.
        tensor: Any = obj
        if tensor.device.type != "cpu":
            raise InvalidInputError(f"{what} is a {tensor.device} tensor; it must be on the CPU")
        if not tensor.is_contiguous():
            raise InvalidInputError(f"{what} must be a contiguous tensor")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        address = int(data_ptr())
        return ffi.cast("uint8_t *", address), nbytes, address
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            f"{what} must be a bytes-like object or a CPU tensor, got {type(obj).__name__}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise InvalidInputError(f"{what} must be C-contiguous")
        if writable and view.readonly:
            raise InvalidInputError(f"{what} must be writable, got a read-only buffer")
        nbytes = view.nbytes
    pointer = ffi.from_buffer("uint8_t[]", obj, require_writable=writable)
    return pointer, nbytes, int(ffi.cast("uintptr_t", pointer))


def _check_itemsize(itemsize: object) -> int:
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise InvalidInputError(f"itemsize must be an int >= 1, got {itemsize!r}")
    return itemsize


@_releases_buffers
def _shuffle_common(fn: Any, what: str, src: object, itemsize: int, out: Any) -> Any:
    size = _check_itemsize(itemsize)
    src_ptr, nbytes, src_addr = _buffer(src, writable=False, what="src")
    result = bytearray(nbytes) if out is None else out
    out_ptr, out_nbytes, out_addr = _buffer(result, writable=True, what="out")
    if out_nbytes != nbytes:
        raise InvalidInputError(f"out holds {out_nbytes} bytes, src holds {nbytes}")
    if nbytes and src_addr < out_addr + nbytes and out_addr < src_addr + nbytes:
        raise InvalidInputError(f"out overlaps src; {what} cannot work in place")
    _check_status(fn(src_ptr, out_ptr, nbytes, size), what)
    return result


@overload
def shuffle(src: object, itemsize: int, out: None = None) -> bytearray: ...
@overload
def shuffle(src: object, itemsize: int, out: BufferT) -> BufferT: ...
def shuffle(src: object, itemsize: int, out: Any = None) -> Any:
    """Byte-shuffle ``src`` (blosc's filter): byte ``j`` of every element goes to plane ``j``.

    ``src`` is any C-contiguous buffer (bytes, bytearray, memoryview, numpy array, or a
    contiguous CPU torch tensor). Trailing bytes that do not fill an element are copied as
    they are. Writes into ``out`` (a writable buffer of the same byte length, not overlapping
    ``src``) and returns it, or returns a new bytearray.
    """
    return _shuffle_common(lib.mc_shuffle, "shuffle", src, itemsize, out)


@overload
def unshuffle(src: object, itemsize: int, out: None = None) -> bytearray: ...
@overload
def unshuffle(src: object, itemsize: int, out: BufferT) -> BufferT: ...
def unshuffle(src: object, itemsize: int, out: Any = None) -> Any:
    """The inverse of :func:`shuffle` for the same ``itemsize``."""
    return _shuffle_common(lib.mc_unshuffle, "unshuffle", src, itemsize, out)


# -- checksum and nibble coder ----------------------------------------------------------------

#: Fixed bytes of a nibble-coded block (book, padding, escape count); see :func:`nib_encode`.
NIB_OVERHEAD = 20
#: The largest plane :func:`nib_encode` codes (escape positions are 32-bit).
NIB_MAX_BYTES = 2**31 - 1
_U32_MAX = 2**32 - 1


def _overlaps(a_addr: int, a_len: int, b_addr: int, b_len: int) -> bool:
    return a_len > 0 and b_len > 0 and a_addr < b_addr + b_len and b_addr < a_addr + a_len


@_releases_buffers
def crc32c(data: object, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value`` as ``zlib.crc32`` does:
    ``crc32c(b, crc32c(a)) == crc32c(a + b)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U32_MAX:
        raise InvalidInputError(f"value must be an int in [0, 2**32), got {value!r}")
    ptr, nbytes, _ = _buffer(data, writable=False, what="data")
    out = ffi.new("uint32_t *")
    _check_status(lib.mc_crc32c(ptr, nbytes, value, out), "crc32c")
    return int(out[0])


@_releases_buffers
def nib_size(coded: object, nbytes: int) -> int:
    """The exact size a nibble-coded block of ``nbytes`` bytes must have, from its escape
    count; raises :class:`CorruptChunkError` when ``coded`` is too short to hold one."""
    ptr, length, _ = _buffer(coded, writable=False, what="coded")
    if length < NIB_OVERHEAD:
        raise CorruptChunkError(f"nibble-coded block is {length} bytes, the fixed part "
                                f"alone is {NIB_OVERHEAD}")
    escapes = int.from_bytes(bytes(ffi.buffer(ptr + 16, 4)), "little")
    return NIB_OVERHEAD + (nbytes + 1) // 2 + 5 * escapes


@_releases_buffers
def nib_encode(src: object, out: object) -> int | None:
    """Nibble-code the bytes of ``src`` into the start of ``out`` (a writable buffer not
    overlapping ``src``) and return the coded size, or None when coding would not make the
    block smaller (``out`` is then unused). The coded size is always below ``len(src)``, so an
    ``out`` as long as ``src`` always fits. ``src`` holds at most :data:`NIB_MAX_BYTES`.
    """
    src_ptr, nbytes, src_addr = _buffer(src, writable=False, what="src")
    out_ptr, cap, out_addr = _buffer(out, writable=True, what="out")
    if nbytes > NIB_MAX_BYTES:
        raise InvalidInputError(f"src holds {nbytes} bytes, the coder takes at most "
                                f"{NIB_MAX_BYTES}")
    if cap < nbytes:
        raise InvalidInputError(f"out holds {cap} bytes, it needs {nbytes} (as many as src)")
    if _overlaps(src_addr, nbytes, out_addr, cap):
        raise InvalidInputError("out overlaps src")
    size = ffi.new("int64_t *")
    status = lib.mc_nib_encode(src_ptr, nbytes, out_ptr, cap, size)
    if status == lib.MC_ERR_NO_GAIN:
        return None
    _check_status(status, "nib_encode")
    return int(size[0])


@_releases_buffers
def nib_decode(coded: object, out: object) -> None:
    """Decode a block written by :func:`nib_encode` into all of ``out`` (a writable buffer as
    long as the original block). Raises :class:`CorruptChunkError` when ``coded`` is not the
    exact coding of ``len(out)`` bytes (``out`` may then hold garbage)."""
    src_ptr, length, src_addr = _buffer(coded, writable=False, what="coded")
    out_ptr, nbytes, out_addr = _buffer(out, writable=True, what="out")
    if nbytes > NIB_MAX_BYTES:
        raise InvalidInputError(f"out holds {nbytes} bytes, the coder takes at most "
                                f"{NIB_MAX_BYTES}")
    if _overlaps(src_addr, length, out_addr, nbytes):
        raise InvalidInputError("out overlaps coded")
    want = nib_size(coded, nbytes)
    if length != want:
        raise CorruptChunkError(f"nibble-coded block is {length} bytes, its escape count "
                                f"says {want} for {nbytes} bytes")
    status = lib.mc_nib_decode(src_ptr, length, out_ptr, nbytes)
    if status == lib.MC_ERR_CORRUPT:
        raise CorruptChunkError("nibble-coded block is inconsistent (escapes or padding)")
    _check_status(status, "nib_decode")


# -- chunk decode into its destinations (codec.py's tagged blocks) ---------------------------


@_releases_buffers
def lz4_decode(block: object, out: object) -> None:
    """Decode an LZ4 block (the format of ``lz4.block.compress(..., store_size=False)``) into
    all of ``out``, a writable buffer of exactly the decoded size. Raises
    :class:`CorruptChunkError` when ``block`` is malformed or decodes to another size; nothing
    outside ``out`` is written either way (``out`` may then hold garbage)."""
    src_ptr, length, src_addr = _buffer(block, writable=False, what="block")
    out_ptr, nbytes, out_addr = _buffer(out, writable=True, what="out")
    if _overlaps(src_addr, length, out_addr, nbytes):
        raise InvalidInputError("out overlaps block")
    status = lib.mc_lz4_decode(src_ptr, length, out_ptr, nbytes)
    if status == lib.MC_ERR_CORRUPT:
        raise CorruptChunkError(f"lz4 block of {length} bytes does not decode to {nbytes} bytes")
    _check_status(status, "lz4_decode")


class ChunkCopy:
    """A second destination for a chunk's decoded bytes: ``addrs[r]`` receives bytes
    ``[r * run_bytes, (r + 1) * run_bytes)`` of the chunk. The native decode writes it a strip
    at a time; :meth:`close` stops that (it returns once no copy is in progress, at most one
    strip of 32 KiB later), and :attr:`written` counts the bytes copied so far.

    The caller owns the memory behind ``addrs`` and keeps it alive while the copy is open; the
    addresses are not checked (``_tee.Tee`` derives them from a tensor's strides)."""

    def __init__(self, addrs: np.ndarray[Any, Any], run_bytes: int) -> None:
        if addrs.dtype != np.uint64 or addrs.ndim != 1 or not addrs.flags.c_contiguous:
            raise InvalidInputError("addrs must be a contiguous 1-D uint64 array")
        if run_bytes <= 0:
            raise InvalidInputError(f"run_bytes must be > 0, got {run_bytes}")
        self.nbytes = int(addrs.size) * run_bytes
        # Kept alive: the C struct points into it (from_buffer, not ``addrs.ctypes``: a tee
        # is made on the loop for each chunk a get reads from disk, and this is 1 µs less).
        self._addrs = ffi.from_buffer("uint64_t[]", addrs)
        self._tee = ffi.new("mc_tee *")
        self._runs = ffi.new("mc_runs *")
        self._runs.addrs = self._addrs
        self._runs.num_runs = int(addrs.size)
        self._runs.run_bytes = run_bytes
        self._runs.tee = self._tee

    @property
    def written(self) -> int:
        return int(self._tee.written)

    @property
    def closed(self) -> bool:
        return bool(self._tee.closed)

    def close(self) -> None:
        _check_status(lib.mc_tee_close(self._tee), "tee_close")

    @_releases_buffers
    def copy(self, src: object, offset: int) -> None:
        """Copy the bytes of ``src`` to chunk bytes ``[offset, offset + len(src))`` (nothing
        once closed)."""
        ptr, nbytes, _ = _buffer(src, writable=False, what="src")
        _check_status(lib.mc_runs_copy(self._runs, ptr, offset, nbytes), "runs_copy")


def runs_copy(copy: ChunkCopy, src: object, offset: int) -> None:
    """:meth:`ChunkCopy.copy`."""
    copy.copy(src, offset)


@_releases_buffers
def _tagged_dests(out: object | None, copy: ChunkCopy | None, raw_len: int, tab_len: int,
                  num_blocks: int) -> tuple[Any, int]:
    """The checks ``tagged_decode`` and ``tagged_read`` share: ``out`` (its pointer and
    address) and ``copy`` against the chunk, and the table's length."""
    if out is None:
        if copy is None:
            raise InvalidInputError("a tagged decode needs out or copy (or both)")
        out_ptr, out_len, out_addr = ffi.NULL, raw_len, 0
    else:
        out_ptr, out_len, out_addr = _buffer(out, writable=True, what="out")
    if tab_len != 8 * num_blocks:
        raise InvalidInputError(f"table holds {tab_len} bytes, {num_blocks} blocks need "
                                f"{8 * num_blocks}")
    if out_len != raw_len:
        raise InvalidInputError(f"out holds {out_len} bytes, the chunk is {raw_len}")
    if copy is not None and copy.nbytes != raw_len:
        raise InvalidInputError(f"the copy takes {copy.nbytes} bytes, the chunk is {raw_len}")
    return out_ptr, out_addr


@_releases_buffers
def tagged_decode(payload: object, table: object, *, num_blocks: int, block_size: int,
                  raw_len: int, itemsize: int, scratch: object, out: object | None,
                  copy: ChunkCopy | None = None) -> None:
    """Verify and decode a payload of tagged blocks (``codec.py``'s codec id 2) into ``out``
    (``raw_len`` bytes), unshuffled for ``itemsize`` > 1, and copy it on into ``copy`` a strip
    at a time. ``table`` is the object's block table as stored; ``scratch`` (at least
    ``raw_len`` bytes, overlapping nothing else) receives the coded blocks' decoded planes.
    Every block is checked before ``out`` or ``copy`` is written, so on an error neither was
    touched.

    ``out`` may be None when ``copy`` is given: the copy's runs are then the only
    destination (a read straight into a caller's tensor), and the decode stops once the
    copy's tee is closed; the caller tells a complete decode by ``copy.written``.

    Raises :class:`CorruptChunkError` naming the block whose checksum does not match or
    whose coding is invalid.
    """
    pay_ptr, pay_len, pay_addr = _buffer(payload, writable=False, what="payload")
    tab_ptr, tab_len, _ = _buffer(table, writable=False, what="table")
    scr_ptr, scr_len, scr_addr = _buffer(scratch, writable=True, what="scratch")
    out_ptr, out_addr = _tagged_dests(out, copy, raw_len, tab_len, num_blocks)
    if scr_len < raw_len:
        raise InvalidInputError(f"scratch holds {scr_len} bytes, the chunk is {raw_len}")
    if (out is not None and (_overlaps(pay_addr, pay_len, out_addr, raw_len)
                             or _overlaps(scr_addr, scr_len, out_addr, raw_len))) \
            or _overlaps(pay_addr, pay_len, scr_addr, scr_len):
        raise InvalidInputError("payload, scratch and out must not overlap")
    bad = ffi.new("int64_t *")
    status = lib.mc_tagged_decode(pay_ptr, pay_len, tab_ptr, num_blocks, block_size, raw_len,
                                  itemsize, scr_ptr, scr_len, out_ptr,
                                  ffi.NULL if copy is None else copy._runs, bad)
    _check_decode_status(status, int(bad[0]), 0, "tagged_decode")


def tagged_ring_bytes(*, num_blocks: int, block_size: int, itemsize: int) -> int:
    """The size of the ring :func:`tagged_read` reads through: a few blocks (one more than
    ``itemsize``'s planes, no more than the chunk's blocks), whatever the chunk's size."""
    need = int(lib.mc_tagged_ring_bytes(num_blocks, block_size, itemsize))
    if need < 0:
        raise InvalidInputError(f"no tagged payload has {num_blocks} blocks of {block_size} "
                                f"bytes and itemsize {itemsize}")
    return need


@_releases_buffers
def tagged_read(fd: int, file_offset: int, table: object, *, payload_len: int,
                num_blocks: int, block_size: int, raw_len: int, itemsize: int, ring: object,
                out: object | None, copy: ChunkCopy | None = None) -> None:
    """:func:`tagged_decode` of the payload (``payload_len`` bytes) at ``file_offset`` of the
    open file ``fd``: each block is read into a slot of ``ring`` (at least
    :func:`tagged_ring_bytes`), checked and decoded there just before the first strip that
    needs it, so the chunk's bytes pass through a few blocks of cache and never through a
    chunk-sized buffer. An error leaves the strips before it written (in ``out`` and
    ``copy``), all from verified blocks.

    Raises what :func:`tagged_decode` raises, :class:`CorruptChunkError` for a file that ends
    early ("truncated"), and ``OSError`` for a failed read.
    """
    tab_ptr, tab_len, _ = _buffer(table, writable=False, what="table")
    ring_ptr, ring_len, ring_addr = _buffer(ring, writable=True, what="ring")
    out_ptr, out_addr = _tagged_dests(out, copy, raw_len, tab_len, num_blocks)
    need = tagged_ring_bytes(num_blocks=num_blocks, block_size=block_size, itemsize=itemsize)
    if ring_len < need:
        raise InvalidInputError(f"ring holds {ring_len} bytes, {need} are needed")
    if out is not None and _overlaps(ring_addr, ring_len, out_addr, raw_len):
        raise InvalidInputError("ring and out must not overlap")
    bad = ffi.new("int64_t *")
    err = ffi.new("int *")
    status = lib.mc_tagged_read(fd, file_offset, payload_len, tab_ptr, num_blocks, block_size,
                                raw_len, itemsize, ring_ptr, ring_len, out_ptr,
                                ffi.NULL if copy is None else copy._runs, bad, err)
    _check_decode_status(status, int(bad[0]), int(err[0]), "tagged_read")


@_releases_buffers
def raw_read(fd: int, file_offset: int, table: object, *, num_blocks: int, block_size: int,
             out: object, copy: ChunkCopy | None = None) -> None:
    """Read a raw chunk object's payload (``codec.py``'s codec id 3) from ``fd`` at
    ``file_offset`` straight into ``out``, a block at a time, checking each block's CRC-32C
    right after its read and copying the verified block on into ``copy``. Raises what
    :func:`tagged_read` raises; ``out`` then holds part of the chunk, ``copy`` only
    verified blocks."""
    tab_ptr, tab_len, _ = _buffer(table, writable=False, what="table")
    out_ptr, raw_len, _ = _buffer(out, writable=True, what="out")
    _check_raw_table(tab_len, num_blocks, copy, raw_len)
    bad = ffi.new("int64_t *")
    err = ffi.new("int *")
    status = lib.mc_raw_read(fd, file_offset, tab_ptr, num_blocks, block_size, raw_len,
                             out_ptr, ffi.NULL if copy is None else copy._runs, bad, err)
    _check_decode_status(status, int(bad[0]), int(err[0]), "raw_read")


@_releases_buffers
def raw_read_runs(fd: int, file_offset: int, table: object, *, num_blocks: int,
                  block_size: int, raw_len: int, scratch: object, copy: ChunkCopy) -> None:
    """:func:`raw_read` with ``copy``'s runs as the only destination (a read straight into a
    caller's tensor): each block is read into ``scratch`` (at least one block, or the whole
    chunk if smaller), checked there, and copied on. Stops once the copy's tee is closed; the
    caller tells a complete read by ``copy.written``. Raises what :func:`raw_read` raises;
    ``copy`` then holds only verified blocks."""
    tab_ptr, tab_len, _ = _buffer(table, writable=False, what="table")
    scr_ptr, scr_len, _ = _buffer(scratch, writable=True, what="scratch")
    _check_raw_table(tab_len, num_blocks, copy, raw_len)
    if scr_len < min(block_size, raw_len):
        raise InvalidInputError(f"scratch holds {scr_len} bytes, a block is "
                                f"{min(block_size, raw_len)}")
    bad = ffi.new("int64_t *")
    err = ffi.new("int *")
    status = lib.mc_raw_read_runs(fd, file_offset, tab_ptr, num_blocks, block_size, raw_len,
                                  scr_ptr, scr_len, copy._runs, bad, err)
    _check_decode_status(status, int(bad[0]), int(err[0]), "raw_read_runs")


def _check_raw_table(tab_len: int, num_blocks: int, copy: ChunkCopy | None,
                     raw_len: int) -> None:
    """A raw object's block table holds ``num_blocks`` entries, and ``copy`` (if any) takes
    the chunk's ``raw_len`` bytes."""
    if tab_len != 8 * num_blocks:
        raise InvalidInputError(f"table holds {tab_len} bytes, {num_blocks} blocks need "
                                f"{8 * num_blocks}")
    if copy is not None and copy.nbytes != raw_len:
        raise InvalidInputError(f"the copy takes {copy.nbytes} bytes, the chunk is {raw_len}")


def _check_decode_status(status: int, bad: int, err: int, what: str) -> None:
    if status == lib.MC_ERR_CHECKSUM:
        raise CorruptChunkError(f"chunk payload checksum mismatch in block {bad}")
    if status == lib.MC_ERR_CORRUPT:
        if bad < 0:
            raise CorruptChunkError("chunk block lengths do not add up to the payload length")
        raise CorruptChunkError(f"chunk block {bad} is not a valid coding of its raw bytes")
    if status == lib.MC_ERR_TRUNCATED:
        raise CorruptChunkError(f"chunk file ends inside block {bad}, before its header "
                                f"says (truncated)")
    if status == lib.MC_ERR_IO:
        raise OSError(err, f"reading chunk block {bad}: {os.strerror(err)}")
    _check_status(status, what)
