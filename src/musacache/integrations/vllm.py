"""``MusaCacheConnector``: a vLLM v1 KV connector backed by one ``musacache serve`` per node.

Load it with (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "MusaCacheConnector",
      "kv_connector_module_path": "musacache.integrations.vllm",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"musacache.socket": "/run/musacache/node.sock",
                                    "musacache.config": "/etc/musacache/tiers.toml"}}'

Both roles reach the same server. ``musacache.config`` is optional: when given and no server
listens on ``musacache.socket``, the connector starts one (:func:`musacache.server.spawn`,
detached, so the cache outlives this vLLM process and serves the next).

- The **scheduler side** (EngineCore process) looks prompts up without touching KV: the
  arithmetic is :class:`~musacache.integrations._vllm_plan.SchedulerPlanner`.
- The **worker side** moves KV. Pages on a GPU are shared with the server once by IPC and the
  server gathers/scatters them directly. vLLM's CPU pages are private memory, which another
  process cannot map: there the worker gathers into (scatters from) a shared staging area
  with the native transfer module, and the server reads (writes) the staging area instead.

A cache fault never fails a request: a lookup that fails is a miss, a load that comes up
short reports its blocks through ``get_block_ids_with_load_errors`` (vLLM recomputes them;
run with ``"kv_load_failure_policy": "recompute"``), and a save that fails is dropped and
counted. No hook waits on the server without a timeout.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import torch

from musacache.server.client import Client
from musacache.server.spawn import is_listening, spawn

from .. import ipc, transfer
from .._errors import (
    ConfigError,
    InvalidInputError,
    MusaCacheError,
    TierError,
)
from .._spec import KVSpec
from ._loop import MAX_TIMEOUT_S, LoopThread
from ._vllm_plan import RequestOp, SchedulerPlanner

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as e:  # pragma: no cover - only without vLLM
    raise ImportError("musacache.integrations.vllm needs vLLM (pip install vllm)") from e
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    _WORKER_META = True
except ImportError:  # pragma: no cover - a vLLM whose workers send the scheduler nothing
    _WORKER_META = False

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stands in for the base class a vLLM without worker metadata lacks."""

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorSettings", "MusaCacheConnector", "MusaCacheConnectorMetadata",
           "MusaCacheConnectorStats", "MusaCacheStepDone"]

log = logging.getLogger("musacache.vllm")

_PREFIX = "musacache."
_KNOWN = ("socket", "config", "namespace", "chunk_size", "timeout", "lookup_timeout",
          "layerwise", "save_decode", "staging_tokens")

@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings, from ``kv_connector_extra_config`` keys ``"musacache.*"``.

    ``socket`` (required) is the node server's socket; ``config`` a TOML file of tiers for a
    server the connector starts itself when none listens. ``namespace`` defaults to the
    model; each rank caches under it followed by its pipeline and tensor-parallel ranks, the
    KV cache format and its layers (:func:`cache_namespace`).
    ``timeout`` bounds every load and save; ``lookup_timeout`` a scheduler lookup (seconds,
    finite, at most :data:`MAX_TIMEOUT_S`).
    ``layerwise`` scatters loads layer by layer (``wait_for_layer_load``) and hands saves
    off per layer (``save_kv_layer``). ``staging_tokens`` sizes the CPU staging area.
    """

    socket: str
    config: str | None = None
    namespace: str | None = None
    chunk_size: int | None = None
    timeout: float = 30.0
    lookup_timeout: float = 5.0
    layerwise: bool = False
    save_decode: bool = False
    staging_tokens: int = 8192

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        ours = {k[len(_PREFIX):]: v for k, v in extra.items() if k.startswith(_PREFIX)}
        unknown = sorted(set(ours) - set(_KNOWN))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) "
                              f"{[_PREFIX + k for k in unknown]}; known: "
                              f"{[_PREFIX + k for k in _KNOWN]}")
        if not ours.get("socket"):
            raise ConfigError('kv_connector_extra_config needs "musacache.socket": the path '
                              "of the musacache serve socket")
        try:
            return cls(
                socket=str(ours["socket"]),
                config=str(ours["config"]) if ours.get("config") else None,
                namespace=str(ours["namespace"]) if ours.get("namespace") else None,
                chunk_size=_opt_int(ours.get("chunk_size"), "chunk_size"),
                timeout=_seconds(ours.get("timeout", 30.0), "timeout"),
                lookup_timeout=_seconds(ours.get("lookup_timeout", 5.0), "lookup_timeout"),
                layerwise=_flag(ours.get("layerwise", False), "layerwise"),
                save_decode=_flag(ours.get("save_decode", False), "save_decode"),
                staging_tokens=_opt_int(ours.get("staging_tokens", 8192),
                                        "staging_tokens") or 8192,
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config: {e}") from e


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or int(v) != v or int(v) <= 0:
        raise ValueError(f"musacache.{name} must be a positive integer, got {v!r}")
    return int(v)


def _seconds(v: Any, name: str) -> float:
    # NaN passes a plain `<= 0` check (json.loads accepts it), and a wait past
    # threading.TIMEOUT_MAX raises OverflowError in the hook that makes it.
    if isinstance(v, bool) or not 0 < float(v) <= MAX_TIMEOUT_S:
        raise ValueError(f"musacache.{name} must be a finite number of seconds in "
                         f"(0, {MAX_TIMEOUT_S:.4g}], got {v!r}")
    return float(v)


def _flag(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise ValueError(f"musacache.{name} must be true or false, got {v!r}")


class MusaCacheConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side sends the workers each step: one op per request, and with
    several ranks the step's number (0 with one rank), which each worker sends back
    (:class:`MusaCacheStepDone`) with the step's failed loads."""

    def __init__(self, ops: list[RequestOp], step: int = 0) -> None:
        self.ops = ops
        self.step = step


class MusaCacheStepDone(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side after a step: its number. vLLM merges every
    rank's (:meth:`aggregate`) into the step's output, beside every rank's failed blocks,
    so the scheduler side learns when a step's loads are known good on all ranks."""

    def __init__(self, step: int) -> None:
        self.step = step

    def aggregate(self, other: Any) -> MusaCacheStepDone:
        if isinstance(other, MusaCacheStepDone):
            self.step = max(self.step, other.step)
        return self


@dataclass
class MusaCacheConnectorStats(KVConnectorStats):
    """Hits, misses and bytes moved since the last report (summed over workers)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _RateLimitedWarning:
    """One warning per kind per interval: a dead server must not flood vLLM's log."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}

    def __call__(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) >= self.interval:
            self._last[kind] = now
            log.warning(msg, *args)


class _Server:
    """The connector's client of the node server, living on the private loop.

    Connects lazily, starts the server when allowed, and after a failed connect waits
    ``retry_after`` seconds before trying again, so a dead server costs one quick failure
    per hook rather than a connect timeout each.
    """

    def __init__(self, settings: ConnectorSettings, spec: KVSpec, namespace: str,
                 retry_after: float = 2.0) -> None:
        self.settings = settings
        self.spec = spec
        self.namespace = namespace
        self.retry_after = retry_after
        self.client: Client | None = None
        self._lock: anyio.Lock | None = None
        self._failed_at = -1e9
        self.on_connect: list[Any] = []

    async def get(self) -> Client:
        if self.client is not None:
            return self.client
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self.client is not None:
                return self.client
            if time.monotonic() - self._failed_at < self.retry_after:
                raise _Unavailable("musacache server unreachable (retrying shortly)")
            client: Client | None = None
            try:
                if self.settings.config and not is_listening(self.settings.socket):
                    await anyio.to_thread.run_sync(
                        lambda: spawn(self.settings.config or "", self.settings.socket,
                                      detach=True))
                client = Client(self.settings.socket, spec=self.spec,
                                namespace=self.namespace,
                                chunk_size=self.settings.chunk_size,
                                timeout=self.settings.timeout)
                await client.open()
                for hook in self.on_connect:
                    await hook(client)
            except BaseException as e:
                # A half-opened client is closed whatever ended the connect, a hook's time
                # limit too (each cancel between hello and the staging
                # area's registration kept a socket on each side and a server mapping).
                self._failed_at = time.monotonic()
                if client is not None:
                    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                        await client.aclose()
                if isinstance(e, (MusaCacheError, OSError)):
                    raise _Unavailable(str(e)) from e
                raise
            self.client = client
            return client

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


# Requests whose failed load the worker remembers until vLLM rewinds them (a request that
# ends before is forgotten once this many more have failed).
_TAINTED_MAX = 4096


class _Unavailable(Exception):
    pass


def _spec_from_kv_cache_config(kv_cache_config: Any) -> tuple[KVSpec, int, list[str]]:
    """(KVSpec, block_size, layer names) of a model whose layers share one attention spec."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise ConfigError("MusaCacheConnector: vLLM gave no KV cache groups")
    names: list[str] = []
    spec0 = groups[0].kv_cache_spec
    for g in groups:
        s = g.kv_cache_spec
        if (type(s), getattr(s, "num_kv_heads", None), getattr(s, "head_size", None),
                getattr(s, "dtype", None), s.block_size) != (
                type(spec0), getattr(spec0, "num_kv_heads", None),
                getattr(spec0, "head_size", None), getattr(spec0, "dtype", None),
                spec0.block_size):
            raise ConfigError("MusaCacheConnector supports models whose attention layers all "
                              f"share one KV spec; got {type(spec0).__name__} and "
                              f"{type(s).__name__}")
        names.extend(g.layer_names)
    heads = getattr(spec0, "num_kv_heads", None)
    head_size = getattr(spec0, "head_size", None)
    if heads is None or head_size is None:
        raise ConfigError(f"MusaCacheConnector: {type(spec0).__name__} is not an attention "
                          "KV spec")
    mla = type(spec0).__name__.startswith("MLA")
    spec = KVSpec(len(names), 1 if mla else int(heads), int(head_size), spec0.dtype, mla)
    return spec, int(spec0.block_size), names


def _parallel_ranks() -> tuple[int, int]:
    """This worker's (pipeline, tensor) parallel ranks; (0, 0) outside vLLM's groups."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return 0, 0
    ranks = []
    for get in (ps.get_pipeline_model_parallel_rank, ps.get_tensor_model_parallel_rank):
        try:
            ranks.append(int(get()))
        except (AssertionError, RuntimeError, AttributeError):
            ranks.append(0)
    return ranks[0], ranks[1]


def _held_ranks(vllm_config: Any) -> int:
    """The ranks of one engine (tensor x pipeline x context parallel) whose loads the
    scheduler side must hear of before a loaded request saves again (see
    ``_vllm_plan``); 1 where vLLM's workers cannot send it the step's number, which leaves
    a load that fails on one rank alone to the other ranks' saves (docs/vllm.md)."""
    pc = getattr(vllm_config, "parallel_config", None)
    ranks = int(getattr(pc, "world_size", 0) or 0) or (
        int(getattr(pc, "tensor_parallel_size", 1)) * int(getattr(pc, "pipeline_parallel_size", 1)))
    if ranks > 1 and not _WORKER_META:
        log.warning("MusaCacheConnector: this vLLM has no worker metadata: a load that fails "
                    "on one of the %d ranks alone does not hold back the others' saves", ranks)
        return 1
    return max(1, ranks)


def _kv_format(vllm_config: Any, kv_cache_config: Any) -> str:
    """The logical format of the KV bytes: vLLM's ``cache_dtype`` (it holds every fp8
    variant as uint8, so the torch dtype cannot tell fp8_e4m3 from fp8_e5m2), and its
    quantisation mode when there is one."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if cache_dtype is None:
        quantized = mode != "NONE" or spec.dtype in (torch.uint8, torch.int8) \
            or "float8" in str(spec.dtype)
        if quantized:
            raise ConfigError(f"MusaCacheConnector: the KV cache holds {spec.dtype} but vLLM "
                              "gave no cache_config.cache_dtype to tell its format by")
        cache_dtype = "auto"
    return str(cache_dtype) if mode == "NONE" else f"{cache_dtype}-{mode.lower()}"


def cache_namespace(base: str, pp_rank: int, tp_rank: int, kv_format: str,
                    layer_names: Sequence[str]) -> str:
    """``"<base>/pp<p>/tp<t>/kv-<format>/L<digest>"``: one cache per pipeline stage,
    tensor-parallel rank, KV format and set of layers (a digest of their names: stages of
    another split hold other layers under the same rank)."""
    layers = hashlib.blake2b("\n".join(layer_names).encode(), digest_size=4).hexdigest()
    return f"{base}/pp{pp_rank}/tp{tp_rank}/kv-{kv_format}/L{layers}"


def _refusal(kv_cache_config: Any) -> str | None:
    """Why a model's KV can never be reused by prefix, or None."""
    if any(getattr(g.kv_cache_spec, "non_causal", False)
           for g in kv_cache_config.kv_cache_groups):
        # vLLM turns its own prefix caching off for these too.
        return "its attention is non-causal (a token's KV depends on later tokens)"
    return None


class MusaCacheConnector(KVConnectorBase_V1):
    """The vLLM v1 connector. vLLM constructs it once per role; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.spec, self.block_size, self._layer_names = _spec_from_kv_cache_config(
            kv_cache_config)
        model = str(vllm_config.model_config.model)
        base = self.settings.namespace or model
        pp_rank = tp_rank = 0
        if role == KVConnectorRole.WORKER:
            pp_rank, tp_rank = _parallel_ranks()
        # vLLM's CPU backend holds each block's keys transposed ([head_dim, block_size] per
        # head): read as token rows, part of a block is other tokens' bytes. Such a vLLM
        # moves whole blocks only (SchedulerPlanner.whole_blocks), which come back where
        # they were, and caches under a name of its own, so that no engine of another
        # layout or block size reads them as rows.
        self.whole_blocks = _kv_in(vllm_config, self._layer_names[0]) == "block"
        kv_format = _kv_format(vllm_config, kv_cache_config)
        if self.whole_blocks:
            kv_format += f"+cpu-kt{self.block_size}"
        # The scheduler looks up the first rank's namespace (vLLM gives it that rank's KV
        # cache config): every rank stores the same tokens.
        self.namespace = cache_namespace(base, pp_rank, tp_rank, kv_format, self._layer_names)
        #: Why no request is cached, when none can be (see docs/vllm.md).
        self.refused = _refusal(kv_cache_config)
        if self.refused is not None:
            log.warning("MusaCacheConnector: nothing is cached: %s", self.refused)
        self._warn = _RateLimitedWarning()
        self._loop = LoopThread(f"musacache-vllm-{role.name.lower()}")
        self._server = _Server(self.settings, self.spec, self.namespace)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") != "recompute":
            log.warning('MusaCacheConnector: kv_load_failure_policy is not "recompute": a '
                        "cache fault during a load will fail the request instead of being "
                        "recomputed")
        self._planner: SchedulerPlanner | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = SchedulerPlanner(
                block_size=self.block_size, chunk_size=self.settings.chunk_size or 256,
                start_lookup=self._start_lookup, save_decode=self.settings.save_decode,
                ranks=_held_ranks(vllm_config), whole_blocks=self.whole_blocks)
            self._server.on_connect.append(self._learn_chunk_size)
        else:
            self._worker = _Worker(self)

    # ==== scheduler side ====================================================================

    async def _learn_chunk_size(self, client: Client) -> None:
        if self._planner is not None and client.server_info.get("chunk_size"):
            self._planner.chunk_size = int(client.server_info["chunk_size"])

    def _start_lookup(self, tokens: np.ndarray) -> Any:
        return self._loop.submit(self._lookup(tokens))

    async def _lookup(self, tokens: np.ndarray) -> int:
        try:
            with anyio.fail_after(self.settings.lookup_timeout):
                client = await self._server.get()
                return int(await client.lookup(tokens))
        except (MusaCacheError, _Unavailable, OSError, TimeoutError) as e:
            self._warn("lookup", "musacache: lookup failed, treating it as a miss: %s", e)
            raise

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        assert self._planner is not None
        if self.refused is not None:
            return 0, False
        return self._planner.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        if self.refused is not None:
            return MusaCacheConnectorMetadata([])
        ops = self._planner.build(scheduler_output)
        return MusaCacheConnectorMetadata(
            ops, self._planner.step if self._planner.ranks > 1 else 0)

    def update_connector_output(self, connector_output: Any) -> None:
        done = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._planner is not None and isinstance(done, MusaCacheStepDone):
            self._planner.outputs_seen(done.step)

    def request_finished(self, request: Request, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete inside the step (wait_for_save), so the blocks may be freed now.
        if self._planner is not None:
            self._planner.forget(request.request_id)
        return False, None

    # ==== worker side =======================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, MusaCacheConnectorMetadata):
                self._worker.start_load(meta.ops)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._worker is not None and self.settings.layerwise \
                and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, MusaCacheConnectorMetadata):
                self._worker.save_layer(layer_name, meta.ops)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, MusaCacheConnectorMetadata):
                self._worker.save(meta.ops)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        # Called after get_block_ids_with_load_errors, into the same output: the step's
        # failed loads travel with its number.
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, MusaCacheConnectorMetadata) and meta.step:
                return MusaCacheStepDone(meta.step)
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            data = self._worker.take_stats()
        elif self._planner is not None:
            s = self._planner.stats
            data = {"lookups": s.lookups, "lookup_failures": s.lookup_failures,
                    "lookup_tokens": s.lookup_tokens, "hit_tokens": s.hit_tokens,
                    "refused_requests": s.refused, "held_saves": s.held_saves}
            self._planner.stats = type(s)()
        else:
            return None
        stats = MusaCacheConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return MusaCacheConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        try:
            self._loop.run(self._server.aclose(), 5.0)
        except (TimeoutError, MusaCacheError, OSError):
            pass
        self._loop.close()


class _Worker:
    """The worker side: registers the pages and runs each step's loads and saves.

    A store or retrieve left unanswered (it timed out, was cancelled, or its connection
    broke) may still be running on the server, reading or writing the memory it names. On
    CPU pages that memory is the staging area, so it is never used again: the next load or
    save closes the connection (the server cancels what it still runs for it) and registers
    a fresh staging area on a new one (a timed-out load went on writing the
    staging area while the same step's save gathered into it, and the server stored the
    load's KV under the save's tokens). On device pages the server writes vLLM's blocks
    directly; the connection is closed the same way, but the server may still write the
    blocks of that load for as long as its copy takes to stop (see docs/vllm.md).
    """

    def __init__(self, owner: MusaCacheConnector) -> None:
        self.owner = owner
        self.spec = owner.spec
        self.settings = owner.settings
        self._pages: transfer.Pages | None = None   # vLLM's caches, opened once
        self._layer_index: dict[str, int] = {}
        self._direct = False                    # device pages registered by IPC
        self._staging: torch.Tensor | None = None   # (L, 2, S, H, D) or (L, S, D), shared
        self._staging_pages: transfer.Pages | None = None
        #: A call was left unanswered: the next one reconnects (and, on CPU pages, stages
        #: through a fresh area) first.
        self._abandoned = False
        self._load_errors: set[int] = set()
        self._step_failed: set[int] = set()     # blocks whose load failed in this step
        # Per request, the first token of a load that failed: what it computes past that is
        # over blocks never loaded until vLLM rewinds it there, in later steps too (async
        # scheduling plans the next step before it sees a failure).
        self._tainted: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._errors_lock = threading.Lock()
        self._layer_events: list[threading.Event] = []
        self._layer_deadline = 0.0
        self._pending_load: Any = None
        self._layer_saves: list[tuple[torch.Tensor, Any]] = []  # (staging, its gather)
        self._stats: dict[str, int] = {}
        owner._server.on_connect.append(self._register_remote)

    # -- registration ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        kv_in = _kv_in(self.owner._vllm_config, names[0])
        pages = _as_musacache_pages(tensors, self.spec, kv_in)
        if pages.spec != self.spec:
            raise ConfigError(f"vLLM's KV caches hold {pages.spec.describe()}, but its KV "
                              f"cache config says {self.spec.describe()}")
        self._pages = pages
        self._direct = pages.device.type != "cpu"
        if not self._direct:
            self._new_staging()
        self._layer_events = [threading.Event() for _ in names]
        for ev in self._layer_events:
            ev.set()
        log.info("musacache: registered %d layers (%s, K/V in the %s, %s), %s", len(names),
                 pages.layout, kv_in, self.spec.describe(), "by IPC" if self._direct else
                 f"CPU staging of {self.settings.staging_tokens} tokens")
        try:  # connect early; a failure here is retried on the first load or save
            self.owner._loop.run(self.owner._server.get(), self.settings.timeout)
        except (TimeoutError, _Unavailable, MusaCacheError) as e:
            self.owner._warn("connect", "musacache: server not reachable yet: %s", e)

    def _new_staging(self) -> None:
        s = self.settings.staging_tokens
        staging = ipc.empty_shared(self.spec.shape(s), self.spec.dtype)
        # The staging tensor seen as pages with a block size of 1: slot t is token t.
        if self.spec.mla:
            pages = transfer.Pages.open([staging[i].view(s, 1, self.spec.head_dim)
                                         for i in range(self.spec.num_layers)], "sglang-mla")
        else:
            pages = transfer.Pages.open(
                [staging[i].view(2, s, 1, self.spec.num_kv_heads, self.spec.head_dim)
                 for i in range(self.spec.num_layers)], "vllm")
        self._staging, self._staging_pages = staging, pages

    async def _register_remote(self, client: Client) -> None:
        pages = self._pages if self._direct else self._staging_pages
        if pages is not None:
            await client.register_kv_caches(pages)

    async def _client(self) -> Client:
        """The connected client; after a call left unanswered, on a new connection (and a
        new staging area) first."""
        if self._abandoned:
            self._count("abandoned_calls", 1)
            await self.owner._server.aclose()
            if not self._direct:
                self._new_staging()
            self._abandoned = False
        return await self.owner._server.get()

    async def _answered(self, call: Awaitable[int]) -> int:
        """``call`` (a store or retrieve), noting when it is left unanswered."""
        answered = False
        try:
            got = await call
            answered = True
            return got
        except (InvalidInputError, TierError):
            answered = True  # refused before it was sent, or the server's answer
            raise
        finally:
            if not answered:
                self._abandoned = True

    # -- loads --------------------------------------------------------------------------------

    def start_load(self, ops: Sequence[RequestOp]) -> None:
        with self._errors_lock:
            self._step_failed = set()
        loads = [op for op in ops if op.loads]
        if not loads or self._pages is None:
            return
        for ev in self._layer_events:
            ev.clear()
        self._layer_deadline = time.monotonic() + self.settings.timeout
        try:
            fut = self.owner._loop.start(self._load_all(loads), self.settings.timeout)
        except MusaCacheError as e:  # the loop is closed: every block is recomputed
            self._load_failed(e, loads)
            return
        if self.settings.layerwise:
            self._pending_load = (fut, loads)
            return
        self._finish_load(fut, loads)

    def _finish_load(self, fut: Any, loads: Sequence[RequestOp]) -> None:
        try:
            # Returns only once the load has ended (or was cancelled and has ended): its
            # writes into the pages stop before vLLM hears of the blocks to recompute.
            self.owner._loop.result(fut, self._layer_deadline - time.monotonic())
        except Exception as e:  # any fault: the blocks it did not fill are recomputed
            if not fut.done():
                self._abandoned = True  # it may still run: never reuse what it holds
            self._load_failed(e, loads)
        finally:
            for ev in self._layer_events:
                ev.set()
            self._pending_load = None

    def _load_failed(self, e: Exception, loads: Sequence[RequestOp]) -> None:
        self.owner._warn("load", "musacache: load failed, vLLM recomputes: %s", e)
        self._count("load_failures", 1)
        for op in loads:
            self._fail(op, op.load_start, op.load_end)
        for ev in self._layer_events:
            ev.set()

    def wait_layer(self, layer_name: str) -> None:
        pending = self._pending_load
        if pending is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        if not self._layer_events[i].wait(max(0.0, self._layer_deadline - time.monotonic())):
            self._finish_load(*pending)  # timed out: fail what is left, free every layer
        elif i == len(self._layer_events) - 1:
            self._finish_load(*pending)

    async def _load_all(self, loads: Sequence[RequestOp]) -> None:
        try:
            await self._load_each(loads)
        finally:
            # Every exit frees the layers: a load that failed at once must not leave
            # wait_for_layer_load waiting out the timeout.
            for ev in self._layer_events:
                ev.set()

    async def _load_each(self, loads: Sequence[RequestOp]) -> None:
        client = await self._client()
        if self._direct:
            for op in loads:
                got = await self._answered(client.retrieve(
                    op.token_ids[:op.load_end], op.slot_mapping[:op.load_end],
                    skip_prefix=op.load_start))
                self._after_load(op, op.load_start + got)
            return
        # CPU pages: the server scatters into the shared staging area, then we scatter from
        # there into vLLM's pages, at most staging_tokens at a time.
        staging = self._staging
        assert staging is not None
        cap = self.settings.staging_tokens
        for op in loads:
            start = op.load_start
            while start < op.load_end:
                end = min(op.load_end, start + cap)
                slots = np.full(end, -1, dtype=np.int64)
                slots[start:end] = np.arange(end - start)
                got = await self._answered(client.retrieve(op.token_ids[:end], slots,
                                                           skip_prefix=start))
                if self.settings.layerwise:
                    last = op is loads[-1] and end == op.load_end
                    for layer in range(self.spec.num_layers):
                        await anyio.to_thread.run_sync(
                            self._scatter_staging, staging, op, start, start + got, layer)
                        if last:
                            self._layer_events[layer].set()
                else:
                    await anyio.to_thread.run_sync(self._scatter_staging, staging, op, start,
                                                   start + got, None)
                start += got
                if start < end:
                    break
            self._after_load(op, start)

    def _scatter_staging(self, staging: torch.Tensor, op: RequestOp, start: int, end: int,
                         layer: int | None) -> None:
        if end <= start:
            return
        assert self._pages is not None  # registered: CPU pages
        n = end - start
        slots = torch.from_numpy(op.slot_mapping[start:end])
        td = self.spec.token_dim
        if layer is None:
            transfer.scatter(staging.narrow(td, 0, n), self._pages, slots)
        else:
            transfer.scatter(staging[layer:layer + 1].narrow(td, 0, n),
                             self._pages.layers(layer, layer + 1), slots)

    def _after_load(self, op: RequestOp, loaded_to: int) -> None:
        self._count("load_tokens", max(0, loaded_to - op.load_start))
        self._count("load_bytes", self.spec.nbytes(max(0, loaded_to - op.load_start)))
        if loaded_to < op.load_end:
            self._count("load_short_tokens", op.load_end - loaded_to)
            self._fail(op, loaded_to, op.load_end)

    def _fail(self, op: RequestOp, start: int, end: int) -> None:
        blocks = op.blocks_of(start, end)
        with self._errors_lock:
            self._load_errors |= blocks
            self._step_failed |= blocks
            self._tainted[op.req_id] = min(start, self._tainted.get(op.req_id, start))
            self._tainted.move_to_end(op.req_id)
            while len(self._tainted) > _TAINTED_MAX:  # (requests that ended unrewound)
                self._tainted.popitem(last=False)

    def take_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves --------------------------------------------------------------------------------

    def _savable(self, ops: Sequence[RequestOp]) -> tuple[list[RequestOp], bool]:
        """This step's saves, less those of requests over a block whose load failed in this
        step: vLLM drops what the step computed for them and computes it again (KV computed over
        blocks never loaded was stored and served). And whether
        any was left out."""
        with self._errors_lock:
            failed = set(self._step_failed)
            saves: list[RequestOp] = []
            skipped = False
            for op in ops:
                if not op.saves:
                    continue
                tainted = self._tainted.get(op.req_id)
                if tainted is not None and op.save_start <= tainted:
                    # vLLM rewound the request to its failed load and computes it again: what
                    # it saves from there is over blocks loaded or computed anew.
                    del self._tainted[op.req_id]
                    tainted = None
                if tainted is not None or (failed and op.blocks_of(0, op.save_end) & failed):
                    self._count("save_skipped_tokens", op.save_end - op.save_start)
                    skipped = True
                    continue
                saves.append(op)
        return saves, skipped

    def save_layer(self, layer_name: str, ops: Sequence[RequestOp]) -> None:
        """Layerwise mode: this layer's KV is written; hand it to the staging area now."""
        i = self._layer_index.get(layer_name)
        saves = [op for op in ops if op.saves]
        staging = self._staging
        if i is None or not saves or self._direct or self._pages is None or staging is None \
                or self._abandoned:
            return  # (abandoned: wait_for_save gathers into a fresh area)
        total = sum(op.save_end - op.save_start for op in saves)
        if total > self.settings.staging_tokens:
            return  # too big to stage at once: wait_for_save gathers it in pieces
        self._layer_saves.append((staging, self.owner._loop.submit(
            anyio.to_thread.run_sync(self._gather_layers, staging, saves, i))))

    def _gather_layers(self, staging: torch.Tensor, saves: Sequence[RequestOp],
                       layer: int | None) -> None:
        assert self._pages is not None  # registered: CPU pages
        td = self.spec.token_dim
        at = 0
        for op in saves:
            n = op.save_end - op.save_start
            slots = torch.from_numpy(op.slot_mapping[op.save_start:op.save_end])
            if layer is None:
                transfer.gather(self._pages, slots, staging.narrow(td, at, n))
            else:
                transfer.gather(self._pages.layers(layer, layer + 1), slots,
                                staging[layer:layer + 1].narrow(td, at, n))
            at += n

    def save(self, ops: Sequence[RequestOp]) -> None:
        if self._pending_load is not None:
            # Layerwise: vLLM did not wait for every layer this step; settle the load (and
            # its errors) before the step ends.
            self._finish_load(*self._pending_load)
        saves, skipped = self._savable(ops)
        layer_saves, self._layer_saves = self._layer_saves, []
        if (not saves and not layer_saves) or self._pages is None:
            return
        if saves and self._direct and self._pages.device.type in ("cuda", "musa"):
            # The pages are written by this step's kernels: the server may read them only
            # after they finish.
            torch.cuda.synchronize() if self._pages.device.type == "cuda" else \
                torch.musa.synchronize()  # type: ignore[attr-defined]
        try:
            self.owner._loop.run(self._save_all(saves, layer_saves, skipped),
                                 self.settings.timeout)
        except Exception as e:  # a failed save is a future miss, never a failed request
            self.owner._warn("save", "musacache: save failed (dropped): %s", e)
            self._count("save_failures", 1)

    async def _save_all(self, saves: Sequence[RequestOp],
                        layer_saves: list[tuple[torch.Tensor, Any]], skipped: bool) -> None:
        import asyncio

        # The per-layer gathers end before anything else uses a staging area.
        done = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in layer_saves),
                                    return_exceptions=True)
        if not saves:
            return
        client = await self._client()
        if self._direct:
            for op in saves:
                n = await self._answered(client.store(
                    op.token_ids[:op.save_end], op.slot_mapping[:op.save_end],
                    skip_prefix=op.save_start))
                self._after_save(op, n)
            return
        staging = self._staging
        assert staging is not None
        cap = self.settings.staging_tokens
        # Every layer gathered by save_kv_layer, packed from row 0, into this staging area
        # and for exactly these saves.
        staged = (not skipped and len(layer_saves) == self.spec.num_layers
                  and all(st is staging for st, _ in layer_saves)
                  and not any(isinstance(r, BaseException) for r in done))
        if staged:
            at = 0
            for op in saves:
                n = op.save_end - op.save_start
                slots = np.full(op.save_end, -1, dtype=np.int64)
                slots[op.save_start:] = np.arange(at, at + n)
                stored = await self._answered(client.store(
                    op.token_ids[:op.save_end], slots, skip_prefix=op.save_start))
                self._after_save(op, stored)
                at += n
            return
        for op in saves:
            start = op.save_start
            while start < op.save_end:
                end = min(op.save_end, start + cap)
                piece = RequestOp(op.req_id, op.token_ids, op.slot_mapping, op.block_size,
                                  save_start=start, save_end=end)
                await anyio.to_thread.run_sync(self._gather_layers, staging, [piece], None)
                slots = np.full(end, -1, dtype=np.int64)
                slots[start:end] = np.arange(end - start)
                stored = await self._answered(client.store(op.token_ids[:end], slots,
                                                           skip_prefix=start))
                if stored < end:
                    break
                start = end
            self._after_save(op, stored)

    def _after_save(self, op: RequestOp, stored: int) -> None:
        new = max(0, min(stored, op.save_end) - op.save_start)
        self._count("save_tokens", new)
        self._count("save_bytes", self.spec.nbytes(new))

    # -- stats --------------------------------------------------------------------------------

    def _count(self, key: str, n: int) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def take_stats(self) -> dict[str, int]:
        stats, self._stats = self._stats, {}
        return stats


def _as_musacache_pages(tensors: Sequence[torch.Tensor], spec: KVSpec, kv_in: str = "last-dim",
                        ) -> transfer.Pages:
    """vLLM's per-layer KV tensors as :class:`transfer.Pages` (opened once, at register).

    vLLM 0.32's attention layers each hold one logical ``[num_blocks, H, block_size, 2*D]``
    tensor, read two ways:

    - ``kv_in="last-dim"`` (the GPU backends): K is ``[..., :D]``, V is ``[..., D:]``; the
      physical order of the first three dims varies by backend, so only strides are used;
    - ``kv_in="block"`` (the CPU backend, CPU_ATTN): each ``[block_size, 2*D]`` block of a
      head is ``block_size`` rows of K then ``block_size`` rows of V (vLLM views it as
      ``[num_blocks, H, 2*block_size, D]`` and splits dim 2).

    These are musacache's ``vllm-packed`` and ``vllm-packed-cpu`` layouts. Older vLLM (and
    vllm-musa) hand ``[2, num_blocks, block_size, H, D]``, the ``vllm`` layout; MLA
    ``[num_blocks, block_size, D]`` (``vllm-mla``).
    """
    first = tensors[0]
    if spec.mla:
        if first.dim() == 4 and first.shape[1] == 1:
            return transfer.Pages.open([t.squeeze(1) for t in tensors], "vllm-mla")
        return transfer.Pages.open(list(tensors), "vllm-mla")
    if first.dim() == 5 and first.shape[0] == 2:
        return transfer.Pages.open(list(tensors), "vllm")
    if first.dim() == 4 and first.shape[-1] == 2 * spec.head_dim:
        packed = {"last-dim": "vllm-packed", "block": "vllm-packed-cpu"}.get(kv_in)
        if packed is not None:
            return transfer.Pages.open(list(tensors), packed)
        raise ConfigError(f"kv_in must be 'last-dim' or 'block', got {kv_in!r}")
    raise ConfigError(f"MusaCacheConnector: vLLM KV cache tensor of shape {tuple(first.shape)} "
                      f"is not a known layout for {spec.describe()}")


def _kv_in(vllm_config: Any, layer_name: str) -> str:
    """How this vLLM's attention backend reads its packed KV tensor (see
    :func:`_as_musacache_pages`): by the backend of the layer, else by the platform."""
    name = None
    try:
        layer = vllm_config.compilation_config.static_forward_context[layer_name]
        name = layer.attn_backend.get_name()
    except (AttributeError, KeyError, TypeError):
        pass
    if name is None:
        try:
            from vllm.platforms import current_platform

            name = "CPU_ATTN" if current_platform.is_cpu() else ""
        except ImportError:
            name = ""
    return "block" if name == "CPU_ATTN" else "last-dim"
