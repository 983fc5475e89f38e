"""Typed request messages of the node server: op arguments decoded and checked before use.

A frame's ``args`` is whatever msgpack produced from bytes a peer chose. Each op's arguments
are decoded here into a frozen dataclass, so a handler only ever sees well-formed values:
a wrong type, a missing field, a number out of range, or fds that do not match the handles
all raise :class:`~musacache.ProtocolError` (a malformed request is the peer's fault, not a
server bug, and is answered without a traceback in the server log).

fds: every message says how many fds its handles and events claim (:attr:`nfds`); the
decoder refuses a frame whose fd count differs, so no handler can pop an fd that was not
sent, and :meth:`take_fds` hands each handle exactly its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._errors import ProtocolError
from ._memory import TensorHandle

__all__ = [
    "DenseMessage",
    "EmptyMessage",
    "EventWire",
    "HelloMessage",
    "PagedMessage",
    "PrefetchMessage",
    "PutStagedMessage",
    "RegisterMessage",
    "StageBytesMessage",
    "TokensMessage",
    "UnregisterMessage",
    "decode_args",
    "take_fds",
]

#: Handles one registration may name (layers x 2 for the sglang pair layout, with room).
MAX_HANDLES: Final = 512
#: Tokens one request may name (int32 each): 16 M tokens is far past any context length.
MAX_TOKENS: Final = 1 << 24
_MAX_NAME: Final = 1024


def _get(args: Mapping[str, Any], op: str, name: str, kind: type | tuple[type, ...],
         *, optional: bool = False) -> Any:
    if name not in args or args[name] is None:
        if optional:
            return None
        raise ProtocolError(f"{op}: missing argument {name!r}")
    value = args[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass: True is never a valid count, id or size.
    if type(value) not in kinds:
        names = " or ".join(k.__name__ for k in kinds)
        raise ProtocolError(f"{op}: {name!r} must be {names}, got {type(value).__name__}")
    return value


def _int(args: Mapping[str, Any], op: str, name: str, lo: int, hi: int,
         *, default: int | None = None) -> int:
    value = _get(args, op, name, int, optional=default is not None)
    if value is None:
        return int(default)  # type: ignore[arg-type]
    if not lo <= value <= hi:
        raise ProtocolError(f"{op}: {name!r} must be in [{lo}, {hi}], got {value}")
    return int(value)


def _tokens(args: Mapping[str, Any], op: str) -> bytes:
    raw = _get(args, op, "tokens", bytes)
    if len(raw) % 4 or len(raw) // 4 > MAX_TOKENS:
        raise ProtocolError(f"{op}: tokens must be little-endian int32 bytes "
                            f"(at most {MAX_TOKENS} tokens)")
    return raw


@dataclass(frozen=True)
class EventWire:
    """A peer's exported event, checked for shape (opened later by the MappingTable)."""

    wire: Mapping[str, Any]
    nfds: int

    @classmethod
    def decode(cls, args: Mapping[str, Any], op: str, name: str) -> EventWire | None:
        wire = _get(args, op, name, dict, optional=True)
        if wire is None:
            return None
        mode = wire.get("mode")
        if mode == "host":
            nfds = wire.get("nfds")
            if type(nfds) is not int or nfds != 1:
                raise ProtocolError(f"{op}: a host event {name!r} carries exactly one fd")
            return cls(wire, 1)
        if mode == "device":
            if wire.get("nfds", 0) != 0:
                raise ProtocolError(f"{op}: a device event {name!r} carries no fds")
            return cls(wire, 0)
        raise ProtocolError(f"{op}: {name!r} must be an exported event, mode 'host' or "
                            f"'device'")


def _handle(wire: Any, op: str, name: str) -> TensorHandle:
    if not isinstance(wire, dict):
        raise ProtocolError(f"{op}: {name!r} must be a tensor handle map, "
                            f"got {type(wire).__name__}")
    return TensorHandle.from_wire(wire)


@dataclass(frozen=True)
class HelloMessage:
    protocol: int
    monitor: bool
    namespace: str | None
    spec: Mapping[str, Any] | None
    chunk_size: int | None
    tenant: str | None
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any]) -> HelloMessage:
        monitor = _get(args, "hello", "monitor", bool, optional=True) or False
        protocol = _get(args, "hello", "protocol", int)
        namespace = _get(args, "hello", "namespace", str, optional=True)
        spec = _get(args, "hello", "spec", dict, optional=True)
        chunk = _get(args, "hello", "chunk_size", int, optional=True)
        tenant = _get(args, "hello", "tenant", str, optional=True)
        if not monitor and (not namespace or spec is None):
            raise ProtocolError("hello: a cache connection names its namespace and spec "
                                "(or says monitor: true)")
        for label, text in (("namespace", namespace), ("tenant", tenant)):
            if text is not None and len(text) > _MAX_NAME:
                raise ProtocolError(f"hello: {label} longer than {_MAX_NAME} characters")
        if chunk is not None and not 0 < chunk < 1 << 31:
            raise ProtocolError(f"hello: chunk_size must be in [1, 2**31), got {chunk}")
        return cls(protocol, bool(monitor), namespace, spec, chunk, tenant)


@dataclass(frozen=True)
class RegisterMessage:
    layout: str
    handles: tuple[TensorHandle, ...]

    @property
    def nfds(self) -> int:
        return sum(h.num_fds for h in self.handles)

    @classmethod
    def decode(cls, args: Mapping[str, Any]) -> RegisterMessage:
        layout = _get(args, "register", "layout", str)
        wires = _get(args, "register", "handles", list)
        if not 0 < len(wires) <= MAX_HANDLES:
            raise ProtocolError(f"register: 1..{MAX_HANDLES} handles, got {len(wires)}")
        return cls(layout, tuple(_handle(w, "register", "handles[]") for w in wires))


@dataclass(frozen=True)
class UnregisterMessage:
    reg: int
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any]) -> UnregisterMessage:
        return cls(_int(args, "unregister", "reg", 0, 1 << 62))


@dataclass(frozen=True)
class TokensMessage:
    """lookup, delete: only tokens."""

    tokens: bytes
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any], op: str) -> TokensMessage:
        return cls(_tokens(args, op))


@dataclass(frozen=True)
class PrefetchMessage:
    tokens: bytes
    timeout: float | None
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any]) -> PrefetchMessage:
        timeout = _get(args, "prefetch", "timeout", (int, float), optional=True)
        if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
            raise ProtocolError(f"prefetch: timeout must be a finite number >= 0, "
                                f"got {timeout!r}")
        return cls(_tokens(args, "prefetch"), None if timeout is None else float(timeout))


#: Buffers one request may release (the client keeps far fewer mapped).
MAX_RELEASE: Final = 1024
_MAX_BUFFER_ID: Final = (1 << 63) - 1


@dataclass(frozen=True)
class DenseMessage:
    """put (``kv``) and get (``out``): tokens and the tensor to read or write.

    The tensor is a handle (mapped for this request only), a handle with ``buf`` (mapped
    and kept on the connection as buffer ``buf``), or ``buf`` alone (a buffer kept by an
    earlier request: no handle, no fd, no mapping). ``release`` names buffers the client no
    longer needs; they are let go before the op runs.
    """

    tokens: bytes
    handle: TensorHandle | None
    buf: int | None = None
    release: tuple[int, ...] = ()

    @property
    def nfds(self) -> int:
        return self.handle.num_fds if self.handle is not None else 0

    @classmethod
    def decode(cls, args: Mapping[str, Any], op: str) -> DenseMessage:
        name = "kv" if op == "put" else "out"
        buf = _get(args, op, "buf", int, optional=True)
        if buf is not None and not 0 <= buf <= _MAX_BUFFER_ID:
            raise ProtocolError(f"{op}: 'buf' must be in [0, 2**63), got {buf}")
        wire = _get(args, op, name, dict, optional=buf is not None)
        release: tuple[int, ...] = ()
        raw = _get(args, op, "release", list, optional=True)
        if raw is not None:
            if len(raw) > MAX_RELEASE or any(type(b) is not int or not 0 <= b <= _MAX_BUFFER_ID
                                             for b in raw):
                raise ProtocolError(f"{op}: 'release' must list at most {MAX_RELEASE} "
                                    f"buffer ids")
            release = tuple(raw)
        handle = None if wire is None else _handle(wire, op, name)
        return cls(_tokens(args, op), handle, buf, release)


@dataclass(frozen=True)
class PagedMessage:
    """store and retrieve: tokens, slots, a registration and up to two events."""

    tokens: bytes
    slots: bytes
    reg: int
    skip_prefix: int
    ready: EventWire | None
    done: EventWire | None

    @property
    def nfds(self) -> int:
        return sum(e.nfds for e in (self.ready, self.done) if e is not None)

    @classmethod
    def decode(cls, args: Mapping[str, Any], op: str) -> PagedMessage:
        tokens = _tokens(args, op)
        slots = _get(args, op, "slots", bytes)
        if len(slots) % 8:
            raise ProtocolError(f"{op}: slots must be little-endian int64 bytes")
        if len(slots) // 8 != len(tokens) // 4:
            raise ProtocolError(f"{op}: {len(slots) // 8} slots for {len(tokens) // 4} tokens")
        skip = _int(args, op, "skip_prefix", 0, len(tokens) // 4, default=0)
        done = EventWire.decode(args, op, "done") if op == "retrieve" else None
        if op != "retrieve" and args.get("done") is not None:
            raise ProtocolError(f"{op}: only retrieve takes a done event")
        return cls(tokens, slots, _int(args, op, "reg", 0, 1 << 62), skip,
                   EventWire.decode(args, op, "ready"), done)


@dataclass(frozen=True)
class StageBytesMessage:
    total: int
    offset: int
    data: bytes
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any], max_total: int) -> StageBytesMessage:
        total = _int(args, "stage_bytes", "total", 1, max_total)
        offset = _int(args, "stage_bytes", "offset", 0, total)
        data = _get(args, "stage_bytes", "data", bytes)
        if offset + len(data) > total:
            raise ProtocolError(f"stage_bytes: {len(data)} bytes at {offset} run past "
                                f"total={total}")
        return cls(total, offset, data)


@dataclass(frozen=True)
class PutStagedMessage:
    tokens: bytes
    nfds: int = 0

    @classmethod
    def decode(cls, args: Mapping[str, Any]) -> PutStagedMessage:
        return cls(_tokens(args, "put_staged"))


#: Pages one put_pages/get_pages/exists_pages call may name, and the longest page key.
MAX_PAGES = 65536
MAX_PAGE_KEY = 1024


def _page_key_list(args: Mapping[str, Any], op: str, name: str = "keys") -> list[bytes]:
    keys = _get(args, op, name, list)
    if len(keys) > MAX_PAGES:
        raise ProtocolError(f"{op}: at most {MAX_PAGES} keys per call, got {len(keys)}")
    for k in keys:
        if type(k) is not bytes or not 0 < len(k) <= MAX_PAGE_KEY:
            raise ProtocolError(f"{op}: each key must be 1 to {MAX_PAGE_KEY} bytes")
    return keys


@dataclass(frozen=True)
class PagesMessage:
    """put_pages (``pages``), get_pages (``out``), exists_pages (keys only): engine-named
    pages. The handle is one ``[num_keys, page_elements]`` tensor."""

    keys: list[bytes]
    handle: TensorHandle | None
    after: bytes | None

    @property
    def nfds(self) -> int:
        return self.handle.num_fds if self.handle is not None else 0

    @classmethod
    def decode(cls, args: Mapping[str, Any], op: str) -> PagesMessage:
        keys = _page_key_list(args, op)
        handle = None
        if op != "exists_pages":
            name = "pages" if op == "put_pages" else "out"
            handle = _handle(_get(args, op, name, dict), op, name)
        after = _get(args, op, "after", bytes, optional=True) if op == "put_pages" else None
        if after is not None and not 0 < len(after) <= MAX_PAGE_KEY:
            raise ProtocolError(f"{op}: 'after' must be 1 to {MAX_PAGE_KEY} bytes")
        return cls(keys, handle, after)


@dataclass(frozen=True)
class EmptyMessage:
    """clear, flush, stats: no arguments (any given are ignored)."""

    nfds: int = 0


def decode_args(op: str, args: Mapping[str, Any], nfds: int, *,
                max_stage_bytes: int) -> Any:
    """The typed message of ``op``; ProtocolError if ``args`` (or the fd count) is malformed."""
    msg: Any
    if op == "hello":
        msg = HelloMessage.decode(args)
    elif op == "register":
        msg = RegisterMessage.decode(args)
    elif op == "unregister":
        msg = UnregisterMessage.decode(args)
    elif op in ("lookup", "delete"):
        msg = TokensMessage.decode(args, op)
    elif op == "prefetch":
        msg = PrefetchMessage.decode(args)
    elif op in ("put", "get"):
        msg = DenseMessage.decode(args, op)
    elif op in ("store", "retrieve"):
        msg = PagedMessage.decode(args, op)
    elif op == "stage_bytes":
        msg = StageBytesMessage.decode(args, max_stage_bytes)
    elif op == "put_staged":
        msg = PutStagedMessage.decode(args)
    elif op in ("put_pages", "get_pages", "exists_pages"):
        msg = PagesMessage.decode(args, op)
    elif op in ("clear", "flush", "stats"):
        msg = EmptyMessage()
    else:
        raise ProtocolError(f"unknown op {op!r}")
    if msg.nfds != nfds:
        raise ProtocolError(f"{op}: the arguments claim {msg.nfds} fds, the frame carried "
                            f"{nfds}")
    return msg


def take_fds(fds: list[int], n: int) -> list[int]:
    """The next ``n`` fds of a frame (the count was checked by :func:`decode_args`)."""
    mine, fds[:n] = fds[:n], []
    return mine

