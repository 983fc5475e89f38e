"""Frozen configuration: the cache, its memory tiers, and the loaders (TOML and environment).

Every setting has one name. A TOML file and the environment spell the same names:

* TOML: ``namespace = "llama"``, ``[spec] num_layers = 32``, ``[[tiers]] kind = "host"``...
* env:  ``MUSACACHE_NAMESPACE=llama``, ``MUSACACHE_SPEC__NUM_LAYERS=32``,
  ``MUSACACHE_TIERS__0__KIND=host``... (``__`` nests, list indexes are numbers).

Sizes accept ints or strings such as ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from ._errors import ConfigError
from ._spec import KVSpec
from ._validate import parse_size

if TYPE_CHECKING:
    from .tiers.base import StorageTier

__all__ = ["CacheConfig", "DeviceTier", "HostTier", "TierConfig", "parse_size"]

DEFAULT_SEGMENT_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class HostTier:
    """Host memory. ``pinned="auto"`` pins only where an accelerator exists (pinning needs one).

    The pool grows lazily in segments of ``segment_bytes``: creating a 512 GiB tier allocates
    nothing until chunks arrive.
    """

    capacity_bytes: int | str
    pinned: bool | Literal["auto"] = "auto"
    segment_bytes: int | str = DEFAULT_SEGMENT_BYTES
    name: str = "host"
    #: Bytes allocated (and pinned) at ``open()``, for servers that want no growth on the
    #: request path; the rest still grows lazily, ahead of need.
    prealloc: int | str = 0
    kind: Literal["host"] = field(default="host", init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes",
                           parse_size(self.capacity_bytes, what=f"{self.name}.capacity_bytes"))
        object.__setattr__(self, "segment_bytes",
                           parse_size(self.segment_bytes, what=f"{self.name}.segment_bytes"))
        object.__setattr__(self, "prealloc",
                           parse_size(self.prealloc, what=f"{self.name}.prealloc"))
        if int(self.prealloc) > int(self.capacity_bytes):
            raise ConfigError(f"{self.name}.prealloc ({self.prealloc} bytes) is more than its "
                              f"capacity_bytes ({self.capacity_bytes})")
        if self.pinned not in (True, False, "auto"):
            raise ConfigError(
                f"{self.name}.pinned must be true, false or 'auto', got {self.pinned!r}")
        if int(self.segment_bytes) <= 0:
            raise ConfigError(f"{self.name}.segment_bytes must be positive")


@dataclass(frozen=True)
class DeviceTier:
    """Accelerator memory (cuda or musa), or CPU memory when ``device`` resolves to cpu.

    ``device="auto"`` picks cuda, then musa, then cpu.
    """

    capacity_bytes: int | str
    device: str = "auto"
    segment_bytes: int | str = DEFAULT_SEGMENT_BYTES
    name: str = "device"
    kind: Literal["device"] = field(default="device", init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes",
                           parse_size(self.capacity_bytes, what=f"{self.name}.capacity_bytes"))
        object.__setattr__(self, "segment_bytes",
                           parse_size(self.segment_bytes, what=f"{self.name}.segment_bytes"))
        if int(self.segment_bytes) <= 0:
            raise ConfigError(f"{self.name}.segment_bytes must be positive")


TierConfig = Union[HostTier, DeviceTier, "StorageTier", Any]


@dataclass(frozen=True)
class CacheConfig:
    """Everything a :class:`~musacache.Cache` needs. ``tiers`` is ordered hot to cold.

    A tier is a :class:`DeviceTier`, a :class:`HostTier`, a :class:`~musacache.DiskTier`, an
    :class:`~musacache.S3Tier`, or an instance of your own
    :class:`~musacache.StorageTier` subclass.
    """

    spec: KVSpec
    namespace: str
    tiers: tuple[Any, ...] = (HostTier(capacity_bytes=4 * 1024**3),)
    chunk_size: int = 256
    #: Optional tenant salt: two tenants never share (or even see) each other's chunks.
    tenant: str | None = None
    #: Worker threads for copies, lz4 and native calls (they release the GIL).
    copy_threads: int = 2
    #: Copies smaller than this run on the event loop; larger ones go to a worker thread.
    inline_copy_bytes: int | str = 256 * 1024
    #: Encoded bytes that may wait for storage-tier writes before ``put`` feels backpressure.
    write_queue_bytes: int | str = 512 * 1024**2
    #: Minimum seconds between directory refreshes of shared storage tiers on a miss.
    refresh_interval: float = 2.0
    #: On ``aclose()``, write chunks held only in memory down to the first storage tier, so a
    #: restarted cache on the same disk or bucket finds them (costs encode + write time).
    persist_on_close: bool = True
    #: Where ``get`` returns KV (``Hit.kv``): ``"auto"`` is the hottest memory tier's device;
    #: or ``"cpu"``, ``"cuda[:n]"``, ``"musa[:n]"`` (a host-only cache can return device
    #: tensors).
    device: str = "auto"
    #: Seconds ``aclose()`` may spend persisting chunks and finishing queued writes; what is
    #: left after it is counted (``stats()["close"]``), not waited for.
    close_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise ConfigError(f"spec must be a KVSpec, got {type(self.spec).__name__}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError("namespace must be a non-empty string (the model name)")
        tiers = tuple(self.tiers) if not isinstance(self.tiers, tuple) else self.tiers
        if not tiers:
            raise ConfigError("tiers must name at least one tier")
        object.__setattr__(self, "tiers", tiers)
        names = [getattr(t, "name", type(t).__name__) for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}; set name= on each tier")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) \
                or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
        if self.copy_threads <= 0:
            raise ConfigError(f"copy_threads must be positive, got {self.copy_threads}")
        object.__setattr__(self, "inline_copy_bytes",
                           parse_size(self.inline_copy_bytes, what="inline_copy_bytes"))
        object.__setattr__(self, "write_queue_bytes",
                           parse_size(self.write_queue_bytes, what="write_queue_bytes"))
        if self.refresh_interval < 0:
            raise ConfigError("refresh_interval must not be negative")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda[:n]' or 'musa[:n]', "
                              f"got {self.device!r}")
        if isinstance(self.close_timeout, bool) or not isinstance(self.close_timeout,
                                                                  (int, float)) \
                or not self.close_timeout >= 0:
            raise ConfigError(f"close_timeout must be a number of seconds >= 0, "
                              f"got {self.close_timeout!r}")
        if not isinstance(self.persist_on_close, bool):
            raise ConfigError(
                f"persist_on_close must be true or false, got {self.persist_on_close!r}")

    # -- loaders --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        """Build from the nested mapping that TOML and the environment both produce."""
        data = dict(data)
        spec_data = data.pop("spec", None)
        if not isinstance(spec_data, Mapping):
            raise ConfigError(
                "the config needs a [spec] table (num_layers, num_kv_heads, head_dim)")
        tiers_data = data.pop("tiers", None)
        if tiers_data is None:
            tiers: tuple[Any, ...] = (HostTier(capacity_bytes=4 * 1024**3),)
        else:
            if isinstance(tiers_data, Mapping):  # env form: {"0": {...}, "1": {...}}
                tiers_data = [tiers_data[k] for k in sorted(tiers_data, key=_index_key)]
            tiers = tuple(_tier_from_dict(t, i) for i, t in enumerate(tiers_data))
        known = {f.name for f in dataclasses.fields(cls)} - {"spec", "tiers"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
        if "chunk_size" in data:
            data["chunk_size"] = _as_int(data["chunk_size"], "chunk_size")
        if "copy_threads" in data:
            data["copy_threads"] = _as_int(data["copy_threads"], "copy_threads")
        if "refresh_interval" in data:
            data["refresh_interval"] = _as_float(data["refresh_interval"], "refresh_interval")
        if "close_timeout" in data:
            data["close_timeout"] = _as_float(data["close_timeout"], "close_timeout")
        return cls(spec=KVSpec.from_dict(_coerce_spec(spec_data)), tiers=tiers, **data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> CacheConfig:
        """Load a TOML file (see docs/configuration.md)."""
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 prefix: str = "MUSACACHE_") -> CacheConfig:
        """Read ``MUSACACHE_*`` variables; ``MUSACACHE_CONFIG`` names a TOML file to start from,
        which the other variables then override."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        base = env.get(prefix + "CONFIG")
        if base:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            try:
                data = tomllib.loads(Path(base).read_text())
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ConfigError(f"MUSACACHE_CONFIG={base}: {e}") from e
            if isinstance(data.get("tiers"), list):
                data["tiers"] = {str(i): t for i, t in enumerate(data["tiers"])}
        for name, raw in env.items():
            if not name.startswith(prefix) or name == prefix + "CONFIG":
                continue
            path = [p.lower() for p in name[len(prefix):].split("__")]
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{name}: {part} is not a table")
            node[path[-1]] = _env_value(raw)
        return cls.from_dict(data)


def _index_key(k: str) -> int:
    try:
        return int(k)
    except ValueError:
        raise ConfigError(f"tier index must be a number, got {k!r}") from None


def _env_value(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", ""):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def _as_int(v: Any, what: str) -> int:
    try:
        if isinstance(v, bool):
            raise ValueError
        return int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be an integer, got {v!r}") from None


def _as_float(v: Any, what: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {v!r}") from None


def _coerce_spec(d: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for k in ("num_layers", "num_kv_heads", "head_dim"):
        if k in out:
            out[k] = _as_int(out[k], f"spec.{k}")
    return out


def tier_kinds() -> dict[str, type]:
    """Config classes by ``kind`` name; cold tiers are imported only when named."""
    kinds: dict[str, type] = {"host": HostTier, "device": DeviceTier}
    try:
        from .tiers.disk import DiskTier

        kinds["disk"] = DiskTier
    except ImportError:
        pass
    try:
        from .tiers.s3 import S3Tier

        kinds["s3"] = S3Tier
    except ImportError:
        pass
    return kinds


def _tier_from_dict(d: Any, index: int) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(f"tiers[{index}] must be a table, got {type(d).__name__}")
    d = dict(d)
    kind = d.pop("kind", None)
    kinds = tier_kinds()
    if kind not in kinds:
        raise ConfigError(f"tiers[{index}].kind must be one of {sorted(kinds)}, got {kind!r}")
    cls = kinds[kind]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    if "capacity" in d and "capacity_bytes" not in d:
        d["capacity_bytes"] = d.pop("capacity")
    unknown = set(d) - fields
    if unknown:
        raise ConfigError(f"tiers[{index}] ({kind}): unknown setting(s) {sorted(unknown)}; "
                          f"known: {sorted(fields)}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"tiers[{index}] ({kind}): {e}") from e
