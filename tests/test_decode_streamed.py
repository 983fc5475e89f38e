"""A tagged decode of 1 MiB or more streams its output. With one destination (a slot alone, or
a get's own tensor as runs alone) the planes are unshuffled straight into it, a piece between
two block boundaries at a time, with no strip buffer in between; with both, each strip goes
through the buffer and is streamed to each. These tests read files built here, independently
of the encoder, through every one of those paths, at every alignment of the destination, and
check the bytes against the data, the bytes around the destination, and what a damaged block
leaves written (verified bytes only)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musacache import _native
from musacache._errors import CorruptChunkError
from test_native_decode import _guarded, _guards_intact, _tagged_payload

MIB = 1 << 20
FILL = 0x5A


def _data(nbytes: int, itemsize: int, seed: int) -> bytes:
    """Elements whose high byte takes a few values (the nibble coder's case), whose low
    bytes are noise, with runs of one value here and there (lz4's case)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    n = nbytes // itemsize
    if itemsize > 1:
        raw[itemsize - 1 : n * itemsize : itemsize] = rng.choice(
            np.array([0x3C, 0x3D, 0x3E, 0xBC, 0xBD, 0xBE], dtype=np.uint8), n)
    for start in rng.integers(0, max(1, nbytes - 5000), 8):
        raw[start : start + 4000] = raw[start]
    return raw.tobytes()


def _runs_in(buf: np.ndarray, nbytes: int, run_bytes: int, gap: int, offset: int,
             ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The addresses of runs of ``run_bytes`` covering ``nbytes`` bytes, laid out in ``buf``
    from ``offset`` with ``gap`` bytes between them, and a view of each run."""
    addrs, views = [], []
    at = offset
    for _ in range(nbytes // run_bytes):
        views.append(buf[at : at + run_bytes])
        addrs.append(buf.ctypes.data + at)
        at += run_bytes + gap
    return np.array(addrs, dtype=np.uint64), views


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(itemsize=st.sampled_from([1, 2, 4]), elems=st.integers(MIB // 4, MIB // 2 + 3000),
       extra=st.integers(0, 3), block_size=st.sampled_from([65536, 200_003, MIB]),
       tags=st.lists(st.integers(0, 2), min_size=1, max_size=4),
       dest=st.sampled_from(["out", "runs", "both"]), offset=st.integers(0, 70),
       run_elems=st.integers(33, 70_000), gap=st.integers(0, 130),
       bad=st.one_of(st.none(), st.integers(0, 1 << 30)), seed=st.integers(0, 1 << 16))
def test_a_streamed_decode_writes_the_data_at_any_alignment_and_only_verified_bytes(
        tmp_path: Path, itemsize: int, elems: int, extra: int, block_size: int,
        tags: list[int], dest: str, offset: int, run_elems: int, gap: int, bad: int | None,
        seed: int) -> None:
    run_bytes = run_elems * itemsize
    if dest == "out":
        # A length that need not be whole elements: its last bytes are stored apart.
        nbytes = MIB + elems * itemsize + (extra if itemsize > 1 else 0)
    else:  # runs cover a chunk of whole elements exactly
        nbytes = -(-MIB // run_bytes) * run_bytes
    data = _data(nbytes, itemsize, seed)
    payload, table = _tagged_payload(data, itemsize, block_size, tags)
    num_blocks = len(table) // 8
    damaged = bytearray(payload)
    bad_block = None
    if bad is not None:
        bad_block = bad % num_blocks
        sizes = [int.from_bytes(table[8 * i : 8 * i + 4], "little") for i in range(num_blocks)]
        damaged[sum(sizes[:bad_block]) + bad % sizes[bad_block]] ^= 0x04
    path = tmp_path / "chunk"
    path.write_bytes(b"lead" + bytes(damaged))

    out = copy = None
    out_buf = runs_buf = None
    if dest in ("out", "both"):
        # out at any offset from a 64-byte line: the unaligned head (odd offsets included,
        # where two planes cannot stream) and the tail are stored apart from the lines.
        out_buf, inner = _guarded(nbytes + offset)
        out = inner[offset:]
        out[:] = FILL
    views: list[np.ndarray] = []
    if dest in ("runs", "both"):
        count = nbytes // run_bytes
        runs_buf, runs_inner = _guarded(count * (run_bytes + gap) + offset)
        runs_inner[:] = FILL
        addrs, views = _runs_in(runs_inner, nbytes, run_bytes, gap, offset)
        copy = _native.ChunkCopy(addrs, run_bytes)
    ring_len = _native.tagged_ring_bytes(num_blocks=num_blocks, block_size=block_size,
                                         itemsize=itemsize)
    ring_buf, ring = _guarded(ring_len)
    fd = os.open(path, os.O_RDONLY)
    try:
        geometry = {"payload_len": len(payload), "num_blocks": num_blocks,
                    "block_size": block_size, "raw_len": nbytes, "itemsize": itemsize}
        if bad_block is None:
            _native.tagged_read(fd, 4, table, **geometry, ring=ring, out=out, copy=copy)
        else:
            with pytest.raises(CorruptChunkError, match=f"block {bad_block}"):
                _native.tagged_read(fd, 4, table, **geometry, ring=ring, out=out, copy=copy)
    finally:
        os.close(fd)

    assert _guards_intact(ring_buf)
    want = np.frombuffer(data, dtype=np.uint8)
    got_all = []
    if out is not None:
        assert out_buf is not None and _guards_intact(out_buf)
        got_all.append(out)
    if copy is not None:
        assert runs_buf is not None and _guards_intact(runs_buf)
        got_all.append(np.concatenate(views))
        # The gaps between runs are not the runs' bytes: untouched.
        for k in range(len(views) - 1):
            lo = offset + k * (run_bytes + gap) + run_bytes
            assert bool((runs_inner[lo : lo + gap] == FILL).all())
    for got in got_all:
        if bad_block is None:
            assert got.tobytes() == data
        else:
            assert bool(((got == FILL) | (got == want)).all())
    if copy is not None:
        assert (copy.written == nbytes) == (bad_block is None)


def test_a_closed_copy_is_not_written_by_a_streamed_decode(tmp_path: Path) -> None:
    # The runs alone (a get's own tensor) go straight from the planes: a copy closed before
    # the read (the get ended) still takes no byte, and the read stops without an error.
    data = _data(2 * MIB, 2, 7)
    payload, table = _tagged_payload(data, 2, 256 << 10, [2, 0, 1])
    path = tmp_path / "chunk"
    path.write_bytes(payload)
    buf, dst = _guarded(len(data))
    dst[:] = FILL
    copy = _native.ChunkCopy(np.array([dst.ctypes.data], dtype=np.uint64), len(data))
    copy.close()
    ring = bytearray(_native.tagged_ring_bytes(num_blocks=len(table) // 8,
                                               block_size=256 << 10, itemsize=2))
    fd = os.open(path, os.O_RDONLY)
    try:
        _native.tagged_read(fd, 0, table, payload_len=len(payload), num_blocks=len(table) // 8,
                            block_size=256 << 10, raw_len=len(data), itemsize=2, ring=ring,
                            out=None, copy=copy)
    finally:
        os.close(fd)
    assert copy.written == 0 and bool((dst == FILL).all()) and _guards_intact(buf)
