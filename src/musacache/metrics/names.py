"""Every metric musacache exports, in one table: docs/metrics.md lists the same, and a test
holds the two together."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CACHE_METRICS", "OPS", "SERVER_METRICS", "TIMEOUT_KINDS", "MetricDef"]

#: The timed operations, the ``op`` label of ``musacache_request_duration_seconds``.
OPS = ("lookup", "get", "put", "store", "retrieve")
#: The ``kind`` label of ``musacache_server_connection_timeouts_total``.
TIMEOUT_KINDS = ("hello", "idle", "frame")

_CACHE = ("namespace", "tenant")
_TIER = ("namespace", "tenant", "tier")


@dataclass(frozen=True)
class MetricDef:
    """One metric family: ``name`` as prometheus-client takes it (a counter's without its
    ``_total``, which the exposition adds)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]
    help: str

    @property
    def exposed(self) -> str:
        """The name a scrape shows: a counter's samples end in ``_total``."""
        return self.name + "_total" if self.kind == "counter" else self.name


CACHE_METRICS: tuple[MetricDef, ...] = (
    MetricDef("musacache_hit_tokens", "counter", _CACHE,
              "Tokens that gets (get, retrieve, get_pages) asked for and were served."),
    MetricDef("musacache_miss_tokens", "counter", _CACHE,
              "Tokens that gets asked for and were not served."),
    MetricDef("musacache_tier_hit_chunks", "counter", _TIER, "Chunks served from the tier."),
    MetricDef("musacache_tier_miss_chunks", "counter", _TIER,
              "Chunks looked for in the tier and not served from it."),
    MetricDef("musacache_tier_written_bytes", "counter", _TIER,
              "Bytes placed in the tier (KV bytes in memory, encoded bytes in storage)."),
    MetricDef("musacache_tier_read_bytes", "counter", _TIER,
              "Bytes read or served from the tier."),
    MetricDef("musacache_evictions", "counter", _TIER,
              "Chunks evicted from the tier to make room."),
    MetricDef("musacache_promotions", "counter", _TIER,
              "Chunks copied up into the tier from a lower one."),
    MetricDef("musacache_demotions", "counter", _TIER,
              "Chunks written into the tier from the tier above."),
    MetricDef("musacache_lost_chunks", "counter", _TIER,
              "Chunks evicted from the tier that no tier below took."),
    MetricDef("musacache_tier_used_bytes", "gauge", _TIER, "Bytes the tier holds now."),
    MetricDef("musacache_tier_capacity_bytes", "gauge", _TIER,
              "The tier's capacity (absent for a storage tier without one)."),
    MetricDef("musacache_tier_chunks", "gauge", _TIER, "Chunks the tier holds now."),
    MetricDef("musacache_write_queue_depth", "gauge", _TIER,
              "Writes queued for the storage tier (write-behind and write-through)."),
    MetricDef("musacache_write_queue_bytes", "gauge", _TIER,
              "Bytes of the writes queued for the storage tier."),
    MetricDef("musacache_write_sheds", "counter", _TIER,
              "Writes shed: the queue was full and the storage tier failing."),
    MetricDef("musacache_write_drops", "counter", _TIER,
              "Writes given up: too big, no room to make, or failed."),
    MetricDef("musacache_tier_faults", "counter", _TIER,
              "Reads, deletes and refreshes of the storage tier that failed."),
    MetricDef("musacache_tier_timeouts", "counter", _TIER,
              "Reads of the storage tier that ran past its timeout."),
    MetricDef("musacache_request_duration_seconds", "histogram", (*_CACHE, "op"),
              "Time of a cache call (lookup, get, put, store, retrieve), checks included."),
)

SERVER_METRICS: tuple[MetricDef, ...] = (
    MetricDef("musacache_server_open_connections", "gauge", (),
              "Connections open now, monitors included."),
    MetricDef("musacache_server_peers", "gauge", (),
              "Worker connections open now (monitors such as musacache stats left out)."),
    MetricDef("musacache_server_caches", "gauge", (), "Caches open now."),
    MetricDef("musacache_server_max_caches", "gauge", (), "The server's max_caches."),
    MetricDef("musacache_server_requests_in_flight", "gauge", (),
              "Requests running now, all connections together."),
    MetricDef("musacache_server_connections", "counter", (), "Connections admitted."),
    MetricDef("musacache_server_refused_connections", "counter", (),
              "Connections refused: over max_connections, or of a uid not allowed."),
    MetricDef("musacache_server_requests", "counter", (), "Requests admitted and run."),
    MetricDef("musacache_server_request_errors", "counter", (),
              "Requests answered with an error."),
    MetricDef("musacache_server_bad_frames", "counter", (),
              "Frames that were not a well-formed request."),
    MetricDef("musacache_server_limited", "counter", (),
              "Requests refused, or connections ended, for a limit."),
    MetricDef("musacache_server_accept_backoffs", "counter", (),
              "Accepts that failed for lack of fds or memory, and waited."),
    MetricDef("musacache_server_copied_bytes", "counter", (),
              "KV bytes the requests covered (put, get, store, retrieve, staged)."),
    MetricDef("musacache_server_received_bytes", "counter", (),
              "KV bytes received through the socket."),
    MetricDef("musacache_server_cache_evictions", "counter", (),
              "Unused caches closed to make room for another (max_caches)."),
    MetricDef("musacache_server_connection_timeouts", "counter", ("kind",),
              "Connections closed for a timeout: hello, idle or frame."),
)
