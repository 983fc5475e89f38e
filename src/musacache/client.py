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
import itertools
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from . import devices, ipc, transfer
from ._api import TokensLike
from ._engine import Hit
from ._errors import (
    CacheClosedError,
    CacheUnavailableError,
    InvalidInputError,
    IPCError,
    MusaCacheError,
    ShapeError,
)
from ._keys import as_tokens
from ._spec import KVSpec

__all__ = ["Client", "connect"]


class _LocalRegistration:
    def __init__(self, layout: str, kv_caches: Any, tensors: list[torch.Tensor],
                 paged: transfer.PagedKV) -> None:
        self.layout = layout
        self.kv_caches = kv_caches
        self.tensors = tensors
        self.paged = paged
        self.handles = [ipc.share(t) for t in tensors]
        self.remote: int | None = None  # the server's id for it on the current connection
        self.signature = _signature(tensors)


def _signature(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


class Client:
    """A connection to ``musacache serve``. Use ``async with connect(path, spec=..., ...)``."""

    def __init__(self, path: str, *, spec: KVSpec, namespace: str, chunk_size: int | None = None,
                 tenant: str | None = None, timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        if not isinstance(spec, KVSpec):
            raise InvalidInputError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidInputError(f"namespace must be a non-empty string, got {namespace!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise InvalidInputError(f"tenant must be a non-empty string or None, got {tenant!r}")
        if chunk_size is not None and (isinstance(chunk_size, bool)
                                       or not isinstance(chunk_size, int) or chunk_size <= 0):
            raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.path = str(path)
        self.spec = spec
        self.namespace = namespace
        self.tenant = tenant
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.server_info: dict[str, Any] = {}
        self._conn: ipc.Connection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[ipc.Reply]] = {}
        self._ids = itertools.count(1)
        self._regs: list[_LocalRegistration] = []
        self._connect_lock = anyio.Lock()
        self._staging: list[torch.Tensor] = []
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

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError("the client is closed" if self._state == "closed"
                                   else "the client is not open: use `async with connect(...)`")

    async def _ensure(self) -> ipc.Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        async with self._connect_lock:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            return await self._connect()

    async def _connect(self) -> ipc.Connection:
        try:
            with anyio.fail_after(self.connect_timeout):
                conn = await ipc.Connection.connect(self.path, expect="reply")
        except (OSError, TimeoutError) as e:
            raise CacheUnavailableError(f"cannot reach musacache server at {self.path}: {e}") \
                from e
        if self._connected_once:
            self.reconnects += 1
        self._connected_once = True
        self._conn = conn
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(conn))
        try:
            self.server_info = await self._request(conn, "hello", {
                "protocol": ipc.PROTOCOL_VERSION, "namespace": self.namespace,
                "spec": self.spec.to_dict(), "chunk_size": self.chunk_size,
                "tenant": self.tenant})
            for reg in self._regs:
                reg.remote = None
                await self._register_remote(conn, reg)
        except BaseException:
            await self._drop("hello failed")
            raise
        return conn

    async def _drop(self, why: str) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._fail_pending(why)

    def _fail_pending(self, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(CacheUnavailableError(why))

    async def _read_loop(self, conn: ipc.Connection) -> None:
        why = "the server closed the connection"
        try:
            while True:
                frame = await conn.receive()
                if frame is None:
                    break
                if not isinstance(frame, ipc.Reply):
                    ipc.close_fds(frame.fds)
                    continue
                ipc.close_fds(frame.fds)
                if frame.id is None:
                    # An error about the connection itself (refused, bad frame): fail everyone.
                    why = str(ipc.error_from_wire(frame.error)) if frame.error else why
                    self._fail_with(ipc.error_from_wire(frame.error) if frame.error else None, why)
                    continue
                fut = self._pending.pop(frame.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frame)
        except (MusaCacheError, OSError) as e:
            why = f"connection to the server lost: {e}"
        finally:
            if self._conn is conn:
                self._conn = None
            await conn.aclose()
            self._fail_pending(why)

    def _fail_with(self, exc: MusaCacheError | None, why: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc if exc is not None else CacheUnavailableError(why))

    async def _request(self, conn: ipc.Connection, op: str, args: dict[str, Any],
                       fds: Sequence[int] = ()) -> Any:
        rid = next(self._ids)
        fut: asyncio.Future[ipc.Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            with anyio.fail_after(self.timeout):
                await conn.send_request(rid, op, args, fds)
                reply = await fut
        except TimeoutError:
            # A server that does not answer in time is treated as gone: reconnect next call.
            await self._drop(f"{op} got no answer within {self.timeout} s")
            raise CacheUnavailableError(
                f"musacache server at {self.path} did not answer {op} within {self.timeout} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
        return reply.unwrap()

    async def _call(self, op: str, args: dict[str, Any], fds: Sequence[int] = ()) -> Any:
        self._check_open()
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
        dense = kv.narrow(self.spec.token_dim, 0, len(toks))
        raw: torch.Tensor | None = None
        if not ipc.is_sealed(dense):
            # One copy into sealed shared memory (private memory cannot be mapped, and the
            # server refuses memory that could shrink under it); the server then copies once
            # into its tier.
            raw = self._take_staging(self.spec.nbytes(len(toks)))
            staged = raw[:self.spec.nbytes(len(toks))].view(self.spec.dtype).view(
                self.spec.shape(len(toks)))
            await _copy(staged, dense)
            dense = staged
        try:
            handle = ipc.share(dense)
            return int(await self._call("put", {"tokens": toks.tobytes(), "kv": handle.to_wire()},
                                        handle.fds))
        finally:
            if raw is not None:
                self._give_staging(raw)

    async def get(self, tokens: TokensLike, out: torch.Tensor | None = None) -> Hit:
        self._check_open()
        toks = as_tokens(tokens)
        n = len(toks)
        if out is not None:
            have = self.spec.check_dense(out, what="out")
            if have != n:
                raise ShapeError(f"out holds {have} tokens, tokens has {n}: out must have shape "
                                 f"{self.spec.shape(n)}")
        td = self.spec.token_dim
        target = out if out is not None and ipc.is_sealed(out) else \
            ipc.empty_shared(self.spec.shape(n), self.spec.dtype)
        if n == 0:
            return Hit(0, target.narrow(td, 0, 0), {})
        handle = ipc.share(target)
        res = await self._call("get", {"tokens": toks.tobytes(), "out": handle.to_wire()},
                               handle.fds)
        got = int(res["num_tokens"])
        if out is not None and target is not out:
            await _copy(out.narrow(td, 0, got), target.narrow(td, 0, got))
            target = out
        return Hit(got, target.narrow(td, 0, got), dict(res.get("tiers") or {}))

    # -- paged caches -------------------------------------------------------------------------

    async def register_kv_caches(self, kv_caches: Any, layout: str = "vllm") -> int:
        """Share the worker's paged KV caches with the server once (zero copy).

        CPU caches must live in sealed shared memory: allocate them with
        ``musacache.ipc.empty_shared`` (torch's ``share_memory_()`` memory is refused: its
        owner could shrink it under the server's mapping). Returns a registration number for
        ``store``/``retrieve`` (the last registration is the default).
        """
        self._check_open()
        paged = transfer.describe(kv_caches, layout)
        if paged.spec() != self.spec:
            raise InvalidInputError(f"kv_caches hold {paged.spec().describe()}, this client "
                                    f"was opened for {self.spec.describe()}")
        tensors = _flatten(kv_caches, layout)
        for t in tensors:
            if not ipc.is_shareable(t):
                raise IPCError("kv_caches live in private memory the server cannot map; "
                               "allocate them with musacache.ipc.empty_shared(shape, dtype)")
            if not ipc.is_sealed(t):
                raise IPCError("kv_caches live in shared memory that is not sealed against "
                               "shrinking (share_memory_()), which the server refuses; "
                               "allocate them with musacache.ipc.empty_shared(shape, dtype)")
        reg = _LocalRegistration(layout, kv_caches, tensors, paged)
        conn = await self._ensure()
        await self._register_remote(conn, reg)
        self._regs.append(reg)
        return len(self._regs) - 1

    async def _register_remote(self, conn: ipc.Connection, reg: _LocalRegistration) -> None:
        fds = [fd for h in reg.handles for fd in h.fds]
        res = await self._request(conn, "register", {
            "layout": reg.layout, "handles": [h.to_wire() for h in reg.handles]}, fds)
        reg.remote = int(res["reg"])

    def _find_reg(self, kv_caches: Any, layout: str | None, reg: int | None,
                  ) -> _LocalRegistration:
        if kv_caches is not None:
            sig = _signature(_flatten(kv_caches, layout or "vllm"))
            for r in self._regs:
                if r.signature == sig and (layout is None or r.layout == layout):
                    return r
            raise InvalidInputError("these kv_caches are not registered: call "
                                    "register_kv_caches(kv_caches, layout) once first")
        if not self._regs:
            raise InvalidInputError("no kv_caches registered: call register_kv_caches first")
        if reg is None:
            return self._regs[-1]
        if not 0 <= reg < len(self._regs):
            raise InvalidInputError(f"no registration {reg}")
        return self._regs[reg]

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
        r = self._find_reg(kv_caches, layout, reg)
        toks = as_tokens(tokens)
        slots = transfer._as_slots(slot_mapping, len(toks))
        transfer._check_slot_range(slots, r.paged.num_slots)
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
        if r.remote is None:
            await self._register_remote(conn, r)
        call["reg"] = r.remote
        return int(await self._request(conn, op, call, fds))

    # -- staging buffers for dense tensors in private memory ------------------------------------

    def _take_staging(self, nbytes: int) -> torch.Tensor:
        """A shared uint8 buffer of at least ``nbytes``, reused across calls (one per call in
        flight, so concurrent puts never share one)."""
        for i, buf in enumerate(self._staging):
            if buf.numel() >= nbytes:
                return self._staging.pop(i)
        return ipc.empty_shared((nbytes,), torch.uint8)

    def _give_staging(self, buf: torch.Tensor) -> None:
        if len(self._staging) < 4:
            self._staging.append(buf)


def _flatten(kv_caches: Any, layout: str) -> list[torch.Tensor]:
    if layout == "sglang":
        k, v = kv_caches
        return list(k) + list(v)
    return list(kv_caches)


def _tok_bytes(tokens: TokensLike) -> bytes:
    return as_tokens(tokens).tobytes()


async def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() * dst.element_size() < (1 << 20):
        dst.copy_(src)
    else:
        await anyio.to_thread.run_sync(dst.copy_, src)


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

