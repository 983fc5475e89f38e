"""Importer-side bookkeeping of one peer: every mapping and event it handed us, closed at once.

The node server keeps one :class:`MappingTable` per connection. When the peer unregisters
memory, the matching :class:`ImportedTensor` is closed; when it disconnects or dies, the
server calls :meth:`MappingTable.close_all` and nothing of that peer stays mapped or open.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from .._errors import IPCError
from ._events import IpcEvent
from ._memory import MappingKey, TensorHandle, close_fds, open_storage, rebuild_view

__all__ = ["ImportedTensor", "MappingTable"]


@dataclass
class _Mapping:
    storage: torch.UntypedStorage
    refs: int


class ImportedTensor:
    """One opened view of a peer's memory. :meth:`close` gives it back to its table.

    After close, :attr:`tensor` raises: the table no longer vouches for the memory. The
    mapping itself is unmapped only once no tensor uses it, so a view still held elsewhere
    stays valid (never a dangling pointer), but it keeps the memory mapped.
    """

    def __init__(self, table: MappingTable, key: MappingKey, handle: TensorHandle,
                 tensor: torch.Tensor) -> None:
        self._table = table
        self._tensor: torch.Tensor | None = tensor
        self.key = key
        self.handle = handle

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise IPCError("this imported tensor was closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        """Release this view (idempotent)."""
        if self._tensor is not None:
            self._tensor = None
            self._table._release(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ImportedTensor {state} {self.handle.device_kind} {self.handle.shape}>"


class MappingTable:
    """Every mapping and event opened on behalf of one peer, reference-counted.

    * Opening the same storage twice maps it once; the mapping is released when the last
      :class:`ImportedTensor` on it is closed (and no other tensor uses its memory).
    * Events imported with :meth:`open_event` are closed by :meth:`close_all` too.
    * Counters (:attr:`open_mappings`, :attr:`open_imports`, :attr:`open_events`,
      :attr:`open_fds`) feed server stats and leak tests.

    ``require_sealed=True`` refuses CPU memory the peer could still shrink under us (a later
    access would be SIGBUS); the node server always sets it. ``peer_pid`` is the peer's pid
    from SO_PEERCRED: a device handle claiming this process's pid from another peer is
    refused. See :func:`musacache.ipc.open_storage`. Not thread-safe: use it from one event loop.
    """

    def __init__(self, *, require_sealed: bool = False, peer_pid: int | None = None) -> None:
        self.require_sealed = require_sealed
        self.peer_pid = peer_pid
        self._mappings: dict[MappingKey, _Mapping] = {}
        self._imports: set[ImportedTensor] = set()
        self._events: set[IpcEvent] = set()
        self._closed = False

    # -- tensors ----------------------------------------------------------------------------

    def open_tensor(self, handle: TensorHandle, fds: Sequence[int] = ()) -> ImportedTensor:
        """Map ``handle`` (reusing this table's mapping of the same storage) and rebuild its view.

        Takes ownership of ``fds``. Fast for CPU memory; opening GPU memory can take
        milliseconds, so the server should prefer :meth:`aopen_tensor`.
        """
        self._check_open(fds)
        key, storage = open_storage(handle, fds, require_sealed=self.require_sealed,
                                    peer_pid=self.peer_pid)
        return self._adopt(key, storage, handle)

    async def aopen_tensor(self, handle: TensorHandle,
                           fds: Sequence[int] = ()) -> ImportedTensor:
        """:meth:`open_tensor` with the mapping done in a worker thread (driver calls block)."""
        self._check_open(fds)
        started = False

        def open_in_thread() -> tuple[MappingKey, torch.UntypedStorage]:
            nonlocal started
            started = True
            return open_storage(handle, fds, require_sealed=self.require_sealed,
                                peer_pid=self.peer_pid)

        try:
            key, storage = await anyio.to_thread.run_sync(open_in_thread)
        except BaseException:
            # Cancelled before the thread ran: nobody adopted the fds yet. (Once it runs,
            # open_storage closes them itself, and the thread is always waited for.)
            if not started:
                close_fds(fds)
            raise
        if self._closed:
            raise IPCError("the mapping table was closed while the tensor was being opened")
        return self._adopt(key, storage, handle)

    def _check_open(self, fds: Sequence[int]) -> None:
        if self._closed:
            close_fds(fds)
            raise IPCError("the mapping table is closed (its peer went away)")

    def _adopt(self, key: MappingKey, storage: torch.UntypedStorage,
               handle: TensorHandle) -> ImportedTensor:
        mapping = self._mappings.get(key)
        if mapping is None:
            mapping = self._mappings[key] = _Mapping(storage, 0)
        # A duplicate storage object is dropped here; it shares the one mapping anyway.
        view = rebuild_view(mapping.storage, handle)
        mapping.refs += 1
        imported = ImportedTensor(self, key, handle, view)
        self._imports.add(imported)
        return imported

    def _release(self, imported: ImportedTensor) -> None:
        self._imports.discard(imported)
        mapping = self._mappings.get(imported.key)
        if mapping is None:
            return
        mapping.refs -= 1
        if mapping.refs <= 0:
            del self._mappings[imported.key]

    # -- events -----------------------------------------------------------------------------

    def open_event(self, wire: Mapping[str, Any], fds: Sequence[int] = ()) -> IpcEvent:
        """Import a peer's event (:meth:`IpcEvent.from_wire`) and track it. Takes ``fds``."""
        self._check_open(fds)
        event = IpcEvent.from_wire(wire, fds)
        self._events.add(event)
        return event

    def close_event(self, event: IpcEvent) -> None:
        """Close one event opened by :meth:`open_event` (idempotent)."""
        self._events.discard(event)
        event.close()

    # -- lifetime ---------------------------------------------------------------------------

    def close_all(self) -> None:
        """Release every mapping and close every event of this peer. The table stays usable
        for stats; further opens raise IPCError."""
        self._closed = True
        for imported in list(self._imports):
            imported.close()
        for event in list(self._events):
            self.close_event(event)
        self._mappings.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_mappings(self) -> int:
        """Distinct storages this table holds mapped."""
        return len(self._mappings)

    @property
    def open_imports(self) -> int:
        """Open :class:`ImportedTensor` views (several may share one mapping)."""
        return len(self._imports)

    @property
    def open_events(self) -> int:
        return len(self._events)

    @property
    def open_fds(self) -> int:
        """File descriptors this table holds open (mapped memory needs none once mapped)."""
        return sum(1 for event in self._events if event.fileno() is not None)

    def stats(self) -> dict[str, int]:
        return {"open_mappings": self.open_mappings, "open_imports": self.open_imports,
                "open_events": self.open_events, "open_fds": self.open_fds}
