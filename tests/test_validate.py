"""The ground-floor validators and the rate-limited logger."""

import logging
import math

import numpy as np
import pytest

import musacache as mc
from musacache import _validate as v
from musacache._log import RateLimitedLog


@pytest.mark.parametrize("bad", ["2", 1.5, 128.7, 2.0, True, False, None, [1], 1j, b"2"])
def test_integers_reject_everything_that_is_not_an_int(bad):
    with pytest.raises(mc.ConfigError, match="copy_threads must be an integer"):
        v.positive_int(bad, "copy_threads")


def test_integers_accept_ints_and_numpy_ints():
    assert v.positive_int(3, "n") == 3
    got = v.positive_int(np.int64(3), "n")
    assert got == 3 and type(got) is int
    assert v.non_negative_int(0, "n") == 0


@pytest.mark.parametrize("fn,value,message", [
    (v.positive_int, 0, "n must be positive, got 0"),
    (v.positive_int, -3, "n must be positive, got -3"),
    (v.non_negative_int, -1, "n must not be negative, got -1"),
])
def test_integer_bounds(fn, value, message):
    with pytest.raises(mc.ConfigError, match=message):
        fn(value, "n")


def test_integer_maximum():
    assert v.positive_int(2**31 - 1, "chunk_size", maximum=2**31 - 1) == 2**31 - 1
    with pytest.raises(mc.ConfigError, match="at most"):
        v.positive_int(2**32 + 1, "chunk_size", maximum=2**31 - 1)


@pytest.mark.parametrize("bad", ["x", "2", [1], 1j, math.nan, math.inf, -math.inf, True, None])
def test_floats_reject_strings_complex_nan_inf_and_bools(bad):
    with pytest.raises(mc.ConfigError, match="interval must be a"):
        v.positive_float(bad, "interval")


def test_floats_accept_ints_and_floats():
    assert v.positive_float(2, "t") == 2.0
    assert v.non_negative_float(0, "t") == 0.0
    assert v.non_negative_float(np.float32(0.5), "t") == 0.5
    with pytest.raises(mc.ConfigError, match="t must be positive"):
        v.positive_float(0, "t")
    with pytest.raises(mc.ConfigError, match="t must not be negative"):
        v.non_negative_float(-0.1, "t")


@pytest.mark.parametrize("bad", ["1", [1.0], 1j, math.nan, math.inf, -1, True])
def test_timeout_rejects_non_numbers_with_an_input_error(bad):
    with pytest.raises(mc.InvalidInputError, match="timeout"):
        v.timeout(bad)


def test_timeout_accepts_none_and_finite_non_negative():
    assert v.timeout(None) is None
    assert v.timeout(0) == 0.0
    assert v.timeout(1.5) == 1.5


def test_error_class_is_the_callers_choice():
    with pytest.raises(mc.TokensError):
        v.positive_int("x", "n", error=mc.TokensError)
    with pytest.raises(mc.ConfigError):
        v.timeout("x", "prefetch timeout", error=mc.ConfigError)


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
    ("1k", 1000), ("2 KiB", 2048), ("512", 512), (4096, 4096), (8e9, 8_000_000_000),
    (np.int64(5), 5)])
def test_size_bytes(text, expected):
    assert v.size_bytes(text, "cap") == expected
    assert v.parse_size(text) == expected


@pytest.mark.parametrize("bad", [True, "-1GiB", -5, "lots", 1.5, [1], None, "1 XB"])
def test_size_bytes_rejects(bad):
    with pytest.raises(mc.ConfigError, match="cap"):
        v.size_bytes(bad, "cap")


def test_size_bytes_minimum():
    with pytest.raises(mc.ConfigError, match="at least 1 bytes"):
        v.size_bytes(0, "cap", minimum=1)


def test_boolean_and_optional_str():
    assert v.boolean(False, "f") is False
    for bad in (1, "yes", None):
        with pytest.raises(mc.ConfigError, match="f must be true or false"):
            v.boolean(bad, "f")
    assert v.optional_str(None, "tenant") is None
    assert v.optional_str("a", "tenant") == "a"
    for bad in (123, b"abc"):
        with pytest.raises(mc.ConfigError, match="tenant must be a string"):
            v.optional_str(bad, "tenant")
    with pytest.raises(mc.ConfigError, match="must not be empty"):
        v.optional_str("", "tenant", allow_empty=False)


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_rate_limited_log_writes_one_line_per_tier_and_kind_per_interval(caplog):
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger("musacache.test"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="musacache.test"):
        assert log.warn("s3", "timeout", "read took 2 s")
        for _ in range(5):
            assert not log.warn("s3", "timeout", "read took 2 s")
        assert log.warn("s3", "read fault", "boom")  # another kind is not held back
        assert log.warn("disk", "timeout", "slow")  # nor another tier
        assert log.suppressed("s3", "timeout") == 5
        clock.now += 10.0
        assert log.warn("s3", "timeout", "again")
        assert log.suppressed("s3", "timeout") == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["tier s3: timeout: read took 2 s", "tier s3: read fault: boom",
                     "tier disk: timeout: slow",
                     "tier s3: timeout: again (5 similar suppressed)"]
