"""``MusaCacheStorage``: an SGLang HiCache storage backend (the "L3" below host memory).

Select it with (see docs/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "musacache",
        "module_path": "musacache.integrations.sglang", "class_name": "MusaCacheStorage",
        "interface_v1": 1, "musacache.config": "/etc/musacache/tiers.toml"}'

SGLang hashes its pages itself (hex strings, each chained over the pages before it) and never
sends tokens, so this backend uses musacache's key-addressed page API (``put_pages``,
``get_pages``, ``exists_pages``) rather than its token API. Pages flow through the same tiers,
eviction, codec and S3 as token chunks, namespaced by a fingerprint of the model, the page's
KV shape, the page size and the tensor-parallel rank, so two ranks (or two models) never read
each other's pages.

Where the cache lives: with ``"musacache.socket"`` the pages go to a node server (started with
``"musacache.config"`` when none listens); with only ``"musacache.config"`` the cache is
embedded in each SGLang rank process.

SGLang constructs the backend as ``cls(storage_config, kwargs)`` before its host pool exists,
and hands the pool over later with ``register_mem_pool_host``: the cache is opened there, once
the page's shape is known. Every call is synchronous for SGLang and runs on a private event
loop, bounded by ``"musacache.timeout"`` seconds; a fault is a miss (``False``), never an
exception into SGLang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import CacheClosedError, CacheUnavailableError, ConfigError, MusaCacheError
from .._spec import KVSpec
from .._validate import positive_float
from ..stats import SGLangStats, as_dict
from ._loop import MAX_TIMEOUT_S, LoopThread

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as e:  # pragma: no cover - only without SGLang
    raise ImportError("musacache.integrations.sglang needs SGLang (pip install sglang)") from e

__all__ = ["MusaCacheStorage", "page_spec"]

log = logging.getLogger("musacache.sglang")

_PREFIX = "musacache."
_KNOWN = ("socket", "config", "namespace", "timeout")
# The least time register_mem_pool_host gives the store to open: a node server it starts
# takes longer to come up than a call (spawn waits up to a minute).
_OPEN_TIMEOUT = 60.0
# Keys SGLang's dynamic-backend factory itself reads from the same dict.
_FACTORY_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "interface_v2")


def page_spec(pool: Any) -> tuple[KVSpec, int]:
    """(KVSpec, page size) whose ``nbytes(page_size)`` is the byte size of one of ``pool``'s
    flat data pages.

    MHA pools hold ``2 x layers x page x heads x head_dim`` per page and MLA pools
    ``layers x page x 1 x dim``; a pool of another shape is stored as opaque rows of
    ``layers x page`` (its fingerprint still names its size and dtype).
    """
    page_size = int(pool.page_size)
    dummy = pool.get_dummy_flat_data_page()
    numel, dtype = int(dummy.numel()), dummy.dtype
    layers = int(getattr(pool, "layer_num", 1))
    heads = getattr(pool, "head_num", None)
    head_dim = getattr(pool, "head_dim", None)
    mla = "MLA" in type(pool).__name__
    if not mla and heads and head_dim and numel == 2 * layers * page_size * heads * head_dim:
        return KVSpec(layers, int(heads), int(head_dim), dtype), page_size
    if numel % (layers * page_size):
        raise ConfigError(f"SGLang host pool {type(pool).__name__}: a page of {numel} "
                          f"elements is not {layers} layers x {page_size} tokens")
    return KVSpec(layers, 1, numel // (layers * page_size), dtype, mla=True), page_size


class MusaCacheStorage(HiCacheStorage):
    """The backend. SGLang builds one per rank: ``MusaCacheStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None,
                 ) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        ours = {k[len(_PREFIX):]: v for k, v in extra.items() if k.startswith(_PREFIX)}
        unknown = sorted(set(ours) - set(_KNOWN))
        if unknown:
            raise ConfigError(f"hicache storage extra config: unknown key(s) "
                              f"{[_PREFIX + k for k in unknown]}; known: "
                              f"{[_PREFIX + k for k in _KNOWN]}")
        self.socket: str | None = str(ours["socket"]) if ours.get("socket") else None
        self.config: str | None = str(ours["config"]) if ours.get("config") else None
        if self.socket is None and self.config is None:
            raise ConfigError('hicache storage extra config needs "musacache.socket" (a node '
                              'server) or "musacache.config" (a TOML file of tiers)')
        timeout = positive_float(ours.get("timeout", 30.0), "musacache.timeout")
        if timeout > MAX_TIMEOUT_S:  # a thread could not wait for it
            raise ConfigError(f"musacache.timeout must be at most {MAX_TIMEOUT_S:g} s, got "
                              f"{timeout!r}")
        self.timeout = timeout
        model = str(ours.get("namespace") or storage_config.model_name or "sglang")
        # The rank's slice here; the host pool's layout and KV dtype are added when it is
        # registered (register_mem_pool_host).
        self.namespace = _namespace(model, storage_config)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.mem_pool_host: Any = None
        self.spec: KVSpec | None = None
        self.page_size = 0
        # host_indices advance by a logical page per key: page_size times the decode context
        # parallel size (each DCP rank's pool holds page_size of a logical page's tokens).
        self.index_step = 0
        self._closed = False
        self._cache: Any = None
        self._loop: LoopThread | None = None
        self._last_warning = -1e9
        self.counters = SGLangStats()

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: the page shape is known now, so open the cache."""
        super().register_mem_pool_host(mem_pool_host)
        self.spec, self.page_size = page_spec(mem_pool_host)
        self.index_step = int(getattr(mem_pool_host, "logical_page_size", self.page_size))
        if self.index_step <= 0 or self.index_step % self.page_size:
            raise ConfigError(f"SGLang host pool {type(mem_pool_host).__name__}: a logical "
                              f"page of {self.index_step} tokens is not a whole number of "
                              f"{self.page_size}-token pages")
        self.namespace += _pool_identity(mem_pool_host)
        self._loop = LoopThread("musacache-sglang")
        # Opening may start a node server, which takes longer than one call: at least the
        # wait spawn allows it.
        wait = max(self.timeout, _OPEN_TIMEOUT)
        try:
            self._cache = self._run(self._open(), wait)
        except BaseException as e:
            self._loop.close()
            self._loop = None
            if isinstance(e, TimeoutError):
                raise CacheUnavailableError(f"musacache: the page store did not open within "
                                            f"{wait} s") from e
            raise

    async def _open(self) -> Any:
        from ._pagestore import open_page_store

        assert self.spec is not None
        return await open_page_store(spec=self.spec, chunk_size=self.page_size,
                                     namespace=self.namespace, socket=self.socket,
                                     config=self.config, timeout=self.timeout)

    def close(self) -> None:
        if self._loop is not None:
            if self._cache is not None:
                try:
                    self._run(self._cache.aclose(), self.timeout)
                except Exception as e:  # closing must not raise into SGLang's shutdown
                    log.debug("musacache: close: %s", e)
                self._cache = None
            self._loop.close()
            self._loop = None
        self._closed = True

    def _run(self, coro: Any, timeout: float) -> Any:
        assert self._loop is not None
        return self._loop.run(coro, timeout)

    def _ready(self) -> bool:
        if self._closed:
            raise CacheClosedError("MusaCacheStorage: the backend was closed")
        if self._cache is None:
            raise ConfigError("MusaCacheStorage: register_mem_pool_host was not called")
        return True

    def _fault(self, what: str, e: BaseException) -> None:
        self.counters.faults += 1
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("musacache: %s failed, treated as a miss: %s", what, e)

    # -- the zero-copy pair over the registered host pool -----------------------------------

    def _page_views(self, what: str, host_indices: torch.Tensor,
                    count: int) -> list[torch.Tensor]:
        """The pool's view of each of ``count`` pages, the ``i``-th starting at
        ``host_indices[i * index_step]`` (SGLang slices its indices by logical page)."""
        step = self.index_step
        if host_indices.numel() < count * step:
            raise ConfigError(f"{what}: {count} keys need {count * step} host indices, got "
                              f"{host_indices.numel()}")
        pool = self.mem_pool_host
        try:
            return [pool.get_data_page(int(host_indices[i * step]), flat=False)
                    for i in range(count)]
        except (ValueError, IndexError, TypeError, RuntimeError) as e:
            raise ConfigError(f"{what}: the host pool refused a page view: {e}") from e

    def _after(self, extra_info: Any) -> str | None:
        """The key of the page before a batch's first, from SGLang's ``prefix_keys``: the
        batch's pages then hang under it, so that eviction drops a sequence's tail before
        its head (without it, each batch of a long sequence started a new root)."""
        prefix = getattr(extra_info, "prefix_keys", None)
        return str(prefix[-1]) if prefix else None

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Read each key's page straight into its place in the host pool."""
        self._ready()
        n = len(keys)
        self.counters.gets += n
        if n == 0:
            return []
        outs = self._page_views("batch_get_v1", host_indices, n)
        try:
            found = list(self._run(self._cache.get_pages(keys, outs), self.timeout))
        except (MusaCacheError, TimeoutError, OSError) as e:
            self._fault("get", e)
            return [False] * n
        self.counters.hits += sum(found)
        return found

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store each key's page from its place in the host pool. MLA pages are the same on
        every rank: only the storage writer stores them (the others report success)."""
        self._ready()
        n = len(keys)
        if not self.is_writer or n == 0:
            return [True] * n
        return self._put(keys, self._page_views("batch_set_v1", host_indices, n),
                         self._after(extra_info))

    def _put(self, keys: Sequence[str], pages: Sequence[torch.Tensor],
             after: str | None = None) -> list[bool]:
        self.counters.sets += 1
        try:
            stored = int(self._run(self._cache.put_pages(list(keys), list(pages), after=after),
                                   self.timeout))
        except (MusaCacheError, TimeoutError, OSError) as e:
            self._fault("set", e)
            return [False] * len(keys)
        self.counters.set_pages += stored
        return [i < stored for i in range(len(keys))]

    # -- the abstract interface (copying) ---------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None,
            ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each key's flat page, into ``target_locations[i]`` when given (else a new tensor
        shaped like the pool's flat page); ``None`` for a miss."""
        self._ready()
        if not keys:
            return []
        outs = list(target_locations) if target_locations is not None else [
            self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        self.counters.gets += len(keys)
        try:
            found = list(self._run(self._cache.get_pages(list(keys), outs), self.timeout))
        except (MusaCacheError, TimeoutError, OSError) as e:
            self._fault("get", e)
            return [None] * len(keys)
        self.counters.hits += sum(found)
        return [o if f else None for o, f in zip(outs, found)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self._ready()
        if not self.is_writer or not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ConfigError(f"batch_set: {len(keys)} keys need as many values")
        return all(self._put(keys, list(values)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored."""
        self._ready()
        if not keys:
            return 0
        try:
            return int(self._run(self._cache.exists_pages(list(keys)),
                                 min(self.timeout, 10.0)))
        except (MusaCacheError, TimeoutError, OSError) as e:
            self._fault("exists", e)
            return 0

    def clear(self) -> None:
        self._ready()
        try:
            self._run(self._cache.clear(), self.timeout)
        except (MusaCacheError, TimeoutError, OSError) as e:
            self._fault("clear", e)

    def get_stats(self) -> dict[str, int]:
        return as_dict(self.counters)


def _pool_identity(pool: Any) -> str:
    """What of the host pool decides a stored page's bytes beyond its size and storage
    dtype, as a namespace suffix: the layout (a layer-first and a page-first page of the same
    size hold the same values in other orders, so one instance must never read the other's)
    and the KV's logical dtype (SGLang stores every fp8 variant as uint8)."""
    suffix = ""
    layout = getattr(pool, "layout", None)
    if layout:
        suffix += f"/layout={layout}"
    dtype = getattr(getattr(pool, "device_pool", None), "dtype", None)
    if dtype is None:
        dtype = getattr(pool, "dtype", None)
    if dtype is not None:
        suffix += f"/dtype={str(dtype).removeprefix('torch.')}"
    return suffix


def _namespace(model: str, cfg: Any) -> str:
    """One namespace per slice of the KV a rank holds. MHA ranks hold different heads, so
    each TP rank has its own; MLA KV is the same on every TP rank, so they share one."""
    ns = model
    if not getattr(cfg, "is_mla_model", False):
        ns += f"/tp{cfg.tp_rank}of{cfg.tp_size}"
    if getattr(cfg, "pp_size", 1) > 1:
        ns += f"/pp{cfg.pp_rank}of{cfg.pp_size}"
    if getattr(cfg, "attn_cp_size", 1) > 1:
        ns += f"/cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        ns += f"/dcp{cfg.dcp_rank}of{cfg.dcp_size}"
    return ns
