"""One connection of the node server, from its admission to its release, as a state machine.

The server makes a :class:`Peer` for each connection whose uid it admits. Its life::

    AWAITING_HELLO --hello begins--> GREETING --hello answered--> SERVING
          ^                              |
          +--------- hello failed -------+

    AWAITING_HELLO, GREETING, SERVING --end--> CLOSING --released--> CLOSED

The end is the peer's (EOF, a frame that breaks the stream, a limit that closes it), a timeout
(:meth:`Peer.overdue`) or the server's (the connection's task cancelled). Every transition is
in :data:`TRANSITIONS` and made by :meth:`Peer.happen`; what a state allows is checked where
a frame or a request meets it.

Frames come from the connection's reader callback (:meth:`Peer.on_frame`) and each request
runs in a task of the loop's own (:meth:`Peer.run`): the connection's task (:meth:`Peer.serve`)
only answers refused frames and, at the end, cancels what is in flight and gives back
everything the connection holds.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio
import torch

from musacache import ipc, transfer
from musacache._errors import (
    CacheUnavailableError,
    MusaCacheError,
    PermissionDeniedError,
    ProtocolError,
    ServerLimitError,
)
from musacache._executor import Executor, outlive
from musacache.cache import Cache
from musacache.ipc import _messages as msgs
from musacache.ipc import _wire as proto

if TYPE_CHECKING:
    from musacache.server import CacheKey, ServerConfig
    from musacache.stats import ServerCounters

log = logging.getLogger("musacache.server")

#: What a ``monitor: true`` connection may do: read counters, nothing else.
MONITOR_OPS: Final = frozenset({"hello", "stats"})

# Each fd a request brings may be held twice while it waits: itself, and the private
# duplicate the wait on a ready event takes (ipc._events).
FDS_PER_RECEIVED: Final = 2


class State(enum.Enum):
    """Where a connection is in its life (see the module's docstring)."""

    #: Connected: only ``hello`` is served, and ``hello_timeout`` runs.
    AWAITING_HELLO = "awaiting hello"
    #: A hello is being answered (its cache may take long to open): a second one is refused,
    #: and ``hello_timeout`` waits for its answer.
    GREETING = "greeting"
    #: Bound to a cache (or a monitor): its ops are served, and ``idle_timeout`` runs.
    SERVING = "serving"
    #: Ended: no frame is read and no request started; those in flight are cancelled.
    CLOSING = "closing"
    #: Everything the connection held is given back.
    CLOSED = "closed"


class Event(enum.Enum):
    """What moves a connection from one :class:`State` to the next."""

    HELLO = "a hello's handler starts"
    HELLO_FAILED = "that hello is answered with an error"
    HELLO_DONE = "that hello is answered: the connection has its cache"
    END = "the connection ends"
    RELEASE = "what it held is given back"


class Overdue(enum.Enum):
    """A timeout a connection ran past (it is closed), each counted apart."""

    FRAME = "frame timeout"
    HELLO = "hello timeout"
    IDLE = "idle timeout"


#: The states a connection reads frames and runs requests in.
OPEN: Final = frozenset({State.AWAITING_HELLO, State.GREETING, State.SERVING})
# Looked up once: an enum member read through its class costs more than the rest of the
# check, and every request makes it.
_SERVING: Final = State.SERVING

#: A frame whose body is larger is decoded (shape check, unpacking, the op's arguments) in
#: the server's executor: on the loop, a frame near max_frame_size takes tens of ms.
DEFER_ABOVE: Final = 256 * 1024

#: What the server may hold for each chunk or page a request names, beyond its frame: the
#: chunk's key and its place in the lists that plan the op. Counted against
#: ``max_request_bytes_per_peer`` before the op runs.
BYTES_PER_CHUNK: Final = 256

#: Every transition, by (state, event). A hello that ends once the connection is closing (or
#: released, by a server that closes meanwhile) changes nothing: the end stands.
TRANSITIONS: Final[Mapping[tuple[State, Event], State]] = {
    (State.AWAITING_HELLO, Event.HELLO): State.GREETING,
    (State.GREETING, Event.HELLO_FAILED): State.AWAITING_HELLO,
    (State.GREETING, Event.HELLO_DONE): State.SERVING,
    **{(s, Event.END): State.CLOSING for s in (*OPEN, State.CLOSING)},
    (State.CLOSED, Event.END): State.CLOSED,  # (the socket closed after the release)
    **{(s, e): s for s in (State.CLOSING, State.CLOSED)
       for e in (Event.HELLO_FAILED, Event.HELLO_DONE)},
    **{(s, Event.RELEASE): State.CLOSED for s in State},
}


@dataclass
class Usage:
    """What all connections together hold of the server's fds and memory, and the fds the
    requests in flight may hold (``fd_budget``)."""

    fd_budget: int
    staged: int = 0  # bytes of staging buffers (stage_bytes)
    partial: int = 0  # bytes of incomplete frames in the connections' decoders
    #: fds the requests in flight hold (each counted :data:`FDS_PER_RECEIVED` times)
    held_fds: int = 0
    #: fds the decoders hold for frames not whole yet (counted once each)
    parked_fds: int = 0


@dataclass
class Registration:
    pages: transfer.Pages
    imports: list[ipc.ImportedTensor]


#: An op's handler: the peer, the op's typed message and the request's fds (it takes the
#: ones it keeps out of the list).
Handler = Callable[["Peer", Any, list[int]], Awaitable[Any]]


class _Large:
    """A large frame on its way through :meth:`Peer.run`, which hands its parts (the
    received body, the request and its message) to the executor to let go of: unmapping
    them (128 MiB for a 16M-token lookup) took 4 to 8 ms of the loop's CPU."""

    __slots__ = ("parts",)

    def __init__(self, raw: proto.RawFrame) -> None:
        self.parts: list[Any] = [raw]


class Peer:
    """One connection: its state, what it holds (cache, mappings, events, registrations,
    kept buffers, staging), its counters against the per-connection limits, and the
    callbacks its :class:`~musacache.ipc._wire.Connection` delivers frames to."""

    def __init__(self, conn: proto.Connection, creds: proto.PeerCredentials,
                 config: ServerConfig, *, counters: ServerCounters, usage: Usage,
                 handlers: Mapping[str, Handler], on_close: Callable[[Peer], None],
                 executor: Executor) -> None:
        self.conn = conn
        self._executor = executor  # the server's: large frames are decoded there
        self.pid = creds.pid
        self.uid = creds.uid
        self.config = config
        self.counters = counters  # the server's own
        self.usage = usage  # the server's own
        self._handlers = handlers  # the server's own dict, looked up per request
        self._on_close = on_close  # the server forgets the peer (and its use of the cache)
        self.state = State.AWAITING_HELLO
        self.table = ipc.MappingTable(require_sealed=True, peer_pid=creds.pid)
        self.regs: dict[int, Registration] = {}
        self.next_reg = 1
        #: Client views kept mapped between requests, by the client's id (put/get ``buf``).
        self.buffers: dict[int, ipc.ImportedTensor] = {}
        self.staged: torch.Tensor | None = None
        #: Set by hello: the connection's cache and its key, or neither for a monitor.
        self.cache: Cache | None = None
        self.key: CacheKey | None = None
        self.monitor = False
        self.in_flight = 0
        self._max_requests = config.max_requests_per_peer  # (read per frame)
        self.held_fds = 0
        #: bytes the in-flight requests hold: their frames, and what they expand to
        self.request_bytes = 0
        #: mappings being opened (awaited in a worker thread): counted against the limits
        #: before they exist, so that registers running at once cannot all pass them
        self.opening = 0
        #: fds received whose frame is not whole yet, and bytes of an incomplete frame (since)
        self.parked_fds = 0
        self.partial = 0
        self.partial_since = 0.0
        loop = asyncio.get_running_loop()
        self._loop = loop
        #: the deadline of hello; bytes received when last seen, and since when no more came
        self.hello_due = loop.time() + config.hello_timeout
        self.seen = 0
        self.quiet_since = loop.time()
        self._ops: dict[asyncio.Task[None], list[int]] = {}  # each op's fds not yet closed
        self._refusals: collections.deque[tuple[int | None, MusaCacheError]] = \
            collections.deque()
        self._wake = asyncio.Event()
        self._tick = watch_interval(config)
        self._watcher: asyncio.TimerHandle | None = None

    # -- transitions ------------------------------------------------------------------------

    def happen(self, event: Event) -> None:
        """Move to the state that ``event`` leads to from this one (:data:`TRANSITIONS`)."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:  # a server bug: the callers check the state first
            raise RuntimeError(f"peer {self.pid}: {event.value} while {self.state.value}")
        self.state = new

    def begin_hello(self) -> None:
        """A hello's handler starts: refused unless the connection awaits one."""
        if self.state is not State.AWAITING_HELLO:
            raise ProtocolError("hello was already said on this connection")
        self.happen(Event.HELLO)

    def hello_failed(self) -> None:
        self.happen(Event.HELLO_FAILED)  # (hello_timeout runs on)

    def hello_done(self, cache: Cache | None, key: CacheKey | None) -> None:
        """The hello is answered: the connection serves ``cache`` (None: a monitor). Kept
        even once closing, so that the release gives the cache's use back."""
        self.cache, self.key, self.monitor = cache, key, cache is None
        self.happen(Event.HELLO_DONE)

    def _end(self) -> None:
        self.happen(Event.END)
        self.conn.pause_reading()  # (frames already read wait in the decoder, unanswered)
        self._wake.set()

    def release(self) -> None:
        """Give back what the connection holds of the server's fds, memory and mappings."""
        usage = self.usage
        usage.held_fds -= FDS_PER_RECEIVED * self.held_fds  # (of ops cancelled before a step)
        self.held_fds = 0
        usage.parked_fds -= self.parked_fds  # (closed with its decoder)
        self.parked_fds = 0
        usage.partial -= self.partial
        self.partial = 0
        self.regs.clear()
        self.buffers.clear()
        self.unstage()
        self.table.close_all()
        self.happen(Event.RELEASE)

    def unstage(self) -> None:
        if self.staged is not None:
            self.usage.staged -= self.staged.numel()
            self.staged = None

    # -- the connection's task --------------------------------------------------------------

    async def serve(self) -> None:
        """Serve the connection until it ends, then close it. Frames are taken from the
        connection's reader callback and each request gets a task of the loop's
        ``create_task``: a receiving task to wake per frame, or an anyio task group's
        ``start_soon``, would cost a small request most of its time. A refused frame pauses
        the reading until its answer is sent."""
        conn = self.conn
        self._watcher = self._loop.call_later(self._tick, self._watch)
        try:
            conn.start_reading(self.on_frame, self.on_end, on_fds=self.on_fds,
                               on_partial=self.on_partial)
            while self.state in OPEN:
                await self._wake.wait()
                self._wake.clear()
                while self._refusals:
                    rid, error = self._refusals.popleft()
                    try:
                        with anyio.move_on_after(1):
                            await conn.send_error(rid, error)
                    except (CacheUnavailableError, OSError):
                        break  # the peer is gone: on_end has been called
                if self.state in OPEN:
                    conn.resume_reading()
        finally:
            await self._close()

    async def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.state in OPEN:  # this task was cancelled: the server stops
            self._end()
        # The peer is gone (or broke the protocol, or the server stops): its in-flight ops
        # are cancelled, which releases their pins in the cache, and waited for.
        left = dict(self._ops)
        for task in left:
            task.cancel()
        # Waited for whatever cancels this task meanwhile: anyio's shield holds off its own
        # scopes only, and a plain cancel (asyncio.run's at shutdown, a second task.cancel())
        # landing here would skip the release below, keeping the peer's fds, its mapped
        # memory and its socket.
        came = await outlive(asyncio.gather(*left, return_exceptions=True)) if left else None
        for fds in left.values():
            # A task cancelled before its first step never ran its cleanup.
            ipc.close_fds(fds)
            fds.clear()
        self._on_close(self)
        await self.conn.aclose()  # (closes before it yields)
        if came is not None:
            try:
                raise came
            finally:
                del came  # (a local would keep its traceback in a cycle)

    # -- the connection's callbacks ---------------------------------------------------------

    def _refuse(self, rid: int | None, error: MusaCacheError) -> None:
        self._refusals.append((rid, error))
        self.conn.pause_reading()
        self._wake.set()

    def _fatal(self, error: MusaCacheError) -> MusaCacheError:
        """A limit that ends the connection, told to the peer first (typed, not a reset)."""
        self.counters.limited += 1
        try:
            self.conn.send_nowait(proto.encode_error(None, error))
        except (CacheUnavailableError, OSError):
            pass
        return error

    def _sync_parked(self) -> None:
        now = self.conn.pending_fds
        self.usage.parked_fds += now - self.parked_fds
        self.parked_fds = now

    def on_fds(self, n: int) -> None:
        """``n`` fds arrived ahead of their frame: they wait in the decoder, if there is
        room for them."""
        self._sync_parked()
        refused = parking_refused(n, self.usage.parked_fds, self.usage.fd_budget)
        if refused is not None:
            raise self._fatal(refused)
        self.parked_fds += n
        self.usage.parked_fds += n

    def on_partial(self, nbytes: int) -> None:
        """The decoder holds ``nbytes`` of an incomplete frame now."""
        usage = self.usage
        grown, self.partial = nbytes - self.partial, nbytes
        usage.partial += grown
        self.partial_since = (self.partial_since or self._loop.time()) if nbytes else 0.0
        most = self.config.max_buffered_bytes
        if grown > 0 and usage.staged + usage.partial > most:
            raise self._fatal(ServerLimitError(
                f"an incomplete frame of {nbytes} bytes would pass max_buffered_bytes="
                f"{most} (staging and incomplete frames together)"))

    def on_frame(self, frame: proto.Frame | proto.RawFrame | proto.FrameError) -> None:
        """A whole frame: a request is admitted (a task runs it) or refused at the door."""
        self.partial_since = 0.0  # (the next frame's clock: see overdue)
        if self.parked_fds:  # (fds that waited for their frame: taken now, or closed)
            self._sync_parked()
        if isinstance(frame, proto.Request):
            op, rid, size = frame.op, frame.id, frame.size
        elif isinstance(frame, proto.RawFrame):
            op, rid, size = "request", None, len(frame.body)
        else:
            self.counters.bad_frames += 1
            if isinstance(frame, proto.FrameError):
                log.info("bad frame from pid %d: %s", self.pid, frame)
                self._refuse(frame.request_id, frame)
            else:
                ipc.close_fds(frame.fds)
            return
        fds = list(frame.fds)
        nfds = len(fds)
        usage = self.usage
        if nfds or self.in_flight >= self._max_requests \
                or self.request_bytes + size > self.config.max_request_bytes_per_peer:
            # (else no limit can refuse it)
            limit = self._over_limit(op, nfds, size, usage.held_fds + usage.parked_fds)
            if limit is not None:
                ipc.close_fds(fds)
                self.counters.limited += 1
                self._refuse(rid, limit)
                return
        self.in_flight += 1
        self.held_fds += nfds
        self.request_bytes += size
        usage.held_fds += FDS_PER_RECEIVED * nfds
        work = _Large(frame) if isinstance(frame, proto.RawFrame) else frame
        self._ops[self._loop.create_task(self._dispatch(work, fds, size))] = fds

    def on_end(self, error: BaseException | None) -> None:
        """The connection ended (EOF, a frame that broke the stream, a lost peer, a limit
        raised by a hook, or its close)."""
        if isinstance(error, proto.FrameError):
            self.counters.bad_frames += 1
            log.info("bad frame from pid %d: %s", self.pid, error)
        elif error is not None and not isinstance(error, (MusaCacheError, OSError)):
            log.error("connection handler failed", exc_info=error)
        self._end()

    def _watch(self) -> None:
        if self.state not in OPEN:
            return
        why = self.overdue(self.conn.received, self._loop.time(), self.conn.reading_paused)
        if why is None:
            self._watcher = self._loop.call_later(self._tick, self._watch)
            return
        c = self.counters
        if why is Overdue.FRAME:
            c.frame_timeouts += 1
        elif why is Overdue.HELLO:
            c.hello_timeouts += 1
        else:
            c.idle_timeouts += 1
        log.info("closing pid %d: %s", self.pid, why.value)
        self._end()

    # -- limits -----------------------------------------------------------------------------

    def _over_limit(self, op: str, nfds: int, size: int,
                    held_fds: int) -> ServerLimitError | None:
        """Why a request (``op``, with ``nfds`` fds and a body of ``size`` bytes) is refused
        at the door, or None. ``held_fds``: what the requests in flight hold now, all
        connections together, against the server's fd budget."""
        cfg, fd_budget = self.config, self.usage.fd_budget
        if nfds and held_fds + FDS_PER_RECEIVED * nfds > fd_budget:
            return ServerLimitError(
                f"{op}: the server's requests in flight hold {held_fds} fds, and this one "
                f"would pass the {fd_budget} its open-file limit leaves them (RLIMIT_NOFILE; "
                f"raise it, e.g. LimitNOFILE= in systemd)")
        if self.in_flight >= cfg.max_requests_per_peer:
            return ServerLimitError(f"{op}: {self.in_flight} requests already in flight "
                                    f"on this connection (max_requests_per_peer="
                                    f"{cfg.max_requests_per_peer})")
        if self.held_fds + nfds > cfg.max_fds_per_peer:
            return ServerLimitError(f"{op}: this connection's requests would hold "
                                    f"{self.held_fds + nfds} fds (max_fds_per_peer="
                                    f"{cfg.max_fds_per_peer})")
        return self._over_bytes(op, size)

    def _over_bytes(self, op: str, more: int) -> ServerLimitError | None:
        most = self.config.max_request_bytes_per_peer
        if self.request_bytes + more <= most:
            return None
        return ServerLimitError(f"{op}: this connection's requests in flight hold "
                                f"{self.request_bytes} bytes, and this one needs {more} more "
                                f"(max_request_bytes_per_peer={most})")

    def _expansion(self, msg: Any) -> int:
        """What the server may hold, beyond the frame, for the chunks or pages ``msg``
        names (see :data:`BYTES_PER_CHUNK`)."""
        tokens = getattr(msg, "tokens", None)
        if tokens is not None:
            chunk = self.key[2] if self.key is not None else self.config.chunk_size
            return -(-len(tokens) // (4 * chunk)) * BYTES_PER_CHUNK
        keys = getattr(msg, "keys", None)
        return len(keys) * BYTES_PER_CHUNK if keys is not None else 0

    def overdue(self, received: int, now: float, paused: bool = False) -> Overdue | None:
        """The timeout the connection has run past (it is closed), or None.

        ``frame_timeout`` bounds the age of the frame being received (its clock restarts at
        each whole frame), not how long the connection has had some frame incomplete: a busy
        client's reads may end inside frames all the time. While the server reads nothing
        from the connection (``paused``: its turn went to others, a refusal is being
        answered) the frame's clock waits too."""
        cfg = self.config
        if self.partial_since and paused:
            self.partial_since = now
        if self.partial_since and now - self.partial_since >= cfg.frame_timeout:
            return Overdue.FRAME
        if self.state is State.AWAITING_HELLO:
            return Overdue.HELLO if now >= self.hello_due else None
        if self.state is State.GREETING:
            # Its cache may take long to open (a disk tier's scan, an S3 listing), and
            # closing would cancel that open every time: look again later.
            if now >= self.hello_due:
                self.hello_due = now + cfg.hello_timeout
            return None
        if received != self.seen or self.in_flight:
            self.seen, self.quiet_since = received, now
            return None
        # Said hello, then nothing: a silent connection would hold its slot for ever; the
        # client reconnects at its next call.
        return Overdue.IDLE if now - self.quiet_since >= cfg.idle_timeout else None

    # -- one request ------------------------------------------------------------------------

    async def _dispatch(self, frame: proto.Request | _Large, fds: list[int],
                        size: int) -> None:
        """Run one request; it leaves the connection's ops when it ends (no done callback:
        one more turn of the loop per request)."""
        try:
            await self.run(frame, fds)
        finally:
            self.request_bytes -= size
            self._ops.pop(asyncio.current_task(), None)  # type: ignore[arg-type]

    async def run(self, frame: proto.Request | _Large, fds: list[int]) -> None:
        """Run one request and answer it; ``fds`` are its fds (handlers take theirs out of
        the list; the rest are closed here, and the list emptied). A large frame is
        decoded in the server's executor first, and its buffers are let go of there. What
        the request expands to is counted against ``max_request_bytes_per_peer`` before its
        handler runs, until its reply is out."""
        self.counters.requests += 1
        held = len(fds)
        req = frame if type(frame) is proto.Request else None
        msg: Any = None
        more = 0
        # In flight until its reply is out, not only until it is made: a peer that never
        # reads its replies would otherwise have request after request admitted, each
        # holding its reply in a task (memory without bound). max_requests_per_peer
        # replies stuck behind a full socket then refuse the rest.
        try:
            try:
                try:
                    state = self.state
                    if state is not _SERVING and state not in OPEN:
                        # Admitted just before the connection ended: it goes with the rest
                        # of its ops, unstarted (the peer sees the connection close).
                        return
                    if req is None:
                        assert type(frame) is _Large
                        req, msg = await self._decode_raw(frame.parts.pop(), fds)
                    else:
                        msg = self._decode(req, held)
                    need = self._expansion(msg)
                    if need:
                        self._admit(req.op, need)
                        more = need
                        self.request_bytes += more
                    if req.op != "hello":
                        if state is not _SERVING:
                            raise ProtocolError(
                                "the first request on a connection must be hello")
                        if self.monitor and req.op not in MONITOR_OPS:
                            raise PermissionDeniedError(
                                f"{req.op}: a monitor connection may only read stats")
                    # decode_args admitted only known ops, each with its handler.
                    result = await self._handlers[req.op](self, msg, fds)
                finally:
                    ipc.close_fds(fds)  # whatever a handler did not take
                    fds.clear()
                    self.held_fds -= held
                    self.usage.held_fds -= FDS_PER_RECEIVED * held
            except MusaCacheError as e:
                # The peer's mistake (or a refused request): answered, never logged as a bug.
                self.counters.errors += 1
                await reply_error(self.conn, _request_id(req, e), e)
                return
            except Exception as e:  # a server bug: answer, log, keep serving everyone else
                self.counters.errors += 1
                log.exception("op %s failed", req.op if req is not None else "?")
                await reply_error(self.conn, _request_id(req, e), e)
                return
            await _send_result(self.conn, req, result, self.counters)
        finally:
            self.in_flight -= 1
            self.request_bytes -= more
            if type(frame) is _Large and not self._executor.closed:
                frame.parts += (req, msg)
                req = msg = None
                self._executor.submit(frame.parts.clear)

    def _admit(self, op: str, need: int) -> None:
        """Refuse a request whose expansion would take the connection past its budget.
        Raised from here, not kept in :meth:`run`'s frame: an error in a local of the frame
        its traceback holds is a cycle, and it kept the request's bytes (128 MiB for a
        refused 16M-token lookup) until the collector's next full pass."""
        over = self._over_bytes(op, need)
        if over is not None:
            try:
                raise over
            finally:
                del over

    def _decode(self, req: proto.Request, nfds: int) -> Any:
        return msgs.decode_args(req.op, req.args, nfds,
                                max_stage_bytes=self.config.max_stage_bytes)

    async def _decode_raw(self, raw: proto.RawFrame, fds: list[int],
                          ) -> tuple[proto.Request, Any]:
        """A large frame's request and its typed message, decoded in the server's executor.
        The message's error is raised with the request's id (``request_id``) on it."""
        def decode() -> tuple[proto.Request, Any]:
            req = self.conn.parse(raw)
            assert type(req) is proto.Request  # (the decoder expects only requests)
            try:
                return req, self._decode(req, len(fds))
            except MusaCacheError as e:  # the request's error: answered with its id
                e.request_id = req.id  # type: ignore[attr-defined]
                raise

        try:
            return await self._executor.run(decode)
        except proto.FrameError as e:
            fds.clear()  # (closed by the decoder)
            self.counters.bad_frames += 1
            log.info("bad frame from pid %d: %s", self.pid, e)
            raise


def _request_id(req: proto.Request | None, error: BaseException) -> int | None:
    if req is not None:
        return req.id
    rid = getattr(error, "request_id", None)
    return rid if isinstance(rid, int) else None


async def _send_result(conn: proto.Connection, req: proto.Request, result: Any,
                       counters: ServerCounters) -> None:
    """Answer ``req`` with ``result``. A result the wire cannot carry (nothing of it was
    sent: a server bug) is answered with its ProtocolError, or its caller would wait for
    ever."""
    try:
        await conn.send_reply(req.id, result)
    except (CacheUnavailableError, OSError):
        pass  # the peer went away; its cleanup runs when its connection ends
    except ProtocolError as e:
        counters.errors += 1
        log.error("op %s: cannot send its result: %s", req.op, e)
        await reply_error(conn, req.id, e)


async def reply_error(conn: proto.Connection, rid: int | None, e: BaseException) -> None:
    """Answer request ``rid`` with ``e``, unless the peer is gone or stuck (5 s)."""
    try:
        with anyio.move_on_after(5):
            await conn.send_error(rid, e)
    except (CacheUnavailableError, OSError):
        pass


def watch_interval(cfg: ServerConfig) -> float:
    """How often a connection's timeouts are checked (seconds)."""
    return min(1.0, max(0.01, min(cfg.hello_timeout, cfg.idle_timeout, cfg.frame_timeout) / 4))


def parking_refused(n: int, parked: int, fd_budget: int) -> ServerLimitError | None:
    """Why ``n`` more fds may not wait in a connection's decoder for their frame, or None.
    ``parked``: what all decoders hold now. They may hold half of ``fd_budget``, so that
    the requests in flight always have the other half: frames whose body never comes would
    otherwise hold every fd of the server. One connection's decoder holds at most one
    frame's fds (253) anyway."""
    if parked + n > fd_budget // 2:
        return ServerLimitError(f"incomplete frames of all connections would hold "
                                f"{parked + n} fds, more than half of the {fd_budget} the "
                                f"server's open-file limit leaves them (RLIMIT_NOFILE)")
    return None
