"""musacache: an asyncio KV-cache layer for LLM inference.

``async with musacache.Cache(config) as cache``: ``put``, ``get``, ``lookup`` and ``prefetch``
token prefixes across device, host, disk and S3 tiers. See docs/quickstart.md.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from musacache.cache import Cache, Hit
from musacache.server.client import Client, connect

from . import devices, ipc, transfer
from ._api import KVCache, TokensLike
from ._config import CacheConfig, DeviceTier, HostTier
from ._errors import (
    CacheClosedError,
    CacheUnavailableError,
    ConfigError,
    CorruptChunkError,
    DeviceError,
    DTypeError,
    EventLoopError,
    FingerprintMismatchError,
    ForeignFormatError,
    InvalidInputError,
    IPCError,
    LayoutError,
    MusaCacheError,
    NativeBuildError,
    NativeError,
    PermissionDeniedError,
    ProtocolError,
    ReadyTimeoutError,
    ServerLimitError,
    ShapeError,
    SlotRangeError,
    TierError,
    TierTimeoutError,
    TokensError,
)
from ._spec import KVSpec
from ._version import __version__
from .tiers.base import ChunkMeta, StorageTier, TierContext
from .tiers.disk import DiskTier
from .tiers.s3 import S3Tier

__all__ = (
    "Cache",
    "CacheClosedError",
    "CacheConfig",
    "CacheUnavailableError",
    "ChunkMeta",
    "Client",
    "ConfigError",
    "CorruptChunkError",
    "DTypeError",
    "DeviceError",
    "DeviceTier",
    "DiskTier",
    "EventLoopError",
    "FingerprintMismatchError",
    "ForeignFormatError",
    "Hit",
    "HostTier",
    "IPCError",
    "InvalidInputError",
    "KVCache",
    "KVSpec",
    "LayoutError",
    "MusaCacheError",
    "NativeBuildError",
    "NativeError",
    "PermissionDeniedError",
    "ProtocolError",
    "ReadyTimeoutError",
    "S3Tier",
    "ServerLimitError",
    "ShapeError",
    "SlotRangeError",
    "StorageTier",
    "TierContext",
    "TierError",
    "TierTimeoutError",
    "TokensError",
    "TokensLike",
    "__version__",
    "connect",
    "devices",
    "ipc",
    "transfer",
)

if _TYPE_CHECKING:
    # mypy checks both implementations against the one protocol: a method that drifts on
    # either side fails the type check, not a user's code. Here, above both, so that neither
    # module has to import the other or the protocol's module import them.
    def _client_is_a_kvcache(c: Client) -> KVCache:
        return c

    def _cache_is_a_kvcache(c: Cache) -> KVCache:
        return c
