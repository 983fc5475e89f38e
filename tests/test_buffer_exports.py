"""No memoryview stays exported to the native module once a call is over, error or not.

CPython 3.11 crashes when its garbage collector clears a memoryview that still has an export
(gh-77894, fixed in 3.12): the view's tp_clear drops its buffer while the export stands, and
the export's later release reads through NULL. A chunk object decoded from a memoryview that
turned out corrupt raised from a frame holding ``ffi.from_buffer`` of a slice of it; the
exception (kept by a future, with its traceback) later went to the collector with that
slice, and a collection in another test segfaulted (1 run in 3 of test_storage_engine.py).
"""

from __future__ import annotations

import hashlib
import inspect
import subprocess
import sys
import textwrap
import types

import lz4.block
import pytest
import torch

from musacache import _native
from musacache._errors import CorruptChunkError, InvalidInputError
from musacache._keys import Fingerprint
from musacache._spec import KVSpec
from musacache.codec import HEADER_SIZE, decode_chunk, encode_chunk, read_header
from musacache.tiers.base import ChunkMeta


def _exported_views(tb: types.TracebackType | None) -> list[str]:
    """The memoryviews among the locals of ``tb``'s frames that still have an export (their
    ``release`` refuses), named by frame and variable."""
    found = []
    while tb is not None:
        frame = tb.tb_frame
        for name, value in frame.f_locals.items():
            if isinstance(value, memoryview):
                try:
                    value.release()
                except BufferError:
                    found.append(f"{frame.f_code.co_name}:{name}")
        tb = tb.tb_next
    return found


def _corrupt_object() -> tuple[Fingerprint, bytes]:
    fp = Fingerprint("exports", KVSpec(2, 2, 64, torch.bfloat16), 32)
    key = hashlib.blake2b(b"k", digest_size=32).digest()
    meta = ChunkMeta(key=key, parent=bytes(32), num_tokens=32, raw_bytes=fp.spec.nbytes(32))
    data = torch.randn(fp.spec.shape(32)).to(torch.bfloat16)
    obj = bytearray(encode_chunk(fp, meta, data, "lz4", block_size=4096))
    start = HEADER_SIZE + read_header(obj).table_len
    obj[start + (len(obj) - start) // 2] ^= 0xFF  # a payload byte: a checksum mismatch
    return fp, bytes(obj)


def test_a_corrupt_chunk_decoded_from_a_memoryview_leaves_no_export() -> None:
    fp, obj = _corrupt_object()
    view = memoryview(obj)[0:]
    with pytest.raises(CorruptChunkError) as info:
        decode_chunk(fp, view)
    # The traceback keeps every frame of the decode alive, as a future keeping the error
    # does; none of them may still export a memoryview.
    assert _exported_views(info.value.__traceback__) == []
    view.release()


@pytest.mark.parametrize("call", ["lz4_decode", "nib_decode", "nib_encode", "tagged_decode"])
def test_a_native_call_that_raises_releases_its_buffers(call: str) -> None:
    block = memoryview(lz4.block.compress(bytes(range(256)) * 64, store_size=False))[0:]
    out = memoryview(bytearray(100))[0:]  # too short for either: each call raises
    try:
        if call == "lz4_decode":
            _native.lz4_decode(block, out)
        elif call == "nib_decode":
            _native.nib_decode(block, out)
        elif call == "nib_encode":
            _native.nib_encode(block, out)
        else:
            _native.tagged_decode(block, block[:8], num_blocks=1, block_size=4096,
                                  raw_len=100, itemsize=2, scratch=out, out=out)
    except (CorruptChunkError, InvalidInputError) as exc:
        error: BaseException = exc
    else:
        pytest.fail(f"{call} accepted a block that does not decode into {len(out)} bytes")
    assert _exported_views(error.__traceback__) == []
    block.release()  # a BufferError here: the call still holds an export of it
    out.release()


def test_every_function_that_takes_a_buffer_lets_go_of_it_when_it_raises() -> None:
    """Each function (or method) of the native wrappers that calls ``_buffer`` is wrapped
    in ``_releases_buffers``: one added without it would hold its exports on an error."""
    takers = []
    for name, obj in vars(_native).items():
        members = [(name, obj)]
        if isinstance(obj, type) and obj.__module__ == _native.__name__:
            members = [(f"{name}.{k}", v) for k, v in vars(obj).items()]
        for qual, fn in members:
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None and "_buffer" in code.co_names and qual != "_buffer":
                takers.append(qual)
                assert getattr(fn, "__wrapped__", None) is not None, (
                    f"{qual} takes buffers but is not wrapped in _releases_buffers")
    assert {"lz4_decode", "tagged_decode", "tagged_read", "ChunkCopy.copy"} <= set(takers)


def test_the_collector_clears_a_failed_decode_without_crashing() -> None:
    """The crash itself, in a fresh interpreter: a corrupt object decoded from a memoryview
    in a worker thread, its error in a cycle made after the decode's views (so the collector
    clears a view first), then a collection. A segfault before the fix."""
    code = textwrap.dedent("""
        import gc, hashlib, sys
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from musacache._keys import Fingerprint
        from musacache._spec import KVSpec
        from musacache.codec import HEADER_SIZE, decode_chunk, encode_chunk, read_header
        from musacache.tiers.base import ChunkMeta

        fp = Fingerprint("exports", KVSpec(2, 2, 64, torch.bfloat16), 32)
        meta = ChunkMeta(key=hashlib.blake2b(b"k", digest_size=32).digest(),
                         parent=bytes(32), num_tokens=32, raw_bytes=fp.spec.nbytes(32))
        obj = bytearray(encode_chunk(fp, meta, torch.randn(fp.spec.shape(32)).to(
            torch.bfloat16), "lz4", block_size=4096))
        obj[len(obj) - 100] ^= 0xFF
        obj = bytes(obj)

        with ThreadPoolExecutor(1) as pool:
            for _ in range(20):
                err = pool.submit(decode_chunk, fp, memoryview(obj)).exception()
                assert err is not None, "the corrupt object decoded"
                err.cycle = err  # made after the decode's views, as a task's error is
                del err
                gc.collect()
        print("collected")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "collected" in done.stdout, (
        f"rc {done.returncode}: {done.stderr[-2000:]}")
