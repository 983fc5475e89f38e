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

from musacache import _native, _version
from musacache._errors import (
    ConfigError,
    InvalidInputError,
    MusaCacheError,
    NativeBuildError,
    NativeError,
    SlotRangeError,
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
    released the GIL. (The counting loop sleeps for 0 s to hand the GIL back in turn.)"""
    work = make_work()
    started = threading.Event()

    def worker() -> None:
        started.set()
        for _ in range(4):
            work()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        ticks = 0
        while thread.is_alive():
            ticks += 1
            time.sleep(0)
        thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert ticks > 100


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
