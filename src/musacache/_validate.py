"""Number, size and type validators: the one place that decides what a setting may hold.

Every config field and call argument that is a count, a duration or a byte size is checked here,
so they all accept the same spellings and reject the same mistakes with the same words. The
rules are strict on purpose:

* an integer setting takes an ``int`` (or a numpy integer), never ``True``, ``"2"``, ``1.5`` or
  ``128.7``: a value that would be truncated or parsed is a mistake in the config, not a hint;
* a float setting takes an ``int`` or ``float`` that is finite: not ``True``, not a string, not a
  complex number, not NaN and not infinity;
* a byte size takes an ``int``, an integral float (TOML's ``8e9``) or a string with a unit
  (``"512MiB"``, ``"8GiB"``, ``"1.5GB"``).

Each validator raises ``error`` (default :class:`~musacache.ConfigError`, for settings); pass
``error=InvalidInputError`` (or a subclass) when checking the argument of a call. The message
names the setting (``what``) and the value that was given.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
import reprlib
from typing import Any

from ._errors import ConfigError, InvalidInputError, MusaCacheError

__all__ = [
    "boolean",
    "integer",
    "non_negative_float",
    "non_negative_int",
    "number",
    "optional_str",
    "parse_size",
    "positive_float",
    "positive_int",
    "shown",
    "size_bytes",
    "timeout",
]

ErrorType = type[MusaCacheError]

#: The largest byte size: every size travels in 64-bit fields (chunk headers, the native
#: module, the wire protocol).
MAX_SIZE = 2**63 - 1


class _Shown(reprlib.Repr):
    """``repr`` bounded in length and depth, so a message never fails to show a value."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = 120
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 8

    def repr_int(self, x: int, level: int) -> str:
        # repr() refuses ints past 4300 digits (a ValueError inside the message itself).
        if x.bit_length() > 256:
            return f"<an int of {x.bit_length()} bits>"
        return repr(x)


_SHOWN = _Shown()


def shown(value: Any) -> str:
    """``value`` as an error message shows it: its ``repr``, cut short if long or deep."""
    return _SHOWN.repr(value)

# A unit is an optional prefix (k..p, with "i" for binary), then an optional "b": "16i" or
# "ib" alone are no unit.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*((?:[kmgtp]i?)?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i


def _bounds(n: float, what: str, minimum: float | None, maximum: float | None,
            error: ErrorType, *, exclusive_min: bool = False) -> None:
    if minimum is not None and (n < minimum or (exclusive_min and n == minimum)):
        if minimum == 0:
            rule = "be positive" if exclusive_min else "not be negative"
        elif minimum == 1 and isinstance(n, int):
            rule = "be positive"
        else:
            rule = f"be {'>' if exclusive_min else '>='} {minimum}"
        raise error(f"{what} must {rule}, got {shown(n)}")
    if maximum is not None and n > maximum:
        raise error(f"{what} must be at most {maximum}, got {shown(n)}")


def integer(value: Any, what: str, *, minimum: int | None = None, maximum: int | None = None,
            error: ErrorType = ConfigError) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]``; no bool, str or float."""
    if isinstance(value, bool):
        raise error(f"{what} must be an integer, got {shown(value)}")
    try:
        # __index__ accepts ints and numpy integers, and nothing that would be truncated.
        n = operator.index(value)
    except TypeError:
        raise error(f"{what} must be an integer, got {shown(value)} "
                    f"({type(value).__name__})") from None
    _bounds(n, what, minimum, maximum, error)
    return n


def positive_int(value: Any, what: str, *, maximum: int | None = None,
                 error: ErrorType = ConfigError) -> int:
    """An ``int`` >= 1 (a count: threads, layers, a chunk size)."""
    return integer(value, what, minimum=1, maximum=maximum, error=error)


def non_negative_int(value: Any, what: str, *, maximum: int | None = None,
                     error: ErrorType = ConfigError) -> int:
    """An ``int`` >= 0 (retries, an offset)."""
    return integer(value, what, minimum=0, maximum=maximum, error=error)


def number(value: Any, what: str, *, minimum: float | None = None,
           maximum: float | None = None, exclusive_min: bool = False,
           error: ErrorType = ConfigError) -> float:
    """A finite real number as a ``float``; no bool, str, complex, NaN or infinity."""
    if isinstance(value, bool):
        raise error(f"{what} must be a number, got {shown(value)}")
    if not isinstance(value, numbers.Real):  # numpy scalars register as Real; complex does not
        raise error(f"{what} must be a number, got {shown(value)} ({type(value).__name__})")
    try:
        x = float(value)
    except OverflowError:  # an int past the float range
        x = math.inf
    if not math.isfinite(x):
        raise error(f"{what} must be a finite number, got {shown(value)}")
    _bounds(x, what, minimum, maximum, error, exclusive_min=exclusive_min)
    return x


def positive_float(value: Any, what: str, *, error: ErrorType = ConfigError) -> float:
    """A finite number > 0 (a timeout that must allow some time, an interval)."""
    return number(value, what, minimum=0, exclusive_min=True, error=error)


def non_negative_float(value: Any, what: str, *, error: ErrorType = ConfigError) -> float:
    """A finite number >= 0 (a backoff, an interval where 0 means "every time")."""
    return number(value, what, minimum=0, error=error)


def timeout(value: Any, what: str = "timeout", *,
            error: ErrorType = InvalidInputError) -> float | None:
    """``None`` (wait without a bound) or a finite number of seconds >= 0.

    Defaults to :class:`InvalidInputError`: a timeout is usually the argument of a call
    (``prefetch(timeout=)``), to be checked before the call starts any work.
    """
    if value is None:
        return None
    return number(value, what, minimum=0, error=error)


def size_bytes(value: Any, what: str = "size", *, minimum: int = 0,
               maximum: int | None = None, error: ErrorType = ConfigError) -> int:
    """A byte count from an ``int``, an integral float, or a string with a unit.

    ``"8GiB"`` -> 8589934592, ``"1.5GB"`` -> 1500000000, ``"512"`` -> 512.
    """
    if isinstance(value, bool):
        raise error(f"{what} must be a byte count, got {shown(value)}")
    n: int
    if isinstance(value, float):
        if not value.is_integer():
            raise error(f"{what} must be a whole number of bytes, got {shown(value)}")
        n = int(value)
    elif isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("-"):
            raise error(f"{what} must not be negative, got {shown(value)}")
        m = _SIZE_RE.match(stripped)
        if not m:
            raise error(f"{what}: cannot read {shown(value)} as a size (e.g. 512MiB, 8GiB)")
        exact = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not exact.is_integer():  # "1.5" bytes, as the float 1.5 is refused
            raise error(f"{what} must be a whole number of bytes, got {shown(value)}")
        n = int(exact)
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise error(f"{what} must be a byte count, got {type(value).__name__}") from None
    if n < 0:
        raise error(f"{what} must not be negative, got {shown(value)}")
    if n < minimum:
        raise error(f"{what} must be at least {minimum} bytes, got {shown(value)}")
    maximum = MAX_SIZE if maximum is None else min(maximum, MAX_SIZE)
    if n > maximum:
        raise error(f"{what} must be at most {maximum} bytes, got {shown(value)}")
    return n


def parse_size(value: Any, *, what: str = "size") -> int:
    """``"8GiB"`` -> 8589934592 (a ConfigError for anything that is not a byte count >= 0)."""
    return size_bytes(value, what)


def boolean(value: Any, what: str, *, error: ErrorType = ConfigError) -> bool:
    """``True`` or ``False`` only (``1``, ``"yes"`` and ``None`` are mistakes here)."""
    if not isinstance(value, bool):
        raise error(f"{what} must be true or false, got {shown(value)}")
    return value


def optional_str(value: Any, what: str, *, allow_empty: bool = True,
                 error: ErrorType = ConfigError) -> str | None:
    """``None`` or a ``str`` (``bytes`` and numbers are rejected, not converted)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise error(f"{what} must be a string, got {shown(value)} ({type(value).__name__})")
    if not allow_empty and not value:
        raise error(f"{what} must not be empty")
    return value
