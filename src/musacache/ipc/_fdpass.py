"""Unix-socket plumbing: bytes with attached file descriptors, peer credentials, and a framed
:class:`Connection` that speaks the protocol of :mod:`musacache.ipc._protocol`.

Everything here waits on the event loop's reader/writer (``anyio.wait_readable`` /
``wait_writable``) on non-blocking sockets; nothing polls and nothing blocks the loop.

File descriptor ownership: fds *sent* are borrowed (the kernel duplicates them into the
peer; the caller keeps and eventually closes its own). fds *received* are owned by the
receiver: whoever takes a frame's ``fds`` must close them or hand them to a function that
adopts them (``open_tensor``, ``IpcEvent.from_wire``, ``MappingTable``).
"""

from __future__ import annotations

import array
import errno
import os
import socket
import struct
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import anyio
import anyio.lowlevel

from .._errors import CacheUnavailableError, ProtocolError
from ._protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_FDS_PER_FRAME,
    Frame,
    FrameDecoder,
    FrameError,
    encode_error,
    encode_reply,
    encode_request,
)

__all__ = [
    "Connection",
    "PeerCredentials",
    "connect_unix",
    "peer_credentials",
    "recv_with_fds",
    "send_with_fds",
    "wait_fd_readable",
    "wait_fd_writable",
]

_INT_SIZE = array.array("i").itemsize
_RECV_CHUNK = 256 * 1024


# -- waiting on fds -------------------------------------------------------------------------


async def wait_fd_readable(fd: int | socket.socket) -> None:
    """Wait until ``fd`` is readable, through the event loop's reader (no polling).

    Raises ``anyio.ClosedResourceError`` if another task calls ``anyio.notify_closing`` on
    it, and ``anyio.BusyResourceError`` if another task already waits on the same fd number.
    """
    await anyio.wait_readable(fd)


async def wait_fd_writable(fd: int | socket.socket) -> None:
    """Wait until ``fd`` is writable, through the event loop's writer."""
    await anyio.wait_writable(fd)


# -- bytes + fds ------------------------------------------------------------------------------


async def send_with_fds(sock: socket.socket, data: bytes | memoryview,
                        fds: Sequence[int] = ()) -> None:
    """Send all of ``data`` on a non-blocking Unix stream socket, ``fds`` attached to its
    first byte. The fds stay the caller's. Raises CacheUnavailableError if the peer is gone.

    If cancelled after part of ``data`` went out, the stream is no longer at a message
    boundary; :class:`Connection` closes itself in that case.
    """
    if fds and not len(data):
        # A zero-byte stream send carries no ancillary data: the fds would vanish silently.
        raise ProtocolError("fds must be attached to at least one byte")
    if len(fds) > MAX_FDS_PER_FRAME:
        raise ProtocolError(f"cannot attach {len(fds)} fds to one message "
                            f"(the kernel allows {MAX_FDS_PER_FRAME})")
    view = memoryview(data).cast("B")
    ancillary = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
                 if fds else [])
    while True:
        try:
            sent = sock.sendmsg([view], ancillary)
        except BlockingIOError:
            await wait_fd_writable(sock)
            continue
        except OSError as exc:
            raise CacheUnavailableError(f"sending to the peer failed: {exc}") from exc
        # The fds went with the first sendmsg that sent at least one byte.
        ancillary = []
        view = view[sent:]
        if not view:
            return
        await anyio.lowlevel.checkpoint_if_cancelled()


async def recv_with_fds(sock: socket.socket, bufsize: int = _RECV_CHUNK,
                        max_fds: int = MAX_FDS_PER_FRAME) -> tuple[bytes, list[int]]:
    """Receive up to ``bufsize`` bytes and any fds that came with them.

    ``b""`` means the peer closed its end. Received fds are close-on-exec and owned by the
    caller. If the peer attached more than ``max_fds`` fds, the kernel drops the excess;
    this raises ProtocolError after closing the ones that did arrive.
    """
    anc_size = socket.CMSG_SPACE(max_fds * _INT_SIZE)
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(bufsize, anc_size, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            await wait_fd_readable(sock)
            continue
        except OSError as exc:
            raise CacheUnavailableError(f"receiving from the peer failed: {exc}") from exc
        fds = _fds_from_ancillary(ancdata)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"the peer attached more than {max_fds} fds to one message")
        return data, fds


def _fds_from_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _INT_SIZE])
    return list(fds)


# -- peers ------------------------------------------------------------------------------------


class PeerCredentials(NamedTuple):
    """The process at the other end of a Unix socket, as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected Unix socket. The kernel fills it in; it cannot be
    forged by the peer, so the server can authorise on ``uid``."""
    fmt = "3i"
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt))
    except OSError as exc:
        raise CacheUnavailableError(f"cannot read the peer's credentials: {exc}") from exc
    return PeerCredentials(*struct.unpack(fmt, raw))


async def connect_unix(path: str | os.PathLike[str]) -> socket.socket:
    """Connect a non-blocking Unix stream socket to ``path`` without blocking the loop.

    Raises CacheUnavailableError when nothing listens there.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        try:
            sock.connect(os.fspath(path))
        except BlockingIOError:
            # A full listen backlog makes a non-blocking connect pending; its result is
            # reported through SO_ERROR once the socket turns writable.
            await wait_fd_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err)) from None
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            raise CacheUnavailableError(f"no musacache server listens at {path}") from exc
        raise CacheUnavailableError(f"cannot connect to {path}: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


# -- framed connection ------------------------------------------------------------------------


class Connection:
    """Protocol frames (with their fds) over one connected Unix stream socket.

    Many requests may be in flight: any number of tasks may send concurrently (frames are
    never interleaved), and exactly one task should call :meth:`receive` in a loop and route
    replies by id. ``expect`` and ``ops`` configure the decoder (see :class:`FrameDecoder`).

    Errors: :meth:`receive` raises :class:`FrameError` (a ProtocolError) for a bad frame; if
    ``error.fatal`` the connection is unusable and should be closed, otherwise the server can
    reply with an error to ``error.request_id`` and keep reading. A peer that went away
    raises CacheUnavailableError. A send cancelled halfway closes the connection, because
    the peer would otherwise read a torn frame.
    """

    def __init__(self, sock: socket.socket, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 max_fds: int = MAX_FDS_PER_FRAME,
                 expect: Literal["any", "request", "reply"] = "any",
                 ops: Collection[str] | None = None) -> None:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ProtocolError("a Connection needs a connected AF_UNIX stream socket")
        sock.setblocking(False)
        self._sock = sock
        self._max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size=max_frame_size, max_fds=max_fds,
                                     expect=expect, ops=ops)
        self._send_lock = anyio.Lock()
        self._closed = False
        self._eof = False

    @classmethod
    async def connect(cls, path: str | os.PathLike[str], **options: Any) -> Connection:
        """Connect to a server's socket at ``path`` (see :func:`connect_unix`)."""
        return cls(await connect_unix(path), **options)

    @property
    def socket(self) -> socket.socket:
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_credentials(self) -> PeerCredentials:
        return peer_credentials(self._sock)

    # -- sending --------------------------------------------------------------------------

    async def send_frame(self, frame: bytes, fds: Sequence[int] = ()) -> None:
        """Send one encoded frame; ``fds`` must match the count in its header (borrowed)."""
        if self._closed:
            raise CacheUnavailableError("the connection is closed")
        async with self._send_lock:
            if self._closed:
                raise CacheUnavailableError("the connection is closed")
            sent_all = False
            try:
                await send_with_fds(self._sock, frame, fds)
                sent_all = True
            finally:
                if not sent_all:
                    # Part of a frame may be on the wire; nothing can follow it safely.
                    self._close_now()

    async def send_request(self, request_id: int, op: str, args: Mapping[str, Any] | None = None,
                           fds: Sequence[int] = ()) -> None:
        await self.send_frame(encode_request(request_id, op, args, nfds=len(fds),
                                             max_frame_size=self._max_frame_size), fds)

    async def send_reply(self, request_id: int, result: Any = None,
                         fds: Sequence[int] = ()) -> None:
        await self.send_frame(encode_reply(request_id, result, nfds=len(fds),
                                           max_frame_size=self._max_frame_size), fds)

    async def send_error(self, request_id: int | None, error: BaseException) -> None:
        """Reply with ``error`` mapped to the wire (see ``error_to_wire``)."""
        await self.send_frame(encode_error(request_id, error))

    # -- receiving ------------------------------------------------------------------------

    async def receive(self) -> Frame | None:
        """The next frame (a Request or a Reply, with its fds), or None at a clean EOF.

        Cancelling a pending receive loses nothing: buffered bytes and fds stay for the next
        call. EOF in the middle of a frame raises a fatal FrameError.
        """
        while True:
            if self._closed:
                raise CacheUnavailableError("the connection is closed")
            frame = self._decoder.next_frame()
            if frame is not None:
                return frame
            if self._eof:
                if self._decoder.buffered:
                    raise FrameError(f"the peer closed the connection in the middle of a frame "
                                     f"({self._decoder.buffered} bytes pending)", fatal=True)
                return None
            try:
                data, fds = await recv_with_fds(self._sock)
            except anyio.ClosedResourceError as exc:
                raise CacheUnavailableError("the connection was closed while receiving") from exc
            except ProtocolError as exc:
                raise FrameError(str(exc), fatal=True) from exc
            if data:
                self._decoder.feed(data, fds)
            else:
                for fd in fds:
                    os.close(fd)
                self._eof = True

    # -- closing --------------------------------------------------------------------------

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Wakes a task blocked in receive() on this socket before the fd number goes away.
            anyio.notify_closing(self._sock)
        except RuntimeError:
            pass  # no running event loop: nobody can be waiting
        self._sock.close()
        self._decoder.close()

    async def aclose(self) -> None:
        """Close the socket and every received fd nobody took (idempotent)."""
        self._close_now()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

