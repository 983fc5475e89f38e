"""Prometheus metrics of a cache and of the node server (docs/metrics.md lists them).

``register(cache, registry)`` exports an embedded cache into a registry the caller owns;
``musacache serve --metrics HOST:PORT`` serves a server's own registry on ``/metrics``
(:func:`serve`). Nothing here touches prometheus-client's process-wide ``REGISTRY`` unless
the caller passes it, and prometheus-client itself (the ``musacache[metrics]`` extra) is
imported only when a collector is made.

A collector's ``collect()`` runs in the scraping thread (prometheus-client's HTTP server),
not the event loop's: it reads only plain ints and lengths, which the GIL makes whole, and
copies the loop's dicts and sets before it iterates them (:func:`_copy`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from musacache._errors import ConfigError
from musacache._keys import tenant_tag
from musacache.cache import Cache
from musacache.engine.tierstate import MemTier
from musacache.stats import LATENCY_BUCKETS, OpLatencies, ServerCounters

from .names import CACHE_METRICS, OPS, SERVER_METRICS, TIMEOUT_KINDS, MetricDef

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["CACHE_METRICS", "SERVER_METRICS", "CacheCollector", "MetricDef", "ServerCollector",
           "parse_address", "register", "serve"]

EXTRA_HINT = "pip install 'musacache[metrics]'"


def _prometheus() -> Any:
    """prometheus_client's ``core``, or a ConfigError naming the extra that brings it."""
    try:
        from prometheus_client import core
    except ModuleNotFoundError:
        raise ConfigError("metrics need the prometheus-client package, which is not "
                          f"installed: {EXTRA_HINT}") from None
    return core


def _copy(container: Any) -> Any:
    """A copy of a dict or set the event loop changes: ``.copy()`` is one C call, which no
    other thread interrupts; the retry covers an interpreter where one could."""
    for _ in range(8):
        try:
            return container.copy()
        except RuntimeError:  # changed size during the copy
            continue
    return type(container)()


class _Families:
    """Samples by metric and labels, summed where two sources share labels (a server's
    caches that differ only by spec, chunk size or uid), then made into families."""

    def __init__(self, defs: Iterable[MetricDef]) -> None:
        self.defs = {d.name: d for d in defs}
        self.values: dict[str, dict[tuple[str, ...], Any]] = {d: {} for d in self.defs}

    def add(self, name: str, labels: tuple[str, ...], value: float) -> None:
        got = self.values[name]
        got[labels] = got.get(labels, 0) + value

    def add_latency(self, name: str, labels: tuple[str, ...], counts: list[int],
                    seconds: float) -> None:
        got = self.values[name]
        old = got.get(labels)
        if old is None:
            got[labels] = (counts, seconds)
        else:
            got[labels] = ([a + b for a, b in zip(old[0], counts)], old[1] + seconds)

    def families(self) -> Iterator[Any]:
        core = _prometheus()
        bounds = [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for name, d in self.defs.items():
            if d.kind == "counter":
                fam = core.CounterMetricFamily(name, d.help, labels=d.labels)
            elif d.kind == "gauge":
                fam = core.GaugeMetricFamily(name, d.help, labels=d.labels)
            else:
                fam = core.HistogramMetricFamily(name, d.help, labels=d.labels)
            for labels, value in self.values[name].items():
                if d.kind == "histogram":
                    counts, seconds = value
                    total, cumulative = 0, []
                    for bound, n in zip(bounds, counts):
                        total += n
                        cumulative.append((bound, total))
                    fam.add_metric(list(labels), cumulative, seconds)
                else:
                    fam.add_metric(list(labels), value)
            yield fam


def _add_cache(fam: _Families, cache: Cache, namespace: str, tenant: str) -> None:
    """One cache's samples (labels ``namespace``, ``tenant`` and, per tier, ``tier``)."""
    eng = cache._eng
    if eng is None:
        return
    base = (namespace, tenant)
    fam.add("musacache_hit_tokens", base, eng.tok.hit_tokens)
    fam.add("musacache_miss_tokens", base, eng.tok.miss_tokens)
    for t in eng.tiers:  # (a list fixed when the cache opened)
        lab = (*base, t.name)
        c = t.c
        fam.add("musacache_tier_hit_chunks", lab, c.hits)
        fam.add("musacache_tier_miss_chunks", lab, c.misses)
        fam.add("musacache_tier_written_bytes", lab, c.bytes_in)
        fam.add("musacache_tier_read_bytes", lab, c.bytes_out)
        fam.add("musacache_evictions", lab, c.evictions)
        fam.add("musacache_promotions", lab, c.promotions)
        fam.add("musacache_demotions", lab, c.demotions)
        fam.add("musacache_lost_chunks", lab, c.drops)
        fam.add("musacache_tier_chunks", lab, len(t.lru))
        if isinstance(t, MemTier):
            fam.add("musacache_tier_used_bytes", lab, t.pool.bytes_used)
            fam.add("musacache_tier_capacity_bytes", lab, t.capacity_bytes)
            continue
        sc = t.c
        fam.add("musacache_tier_used_bytes", lab, t.used)
        if t.capacity is not None:
            fam.add("musacache_tier_capacity_bytes", lab, t.capacity)
        fam.add("musacache_write_queue_depth", lab, len(t.pending))
        fam.add("musacache_write_queue_bytes", lab, t.pending_bytes)
        fam.add("musacache_write_sheds", lab, sc.write_sheds)
        fam.add("musacache_write_drops", lab, sc.write_drops)
        fam.add("musacache_tier_faults", lab, sc.faults)
        fam.add("musacache_tier_timeouts", lab, sc.timeouts)
    lat: OpLatencies | None = cache._latency
    if lat is not None:
        for op in OPS:
            h = getattr(lat, op)
            if not h.sum and not any(h.counts):
                continue  # an op never called: its 22 empty samples would double a scrape
            fam.add_latency("musacache_request_duration_seconds", (*base, op),
                            list(h.counts), h.sum)


class CacheCollector:
    """A prometheus-client collector of the caches ``source()`` names, as (cache,
    namespace, tenant digest or ``""``) triples; each is timed from when it is named."""

    def __init__(self, source: Callable[[], Iterable[tuple[Cache, str, str]]]) -> None:
        _prometheus()
        self._source = source

    def describe(self) -> Iterator[Any]:
        # The names without the values: registering checks them against the registry's.
        return _Families(CACHE_METRICS).families()

    def collect(self) -> Iterator[Any]:
        fam = _Families(CACHE_METRICS)
        for cache, namespace, tenant in self._source():
            _add_cache(fam, cache, namespace, tenant)
        return fam.families()


def register(cache: Cache, registry: CollectorRegistry) -> CacheCollector:
    """Export ``cache`` into ``registry`` (a ``prometheus_client.CollectorRegistry`` the
    caller owns) and time its calls from now on; ``registry.unregister(collector)`` stops
    the export. Raises :class:`~musacache.ConfigError` without prometheus-client."""
    cache._timed()
    namespace, tenant = cache.config.namespace, tenant_tag(cache.config.tenant) or ""
    collector = CacheCollector(lambda: [(cache, namespace, tenant)])
    registry.register(collector)
    return collector


class _ServerLike(Protocol):
    @property
    def caches(self) -> dict[Any, Cache]: ...
    @property
    def peers(self) -> set[Any]: ...
    counters: ServerCounters
    config: Any

    def time_requests(self) -> None: ...


class ServerCollector:
    """A collector of a node server: its counters and connections, and every cache it
    holds (summed by namespace, tenant digest and tier)."""

    def __init__(self, server: _ServerLike) -> None:
        _prometheus()
        self._server = server
        server.time_requests()
        self._caches = CacheCollector(self._server_caches)

    def _server_caches(self) -> list[tuple[Cache, str, str]]:
        return [(c, key[0], tenant_tag(key[3]) or "")
                for key, c in _copy(self._server.caches).items()]

    def describe(self) -> Iterator[Any]:
        yield from _Families(SERVER_METRICS).families()
        yield from self._caches.describe()

    def collect(self) -> Iterator[Any]:
        s = self._server
        c = s.counters
        peers = _copy(s.peers)
        fam = _Families(SERVER_METRICS)
        values = {"musacache_server_open_connections": len(peers),
                  "musacache_server_peers": sum(1 for p in peers if not p.monitor),
                  "musacache_server_caches": len(s.caches),
                  "musacache_server_max_caches": s.config.max_caches,
                  "musacache_server_requests_in_flight": sum(p.in_flight for p in peers),
                  "musacache_server_connections": c.connections,
                  "musacache_server_refused_connections": c.refused,
                  "musacache_server_requests": c.requests,
                  "musacache_server_request_errors": c.errors,
                  "musacache_server_bad_frames": c.bad_frames,
                  "musacache_server_limited": c.limited,
                  "musacache_server_accept_backoffs": c.accept_backoffs,
                  "musacache_server_copied_bytes": c.bytes_copied,
                  "musacache_server_received_bytes": c.bytes_received,
                  "musacache_server_cache_evictions": c.cache_evictions}
        for name, value in values.items():
            fam.add(name, (), value)
        for kind in TIMEOUT_KINDS:
            fam.add("musacache_server_connection_timeouts", (kind,),
                    getattr(c, f"{kind}_timeouts"))
        yield from fam.families()
        yield from self._caches.collect()


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6; port 0 picks a free one), or a ConfigError
    that says what is wrong with it."""
    host, sep, port = str(text).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port:
        raise ConfigError(f"--metrics takes HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--metrics port must be a number in [0, 65535], got {port!r}")
    return host, int(port)


def serve(server: _ServerLike, host: str, port: int) -> tuple[Any, threading.Thread]:
    """Serve ``server``'s metrics on ``http://HOST:PORT/metrics`` from a thread of its own,
    in a registry of its own (with the process's CPU, memory and fds); returns the HTTP
    server (``server_port`` is the port bound; ``shutdown()`` stops it) and its thread."""
    _prometheus()
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(ServerCollector(server))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(f"--metrics {host}:{port}: cannot listen: {e.strerror or e}") from None
    return httpd, thread
