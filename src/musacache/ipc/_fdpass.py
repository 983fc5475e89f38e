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
import asyncio
import errno
import os
import socket
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
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
    RawFrame,
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
#: Reads of one reader callback: a large frame arriving fast is taken 1 MiB a turn of the
#: loop, not whole in one turn (epoll calls the reader again at the next turn).
_READS_PER_TURN = 4


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


def _ancillary(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    return ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            if fds else [])


def _send_now(sock: socket.socket, data: bytes, fds: Sequence[int]) -> int:
    """One non-blocking sendmsg of ``data`` with ``fds``: the bytes sent (0 if the socket
    is full). The fds go with the first byte, so they are sent whenever this returns > 0."""
    if len(fds) > MAX_FDS_PER_FRAME:
        raise ProtocolError(f"cannot attach {len(fds)} fds to one message "
                            f"(the kernel allows {MAX_FDS_PER_FRAME})")
    try:
        return sock.sendmsg([data], _ancillary(fds)) if fds else sock.send(data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise CacheUnavailableError(f"sending to the peer failed: {exc}") from exc


_ANC_SIZE = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * _INT_SIZE)


def _recv_now(sock: socket.socket) -> tuple[bytes, list[int]]:
    """:func:`recv_with_fds` without the wait: BlockingIOError when nothing is there."""
    try:
        data, ancdata, flags, _ = sock.recvmsg(_RECV_CHUNK, _ANC_SIZE, socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        raise
    except OSError as exc:
        raise CacheUnavailableError(f"receiving from the peer failed: {exc}") from exc
    fds = _fds_from_ancillary(ancdata) if ancdata else []
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"the peer attached more than {MAX_FDS_PER_FRAME} fds to one "
                            f"message")
    return data, fds


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


#: How long a connect retries while the server's listen backlog is full (seconds).
CONNECT_BACKLOG_WAIT = 10.0


async def connect_unix(path: str | os.PathLike[str]) -> socket.socket:
    """Connect a non-blocking Unix stream socket to ``path`` without blocking the loop.

    Raises CacheUnavailableError when nothing listens there, or when its listen backlog
    stays full for ``CONNECT_BACKLOG_WAIT`` seconds.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        # On a Unix stream socket, EAGAIN from a non-blocking connect means the listen
        # backlog is full and nothing happened (it is not a connect in progress, as on
        # TCP): try again, backing off, until the server has accepted some (a burst of
        # hundreds of workers starting at once). Waiting for "writable" instead returned
        # a socket that was never connected.
        delay = 0.001
        deadline = anyio.current_time() + CONNECT_BACKLOG_WAIT
        while True:
            try:
                sock.connect(os.fspath(path))
                break
            except BlockingIOError:
                if anyio.current_time() >= deadline:
                    raise OSError(errno.EAGAIN, "the server's listen backlog stayed full "
                                  f"for {CONNECT_BACKLOG_WAIT:g} s") from None
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.05)
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
                 ops: Collection[str] | None = None,
                 defer_above: int | None = None) -> None:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise ProtocolError("a Connection needs a connected AF_UNIX stream socket")
        sock.setblocking(False)
        self._sock = sock
        self._max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size=max_frame_size, max_fds=max_fds,
                                     expect=expect, ops=ops, defer_above=defer_above)
        self._send_lock = anyio.Lock()
        # The rest of a frame that send_nowait could only send in part: every other frame
        # waits for it (see send_nowait).
        self._tail: asyncio.Task[None] | None = None
        # Frames of send_soon waiting for the end of the loop's turn, and the tasks that send
        # them when the socket did not take them then.
        self._held: list[bytes] = []
        self._held_senders: set[asyncio.Task[None]] = set()
        self._read_waiter: asyncio.Future[None] | None = None
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._on_frame: Callable[[Frame | RawFrame | FrameError], None] | None = None
        self._paused = False
        self._on_end: Callable[[BaseException | None], None] | None = None
        self._closed = False
        self._eof = False
        self._on_fds: Callable[[int], None] | None = None
        self._on_partial: Callable[[int], None] | None = None
        self._partial = 0  # bytes of an incomplete frame last told to on_partial

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

    @property
    def received(self) -> int:
        """Bytes received on this connection so far."""
        return self._decoder.received

    @property
    def pending_fds(self) -> int:
        """fds received whose frames are not whole yet (held by the decoder)."""
        return self._decoder.pending_fds

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out as frames (0: the frame just delivered was
        the last one of the bytes read so far)."""
        decoder = self._decoder  # (FrameDecoder.buffered inline: a server asks per frame)
        return len(decoder._buf) - decoder._pos + decoder._big_have

    def peer_credentials(self) -> PeerCredentials:
        return peer_credentials(self._sock)

    # -- sending --------------------------------------------------------------------------

    async def send_frame(self, frame: bytes, fds: Sequence[int] = (), *,
                         timeout: float | None = None) -> None:
        """Send one encoded frame; ``fds`` must match the count in its header (borrowed).

        ``timeout``: the longest wait for room in the socket (TimeoutError, and the
        connection is closed if part of the frame went out)."""
        if self._closed:
            raise CacheUnavailableError("the connection is closed")
        if self._tail is not None:
            with anyio.fail_after(timeout):
                while self._tail is not None:
                    # (asyncio.wait: a cancelled sender leaves the tail task to finish)
                    await asyncio.wait((self._tail,))
            if self._closed:
                raise CacheUnavailableError("the connection is closed")
        if self._send_lock.locked():
            with anyio.fail_after(timeout):
                await self._send_locked(frame, fds)
            return
        # Nobody is in the middle of a frame: one sendmsg usually takes a whole small frame,
        # and then the send costs no wait (the lock alone is a trip through the loop).
        try:
            sent = _send_now(self._sock, frame, fds)
        except BaseException:
            self._close_now()
            raise
        if sent == len(frame):
            return
        if sent == 0:
            with anyio.fail_after(timeout):
                await self._send_locked(frame, fds)
            return
        # Part of the frame is out (its fds with it): the rest goes before any other frame.
        # No await since the lock was seen free, so it is still free and taken at once.
        sent_all = False
        try:
            with anyio.fail_after(timeout):
                async with self._send_lock:
                    await send_with_fds(self._sock, memoryview(frame)[sent:])
                    sent_all = True
        finally:
            if not sent_all:
                self._close_now()

    def send_nowait(self, frame: bytes) -> bool:
        """Send one encoded frame (no fds) from a callback, without awaiting: True when it
        is out, or its start is out and a task of the loop sends the rest before any other
        frame; False when nothing was sent (the socket is full or another send is under
        way): send it with :meth:`send_frame` instead."""
        if self._closed:
            raise CacheUnavailableError("the connection is closed")
        if self._tail is not None or self._send_lock.locked():
            return False
        try:
            sent = _send_now(self._sock, frame, ())
        except BaseException:
            self._close_now()
            raise
        if sent == len(frame):
            return True
        if sent == 0:
            return False
        # Part of the frame is out: until the task below has sent the rest (holding the
        # send lock once it runs), every send_frame waits for it and send_nowait refuses.
        self._tail = asyncio.get_running_loop().create_task(
            self._send_tail(memoryview(frame)[sent:]))
        return True

    def send_soon(self, frame: bytes) -> None:
        """Send one small encoded frame (no fds) at the end of this turn of the loop, in one
        send with every other frame queued in the same turn: 32 requests made together cost
        one syscall here and one read on the other side, not 32. Frames sent meanwhile with
        :meth:`send_frame` may go first (each frame is whole on the wire either way). A
        failure closes the connection (a reader then sees it end); nothing is raised here
        but CacheUnavailableError for a closed connection."""
        if self._closed:
            raise CacheUnavailableError("the connection is closed")
        self._held.append(frame)
        if len(self._held) == 1:
            asyncio.get_running_loop().call_soon(self._send_held)

    def _send_held(self) -> None:
        held = self._held
        if not held:
            return
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        if self._closed:
            return
        try:
            if self.send_nowait(data):
                return
        except (CacheUnavailableError, OSError):
            return  # send_nowait closed the connection
        task = asyncio.get_running_loop().create_task(self._send_held_later(data))
        self._held_senders.add(task)
        task.add_done_callback(self._held_senders.discard)

    async def _send_held_later(self, data: bytes) -> None:
        try:
            await self.send_frame(data)
        except (CacheUnavailableError, OSError):
            self._close_now()

    async def _send_tail(self, rest: memoryview) -> None:
        sent_all = False
        try:
            async with self._send_lock:
                await send_with_fds(self._sock, rest)
                sent_all = True
        except (CacheUnavailableError, OSError):
            pass  # the peer is gone: the connection is closed below
        finally:
            self._tail = None
            if not sent_all:
                self._close_now()

    async def _send_locked(self, frame: bytes, fds: Sequence[int]) -> None:
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
                           fds: Sequence[int] = (), *, timeout: float | None = None) -> None:
        await self.send_frame(encode_request(request_id, op, args, nfds=len(fds),
                                             max_frame_size=self._max_frame_size), fds,
                              timeout=timeout)

    async def send_reply(self, request_id: int, result: Any = None,
                         fds: Sequence[int] = ()) -> None:
        await self.send_frame(encode_reply(request_id, result, nfds=len(fds),
                                           max_frame_size=self._max_frame_size), fds)

    async def send_error(self, request_id: int | None, error: BaseException) -> None:
        """Reply with ``error`` mapped to the wire (see ``error_to_wire``)."""
        await self.send_frame(encode_error(request_id, error))

    # -- receiving ------------------------------------------------------------------------

    def parse(self, raw: RawFrame) -> Frame:
        """Decode a frame handed out undecoded (see ``defer_above``); any thread."""
        return self._decoder.parse(raw)

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
                if isinstance(frame, RawFrame):
                    return self._decoder.parse(frame)
                return frame
            if self._eof:
                if self._decoder.buffered:
                    raise FrameError(f"the peer closed the connection in the middle of a frame "
                                     f"({self._decoder.buffered} bytes pending)", fatal=True)
                return None
            try:
                data, fds = _recv_now(self._sock)
            except BlockingIOError:
                await self._wait_readable()
                continue
            except ProtocolError as exc:
                raise FrameError(str(exc), fatal=True) from exc
            if data:
                self._decoder.feed(data, fds)
            else:
                for fd in fds:
                    os.close(fd)
                self._eof = True

    def start_reading(self, on_frame: Callable[[Frame | RawFrame | FrameError], None],
                      on_end: Callable[[BaseException | None], None], *,
                      on_fds: Callable[[int], None] | None = None,
                      on_partial: Callable[[int], None] | None = None) -> None:
        """Deliver frames from the loop's reader callback instead of :meth:`receive`: each
        frame to ``on_frame`` as soon as its bytes are in, with no receiving task to wake
        in between. A frame that broke the protocol without breaking the stream comes as
        its (non-fatal) :class:`FrameError`. ``on_end`` is called once: with None at a clean
        EOF, with the error otherwise (a fatal bad frame, a lost peer, :meth:`aclose`);
        nothing is delivered after it. :meth:`pause_reading` stops the delivery (a server
        answering a refused frame reads no further meanwhile), :meth:`resume_reading`
        goes on. Use this or :meth:`receive`, never both.

        Hooks for a server that bounds what its peers make it hold: ``on_fds(n)`` is called
        before ``n`` received fds go to the decoder, which keeps them until their frame is
        whole; ``on_partial(nbytes)`` when the bytes of an incomplete frame held after a read
        change (0: none is held any more). Either may raise to end the connection (with
        that error; the fds are closed)."""
        if self._closed:
            raise CacheUnavailableError("the connection is closed")
        if self._read_waiter is not None or self._on_frame is not None:
            raise anyio.BusyResourceError("receiving")
        self._on_frame, self._on_end = on_frame, on_end
        self._on_fds, self._on_partial = on_fds, on_partial
        self._paused = False
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.fileno(), self._deliver)
        self._reader_loop = loop

    def pause_reading(self) -> None:
        """Deliver no more frames until :meth:`resume_reading` (see :meth:`start_reading`)."""
        if not self._paused:
            self._paused = True
            self._stop_reading()

    @property
    def reading_paused(self) -> bool:
        """Whether delivery is paused (:meth:`pause_reading`)."""
        return self._paused

    def resume_reading(self) -> None:
        if not self._paused or self._closed or self._on_frame is None:
            return
        self._paused = False
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.fileno(), self._deliver)
        self._reader_loop = loop
        loop.call_soon(self._resume)  # frames already received wait in the decoder

    def _resume(self) -> None:
        try:
            self._drain_frames()
        except Exception as exc:
            self._end(exc)

    def _deliver(self) -> None:
        # Called when the socket is readable; the decoder holds no whole frame then (every
        # one was handed out, or delivery is paused and this is not registered).
        try:
            for _ in range(_READS_PER_TURN):
                if self._on_frame is None or self._paused:
                    return
                data, fds = _recv_now(self._sock)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    if self._decoder.buffered:
                        raise FrameError(f"the peer closed the connection in the middle of a "
                                         f"frame ({self._decoder.buffered} bytes pending)",
                                         fatal=True)
                    self._end(None)
                    return
                if fds and self._on_fds is not None:
                    try:
                        self._on_fds(len(fds))
                    except BaseException:
                        for fd in fds:
                            os.close(fd)
                        raise
                self._decoder.feed(data, fds)
                if not self._drain_frames() or len(data) < _RECV_CHUNK:
                    # Paused, ended, or the socket is drained: no second recvmsg only to
                    # hear EAGAIN.
                    return
        except BlockingIOError:
            return
        except Exception as exc:  # the peer's (a bad frame, a reset) or a bug in on_frame
            self._end(exc)

    def _drain_frames(self) -> bool:
        """Hand out the frames in the decoder; False once delivery stopped or paused."""
        while self._on_frame is not None and not self._paused:
            try:
                frame: Frame | RawFrame | FrameError | None = self._decoder.next_frame()
            except FrameError as exc:
                if exc.fatal:
                    raise
                frame = exc
            if frame is None:
                if self._on_partial is not None:
                    decoder = self._decoder
                    left = decoder.buffered  # (the bytes of a partial frame)
                    if left or self._partial:
                        self._partial = left
                        self._on_partial(left)
                return True
            self._on_frame(frame)
        return False

    def _end(self, exc: BaseException | None) -> None:
        on_end, self._on_end, self._on_frame = self._on_end, None, None
        self._close_now()
        if on_end is not None:
            on_end(exc)

    async def _wait_readable(self) -> None:
        # The loop's reader callback stays registered while a receiver keeps waiting, and
        # resolves a plain future: anyio.wait_readable registers and unregisters the fd with
        # the selector on every wait, two of which are a large share of a small round trip.
        if self._read_waiter is not None:
            raise anyio.BusyResourceError("receiving")  # one task receives (see the class)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if self._reader_loop is not loop:
            if self._reader_loop is not None:
                self._reader_loop.remove_reader(self._sock.fileno())
            loop.add_reader(self._sock.fileno(), self._on_readable)
            self._reader_loop = loop
        self._read_waiter = waiter
        try:
            await waiter
        finally:
            self._read_waiter = None

    def _on_readable(self) -> None:
        waiter = self._read_waiter
        if waiter is None or waiter.done():
            # Nobody waits (the receiver is busy with a frame): stop watching until it waits
            # again, so the loop does not call this on every turn meanwhile.
            self._stop_reading()
            return
        waiter.set_result(None)

    def _stop_reading(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._sock.fileno())

    # -- closing --------------------------------------------------------------------------

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._tail is not None:
            self._tail.cancel()  # its socket is going away: it would wait for room forever
        for task in list(self._held_senders):
            task.cancel()
        self._held.clear()
        if self._on_end is not None:
            on_end, self._on_end, self._on_frame = self._on_end, None, None
            on_end(CacheUnavailableError("the connection was closed"))
        waiter, self._read_waiter = self._read_waiter, None
        if waiter is not None and not waiter.done():
            # Wake a task blocked in receive() before the fd number goes away.
            waiter.set_exception(CacheUnavailableError(
                "the connection was closed while receiving"))
        self._sock.close()
        self._decoder.close()

    def close(self) -> None:
        """:meth:`aclose` without the await (from a callback)."""
        self._close_now()

    async def aclose(self) -> None:
        """Close the socket and every received fd nobody took (idempotent)."""
        self._close_now()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

