"""The musacache exception tree.

Every failure that crosses the public API is a :class:`MusaCacheError`. Foreign errors
(botocore, OSError, native status codes, socket errors) are translated at the boundary that
meets them with ``raise ... from``, so callers catch one tree. A cache *miss* is never an
exception: it is a value (``Hit.num_tokens == 0``, ``lookup() == 0``).
"""

from __future__ import annotations

__all__ = [
    "MusaCacheError",
    "ConfigError",
    "InvalidInputError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "TokensError",
    "SlotRangeError",
    "LayoutError",
    "CacheClosedError",
    "EventLoopError",
    "TierError",
    "TierTimeoutError",
    "CorruptChunkError",
    "ForeignFormatError",
    "FingerprintMismatchError",
    "NativeError",
    "NativeBuildError",
    "IPCError",
    "ProtocolError",
    "CacheUnavailableError",
    "PermissionDeniedError",
    "ReadyTimeoutError",
    "ServerLimitError",
]


class MusaCacheError(Exception):
    """Base class of every error raised by musacache.

    Catch this to handle any failure of the cache. Misses are not errors.
    """


class ConfigError(MusaCacheError, ValueError):
    """A configuration value is invalid (negative capacity, unknown tier, bad TOML/env value).

    Raised when a config object is built or loaded, before any resource is created. Fix the
    named setting.
    """


class InvalidInputError(MusaCacheError, ValueError):
    """An argument of a call is invalid. The call changed nothing.

    The subclasses say which kind of argument was wrong.
    """


class ShapeError(InvalidInputError):
    """A tensor has the wrong shape or rank for the cache's ``KVSpec`` or layout."""


class DTypeError(InvalidInputError):
    """A tensor has the wrong dtype (it must match ``KVSpec.dtype``; slots must be int64)."""


class DeviceError(InvalidInputError):
    """A tensor lives on a device the cache cannot read or write (or the device is missing)."""


class TokensError(InvalidInputError):
    """``tokens`` is not a 1-D sequence of integers that fit in int32."""


class SlotRangeError(InvalidInputError):
    """A ``slot_mapping`` entry is outside the paged cache (only -1 may mean "skip")."""


class LayoutError(InvalidInputError):
    """An unknown paged layout name, or ``kv_caches`` that do not match the named layout."""


class CacheClosedError(MusaCacheError, RuntimeError):
    """The cache (or client) was used after ``aclose()`` or outside ``async with``."""


class EventLoopError(MusaCacheError, RuntimeError):
    """A cache was closed from an event loop other than the one that opened it.

    A cache belongs to the event loop that opened it: open, use and close it under one
    ``asyncio.run`` (or one loop). When that loop has closed already, ``aclose()`` releases
    what needs no loop (memory, copy threads, storage tiers it can close) and then raises
    this; the cache is closed, and writes still queued in the old loop were lost with it.
    When that loop is still open, nothing is released: close the cache in its own loop.
    """


class TierError(MusaCacheError):
    """A tier failed to do its job (disk full, S3 down, timeout).

    Cold-tier faults are counted and turned into misses by the engine; this error only reaches
    the caller from explicit tier operations.
    """


class TierTimeoutError(TierError, TimeoutError):
    """A tier's operation outlived the tier's ``timeout`` (a hung network file system): it
    was abandoned, and the engine counts it under ``timeouts``."""


class CorruptChunkError(TierError):
    """A stored chunk object failed its header or checksum verification. It is treated as a miss
    and quarantined/deleted."""


class ForeignFormatError(CorruptChunkError):
    """An intact stored chunk object (its header checksum holds) of another format version.

    This musacache cannot read it, so it is an unreadable cold chunk like a corrupt one: a
    counted miss, never an error of the call that met it.
    """


class FingerprintMismatchError(MusaCacheError):
    """A stored chunk was written for another namespace, ``KVSpec``, chunk size or format version.

    The message names both sides. The codec raises it; a cache's reads count it as a
    ``foreign`` miss, with a warning, so a mismatched deployment is seen in its stats and log
    without a request failing. The node server raises it to a client that names another
    cache when ``max_caches`` is 1.
    """


class NativeError(MusaCacheError):
    """The native transfer module returned a failure status."""


class NativeBuildError(NativeError, ImportError):
    """The native module is missing or was built for another version of musacache.

    Rebuild it with ``pip install -e .`` (or ``pip install .``) from the source tree.
    """


class IPCError(MusaCacheError):
    """Memory or event IPC failed: a handle could not be exported, opened or released."""


class ProtocolError(MusaCacheError):
    """A frame on the node-server socket is malformed, oversized, or of an unknown kind/version."""


class CacheUnavailableError(MusaCacheError, ConnectionError):
    """The node server cannot be reached (not running, killed, or the call timed out).

    Client calls fail fast with this; the client reconnects on the next call.
    """


class PermissionDeniedError(MusaCacheError, PermissionError):
    """The node server refused the peer (its uid is not the server's and not allow-listed)."""


class ReadyTimeoutError(MusaCacheError, TimeoutError):
    """A ``ready`` event was not set within its timeout; nothing was read or written."""


class ServerLimitError(ProtocolError):
    """A peer went past a limit of the node server (requests in flight, fds held, caches
    served, staging bytes). The request was refused; nothing was changed."""
