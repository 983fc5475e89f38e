"""The node-server wire protocol, without I/O: frame encoding, an incremental decoder, and
the mapping of exceptions to and from the wire. See ``docs/protocol.md``.

A frame is an 8-byte header and a msgpack body::

    offset  size  field
    0       2     magic b"MK"
    2       1     protocol version (PROTOCOL_VERSION)
    3       1     number of file descriptors attached to this frame (0..253)
    4       4     body length in bytes, big-endian (<= the receiver's max_frame_size)
    8       n     msgpack map: a request {id, op, args} or a reply {id, result} / {id, error}

Dense tensor data never travels in frames: it is shared through memory IPC, so frames are
small metadata and the size limit protects the receiver, not the throughput.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgpack

from .. import _errors
from .._errors import MusaCacheError, ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FDS_PER_FRAME",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "Reply",
    "Request",
    "encode_error",
    "encode_reply",
    "encode_request",
    "pack",
    "error_from_wire",
    "error_to_wire",
]

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"MK"
_HEADER: Final = struct.Struct(">2sBBI")
HEADER_SIZE: Final = _HEADER.size
DEFAULT_MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
#: The kernel's limit of fds per sendmsg (SCM_MAX_FD); one frame is sent by one sendmsg.
MAX_FDS_PER_FRAME: Final = 253
_MAX_BODY_LENGTH: Final = (1 << 32) - 1
_MAX_REQUEST_ID: Final = (1 << 64) - 1
_MAX_OP_LENGTH: Final = 128
#: What one frame body may unpack to. msgpack turns each byte of an 8 MiB body of empty
#: arrays into a Python list (~70x the bytes); these bounds keep a frame's objects, nesting and
#: container lengths to what the real ops need (a registration of 512 handles is ~18k objects),
#: and the walk that checks them to a few milliseconds of the loop per frame.
MAX_OBJECTS: Final = 1 << 15
MAX_DEPTH: Final = 16
MAX_CONTAINER_LEN: Final = 1 << 16

# msgpack lead bytes -> (length-field size, extra bytes) of str/bin/ext; fixed-size scalars.
_VARLEN: Final = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXTLEN: Final = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXED: Final = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4,
                 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5,
                 0xD7: 9, 0xD8: 17}


class FrameError(ProtocolError):
    """A frame broke the protocol.

    ``fatal``: the byte stream can no longer be trusted (bad magic or version, oversized
    length, fds that do not match), so the connection must be closed. Otherwise the frame
    was cut out cleanly and the connection can go on; ``request_id`` (when the bad frame
    had a readable one) is the id to send an error reply to. Travels as ``ProtocolError``.
    """

    def __init__(self, message: str, *, fatal: bool, request_id: int | None = None) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """A call: ``op`` with ``args``; the reply carries the same ``id``. ``fds`` are owned by
    whoever takes the frame."""

    id: int
    op: str
    args: dict[str, Any]
    fds: tuple[int, ...] = field(default=(), repr=False)
    #: bytes of the frame's body, as received (0 for a request made locally)
    size: int = field(default=0, repr=False, compare=False)


@dataclass(frozen=True)
class RawFrame:
    """A whole frame whose body is not decoded yet: a body larger than the decoder's
    ``defer_above``, for its taker to decode off the event loop with
    :meth:`FrameDecoder.parse`. ``fds`` are owned by whoever takes the frame."""

    body: bytes | bytearray | memoryview | Received
    fds: tuple[int, ...] = field(default=(), repr=False)


class Received:
    """The body of a large frame as the reads brought it: a list of their bytes, kept as
    they came (growing one buffer to 64 MiB copied it over and over on the loop), joined
    by :meth:`gather`, in the thread that decodes it."""

    __slots__ = ("_parts", "_size", "_skip")

    def __init__(self, parts: list[bytes], skip: int, size: int) -> None:
        self._parts = parts  # the first starts with ``skip`` bytes of the header
        self._skip = skip
        self._size = size

    def __len__(self) -> int:
        return self._size

    def gather(self) -> bytearray:
        """The body in one buffer; each part is let go of once copied (so the two copies
        never both exist whole). Once only."""
        out = bytearray(self._size)
        at, skip = 0, self._skip
        parts, self._parts = self._parts, []
        parts.reverse()
        with memoryview(out) as view:
            while parts:
                part = parts.pop()
                n = len(part) - skip
                view[at:at + n] = memoryview(part)[skip:]
                at, skip = at + n, 0
                del part
        return out


@dataclass(frozen=True)
class Reply:
    """The answer to request ``id``: a ``result``, or an ``error`` ``{type, message}``.

    ``id`` is None only for an error about a frame whose id could not be read.
    """

    id: int | None
    result: Any = None
    error: dict[str, str] | None = None
    fds: tuple[int, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Any:
        """The result, or the remote error re-raised as its musacache type."""
        if self.error is not None:
            raise error_from_wire(self.error)
        return self.result


Frame = Request | Reply


def _new_reply(request_id: int | None, result: Any, error: dict[str, str] | None,
               fds: tuple[int, ...], _new: Any = object.__new__) -> Reply:
    """``Reply(...)`` without the frozen dataclass's ``__init__``: its four
    ``object.__setattr__`` calls were 0.6 µs of a small frame's decoding. (The decoder
    builds the usual request and reply inline, without even this call.)"""
    frame = _new(Reply)
    d = frame.__dict__
    d["id"] = request_id
    d["result"] = result
    d["error"] = error
    d["fds"] = fds
    return frame


# -- errors on the wire ---------------------------------------------------------------------

_ERROR_TYPES: Final[dict[str, type[MusaCacheError]]] = {
    name: cls
    for name in _errors.__all__
    if isinstance(cls := getattr(_errors, name), type) and issubclass(cls, MusaCacheError)
}


def error_to_wire(exc: BaseException) -> dict[str, str]:
    """``{"type", "message"}`` for ``exc``: the nearest musacache error class it derives from.

    A foreign exception (a server bug) travels as ``MusaCacheError`` with its own type name in
    the message, so the client still gets an exception from the musacache tree.
    """
    for cls in type(exc).__mro__:
        if _ERROR_TYPES.get(cls.__name__) is cls:
            return {"type": cls.__name__, "message": str(exc)}
    return {"type": "MusaCacheError", "message": f"{type(exc).__name__}: {exc}"}


def error_from_wire(wire: Any) -> MusaCacheError:
    """The exception an error dict describes (not raised). Unknown types -> MusaCacheError."""
    if (not isinstance(wire, Mapping) or type(wire.get("type")) is not str
            or type(wire.get("message")) is not str):
        return ProtocolError(f"malformed error in reply: {wire!r:.200}")
    name, message = wire["type"], wire["message"]
    cls = _ERROR_TYPES.get(name)
    if cls is None:
        return MusaCacheError(f"{name}: {message}")
    return cls(message)


# -- encoding -------------------------------------------------------------------------------

# msgpack.packb makes a Packer, and with it a 1 MiB buffer, for every call: half of the
# packing of a small frame. One Packer per thread is reused instead. Packer.pack runs in C
# from start to end for what the protocol sends (no ``default`` hook calls back into Python,
# nothing it allocates is tracked by the garbage collector), so a thread never re-enters it.
_packers = threading.local()


def _packer() -> msgpack.Packer:
    try:
        packer: msgpack.Packer = _packers.packer
        return packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
        return packer


def pack(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)``, with this thread's reused Packer. Raises
    ProtocolError for what msgpack cannot encode."""
    try:
        return _packer().pack(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode frame body: {exc}") from exc


# The header and the start of a body up to and with the request id, in one pack: the id in
# each of msgpack's shortest forms of an unsigned int (fixint, uint8/16/32/64), as packb
# writes them. ``lead`` is the map's lead byte and its first key, "id".
_HEAD_ID: Final = (
    (0x80, struct.Struct(">2sBBI4sB"), None),
    (0x100, struct.Struct(">2sBBI4sBB"), 0xCC),
    (0x10000, struct.Struct(">2sBBI4sBH"), 0xCD),
    (0x100000000, struct.Struct(">2sBBI4sBI"), 0xCE),
    (1 << 64, struct.Struct(">2sBBI4sBQ"), 0xCF),
)


def _framed_with_id(lead: bytes, request_id: int, rest: bytes, nfds: int,
                    max_frame_size: int) -> bytes:
    """Header + ``lead`` + the packed ``request_id`` + ``rest`` (the rest of the body)."""
    for bound, form, code in _HEAD_ID:
        if request_id < bound:
            length = form.size - HEADER_SIZE + len(rest)
            if length > max_frame_size or length > _MAX_BODY_LENGTH:
                raise ProtocolError(f"frame body of {length} bytes exceeds the limit of "
                                    f"{max_frame_size}; dense data belongs in shared memory")
            if code is None:
                return form.pack(MAGIC, PROTOCOL_VERSION, nfds, length, lead,
                                 request_id) + rest
            return form.pack(MAGIC, PROTOCOL_VERSION, nfds, length, lead, code,
                             request_id) + rest
    raise ProtocolError(f"a request id must be an int in [0, 2**64), got {request_id!r}")


def _check_request_id(request_id: object) -> None:
    if type(request_id) is not int or not 0 <= request_id <= _MAX_REQUEST_ID:
        raise ProtocolError(f"a request id must be an int in [0, 2**64), got {request_id!r}")


def _check_nfds(nfds: object) -> None:
    if type(nfds) is not int or not 0 <= nfds <= MAX_FDS_PER_FRAME:
        raise ProtocolError(f"a frame carries 0..{MAX_FDS_PER_FRAME} fds, got {nfds!r}")


def _framed(payload: bytes, nfds: int, max_frame_size: int) -> bytes:
    if len(payload) > max_frame_size or len(payload) > _MAX_BODY_LENGTH:
        raise ProtocolError(f"frame body of {len(payload)} bytes exceeds the limit of "
                            f"{max_frame_size}; dense data belongs in shared memory")
    return _HEADER.pack(MAGIC, PROTOCOL_VERSION, nfds, len(payload)) + payload


def encode_frame(body: Mapping[str, Any], *, nfds: int = 0,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Header + msgpack ``body``. Raises ProtocolError if it cannot be encoded or is too big."""
    _check_nfds(nfds)
    return _framed(pack(body), nfds, max_frame_size)


# The packed map of a request up to its id, and from its id up to its args, per op: a request
# is {"id": id, "op": op, "args": args} packed in that order, which is what packb writes for
# that dict (a map of three, each key and value in turn).
_REQUEST_HEAD: Final = b"\x83\xa2id"
_request_ops: dict[str, bytes] = {}
_MAX_CACHED_OPS: Final = 64


def _op_part(op: object) -> bytes:
    part = _request_ops.get(op) if type(op) is str else None
    if part is not None:
        return part
    if type(op) is not str or not 0 < len(op) <= _MAX_OP_LENGTH:
        raise ProtocolError(f"an op is a non-empty string of at most {_MAX_OP_LENGTH} "
                            f"characters, got {op!r:.200}")
    part = b"\xa2op" + pack(op) + b"\xa4args"
    if len(_request_ops) < _MAX_CACHED_OPS:
        _request_ops[op] = part
    return part


def encode_request(request_id: int, op: str, args: Mapping[str, Any] | None = None, *,
                   nfds: int = 0, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """A request frame. ``nfds`` fds must be sent with it (see ``Connection.send_frame``).

    Byte for byte ``encode_frame({"id": ..., "op": ..., "args": ...})``; only ``args`` is
    packed per call (the rest is the op's cached prefix and the id)."""
    if type(request_id) is not int or not 0 <= request_id <= _MAX_REQUEST_ID:
        _check_request_id(request_id)  # (raises)
    part = _request_ops.get(op) if type(op) is str else None
    if part is None:
        part = _op_part(op)
    if nfds:
        _check_nfds(nfds)
    body = {} if args is None else args if type(args) is dict else dict(args)
    try:
        packed = _packers.packer.pack(body)
    except AttributeError:  # this thread's first frame
        packed = pack(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode frame body: {exc}") from exc
    return _framed_with_id(_REQUEST_HEAD, request_id, part + packed, nfds, max_frame_size)


_REPLY_HEAD: Final = b"\x82\xa2id"
_RESULT_KEY: Final = b"\xa6result"


def encode_reply(request_id: int, result: Any = None, *, nfds: int = 0,
                 max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """A successful reply frame to ``request_id``."""
    if type(request_id) is not int or not 0 <= request_id <= _MAX_REQUEST_ID:
        _check_request_id(request_id)  # (raises)
    if nfds:
        _check_nfds(nfds)
    try:
        packed = _packers.packer.pack(result)
    except AttributeError:  # this thread's first frame
        packed = pack(result)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode frame body: {exc}") from exc
    return _framed_with_id(_REPLY_HEAD, request_id, _RESULT_KEY + packed, nfds, max_frame_size)


def encode_error(request_id: int | None, exc: BaseException) -> bytes:
    """An error reply frame (``request_id`` None: the failing frame's id was unreadable)."""
    if request_id is not None:
        _check_request_id(request_id)
    return encode_frame({"id": request_id, "error": error_to_wire(exc)})


# -- decoding -------------------------------------------------------------------------------


@dataclass
class _FdBatch:
    """fds that arrived with the stream bytes [start, end).

    The kernel attaches fds to the first byte of the sendmsg that carried them and ends a
    read right after that message, so they belong to the last frame starting in the batch.
    """

    start: int
    end: int
    fds: list[int]


def check_body_shape(body: bytes | bytearray | memoryview, *, max_objects: int = MAX_OBJECTS,
                     max_depth: int = MAX_DEPTH,
                     max_container_len: int = MAX_CONTAINER_LEN) -> None:
    """Refuse a msgpack body that would unpack to too many objects, too deep a nesting, or
    too long an array or map, before anything is built from it (a recoverable FrameError).

    It walks the encoding without building objects (str/bin payloads are skipped, not
    read), so its cost is bounded by ``max_objects`` however the body was crafted.
    """
    data = memoryview(body).cast("B")
    n = len(data)
    pos = 0
    count = 0
    open_items: list[int] = []  # items still expected by each open array/map

    def fail(why: str) -> FrameError:
        return FrameError(f"frame body refused: {why}", fatal=False)

    def length(size: int) -> int:
        nonlocal pos
        if pos + size > n:
            raise fail("truncated")
        value = int.from_bytes(data[pos:pos + size], "big")
        pos += size
        return value

    while True:
        if pos >= n:
            raise fail("truncated")
        lead = data[pos]
        pos += 1
        count += 1
        if count > max_objects:
            raise fail(f"more than {max_objects} msgpack objects")
        items = 0
        if lead <= 0x7F or lead >= 0xE0:
            pass
        elif lead <= 0x8F:
            items = 2 * (lead & 0x0F)
        elif lead <= 0x9F:
            items = lead & 0x0F
        elif lead <= 0xBF:
            pos += lead & 0x1F
        elif lead in _FIXED:
            pos += _FIXED[lead]
        elif lead in _VARLEN:
            size = length(_VARLEN[lead])  # (length() moves pos past the length field)
            pos += size
        elif lead in _EXTLEN:
            size = length(_EXTLEN[lead])
            pos += size + 1
        elif lead in (0xDC, 0xDD):
            items = length(2 if lead == 0xDC else 4)
            if items > max_container_len:
                raise fail(f"an array of {items} items (limit {max_container_len})")
        elif lead in (0xDE, 0xDF):
            pairs = length(2 if lead == 0xDE else 4)
            if pairs > max_container_len:
                raise fail(f"a map of {pairs} entries (limit {max_container_len})")
            items = 2 * pairs
        else:
            raise fail(f"invalid msgpack byte 0x{lead:02x}")
        if pos > n:
            raise fail("truncated")
        if items:
            if len(open_items) >= max_depth:
                raise fail(f"nested deeper than {max_depth}")
            open_items.append(items)
            continue
        # One item is complete: close every container it completes.
        while open_items:
            open_items[-1] -= 1
            if open_items[-1]:
                break
            open_items.pop()
        if not open_items:
            break
    if pos != n:
        raise fail(f"{n - pos} bytes after the body")


#: A body this small unpacks to at most this many objects (each takes a byte at least), so it
#: is unpacked first and only its nesting checked, on the objects: the walk of the encoding
#: in check_body_shape costs more than the whole unpacking of a typical request.
_SMALL_BODY: Final = 512


# The lead bytes of msgpack containers (fixmap, fixarray, array 16/32, map 16/32), and the
# table that deletes every other byte: a body holding at most MAX_DEPTH such bytes cannot
# nest deeper (each level is a container, and each container has its own lead byte), so the
# walk of the unpacked objects is skipped for it with one C call.
_CONTAINER_LEADS: Final = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_CONTAINER_LEADS: Final = bytes(b for b in range(256) if b not in _CONTAINER_LEADS)


def _nested_deeper(obj: object, limit: int) -> bool:
    """Whether containers in ``obj`` nest deeper than ``limit`` (an empty one opens no
    level, as in check_body_shape)."""
    stack: list[tuple[object, int]] = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        items: Any = value.values() if type(value) is dict else value
        if not items:
            continue
        depth += 1
        if depth > limit:
            return True
        stack.extend((v, depth) for v in items if type(v) is dict or type(v) is list)
    return False


_unpackb: Final = msgpack.unpackb
_new: Final = object.__new__


def _bad(request_id: int | None, message: str) -> FrameError:
    """A recoverable FrameError about a frame whose id (if readable) is ``request_id``."""
    return FrameError(message, fatal=False, request_id=request_id)


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension types are not part of the protocol (type {code})")


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FrameDecoder:
    """Incremental frame decoder: feed it bytes (and fds) as they arrive, take whole frames.

    Handles partial reads and many frames per read; memory grows only with bytes actually
    received, never with a declared length (an oversized length is refused from its header).
    Every failure is a :class:`FrameError`; a fatal one is sticky.

    * ``expect``: ``"request"`` for a server, ``"reply"`` for a client, ``"any"`` for both.
    * ``ops``: the known ops; a request for another op is a recoverable FrameError.
    * ``defer_above``: a body of more bytes comes out as a :class:`RawFrame`, undecoded, so
      that the work that grows with it (shape check, unpacking) need not run in the reader's
      callback on the loop. :meth:`parse` decodes it, in any thread.

    fds fed in are owned by the decoder until handed out in a frame; :meth:`close` (and any
    failure) closes the ones it still holds.
    """

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                 max_fds: int = MAX_FDS_PER_FRAME,
                 expect: Literal["any", "request", "reply"] = "any",
                 ops: Collection[str] | None = None,
                 defer_above: int | None = None) -> None:
        if not 0 < max_frame_size <= _MAX_BODY_LENGTH:
            raise ValueError(f"max_frame_size must be in (0, 2**32), got {max_frame_size}")
        if not 0 <= max_fds <= MAX_FDS_PER_FRAME:
            raise ValueError(f"max_fds must be in [0, {MAX_FDS_PER_FRAME}], got {max_fds}")
        if expect not in ("any", "request", "reply"):
            raise ValueError(f"expect must be 'any', 'request' or 'reply', got {expect!r}")
        self.max_frame_size = max_frame_size
        self.max_fds = max_fds
        self.expect = expect
        self.ops = frozenset(ops) if ops is not None else None
        self.defer_above = _MAX_BODY_LENGTH if defer_above is None else defer_above
        self._buf = bytearray()
        self._pos = 0
        self._base = 0  # stream offset of _buf[0]
        # A large frame being received: its reads as they came, where it starts in the
        # stream, how many bytes it has and needs, and the fds its header declared.
        self._big: list[bytes] | None = None
        self._big_start = self._big_have = self._big_need = self._big_nfds = 0
        self._batches: deque[_FdBatch] = deque()
        self._failure: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos + self._big_have

    @property
    def pending_fds(self) -> int:
        """fds fed in whose frames are not whole yet."""
        if not self._batches:
            return 0
        return sum(len(batch.fds) for batch in self._batches)

    @property
    def received(self) -> int:
        """Bytes fed in so far."""
        return self._base + len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> None:
        """Append received bytes and the fds that came with them (adopted by the decoder)."""
        if self._failure is not None:
            _close_all(fds)
            raise self._failure
        if fds and not len(data):
            _close_all(fds)
            raise self._fail("fds arrived without data")
        if self._big is not None:
            self._feed_big(data, fds)
            return
        if self._pos:
            del self._buf[: self._pos]
            self._base += self._pos
            self._pos = 0
        start = self._base + len(self._buf)
        self._buf += data
        if fds:
            self._batches.append(_FdBatch(start, start + len(data), list(fds)))
            if self.pending_fds > self.max_fds:
                raise self._fail(f"the peer sent more than {self.max_fds} fds ahead of "
                                 f"their frames")

    def _feed_big(self, data: bytes | bytearray | memoryview, fds: Sequence[int]) -> None:
        start = self._base  # (the large frame's bytes so far end here)
        take = min(len(data), self._big_need - self._big_have)
        assert self._big is not None
        self._big.append(bytes(data) if take == len(data) else bytes(data[:take]))
        self._big_have += take
        self._base += take
        if take < len(data):
            self._buf += data[take:]  # (the frames after it)
        if fds:
            self._batches.append(_FdBatch(start, start + len(data), list(fds)))
            if self.pending_fds > self.max_fds:
                raise self._fail(f"the peer sent more than {self.max_fds} fds ahead of "
                                 f"their frames")

    def _big_frame(self) -> RawFrame | None:
        """The large frame being received, once whole."""
        if self._big_have < self._big_need:
            return None
        parts, self._big = self._big, None
        assert parts is not None
        start, end, nfds = self._big_start, self._big_start + self._big_need, self._big_nfds
        self._big_have = 0
        if self._batches and self._batches[0].end <= (end if not nfds else start):
            raise self._fail("fds arrived with a frame that declared none")
        fds = self._claim_fds(start, nfds) if nfds else ()
        return RawFrame(Received(parts, HEADER_SIZE, self._big_need - HEADER_SIZE), fds)

    def next_frame(self) -> Frame | RawFrame | None:
        """The next complete frame, or None until more bytes arrive."""
        if self._failure is not None:
            raise self._failure
        if self._big is not None:
            return self._big_frame()
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available < HEADER_SIZE:
            if available == 0:
                return None
            seen = min(available, len(MAGIC))
            if buf[pos:pos + seen] != MAGIC[:seen]:
                raise self._fail("bad frame magic: the peer does not speak the musacache "
                                 "protocol")
            return None
        magic, version, nfds, length = _HEADER.unpack_from(buf, pos)
        if (magic != MAGIC or version != PROTOCOL_VERSION or length > self.max_frame_size
                or nfds > self.max_fds):
            raise self._bad_header(magic, version, nfds, length)
        end = pos + HEADER_SIZE + length
        # The fds of a batch belong to the last frame that starts in it: a frame declaring
        # none that covers the batch's end is that frame (its fds were held
        # until the peer went away, outside every limit).
        if self._batches and self._batches[0].end <= self._base + (end if not nfds else pos):
            raise self._fail("fds arrived with a frame that declared none")
        if end > len(buf):
            if length > self.defer_above:
                # Kept as the reads bring it from here, not grown into this buffer.
                self._big = [bytes(memoryview(buf)[pos:])]
                self._big_start, self._big_have = self._base + pos, len(buf) - pos
                self._big_need, self._big_nfds = HEADER_SIZE + length, nfds
                self._base += len(buf)
                self._buf, self._pos = bytearray(), 0
            return None
        fds = self._claim_fds(self._base + pos, nfds) if nfds else ()
        if length > self.defer_above:
            # The body stays where it was received (a view of the old buffer, no copy on
            # the loop); the new buffer starts with what followed it.
            self._buf = buf[end:]
            self._base += end
            self._pos = 0
            return RawFrame(memoryview(buf)[pos + HEADER_SIZE:end], fds)
        if length <= _SMALL_BODY:
            body: bytes | bytearray = buf[pos + HEADER_SIZE:end]  # (one copy of a few bytes)
        else:
            # One copy out of the receive buffer (slicing the bytearray first would make two).
            with memoryview(buf) as view:
                body = bytes(view[pos + HEADER_SIZE:end])
        self._pos = end
        try:
            return self._parse_body(body, fds)
        except FrameError:
            _close_all(fds)
            raise

    def parse(self, raw: RawFrame) -> Frame:
        """Decode a :class:`RawFrame` as :meth:`next_frame` would have (its fds are closed if
        that fails). Reads only the decoder's settings, so any thread may call it."""
        body = raw.body.gather() if isinstance(raw.body, Received) else raw.body
        try:
            return self._parse_body(body, raw.fds)
        except FrameError:
            _close_all(raw.fds)
            raise

    def _bad_header(self, magic: bytes, version: int, nfds: int, length: int) -> FrameError:
        if magic != MAGIC:
            return self._fail("bad frame magic: the peer does not speak the musacache protocol")
        if version != PROTOCOL_VERSION:
            return self._fail(f"the peer speaks protocol version {version}, this side speaks "
                              f"{PROTOCOL_VERSION}")
        if length > self.max_frame_size:
            return self._fail(f"frame of {length} bytes exceeds the limit of "
                              f"{self.max_frame_size}")
        return self._fail(f"frame declares {nfds} fds, the limit is {self.max_fds}")

    def _claim_fds(self, frame_start: int, nfds: int) -> tuple[int, ...]:
        if nfds == 0:
            return ()
        batch = self._batches[0] if self._batches else None
        if batch is None or not batch.start <= frame_start < batch.end:
            raise self._fail(f"frame declares {nfds} fds but none arrived with it")
        if len(batch.fds) != nfds:
            raise self._fail(f"frame declares {nfds} fds but {len(batch.fds)} arrived with it")
        self._batches.popleft()
        return tuple(batch.fds)

    def _parse_body(self, body: bytes | bytearray | memoryview, fds: tuple[int, ...]) -> Frame:
        small = len(body) <= _SMALL_BODY
        if not small:
            check_body_shape(body)
        try:
            obj = _unpackb(body, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                           max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN,
                           max_ext_len=0)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as exc:
            raise FrameError(f"undecodable frame body: {exc}", fatal=False) from None
        if type(obj) is not dict:  # (unpackb makes plain dicts)
            raise FrameError(f"a frame body must be a map, got {type(obj).__name__}",
                             fatal=False)
        if (small and not isinstance(body, memoryview)
                and len(body.translate(None, _NOT_CONTAINER_LEADS)) > MAX_DEPTH
                and _nested_deeper(obj, MAX_DEPTH)):
            raise FrameError(f"frame body refused: nested deeper than {MAX_DEPTH}", fatal=False)
        raw_id = obj.get("id")
        readable_id = (raw_id if type(raw_id) is int and 0 <= raw_id <= _MAX_REQUEST_ID
                       else None)
        if "op" in obj:
            if "result" in obj or "error" in obj:
                raise _bad(readable_id, "a frame is either a request or a reply, not both")
            if self.expect == "reply":
                raise _bad(readable_id, "got a request where only replies are expected")
            if readable_id is None:
                raise _bad(None, f"a request needs an int id in [0, 2**64), got {raw_id!r:.100}")
            op = obj["op"]
            if type(op) is not str or not 0 < len(op) <= _MAX_OP_LENGTH:
                raise _bad(readable_id, f"malformed op {op!r:.100}")
            if self.ops is not None and op not in self.ops:
                raise _bad(readable_id, f"unknown op {op!r}")
            args = obj.get("args", {})
            if args is None:
                args = {}
            elif type(args) is not dict:
                raise _bad(readable_id, f"args must be a map, got {type(args).__name__}")
            # (Request(...) without the frozen dataclass's __init__, see _new_reply)
            frame = _new(Request)
            d = frame.__dict__
            d["id"] = readable_id
            d["op"] = op
            d["args"] = args
            d["fds"] = fds
            d["size"] = len(body)
            return frame
        if "result" in obj or "error" in obj:
            if self.expect == "request":
                raise _bad(readable_id, "got a reply where only requests are expected")
            error = obj.get("error")
            if error is None and "error" not in obj:
                if raw_id is None or readable_id is None:
                    raise _bad(readable_id,
                               "a successful reply needs the id of its request" if raw_id is None
                               else f"malformed reply id {raw_id!r:.100}")
                # (Reply(...) without the frozen dataclass's __init__, see _new_reply)
                reply = _new(Reply)
                d = reply.__dict__
                d["id"] = readable_id
                d["result"] = obj["result"]
                d["error"] = None
                d["fds"] = fds
                return reply
            if "result" in obj:
                raise _bad(readable_id, "a reply has either a result or an error, not both")
            if raw_id is not None and readable_id is None:
                raise _bad(readable_id, f"malformed reply id {raw_id!r:.100}")
            if not (type(error) is dict and type(error.get("type")) is str
                    and type(error.get("message")) is str):
                raise _bad(readable_id, f"malformed error in reply: {error!r:.200}")
            return _new_reply(readable_id, None, error, fds)
        raise _bad(readable_id, "a frame needs an 'op' (request) or a 'result'/'error' (reply)")

    def _fail(self, message: str) -> FrameError:
        self._failure = FrameError(message, fatal=True)
        self.close()
        return self._failure

    def close(self) -> None:
        """Close every fd not handed out in a frame and drop buffered bytes (idempotent).

        The decoder is unusable afterwards."""
        if self._failure is None:
            self._failure = FrameError("the frame decoder was closed", fatal=True)
        while self._batches:
            _close_all(self._batches.popleft().fds)
        self._buf = bytearray()
        self._pos = 0
        self._big, self._big_have = None, 0
