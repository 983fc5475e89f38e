"""The local-disk storage tier: one file per chunk object, in the codec format.

Layout under ``path``::

    <path>/<storage name>/                    one folder per namespace/spec/chunk size and tenant
        .lock                                 flock'ed while a cache uses the folder
        .delete-notes                         deletes a close cut short, done at the next open
        <kk>/                                 fan-out: the first byte of the key, 256 folders
            <key hex>.<parent hex>.<tokens>.kvc
            .<final name>.<random>.tmp        a write in progress (or a crashed one)

The storage name is the fingerprint digest, followed by ``.<tenant digest>`` for a cache with a
tenant (:attr:`TierContext.storage_name`): tenants sharing ``path`` each scan, read and delete
only their own folder, so one tenant's ``clear()`` never reaches another's chunks.

A file's name alone rebuilds its directory entry (key, parent, token count); the start-up scan
still reads each header (256 bytes) and checks the file size against it, and removes what
fails: leftover temp files, bad headers, wrong sizes, names that disagree with the header.

**Atomic writes, and the fsync policy.** A chunk is written to a temp file in its final folder
and renamed over the final name with ``os.replace``, so a reader never sees half a file under a
chunk's name. By default nothing is fsync'ed: this is a cache, and losing the newest chunks in
a power cut only costs misses. A file torn by a crash (on file systems that can leave a renamed
file short or empty) fails the start-up size check or the read-time checksum, and is removed or
counted as a miss; it never becomes wrong data. ``fsync=True`` adds an fsync of the file before
the rename and of its folder after it, for deployments that want the chunks to survive a crash.

Reads touch the file's mtime, which is what ``last_used`` reports after a restart (access times
are unreliable under ``noatime``/``relatime``).

**Reads land in their destination.** The engine reads a chunk with :meth:`DiskStore.read_into`:
one worker-thread call opens the file, reads, verifies and decodes it into the tensor it is
given (a reserved top-tier slot), with :func:`~musacache.codec.read_chunk_into`: one native
call per chunk. A raw chunk's payload goes from the page cache into the slot with ``pread`` and
no buffer in between; an ``lz4`` chunk's blocks are read, checked and decoded just before the
strips of the slot that need them. Either also writes the caller's tensor when ``on_block``
carries a native copy (``engine/tee.py``). A get's chunks read straight into the caller's tensor
come as one batch (:meth:`DiskStore.read_to_many`): a few worker threads each take the next
chunk as soon as they are done with one, with no event-loop turn in between.

**Writes and deletes of one key are ordered.** They take effect one at a time, in the order the
engine called them (:class:`~musacache.tiers._ordering.KeyOrder`), so a delete never races a
rename of the same key. A write always replaces the file: a key re-put after a delete may carry
new bytes, so a file that merely looks the same is never trusted over the newer write.

**A read never hangs the cache.** Files are opened with ``O_NONBLOCK | O_NOFOLLOW`` and checked
with ``fstat``: anything but a regular file under a chunk's name (a FIFO, a device, a symlink)
is removed and read as absent, without blocking on it. A read that outlives ``timeout`` (a hung
network file system) is abandoned to its thread; its key is quarantined (read as absent until
it is written again) and such stuck threads are counted: while ``max_concurrency`` of them are
stuck, reads fail at once instead of starting more threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import os
import re
import resource
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import torch

from .. import devices
from .._errors import (
    ConfigError,
    CorruptChunkError,
    FingerprintMismatchError,
    TierError,
    TierTimeoutError,
)
from .._executor import Executor
from .._keys import KEY_BYTES, Fingerprint
from .._validate import boolean, parse_size, positive_float, positive_int, shown
from ..codec import CODECS, HEADER_SIZE, read_chunk_into, read_chunk_to, read_header
from ..stats import DiskStats, as_dict
from ._ordering import KeyOrder
from .base import (
    NOT_TRIED,
    ChunkListing,
    ChunkMeta,
    ListingBuilder,
    QuarantinedError,
    StorageTier,
    TierContext,
    own_executor,
)

if TYPE_CHECKING:
    from .._native import ChunkCopy

__all__ = ["DiskStore", "DiskTier"]

_SUFFIX = ".kvc"
#: The delete notes of the folder's cache (``engine.notes``), beside ``.lock``.
NOTES_FILE = ".delete-notes"
_NAME_RE = re.compile(r"^([0-9a-f]{64})\.([0-9a-f]{64})\.([1-9][0-9]{0,9})\.kvc$")
_HEX2_RE = re.compile(r"^[0-9a-f]{2}$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class DiskTier:
    """A local folder of chunk files. ``capacity_bytes`` bounds the encoded bytes stored there
    (the cache evicts least-recently-used leaves to stay under it).

    Every field is a plain value so a TOML table or ``MUSACACHE_TIERS__N__*`` variables can
    build it. ``path`` is created if missing; one cache at a time may use a path for a given
    namespace/spec (a second one fails at start with :class:`TierError`).
    """

    path: str
    capacity_bytes: int | str
    codec: str = "lz4"
    write_through: bool = False
    #: Longest wait in seconds for one read before it counts as a miss.
    timeout: float = 10.0
    #: File reads and writes running at once (worker threads). A batch of reads that do not
    #: wait on the disk (a warm page cache) uses no more of them than there are CPUs.
    max_concurrency: int = 4
    #: fsync each file before its rename, and its folder after (see the module docstring).
    fsync: bool = False
    name: str = "disk"
    kind: Literal["disk"] = field(default="disk", init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ConfigError(f"{self.name}.path must be a non-empty folder path, "
                              f"got {shown(self.path)}")
        object.__setattr__(self, "path", os.fspath(self.path))
        object.__setattr__(self, "capacity_bytes",
                           parse_size(self.capacity_bytes, what=f"{self.name}.capacity_bytes"))
        if self.codec not in CODECS:
            raise ConfigError(f"{self.name}.codec must be one of {CODECS}, got {shown(self.codec)}")
        for flag in ("write_through", "fsync"):
            boolean(getattr(self, flag), f"{self.name}.{flag}")
        object.__setattr__(self, "timeout",
                           positive_float(self.timeout, f"{self.name}.timeout"))
        object.__setattr__(self, "max_concurrency",
                           positive_int(self.max_concurrency, f"{self.name}.max_concurrency"))

    def build(self) -> DiskStore:
        return DiskStore(self)


def file_name(key: bytes, parent: bytes, num_tokens: int) -> str:
    """The file name of a chunk: everything its directory entry needs."""
    return f"{key.hex()}.{parent.hex()}.{num_tokens}{_SUFFIX}"


#: A read cancelled from outside after this share of the tier's timeout counts as hung (its
#: file is quarantined), as one the tier's own timeout ended does.
_HUNG_SHARE = 0.95
# How long a lane of a batch of reads (DiskStore.read_to_many) reads before it gives its thread
# slot back and waits for one again: other work waiting for a slot takes turns with a long batch
# within this (FIFO), and the hand-off it costs (one loop turn) is small against it.
_LANE_SLICE = 0.05
# A read whose thread ran on a CPU for less than this share of its time waited on the disk.
_IO_BOUND_SHARE = 0.25


def _blocks_read() -> int:
    """The blocks this thread has read from storage (not from the page cache) so far; 0 where
    the system does not count them per thread."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_inblock
    except (AttributeError, OSError):
        return 0


class _ThreadRead:
    """The state of one read handed to a worker thread, shared under ``DiskStore._tlock``;
    ``out`` is the tensor it reads into (None when it returns bytes)."""

    __slots__ = ("abandoned", "cancelled", "done", "out", "started", "superseded")

    def __init__(self, out: torch.Tensor | None = None) -> None:
        self.started = self.done = self.abandoned = self.cancelled = False
        # A write replaced the file under the key while this read was in it: if the read
        # hangs, that was the old file, and the key is not quarantined for it.
        self.superseded = False
        self.out = out


class _InFlight:
    """The reads in progress, by key: a write of a key marks those reads superseded (a read
    that hangs then hung in the old file, and the key is not quarantined for it)."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[bytes, list[_ThreadRead]] = {}

    def begin(self, key: bytes, call: _ThreadRead) -> None:
        self._by_key.setdefault(key, []).append(call)

    def end(self, key: bytes, call: _ThreadRead) -> None:
        calls = self._by_key.get(key)
        if calls is not None:
            calls[:] = [c for c in calls if c is not call]
            if not calls:
                del self._by_key[key]

    def supersede(self, key: bytes) -> None:
        for call in self._by_key.get(key, ()):
            call.superseded = True


class _Raised:
    """An exception a lane's read raised (the codec's: a corrupt or foreign object), apart
    from the ``OSError`` that :func:`_with_file` returns for a fault."""

    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class _Unchecked:
    """What _check_file returns for a file it could not read (kept, not listed)."""


_UNCHECKED = _Unchecked()
# Pauses before the start-up scan opens a file again after an OSError (EMFILE, EIO).
_SCAN_RETRY_PAUSES = (0.01, 0.1)


class _NotAFile:
    """What _read_file returns for a name that held no regular file (it was removed)."""


_NOT_A_FILE = _NotAFile()


def _list_subdirs(root: Path) -> tuple[list[Path], str | None]:
    """The fan-out folders, and the error that kept them from being listed. A folder
    that cannot be read is a fault of this tier, counted (``scan_errors``), never a
    failure of the cache's start: it starts knowing nothing of those files, and a
    read of one later is a counted miss as any other."""
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if _HEX2_RE.match(e.name)
                    and e.is_dir()], None
    except OSError as e:
        return [], f"scan {root}: {e}"


class DiskStore(StorageTier):
    """The running disk tier built by :meth:`DiskTier.build`. All file I/O runs in worker
    threads bounded by ``max_concurrency``."""

    shared = False
    kind = "disk"
    reads_into = True
    reads_to = True
    reads_to_many = True
    keeps_delete_notes = True

    def __init__(self, config: DiskTier) -> None:
        self.config = config
        self.name = config.name
        self.capacity_bytes = int(config.capacity_bytes)
        self.write_through = config.write_through
        self.codec = config.codec
        self.timeout = config.timeout
        self.max_concurrency = config.max_concurrency
        # Bounds the file calls running at once; the lanes of a batch of reads
        # (_BatchRead) each run under one of its tokens.
        self._limiter = anyio.CapacityLimiter(config.max_concurrency)
        # The cache's worker threads (given at start), or the tier's own when started alone.
        self._executor: Executor | None = None
        self._owns_executor = False
        self._root: Path | None = None
        self._root_text: str | None = None  # str(_root): what a read's path is made from
        self._fp: Fingerprint | None = None
        self._lock_fd: int | None = None
        # key -> file name, so delete(key) needs no folder listing.
        self._names: dict[bytes, str] = {}
        self._order = KeyOrder()
        # Keys whose read timed out: read as absent until written again.
        self._quarantined: set[bytes] = set()
        self._reading = _InFlight()
        # Read threads abandoned after a timeout that have not returned yet, and the lock that
        # guards this count and every _ThreadRead (worker threads update them).
        self._stuck = 0
        self._tlock = threading.Lock()
        # Whether the last batch of reads waited on the disk (not on the CPUs): it then
        # starts as many lanes as max_concurrency allows, else as many as there are CPUs.
        self._reads_wait = False
        # Abandoned reads into a caller's tensor: the tensor is not the caller's to reuse
        # until the thread returns (writing_into).
        self._writers: list[_ThreadRead] = []
        self._c = DiskStats()

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        if self._root is None:
            raise TierError(f"disk tier {self.name!r} is not started")
        return self._root

    async def _blocking(self, fn: Callable[..., _T], *args: Any, abandon: bool = False) -> _T:
        """``fn(*args)`` on a worker thread, under one of the tier's ``max_concurrency``
        tokens; ``abandon``: a caller cancelled meanwhile (a read past its timeout on a hung
        disk) does not wait for it."""
        assert self._executor is not None, "the tier is started"
        async with self._limiter:
            return await self._executor.run(fn, *args, abandon=abandon)

    async def start(self, ctx: TierContext) -> ChunkListing:
        self._fp = ctx.fingerprint
        self._executor, self._owns_executor = own_executor(ctx, self._executor,
                                                           self._owns_executor, self.name)
        root = Path(self.config.path) / ctx.storage_name
        try:
            await self._blocking(self._open_root, root)
        except OSError as e:
            raise TierError(f"disk tier {self.name!r}: cannot use {root}: {e}") from e
        self._root, self._root_text = root, str(root)
        try:
            subdirs, error = await self._blocking(_list_subdirs, root)
            if error is not None:
                self._c.scan_errors += 1
                self._c.last_error = error
            parts: list[ChunkListing] = []

            async def scan(sub: Path) -> None:
                found, names, counts = await self._blocking(self._scan_dir, sub)
                parts.append(found)
                self._names.update(names)  # one fan-out folder: 1/256 of the files
                for k, v in counts.items():  # a scan's own, merged on the loop
                    setattr(self._c, k, v if k == "last_error" else getattr(self._c, k) + v)

            async with anyio.create_task_group() as tg:
                for sub in subdirs:
                    tg.start_soon(scan, sub)
            listing = await self._blocking(ChunkListing.concat, parts)
            return listing.give()  # (the parts are dropped: nothing here keeps it)
        except BaseException:
            self._release_lock()
            self._root = self._root_text = None
            raise

    def _open_root(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierError(f"disk tier {self.name!r}: {root} is in use by another cache "
                                f"(one cache per folder and fingerprint)") from e
            raise
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    async def aclose(self) -> None:
        if self._owns_executor and self._executor is not None:
            self._executor.close()
        self._release_lock()
        self._root = self._root_text = None

    # -- start-up scan ------------------------------------------------------------------------

    def _scan_dir(self, sub: Path) -> tuple[ChunkListing, dict[bytes, str], dict[str, Any]]:
        """Check every file of one fan-out folder (in a worker thread): the chunks found, in
        compact form, and their file names. Counters are returned, not bumped here, so that
        concurrent scans never race on them."""
        found = ListingBuilder()
        names: dict[bytes, str] = {}
        counts: dict[str, Any] = {}
        try:
            with os.scandir(sub) as it:
                entries = list(it)
        except OSError as e:  # (see _list_subdirs)
            counts["scan_errors"] = 1
            counts["last_error"] = f"scan {sub}: {e}"
            entries = []
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                # A write that never reached its rename (we hold the folder lock, so no
                # live writer owns it).
                self._remove(entry.path, "removed_temp", counts)
                continue
            m = _NAME_RE.match(entry.name)
            if m is None or not entry.is_file(follow_symlinks=False):
                counts["ignored_files"] = counts.get("ignored_files", 0) + 1
                continue
            meta = self._check_file(entry.path, bytes.fromhex(m[1]), bytes.fromhex(m[2]),
                                    int(m[3]), sub.name, counts)
            if isinstance(meta, _Unchecked):
                continue  # kept for the next start (its fault is counted)
            if meta is None:
                self._remove(entry.path, "removed_corrupt", counts)
            else:
                found.add(meta.key, meta.parent, meta.num_tokens, meta.raw_bytes,
                          meta.stored_bytes, meta.last_used)
                names[meta.key] = file_name(meta.key, meta.parent, meta.num_tokens)
        return found.build(), names, counts

    def _check_file(self, path: str, key: bytes, parent: bytes, tokens: int,
                    fan_out: str, counts: dict[str, Any]) -> ChunkMeta | _Unchecked | None:
        """The file's ChunkMeta if its header, size and name agree; None if they do not (a
        corrupt or foreign file, removed); :data:`_UNCHECKED` when the file could not be
        read (out of fds, an I/O error: counted under ``scan_errors``, and the file kept,
        for a fault of the moment must not delete good chunks)."""
        fp = self._fp
        if fp is None or key[:1].hex() != fan_out:
            return None
        for pause in (*_SCAN_RETRY_PAUSES, None):
            try:
                # O_NONBLOCK: a FIFO under a chunk's name must not hang the start-up scan.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        return None
                    head = os.pread(fd, HEADER_SIZE, 0)
                finally:
                    os.close(fd)
                hdr = read_header(head)
                break
            except (CorruptChunkError, FingerprintMismatchError):
                return None
            except FileNotFoundError:
                return _UNCHECKED  # removed meanwhile: nothing to keep or count
            except OSError as e:
                if e.errno == errno.ELOOP:
                    return None  # a symlink put there under a chunk's name (O_NOFOLLOW)
                if pause is None:
                    counts["scan_errors"] = counts.get("scan_errors", 0) + 1
                    counts["last_error"] = f"scan {path}: {e}"
                    return _UNCHECKED
                time.sleep(pause)  # (a worker thread) out of fds for a moment, say
        if (hdr.key, hdr.parent, hdr.num_tokens) != (key, parent, tokens) \
                or not hdr.matches(fp) or st.st_size != hdr.object_len:
            return None
        return hdr.meta(stored_bytes=st.st_size, last_used=st.st_mtime)

    @staticmethod
    def _remove(path: str, counter: str, counts: dict[str, Any]) -> None:
        try:
            os.unlink(path)
            counts[counter] = counts.get(counter, 0) + 1
        except FileNotFoundError:
            pass
        except OSError as e:
            counts["last_error"] = f"remove {path}: {e}"

    # -- chunk I/O ----------------------------------------------------------------------------

    def _path(self, key: bytes, parent: bytes, num_tokens: int) -> Path:
        return Path(self._file(key, parent, num_tokens))

    def _file(self, key: bytes, parent: bytes, num_tokens: int) -> str:
        """The path of a chunk's file as a string: what a read opens (a ``Path`` made with
        two joins cost a read of a small chunk a third of its time)."""
        if self._root_text is None:
            raise TierError(f"disk tier {self.name!r} is not started")
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise TierError(f"chunk keys are {KEY_BYTES} bytes, got {len(key)} and "
                            f"{len(parent)}")
        return f"{self._root_text}/{key[:1].hex()}/{file_name(key, parent, num_tokens)}"

    async def write(self, meta: ChunkMeta, obj: bytes) -> None:
        path = self._path(meta.key, meta.parent, meta.num_tokens)
        async with self._order.hold(meta.key):
            try:
                await self._blocking(self._write_file, path, obj)
            except OSError as e:
                self._c.write_failures += 1
                self._c.last_error = f"write {path.name}: {e}"
                raise TierError(f"disk tier {self.name!r}: cannot write {path}: {e}") from e
            self._names[meta.key] = path.name
            self._quarantined.discard(meta.key)  # a fresh file under the name
            self._reading.supersede(meta.key)
        self._c.writes += 1
        self._c.bytes_in += len(obj)

    def _write_file(self, path: Path, obj: bytes) -> None:
        """Write ``obj`` atomically at ``path``, replacing what is there."""
        folder = path.parent
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{path.name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                view = memoryview(obj)
                while view:  # os.write may write less than asked
                    view = view[os.write(fd, view):]
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.config.fsync:
            dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    async def read(self, meta: ChunkMeta) -> bytes | None:
        obj = await self._read_call(meta, self._read_regular)
        if obj is not None:
            self._c.bytes_out += len(obj)
        return obj

    async def read_into(self, meta: ChunkMeta, fingerprint: Fingerprint,
                        out: torch.Tensor, *,
                        on_block: Callable[[int, int], None] | None = None) -> int | None:
        """Read, verify and decode the chunk straight into ``out`` in one worker-thread call
        (:func:`~musacache.codec.read_chunk_into`: a raw chunk's payload lands in ``out``
        with no buffer in between; ``on_block`` is called in that thread as each verified
        range of ``out`` is final). Returns the object's size, or None when it is absent.

        Raises :class:`TierError` on a fault or a timeout, and the codec's errors
        (:class:`CorruptChunkError`, :class:`FingerprintMismatchError`,
        :class:`ForeignFormatError`) for an object that cannot be read here. After a failure
        ``out`` holds garbage; after a timeout a thread may still write into it until
        :meth:`writing_into` says otherwise.
        """
        def read(path: Path) -> int | OSError | _NotAFile | None:
            return self._read_regular_into(path, fingerprint, meta, out, on_block)

        call = _ThreadRead(out)
        size = await self._read_call(meta, read, call)
        if size is not None:
            self._c.bytes_out += size
        return size

    async def read_to(self, meta: ChunkMeta, fingerprint: Fingerprint,
                      copy: ChunkCopy) -> int | None:
        """Read, verify and decode the chunk straight into ``copy``'s runs in one
        worker-thread call (:func:`~musacache.codec.read_chunk_to`). Returns the object's
        size, or None when it is absent; raises as :meth:`read_into` does. A read abandoned
        by a timeout writes nothing once the copy's tee is closed."""
        def read(path: Path) -> int | OSError | _NotAFile | None:
            return _read_file_to(path, fingerprint, meta, copy)

        size = await self._read_call(meta, read)
        if size is not None:
            self._c.bytes_out += size
        return size

    async def read_to_many(self, items: Sequence[tuple[ChunkMeta, ChunkCopy]],
                           fingerprint: Fingerprint) -> list[Any]:
        """:meth:`read_to` for each of ``items``, as one batch (:class:`_BatchRead`)."""
        return await _BatchRead(self, items, fingerprint).run()

    def writing_into(self, out: torch.Tensor) -> bool:
        """Whether an abandoned read (one that timed out) may still write into ``out``."""
        with self._tlock:
            self._writers = [c for c in self._writers if not c.done]
            return any(c.out is out for c in self._writers)

    async def _read_call(self, meta: ChunkMeta, read: Callable[[Path], Any],
                         call: _ThreadRead | None = None) -> Any:
        """Run ``read(path)`` in a worker thread, bounded by the timeout, counting misses and
        faults; quarantines a file whose read hung."""
        path = self._path(meta.key, meta.parent, meta.num_tokens)
        if meta.key in self._quarantined:
            raise _quarantined(self, path)
        if _stuck_all(self):
            raise _refusal(self, path)
        call = call or _ThreadRead()
        started = anyio.current_time()
        self._reading.begin(meta.key, call)
        try:
            with anyio.fail_after(self.timeout):
                # abandon_on_cancel: a hung disk (NFS) must not hold the caller past timeout.
                obj = await self._blocking(self._read_file, path, read, call, abandon=True)
        except TimeoutError as e:
            self._c.read_faults += 1
            self._c.read_timeouts += 1
            self._c.last_error = f"read {path.name}: timed out"
            self._abandon(call, meta.key)
            raise TierError(f"disk tier {self.name!r}: read of {path} took over "
                            f"{self.timeout} s") from e
        except BaseException:
            # Cancelled from outside. When the read had run for the tier's whole timeout (the
            # engine bounds it with the same timeout, and its deadline comes a moment
            # first), the file hung just the same. A get's own earlier deadline (a read
            # straight into the caller's tensor runs in the get's scope) says nothing
            # about the file.
            hung = anyio.current_time() - started >= _HUNG_SHARE * self.timeout
            self._abandon(call, meta.key if hung else None)
            raise
        finally:
            self._reading.end(meta.key, call)
        return await self._settle(meta, lambda: path, obj)

    async def _settle(self, meta: ChunkMeta, path_of: Callable[[], Path], obj: Any) -> Any:
        """What a read that returned ``obj`` (from :meth:`_read_file`) gives its caller,
        counted: the object (or its size); None when absent (a name that held no regular
        file is removed first); a :class:`TierError` raised for a fault. ``path_of()`` is
        the file's path, asked only for a fault (made on the loop, a path costs a batch
        about 5 µs per chunk read)."""
        if _counted_read(self, obj):
            return obj
        path = path_of()
        if isinstance(obj, _NotAFile):
            # Removed under the key's lock, so that a write renaming a new file into place
            # at this moment cannot be the one removed.
            async with self._order.hold(meta.key):
                removed = await self._blocking(self._remove_not_file, path)
                if isinstance(removed, OSError):
                    self._c.read_faults += 1
                    self._c.last_error = f"read {path.name}: {removed}"
                    raise TierError(f"disk tier {self.name!r}: {path} is not a chunk file and "
                                    f"cannot be removed: {removed}") from removed
                self._names.pop(meta.key, None)
            self._c.read_misses += 1
            self._c.removed_not_files += removed
            return None
        if isinstance(obj, OSError):
            self._c.read_faults += 1
            self._c.last_error = f"read {path.name}: {obj}"
            raise TierError(f"disk tier {self.name!r}: cannot read {path}: {obj}") from obj
        self._c.read_misses += 1  # (obj is None: no file)
        self._names.pop(meta.key, None)
        return None

    def _abandon(self, call: _ThreadRead, hung_key: bytes | None) -> bool:
        """The caller stopped waiting for ``call``; returns whether its thread is still in the
        read. If so, it is counted in ``_stuck`` until it returns, and ``hung_key`` (when
        given, and no write replaced its file since) is quarantined: that file hung, so no
        other thread is handed to it. A read that had not started never will."""
        with self._tlock:
            if call.done:
                return False
            if not call.started:
                call.cancelled = True
                return False
            call.abandoned = True
            self._stuck += 1
            if call.out is not None:
                self._writers.append(call)
        if hung_key is not None and not call.superseded and hung_key not in self._quarantined:
            self._quarantined.add(hung_key)
            self._names.pop(hung_key, None)
            self._c.quarantined += 1
        return True

    def _read_file(self, path: Path, read: Callable[[Path], Any], call: _ThreadRead) -> Any:
        """``read(path)``: the file's bytes (or size); None if absent; _NOT_A_FILE if the name
        held something else (now removed); an OSError (returned, so the caller can count it)
        for any other fault."""
        with self._tlock:
            if call.cancelled:
                return None
            call.started = True
        try:
            return read(path)
        finally:
            with self._tlock:
                call.done = True
                if call.abandoned:
                    self._stuck -= 1

    @staticmethod
    def _read_regular(path: Path) -> bytes | OSError | _NotAFile | None:
        def whole(fd: int, _size: int) -> bytes:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()

        return _with_file(path, whole)

    @staticmethod
    def _read_regular_into(path: Path, fp: Fingerprint, meta: ChunkMeta, out: torch.Tensor,
                           on_block: Callable[[int, int], None] | None = None,
                           ) -> int | OSError | _NotAFile | None:
        def into(fd: int, size: int) -> int:
            read_chunk_into(fp, fd, size, out, expect=meta, on_block=on_block)
            return size

        return _with_file(path, into)

    @staticmethod
    def _remove_not_file(path: Path) -> OSError | bool:
        """Remove what is at ``path`` unless it is a regular file by now: whether something was
        removed, or the error if it cannot be (a folder, say: it stays a fault until someone
        removes it)."""
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                return True
        except FileNotFoundError:
            pass
        except OSError as e:
            return e
        return False

    async def delete(self, key: bytes) -> None:
        folder = self.root / key[:1].hex()
        async with self._order.hold(key):
            name = self._names.pop(key, None)
            self._quarantined.discard(key)
            try:
                await self._blocking(self._delete_files, folder, key, name)
            except OSError as e:
                self._c.last_error = f"delete {key.hex()}: {e}"
                raise TierError(f"disk tier {self.name!r}: cannot delete {key.hex()}: "
                                f"{e}") from e
        self._c.deletes += 1

    @staticmethod
    def _delete_files(folder: Path, key: bytes, name: str | None) -> None:
        if name is not None:
            names = [name]
        else:  # not written or scanned by us: find it by its key prefix
            prefix = key.hex() + "."
            try:
                names = [n for n in os.listdir(folder) if n.startswith(prefix)]
            except FileNotFoundError:
                return
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / n)

    # -- delete notes ---------------------------------------------------------------------

    async def write_delete_notes(self, notes: bytes | None) -> None:
        try:
            await self._blocking(_put_notes, self.root, notes)
        except OSError as e:
            self._c.last_error = f"delete notes: {e}"
            raise TierError(f"disk tier {self.name!r}: cannot write its delete notes: "
                            f"{e}") from e

    async def read_delete_notes(self) -> bytes | None:
        try:
            return await self._blocking(_get_notes, self.root)
        except OSError as e:
            self._c.last_error = f"delete notes: {e}"
            raise TierError(f"disk tier {self.name!r}: cannot read its delete notes: "
                            f"{e}") from e

    def stats(self) -> dict[str, Any]:
        return {**as_dict(self._c), "kind": self.kind, "files": len(self._names),
                "stuck_reads": self._stuck, "path": str(self._root or "")}

    def __repr__(self) -> str:
        return (f"DiskStore(name={self.name!r}, path={self.config.path!r}, "
                f"codec={self.codec!r}, capacity_bytes={self.capacity_bytes})")


def _put_notes(root: Path, notes: bytes | None) -> None:
    """Replace ``root``'s delete notes with ``notes`` (None: remove them), fsync'ed whatever
    the tier's policy: a note lost to a crash brings deleted prefixes back."""
    path = root / NOTES_FILE
    if notes is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        tmp = root / f"{NOTES_FILE}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(notes)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _get_notes(root: Path) -> bytes | None:
    for tmp in root.glob(f"{NOTES_FILE}.*.tmp"):  # a write a crash cut short
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    try:
        return (root / NOTES_FILE).read_bytes()
    except FileNotFoundError:
        return None


def _with_file(path: str | Path, use: Callable[[int, int], _T],
               ) -> _T | OSError | _NotAFile | None:
    """``use(fd, size)`` on the regular file at ``path``; None if absent, _NOT_A_FILE if
    the name holds something else, the OSError of any other fault. The codec's errors
    (a corrupt or foreign object) propagate."""
    try:
        # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever.
        # O_NOFOLLOW: we only ever write regular files, so a symlink is not ours.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            return e
        fd = -1  # a symlink
    try:
        if fd < 0:
            return _NOT_A_FILE
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _NOT_A_FILE
        got = use(fd, st.st_size)
        # Recency for the LRU order rebuilt after a restart (by the open file: no second
        # lookup of its path); losing it is harmless.
        with contextlib.suppress(OSError):
            os.utime(fd)
    except OSError as e:
        return e
    finally:
        if fd >= 0:
            os.close(fd)
    return got


def _read_file_to(path: str | Path, fingerprint: Fingerprint, meta: ChunkMeta,
                  copy: ChunkCopy) -> int | OSError | _NotAFile | None:
    """The chunk in the file at ``path`` read, verified and decoded straight into ``copy``'s
    runs (:func:`~musacache.codec.read_chunk_to`): its size, or what
    :func:`_with_file` returns for no file or a fault."""
    def to(fd: int, size: int) -> int:
        read_chunk_to(fingerprint, fd, size, copy, expect=meta)
        return size

    return _with_file(path, to)


def _counted_read(store: DiskStore, obj: Any) -> bool:
    """Whether ``obj``, what a read returned, is the chunk read (its bytes or size: not absent,
    not a fault); counted if so. The rest is :meth:`DiskStore._settle`'s."""
    if obj is None or isinstance(obj, (_NotAFile, OSError)):
        return False
    store._c.reads += 1
    return True


def _quarantined(store: DiskStore, path: Path) -> QuarantinedError:
    """The error of a read of a quarantined file (one whose read hung), counted."""
    store._c.read_faults += 1
    return QuarantinedError(f"disk tier {store.name!r}: {path} is quarantined (a read of it "
                            "hung); the engine deletes it")


def _stuck_all(store: DiskStore) -> bool:
    """Whether every thread the store may use is stuck in the file system (starting another
    one would only leak it too)."""
    return store._stuck >= store.max_concurrency


def _refusal(store: DiskStore, path: Path) -> TierError:
    """The error (counted) of a read of ``path`` refused because :func:`_stuck_all`."""
    store._c.read_faults += 1
    store._c.reads_refused += 1
    return TierError(f"disk tier {store.name!r}: {store._stuck} reads are stuck in "
                     f"{store.config.path}; not reading {path.name}")


class _BatchRead:
    """One batch of reads (:meth:`DiskStore.read_to_many`): ``(meta, copy)`` items read by
    up to ``max_concurrency`` lanes, each a worker thread that takes the next item as soon
    as it is done with one, so no event-loop turn, thread hand-off or token wait comes
    between the chunks of a request.

    Each read is bounded by the tier's ``timeout``, as a read alone is, not the batch by its
    length: a lane whose read outlives it (a hung file) is abandoned to its thread, the read
    counted as a timeout and the file quarantined, while the other lanes go on. When every
    lane is abandoned, or none has run a read for a whole ``timeout`` (they wait for
    tokens), the items not started are left untried (:data:`NOT_TRIED`).

    The lane threads and the loop share ``todo``, ``stop``, ``ended``, ``outcome``,
    ``began``, ``current``, ``dead``, ``judged`` and ``waited`` under the store's
    ``_tlock``; the rest is the loop's.
    """

    def __init__(self, store: DiskStore, items: Sequence[tuple[ChunkMeta, ChunkCopy]],
                 fingerprint: Fingerprint) -> None:
        self.store = store
        self.items = items
        self.fingerprint = fingerprint
        n = self.n = len(items)
        self.out: list[Any] = [NOT_TRIED] * n  # what each item gives the caller
        self.calls = [_ThreadRead() for _ in items]
        self.todo: deque[int] = deque()
        self.stop = False
        self.ended = 0
        self.outcome: list[Any] = [NOT_TRIED] * n  # what each read returned, in its lane
        self.began = [0.0] * n
        # Per lane: the item it is reading (None between items), whether it was abandoned.
        self.current: list[int | None] = []
        self.dead: list[bool] = []
        # How many reads ended, and how many of them waited on the disk (:meth:`judge`;
        # read when the batch ends, as the store's guess for the next one).
        self.judged = 0
        self.waited = 0
        # Per lane, what holds its token. What the batch waits for: each lane's slice on its
        # thread, or (when no token was free) its wait for a token, with the lane's number.
        self.borrowers: list[object] = []
        self.waits: dict[asyncio.Future[Any], int] = {}
        self.hung: set[int] = set()  # items whose read ran the whole timeout: quarantined
        self.cut: set[int] = set()  # items still being read when the batch ended: abandoned

    # -- what a read cost its thread ------------------------------------------------------

    def judge(self, wall: float, cpu: float, blocks: int) -> None:
        """Take what a read that ended cost its thread: ``blocks`` read from storage, or a
        thread that ran on a CPU for under a quarter of the read's time (a network file
        system reads no local blocks), say that it waited on the disk."""
        self.judged += 1
        if blocks > 0 or cpu < _IO_BOUND_SHARE * wall:
            self.waited += 1

    @property
    def io_bound(self) -> bool:
        """Most reads waited on the disk, which then wants more reads in flight; else the
        copy and decode are the work (a warm page cache), and lanes beyond the CPUs would
        only take turns on them. A majority, so that one read that lost its CPU for a while
        (another thread, the hypervisor) does not count as the disk."""
        return self.waited * 2 > self.judged

    # -- the batch, on the loop -------------------------------------------------------------

    async def run(self) -> list[Any]:
        """Per item what ``read_to`` returns or the exception it raises, or
        :data:`NOT_TRIED` for an item no lane started."""
        store = self.store
        for i, (meta, _copy) in enumerate(self.items):
            if meta.key in store._quarantined:
                self.out[i] = _quarantined(store, self.path_of(i))
            else:
                self.todo.append(i)
        if not self.todo:
            return self.out
        if _stuck_all(store):
            for i in self.todo:
                self.out[i] = _refusal(store, self.path_of(i))
            return self.out
        full = min(len(self.todo), store.max_concurrency - store._stuck)
        self.current = [None] * full
        self.dead = [False] * full
        self.borrowers = [object() for _ in range(full)]
        for i in self.todo:
            store._reading.begin(self.items[i][0].key, self.calls[i])
        try:
            await self._wait_for_lanes(full)
        finally:
            self._end(full)
        return await self._results()

    def path_of(self, i: int) -> Path:
        # Made where it is needed: in the lane that reads the file (not on the loop, where
        # a batch's paths would cost it per chunk), and for a fault's message.
        meta = self.items[i][0]
        return self.store._path(meta.key, meta.parent, meta.num_tokens)

    async def _wait_for_lanes(self, full: int) -> None:
        store, timeout = self.store, self.store.timeout
        # From a warm page cache each read is a copy and a decode: lanes past the CPUs would
        # only take turns on them. Reads that wait on the disk want every lane. The last
        # batch's reads tell which, and so do this one's: a lane that ends a slice of reads
        # that waited starts the others.
        count = full if store._reads_wait else min(full, devices.usable_cpus())
        # Every lane's first slice is on its thread here, at once, before any turn of the
        # loop: a lane started a turn later would end a batch of equal chunks that much later.
        for k in range(count):
            self._next_slice(k)
        started = count
        seen, progress = 0, time.monotonic()
        while self.waits:
            with store._tlock:
                running = [self.began[i] for k, i in enumerate(self.current)
                           if i is not None and not self.dead[k]]
                if self.ended != seen:
                    seen, progress = self.ended, time.monotonic()
            deadline = (min(running) if running else progress) + timeout
            done, _ = await asyncio.wait(self.waits,
                                         timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                k = self.waits.pop(fut)
                if not isinstance(fut, asyncio.Task):  # a slice ended: True, more to read
                    store._limiter.release_on_behalf_of(self.borrowers[k])
                    if fut.result():
                        self._next_slice(k)
                        while self.io_bound and started < full:
                            self._next_slice(started)
                            started += 1
                elif self.dead[k] or self.stop:  # a token, for a lane that is over
                    store._limiter.release_on_behalf_of(self.borrowers[k])
                else:
                    self._run_slice(k)
            if not done and self._watch(seen, progress):
                break

    def _watch(self, seen: int, progress: float) -> bool:
        """A deadline passed: abandon each lane whose read ran the whole timeout; True when
        the batch is stalled (no read ended in a timeout, and none runs)."""
        store, timeout = self.store, self.store.timeout
        now = time.monotonic()
        with store._tlock:
            late = [(k, i) for k, i in enumerate(self.current)
                    if i is not None and not self.dead[k]
                    and now - self.began[i] >= _HUNG_SHARE * timeout]
            for k, _i in late:
                self.dead[k] = True
            stalled = not late and self.ended == seen and not any(
                i is not None and not self.dead[k] for k, i in enumerate(self.current)) \
                and now - progress >= _HUNG_SHARE * timeout
            if stalled:
                self.stop = True
        for k, i in late:
            if store._abandon(self.calls[i], self.items[i][0].key):
                self.hung.add(i)
            self._drop(k)
        return stalled

    def _run_slice(self, k: int) -> None:
        # Lane k's next slice, on a thread from now, under the token it holds: given back
        # when the batch takes the slice's end, or once it abandons the slice (a hung disk
        # must not hold the caller past the timeout).
        store = self.store
        try:
            assert store._executor is not None, "the tier is started"
            self.waits[store._executor.submit(self._lane, k)] = k
        except BaseException:
            store._limiter.release_on_behalf_of(self.borrowers[k])
            raise

    def _next_slice(self, k: int) -> None:
        # Now if a token is free and no other work waits for one (first come, first served:
        # a long batch takes turns with the rest), else once one is.
        limiter = self.store._limiter
        try:
            limiter.acquire_on_behalf_of_nowait(self.borrowers[k])
        except anyio.WouldBlock:
            self.waits[asyncio.ensure_future(limiter.acquire_on_behalf_of(self.borrowers[k]))] = k
            return
        self._run_slice(k)

    def _drop(self, k: int) -> None:
        # Lane k is abandoned (its read hung) or the batch stops: not waited for any more,
        # and its token given back. A wait for a token that is cancelled gives back what it
        # was granted itself.
        limiter = self.store._limiter
        for fut in [f for f, lane_k in self.waits.items() if lane_k == k]:
            del self.waits[fut]
            if not isinstance(fut, asyncio.Task):
                fut.cancel()
                limiter.release_on_behalf_of(self.borrowers[k])
            elif not fut.cancel() and not fut.cancelled() and fut.exception() is None:
                limiter.release_on_behalf_of(self.borrowers[k])

    def _end(self, full: int) -> None:
        # Normal end, a stalled batch, or cancelled from outside: no lane takes another item,
        # the reads still running are abandoned to their threads, and every token the batch
        # holds or waits for is given back.
        store, calls = self.store, self.calls
        with store._tlock:
            self.stop = True
            begun = [i for i in range(self.n) if calls[i].started and not calls[i].done
                     and i not in self.hung]
        for k in range(full):
            self._drop(k)
        if self.hung or self.judged:
            store._reads_wait = bool(self.hung) or self.io_bound
        now = time.monotonic()
        self.cut = {i for i in begun if store._abandon(
            calls[i], self.items[i][0].key
            if now - self.began[i] >= _HUNG_SHARE * store.timeout else None)}
        for i in range(self.n):
            if self.out[i] is NOT_TRIED:  # every item registered in run
                store._reading.end(self.items[i][0].key, calls[i])

    async def _results(self) -> list[Any]:
        store = self.store
        for i in range(self.n):
            if self.out[i] is not NOT_TRIED or not self.calls[i].started:
                continue
            if i in self.hung or i in self.cut:
                store._c.read_faults += 1
                store._c.read_timeouts += 1
                store._c.last_error = f"read {self.path_of(i).name}: timed out"
                self.out[i] = TierTimeoutError(
                    f"disk tier {store.name!r}: a read of a batch took over {store.timeout} "
                    f"s; abandoned the read of {self.path_of(i)}")
                continue
            got = self.outcome[i]
            if isinstance(got, _Raised):
                self.out[i] = got.exc
                continue
            if _counted_read(store, got):  # the usual: no coroutine per chunk for it
                store._c.bytes_out += got
                self.out[i] = got
                continue
            try:  # absent (None), or a fault (raised)
                self.out[i] = await store._settle(self.items[i][0],
                                                  functools.partial(self.path_of, i), got)
            except TierError as exc:
                self.out[i] = exc
        return self.out

    # -- a lane, on its worker thread ---------------------------------------------------------

    def _lane(self, k: int) -> bool:
        """One slice of lane ``k``'s reads: it gives its token back after ``_LANE_SLICE``
        seconds, so that other work waiting for one (another get's batch, a write) takes
        turns with a long batch. True: more to read, in another slice."""
        store, items, calls = self.store, self.items, self.calls
        until = time.monotonic() + _LANE_SLICE
        reads = 0
        while True:
            with store._tlock:
                if self.stop or self.dead[k] or not self.todo:
                    return False
                if reads and time.monotonic() >= until:
                    return True
                reads += 1
                i = self.todo.popleft()
                calls[i].started = True
                self.began[i] = time.monotonic()
                self.current[k] = i
            got: Any
            wall, cpu, blocks = time.perf_counter(), time.thread_time(), _blocks_read()
            try:
                meta = items[i][0]
                got = _read_file_to(store._file(meta.key, meta.parent, meta.num_tokens),
                                    self.fingerprint, *items[i])
            except Exception as exc:  # the codec's: a corrupt or foreign object
                got = _Raised(exc)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            blocks = _blocks_read() - blocks
            with store._tlock:
                self.judge(wall, cpu, blocks)
                self.outcome[i] = got
                self.ended += 1
                self.current[k] = None
                calls[i].done = True
                if calls[i].abandoned:
                    store._stuck -= 1
