"""The wire protocol and its Unix-socket transport, in one private namespace.

The server and the client speak it; users do not. Its format is in ``docs/protocol.md``.
"""

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
from ._protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    MAGIC,
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    RawFrame,
    Reply,
    Request,
    encode_error,
    encode_frame,
    encode_reply,
    encode_request,
    error_from_wire,
    error_to_wire,
)

__all__ = (
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FDS_PER_FRAME",
    "PROTOCOL_VERSION",
    "Connection",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "PeerCredentials",
    "RawFrame",
    "Reply",
    "Request",
    "connect_unix",
    "encode_error",
    "encode_frame",
    "encode_reply",
    "encode_request",
    "error_from_wire",
    "error_to_wire",
    "peer_credentials",
    "recv_with_fds",
    "send_with_fds",
    "wait_fd_readable",
    "wait_fd_writable",
)
