"""``musacache serve``: the node server.

One process owns the tiers of a node. Workers in other processes connect over a Unix socket
(:func:`musacache.connect`), register their paged KV caches once through memory IPC, and from
then on a ``store`` or ``retrieve`` sends only metadata: the server waits on the worker's
ready event without blocking its loop, then gathers from (or scatters into) the worker's pages
directly. Dense ``put``/``get`` pass a shared tensor handle, never the bytes.

The wire protocol is in ``docs/protocol.md``; the ops are the ``_op_*`` methods below.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import stat
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from . import ipc, transfer
from ._config import CacheConfig
from ._engine import Cache
from ._errors import (
    CacheUnavailableError,
    ConfigError,
    FingerprintMismatchError,
    InvalidInputError,
    MusaCacheError,
    PermissionDeniedError,
    ProtocolError,
)
from ._keys import Fingerprint
from ._spec import KVSpec
from ._version import __version__

__all__ = ["OPS", "Server", "ServerConfig", "main"]

log = logging.getLogger("musacache.server")

#: Every op a client may send (the decoder refuses others before they reach a handler).
OPS = ("hello", "register", "unregister", "put", "get", "lookup", "prefetch", "store",
       "retrieve", "delete", "clear", "flush", "stats", "stage_bytes", "put_staged")


@dataclass(frozen=True)
class ServerConfig:
    """The node server: where it listens, who may connect, and the cache it serves.

    ``allow_uids`` adds uids besides the server's own that may connect (checked with
    SO_PEERCRED on every connection). ``max_frame_size`` bounds one protocol frame; only the
    baseline byte path (``stage_bytes``) sends large frames.
    """

    socket_path: str
    cache: CacheConfig
    allow_uids: tuple[int, ...] = ()
    max_frame_size: int = 64 * 1024**2 + 4096
    max_connections: int = 512
    #: Longest wait for a worker's ready event (seconds).
    ready_timeout: float = 60.0

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], socket_path: str | None = None,
                  ) -> ServerConfig:
        """A cache config file (docs/configuration.md) with an optional ``[server]`` table:
        ``socket``, ``allow_uids``, ``max_frame_size``, ``max_connections``, ``ready_timeout``."""
        import tomllib

        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read server config {path}: {e}") from e
        server = dict(data.pop("server", {}))
        sock = socket_path or server.pop("socket", None)
        server.pop("socket", None)
        if not sock:
            raise ConfigError("no socket path: pass --socket or set [server] socket")
        known = {"allow_uids", "max_frame_size", "max_connections", "ready_timeout"}
        unknown = set(server) - known
        if unknown:
            raise ConfigError(
                f"[server]: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
        if "allow_uids" in server:
            server["allow_uids"] = tuple(int(u) for u in server["allow_uids"])
        return cls(socket_path=str(sock), cache=CacheConfig.from_dict(data), **server)


@dataclass
class _Registration:
    layout: str
    kv_caches: Any
    imports: list[ipc.ImportedTensor]
    paged: transfer.PagedKV


@dataclass(eq=False)
class _Peer:
    """What one connection holds: its mappings, events and registrations."""

    pid: int
    uid: int
    table: ipc.MappingTable = field(default_factory=ipc.MappingTable)
    regs: dict[int, _Registration] = field(default_factory=dict)
    next_reg: int = 1
    staged: torch.Tensor | None = None
    hello: bool = False


class Server:
    """Run with ``async with Server(config) as server: await server.serve_forever()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.cache = Cache(config.cache)
        self._listener: socket.socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._peers: set[_Peer] = set()
        self._stopped = anyio.Event()
        self.counters = dict.fromkeys(
            ("connections", "refused", "requests", "errors", "bad_frames", "bytes_copied",
             "bytes_received"), 0)

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        await self.cache.open()
        try:
            self._listener = _listen(self.config.socket_path)
        except BaseException:
            await self.cache.aclose()
            raise
        log.info("musacache %s serving on %s", __version__, self.config.socket_path)

    async def serve_forever(self) -> None:
        """Accept connections until :meth:`stop` (or cancellation)."""
        if self._listener is None:
            raise CacheUnavailableError("the server is not started")
        listener = self._listener
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._accept_loop, listener)
            await self._stopped.wait()
            tg.cancel_scope.cancel()

    def stop(self) -> None:
        self._stopped.set()

    async def aclose(self) -> None:
        self.stop()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        for peer in list(self._peers):
            self._release_peer(peer)
        await self.cache.aclose()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            if len(self._peers) >= self.config.max_connections:
                self.counters["refused"] += 1
                log.warning("refusing a connection: %d connections open", len(self._peers))
                sock.close()
                continue
            if self._tg is not None:
                self._tg.start_soon(self._serve_peer_guarded, sock)

    async def _serve_peer_guarded(self, sock: socket.socket) -> None:
        # One peer's failure must never take the accept loop (and everyone else) down.
        try:
            await self._serve_peer(sock)
        except Exception:
            log.exception("connection handler failed")

    # -- one connection ---------------------------------------------------------------------

    async def _serve_peer(self, sock: socket.socket) -> None:
        try:
            creds = ipc.peer_credentials(sock)
        except Exception as e:  # not a Unix socket peer we can identify
            log.warning("refusing a peer without credentials: %r", e)
            sock.close()
            return
        conn = ipc.Connection(sock, max_frame_size=self.config.max_frame_size,
                              expect="request", ops=OPS)
        allowed = {os.getuid(), *self.config.allow_uids}
        if creds.uid not in allowed:
            self.counters["refused"] += 1
            log.warning("refused pid %d uid %d: not the server's uid nor in allow_uids",
                        creds.pid, creds.uid)
            with anyio.move_on_after(1):
                await conn.send_error(None, PermissionDeniedError(
                    f"uid {creds.uid} may not use this musacache server"))
            await conn.aclose()
            return
        peer = _Peer(pid=creds.pid, uid=creds.uid)
        self._peers.add(peer)
        self.counters["connections"] += 1
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    try:
                        frame = await conn.receive()
                    except ipc.FrameError as e:
                        self.counters["bad_frames"] += 1
                        log.warning("bad frame from pid %d: %s", peer.pid, e)
                        if e.fatal:
                            break
                        with anyio.move_on_after(1):
                            await conn.send_error(e.request_id, e)
                        continue
                    except CacheUnavailableError:
                        break
                    if frame is None:
                        break
                    if not isinstance(frame, ipc.Request):
                        ipc.close_fds(frame.fds)
                        self.counters["bad_frames"] += 1
                        continue
                    tg.start_soon(self._dispatch, conn, peer, frame)
                # The peer is gone (or broke the protocol): its in-flight ops are cancelled,
                # which releases their pins in the cache.
                tg.cancel_scope.cancel()
        finally:
            self._release_peer(peer)
            await conn.aclose()

    def _release_peer(self, peer: _Peer) -> None:
        peer.regs.clear()
        peer.staged = None
        peer.table.close_all()
        self._peers.discard(peer)

    async def _dispatch(self, conn: ipc.Connection, peer: _Peer, req: ipc.Request) -> None:
        self.counters["requests"] += 1
        fds = list(req.fds)
        try:
            handler: Callable[[_Peer, Mapping[str, Any], list[int]], Awaitable[Any]] = getattr(
                self, f"_op_{req.op}")
            if req.op != "hello" and not peer.hello:
                raise ProtocolError("the first request on a connection must be hello")
            result = await handler(peer, req.args, fds)
        except MusaCacheError as e:
            self.counters["errors"] += 1
            ipc.close_fds(fds)
            await self._reply_error(conn, req.id, e)
            return
        except (KeyError, TypeError, ValueError) as e:
            self.counters["errors"] += 1
            ipc.close_fds(fds)
            await self._reply_error(
                conn, req.id, ProtocolError(f"bad arguments to {req.op}: {e!r}"))
            return
        except Exception as e:  # a server bug: answer, log, keep serving everyone else
            self.counters["errors"] += 1
            ipc.close_fds(fds)
            log.exception("op %s failed", req.op)
            await self._reply_error(conn, req.id, e)
            return
        ipc.close_fds(fds)  # whatever a handler did not take
        try:
            await conn.send_reply(req.id, result)
        except (CacheUnavailableError, OSError):
            pass  # the peer went away; its cleanup runs in _serve_peer

    @staticmethod
    async def _reply_error(conn: ipc.Connection, rid: int, e: BaseException) -> None:
        try:
            await conn.send_error(rid, e)
        except (CacheUnavailableError, OSError):
            pass

    # -- ops --------------------------------------------------------------------------------

    async def _op_hello(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        version = args.get("protocol")
        if version != ipc.PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol {version}, server "
                                f"{ipc.PROTOCOL_VERSION}")
        if not args.get("monitor"):
            theirs = Fingerprint(str(args["namespace"]), KVSpec.from_dict(args["spec"]),
                                 int(args.get("chunk_size") or self.config.cache.chunk_size))
            ours = self.cache.fingerprint
            if theirs != ours:
                raise FingerprintMismatchError(
                    f"client wants {theirs.describe()}, this server caches {ours.describe()}")
        peer.hello = True
        return {"server": __version__, "protocol": ipc.PROTOCOL_VERSION,
                "namespace": self.config.cache.namespace,
                "spec": self.config.cache.spec.to_dict(),
                "chunk_size": self.config.cache.chunk_size,
                "device": str(self.cache.device),
                "event_ipc": {k: ipc.event_ipc_capability(k)
                              for k in ("cpu", "cuda", "musa")}}

    async def _op_register(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        layout = str(args["layout"])
        wires = args["handles"]
        if not isinstance(wires, list) or not wires:
            raise ProtocolError("register needs a non-empty list of handles")
        handles = [ipc.TensorHandle.from_wire(w) for w in wires]
        if sum(h.num_fds for h in handles) != len(fds):
            raise ProtocolError(f"register: the handles need {sum(h.num_fds for h in handles)} "
                                f"fds, the frame carried {len(fds)}")
        imports: list[ipc.ImportedTensor] = []
        try:
            for h in handles:
                mine = [fds.pop(0) for _ in range(h.num_fds)]
                imports.append(await peer.table.aopen_tensor(h, mine))
            tensors = [imp.tensor for imp in imports]
            kv_caches: Any = tensors
            if layout == "sglang":
                half = len(tensors) // 2
                kv_caches = (tensors[:half], tensors[half:])
            paged = transfer.describe(kv_caches, layout)
            if paged.spec() != self.cache.spec:
                raise InvalidInputError(f"registered caches hold {paged.spec().describe()}, "
                                        f"this server caches {self.cache.spec.describe()}")
        except BaseException:
            for imp in imports:
                imp.close()
            raise
        reg = peer.next_reg
        peer.next_reg += 1
        peer.regs[reg] = _Registration(layout, kv_caches, imports, paged)
        return {"reg": reg, "num_slots": paged.num_slots}

    async def _op_unregister(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        reg = peer.regs.pop(int(args["reg"]), None)
        if reg is None:
            raise InvalidInputError(f"no registration {args['reg']!r} on this connection")
        for imp in reg.imports:
            imp.close()
        return True

    def _reg(self, peer: _Peer, args: Mapping[str, Any]) -> _Registration:
        reg = peer.regs.get(int(args["reg"]))
        if reg is None:
            raise InvalidInputError(f"no registration {args['reg']!r}: call register_kv_caches")
        return reg

    async def _ready(self, peer: _Peer, args: Mapping[str, Any], fds: list[int],
                     key: str) -> ipc.IpcEvent | None:
        wire = args.get(key)
        if wire is None:
            return None
        n = int(wire.get("nfds", 0))
        mine = [fds.pop(0) for _ in range(n)]
        return peer.table.open_event(wire, mine)

    async def _op_store(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        reg = self._reg(peer, args)
        ready = await self._ready(peer, args, fds, "ready")
        try:
            before = self._tier_bytes_in()
            n = await self.cache.store(
                _tokens(args), reg.kv_caches, _slots(args), layout=reg.layout,
                skip_prefix=int(args.get("skip_prefix", 0)), ready=ready,
                ready_timeout=self.config.ready_timeout)
            self.counters["bytes_copied"] += self._tier_bytes_in() - before
            return n
        finally:
            if ready is not None:
                peer.table.close_event(ready)

    async def _op_retrieve(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        reg = self._reg(peer, args)
        ready = await self._ready(peer, args, fds, "ready")
        done = await self._ready(peer, args, fds, "done")
        try:
            n = await self.cache.retrieve(
                _tokens(args), reg.kv_caches, _slots(args), layout=reg.layout,
                skip_prefix=int(args.get("skip_prefix", 0)), ready=ready,
                ready_timeout=self.config.ready_timeout)
            self.counters["bytes_copied"] += self.cache.spec.nbytes(n)
            if done is not None:
                done.set()
            return n
        finally:
            for ev in (ready, done):
                if ev is not None:
                    peer.table.close_event(ev)

    async def _open_dense(self, peer: _Peer, args: Mapping[str, Any], fds: list[int],
                          key: str) -> ipc.ImportedTensor:
        handle = ipc.TensorHandle.from_wire(args[key])
        mine = [fds.pop(0) for _ in range(handle.num_fds)]
        return await peer.table.aopen_tensor(handle, mine)

    async def _op_put(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        imp = await self._open_dense(peer, args, fds, "kv")
        try:
            before = self._tier_bytes_in()
            n = await self.cache.put(_tokens(args), imp.tensor)
            self.counters["bytes_copied"] += self._tier_bytes_in() - before
            return n
        finally:
            imp.close()

    async def _op_get(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        imp = await self._open_dense(peer, args, fds, "out")
        try:
            hit = await self.cache.get(_tokens(args), out=imp.tensor)
            self.counters["bytes_copied"] += self.cache.spec.nbytes(hit.num_tokens)
            return {"num_tokens": hit.num_tokens, "tiers": hit.tiers}
        finally:
            imp.close()

    async def _op_lookup(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        return await self.cache.lookup(_tokens(args))

    async def _op_prefetch(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        timeout = args.get("timeout")
        return await self.cache.prefetch(_tokens(args),
                                         timeout=None if timeout is None else float(timeout))

    async def _op_delete(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        return await self.cache.delete(_tokens(args))

    async def _op_clear(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        await self.cache.clear()
        return True

    async def _op_flush(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        await self.cache.flush()
        return True

    async def _op_stats(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        return self.stats()

    # The baseline byte path, kept for `musacache bench ipc`: the worker gathers its KV into a
    # buffer and sends the bytes through the socket; the server copies them into a staging
    # tensor and then puts that. Three copies of the payload, against one for `store`.
    async def _op_stage_bytes(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        total = int(args["total"])
        offset = int(args["offset"])
        data = args["data"]
        if not isinstance(data, bytes) or not 0 <= offset <= offset + len(data) <= total:
            raise ProtocolError("stage_bytes: data must be bytes inside [0, total)")
        if total > 1 << 40:
            raise ProtocolError("stage_bytes: total is absurd")
        if peer.staged is None or peer.staged.numel() != total:
            peer.staged = torch.empty(total, dtype=torch.uint8)
        staged = peer.staged
        if data:
            src = np.frombuffer(data, dtype=np.uint8)
            await anyio.to_thread.run_sync(
                lambda: np.copyto(staged[offset:offset + len(data)].numpy(), src))
        self.counters["bytes_received"] += len(data)
        self.counters["bytes_copied"] += len(data)
        return len(data)

    async def _op_put_staged(self, peer: _Peer, args: Mapping[str, Any], fds: list[int]) -> Any:
        toks = _tokens(args)
        spec = self.cache.spec
        if peer.staged is None or peer.staged.numel() != spec.nbytes(len(toks)):
            raise InvalidInputError("put_staged: the staged bytes do not hold these tokens")
        kv = peer.staged.view(spec.dtype).view(spec.shape(len(toks)))
        before = self._tier_bytes_in()
        n = await self.cache.put(toks, kv)
        self.counters["bytes_copied"] += self._tier_bytes_in() - before
        peer.staged = None
        return n

    def _tier_bytes_in(self) -> int:
        return sum(int(t["bytes_in"]) for t in self.cache.stats()["tiers"].values())

    def stats(self) -> dict[str, Any]:
        st = self.cache.stats()
        st["server"] = {
            **self.counters,
            "version": __version__,
            "socket": self.config.socket_path,
            "peers": len(self._peers),
            "registrations": sum(len(p.regs) for p in self._peers),
            "open_mappings": sum(p.table.open_mappings for p in self._peers),
            "open_events": sum(p.table.open_events for p in self._peers),
            "open_fds": _count_fds(),
            "event_ipc": {k: ipc.event_ipc_capability(k) for k in ("cpu", "cuda", "musa")},
        }
        return st


def _tokens(args: Mapping[str, Any]) -> np.ndarray:
    raw = args["tokens"]
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise ProtocolError("tokens must be little-endian int32 bytes")
    return np.frombuffer(raw, dtype="<i4").copy()


def _slots(args: Mapping[str, Any]) -> torch.Tensor:
    raw = args["slots"]
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise ProtocolError("slots must be little-endian int64 bytes")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i8").copy())


def _count_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path``: mode 0600 in a directory of mode 0700."""
    sock_path = Path(path)
    parent = sock_path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = parent.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {parent} belongs to uid {st.st_uid}, not us")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(parent, 0o700)
    if sock_path.exists() or sock_path.is_symlink():
        if not stat.S_ISSOCK(sock_path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            sock_path.unlink()  # a stale socket of a dead server
        else:
            raise ConfigError(f"another server is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="musacache serve",
        description="Run the musacache node server: it owns the tiers of this node, and "
                    "workers reach it with musacache.connect(SOCKET, spec=..., namespace=...).")
    p.add_argument("--socket", help="Unix socket path (its directory is made mode 0700)")
    p.add_argument("--config", required=True,
                   help="TOML file: the cache settings (docs/configuration.md) plus an "
                        "optional [server] table")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServerConfig.from_toml(args.config, socket_path=args.socket)
    except MusaCacheError as e:
        print(f"musacache serve: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        async with Server(config) as server:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, server.stop)
            print(f"musacache serve: listening on {config.socket_path}", flush=True)
            await server.serve_forever()

    try:
        asyncio.run(run())
    except MusaCacheError as e:
        print(f"musacache serve: {e}", file=sys.stderr)
        return 1
    return 0
