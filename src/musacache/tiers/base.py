"""The tier protocol.

There are two kinds of tier:

* **Memory tiers** (:class:`~musacache.DeviceTier`, :class:`~musacache.HostTier`) hold chunks as
  tensors in a lazily grown pool. The engine copies straight in and out of them.
* **Storage tiers** (:class:`StorageTier`: disk, S3, or your own) hold *encoded chunk objects*
  (see :mod:`musacache.codec`): bytes with a self-describing, checksummed header. The engine
  encodes before ``write`` and verifies and decodes after ``read``, so a storage tier only moves
  bytes by key. This is the protocol to implement for a new backend (Redis, NFS, ...).

The engine owns the directory, capacity accounting and eviction for *all* tiers: a storage tier
with ``capacity_bytes`` set never has to evict by itself, and it never sees a write that would
exceed its capacity.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from musacache.tiers.listing import ChunkListing, ListingBuilder

from .._chunkmeta import ChunkMeta
from .._errors import TierError
from .._executor import Executor
from .._keys import Fingerprint
from .._spec import KVSpec

if TYPE_CHECKING:
    from .._native import ChunkCopy

__all__ = ["NOT_TRIED", "ChunkListing", "ChunkMeta", "ListingBuilder", "QuarantinedError",
           "StorageTier", "TierConfig", "TierContext", "own_executor"]


def own_executor(ctx: TierContext, have: Executor | None, owned: bool,
                 name: str) -> tuple[Executor, bool]:
    """The executor a storage tier starting under ``ctx`` runs its blocking calls on, and
    whether the tier owns it (closes it at ``aclose``): the cache's, or else one of the
    tier's own (``have`` again, while it is open)."""
    if ctx.executor is not None:
        return ctx.executor, False
    if have is not None and owned and not have.closed:
        return have, True
    return Executor(f"musacache-{name}"), True


@dataclass(frozen=True)
class TierContext:
    """Given to a storage tier at start: what the cache stores and how to name it.

    ``storage_name`` is the folder or prefix a tier keeps this cache's objects under. It names
    the fingerprint and, when the cache has a ``tenant``, the tenant too: tenants sharing one
    folder or bucket never list, read or delete each other's objects.
    """

    fingerprint: Fingerprint
    #: The cache's tenant salt (``CacheConfig.tenant``); ``None`` or ``""`` for no tenant.
    tenant: str | None = None
    #: The cache's worker threads, for the tier's blocking calls (file I/O, listings): a
    #: tier started without one makes its own.
    executor: Executor | None = field(default=None, compare=False, repr=False)
    spec: KVSpec = field(init=False)
    chunk_size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", self.fingerprint.spec)
        object.__setattr__(self, "chunk_size", self.fingerprint.chunk_size)

    @property
    def storage_name(self) -> str:
        """``<fingerprint digest hex>``, or ``<fingerprint digest hex>.<tenant digest hex>``.

        The tenant part is a digest so that a tenant's name never appears in a path; the
        fingerprint part stays first so one model's objects still sort together. A cache
        without a tenant keeps the name it always had.
        """
        fp = self.fingerprint.digest().hex()
        if not self.tenant:
            return fp
        tenant = hashlib.blake2b(self.tenant.encode(), digest_size=16,
                                 person=b"musacache-tenant").hexdigest()
        return f"{fp}.{tenant}"


class StorageTier(abc.ABC):
    """A tier that stores encoded chunk objects by key. Subclass it to plug in a backend.

    Contract:

    * ``write`` stores ``obj``, replacing whatever the key held (the last write wins: a key
      re-put after a delete may carry new bytes, so never skip a write because the key looks
      present). Operations on one key take effect in the order they were called. It raises
      :class:`~musacache.TierError` after the tier's own retries are spent; the engine then counts
      the write as dropped. It is always called from a background task, never on ``put``'s path.
    * ``read`` returns the object's bytes, ``None`` when the key is absent, and raises
      :class:`~musacache.TierError` on a fault. The engine bounds it with ``timeout`` seconds and
      turns faults and timeouts into counted misses.
    * ``read_into`` is optional (set ``reads_into``): a tier that can read a chunk straight
      into a tensor (a local file) saves the engine a buffer and a copy per chunk.
    * ``start`` returns the chunks that already exist (after a restart, or written by other
      nodes), so the engine can rebuild its directory. ``refresh`` is asked again on a miss.
    * Keep each cache's objects under its ``ctx.storage_name`` (fingerprint and tenant), and
      list, read and delete only there: another tenant's ``clear()`` must not reach them.
    """

    #: Shown in stats and logs.
    name: str = "storage"

    @property
    def kind(self) -> str:
        """What backend this is, for stats (``"disk"``, ``"s3"``); a plug-in tier that does not
        set it shows its class name."""
        return type(self).__name__

    #: Bytes the engine may store here; ``None`` means unbounded (an object store).
    capacity_bytes: int | None = None
    #: Every put is also written here in the background (sharing between nodes).
    write_through: bool = False
    #: The codec of the objects this tier stores: ``"lz4"`` (byte-shuffle + lz4) or ``"raw"``.
    codec: str = "lz4"
    #: Longest time in seconds the engine waits for one ``read`` before counting a miss.
    timeout: float = 10.0
    #: Reads and writes the engine runs at once against this tier.
    max_concurrency: int = 8
    #: Whether ``refresh`` can discover chunks written by others (worth asking on a miss).
    shared: bool = False
    #: The tier implements :meth:`read_into` (the engine then reads chunks straight into
    #: their destination instead of calling :meth:`read` and decoding the bytes).
    reads_into: bool = False
    #: The tier implements :meth:`read_to` (the engine then reads a chunk a get asked for
    #: straight into the caller's tensor, and promotes it in the background).
    reads_to: bool = False
    #: The tier also implements :meth:`read_to_many` (the engine then hands it every such
    #: chunk of a request as one batch, instead of one :meth:`read_to` call per chunk).
    reads_to_many: bool = False
    #: The tier keeps a delete note (:meth:`write_delete_notes`): deletes a close cut short
    #: are then finished at the next open instead of lost (their objects served again).
    keeps_delete_notes: bool = False

    @abc.abstractmethod
    async def start(self, ctx: TierContext) -> ChunkListing | Sequence[ChunkMeta]:
        """Open connections or folders; return the chunks already stored for ``ctx``.

        A :class:`ChunkListing` (built in a worker thread, e.g. with :class:`ListingBuilder`)
        is learned without an event-loop stall however long it is; a tier that keeps no
        reference to it returns ``listing.give()``, and the cache gives its memory back as
        soon as it has sorted it (:meth:`ChunkListing.give`). A list of ``ChunkMeta`` is
        still accepted, and is the cache's from then on: it is read and emptied a batch per
        loop turn (so its objects are freed a batch at a time if the tier keeps no other
        reference). Making a million objects is still the tier's own time."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every resource. Pending writes are the engine's to flush first."""

    @abc.abstractmethod
    async def write(self, meta: ChunkMeta, obj: bytes) -> None:
        """Store ``obj`` (an encoded chunk) under ``meta.key``."""

    @abc.abstractmethod
    async def read(self, meta: ChunkMeta) -> bytes | None:
        """Return the object stored under ``meta.key``, or ``None`` if there is none."""

    @abc.abstractmethod
    async def delete(self, key: bytes) -> None:
        """Remove the object under ``key`` (absent keys are not an error)."""

    async def read_into(self, meta: ChunkMeta, fingerprint: Fingerprint,
                        out: torch.Tensor, *,
                        on_block: Callable[[int, int], None] | None = None) -> int | None:
        """Optional (set :attr:`reads_into`): read, verify and decode the chunk under
        ``meta.key`` into ``out`` (a contiguous CPU tensor of its shape), as
        :func:`~musacache.codec.read_chunk_into` does from a file. When ``on_block`` is
        given, call ``on_block(start, end)`` as soon as bytes ``[start, end)`` of ``out`` are
        verified and final (the engine copies them on to the caller's tensor while they are
        in cache; a tier that never calls it only costs that copy later). Returns the
        object's size, or ``None`` if there is none. Raises :class:`~musacache.TierError`
        on a fault and the codec's errors for an object that cannot be read here; ``out``
        then holds garbage, and after a timeout it may be written until
        :meth:`writing_into` is False.
        """
        raise NotImplementedError(f"{type(self).__name__} does not read into a tensor")

    def writing_into(self, out: torch.Tensor) -> bool:
        """Whether an abandoned :meth:`read_into` may still write into ``out``."""
        return False

    async def read_to(self, meta: ChunkMeta, fingerprint: Fingerprint,
                      copy: ChunkCopy) -> int | None:
        """Optional (set :attr:`reads_to`): read, verify and decode the chunk under
        ``meta.key`` straight into ``copy``'s runs (a caller's tensor), as
        :func:`~musacache.codec.read_chunk_to` does from a file: only verified bytes are
        ever copied, and nothing once the copy's tee is closed. Returns the object's size,
        or ``None`` if there is none; the engine tells a complete read by ``copy.written``.
        Raises as :meth:`read_into` does."""
        raise NotImplementedError(f"{type(self).__name__} does not read into a caller's tensor")

    async def read_to_many(self, items: Sequence[tuple[ChunkMeta, ChunkCopy]],
                           fingerprint: Fingerprint) -> list[Any]:
        """Optional (set :attr:`reads_to_many`): :meth:`read_to` for each ``(meta, copy)`` of
        ``items``, as one batch, bounded by the tier's own ``timeout`` (the engine adds no
        deadline of its own around a batch). Returns, for each item in order, what
        ``read_to`` would return (the size, or None when absent), the exception it would
        raise (a :class:`~musacache.TierError` for a fault or a read that hung, the codec's
        errors for an object that cannot be read here), or :data:`NOT_TRIED` for an item the
        batch never started (the engine then reads it on its own)."""
        raise NotImplementedError(f"{type(self).__name__} does not read in batches")

    async def write_delete_notes(self, notes: bytes | None) -> None:
        """Optional (set :attr:`keeps_delete_notes`): keep ``notes`` (opaque bytes, the
        deletes a close cut short) durably under ``ctx.storage_name``, in place of any
        kept before; ``None`` removes them. Called while the tier is started, before
        :meth:`aclose`. Raises :class:`~musacache.TierError` if it cannot."""
        raise NotImplementedError(f"{type(self).__name__} keeps no delete notes")

    async def read_delete_notes(self) -> bytes | None:
        """Optional (set :attr:`keeps_delete_notes`): what :meth:`write_delete_notes` kept
        last, or ``None``; called once after :meth:`start`."""
        return None

    async def refresh(self, parent: bytes | None = None) -> list[ChunkMeta]:
        """Chunks stored now (under ``parent`` only, if given). Shared tiers override this."""
        return []

    def stats(self) -> dict[str, Any]:
        """Backend-specific counters, merged into ``Cache.stats()`` under this tier."""
        return {}

    def build(self) -> StorageTier:
        """A running tier is its own config: an instance may stand in ``CacheConfig.tiers``."""
        return self


class QuarantinedError(TierError):
    """What a read raises for an object the tier will not read again (an earlier read of it
    hung and was abandoned). The engine counts a fault and a miss, forgets the chunk and
    deletes the object, as for a corrupt one: an object left in place but forgotten would
    escape a later delete or clear, and come back at the next restart."""


class _NotTried:
    """The type of :data:`NOT_TRIED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_TRIED"


#: What :meth:`StorageTier.read_to_many` returns for an item it never started.
NOT_TRIED = _NotTried()


@runtime_checkable
class TierConfig(Protocol):
    """The settings of a storage tier: what ``CacheConfig.tiers`` holds besides the memory tiers
    (:class:`~musacache.HostTier`, :class:`~musacache.DeviceTier`).

    :class:`~musacache.DiskTier` and :class:`~musacache.S3Tier` are frozen dataclasses of plain
    values (so TOML and the environment can build them) whose ``build()`` makes the running
    tier; a :class:`StorageTier` instance builds to itself. The engine calls ``build()`` once,
    in ``Cache.open()``.
    """

    @property
    def name(self) -> str:
        """The tier's name in ``stats()`` and logs; unique within one cache."""
        ...

    def build(self) -> StorageTier:
        """The running tier, not yet started."""
        ...
