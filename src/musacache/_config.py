"""Frozen configuration: the cache, its memory tiers, and the loaders (TOML and environment).

Every setting has one name. A TOML file and the environment spell the same names:

* TOML: ``namespace = "llama"``, ``[spec] num_layers = 32``, ``[[tiers]] kind = "host"``...
* env:  ``MUSACACHE_NAMESPACE=llama``, ``MUSACACHE_SPEC__NUM_LAYERS=32``,
  ``MUSACACHE_TIERS__0__KIND=host``... (``__`` nests, list indexes are numbers).

Sizes accept ints or strings such as ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._errors import ConfigError
from ._spec import KVSpec
from ._validate import (
    boolean,
    non_negative_float,
    optional_str,
    parse_size,
    positive_int,
    shown,
    size_bytes,
)
from .tiers import register_tier_kind, tier_kind, tier_kinds
from .tiers.base import TierConfig

__all__ = ["MAX_CHUNK_BYTES", "MAX_CHUNK_SIZE", "MAX_DEPTH", "CacheConfig", "DeviceTier",
           "HostTier", "MemoryTierConfig", "TierConfig", "check_depth", "parse_size",
           "read_toml"]

DEFAULT_SEGMENT_BYTES = 256 * 1024**2

#: The largest ``chunk_size``. A chunk object's header stores the chunk size and a chunk's token
#: count in 32-bit fields (``struct.error`` at the first write to a storage tier, past 2**32 - 1);
#: the bound stays within a signed 32-bit int so every reader of the header agrees on it. Any
#: useful chunk is far smaller: a chunk is one memory slot, and 2**31 tokens of the smallest
#: real model's KV would be terabytes.
MAX_CHUNK_SIZE = 2**31 - 1
#: The most bytes one chunk may take (a tier's slot; the chunk header's lengths are 64-bit).
MAX_CHUNK_BYTES = 2**40
#: The deepest that a config's tables and arrays may nest: a real one is 4 deep (tiers, a
#: tier, a list value), and deeper data recurses without bound in the TOML parser and in the
#: messages that show its values.
MAX_DEPTH = 32


def check_depth(data: Any, where: str) -> None:
    """A :class:`ConfigError` if tables and arrays in ``data`` nest deeper than MAX_DEPTH.

    It walks with a stack of its own, so data of any depth (or a cycle) is refused without
    recursing."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where}: tables and arrays nest more than {MAX_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)


def read_toml(path: str | os.PathLike[str], where: str) -> dict[str, Any]:
    """The table of a TOML file, checked by :func:`check_depth`; a :class:`ConfigError`
    that starts with ``where`` for a file that cannot be read or is no UTF-8 TOML."""
    import tomllib

    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{where}: a config path is a str or a PathLike, "
                          f"got {type(path).__name__}")
    try:
        raw = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ConfigError(f"cannot read {where}: {e}") from e
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except RecursionError:
        # The parser recurses once per nested array or inline table.
        raise ConfigError(f"{where}: tables and arrays nest more than {MAX_DEPTH} deep") \
            from None
    except (UnicodeDecodeError, ValueError) as e:  # an int past int()'s digits is ValueError
        raise ConfigError(f"{where} is not valid TOML: {e}") from e
    check_depth(data, where)
    return data


def _tier_name(value: Any, default: str) -> str:
    name = optional_str(value, f"{default} tier name", allow_empty=False)
    return default if name is None else name


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
        object.__setattr__(self, "name", _tier_name(self.name, "host"))
        object.__setattr__(self, "capacity_bytes", size_bytes(
            self.capacity_bytes, f"{self.name}.capacity_bytes", minimum=1))
        object.__setattr__(self, "segment_bytes", size_bytes(
            self.segment_bytes, f"{self.name}.segment_bytes", minimum=1))
        object.__setattr__(self, "prealloc", size_bytes(self.prealloc, f"{self.name}.prealloc"))
        if int(self.prealloc) > int(self.capacity_bytes):
            raise ConfigError(f"{self.name}.prealloc ({self.prealloc} bytes) is more than its "
                              f"capacity_bytes ({self.capacity_bytes})")
        if not (isinstance(self.pinned, bool) or self.pinned == "auto"):
            raise ConfigError(
                f"{self.name}.pinned must be true, false or 'auto', got {shown(self.pinned)}")


_DEVICE_NAME = re.compile(r"auto|cpu|(cuda|musa)(:\d+)?")


def _device_name(value: object, what: str) -> None:
    """Refuse a device name that can never resolve ("gpu", "cuda0"), when the config is made:
    whether the device exists is known only where the cache opens, but a misspelling is
    known now (a server started with one listened, and refused every client)."""
    if not isinstance(value, str) or not _DEVICE_NAME.fullmatch(value):
        raise ConfigError(f"{what} must be 'auto', 'cpu', 'cuda[:n]' or 'musa[:n]', "
                          f"got {shown(value)}")


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
        object.__setattr__(self, "name", _tier_name(self.name, "device"))
        object.__setattr__(self, "capacity_bytes", size_bytes(
            self.capacity_bytes, f"{self.name}.capacity_bytes", minimum=1))
        object.__setattr__(self, "segment_bytes", size_bytes(
            self.segment_bytes, f"{self.name}.segment_bytes", minimum=1))
        optional_str(self.device, f"{self.name}.device", allow_empty=False)
        if self.device is not None:
            _device_name(self.device, f"{self.name}.device")


#: The tiers whose chunks the engine holds as tensors in a pool of its own.
MemoryTierConfig = HostTier | DeviceTier

register_tier_kind("host", HostTier)
register_tier_kind("device", DeviceTier)


@dataclass(frozen=True)
class CacheConfig:
    """Everything a :class:`~musacache.Cache` needs. ``tiers`` is ordered hot to cold.

    A tier is a :class:`DeviceTier`, a :class:`HostTier`, a :class:`~musacache.DiskTier`, an
    :class:`~musacache.S3Tier`, or any other :class:`~musacache.tiers.base.TierConfig` (an
    object with ``name`` and ``build()``), such as an instance of your own
    :class:`~musacache.StorageTier` subclass.
    """

    spec: KVSpec
    namespace: str
    #: Built in Python, a config without tiers gets one 4 GiB host tier. A TOML file or the
    #: environment must name its tiers (``[[tiers]]``): a file that forgot them is refused.
    tiers: tuple[MemoryTierConfig | TierConfig, ...] = (HostTier(capacity_bytes=4 * 1024**3),)
    chunk_size: int = 256
    #: Optional tenant salt: two tenants never share (or even see) each other's chunks.
    tenant: str | None = None
    #: Worker threads for copies, lz4 and native calls (they release the GIL).
    copy_threads: int = 2
    #: Copies smaller than this run on the event loop (a thread hop costs more than they
    #: do: 4 MiB is 32 tokens of a Llama-3-8B KV); larger ones go to a worker thread.
    inline_copy_bytes: int | str = 4 * 1024**2
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
    #: How a chunk that ``get`` reads from a local storage tier (disk) reaches a host top
    #: tier. ``"background"``: the read goes straight into the get's tensor (``out``, or the
    #: one it returns: one pass over the bytes, the get returns sooner), and the chunk is
    #: promoted by a second read after the get has returned (``flush()`` waits for it).
    #: ``"sync"``: the read lands in a top-tier slot and is copied on into the get's tensor
    #: in the same pass; the chunk is resident when the get returns.
    promotion: Literal["background", "sync"] = "background"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise ConfigError(f"spec must be a KVSpec, got {type(self.spec).__name__}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError("namespace must be a non-empty string (the model name)")
        if isinstance(self.tiers, (str, bytes, Mapping)) or not hasattr(self.tiers, "__iter__"):
            raise ConfigError(f"tiers must be a sequence of tier configs, got "
                              f"{shown(self.tiers)}")
        tiers = tuple(self.tiers)
        if not tiers:
            raise ConfigError("tiers must name at least one tier")
        for i, tier in enumerate(tiers):
            if not isinstance(tier, (HostTier, DeviceTier, TierConfig)):
                raise ConfigError(
                    f"tiers[{i}] is a {type(tier).__name__}: a tier is a HostTier, a "
                    "DeviceTier, a DiskTier, an S3Tier, or a StorageTier (anything with a "
                    "name and build())")
            name = getattr(tier, "name", None)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"tiers[{i}].name must be a non-empty string, got "
                                  f"{shown(name)}")
        object.__setattr__(self, "tiers", tiers)
        for hot, cold in itertools.pairwise(tiers):
            if isinstance(cold, (HostTier, DeviceTier)) and \
                    not isinstance(hot, (HostTier, DeviceTier)):
                # Tiers go hot to cold: chunks move down from memory to storage, never up
                # into a memory tier listed below one (it would stay empty).
                raise ConfigError(f"tiers go hot to cold: memory tier {shown(cold.name)} "
                                  f"cannot come after storage tier {shown(hot.name)}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}; set name= on each tier")
        object.__setattr__(self, "chunk_size",
                           positive_int(self.chunk_size, "chunk_size", maximum=MAX_CHUNK_SIZE))
        if self.spec.nbytes(self.chunk_size) > MAX_CHUNK_BYTES:
            raise ConfigError(
                f"a chunk of {self.chunk_size} tokens of {self.spec.describe()} takes "
                f"{self.spec.nbytes(self.chunk_size)} bytes; at most {MAX_CHUNK_BYTES} (1 TiB) "
                "are supported: use a smaller chunk_size")
        object.__setattr__(self, "tenant",
                           optional_str(self.tenant, "tenant", allow_empty=False))
        object.__setattr__(self, "copy_threads", positive_int(self.copy_threads, "copy_threads"))
        object.__setattr__(self, "inline_copy_bytes",
                           parse_size(self.inline_copy_bytes, what="inline_copy_bytes"))
        object.__setattr__(self, "write_queue_bytes",
                           parse_size(self.write_queue_bytes, what="write_queue_bytes"))
        object.__setattr__(self, "refresh_interval",
                           non_negative_float(self.refresh_interval, "refresh_interval"))
        boolean(self.persist_on_close, "persist_on_close")
        _device_name(self.device, "device")
        object.__setattr__(self, "close_timeout",
                           non_negative_float(self.close_timeout, "close_timeout"))
        if self.promotion not in ("background", "sync"):
            raise ConfigError(f"promotion must be 'background' or 'sync', got "
                              f"{shown(self.promotion)}")

    # -- loaders --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        """Build from the nested mapping that TOML and the environment both produce.

        Values are checked as strictly as in Python: ``chunk_size = 128.7`` or
        ``num_layers = "4"`` is a :class:`ConfigError`, not a conversion.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config is a table of settings, got {type(data).__name__}")
        check_depth(data, "the config")
        data = dict(data)
        spec_data = data.pop("spec", None)
        if not isinstance(spec_data, Mapping):
            raise ConfigError(
                "the config needs a [spec] table (num_layers, num_kv_heads, head_dim)")
        tiers_data = data.pop("tiers", None)
        if not tiers_data:
            # A 4 GiB default would hide a forgotten table (or a misspelt [[tier]]) until
            # memory ran short in production; a file says what it wants.
            raise ConfigError(
                "the config names no tiers: add one [[tiers]] table per tier, hot to cold, "
                'e.g. [[tiers]] kind = "host" capacity = "16GiB" '
                "(env: MUSACACHE_TIERS__0__KIND=host, MUSACACHE_TIERS__0__CAPACITY=16GiB)")
        if isinstance(tiers_data, Mapping):  # env form: {"0": {...}, "1": {...}}
            tiers_data = [tiers_data[k] for k in sorted(tiers_data, key=_index_key)]
        if isinstance(tiers_data, (str, bytes)) or not isinstance(tiers_data, list):
            raise ConfigError(f"tiers must be a list of tables ([[tiers]]), got "
                              f"{shown(tiers_data)}")
        tiers = tuple(tier_from_dict(t, i) for i, t in enumerate(tiers_data))
        fields = [f for f in dataclasses.fields(cls) if f.name not in ("spec", "tiers")]
        known = {f.name for f in fields}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown, key=str)}; "
                              f"known: {sorted(known)}")
        missing = [f.name for f in fields if f.name not in data
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"the config needs {', '.join(missing)} (e.g. namespace = "
                              '"llama-3-8b", the model name)')
        return cls(spec=KVSpec.from_dict(spec_data), tiers=tiers, **data)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> CacheConfig:
        """Load a TOML file (see docs/configuration.md)."""
        return cls.from_dict(read_toml(path, f"config file {path}"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 prefix: str = "MUSACACHE_") -> CacheConfig:
        """Read ``MUSACACHE_*`` variables; ``MUSACACHE_CONFIG`` names a TOML file to start from,
        which the other variables then override. The variables of musacache's own tooling
        (``ENV_RESERVED``: the engines' test interpreters, the native module's thread count)
        are not settings and are passed over, so a shell that exports them can still build a
        config from its environment."""
        env = os.environ if environ is None else environ
        if not isinstance(env, Mapping):
            raise ConfigError(f"the environment is a mapping of names to strings, got "
                              f"{type(env).__name__}")
        data: dict[str, Any] = {}
        base = env.get(prefix + "CONFIG")
        if base:
            data = read_toml(base, f"{prefix}CONFIG={base}")
            if isinstance(data.get("tiers"), list):
                data["tiers"] = {str(i): t for i, t in enumerate(data["tiers"])}
        for name, raw in env.items():
            if not name.startswith(prefix) or name == prefix + "CONFIG" \
                    or name[len(prefix):] in ENV_RESERVED:
                continue
            if not isinstance(raw, str):
                raise ConfigError(f"{name}: an environment value is a string, got "
                                  f"{type(raw).__name__}")
            path = [p.lower() for p in name[len(prefix):].split("__")]
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{name}: {part} is not a table")
            setting = path[-1]
            if len(path) == 3 and path[0] == "tiers" and setting in ("capacity",
                                                                      "capacity_bytes"):
                # A tier's capacity has two spellings: the variable replaces whichever the
                # file used (both at once are refused as unknown).
                node.pop("capacity", None)
                setting = "capacity_bytes"
            node[setting] = _env_value(raw, setting)
        return cls.from_dict(data)


#: ``MUSACACHE_*`` variables that are not settings: read by the native module
#: (``NATIVE_THREADS``), the test suite and CI (the serving engines' venvs and interpreters),
#: and the noxfile (``TORCH``). ``CacheConfig.from_env`` passes over them.
ENV_RESERVED = frozenset({
    "NATIVE_THREADS", "VLLM_PYTHON", "SGLANG_PYTHON", "VLLM_VENV", "SGLANG_VENV", "TORCH",
})

#: Settings whose values are names: an environment value of "2024" stays the string "2024".
_NAME_SETTINGS = frozenset({
    "namespace", "tenant", "dtype", "name", "kind", "path", "device", "bucket", "prefix",
    "endpoint_url", "region", "access_key_id", "secret_access_key", "session_token", "codec",
})


def _index_key(k: Any) -> int:
    try:
        return int(k)
    except (TypeError, ValueError):
        raise ConfigError(f"tier index must be a number, got {shown(k)}") from None


def _env_value(raw: str, setting: str) -> Any:
    """An environment string as the TOML value it stands for (env has only strings)."""
    if setting in _NAME_SETTINGS:
        return raw if raw.strip() else None
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


def tier_from_dict(d: Any, index: int) -> MemoryTierConfig | TierConfig:
    """The tier config a ``[[tiers]]`` table describes (``index``: where, for messages)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"tiers[{index}] must be a table, got {type(d).__name__}")
    check_depth(d, f"tiers[{index}]")
    d = dict(d)
    kind = d.pop("kind", None)
    if kind is None:
        raise ConfigError(f"tiers[{index}] has no kind; kinds: {tier_kinds()}")
    if not isinstance(kind, str):
        raise ConfigError(f"tiers[{index}].kind must be a string, got {shown(kind)}; "
                          f"kinds: {tier_kinds()}")
    try:
        config_cls = tier_kind(kind)
    except ConfigError as e:
        raise ConfigError(f"tiers[{index}].kind: {e}") from None
    if "capacity" in d and "capacity_bytes" not in d:
        d["capacity_bytes"] = d.pop("capacity")
    where = f"tiers[{index}] ({kind})"
    params = _init_params(config_cls)
    if params is not None:
        accepted, required = params
        unknown = set(d) - accepted
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {sorted(unknown, key=str)}; "
                              f"known: {sorted(accepted)}")
        missing = [p for p in required if p not in d]
        if missing:
            raise ConfigError(f"{where}: missing required setting(s) {missing}")
    try:
        tier = config_cls(**d)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a plug-in whose signature could not be read
        raise ConfigError(f"{where}: {e}") from e
    if not isinstance(tier, (HostTier, DeviceTier, TierConfig)):
        raise ConfigError(f"{where}: {config_cls!r} built a {type(tier).__name__}, which has "
                          "no name and build()")
    return tier


def _init_params(config_cls: Any) -> tuple[set[str], list[str]] | None:
    """The keyword settings a tier config takes, and those it requires (in order)."""
    if dataclasses.is_dataclass(config_cls):
        fields = [f for f in dataclasses.fields(config_cls) if f.init]
        no_default = dataclasses.MISSING
        return ({f.name for f in fields},
                [f.name for f in fields
                 if f.default is no_default and f.default_factory is no_default])
    try:
        sig = inspect.signature(config_cls)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    usable = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ({p.name for p in usable}, [p.name for p in usable if p.default is p.empty])
