"""IPC building blocks of the node server: memory IPC and event IPC.

Memory IPC (zero copy):
    :func:`share` / :class:`ExportTable` on the exporter, :func:`open_tensor` /
    :class:`MappingTable` on the importer; :func:`empty_shared` / :func:`to_shared` for CPU
    memory that another process can map.
Event IPC ("the data is ready"):
    :class:`IpcEvent`, :func:`event_ipc_capability`.

The wire protocol and the Unix-socket plumbing that carries frames with file descriptors are
private (``ipc._wire``); ``docs/protocol.md`` describes the format and the fd/lifetime rules.
"""

from ._events import EventCapability, IpcEvent, event_ipc_capability
from ._memory import (
    DeviceKind,
    ExportTable,
    MappingKey,
    TensorHandle,
    close_fds,
    empty_shared,
    is_sealed,
    is_shareable,
    open_storage,
    open_tensor,
    rebuild_view,
    share,
    to_shared,
)
from ._table import ImportedTensor, MappingTable

__all__ = (
    "DeviceKind",
    "EventCapability",
    "ExportTable",
    "ImportedTensor",
    "IpcEvent",
    "MappingKey",
    "MappingTable",
    "TensorHandle",
    "close_fds",
    "empty_shared",
    "event_ipc_capability",
    "is_sealed",
    "is_shareable",
    "open_storage",
    "open_tensor",
    "rebuild_view",
    "share",
    "to_shared",
)
