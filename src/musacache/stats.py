"""The counters of a cache, its tiers and the server, one record per concept.

Each record is a mutable, slotted dataclass that the code counts into in place
(``tier.c.hits += 1``: as cheap as a dict update, and a misspelt counter fails the type check
instead of adding a key). ``stats()`` reports each one as a dict of its fields
(:func:`as_dict`), beside what is measured at the time of asking (bytes used, chunks
held, connections open), so the
keys of a ``stats()`` dict are the field names below, in their order.

It lives on the ground floor: the tiers, the engine, the cache, the server and the
integrations all count into these records, and none of them may import the others.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "as_dict",
    "CloseReport",
    "DiskStats",
    "InFlight",
    "LATENCY_BUCKETS",
    "Latency",
    "MemoryTierStats",
    "OpCounts",
    "OpLatencies",
    "S3Stats",
    "SGLangStats",
    "ServerCounters",
    "StorageTierStats",
    "TokenCounts",
]


@dataclass(slots=True)
class OpCounts:
    """Calls of a cache's public operations since it was made (``stats()["ops"]``)."""

    puts: int = 0
    """``put``, ``store`` and ``put_pages`` calls."""
    gets: int = 0
    """``get``, ``retrieve`` and ``get_pages`` calls."""
    lookups: int = 0
    """``lookup`` and ``exists_pages`` calls."""
    prefetches: int = 0
    """``prefetch`` calls."""
    deletes: int = 0
    """``delete`` calls."""


@dataclass(slots=True)
class InFlight:
    """Operations running now (``stats()["in_flight"]``, with the cache's background tasks
    beside them as ``background``): each is counted up as it starts and down as it ends."""

    puts: int = 0
    """Put calls (``put``, ``store``, ``put_pages``) not returned yet."""
    gets: int = 0
    """Get calls (``get``, ``retrieve``, ``get_pages``) not returned yet."""
    lookups: int = 0
    """``lookup`` calls not returned yet."""
    prefetches: int = 0
    """``prefetch`` calls not returned yet."""
    promotions: int = 0
    """Promotions of a chunk into the top tier started and not finished."""
    writes: int = 0
    """Writes of an object to a storage tier started and not finished."""


@dataclass(slots=True)
class TokenCounts:
    """Tokens the cache was asked for and given, since it opened (``stats()["tokens"]``)."""

    hit_tokens: int = 0
    """Tokens that gets (``get``, ``retrieve``, ``get_pages``) asked for and were served."""
    miss_tokens: int = 0
    """Tokens that gets asked for and were not served (a hit cut short counts its rest)."""
    put_tokens: int = 0
    """Tokens of the new chunks that puts placed."""
    stored_tokens: int = 0
    """The cached prefix lengths that puts returned, summed."""


@dataclass(slots=True)
class CloseReport:
    """What ``aclose`` wrote and what it left (``stats()["close"]``); zeros until it ran."""

    to_persist: int = 0
    """Chunks held only in memory that ``persist_on_close`` set out to write down."""
    persisted: int = 0
    """Of those, chunks written to the first storage tier."""
    not_persisted: int = 0
    """``to_persist - persisted``: chunks lost with the memory tiers."""
    writes_abandoned: int = 0
    """Writes still queued for a storage tier when the tiers were closed (lost)."""
    timed_out: int = 0
    """1 if ``close_timeout`` cut the close short, else 0."""
    deletes_cut: int = 0
    """Deletes and clears still running when the close cut them short (their memory part
    goes with the cache; their storage part is noted or abandoned)."""
    object_deletes_cut: int = 0
    """Storage object deletes queued or running when the close cut them short."""
    deletes_noted: int = 0
    """Prompts and object keys written to delete notes, finished at the next open (all
    tiers together)."""
    deletes_abandoned: int = 0
    """Prompts and object keys a storage tier could not note (S3, or a note that failed to
    write): what they name may be served again after a restart."""


@dataclass(slots=True)
class MemoryTierStats:
    """What the engine counts for a memory tier (device or host); in ``stats()["tiers"]``."""

    hits: int = 0
    """Chunks served from this tier."""
    misses: int = 0
    """Chunks a get looked for in this top tier and found only lower down."""
    bytes_in: int = 0
    """KV bytes of the chunks placed in this tier."""
    bytes_out: int = 0
    """KV bytes that gets were served from this tier."""
    evictions: int = 0
    """Chunks evicted from this tier to make room."""
    promotions: int = 0
    """Chunks copied up into this tier from a lower one."""
    demotions: int = 0
    """Chunks that came down into this tier, evicted from the tier above."""
    drops: int = 0
    """Chunks evicted from this tier that no tier below took: their data is gone."""


@dataclass(slots=True)
class StorageTierStats:
    """What the engine counts for a storage tier; in ``stats()["tiers"]``, beside the tier's
    own counters (its ``stats()``, prefixed ``store_``)."""

    hits: int = 0
    """Chunks served from this tier."""
    misses: int = 0
    """Reads of a chunk that served nothing: absent, failed, timed out, corrupt or foreign."""
    bytes_in: int = 0
    """Encoded bytes written to this tier."""
    bytes_out: int = 0
    """Bytes read from this tier (encoded), and the KV bytes of the gets it served."""
    evictions: int = 0
    """Chunks evicted from this tier to keep it within its capacity."""
    faults: int = 0
    """Reads, deletes and refreshes that failed (timeouts included)."""
    timeouts: int = 0
    """Reads that ran past the tier's ``timeout``."""
    corrupt: int = 0
    """Objects that failed their checks (deleted, unless a second read finds them whole)."""
    foreign: int = 0
    """Objects under this cache's key written for another model, layout or format."""
    writes: int = 0
    """Objects written."""
    write_drops: int = 0
    """Writes given up: too big, no room to make (only pinned or queued chunks), or failed."""
    write_sheds: int = 0
    """Writes shed because the write queue was full and the tier failing."""
    promotions: int = 0
    """Chunks copied up into this tier (when it is the top tier)."""
    demotions: int = 0
    """Chunks written to this tier from the tier above: evicted there, or persisted."""
    refreshes: int = 0
    """Listings of a shared tier, for chunks other nodes wrote, that answered."""
    drops: int = 0
    """Chunks evicted from this tier that no tier below took: their data is gone."""
    deletes: int = 0
    """Objects deleted."""
    notes_replayed: int = 0
    """Prompts and keys of this tier's delete notes done at open (deletes a close cut)."""

    def read_fault(self) -> None:
        """A read that failed: a fault, and a miss."""
        self.faults += 1
        self.misses += 1

    def read_timeout(self) -> None:
        """A read that ran past its deadline: a timeout, a fault, and a miss."""
        self.timeouts += 1
        self.read_fault()


@dataclass(slots=True)
class S3Stats:
    """What the S3 tier counts of its requests (``S3Tier.stats()``)."""

    reads: int = 0
    """Objects read whole (one GET, or a ranged read's parts together)."""
    read_misses: int = 0
    """Reads of an object the bucket does not have."""
    read_faults: int = 0
    """Reads that failed."""
    writes: int = 0
    """Objects written."""
    write_retries: int = 0
    """Write attempts that failed and were tried again."""
    write_failures: int = 0
    """Writes that failed for good (after their retries, or on an error not worth one)."""
    deletes: int = 0
    """Objects deleted."""
    lists: int = 0
    """Listings of a prefix that completed."""
    list_faults: int = 0
    """Listings that failed."""
    bytes_in: int = 0
    """Bytes of the objects written."""
    bytes_out: int = 0
    """Bytes of the objects read."""
    multipart_writes: int = 0
    """Writes sent as multipart uploads (objects of ``multipart_threshold`` bytes or more)."""
    ranged_reads: int = 0
    """Reads fetched in several ``part_size`` ranges."""
    last_error: str | None = None
    """The last failure, as ``"op (kind): message"``; None if there was none."""


@dataclass(slots=True)
class DiskStats:
    """What the disk tier counts of its files (``DiskTier.stats()``)."""

    reads: int = 0
    """Reads that returned a chunk's file."""
    read_misses: int = 0
    """Reads of a chunk that has no file (or only an entry that is not a file)."""
    read_faults: int = 0
    """Reads that failed (timeouts and refusals included)."""
    read_timeouts: int = 0
    """Reads that ran past the tier's ``timeout`` (their thread abandoned)."""
    reads_refused: int = 0
    """Reads refused at once while ``max_concurrency`` abandoned reads were stuck."""
    writes: int = 0
    """Files written."""
    write_failures: int = 0
    """Writes that failed."""
    deletes: int = 0
    """Files deleted."""
    bytes_in: int = 0
    """Bytes of the files written."""
    bytes_out: int = 0
    """Bytes read from files."""
    removed_temp: int = 0
    """Leftover temporary files removed by the start-up scan."""
    removed_corrupt: int = 0
    """Chunk files that failed the start-up scan's check, removed."""
    removed_not_files: int = 0
    """Entries under a chunk's name that were not regular files, removed."""
    quarantined: int = 0
    """Keys whose file hung a read: not read again until written again."""
    ignored_files: int = 0
    """Entries the start-up scan left alone: not named as chunks, or not regular files."""
    scan_errors: int = 0
    """Folders or files the start-up scan could not read (kept)."""
    last_error: str | None = None
    """The last failure, as a message naming the file; None if there was none."""


@dataclass(slots=True)
class ServerCounters:
    """What ``musacache serve`` counts over all its connections (``stats()["server"]``,
    beside what is open now: peers, caches, mappings, fds)."""

    connections: int = 0
    """Connections admitted (of an allowed uid, under ``max_connections``)."""
    refused: int = 0
    """Connections refused: over ``max_connections``, or of a uid not allowed."""
    requests: int = 0
    """Requests admitted and run."""
    errors: int = 0
    """Requests answered with an error."""
    bad_frames: int = 0
    """Frames that were not a well-formed request."""
    limited: int = 0
    """Requests refused at the door, or connections ended, for a limit."""
    accept_backoffs: int = 0
    """Accepts that failed for lack of fds or memory, and waited."""
    bytes_copied: int = 0
    """KV bytes the requests covered (put, get, store, retrieve, staged)."""
    bytes_received: int = 0
    """KV bytes received through the socket (``stage_bytes``)."""
    hello_timeouts: int = 0
    """Connections closed for no ``hello`` within ``hello_timeout``."""
    idle_timeouts: int = 0
    """Connections closed after ``idle_timeout`` with nothing in flight and nothing sent."""
    frame_timeouts: int = 0
    """Connections closed for a frame incomplete past ``frame_timeout``."""
    cache_evictions: int = 0
    """Unused caches closed to make room for another (``max_caches``)."""


@dataclass(slots=True)
class SGLangStats:
    """What the SGLang HiCache storage backend counts (its ``get_stats()``)."""

    gets: int = 0
    """Pages asked for."""
    hits: int = 0
    """Of those, pages found and copied into the host pool."""
    sets: int = 0
    """Set calls."""
    set_pages: int = 0
    """Pages the set calls stored."""
    faults: int = 0
    """Calls that failed (the cache unavailable, an error, a timeout)."""


#: Upper bounds (seconds) of the latency buckets: a one-chunk host get takes ~10 µs, a
#: 32k-token get from S3 seconds.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Latency:
    """The durations of one operation, counted in :data:`LATENCY_BUCKETS` (not cumulative:
    the last count is of those over the largest bound)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    """Calls per bucket: ``counts[i]`` took at most ``LATENCY_BUCKETS[i]`` and more than
    the bound before."""
    sum: float = 0.0
    """Seconds of all the calls counted."""

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds


@dataclass(slots=True)
class OpLatencies:
    """How long a cache's public calls took, from its argument checks to its return or
    raise; kept only while something exports them (``musacache.metrics``)."""

    lookup: Latency = field(default_factory=Latency)
    """``lookup`` calls."""
    get: Latency = field(default_factory=Latency)
    """``get`` calls."""
    put: Latency = field(default_factory=Latency)
    """``put`` calls."""
    store: Latency = field(default_factory=Latency)
    """``store`` calls."""
    retrieve: Latency = field(default_factory=Latency)
    """``retrieve`` calls."""


_NAMES: dict[type, tuple[str, ...]] = {}


def as_dict(record: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` of a record of this module without its deep copy: the fields
    are plain values, and ``stats()`` may be sampled every turn of the loop."""
    cls = type(record)
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return {name: getattr(record, name) for name in names}
