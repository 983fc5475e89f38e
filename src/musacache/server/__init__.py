"""``musacache serve``: the node server.

One process owns the tiers of a node and serves any number of caches over them, one per
(namespace, KVSpec, chunk size, tenant) that a client names at :func:`musacache.connect`.
Workers in other processes connect over a Unix socket, register their paged KV caches once
through memory IPC, and from then on a ``store`` or ``retrieve`` sends only metadata: the
server waits on the worker's ready event without blocking its loop, then gathers from (or
scatters into) the worker's pages directly. Dense ``put``/``get`` pass a shared tensor
handle, never the bytes.

A connection touches only its own cache: keys of another namespace, spec or tenant are
unreachable through it. A ``monitor`` connection (``musacache stats``) sees counters only.
Every peer is bounded (requests in flight, fds held, staging bytes), every frame is bounded
(size, msgpack objects and depth) and every op's arguments are decoded into a typed message
first, so no client can exhaust or crash the server. See ``docs/security.md``.

The wire protocol is in ``docs/protocol.md``; the ops are the ``_op_*`` methods below. One
connection's life, from its hello to its release, is the state machine of
:class:`musacache.server.peer.Peer`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import hashlib
import logging
import os
import resource
import signal
import socket
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import numpy as np
import torch

from musacache import ipc, transfer
from musacache._config import CacheConfig, check_depth, read_toml, tier_from_dict
from musacache._errors import (
    CacheUnavailableError,
    ConfigError,
    FingerprintMismatchError,
    InvalidInputError,
    MusaCacheError,
    PermissionDeniedError,
    ProtocolError,
    ServerLimitError,
)
from musacache._executor import Executor
from musacache._keys import Fingerprint, tenant_tag
from musacache._spec import KVSpec
from musacache._validate import integer, positive_float, shown
from musacache._version import __version__
from musacache.cache import Cache
from musacache.engine.pages import PAGE_RUN
from musacache.ipc import _messages as msgs
from musacache.ipc import _wire as proto
from musacache.server.peer import DEFER_ABOVE, Handler, Peer, Registration, Usage
from musacache.server.spawn import SpawnedServer, spawn
from musacache.stats import ServerCounters, as_dict

__all__ = ["OPS", "Server", "ServerConfig", "SpawnedServer", "main", "spawn"]

log = logging.getLogger("musacache.server")

#: Every op a client may send (the decoder refuses others before they reach a handler).
OPS = ("hello", "register", "unregister", "put", "get", "lookup", "prefetch", "store",
       "retrieve", "delete", "clear", "flush", "stats", "stage_bytes", "put_staged",
       "put_pages", "get_pages", "exists_pages")

# accept() failures that mean "out of resources for now": back off and retry, never exit.
_ACCEPT_BACKOFF_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                           errno.ENOMEM})
_ACCEPT_BACKOFF_S: Final = 0.1
# CacheConfig fields that belong to one cache, named by the client, not by the server config.
_PER_CACHE_FIELDS: Final = frozenset({"spec", "namespace", "tenant", "chunk_size", "tiers"})
# Only used to validate the server's tiers and cache options before any client names a spec.
_PROBE_SPEC: Final = KVSpec(1, 1, 8, torch.float16)
_SUN_PATH_MAX: Final = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL
# The other CacheConfig fields: what cache_options may set.
_CACHE_OPTIONS: Final = frozenset(f.name for f in dataclasses.fields(CacheConfig)) \
    - _PER_CACHE_FIELDS
# Limits travel as 64-bit ints (stats, the wire protocol).
_MAX_LIMIT: Final = 2**63 - 1

#: (namespace, spec, chunk size, tenant, uid): one cache of the server.
CacheKey = tuple[str, KVSpec, int, str | None, int]


@dataclass(frozen=True)
class ServerConfig:
    """The node server: where it listens, who may connect, its tiers and its limits.

    ``tiers`` are the node's tiers, hot to cold; their capacities are the node's totals.
    Each cache the server opens (one per namespace, spec, chunk size, tenant and uid) gets an
    equal share, ``1/max_caches`` of every bounded tier, so the totals are never exceeded
    (``max_caches=0``: 1 when ``cache`` is given, else 4). ``cache_options`` are the other
    :class:`~musacache.CacheConfig` settings every cache gets (``copy_threads``...).

    ``cache``, when given, is opened at start; its tiers, chunk size and settings are the
    defaults of the fields above. ``allow_uids`` adds uids besides the server's own that may
    connect (checked with SO_PEERCRED on every connection). ``max_frame_size`` bounds one
    protocol frame; only the baseline byte path (``stage_bytes``) sends large frames.
    """

    socket_path: str
    cache: CacheConfig | None = None
    tiers: tuple[Any, ...] = ()
    chunk_size: int = 0
    cache_options: Mapping[str, Any] = field(default_factory=dict)
    max_caches: int = 0
    allow_uids: tuple[int, ...] = ()
    max_frame_size: int = 64 * 1024**2 + 4096
    max_connections: int = 512
    #: Requests one connection may have in flight; more get ServerLimitError.
    max_requests_per_peer: int = 64
    #: fds one connection's in-flight requests may hold (ready/done events, handles).
    max_fds_per_peer: int = 256
    #: Bytes one connection's in-flight requests may hold in the server: their frames, and
    #: what they expand to (:data:`~musacache.server.peer.BYTES_PER_CHUNK` per chunk or page
    #: named). A request past it gets ServerLimitError. At least ``max_frame_size``.
    max_request_bytes_per_peer: int = 256 * 1024**2
    #: The smallest ``chunk_size`` a client may ask for in hello: the server's memory per
    #: token a request names grows as the chunks shrink.
    min_chunk_size: int = 16
    #: Client buffers one connection may keep mapped between requests (put/get ``buf``).
    max_buffers_per_peer: int = 128
    #: Largest staging buffer of the byte path (``stage_bytes``), per connection.
    max_stage_bytes: int = 1024**3
    #: Staging buffers and incomplete frames of all connections together (bytes; 0: twice
    #: ``max_stage_bytes + max_frame_size``). Past it a ``stage_bytes`` is refused and a
    #: connection whose incomplete frame would pass it is closed, with ServerLimitError.
    max_buffered_bytes: int = 0
    #: Memory mappings one connection may keep in the server (its registrations' storages
    #: and kept buffers), and all connections together: each is a kernel mapping, and the
    #: process has ``vm.max_map_count`` (65530) of them for everything it maps.
    max_mappings_per_peer: int = 2048
    max_mappings: int = 32768
    #: Longest wait for a worker's ready event (seconds).
    ready_timeout: float = 60.0
    #: A connection that has not said hello this long after connecting is closed (seconds):
    #: silent sockets would otherwise hold every connection slot.
    hello_timeout: float = 10.0
    #: A connection with no request in flight that sends nothing this long is closed
    #: (seconds); the client reconnects at its next call.
    idle_timeout: float = 600.0
    #: Longest time a frame may stay incomplete (seconds): its bytes and fds are held
    #: meanwhile.
    frame_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ConfigError("socket_path must be a non-empty string")
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {type(self.cache).__name__}")
        cache = self.cache
        if cache is not None:
            if not self.tiers:
                object.__setattr__(self, "tiers", cache.tiers)
            if not self.chunk_size:
                object.__setattr__(self, "chunk_size", cache.chunk_size)
            if not self.cache_options:
                object.__setattr__(self, "cache_options", {
                    f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
                    if f.name not in _PER_CACHE_FIELDS})
        if not self.chunk_size:
            object.__setattr__(self, "chunk_size", 256)
        if not self.max_caches:
            object.__setattr__(self, "max_caches", 1 if cache is not None else 4)
        for name in ("max_caches", "max_connections", "max_requests_per_peer",
                     "max_fds_per_peer", "max_buffers_per_peer", "max_stage_bytes",
                     "max_frame_size", "max_mappings_per_peer", "max_mappings",
                     "max_request_bytes_per_peer", "min_chunk_size"):
            _limit(self, name)
        if not self.max_buffered_bytes:
            object.__setattr__(self, "max_buffered_bytes",
                               min(2 * (self.max_stage_bytes + self.max_frame_size), _MAX_LIMIT))
        _limit(self, "max_buffered_bytes")
        object.__setattr__(self, "tiers", tuple(
            tier_from_dict(t, i) if isinstance(t, Mapping) else t
            for i, t in enumerate(_sequence(self.tiers, "tiers"))))
        if not isinstance(self.cache_options, Mapping):
            raise ConfigError(f"cache_options must be a table of CacheConfig settings, got "
                              f"{type(self.cache_options).__name__}")
        check_depth(self.cache_options, "cache_options")
        object.__setattr__(self, "cache_options", dict(self.cache_options))
        object.__setattr__(self, "allow_uids", _sequence(self.allow_uids, "[server] allow_uids"))
        if not self.tiers:
            raise ConfigError("a server needs its tiers: [[tiers]] in the config file")
        if self.max_request_bytes_per_peer < self.max_frame_size:
            raise ConfigError(f"[server] max_request_bytes_per_peer "
                              f"({self.max_request_bytes_per_peer}) must hold one frame of "
                              f"max_frame_size ({self.max_frame_size})")
        if self.max_buffered_bytes < self.max_frame_size:
            raise ConfigError(f"[server] max_buffered_bytes ({self.max_buffered_bytes}) must "
                              f"hold one frame of max_frame_size ({self.max_frame_size})")
        for name in ("ready_timeout", "hello_timeout", "idle_timeout", "frame_timeout"):
            object.__setattr__(self, name, positive_float(getattr(self, name),
                                                          f"[server] {name} (seconds)"))
        for i, uid in enumerate(self.allow_uids):
            integer(uid, f"[server] allow_uids[{i}] (a uid)", minimum=0, maximum=2**32 - 1)
        bad = set(self.cache_options) & _PER_CACHE_FIELDS
        if bad:
            raise ConfigError(f"cache_options may not set {sorted(bad)}: each client names "
                              f"its own namespace, spec, chunk size and tenant")
        unknown = set(self.cache_options) - _CACHE_OPTIONS
        if unknown:
            raise ConfigError(f"cache_options: unknown setting(s) {sorted(unknown, key=str)}; "
                              f"known: {sorted(_CACHE_OPTIONS)}")
        # Fail at start, not at the first client: build one cache config over the tiers.
        self.cache_config(_PROBE_SPEC, "probe", self.chunk_size, None)

    def shared_tiers(self) -> tuple[Any, ...]:
        """The tier configs of one cache: each bounded tier's capacity over ``max_caches``."""
        return tuple(_share_of(t, self.max_caches) for t in self.tiers)

    def cache_config(self, spec: KVSpec, namespace: str, chunk_size: int,
                     tenant: str | None) -> CacheConfig:
        """The config of one cache of this server."""
        return CacheConfig(spec=spec, namespace=namespace, tiers=self.shared_tiers(),
                           chunk_size=chunk_size, tenant=tenant, **self.cache_options)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], socket_path: str | None = None,
                  ) -> ServerConfig:
        """A server config file: ``[[tiers]]`` (required), an optional ``[server]`` table
        (``socket``, ``allow_uids``, ``max_caches``, ``max_frame_size``, ``max_connections``,
        ``max_requests_per_peer``, ``max_fds_per_peer``, ``max_buffers_per_peer``,
        ``max_stage_bytes``, ``max_buffered_bytes``, ``max_mappings_per_peer``,
        ``max_mappings``, ``ready_timeout``, ``hello_timeout``, ``idle_timeout``,
        ``frame_timeout``) and optional cache
        settings (``chunk_size``, ``copy_threads``...; docs/configuration.md).
        ``namespace`` with ``[spec]`` names a cache opened at start."""
        data = read_toml(path, f"server config {path}")
        server = data.pop("server", {})
        if not isinstance(server, dict):
            raise ConfigError("[server] must be a table")
        server = dict(server)
        in_file = server.pop("socket", None)
        if in_file is not None and not isinstance(in_file, str):
            raise ConfigError(f"[server] socket must be a path, got {shown(in_file)}")
        sock = socket_path or in_file
        if not sock:
            raise ConfigError("no socket path: pass --socket or set [server] socket")
        known = {"allow_uids", "max_caches", "max_frame_size", "max_connections",
                 "max_requests_per_peer", "max_fds_per_peer", "max_buffers_per_peer",
                 "max_stage_bytes", "max_buffered_bytes", "max_mappings_per_peer",
                 "max_mappings", "max_request_bytes_per_peer", "min_chunk_size",
                 "ready_timeout", "hello_timeout", "idle_timeout", "frame_timeout"}
        unknown = set(server) - known
        if unknown:
            raise ConfigError(f"[server]: unknown setting(s) {sorted(unknown, key=str)}; "
                              f"known: {sorted(known)}")
        if "max_caches" in server and (isinstance(server["max_caches"], bool)
                                       or not isinstance(server["max_caches"], int)
                                       or server["max_caches"] <= 0):
            raise ConfigError(f"[server] max_caches must be a positive int, got "
                              f"{shown(server['max_caches'])}")
        if "allow_uids" in server:
            uids = server["allow_uids"]
            if not isinstance(uids, list):
                raise ConfigError("[server] allow_uids must be a list of uids")
            server["allow_uids"] = tuple(uids)
        if not data.get("tiers"):
            raise ConfigError(f"{path}: a server config needs [[tiers]] (the node's tiers)")
        if ("namespace" in data) != ("spec" in data):
            raise ConfigError(f"{path}: namespace and [spec] name a cache together; give both "
                              f"or neither")
        if "namespace" in data:
            cache = CacheConfig.from_dict(data)
            return cls(socket_path=sock, cache=cache, **server)
        probe = CacheConfig.from_dict({**data, "namespace": "probe",
                                       "spec": _PROBE_SPEC.to_dict()})
        options = {f.name: getattr(probe, f.name) for f in dataclasses.fields(probe)
                   if f.name not in _PER_CACHE_FIELDS and f.name in data}
        return cls(socket_path=sock, tiers=probe.tiers, chunk_size=probe.chunk_size,
                   cache_options=options, **server)


def _limit(config: ServerConfig, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_LIMIT:
        raise ConfigError(f"[server] {name} must be a positive int below 2**63, got "
                          f"{shown(value)}")


def _sequence(value: Any, what: str) -> tuple[Any, ...]:
    """``value`` (a list or another iterable but a string or table) as a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{what} must be a list, got {shown(value)}")
    return tuple(value)


def _share_of(tier: Any, n: int) -> Any:
    if n == 1:
        return tier
    if not dataclasses.is_dataclass(tier) or isinstance(tier, type):
        # A StorageTier instance holds its own state: it can back one cache only.
        raise ConfigError(f"tier {shown(getattr(tier, 'name', tier))} is a StorageTier instance, "
                          f"which can back one cache only; with max_caches={n} pass its "
                          f"config (DiskTier, S3Tier) instead")
    capacity = getattr(tier, "capacity_bytes", None)
    if capacity is None:
        return tier
    try:
        share = int(capacity) // n
    except (TypeError, ValueError) as e:  # a plug-in tier's capacity that is no number
        raise ConfigError(f"tier {shown(getattr(tier, 'name', '?'))}: capacity_bytes must be "
                          f"a byte count, got {shown(capacity)}") from e
    try:
        return dataclasses.replace(tier, capacity_bytes=share)
    except ConfigError as e:
        raise ConfigError(f"tier {getattr(tier, 'name', '?')!r}: each of max_caches={n} caches "
                          f"gets capacity_bytes // {n} = {int(capacity) // n} of its "
                          f"{int(capacity)} bytes: {e}") from None


def _cache_of(peer: Peer) -> Cache:
    if peer.cache is None:  # unreachable past the monitor check; kept as a typed refusal
        raise PermissionDeniedError("this connection has no cache")
    return peer.cache


class _DataOps:
    """The data operations of a server, one method per op: each takes a peer that ``hello``
    bound to a cache, the op's typed message and the request's fds. A :class:`Peer` runs
    its connection's requests on these; :class:`Server` owns the peers, caches and the
    lifecycle."""

    def __init__(self, config: ServerConfig, counters: ServerCounters, usage: Usage,
                 peers: set[Peer], executor: Executor) -> None:
        self.config = config
        self.executor = executor  # the server's copies of staged bytes run here
        self.counters = counters  # the server's own: bytes are counted where they move
        self.usage = usage
        self.peers = peers  # the server's own set

    def _mappings_elsewhere(self, peer: Peer) -> int:
        return sum(p.table.open_mappings + p.opening for p in self.peers if p is not peer)

    def _room_for_a_mapping(self, peer: Peer, op: str) -> None:
        """Refuse a mapping the connection would keep past its limit or the server's (one client's
        65k registrations filled vm.max_map_count, and every mmap of
        the server failed for everyone). Mappings still being opened count (registers of six
        connections at once all passed a limit of 8)."""
        elsewhere = self._mappings_elsewhere(peer)
        mine = peer.table.open_mappings + peer.opening
        if mine >= self.config.max_mappings_per_peer:
            raise ServerLimitError(f"{op}: this connection keeps {mine} memory mappings in the "
                                   f"server (max_mappings_per_peer="
                                   f"{self.config.max_mappings_per_peer}); unregister some")
        if elsewhere + mine >= self.config.max_mappings:
            raise ServerLimitError(f"{op}: the server keeps {elsewhere + mine} memory mappings "
                                   f"(max_mappings={self.config.max_mappings})")

    def _reg(self, peer: Peer, number: int) -> Registration:
        reg = peer.regs.get(number)
        if reg is None:
            raise InvalidInputError(f"no registration {number}: call register_kv_caches")
        return reg

    def _open_event(self, peer: Peer, wire: msgs.EventWire | None,
                    fds: list[int]) -> ipc.IpcEvent | None:
        if wire is None:
            return None
        return peer.table.open_event(wire.wire, msgs.take_fds(fds, wire.nfds))

    async def _op_store(self, peer: Peer, msg: msgs.PagedMessage, fds: list[int]) -> Any:
        return await self._paged(peer, msg, fds, store=True)

    async def _op_retrieve(self, peer: Peer, msg: msgs.PagedMessage, fds: list[int]) -> Any:
        return await self._paged(peer, msg, fds, store=False)

    async def _paged(self, peer: Peer, msg: msgs.PagedMessage, fds: list[int], *,
                     store: bool) -> int:
        """A store or retrieve on a registration's pages; a retrieve sets its ``done`` event
        once the pages are written."""
        cache = _cache_of(peer)
        reg = self._reg(peer, msg.reg)
        ready = self._open_event(peer, msg.ready, fds)
        done = None
        try:
            if not store:
                done = self._open_event(peer, msg.done, fds)
            move = cache.store if store else cache.retrieve
            n = await move(_tokens(msg.tokens), reg.pages, _slots(msg.slots),
                           skip_prefix=msg.skip_prefix, ready=ready,
                           ready_timeout=self.config.ready_timeout)
            self.counters.bytes_copied += cache.spec.nbytes(max(0, n - msg.skip_prefix))
            if done is not None:
                done.set()
            return n
        finally:
            for ev in (ready, done):
                if ev is not None:
                    peer.table.close_event(ev)

    async def _op_register(self, peer: Peer, msg: msgs.RegisterMessage,
                           fds: list[int]) -> Any:
        cache = _cache_of(peer)
        imports: list[ipc.ImportedTensor] = []
        try:
            for h in msg.handles:
                self._room_for_a_mapping(peer, "register")
                peer.opening += 1
                try:
                    imports.append(await peer.table.aopen_tensor(
                        h, msgs.take_fds(fds, h.num_fds)))
                finally:
                    peer.opening -= 1
            # The handles come in the order of Pages.tensors: described here once, then
            # every store and retrieve on this registration reuses it.
            pages = transfer.Pages.from_tensors([imp.tensor for imp in imports], msg.layout)
            if pages.spec != cache.spec:
                raise InvalidInputError(f"registered caches hold {pages.spec.describe()}, "
                                        f"this connection caches {cache.spec.describe()}")
        except BaseException:
            for imp in imports:
                imp.close()
            raise
        reg = peer.next_reg
        peer.next_reg += 1
        peer.regs[reg] = Registration(pages, imports)
        return {"reg": reg, "num_slots": pages.num_slots}

    async def _op_unregister(self, peer: Peer, msg: msgs.UnregisterMessage,
                             fds: list[int]) -> Any:
        reg = peer.regs.pop(msg.reg, None)
        if reg is None:
            raise InvalidInputError(f"no registration {msg.reg} on this connection")
        for imp in reg.imports:
            imp.close()
        return True

    async def _dense(self, peer: Peer, msg: msgs.DenseMessage, fds: list[int],
                     ) -> tuple[torch.Tensor, ipc.ImportedTensor | None]:
        """The tensor a put or get reads or writes, and the mapping to close after the op
        (None: the connection keeps it). A kept buffer costs no mapping, no handle check
        and no worker thread: mapping the client's memory on every call was most of a
        small get."""
        for number in msg.release:
            kept = peer.buffers.pop(number, None)
            if kept is not None:
                kept.close()
        if msg.handle is None:
            kept = None if msg.buf is None else peer.buffers.get(msg.buf)
            if kept is None:
                raise InvalidInputError(f"no buffer {msg.buf} on this connection: send its "
                                        f"handle with it first")
            return kept.tensor, None
        if msg.buf is None:
            imp = await peer.table.aopen_tensor(msg.handle, msgs.take_fds(fds, msg.nfds))
            return imp.tensor, imp
        if msg.buf in peer.buffers:
            raise ProtocolError(f"buffer {msg.buf} is already mapped on this connection")
        if len(peer.buffers) >= self.config.max_buffers_per_peer:
            raise ServerLimitError(f"this connection keeps {len(peer.buffers)} buffers "
                                   f"mapped (max_buffers_per_peer="
                                   f"{self.config.max_buffers_per_peer}); release some")
        self._room_for_a_mapping(peer, "buf")
        mine = msgs.take_fds(fds, msg.nfds)
        if msg.handle.device_kind == "cpu":
            # A shared memory file is mapped with a few cheap syscalls: no worker thread.
            imp = peer.table.open_tensor(msg.handle, mine)
        else:
            peer.opening += 1
            try:
                imp = await peer.table.aopen_tensor(msg.handle, mine)
            finally:
                peer.opening -= 1
            if msg.buf in peer.buffers:  # another request kept this id meanwhile
                imp.close()
                raise ProtocolError(f"buffer {msg.buf} is already mapped on this connection")
        peer.buffers[msg.buf] = imp
        return imp.tensor, None

    async def _op_put(self, peer: Peer, msg: msgs.DenseMessage, fds: list[int]) -> Any:
        cache = _cache_of(peer)
        kv, imp = await self._dense(peer, msg, fds)
        try:
            n = await cache.put(_tokens(msg.tokens), kv)
            # Counted from the answer, not from per-request stats() calls: the bytes of KV
            # the put covered (chunks already cached are not copied again).
            self.counters.bytes_copied += cache.spec.nbytes(n)
            return n
        finally:
            if imp is not None:
                imp.close()

    async def _op_get(self, peer: Peer, msg: msgs.DenseMessage, fds: list[int]) -> Any:
        cache = _cache_of(peer)
        out, imp = await self._dense(peer, msg, fds)
        try:
            hit = await cache.get(_tokens(msg.tokens), out=out)
            self.counters.bytes_copied += cache.spec.nbytes(hit.num_tokens)
            return {"num_tokens": hit.num_tokens, "tiers": hit.tiers}
        finally:
            if imp is not None:
                imp.close()

    async def _op_lookup(self, peer: Peer, msg: msgs.TokensMessage, fds: list[int]) -> Any:
        return await _cache_of(peer).lookup(_tokens(msg.tokens))

    async def _op_prefetch(self, peer: Peer, msg: msgs.PrefetchMessage,
                           fds: list[int]) -> Any:
        return await _cache_of(peer).prefetch(_tokens(msg.tokens), timeout=msg.timeout)

    async def _op_delete(self, peer: Peer, msg: msgs.TokensMessage, fds: list[int]) -> Any:
        return await _cache_of(peer).delete(_tokens(msg.tokens))

    async def _op_clear(self, peer: Peer, msg: msgs.EmptyMessage, fds: list[int]) -> Any:
        await _cache_of(peer).clear()
        return True

    async def _op_flush(self, peer: Peer, msg: msgs.EmptyMessage, fds: list[int]) -> Any:
        await _cache_of(peer).flush()
        return True

    # The baseline byte path, kept for `musacache bench ipc`: the worker gathers its KV into a
    # buffer and sends the bytes through the socket; the server copies them into a staging
    # tensor and then puts that. Three copies of the payload, against one for `store`.
    async def _op_stage_bytes(self, peer: Peer, msg: msgs.StageBytesMessage,
                              fds: list[int]) -> Any:
        _cache_of(peer)
        if peer.staged is None or peer.staged.numel() != msg.total:
            peer.unstage()  # let go of the old buffer before the new one is allocated
            usage, most = self.usage, self.config.max_buffered_bytes
            if usage.staged + usage.partial + msg.total > most:
                # Each connection's max_stage_bytes alone let a few idle ones take GiBs,
                # and 512 of them would have the server OOM-killed.
                raise ServerLimitError(
                    f"stage_bytes: the server holds {usage.staged + usage.partial} bytes of "
                    f"staging and incomplete frames; {msg.total} more would pass "
                    f"max_buffered_bytes={most}")
            peer.staged = torch.empty(msg.total, dtype=torch.uint8, device="cpu")
            usage.staged += msg.total
        staged, offset, data = peer.staged, msg.offset, msg.data
        if data:
            src = np.frombuffer(data, dtype=np.uint8)
            await self.executor.run(np.copyto, staged[offset:offset + len(data)].numpy(), src)
        self.counters.bytes_received += len(data)
        self.counters.bytes_copied += len(data)
        return len(data)

    async def _open_pages(self, peer: Peer, msg: msgs.PagesMessage, cache: Cache,
                          fds: list[int]) -> tuple[ipc.ImportedTensor, list[torch.Tensor]]:
        assert msg.handle is not None
        imp = await peer.table.aopen_tensor(msg.handle, msgs.take_fds(fds, msg.nfds))
        t = imp.tensor
        if t.dim() != 2 or t.shape[0] != len(msg.keys):
            imp.close()
            raise InvalidInputError(f"pages: a [{len(msg.keys)}, page elements] tensor is "
                                    f"needed, got shape {tuple(t.shape)}")
        views: list[torch.Tensor] = []
        try:
            for start in range(0, t.shape[0], PAGE_RUN):  # (a view per page: ms per thousand)
                if start:
                    await anyio.lowlevel.checkpoint()
                views.extend(t[start:start + PAGE_RUN].unbind(0))
        except BaseException:
            imp.close()
            raise
        return imp, views

    async def _op_put_pages(self, peer: Peer, msg: msgs.PagesMessage, fds: list[int]) -> Any:
        cache = _cache_of(peer)
        imp, pages = await self._open_pages(peer, msg, cache, fds)
        try:
            n = await cache.put_pages(msg.keys, pages, after=msg.after)
            self.counters.bytes_copied += cache.spec.nbytes(n * cache.config.chunk_size)
            return n
        finally:
            imp.close()

    async def _op_get_pages(self, peer: Peer, msg: msgs.PagesMessage, fds: list[int]) -> Any:
        cache = _cache_of(peer)
        imp, outs = await self._open_pages(peer, msg, cache, fds)
        try:
            found = await cache.get_pages(msg.keys, outs)
            self.counters.bytes_copied += cache.spec.nbytes(
                sum(found) * cache.config.chunk_size)
            return found
        finally:
            imp.close()

    async def _op_exists_pages(self, peer: Peer, msg: msgs.PagesMessage,
                               fds: list[int]) -> Any:
        return await _cache_of(peer).exists_pages(msg.keys)

    async def _op_put_staged(self, peer: Peer, msg: msgs.PutStagedMessage,
                             fds: list[int]) -> Any:
        cache = _cache_of(peer)
        toks = _tokens(msg.tokens)
        spec = cache.spec
        if peer.staged is None or peer.staged.numel() != spec.nbytes(len(toks)):
            raise InvalidInputError("put_staged: the staged bytes do not hold these tokens")
        kv = peer.staged.view(spec.dtype).view(spec.shape(len(toks)))
        n = await cache.put(toks, kv)
        self.counters.bytes_copied += spec.nbytes(n)
        peer.unstage()
        return n


# Fds the server keeps for itself beyond one per connection: the listener, epoll, the
# loop's self-pipe, worker threads' files, the disk tiers' reads and writes, log files.
_FD_RESERVE: Final = 256
# The fewest fds the requests in flight may hold, whatever the limit says.
_MIN_FD_BUDGET: Final = 64
# The kernel's default nr_open: the most fds a process may have, whatever its limit says.
_NR_OPEN: Final = 1 << 20


def _fd_budget(cfg: ServerConfig) -> int:
    """How many fds the requests in flight may hold, all connections together: the
    process's soft ``RLIMIT_NOFILE`` less one per connection allowed and a reserve. Per-peer
    limits alone let a few connections of one uid hold every fd, and the server could then
    accept nobody (8 connections of never-set ready events reached 1024
    of 1024)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = _NR_OPEN
    return max(_MIN_FD_BUDGET, soft - cfg.max_connections - _FD_RESERVE)


#: The GIL switch interval of ``musacache serve`` (Python's default is 5 ms).
SWITCH_INTERVAL_S: Final = 0.001


def _raise_open_file_limit() -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (``musacache serve``
    only: a process that embeds a Server keeps its own), as servers do: the common soft
    default of 1024 leaves the requests in flight of 512 connections few fds
    (:func:`_fd_budget`), where the hard limit (often 524288) covers all that the per-peer
    limits allow. The event loop waits with epoll, which has no FD_SETSIZE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _NR_OPEN if hard == resource.RLIM_INFINITY else min(hard, _NR_OPEN)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # (above the kernel's nr_open: the limit stays as it was)


def peer_salt(uid: int, tenant: str | None, own_uid: int) -> str | None:
    """The key salt of a peer's cache: a digest of the length-prefixed (uid, tenant), so that
    no tenant string can spell another identity, and another uid's chunks are apart even
    where the tenant names match (isolation between users rests on SO_PEERCRED, not on a
    secret). The server's own uid without a tenant keeps the unsalted default cache."""
    if tenant is None and uid == own_uid:
        return None
    h = hashlib.blake2b(digest_size=16, person=b"musacache-peer")
    for part in (str(uid).encode(), b"" if tenant is None else b"t" + tenant.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return f"peer.{h.hexdigest()}"


class _Caches:
    """The caches of a server, one per :data:`CacheKey`, opened by the first hello that names
    one. A cache that no connection uses stays open, its chunks served to the next one that
    names it, until a hello for another cache finds ``max_caches`` open: the cache unused the
    longest is then closed to make room (memory-only chunks written to a storage tier first,
    as at shutdown; without one they are gone), so that hellos with made-up tenants cannot
    hold every slot. The cache of the config's ``cache`` is never closed so. The close runs
    in a task of its own, outside :attr:`lock`, and counts against ``max_caches`` until it
    ends: only the hello that needs its room (or its key) waits for it."""

    def __init__(self, config: ServerConfig, counters: ServerCounters) -> None:
        self.config = config
        self.counters = counters
        self.caches: dict[CacheKey, Cache] = {}
        self.users: dict[CacheKey, int] = {}
        self.unused: dict[CacheKey, None] = {}  # caches no connection uses, oldest first
        # Caches evicted and still closing: they count against max_caches until closed.
        self.closing: dict[CacheKey, asyncio.Task[None]] = {}
        self.pinned: CacheKey | None = None
        #: whether each cache opened times its calls (set while metrics are exported)
        self.timed = False
        self.lock = anyio.Lock()
        #: per cache closed by :meth:`close_all`: chunks held, chunks written while closing
        self.report: list[dict[str, Any]] = []

    async def acquire(self, key: CacheKey, *, pin: bool = False) -> Cache:
        """The cache of ``key``, opened if need be, counted as used until :meth:`release`
        (``pin``: the server's own, never closed before the server). A cache closed to make
        room is closed outside :attr:`lock`: hellos for other caches go on meanwhile, and a
        hello for the one closing waits for its close, then opens it afresh."""
        while True:
            cache = self.caches.get(key)
            if cache is not None:
                # Open already: no wait behind a hello that opens or evicts another cache.
                self._use(key, pin)
                return cache
            wait_for = self.closing.get(key)
            if wait_for is None:
                async with self.lock:
                    wait_for = await self._open_or_make_room(key, pin)
                if wait_for is None:
                    return self.caches[key]
            # Out of the lock, and not cancelled with this hello (its peer may go away).
            await asyncio.wait({wait_for})

    async def _open_or_make_room(self, key: CacheKey, pin: bool) -> asyncio.Task[None] | None:
        """Under :attr:`lock`: open ``key``'s cache (None), or the close to wait for before
        trying again (``key``'s own, or one that makes room)."""
        if key in self.caches:
            self._use(key, pin)
            return None
        if key in self.closing:
            return self.closing[key]
        if len(self.caches) + len(self.closing) >= self.config.max_caches:
            closing = self._evict() or next(iter(self.closing.values()), None)
            if closing is None:
                raise self._full(key)
            return closing
        namespace, spec, chunk, tenant, uid = key
        salt = peer_salt(uid, tenant, os.getuid())
        cache = Cache(self.config.cache_config(spec, namespace, chunk, salt))
        if self.timed:
            cache._timed()
        await cache.open()
        self.caches[key] = cache
        log.info("opened a cache for %s (tenant %s)",
                 Fingerprint(namespace, spec, chunk).describe(), tenant_tag(tenant))
        self._use(key, pin)
        return None

    def _use(self, key: CacheKey, pin: bool) -> None:
        if pin:
            self.pinned = key
        else:
            self.users[key] = self.users.get(key, 0) + 1
            self.unused.pop(key, None)

    def release(self, key: CacheKey) -> None:
        """A connection that used ``key``'s cache ended."""
        left = self.users.get(key, 0) - 1
        if left > 0:
            self.users[key] = left
            return
        self.users.pop(key, None)
        if key in self.caches and key != self.pinned:
            self.unused[key] = None

    def _full(self, key: CacheKey) -> MusaCacheError:
        def name(k: CacheKey) -> str:
            # The tenant too: two keys may differ by it alone.
            return f"{Fingerprint(k[0], k[1], k[2]).describe()} (tenant {tenant_tag(k[3])})"

        wanted = name(key)
        held = "; ".join(name(k) for k in self.caches)
        if self.config.max_caches == 1:
            return FingerprintMismatchError(
                f"client wants {wanted}, this server caches {held} (max_caches=1)")
        return ServerLimitError(f"cannot open a cache for {wanted}: the server holds "
                                f"max_caches={self.config.max_caches} caches, all in use")

    def _evict(self) -> asyncio.Task[None] | None:
        """Start closing the cache unused the longest, in a task of its own (its close
        must never hold :attr:`lock`, nor be cut short with a hello); None if every cache
        is in use."""
        key = next(iter(self.unused), None)
        if key is None:
            return None
        del self.unused[key]
        cache = self.caches.pop(key)
        closing = self.closing[key] = asyncio.ensure_future(self._close_evicted(key, cache))
        return closing

    async def _close_evicted(self, key: CacheKey, cache: Cache) -> None:
        try:
            entry = await self._close(key, cache)
        finally:
            del self.closing[key]
        self.counters.cache_evictions += 1
        log.info("closed the unused cache of %s (tenant %s) to open another: %d chunk(s), "
                 "%d written to storage", key[0], entry["tenant"], entry["chunks"],
                 entry["persisted"])

    async def close_all(self) -> None:
        caches, self.caches = self.caches, {}
        self.users.clear()
        self.unused.clear()
        for key, cache in caches.items():
            self.report.append(await self._close(key, cache))
        while self.closing:  # evictions still closing: their tiers are released too
            await asyncio.wait(set(self.closing.values()))

    async def _close(self, key: CacheKey, cache: Cache) -> dict[str, Any]:
        before = await _storage_writes(cache)
        chunks = int((await cache.stats())["chunks"])
        try:
            await cache.aclose()
        except Exception:  # one cache failing to close must not strand the others
            log.exception("closing the cache of %s failed", key[0])
        return {"namespace": key[0], "tenant": tenant_tag(key[3]), "chunks": chunks,
                "persisted": await _storage_writes(cache) - before,
                "storage": [n for n, t in (await cache.stats())["tiers"].items()
                            if "pending_writes" in t]}


class Server:
    """Run with ``async with Server(config) as server: await server.serve_forever()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._listener: socket.socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._peers: set[Peer] = set()
        self._stopped = anyio.Event()
        self._last_backoff_log = 0.0
        self.counters = ServerCounters()
        self._caches = _Caches(config, self.counters)
        #: what all connections hold together, and the fds their requests may hold
        self.usage = Usage(fd_budget=_fd_budget(config))
        self._executor = Executor("musacache-server")
        self._data = _DataOps(config, self.counters, self.usage, self._peers, self._executor)
        self._handlers: dict[str, Handler] = {
            op: getattr(self, f"_op_{op}", None) or getattr(self._data, f"_op_{op}")
            for op in OPS}

    @property
    def caches(self) -> dict[CacheKey, Cache]:
        """The open caches, by key."""
        return self._caches.caches

    @property
    def peers(self) -> set[Peer]:
        """The connections open now (monitors included)."""
        return self._peers

    @property
    def held_fds(self) -> int:
        """fds the requests in flight hold, all connections together (each counted twice:
        a wait on a ready event duplicates it)."""
        return self.usage.held_fds

    @property
    def parked_fds(self) -> int:
        """fds the connections' decoders hold for frames not whole yet."""
        return self.usage.parked_fds

    @property
    def fd_budget(self) -> int:
        """How many fds the requests in flight may hold (see :func:`_fd_budget`)."""
        return self.usage.fd_budget

    @fd_budget.setter
    def fd_budget(self, n: int) -> None:
        self.usage.fd_budget = n

    def time_requests(self) -> None:
        """Count the latencies of every cache's calls from now on (for an exporter:
        :mod:`musacache.metrics`)."""
        self._caches.timed = True
        for cache in self.caches.values():
            cache._timed()

    @property
    def close_report(self) -> list[dict[str, Any]]:
        """What :meth:`aclose` did (for ``musacache serve`` to report): per cache, chunks
        held and chunks written to storage while closing."""
        return self._caches.report
    @property
    def cache(self) -> Cache:
        """The server's only cache (a server configured with ``cache=``); see :attr:`caches`."""
        if len(self.caches) != 1:
            raise InvalidInputError(f"this server holds {len(self.caches)} caches; use .caches")
        return next(iter(self.caches.values()))

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        self._listener = _listen(self.config.socket_path)
        try:
            if self.config.cache is not None:
                c = self.config.cache
                await self._caches.acquire((c.namespace, c.spec, c.chunk_size, c.tenant,
                                            os.getuid()), pin=True)
        except BaseException:
            await self.aclose()
            raise
        log.info("musacache %s serving on %s", __version__, self.config.socket_path)

    async def serve_forever(self) -> None:
        """Accept connections until :meth:`stop` (or cancellation)."""
        if self._listener is None:
            raise CacheUnavailableError("the server is not started")
        listener = self._listener
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._accept_loop, listener)
            await self._stopped.wait()
            tg.cancel_scope.cancel()

    def stop(self) -> None:
        self._stopped.set()

    async def aclose(self) -> None:
        self.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        for peer in list(self._peers):
            self._release_peer(peer)
        await self._caches.close_all()
        self._executor.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:
                if e.errno in _ACCEPT_BACKOFF_ERRNOS:
                    # Out of fds or memory: the pending connection stays in the backlog. Wait
                    # for peers to let go instead of dying (clients retry their connects).
                    self.counters.accept_backoffs += 1
                    now = time.monotonic()
                    if now - self._last_backoff_log > 10:
                        self._last_backoff_log = now
                        log.warning("accept failed (%s); backing off: %d connections open, "
                                    "%d fds", e, len(self._peers), _count_fds())
                    await anyio.sleep(_ACCEPT_BACKOFF_S)
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                    continue
                raise
            if len(self._peers) >= self.config.max_connections:
                self.counters.refused += 1
                log.warning("refusing a connection: %d connections open", len(self._peers))
                try:  # told why (typed), not a bare reset: a new socket has room for it
                    sock.send(proto.encode_error(None, ServerLimitError(
                        f"the server has max_connections={self.config.max_connections} "
                        f"connections open")))
                except OSError:
                    pass
                sock.close()
                continue
            if self._tg is not None:
                self._tg.start_soon(self._serve_peer_guarded, sock)

    async def _serve_peer_guarded(self, sock: socket.socket) -> None:
        # One peer's failure must never take the accept loop (and everyone else) down.
        try:
            await self._serve_peer(sock)
        except Exception:
            log.exception("connection handler failed")

    # -- one connection ---------------------------------------------------------------------

    async def _serve_peer(self, sock: socket.socket) -> None:
        try:
            creds = proto.peer_credentials(sock)
        except Exception as e:  # not a Unix socket peer we can identify
            log.warning("refusing a peer without credentials: %r", e)
            sock.close()
            return
        conn = proto.Connection(sock, max_frame_size=self.config.max_frame_size,
                                expect="request", ops=OPS, defer_above=DEFER_ABOVE)
        allowed = {os.getuid(), *self.config.allow_uids}
        if creds.uid not in allowed:
            self.counters.refused += 1
            log.warning("refused pid %d uid %d: not the server's uid nor in allow_uids",
                        creds.pid, creds.uid)
            with anyio.move_on_after(1):
                await conn.send_error(None, PermissionDeniedError(
                    f"uid {creds.uid} may not use this musacache server"))
            await conn.aclose()
            return
        peer = Peer(conn, creds, self.config, counters=self.counters, usage=self.usage,
                    handlers=self._handlers, on_close=self._release_peer,
                    executor=self._executor)
        self._peers.add(peer)
        self.counters.connections += 1
        await peer.serve()

    def _release_peer(self, peer: Peer) -> None:
        if peer not in self._peers:
            return
        peer.release()
        self._peers.discard(peer)
        if peer.key is not None:
            self._caches.release(peer.key)

    # -- ops --------------------------------------------------------------------------------

    async def _op_hello(self, peer: Peer, msg: msgs.HelloMessage, fds: list[int]) -> Any:
        # Before the first await, so that of two hellos sent back to back the second is
        # refused, not bound to another cache.
        peer.begin_hello()
        try:
            return await self._hello(peer, msg)
        except Exception:
            peer.hello_failed()
            raise

    async def _hello(self, peer: Peer, msg: msgs.HelloMessage) -> Any:
        if msg.protocol != proto.PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol {msg.protocol}, server "
                                f"{proto.PROTOCOL_VERSION}")
        info: dict[str, Any] = {"server": __version__, "protocol": proto.PROTOCOL_VERSION,
                                "event_ipc": {k: ipc.event_ipc_capability(k)
                                              for k in ("cpu", "cuda", "musa")}}
        if msg.monitor:
            peer.hello_done(None, None)
            return info
        if msg.spec is None or msg.namespace is None:  # HelloMessage guarantees both
            raise ProtocolError("hello: namespace and spec are required")
        try:
            spec = KVSpec.from_dict(dict(msg.spec))
        except (MusaCacheError, TypeError, ValueError) as e:
            raise ProtocolError(f"hello: malformed spec: {e}") from None
        if msg.chunk_size and msg.chunk_size < self.config.min_chunk_size:
            raise ServerLimitError(f"hello: chunk_size={msg.chunk_size} is below this "
                                   f"server's min_chunk_size={self.config.min_chunk_size}")
        chunk = msg.chunk_size or self.config.chunk_size
        key: CacheKey = (msg.namespace, spec, chunk, msg.tenant, peer.uid)
        cache = await self._caches.acquire(key)
        peer.hello_done(cache, key)
        return {**info, "namespace": msg.namespace, "spec": spec.to_dict(),
                "chunk_size": chunk, "device": str(cache.device),
                "max_buffers": self.config.max_buffers_per_peer}

    async def _op_stats(self, peer: Peer, msg: msgs.EmptyMessage, fds: list[int]) -> Any:
        if peer.cache is None:
            return await self.stats()
        return {**(await peer.cache.stats()), "server": self._server_stats()}

    # -- stats ------------------------------------------------------------------------------

    def _server_stats(self) -> dict[str, Any]:
        workers = [p for p in self._peers if not p.monitor]
        return {
            **as_dict(self.counters),
            "version": __version__,
            "socket": self.config.socket_path,
            # Monitors (musacache stats itself) are counted apart from the workers they watch.
            "peers": len(workers),
            "monitors": len(self._peers) - len(workers),
            "caches": len(self.caches),
            "max_caches": self.config.max_caches,
            "registrations": sum(len(p.regs) for p in self._peers),
            "buffers": sum(len(p.buffers) for p in self._peers),
            "open_mappings": sum(p.table.open_mappings for p in self._peers),
            "open_events": sum(p.table.open_events for p in self._peers),
            "requests_in_flight": sum(p.in_flight for p in self._peers),
            "open_fds": _count_fds(),
            "event_ipc": {k: ipc.event_ipc_capability(k) for k in ("cpu", "cuda", "musa")},
        }

    async def stats(self) -> dict[str, Any]:
        """The server's counters and, per cache, its ``Cache.stats()`` (tenant names are
        shown as digests: a tenant string is a capability, see docs/security.md)."""
        return {
            "server": self._server_stats(),
            "caches": [{"namespace": k[0], "spec": k[1].describe(), "chunk_size": k[2],
                        "tenant": tenant_tag(k[3]), "uid": k[4], **(await c.stats())}
                       for k, c in self.caches.items()],
        }


async def _storage_writes(cache: Cache) -> int:
    return sum(int(t.get("writes", 0)) for t in (await cache.stats())["tiers"].values()
               if "pending_writes" in t)


def _tokens(raw: bytes) -> np.ndarray:
    # A read-only view, not a copy: 16 M tokens are 64 MiB to copy on the loop, and the cache
    # copies what it keeps of them.
    return np.frombuffer(raw, dtype="<i4")


def _slots(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype="<i8").copy())


def _count_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def socket_dir_problem(path: str) -> str | None:
    """Why the socket's folder is unsafe to listen in, or None (it may not exist yet).

    Safe: a folder owned by us (or created by us, mode 0700) that no one else can write, on
    a path whose every existing component is a real folder, not a symlink. Never changes
    the mode of an existing folder: ``/tmp`` or the current folder belong to everyone.
    """
    parent = Path(os.path.abspath(path)).parent
    for part in [*reversed(parent.parents), parent]:
        try:
            st = os.lstat(part)
        except FileNotFoundError:
            return None  # this and what is below it do not exist yet: they will be created
        except OSError as e:
            return f"cannot inspect {part}: {e.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{part} is a symlink; give the socket's real path"
        if not stat.S_ISDIR(st.st_mode):
            return f"{part} is not a folder"
    st = os.lstat(parent)
    if st.st_uid != os.getuid():
        return (f"the socket folder {parent} belongs to uid {st.st_uid}, not to this server "
                f"(uid {os.getuid()}); use a folder of its own, e.g. /run/musacache/")
    if stat.S_IMODE(st.st_mode) & 0o022:
        return (f"the socket folder {parent} is writable by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): another user could replace the socket; use "
                f"a folder of its own, e.g. /run/musacache/ (mode 0700)")
    return None


_BACKLOG = 1024


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path`` (mode 0600). Missing folders are created 0700; an
    existing folder is used only if it is safe (see :func:`socket_dir_problem`), never
    chmodded."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ConfigError(f"socket path is {len(os.fsencode(path))} bytes; Unix sockets allow "
                          f"{_SUN_PATH_MAX}: use a shorter path such as /run/musacache/x.sock")
    problem = socket_dir_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    sock_path = Path(os.path.abspath(path))
    try:
        sock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the socket folder {sock_path.parent}: "
                          f"{e.strerror}") from e
    problem = socket_dir_problem(path)  # re-checked: a folder may have appeared meanwhile
    if problem is not None:
        raise ConfigError(problem)
    if sock_path.exists() or sock_path.is_symlink():
        if not stat.S_ISSOCK(sock_path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(sock_path))
        except OSError:
            sock_path.unlink()  # a stale socket of a dead server
        else:
            raise ConfigError(f"another server is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
    try:
        sock.bind(str(sock_path))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {e.strerror}") from e
    finally:
        os.umask(old)
    os.chmod(sock_path, 0o600)
    # A full backlog fails every further connect with EAGAIN (the client retries): room for
    # a burst of workers that start together (the kernel caps it at somaxconn).
    sock.listen(_BACKLOG)
    sock.setblocking(False)
    return sock


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}; use debug, info, warning, error or critical")
    return level


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musacache serve",
        description="Run the musacache node server: it owns the tiers of this node, and "
                    "workers reach it with musacache.connect(SOCKET, spec=..., namespace=...).")
    p.add_argument("--socket", help="Unix socket path, e.g. /run/musacache/cache.sock (a "
                                    "missing folder is created mode 0700)")
    p.add_argument("--config", required=True,
                   help="TOML file: [[tiers]], an optional [server] table and cache settings "
                        "(docs/deployment.md)")
    p.add_argument("--log-level", default="INFO", type=_log_level,
                   help="debug, info (default), warning, error or critical")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 picks "
                        "a free one; needs musacache[metrics]; docs/metrics.md)")
    args = p.parse_args(list(argv) if argv is not None else None)
    address: tuple[str, int] | None = None
    if args.metrics is not None:
        # Checked before anything starts: a bad address or a missing package is one line.
        from musacache import metrics

        address = metrics.parse_address(args.metrics)
        metrics._prometheus()
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # A MusaCacheError goes up to the musacache command, which says it in one line.
    config = ServerConfig.from_toml(args.config, socket_path=args.socket)

    def say(text: str) -> None:
        print(f"musacache serve: {text}", flush=True)

    _raise_open_file_limit()
    # (musacache serve owns its process.) A thread that unpacks a large frame holds the GIL
    # for a switch interval at a time, which every other client's request then waits out.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    async def run() -> None:
        server = Server(config)
        httpd = None
        try:
            await server.start()
            if address is not None:
                from musacache import metrics

                httpd, _thread = metrics.serve(server, *address)
                host = address[0] if ":" not in address[0] else f"[{address[0]}]"
                say(f"metrics on http://{host}:{httpd.server_port}/metrics")
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, server.stop)
            say(f"listening on {config.socket_path} ({len(config.tiers)} tier(s), up to "
                f"{config.max_caches} cache(s))")
            await server.serve_forever()
            say(f"stopping: closing {len(server._peers)} connection(s) and "
                f"{len(server.caches)} cache(s), writing memory-only chunks to storage")
        finally:
            if httpd is not None:
                # (its thread waits up to half a second for the next poll: off the loop)
                await asyncio.to_thread(httpd.shutdown)
                httpd.server_close()
            await server.aclose()
        for r in server.close_report:
            where = ", ".join(r["storage"]) or "no storage tier"
            tenant = f" tenant {r['tenant']}" if r["tenant"] else ""
            say(f"{r['namespace']}{tenant}: {r['chunks']} chunk(s) held, {r['persisted']} "
                f"written to {where} while closing")
        say("stopped")

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    return 0
