"""The native module through its checked wrappers: build check, row copies, byte-shuffle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from musacache import (
    ConfigError,
    CorruptChunkError,
    InvalidInputError,
    MusaCacheError,
    NativeBuildError,
    NativeError,
    SlotRangeError,
    _native,
    _version,
)

SIMD_LEVELS = _native.SIMD_LEVELS[: _native.SIMD_LEVELS.index(_native.max_simd_level()) + 1]


@pytest.fixture(autouse=True)
def restore_settings() -> Iterator[None]:
    level = _native.get_simd_level()
    threads = _native.get_num_threads()
    yield
    _native.set_simd_level(level)
    _native.set_num_threads(threads)
    _native.set_streaming_threshold(None)
    _native.set_thread_min_bytes(None)


# -- build check ----------------------------------------------------------------------------


def test_built_version_is_the_package_version() -> None:
    assert _native.built_version() == _version.__version__
    _native.check_build_version()


def test_stale_build_raises_with_rebuild_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_version, "__version__", "9.9.9")
    with pytest.raises(NativeBuildError) as info:
        _native.check_build_version()
    message = str(info.value)
    assert "9.9.9" in message and _native.built_version() in message
    assert "pip install -e ." in message
    assert isinstance(info.value, ImportError) and isinstance(info.value, MusaCacheError)


# The package __init__ imports the native module itself, so a subprocess that wants to patch
# things first enters the package as a bare namespace (no __init__ run).
_BARE_PACKAGE = (
    "import importlib.util, sys, types\n"
    "found = importlib.util.find_spec('musacache')\n"
    "pkg = types.ModuleType('musacache')\n"
    "pkg.__path__ = list(found.submodule_search_locations)\n"
    "sys.modules['musacache'] = pkg\n"
)


def _import_in_subprocess(prelude: str) -> subprocess.CompletedProcess[str]:
    code = (
        _BARE_PACKAGE
        + f"{prelude}\n"
        "from musacache._errors import NativeBuildError\n"
        "try:\n"
        "    import musacache._native\n"
        "except NativeBuildError as e:\n"
        "    print('NativeBuildError:', e)\n"
        "else:\n"
        "    print('imported')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


def test_import_of_a_stale_build_raises_native_build_error() -> None:
    result = _import_in_subprocess("import musacache._version as v; v.__version__ = '0.0.0-old'")
    assert result.returncode == 0, result.stderr
    assert "NativeBuildError:" in result.stdout
    assert "0.0.0-old" in result.stdout and "pip install -e ." in result.stdout


def test_import_without_a_build_raises_native_build_error() -> None:
    result = _import_in_subprocess("import sys; sys.modules['musacache._native_lib'] = None")
    assert result.returncode == 0, result.stderr
    assert "NativeBuildError:" in result.stdout and "pip install -e ." in result.stdout


def test_import_musacache_without_a_build_says_how_to_rebuild() -> None:
    code = ("import sys; sys.modules['musacache._native_lib'] = None\n"
            "try:\n"
            "    import musacache\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__ + ':', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "NativeBuildError:" in result.stdout and "pip install -e ." in result.stdout


def test_status_codes_become_native_errors() -> None:
    with pytest.raises(NativeError, match="invalid argument"):
        _native._check_status(_native.lib.MC_ERR_ARGUMENT, "gather")
    with pytest.raises(NativeError, match="status 99"):
        _native._check_status(99, "gather")
    _native._check_status(_native.lib.MC_OK, "gather")


def test_c_rejects_bad_arguments_without_writing() -> None:
    """The C side checks again (for callers that skip the wrappers)."""
    lib, ffi = _native.lib, _native.ffi
    assert lib.mc_gather_rows(ffi.NULL, 1) == lib.MC_ERR_ARGUMENT
    assert lib.mc_shuffle(ffi.NULL, ffi.NULL, 4, 2) == lib.MC_ERR_ARGUMENT
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    slots = np.array([0, 5], dtype=np.int64)  # 5 is past num_slots = 4
    planes_p = ffi.new("uintptr_t[]", [src.ctypes.data])
    planes_d = ffi.new("uintptr_t[]", [dst.ctypes.data])
    copy = ffi.new("mc_row_copy *")
    copy.paged_planes = ffi.cast("char *const *", planes_p)
    copy.dense_planes = ffi.cast("char *const *", planes_d)
    copy.num_planes = 1
    copy.row_bytes = 4
    copy.block_size = 1
    copy.block_stride = 4
    copy.slot_stride = 4
    copy.num_slots = 4
    copy.dense_row_stride = 4
    slot_buf = ffi.from_buffer("int64_t[]", slots)
    copy.slots = slot_buf
    copy.num_tokens = 2
    assert lib.mc_gather_rows(copy, 1) == lib.MC_ERR_SLOT_RANGE
    assert not dst.any()
    copy.block_size = 0
    assert lib.mc_scatter_rows(copy, 1) == lib.MC_ERR_ARGUMENT


def _shuffle_work() -> Callable[[], None]:
    src, out = bytearray(32 << 20), bytearray(32 << 20)
    return lambda: _native.shuffle(src, 2, out)


def _gather_work() -> Callable[[], None]:
    paged, dense = np.ones(32 << 20, np.uint8), np.zeros(32 << 20, np.uint8)
    slots = np.arange((32 << 20) // 4096, dtype=np.int64)
    return lambda: _native.gather_rows([paged.ctypes.data], [dense.ctypes.data], slots,
                                       row_bytes=4096, num_slots=slots.size,
                                       paged_extents=paged.nbytes, dense_extents=dense.nbytes,
                                       threads=1)


@pytest.mark.parametrize("make_work", [_shuffle_work, _gather_work], ids=["shuffle", "gather"])
def test_native_calls_release_the_gil(make_work: Callable[[], Callable[[], None]]) -> None:
    """With a 60 s switch interval a thread that holds the GIL keeps it until it blocks or
    ends, so the main thread only gets to count while the worker is inside C if the call
    released the GIL. (The counting loop sleeps for 0 s to hand the GIL back in turn.)

    The worker repeats the call until the main thread has counted enough, so the verdict does
    not depend on how fast this machine runs one call; a call that kept the GIL would leave
    the main thread no turn at all until the worker's 30 s cap ran out."""
    work = make_work()
    started, enough = threading.Event(), threading.Event()
    calls = 0

    def worker() -> None:
        nonlocal calls
        started.set()
        deadline = time.monotonic() + 30
        while not enough.is_set() and time.monotonic() < deadline:
            work()
            calls += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        ticks = 0
        while thread.is_alive():
            ticks += 1
            if ticks == 1000:
                enough.set()
            time.sleep(0)
        thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert enough.is_set(), f"the main thread got {ticks} turns in {calls} native calls"


# -- settings -------------------------------------------------------------------------------


def test_streaming_store_support_is_reported() -> None:
    has = _native.has_streaming_stores()
    assert isinstance(has, bool)
    if os.uname().machine in ("x86_64", "AMD64"):
        assert has


def test_streaming_threshold_round_trips() -> None:
    default = _native.get_streaming_threshold()
    assert default >= 4 << 20
    _native.set_streaming_threshold(123)
    assert _native.get_streaming_threshold() == 123
    _native.set_streaming_threshold(None)
    assert _native.get_streaming_threshold() == default
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(InvalidInputError):
            _native.set_streaming_threshold(bad)  # type: ignore[arg-type]


def test_simd_level_is_clamped_to_the_cpu() -> None:
    assert _native.set_simd_level("none") == "none"
    assert _native.set_simd_level("avx512") == _native.max_simd_level()
    with pytest.raises(InvalidInputError):
        _native.set_simd_level("avx9000")


def test_thread_count_setting_is_checked() -> None:
    _native.set_num_threads(3)
    assert _native.get_num_threads() == 3
    for bad in (0, -1, _native.MAX_THREADS + 1, 2.0, True, "2", None):
        with pytest.raises(InvalidInputError):
            _native.set_num_threads(bad)  # type: ignore[arg-type]
    assert _native.get_num_threads() == 3


def test_default_threads_come_from_cpu_count_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "_num_threads", None)
    monkeypatch.delenv("MUSACACHE_NATIVE_THREADS", raising=False)
    assert _native.get_num_threads() == max(1, min(os.cpu_count() or 1, 8))
    monkeypatch.setattr(_native, "_num_threads", None)
    monkeypatch.setenv("MUSACACHE_NATIVE_THREADS", "5")
    assert _native.get_num_threads() == 5
    monkeypatch.setattr(_native, "_num_threads", None)
    monkeypatch.setenv("MUSACACHE_NATIVE_THREADS", "many")
    with pytest.raises(ConfigError, match="MUSACACHE_NATIVE_THREADS"):
        _native.get_num_threads()


# -- row copies -----------------------------------------------------------------------------


def _paged_reference_offsets(slot: int, block_size: int, block_stride: int,
                             slot_stride: int) -> int:
    return (slot // block_size) * block_stride + (slot % block_size) * slot_stride


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_gather_and_scatter_rows_with_block_strides(threads: int, stream: bool) -> None:
    rng = np.random.default_rng(7)
    row, block_size, num_blocks, planes = 40, 3, 5, 4
    slot_stride, block_stride = 48, 3 * 48 + 16  # padded rows and padded blocks
    paged = [rng.integers(0, 256, num_blocks * block_stride, dtype=np.uint8) for _ in range(planes)]
    slots = np.array([0, 1, 2, 3, -1, 14, 13, 7, 8, 9, 2], dtype=np.int64)
    dense_stride = 64
    dense = [np.zeros(len(slots) * dense_stride, dtype=np.uint8) for _ in range(planes)]
    _native.set_thread_min_bytes(0)
    _native.set_streaming_threshold(0 if stream else None)
    kwargs = dict(row_bytes=row, num_slots=num_blocks * block_size,
                  paged_extents=[p.nbytes for p in paged], dense_extents=dense[0].nbytes,
                  block_size=block_size, block_stride=block_stride, slot_stride=slot_stride,
                  dense_row_stride=dense_stride, threads=threads)
    _native.gather_rows([p.ctypes.data for p in paged], [d.ctypes.data for d in dense], slots,
                        **kwargs)  # type: ignore[arg-type]
    for p, d in zip(paged, dense, strict=True):
        for t, s in enumerate(slots):
            got = d[t * dense_stride: t * dense_stride + row]
            if s < 0:
                assert not got.any()
                continue
            at = _paged_reference_offsets(int(s), block_size, block_stride, slot_stride)
            assert np.array_equal(got, p[at: at + row])
        assert not d.reshape(len(slots), dense_stride)[:, row:].any()  # padding untouched

    target = [np.zeros_like(p) for p in paged]
    _native.scatter_rows([p.ctypes.data for p in target], [d.ctypes.data for d in dense], slots,
                         **kwargs)  # type: ignore[arg-type]
    for p, got in zip(paged, target, strict=True):
        expected = np.zeros_like(p)
        for s in slots:
            if s >= 0:
                at = _paged_reference_offsets(int(s), block_size, block_stride, slot_stride)
                expected[at: at + row] = p[at: at + row]
        assert np.array_equal(got, expected)


def test_scatter_rows_keeps_the_last_token_of_a_repeated_slot() -> None:
    paged = np.zeros(4 * 8, dtype=np.uint8)
    dense = np.repeat(np.arange(1, 5, dtype=np.uint8), 8)
    slots = np.array([2, 1, 2, 2], dtype=np.int64)
    _native.scatter_rows([paged.ctypes.data], [dense.ctypes.data], slots, row_bytes=8,
                         num_slots=4, paged_extents=paged.nbytes, dense_extents=dense.nbytes)
    assert list(paged.reshape(4, 8)[:, 0]) == [0, 2, 4, 0]


class _Rows:
    """A small valid gather_rows call that a test breaks one argument of."""

    def __init__(self) -> None:
        self.paged = np.arange(64, dtype=np.uint8)
        self.dense = np.zeros(32, dtype=np.uint8)
        self.paged_before = self.paged.copy()
        self.kwargs: dict[str, object] = dict(
            paged_planes=[self.paged.ctypes.data], dense_planes=[self.dense.ctypes.data],
            slots=np.array([0, 3, -1, 7], dtype=np.int64), row_bytes=8, num_slots=8,
            paged_extents=64, dense_extents=32)

    def unchanged(self) -> bool:
        return not self.dense.any() and np.array_equal(self.paged, self.paged_before)


BAD_ROW_CALLS: list[tuple[str, dict[str, object], type[Exception]]] = [
    ("slot past the end", {"slots": np.array([0, 8], dtype=np.int64)}, SlotRangeError),
    ("slot below -1", {"slots": np.array([-2], dtype=np.int64)}, SlotRangeError),
    ("int32 slots", {"slots": np.array([0], dtype=np.int32)}, InvalidInputError),
    ("2-D slots", {"slots": np.zeros((2, 2), dtype=np.int64)}, InvalidInputError),
    ("strided slots", {"slots": np.zeros(8, dtype=np.int64)[::2]}, InvalidInputError),
    ("list slots", {"slots": [0, 1]}, InvalidInputError),
    ("plane count mismatch", {"dense_planes": []}, InvalidInputError),
    ("null plane", {"paged_planes": [0]}, InvalidInputError),
    ("paged extent too small", {"paged_extents": 63}, InvalidInputError),
    ("dense extent too small", {"dense_extents": 31}, InvalidInputError),
    ("extent list too short", {"paged_extents": []}, InvalidInputError),
    ("negative row", {"row_bytes": -1}, InvalidInputError),
    ("zero block size", {"block_size": 0}, InvalidInputError),
    ("overlapping dense rows", {"dense_row_stride": 4}, InvalidInputError),
    ("overlapping blocks", {"block_size": 2, "block_stride": 8}, InvalidInputError),
    ("zero threads", {"threads": 0}, InvalidInputError),
    ("too many threads", {"threads": _native.MAX_THREADS + 1}, InvalidInputError),
]


@pytest.mark.parametrize(("change", "error"), [(c, e) for _, c, e in BAD_ROW_CALLS],
                         ids=[name for name, _, _ in BAD_ROW_CALLS])
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_row_calls_raise_before_writing(change: dict[str, object], error: type[Exception],
                                            direction: str) -> None:
    call = _Rows()
    call.kwargs.update(change)
    move = _native.gather_rows if direction == "gather" else _native.scatter_rows
    with pytest.raises(error):
        move(**call.kwargs)  # type: ignore[arg-type]
    assert call.unchanged()


def test_slot_check_tells_whether_a_token_has_no_slot() -> None:
    assert _native.check_slots(np.array([0, 7, 3], dtype=np.int64), 8) is False
    assert _native.check_slots(np.array([0, -1, 3], dtype=np.int64), 8) is True
    assert _native.check_slots(np.array([-1], dtype=np.int64), 1) is True
    assert _native.check_slots(np.array([], dtype=np.int64), 8) is False


def test_slot_range_error_names_the_first_bad_index() -> None:
    with pytest.raises(SlotRangeError, match=r"slot_mapping\[2\] = 9 "):
        _native.check_slots(np.array([0, -1, 9, 10, -5], dtype=np.int64), 8)


# -- byte shuffle ---------------------------------------------------------------------------


def numpy_shuffle(data: bytes, itemsize: int) -> bytes:
    whole = len(data) // itemsize * itemsize
    planes = np.frombuffer(data[:whole], dtype=np.uint8).reshape(-1, itemsize).T
    return planes.tobytes() + data[whole:]


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("length", [0, 1, 7, 64, 1000, 65_539])
def test_shuffle_matches_numpy_and_round_trips(simd: str, itemsize: int, length: int) -> None:
    _native.set_simd_level(simd)
    data = np.random.default_rng(length + itemsize).integers(0, 256, length, dtype=np.uint8)
    raw = data.tobytes()
    shuffled = _native.shuffle(raw, itemsize)
    assert isinstance(shuffled, bytearray)
    assert bytes(shuffled) == numpy_shuffle(raw, itemsize)
    assert bytes(_native.unshuffle(shuffled, itemsize)) == raw


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.integers(1, 12),
       simd=st.sampled_from(SIMD_LEVELS))
def test_shuffle_property(data: bytes, itemsize: int, simd: str) -> None:
    _native.set_simd_level(simd)
    shuffled = _native.shuffle(data, itemsize)
    assert bytes(shuffled) == numpy_shuffle(data, itemsize)
    assert bytes(_native.unshuffle(shuffled, itemsize)) == data


def test_shuffle_takes_any_contiguous_buffer_and_fills_out() -> None:
    values = torch.arange(-500, 500, dtype=torch.float32).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().tobytes()
    expected = numpy_shuffle(raw, 2)
    for src in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint16).reshape(50, 20),
                values):
        assert bytes(_native.shuffle(src, 2)) == expected
    out_np = np.zeros(len(raw), dtype=np.uint8)
    assert _native.shuffle(values, 2, out_np) is out_np
    assert out_np.tobytes() == expected
    back = torch.empty_like(values)
    assert _native.unshuffle(out_np, 2, back) is back
    assert torch.equal(back.view(torch.int16), values.view(torch.int16))
    view_out = memoryview(bytearray(len(raw)))
    assert _native.shuffle(raw, 2, view_out) is view_out
    assert view_out.tobytes() == expected


@pytest.mark.parametrize(
    ("src", "itemsize", "out", "message"),
    [
        (b"abcd", 0, None, "itemsize"),
        (b"abcd", True, None, "itemsize"),
        (b"abcd", 2.0, None, "itemsize"),
        (12345, 2, None, "bytes-like"),
        (np.zeros(8, np.uint16)[::2], 2, None, "C-contiguous"),
        (torch.zeros(4, 4)[:, 0], 2, None, "contiguous"),
        (torch.zeros(4, device="meta"), 2, None, "CPU"),
        (b"abcd", 2, b"....", "writable"),
        (b"abcd", 2, bytearray(3), "holds 3 bytes"),
    ],
)
def test_bad_shuffle_calls_raise(src: object, itemsize: object, out: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        _native.shuffle(src, itemsize, out)  # type: ignore[arg-type]


def test_shuffle_refuses_to_work_in_place() -> None:
    buf = bytearray(b"abcdefgh")
    with pytest.raises(InvalidInputError, match="overlaps"):
        _native.unshuffle(buf, 2, buf)
    view = memoryview(buf)
    with pytest.raises(InvalidInputError, match="overlaps"):
        _native.shuffle(view[:6], 2, view[2:])
    assert buf == bytearray(b"abcdefgh")


# -- crc32c ---------------------------------------------------------------------------------


def _crc32c_reference(data: bytes, value: int = 0) -> int:
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_crc32c_matches_the_standard_and_chains(simd: str) -> None:
    _native.set_simd_level(simd)
    assert _native.crc32c(b"123456789") == 0xE3069283  # the published check value
    assert _native.crc32c(b"") == 0
    data = np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    for length in (1, 7, 8, 9, 63, 64, 1000, 3000):
        assert _native.crc32c(data[:length]) == _crc32c_reference(data[:length])
    assert _native.crc32c(data[1000:], _native.crc32c(data[:1000])) == _native.crc32c(data)
    assert _native.crc32c(data[:5], 12345) == _crc32c_reference(data[:5], 12345)


def test_crc32c_three_stream_path_matches_the_single_stream_one() -> None:
    # Buffers of 3 x 4096 bytes and more run as three interleaved chains joined by a table
    # shift; the scalar path (one chain, no join) and short chained pieces are the reference.
    data = np.random.default_rng(3).integers(0, 256, 5 * 12288 + 777, dtype=np.uint8).tobytes()
    best = _native.max_simd_level()
    for length in (12287, 12288, 12289, 24576 + 4095, len(data)):
        for value in (0, 0xDEADBEEF):
            _native.set_simd_level(best)
            fast = _native.crc32c(data[:length], value)
            _native.set_simd_level("none")
            assert fast == _native.crc32c(data[:length], value), length
            _native.set_simd_level(best)
            chained = value
            for i in range(0, length, 1000):  # pieces too short for the interleaved path
                chained = _native.crc32c(data[i : min(i + 1000, length)], chained)
            assert fast == chained, length
    flipped = bytearray(data)
    flipped[2 * 4096 + 5] ^= 0x10  # a bit in the third stream of the first round
    assert _native.crc32c(flipped) != _native.crc32c(data)


def test_crc32c_catches_every_single_bit_flip() -> None:
    data = bytearray(np.random.default_rng(2).integers(0, 256, 256, dtype=np.uint8).tobytes())
    good = _native.crc32c(data)
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        assert _native.crc32c(data) != good
        data[bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize("value", [-1, 2**32, True, 1.0])
def test_crc32c_rejects_a_bad_start_value(value: object) -> None:
    with pytest.raises(InvalidInputError, match="value"):
        _native.crc32c(b"abc", value)  # type: ignore[arg-type]


# -- nibble coder ---------------------------------------------------------------------------


def _nib_reference_decode(coded: bytes, n: int) -> bytes:
    """The documented layout, decoded in numpy (independent of the C decoder)."""
    book = list(coded[:15]) + [0]
    escapes = int.from_bytes(coded[16:20], "little")
    codes = np.frombuffer(coded[20 : 20 + (n + 1) // 2], dtype=np.uint8)
    nibbles = np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:n]
    out = np.array(book, dtype=np.uint8)[nibbles]
    rec = coded[20 + (n + 1) // 2 :]
    assert len(rec) == 5 * escapes
    for e in range(escapes):
        pos = int.from_bytes(rec[5 * e : 5 * e + 4], "little")
        assert nibbles[pos] == 15
        out[pos] = rec[5 * e + 4]
    assert int((nibbles == 15).sum()) == escapes
    return out.tobytes()


def _nib_round_trip(data: bytes) -> int | None:
    out = bytearray(len(data))
    size = _native.nib_encode(data, out)
    if size is None:
        return None
    assert 0 < size < len(data)
    coded = bytes(out[:size])
    assert _nib_reference_decode(coded, len(data)) == data
    back = bytearray(b"\xaa" * len(data))
    _native.nib_decode(coded, back)
    assert bytes(back) == data
    return size


def _gaussian_bf16_high_bytes(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(torch.bfloat16)
    return x.view(torch.uint8).numpy()[1::2].tobytes()


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("n", [1 << 20, 65_537, 4096, 1001])
def test_nib_round_trip_on_gaussian_bf16_exponents(simd: str, n: int) -> None:
    _native.set_simd_level(simd)
    data = _gaussian_bf16_high_bytes(n, seed=n)
    assert n < 65_536 or len(set(data)) > 15  # the large ones exercise escapes
    size = _nib_round_trip(data)
    assert size is not None and size < 20 + 0.52 * n  # about half


@pytest.mark.parametrize("simd", SIMD_LEVELS)
@pytest.mark.parametrize("n", [0, 1, 2, 20, 41, 42, 43, 44, 100, 4095, 4096, 1 << 18])
def test_nib_all_equal_bytes(n: int, simd: str) -> None:
    _native.set_simd_level(simd)
    data = b"\x3f" * n
    size = _nib_round_trip(data)
    # 20 fixed bytes plus half a byte per byte: it pays from 42 bytes on.
    assert size == (20 + (n + 1) // 2 if 20 + (n + 1) // 2 < n else None)


@pytest.mark.parametrize("distinct", [2, 15, 16, 17, 64, 256])
@pytest.mark.parametrize("n", [4097, 200_000])
@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_nib_round_trip_with_few_or_many_distinct_values(distinct: int, n: int,
                                                         simd: str) -> None:
    _native.set_simd_level(simd)
    rng = np.random.default_rng(distinct * n)
    # Skewed, so the 15 most frequent values are well defined and the rest are escapes.
    probs = 0.5 ** np.arange(distinct, dtype=np.float64) + 1e-3
    values = rng.choice(256, distinct, replace=False).astype(np.uint8)
    data = values[rng.choice(distinct, n, p=probs / probs.sum())].tobytes()
    size = _nib_round_trip(data)
    if distinct <= 15:
        assert size == 20 + (n + 1) // 2
    elif distinct <= 17:
        assert size is not None
    else:
        assert size is None or size < n


def test_nib_output_is_the_same_at_every_simd_level() -> None:
    # The format does not depend on the CPU: every level writes the same bytes, and each
    # decodes what the others wrote.
    data = bytearray(_gaussian_bf16_high_bytes(100_003, seed=4))
    data[64:70] = bytes(range(200, 206))  # escapes inside and around a SIMD stride
    coded = {}
    for simd in SIMD_LEVELS:
        _native.set_simd_level(simd)
        out = bytearray(len(data))
        size = _native.nib_encode(bytes(data), out)
        assert size is not None
        coded[simd] = bytes(out[:size])
    assert len(set(coded.values())) == 1
    for simd in SIMD_LEVELS:
        _native.set_simd_level(simd)
        back = bytearray(len(data))
        _native.nib_decode(coded[SIMD_LEVELS[0]], back)
        assert back == data


def test_nib_uniform_random_bytes_are_not_coded() -> None:
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    assert _native.nib_encode(data, bytearray(len(data))) is None
    assert _native.nib_encode(data[:5000], bytearray(5000)) is None


@pytest.mark.parametrize("n", [4096, 4097, 300_001])
@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_nib_escapes_at_the_edges(n: int, simd: str) -> None:
    _native.set_simd_level(simd)
    # 15 common values fill the book; 0xEE, the rarest, is an escape at the block's edges.
    data = bytearray((np.arange(n) % 15 + 0x10).astype(np.uint8).tobytes())
    edges = (0, 1, n // 2, n - 2, n - 1)
    for pos in edges:
        data[pos] = 0xEE
    out = bytearray(n)
    size = _native.nib_encode(bytes(data), out)
    assert size == 20 + (n + 1) // 2 + 5 * len(edges)
    rec = 20 + (n + 1) // 2
    positions = [int.from_bytes(out[rec + 5 * e : rec + 5 * e + 4], "little")
                 for e in range(len(edges))]
    assert positions == list(edges)
    assert _nib_round_trip(bytes(data)) == size


def test_nib_sampled_book_misses_values_only_as_escapes() -> None:
    # The book comes from a sample; bytes the sample never saw must still round-trip.
    n = 1 << 20
    data = bytearray(_gaussian_bf16_high_bytes(n, seed=9))
    data[5000:5200] = bytes(range(200))  # between the sample slices
    _nib_round_trip(bytes(data))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), alphabet=st.integers(1, 40),
       simd=st.sampled_from(SIMD_LEVELS))
def test_nib_property(data: bytes, alphabet: int, simd: str) -> None:
    _native.set_simd_level(simd)
    squeezed = bytes(b % alphabet for b in data)
    _nib_round_trip(squeezed)


def _coded(n: int = 1000) -> tuple[bytes, bytes]:
    data = bytearray(b"\x05\x06" * (n // 2))
    data[10] = 0x99
    for k in range(15):
        data[100 + k] = 0x40 + k
    out = bytearray(n)
    size = _native.nib_encode(bytes(data), out)
    assert size is not None
    return bytes(data), bytes(out[:size])


def _corrupt_nib_blocks() -> list[tuple[str, bytes]]:
    data, coded = _coded()
    n_codes = (len(data) + 1) // 2
    rec = 20 + n_codes
    cases = [("short", coded[:19]), ("truncated", coded[:-1]), ("long", coded + b"\0")]
    b = bytearray(coded)
    b[15] = 1
    cases.append(("padding byte", bytes(b)))
    b = bytearray(coded)
    b[16] += 1  # one escape more than the records hold
    cases.append(("escape count", bytes(b)))
    b = bytearray(coded)
    b[20] = 0x55  # codes that are not escapes where an escape record points
    b[20 + 5] = 0xFF  # and escapes without a record
    cases.append(("codes", bytes(b)))
    first = int.from_bytes(coded[rec : rec + 4], "little")
    b = bytearray(coded)
    b[rec : rec + 4] = (len(data) + 3).to_bytes(4, "little")
    cases.append(("position past the end", bytes(b)))
    b = bytearray(coded)
    b[rec + 5 : rec + 9] = first.to_bytes(4, "little")
    cases.append(("positions not increasing", bytes(b)))
    return cases


@pytest.mark.parametrize("case", _corrupt_nib_blocks(), ids=lambda c: c[0])
def test_nib_decode_rejects_inconsistent_blocks(case: tuple[str, bytes]) -> None:
    data, _ = _coded()
    with pytest.raises(CorruptChunkError):
        _native.nib_decode(case[1], bytearray(len(data)))


def test_nib_decode_rejects_a_set_padding_nibble() -> None:
    data = b"\x07" * 101
    out = bytearray(101)
    size = _native.nib_encode(data, out)
    assert size is not None
    coded = bytearray(out[:size])
    coded[20 + 50] |= 0x10
    with pytest.raises(CorruptChunkError):
        _native.nib_decode(bytes(coded), bytearray(101))
    # The C side checks the same on its own.
    lib, ffi = _native.lib, _native.ffi
    dst = bytearray(101)
    assert lib.mc_nib_decode(ffi.from_buffer(coded), size, ffi.from_buffer(dst),
                             101) == lib.MC_ERR_CORRUPT


def test_nib_c_rejects_bad_arguments() -> None:
    lib, ffi = _native.lib, _native.ffi
    size = ffi.new("int64_t *")
    src = bytearray(b"\x01" * 100)
    dst = bytearray(100)
    s, d = ffi.from_buffer(src), ffi.from_buffer(dst)
    assert lib.mc_nib_encode(s, 100, d, 99, size) == lib.MC_ERR_ARGUMENT  # cap < n
    assert lib.mc_nib_encode(s, 100, s, 100, size) == lib.MC_ERR_ARGUMENT  # in place
    assert lib.mc_nib_encode(s, 100, ffi.NULL, 100, size) == lib.MC_ERR_ARGUMENT
    assert lib.mc_nib_encode(s, 100, d, 100, ffi.NULL) == lib.MC_ERR_ARGUMENT
    assert lib.mc_nib_encode(s, -1, d, 100, size) == lib.MC_ERR_ARGUMENT
    assert lib.mc_nib_decode(s, -1, d, 100) == lib.MC_ERR_ARGUMENT
    assert lib.mc_nib_decode(s, 100, s, 100) == lib.MC_ERR_ARGUMENT
    assert lib.mc_crc32c(ffi.NULL, 4, 0, ffi.new("uint32_t *")) == lib.MC_ERR_ARGUMENT
    assert not any(dst)


@pytest.mark.parametrize(
    ("fn", "args", "message"),
    [
        ("nib_encode", (b"\x01" * 100, bytearray(99)), "needs 100"),
        ("nib_encode", (b"\x01" * 100, b"\0" * 100), "writable"),
        ("nib_encode", (12345, bytearray(10)), "bytes-like"),
        ("nib_encode", (np.zeros(8, np.uint16)[::2], bytearray(10)), "C-contiguous"),
        ("nib_decode", (b"\0" * 40, b"\0" * 100), "writable"),
        ("nib_decode", (b"\0" * 40, np.zeros(8, np.uint16)[::2]), "C-contiguous"),
        ("crc32c", (12345,), "bytes-like"),
    ],
)
def test_bad_coder_calls_raise_before_c(fn: str, args: tuple[object, ...], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        getattr(_native, fn)(*args)


def test_nib_takes_tensors() -> None:
    data = torch.tensor(list(_gaussian_bf16_high_bytes(5000)), dtype=torch.uint8)
    out = torch.zeros(5000, dtype=torch.uint8)
    size = _native.nib_encode(data, out)
    assert size is not None
    back = torch.zeros(5000, dtype=torch.uint8)
    _native.nib_decode(out[:size].clone(), back)
    assert torch.equal(back, data)


def test_nib_refuses_overlapping_buffers() -> None:
    buf = bytearray(b"\x01" * 200)
    view = memoryview(buf)
    with pytest.raises(InvalidInputError, match="overlaps"):
        _native.nib_encode(view[:100], view[50:150])
    data, coded = _coded()
    both = bytearray(coded + bytes(len(data)))
    view = memoryview(both)
    with pytest.raises(InvalidInputError, match="overlaps"):
        _native.nib_decode(view[: len(coded)], view[len(coded) - 1 : len(coded) - 1 + len(data)])


def test_nib_decode_checks_the_length_before_c(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_c(*args: object) -> int:
        raise AssertionError("C was called with a block of the wrong length")

    data, coded = _coded()
    monkeypatch.setattr(_native, "lib", type("L", (), {"mc_nib_decode": no_c}))
    for bad in (coded[:10], coded[:-1], coded + b"\0"):
        with pytest.raises(CorruptChunkError):
            _native.nib_decode(bad, bytearray(len(data)))


def test_crc32c_fold_path_matches_the_scalar_one_at_every_edge() -> None:
    # On a CPU with AVX-512 VPCLMULQDQ, 256 bytes and more are folded 64 bytes at a time by
    # carry-less multiplies and finished by crc32 instructions (16-byte steps, then bytes);
    # every length around those steps, at every alignment mod 64, from any register, must
    # give the scalar path's bits. Elsewhere both sides take the same crc32 path.
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 4096 + 64, dtype=np.uint8).tobytes()
    lengths = sorted({*range(240, 600), 1023, 1024, 1025, 4095, 4096}
                     | {256 * k + d for k in range(1, 16) for d in (-17, -16, -1, 0, 1, 15, 16, 63, 64)})
    best = _native.max_simd_level()
    for length in lengths:
        start = int(rng.integers(0, 64))
        piece = data[start : start + length]
        value = int(rng.integers(0, 1 << 32))
        _native.set_simd_level(best)
        fast = (_native.crc32c(piece), _native.crc32c(piece, value))
        _native.set_simd_level("none")
        assert fast == (_native.crc32c(piece), _native.crc32c(piece, value)), (length, start)
    _native.set_simd_level(best)
    # A flipped bit anywhere changes the checksum (what the fold must still catch).
    base = _native.crc32c(data[:2048])
    for bit in (0, 7, 8 * 255, 8 * 256, 8 * 1000 + 3, 8 * 2047 + 7):
        flipped = bytearray(data[:2048])
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert _native.crc32c(bytes(flipped)) != base


def test_slot_range_matches_numpy_min_and_max() -> None:
    from musacache import _native

    rng = np.random.default_rng(4)
    for n in (1, 2, 7, 4096, 100_003):
        a = rng.integers(-5, 1 << 40, n, dtype=np.int64)
        assert _native.slot_range_at(a.ctypes.data, n) == (int(a.min()), int(a.max()))
    with pytest.raises(_native.NativeError):
        _native.slot_range_at(a.ctypes.data, 0)
