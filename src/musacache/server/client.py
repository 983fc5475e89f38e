"""The node-server client: :func:`musacache.connect` returns a :class:`Client` with the same
async API as :class:`musacache.Cache`, so code written for the embedded cache runs against
``musacache serve`` unchanged.

Requests are multiplexed: many calls may be in flight on one connection, each answered by id.
Dense KV never travels through the socket: ``put``/``get`` send a shared-memory handle, and
``store``/``retrieve`` send only tokens and slots for caches registered once.

If the server dies, calls fail fast with :class:`CacheUnavailableError` (a dropped connection
is noticed at once; a hung server after ``timeout`` seconds). The next call reconnects, says
hello again and re-registers the KV caches, so a restarted server is picked up by itself.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from musacache import devices, ipc, transfer
from musacache._api import TokensLike
from musacache._errors import (
    CacheClosedError,
    CacheUnavailableError,
    InvalidInputError,
    IPCError,
    MusaCacheError,
    ShapeError,
)
from musacache._executor import Executor
from musacache._keys import as_tokens, token_bytes
from musacache._spec import KVSpec, check_writable, may_overlap
from musacache._validate import positive_float
from musacache.cache import Hit, _new_hit
from musacache.engine.pages import check_pages
from musacache.ipc import _wire as proto
from musacache.ipc._memory import shared_segment

__all__ = ["Client", "connect"]


class _LocalRegistration:
    def __init__(self, pages: transfer.Pages) -> None:
        self.pages = pages
        self.layout = pages.layout
        # Shared in the order of Pages.tensors, which the server's Pages.from_tensors takes.
        self.handles = [ipc.share(t) for t in pages.tensors]
        self.remote: int | None = None  # the server's id for it on ``conn``
        self.conn: proto.Connection | None = None
        self.signature = _signature(pages.tensors)


def _flat(kv_caches: Any, pages: transfer.Pages) -> list[torch.Tensor] | None:
    """``kv_caches`` as a flat tensor list in ``pages``' layout, or None if it is not one."""
    try:
        if pages.row.pair:
            k, v = kv_caches
            flat = [*k, *v]
        else:
            flat = list(kv_caches)
    except (TypeError, ValueError):
        return None
    return flat if all(isinstance(t, torch.Tensor) for t in flat) else None


def _signature(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


#: Views one connection asks the server to keep mapped (the server's limit may be lower).
_MAX_BUFFERS = 64
#: A get without a shared ``out`` of at most this many bytes goes through a reused staging
#: buffer and one copy; a larger one gets fresh shared memory (a copy would cost more).
_SMALL_GET = 1 << 20
# Requests up to this size are sent a loop turn at a time (Connection.send_soon).
_HOLD_BYTES = 64 * 1024


class _Staging:
    """Shared uint8 buffers for tensors in private memory, reused across calls (one per call
    in flight, so concurrent calls never share one; at most four kept)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)
        return ipc.empty_shared((nbytes,), torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        if len(self._free) < 4:
            self._free.append(buf)

    def settle(self, buf: torch.Tensor, answered: bool) -> None:
        """The end of ``buf``'s request: kept for the next one only if the request was
        answered. A call cancelled or cut off after it was sent leaves the server reading or
        writing the buffer still, so it is dropped, never handed to another call (a put cancelled in
        flight had the next put's KV stored under its prompt)."""
        if answered:
            self.give(buf)

    def clear(self) -> None:
        self._free.clear()


class _Buffers:
    """The views of this client's shared memory that the server keeps mapped for one
    connection, by id (``buf`` in a put or get).

    The first request on a view sends its handle and fd with a new id; later ones send the
    id alone. A view is named by its memory (the mapping object of :func:`empty_shared`,
    watched by one finaliser per memory, so the views of a freed buffer are released with the
    next request and its name is never reused while listed; the finaliser only notes it: it
    may run in the middle of :meth:`bind`) and its dtype, offset, shape and stride. Past the
    limit, the least recently used view with no request in flight is released (``release``
    in the next request). Ids are never reused on a connection, so a release sent twice is
    harmless.
    """

    def __init__(self, conn: proto.Connection, limit: int) -> None:
        self.conn = conn
        self.limit = limit
        self._ids: dict[tuple[Any, ...], int] = {}  # in order of use, oldest first
        self._keys: dict[int, tuple[Any, ...]] = {}
        self._busy: dict[int, int] = {}
        self._release: list[int] = []
        self._watched: dict[int, weakref.finalize] = {}  # id(segment) -> its finaliser
        self._dead: list[int] = []  # ids of segments whose memory is gone
        self._next = itertools.count(1)
        # The kept view a tensor object was last bound to: id(t) -> (a weak reference to t,
        # its address, shape and dtype then, the buffer id). A worker passes the same out
        # tensors again and again; this finds their id without asking for the memory's
        # mapping or building the view's key (most of a small get's client side).
        self._by_tensor: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Size,
                                          torch.dtype, int]] = {}

    def kept(self, t: torch.Tensor) -> int | None:
        """The id of the kept view ``t`` was bound to, marked busy as :meth:`bind` does
        (pass it to :meth:`done`), when ``t`` is the same tensor object, still a
        contiguous view of the same address, shape and dtype, and nothing is to be
        released first; else None (call :meth:`bind`)."""
        memo = self._by_tensor.get(id(t))
        if memo is None or self._dead or self._release:
            return None
        ref, ptr, shape, dtype, bid = memo
        if ref() is not t or t.data_ptr() != ptr or t.shape != shape or t.dtype is not dtype \
                or not t.is_contiguous():
            # A different tensor under a recycled id(), or the tensor was re-pointed in
            # place (set_, .data =): bind() decides afresh.
            del self._by_tensor[id(t)]
            return None
        key = self._keys.get(bid)
        if key is None:  # released meanwhile (past the limit)
            del self._by_tensor[id(t)]
            return None
        del self._ids[key]
        self._ids[key] = bid  # the newest now
        self._busy[bid] += 1
        return bid

    def _remember(self, t: torch.Tensor, bid: int) -> None:
        if t.is_contiguous():
            if len(self._by_tensor) >= 2 * self.limit:  # tensors gone or rebound: start over
                self._by_tensor.clear()
            self._by_tensor[id(t)] = (weakref.ref(t), t.data_ptr(), t.shape, t.dtype, bid)

    def bind(self, t: torch.Tensor, name: str, args: dict[str, Any],
             segment: object | None = None,
             ) -> tuple[ipc.TensorHandle | None, int | None, bool, list[int]]:
        """Fill ``args`` for ``t``: (the handle whose fds go with the request, the buffer id,
        whether it is new, the ids released by this request). Pass all but the handle to
        :meth:`done` when the request ends. ``segment``: ``shared_segment(t)`` when the
        caller has it already."""
        while self._dead:
            gone = self._dead.pop()
            self._watched.pop(gone, None)
            for dead in [b for b, k in self._keys.items() if k[0] == gone]:
                self._forget(dead)
                self._release.append(dead)
        released, self._release = self._release, []
        if released:
            args["release"] = released
        if segment is None and self.limit:
            segment = shared_segment(t)
        elif not self.limit:
            segment = None
        if segment is None:
            handle = ipc.share(t)
            args[name] = handle.to_wire()
            return handle, None, False, released
        key = (id(segment), t.dtype, t.storage_offset(), t.shape, t.stride())
        kept = self._ids.get(key)
        if kept is not None:
            del self._ids[key]
            self._ids[key] = kept  # the newest now
            self._busy[kept] += 1
            args["buf"] = kept
            self._remember(t, kept)
            return None, kept, False, released
        if len(self._ids) >= self.limit:
            victim = next((b for b in self._ids.values() if not self._busy[b]), None)
            if victim is None:  # every kept view is in use: this one goes without keeping
                handle = ipc.share(t)
                args[name] = handle.to_wire()
                return handle, None, False, released
            self._forget(victim)
            released.append(victim)
            args["release"] = released
        bid = next(self._next)
        self._ids[key] = bid
        self._keys[bid] = key
        self._busy[bid] = 1
        if id(segment) not in self._watched:
            self._watched[id(segment)] = weakref.finalize(segment, self._dead.append,
                                                          id(segment))
        handle = ipc.share(t)
        args[name] = handle.to_wire()
        args["buf"] = bid
        self._remember(t, bid)
        return handle, bid, True, released

    def done(self, bid: int | None, new: bool, released: list[int], failed: bool) -> None:
        if bid is not None and bid in self._busy:
            self._busy[bid] -= 1
        if failed:
            # The server may not have read the request: say the releases again, and forget
            # a view it may not have kept (released too, in case it did).
            self._release.extend(released)
            if new and bid is not None and bid in self._keys:
                self._forget(bid)
                self._release.append(bid)

    def _forget(self, bid: int) -> None:
        key = self._keys.pop(bid)
        del self._ids[key]
        del self._busy[bid]


class Client:
    """A connection to ``musacache serve``. Use ``async with connect(path, spec=..., ...)``."""

    def __init__(self, path: str, *, spec: KVSpec, namespace: str, chunk_size: int | None = None,
                 tenant: str | None = None, timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        _check_client_args(spec, namespace, tenant, chunk_size)
        self.path = str(path)
        self.spec = spec
        self.namespace = namespace
        self.tenant = tenant
        self.chunk_size = chunk_size
        # Checked here, not at the first call: a NaN bound never expires (a call to a server
        # that answers nothing would hang), and a string failed deep inside asyncio.
        self.timeout = positive_float(timeout, "timeout", error=InvalidInputError)
        self.connect_timeout = positive_float(connect_timeout, "connect_timeout",
                                              error=InvalidInputError)
        self.server_info: dict[str, Any] = {}
        self._conn: proto.Connection | None = None
        self._pending: dict[int, asyncio.Future[proto.Reply]] = {}
        # Each pending request's deadline, oldest first (the timeout is the same for all,
        # so the order of sending is the order of deadlines): one timer serves them all.
        self._due: dict[int, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._regs: list[_LocalRegistration] = []
        self._connect_lock = anyio.Lock()
        self._connect_failed: tuple[float, CacheUnavailableError] | None = None
        self._staging = _Staging()
        self._buffers: _Buffers | None = None
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._executor = Executor("musacache-client")  # copies too large for the loop
        self._state = "new"
        self._connected_once = False
        self.reconnects = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._state != "new":
            raise CacheClosedError(f"Client.open() on a client that is {self._state}")
        self._state = "open"
        await self._ensure()

    async def aclose(self) -> None:
        self._state = "closed"
        await self._drop("the client was closed")
        self._regs.clear()
        self._staging.clear()
        self._executor.close()

    async def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() * dst.element_size() < (1 << 20):
            dst.copy_(src)
        else:
            await self._executor.run(dst.copy_, src)

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError("the client is closed" if self._state == "closed"
                                   else "the client is not open: use `async with connect(...)`")

    async def _ensure(self) -> proto.Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        asked = time.monotonic()
        async with self._connect_lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            failed = self._connect_failed
            if failed is not None and failed[0] >= asked:
                # An attempt that failed while this call waited answers it too: one after
                # another, the k-th caller waited k timeouts.
                raise CacheUnavailableError(str(failed[1])) from failed[1]
            try:
                return await self._connect()
            except CacheUnavailableError as e:
                self._connect_failed = (time.monotonic(), e)
                raise

    async def _connect(self) -> proto.Connection:
        try:
            with anyio.fail_after(self.connect_timeout):
                conn = await proto.Connection.connect(self.path, expect="reply")
        except (OSError, TimeoutError) as e:
            raise CacheUnavailableError(f"cannot reach musacache server at {self.path}: {e}") \
                from e
        if self._connected_once:
            self.reconnects += 1
        self._connected_once = True
        conn.start_reading(functools.partial(self._on_frame, conn),  # (no lambda frame per
                           functools.partial(self._on_end, conn))  # reply: partials)
        try:
            self.server_info = await self._request(conn, "hello", {
                "protocol": proto.PROTOCOL_VERSION, "namespace": self.namespace,
                "spec": self.spec.to_dict(), "chunk_size": self.chunk_size,
                "tenant": self.tenant})
            for reg in self._regs:
                await self._register_remote(conn, reg)
        except BaseException:
            await conn.aclose()
            self._fail_pending("hello failed")
            raise
        # Published only now, with hello answered and every registration made on it (calls went out
        # before hello, stores with another connection's numbers).
        if self._state != "open":  # closed meanwhile: aclose could not see this one
            await conn.aclose()
            raise CacheClosedError("the client was closed while it connected")
        self._conn = conn
        return conn

    async def _drop(self, why: str) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()
        self._fail_pending(why)

    def _fail_pending(self, why: str) -> None:
        self._fail_with(None, why)

    # Replies are routed from the connection's reader callback: no reading task to wake
    # between the socket and the caller's future.
    def _on_frame(self, conn: proto.Connection, frame: proto.Frame | proto.FrameError) -> None:
        if isinstance(frame, proto.FrameError):
            # A reply the client cannot read: nothing on this connection can be trusted.
            self._fail_pending(f"connection to the server lost: {frame}")
            conn.close()
            return
        if frame.fds:
            ipc.close_fds(frame.fds)
        if not isinstance(frame, proto.Reply):
            return
        if frame.id is None:
            # An error about the connection itself (refused, bad frame): fail everyone.
            err = proto.error_from_wire(frame.error) if frame.error else None
            self._fail_with(err, str(err) if err else "the server closed the connection")
            return
        fut = self._pending.pop(frame.id, None)
        if fut is not None and not fut.done():
            fut.set_result(frame)

    def _on_end(self, conn: proto.Connection, exc: BaseException | None) -> None:
        if self._conn is conn:
            self._conn = None
        self._fail_pending("the server closed the connection" if exc is None
                           else f"connection to the server lost: {exc}")

    def _fail_with(self, exc: MusaCacheError | None, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc if exc is not None else CacheUnavailableError(why))

    async def _request(self, conn: proto.Connection, op: str, args: dict[str, Any],
                       fds: Sequence[int] = ()) -> Any:
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[proto.Reply] = loop.create_future()
        self._pending[rid] = fut
        # The deadline fails the reply's future from a timer: an anyio cancel scope per
        # request cost as much as the rest of a small request's client side, and a timer
        # per request still a tenth of it.
        due = self._due[rid] = loop.time() + self.timeout
        if self._timer is None or self._timer_loop is not loop:
            self._timer, self._timer_loop = loop.call_at(due, self._expire), loop
        try:
            frame = proto.encode_request(rid, op, args, nfds=len(fds))
            if fds or len(frame) > _HOLD_BYTES:
                await conn.send_frame(frame, fds, timeout=self.timeout)
            else:  # with this turn's other requests in one syscall (the timer bounds it)
                conn.send_soon(frame)
            reply = await fut
        except TimeoutError:
            # A server that does not answer in time is treated as gone: reconnect next call.
            await self._drop(f"{op} got no answer within {self.timeout} s")
            raise CacheUnavailableError(
                f"musacache server at {self.path} did not answer {op} within {self.timeout} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            self._due.pop(rid, None)
        if reply.error is not None:
            raise proto.error_from_wire(reply.error)
        return reply.result

    def _expire(self) -> None:
        """Fail the requests past their deadline; wake again at the next one."""
        self._timer = None
        loop = self._timer_loop
        if loop is None:
            return
        now = loop.time()
        while self._due:
            rid, due = next(iter(self._due.items()))
            if due > now:
                self._timer = loop.call_at(due, self._expire)
                return
            del self._due[rid]
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(TimeoutError())

    async def _call(self, op: str, args: dict[str, Any], fds: Sequence[int] = ()) -> Any:
        self._check_open()
        conn = self._conn
        if conn is None or conn.closed:  # (the usual case costs no coroutine)
            conn = await self._ensure()
        return await self._request(conn, op, args, fds)

    # -- the Cache API ----------------------------------------------------------------------

    async def lookup(self, tokens: TokensLike) -> int:
        return int(await self._call("lookup", {"tokens": _tok_bytes(tokens)}))

    async def prefetch(self, tokens: TokensLike, timeout: float | None = None) -> int:
        return int(await self._call("prefetch", {"tokens": _tok_bytes(tokens),
                                                 "timeout": timeout}))

    async def delete(self, tokens: TokensLike) -> int:
        return int(await self._call("delete", {"tokens": _tok_bytes(tokens)}))

    async def clear(self) -> None:
        await self._call("clear", {})

    async def flush(self) -> None:
        await self._call("flush", {})

    async def stats(self) -> dict[str, Any]:
        """The server's ``Cache.stats()`` for this connection's cache, plus a ``server``
        section (a coroutine, as on :class:`~musacache.Cache`)."""
        return dict(await self._call("stats", {}))

    async def put(self, tokens: TokensLike, kv: torch.Tensor) -> int:
        self._check_open()
        toks = as_tokens(tokens)
        have = self.spec.check_dense(kv, what="kv")
        if have < len(toks):
            raise ShapeError(f"kv holds {have} tokens but tokens has {len(toks)}")
        if len(toks) == 0:
            return 0
        # (detached: KV from a prefill run with grad on is cached by its values)
        dense = kv.detach().narrow(self.spec.token_dim, 0, len(toks))
        raw: torch.Tensor | None = None
        if not _sealed(dense):
            # One copy into sealed shared memory (private memory cannot be mapped, and the
            # server refuses memory that could shrink under it); the server then copies once
            # into its tier.
            raw = self._staging.take(self.spec.nbytes(len(toks)))
            staged = raw[:self.spec.nbytes(len(toks))].view(self.spec.dtype).view(
                self.spec.shape(len(toks)))
            await self._copy(staged, dense)
            dense = staged
        answered = False
        try:
            stored = int(await self._dense("put", toks.tobytes(), "kv", dense))
            answered = True
            return stored
        finally:
            if raw is not None:
                self._staging.settle(raw, answered)

    async def get(self, tokens: TokensLike, out: torch.Tensor | None = None) -> Hit:
        conn, bufs = self._conn, self._buffers
        if out is not None and bufs is not None and bufs.conn is conn and conn is not None \
                and not conn.closed and self._state == "open":
            # An out the server keeps already (a worker's reused buffer): its id alone goes,
            # and out is checked against what it was bound as (_Buffers.kept).
            raw_tokens = token_bytes(tokens)
            n = len(raw_tokens) >> 2
            shape = self._shapes.get(n)
            bid = bufs.kept(out) if shape is not None and type(out) is torch.Tensor \
                and out.shape == shape else None
            if bid is not None:
                failed = True
                try:
                    res = await self._request(conn, "get", {"tokens": raw_tokens, "buf": bid})
                    failed = False
                finally:  # (a failed request releases nothing: the id was kept before it)
                    bufs.done(bid, False, [], failed)
                got = int(res["num_tokens"])
                tiers = res.get("tiers") or {}
                return _new_hit(got, out if got == n else out.narrow(self.spec.token_dim, 0, got),
                                tiers if type(tiers) is dict else dict(tiers))
        return await self._get(tokens, out)

    async def _get(self, tokens: TokensLike, out: torch.Tensor | None) -> Hit:
        self._check_open()
        raw_tokens = token_bytes(tokens)
        n = len(raw_tokens) >> 2
        segment = None
        if out is not None:
            _check_out(self.spec, self._shapes, out, n)
            segment = shared_segment(out)
        td = self.spec.token_dim
        if n == 0:
            empty = out if out is not None else torch.empty(self.spec.shape(0),
                                                            dtype=self.spec.dtype,
                                                            device="cpu")
            return Hit(0, empty.narrow(td, 0, 0), {})
        raw: torch.Tensor | None = None
        if out is not None and (segment is not None or ipc.is_sealed(out)):
            target = out
        elif self.spec.nbytes(n) <= _SMALL_GET:
            # A reused staging buffer (kept mapped by the server), then one small copy.
            raw = self._staging.take(self.spec.nbytes(n))
            target = raw[:self.spec.nbytes(n)].view(self.spec.dtype).view(self.spec.shape(n))
        else:
            target = ipc.empty_shared(self.spec.shape(n), self.spec.dtype)
        answered = False
        try:
            res = await self._dense("get", raw_tokens, "out", target,
                                    segment if target is out else None)
            answered = True
            got = int(res["num_tokens"])
            if raw is not None:
                dst = out if out is not None else torch.empty(self.spec.shape(n),
                                                              dtype=self.spec.dtype,
                                                              device="cpu")
                dst.narrow(td, 0, got).copy_(target.narrow(td, 0, got))
                target = dst
            elif out is not None and target is not out:
                await self._copy(out.narrow(td, 0, got), target.narrow(td, 0, got))
                target = out
        finally:
            if raw is not None:
                self._staging.settle(raw, answered)
        return Hit(got, target if got == n else target.narrow(td, 0, got),
                   dict(res.get("tiers") or {}))

    async def _dense(self, op: str, tokens: bytes, name: str, t: torch.Tensor,
                     segment: object | None = None) -> Any:
        """One put or get of ``t`` (shared memory): by buffer id once the server keeps it."""
        self._check_open()
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._ensure()
        bufs = self._buffers
        if bufs is None or bufs.conn is not conn:
            limit = min(_MAX_BUFFERS, int(self.server_info.get("max_buffers") or 0))
            bufs = self._buffers = _Buffers(conn, limit)
        args: dict[str, Any] = {"tokens": tokens}
        handle, bid, new, released = bufs.bind(t, name, args, segment)
        failed = True
        try:
            result = await self._request(conn, op, args, handle.fds if handle else ())
            failed = False
            return result
        finally:
            bufs.done(bid, new, released, failed)

    # -- key-addressed pages (Cache.put_pages and friends) ----------------------------------

    async def put_pages(self, keys: Sequence[str | bytes], pages: Sequence[torch.Tensor], *,
                        after: str | bytes | None = None) -> int:
        """As :meth:`musacache.Cache.put_pages`: the pages are staged into one shared buffer
        (one copy) and the server copies them into its tiers."""
        wire_keys, numel = self._page_args(keys, pages, "pages", writes=False)
        if not wire_keys:
            return 0
        raw, staged = self._page_buffer(len(pages), numel)
        answered = False
        try:
            for i, p in enumerate(pages):
                staged[i].view(p.shape).copy_(p.detach())
            handle = ipc.share(staged)
            args: dict[str, Any] = {"keys": wire_keys, "pages": handle.to_wire()}
            if after is not None:
                args["after"] = _page_keys([after])[0]
            stored = int(await self._call("put_pages", args, handle.fds))
            answered = True
            return stored
        finally:
            self._staging.settle(raw, answered)

    def _page_args(self, keys: Sequence[str | bytes], pages: Sequence[torch.Tensor],
                   what: str, *, writes: bool) -> tuple[list[bytes], int]:
        """The keys as sent, and the elements of one page, once ``pages`` are checked."""
        self._check_open()
        wire_keys = _page_keys(keys)
        tokens = _page_tokens(self.server_info, self.chunk_size)
        check_pages(pages, len(wire_keys), self.spec, tokens, what, writes=writes)
        return wire_keys, self.spec.nbytes(tokens) // self.spec.dtype.itemsize

    def _page_buffer(self, count: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer (to settle after the call) and its ``[count, numel]`` view."""
        nbytes = count * numel * self.spec.dtype.itemsize
        raw = self._staging.take(nbytes)
        return raw, raw[:nbytes].view(self.spec.dtype).view(count, numel)

    async def get_pages(self, keys: Sequence[str | bytes], outs: Sequence[torch.Tensor],
                        ) -> list[bool]:
        """As :meth:`musacache.Cache.get_pages`: the server writes into a shared buffer, then
        each found page is copied into its ``out``."""
        wire_keys, numel = self._page_args(keys, outs, "outs", writes=True)
        if not wire_keys:
            return []
        raw, target = self._page_buffer(len(outs), numel)
        answered = False
        try:
            handle = ipc.share(target)
            found = [bool(f) for f in await self._call(
                "get_pages", {"keys": wire_keys, "out": handle.to_wire()}, handle.fds)]
            answered = True
            for i, f in enumerate(found):
                if f:
                    outs[i].copy_(target[i].view(outs[i].shape))
            return found
        finally:
            self._staging.settle(raw, answered)

    async def exists_pages(self, keys: Sequence[str | bytes]) -> int:
        """As :meth:`musacache.Cache.exists_pages`."""
        self._check_open()
        return int(await self._call("exists_pages", {"keys": _page_keys(keys)}))

    # -- paged caches -------------------------------------------------------------------------

    async def register_kv_caches(self, kv_caches: Any, layout: str | None = None) -> int:
        """Share the worker's paged KV caches with the server once (zero copy).

        ``kv_caches`` is a :class:`musacache.transfer.Pages`, or raw caches in ``layout``
        (default ``"vllm"``).

        CPU caches must live in sealed shared memory: allocate them with
        ``musacache.ipc.empty_shared`` (torch's ``share_memory_()`` memory is refused: its
        owner could shrink it under the server's mapping). Returns a registration number for
        ``store``/``retrieve`` (the last registration is the default).
        """
        self._check_open()
        reg = _LocalRegistration(_shareable_pages(kv_caches, layout, self.spec))
        conn = await self._ensure()
        await self._register_remote(conn, reg)
        self._regs.append(reg)
        return len(self._regs) - 1

    async def _register_remote(self, conn: proto.Connection, reg: _LocalRegistration) -> None:
        fds = [fd for h in reg.handles for fd in h.fds]
        res = await self._request(conn, "register", {
            "layout": reg.layout, "handles": [h.to_wire() for h in reg.handles]}, fds)
        reg.remote, reg.conn = int(res["reg"]), conn

    async def store(self, tokens: TokensLike, *args: Any, layout: str | None = None,
                    skip_prefix: int = 0, ready: Any = None, reg: int | None = None,
                    ready_timeout: float | None = None) -> int:
        """``store(tokens, slot_mapping, ready=event)`` for the registered caches, or
        ``store(tokens, kv_caches, slot_mapping, layout=...)`` as on the embedded cache (the
        caches must have been registered). Only metadata crosses the socket."""
        return await self._paged("store", tokens, args, layout, skip_prefix, ready, reg,
                                 ready_timeout, None)

    async def retrieve(self, tokens: TokensLike, *args: Any, layout: str | None = None,
                       skip_prefix: int = 0, ready: Any = None, reg: int | None = None,
                       ready_timeout: float | None = None, done: Any = None) -> int:
        """Scatter the cached prefix straight into the registered pages; ``done`` (an
        :class:`~musacache.ipc.IpcEvent`) is set by the server when the pages are written."""
        return await self._paged("retrieve", tokens, args, layout, skip_prefix, ready, reg,
                                 ready_timeout, done)

    async def _paged(self, op: str, tokens: TokensLike, args: tuple[Any, ...], layout: str | None,
                     skip_prefix: int, ready: Any, reg: int | None,
                     ready_timeout: float | None, done: Any) -> int:
        self._check_open()
        if len(args) == 2:
            kv_caches, slot_mapping = args
        elif len(args) == 1:
            kv_caches, slot_mapping = None, args[0]
        else:
            raise InvalidInputError(f"{op}(tokens, slot_mapping) or "
                                    f"{op}(tokens, kv_caches, slot_mapping)")
        r = _find_reg(self._regs, kv_caches, layout, reg)
        toks = as_tokens(tokens)
        slots = transfer._as_slots(slot_mapping, len(toks))
        transfer._check_slot_range(slots, r.pages.num_slots)
        if isinstance(skip_prefix, bool) or not isinstance(skip_prefix, int) \
                or not 0 <= skip_prefix <= len(toks):
            raise InvalidInputError(f"skip_prefix must be an int in [0, {len(toks)}], "
                                    f"got {skip_prefix!r}")
        fds: list[int] = []
        call: dict[str, Any] = {"tokens": toks.tobytes(),
                                "slots": slots.to("cpu").numpy().astype("<i8").tobytes(),
                                "skip_prefix": skip_prefix}
        if isinstance(ready, ipc.IpcEvent):
            wire, efds = ready.export()
            call["ready"] = wire
            fds += efds
        elif ready is not None:
            # A local event cannot cross processes: wait for it here, then send.
            await devices.wait_ready(ready, ready_timeout)
        if done is not None:
            if not isinstance(done, ipc.IpcEvent):
                raise InvalidInputError("done= must be a musacache.ipc.IpcEvent")
            wire, efds = done.export()
            call["done"] = wire
            fds += efds
        conn = await self._ensure()
        if r.conn is not conn:  # (a number is the server's on one connection only)
            await self._register_remote(conn, r)
        call["reg"] = r.remote
        return int(await self._request(conn, op, call, fds))



def _check_client_args(spec: object, namespace: object, tenant: object,
                       chunk_size: object) -> None:
    if not isinstance(spec, KVSpec):
        raise InvalidInputError(f"spec must be a KVSpec, got {type(spec).__name__}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidInputError(f"namespace must be a non-empty string, got {namespace!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidInputError(f"tenant must be a non-empty string or None, got {tenant!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool)
                                   or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _shareable_pages(kv_caches: Any, layout: str | None, spec: KVSpec) -> transfer.Pages:
    """``kv_caches`` as Pages of ``spec`` in sealed shared memory, which the server can map."""
    pages = transfer.as_pages(kv_caches, layout)
    if pages.spec != spec:
        raise InvalidInputError(f"kv_caches hold {pages.spec.describe()}, this client "
                                f"was opened for {spec.describe()}")
    for t in pages.tensors:
        if not ipc.is_shareable(t):
            raise IPCError("kv_caches live in private memory the server cannot map; "
                           "allocate them with musacache.ipc.empty_shared(shape, dtype)")
        if not ipc.is_sealed(t):
            raise IPCError("kv_caches live in shared memory that is not sealed against "
                           "shrinking (share_memory_()), which the server refuses; "
                           "allocate them with musacache.ipc.empty_shared(shape, dtype)")
    return pages


def _find_reg(regs: list[_LocalRegistration], kv_caches: Any, layout: str | None,
              reg: int | None) -> _LocalRegistration:
    """The registration a store or retrieve names: by its caches, or by number (the last
    one by default)."""
    if kv_caches is not None:
        for r in regs:
            if r.pages is kv_caches:
                return r
        if isinstance(kv_caches, transfer.Pages):
            kv_caches, layout = kv_caches.kv_caches, layout or kv_caches.layout
        # Raw caches: found by their tensors' addresses and shapes, read in each
        # registration's layout (a registered match was checked when it was registered).
        for r in regs:
            flat = _flat(kv_caches, r.pages)
            if (layout is None or r.layout == layout) and flat is not None and (
                    _signature(flat) == r.signature):
                return r
        raise InvalidInputError("these kv_caches are not registered: call "
                                "register_kv_caches(kv_caches, layout) once first")
    if not regs:
        raise InvalidInputError("no kv_caches registered: call register_kv_caches first")
    if reg is None:
        return regs[-1]
    if isinstance(reg, bool) or not isinstance(reg, int) or not 0 <= reg < len(regs):
        raise InvalidInputError(f"no registration {reg!r}: reg= is a number that "
                                "register_kv_caches returned")
    return regs[reg]


def _page_tokens(server_info: dict[str, Any], chunk_size: int | None) -> int:
    """Tokens of one page: one chunk, the server's chunk size first."""
    return int(server_info.get("chunk_size") or chunk_size or 0)


def _page_keys(keys: Any) -> list[bytes]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidInputError(f"keys must be a sequence of str or bytes, got "
                                f"{type(keys).__name__}")
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, (str, bytes)) or not k:
            raise InvalidInputError(f"keys[{i}] must be a non-empty str or bytes, got {k!r}")
        out.append(k.encode() if isinstance(k, str) else bytes(k))
    return out


def _check_out(spec: KVSpec, shapes: dict[int, tuple[int, ...]], out: torch.Tensor,
               n: int) -> None:
    """Refuse an ``out`` that cannot hold ``n`` tokens of ``spec``. One of exactly the
    spec's shape and dtype passes on plain attributes (the general check cost as much as the
    rest of a small get's client side); any other goes through ``check_dense``, which names
    what is wrong. ``shapes``: the caller's cache of ``spec.shape(n)``."""
    shape = shapes.get(n)
    if shape is None:
        shape = spec.shape(n)
        if len(shapes) < 64:  # the token counts a worker uses: a bounded few
            shapes[n] = shape
    if not (type(out) is torch.Tensor and out.dtype is spec.dtype
            and out.layout is torch.strided and not out.is_meta and out.shape == shape):
        have = spec.check_dense(out, what="out")
        if have != n:
            raise ShapeError(f"out holds {have} tokens, tokens has {n}: out must have shape "
                             f"{spec.shape(n)}")
    # What the final copy into it would refuse, refused here with the Cache's own errors
    # (a requires-grad or expanded out raised torch's RuntimeError).
    if out.requires_grad or out.is_inference() or (
            not out.is_contiguous() and may_overlap(out)):
        check_writable(out, "out")


def _sealed(t: torch.Tensor) -> bool:
    # empty_shared memory is sealed by construction: known without asking the kernel.
    return shared_segment(t) is not None or ipc.is_sealed(t)


def _tok_bytes(tokens: TokensLike) -> bytes:
    return token_bytes(tokens)


def connect(path: str, *, spec: KVSpec, namespace: str, chunk_size: int | None = None,
            tenant: str | None = None, timeout: float = 30.0,
            connect_timeout: float = 5.0) -> Client:
    """A client of the node server at ``path``: ``async with musacache.connect(...) as cache``.

    The server holds one cache per (``namespace``, ``spec``, ``chunk_size``, ``tenant``) and
    opens it on first use; this connection reaches that cache and no other. ``chunk_size``
    None takes the server's default. A server configured for one cache only
    (``max_caches=1``) refuses another with :class:`~musacache.FingerprintMismatchError`.
    """
    return Client(path, spec=spec, namespace=namespace, chunk_size=chunk_size, tenant=tenant,
                  timeout=timeout, connect_timeout=connect_timeout)

