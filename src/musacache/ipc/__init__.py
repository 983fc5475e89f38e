"""IPC building blocks of the node server: memory IPC, event IPC, the wire protocol and the
Unix-socket plumbing that carries frames with file descriptors.

Memory IPC (zero copy):
    :func:`share` / :class:`ExportTable` on the exporter, :func:`open_tensor` /
    :class:`MappingTable` on the importer; :func:`empty_shared` / :func:`to_shared` for CPU
    memory that another process can map.
Event IPC ("the data is ready"):
    :class:`IpcEvent`, :func:`event_ipc_capability`.
Protocol and transport:
    :class:`FrameDecoder`, ``encode_*``, :func:`error_to_wire` / :func:`error_from_wire`,
    :class:`Connection`, :func:`peer_credentials`, :func:`send_with_fds` /
    :func:`recv_with_fds`.

See ``docs/protocol.md`` for the wire format and the fd/lifetime rules.
"""

from ._events import EventCapability, IpcEvent, event_ipc_capability
from ._fdpass import (
    Connection,
    PeerCredentials,
    connect_unix,
    peer_credentials,
    recv_with_fds,
    send_with_fds,
    wait_fd_readable,
    wait_fd_writable,
)
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
from ._protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    MAGIC,
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    Reply,
    Request,
    encode_error,
    encode_frame,
    encode_reply,
    encode_request,
    error_from_wire,
    error_to_wire,
)
from ._table import ImportedTensor, MappingTable

__all__ = (
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FDS_PER_FRAME",
    "PROTOCOL_VERSION",
    "Connection",
    "DeviceKind",
    "EventCapability",
    "ExportTable",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "ImportedTensor",
    "IpcEvent",
    "MappingKey",
    "MappingTable",
    "PeerCredentials",
    "Reply",
    "Request",
    "TensorHandle",
    "close_fds",
    "connect_unix",
    "empty_shared",
    "encode_error",
    "encode_frame",
    "encode_reply",
    "encode_request",
    "error_from_wire",
    "error_to_wire",
    "event_ipc_capability",
    "is_sealed",
    "is_shareable",
    "open_storage",
    "open_tensor",
    "peer_credentials",
    "rebuild_view",
    "recv_with_fds",
    "send_with_fds",
    "share",
    "to_shared",
    "wait_fd_readable",
    "wait_fd_writable",
)
