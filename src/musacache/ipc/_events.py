"""Event IPC: "the data is ready" signals between processes.

An :class:`IpcEvent` is either

* a **host** event: a Linux ``eventfd`` whose fd travels over the Unix socket
  (``SCM_RIGHTS``) and is waited on through the event loop's reader, with no polling; or
* a **device** event: ``torch.cuda.Event(interprocess=True)`` (or ``torch.musa.Event``),
  exported by its IPC handle and waited on by polling ``query()`` with a growing backoff.

Where a device cannot export events (MUSA's interprocess events are unproven),
:meth:`IpcEvent.create` falls back to a host event and :meth:`IpcEvent.record` synchronises
the producer's stream before setting it, so consumers see the same meaning either way:
*once the event is set, everything queued before the record is done*.

Host event semantics (level-triggered, like ``threading.Event``): :meth:`~IpcEvent.set`
makes the event set until someone calls :meth:`~IpcEvent.clear`; :meth:`~IpcEvent.wait`
never consumes, so every waiter in every process wakes. :meth:`~IpcEvent.clear` returns how
many ``set()`` calls it consumed (the eventfd counter), so a consumer that clears after each
wait can tell whether the producer signalled more than once meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import select
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import anyio
import anyio.to_thread

from .. import devices
from .._errors import IPCError, ProtocolError
from ..devices import device_uuid, ipc_module, local_device_index, parse_device
from ._fdpass import wait_fd_readable
from ._memory import DEVICE_KINDS

__all__ = ["EventCapability", "IpcEvent", "event_ipc_capability"]

EventCapability = Literal["device", "host-fallback"]
EventMode = Literal["host", "device"]

# Failures a device backend raises while creating or exporting an interprocess event.
_BACKEND_ERRORS: Final = (RuntimeError, AttributeError, TypeError, NotImplementedError,
                          ValueError)

_capabilities: dict[str, EventCapability] = {}


def event_ipc_capability(device_kind: str) -> EventCapability:
    """``"device"`` if ``device_kind`` can export interprocess events, else ``"host-fallback"``.

    Probed once per kind at run time (create an interprocess event and export its handle) and
    cached; ``"cpu"`` is always ``"host-fallback"`` (there is no device event to export). The
    node server records the answer in its stats.
    """
    cached = _capabilities.get(device_kind)
    if cached is None:
        cached = _capabilities[device_kind] = _probe_capability(device_kind)
    return cached


def _probe_capability(device_kind: str) -> EventCapability:
    # One probe for the whole package: the device layer's (it exports a recorded event).
    if device_kind not in DEVICE_KINDS or device_kind == "cpu":
        return "host-fallback"
    return "device" if devices.capabilities(device_kind).event_ipc else "host-fallback"


def _reset_capability_cache() -> None:
    """Forget probed capabilities (tests swap device modules under the probe)."""
    _capabilities.clear()
    devices._reset_probes()


def _poll_readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        # Without /proc the check is impossible; the later reads would still fail cleanly.
        return True


class IpcEvent:
    """A "data ready" event shared between processes. Build with :meth:`create` (producer) or
    :meth:`from_wire` (consumer); close with :meth:`close` or ``with``.

    :meth:`wait` returns ``True`` once the event is set and ``False`` when ``timeout`` runs
    out: not ready yet is an ordinary outcome, not an error. It raises IPCError if the event
    is closed while waiting.
    """

    def __init__(self, *, mode: EventMode, device_kind: str, device_index: int | None = None,
                 fd: int | None = None, device_event: Any = None,
                 handle: bytes | None = None) -> None:
        # Private: use create() or from_wire().
        self.mode: EventMode = mode
        self.device_kind = device_kind
        self.device_index = device_index
        self._fd = fd
        self._device_event = device_event
        self._handle = handle
        self._waiters: set[int] = set()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def create(cls, device: Any = "cpu", *,
               mode: Literal["auto", "device", "host"] = "auto") -> IpcEvent:
        """A new event for data produced on ``device`` (``"cpu"``, ``"cuda:0"``, ``"musa:1"``,
        or a ``torch.device``).

        ``mode="auto"`` uses a device event where :func:`event_ipc_capability` says
        ``"device"`` and a host event otherwise; ``"host"`` forces the fallback (for example
        when the consumer cannot open device events); ``"device"`` raises IPCError if the
        device cannot export one.
        """
        if mode not in ("auto", "device", "host"):
            raise ValueError(f"mode must be 'auto', 'device' or 'host', got {mode!r}")
        kind, index = parse_device(device)
        use_device = kind != "cpu" and (
            mode == "device" or (mode == "auto" and event_ipc_capability(kind) == "device")
        )
        if not use_device:
            if kind == "cpu" and mode == "device":
                raise IPCError("a cpu event has no device form; use mode='auto' or 'host'")
            try:
                fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            except OSError as exc:
                raise IPCError(f"eventfd failed: {exc}") from exc
            return cls(mode="host", device_kind=kind, device_index=index, fd=fd)
        module = ipc_module(kind)
        try:
            if index is None:
                index = int(module.current_device())
            with module.device(index):
                event = module.Event(interprocess=True)
                handle = event.ipc_handle()
        except _BACKEND_ERRORS as exc:
            raise IPCError(f"{kind} cannot export interprocess events here ({exc}); create "
                           f"the event with mode='host'") from exc
        return cls(mode="device", device_kind=kind, device_index=index,
                   device_event=event, handle=bytes(handle))

    def export(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """``(wire dict, fds)`` for :meth:`from_wire` in the peer. The fds are borrowed: they
        stay valid while this event is open; send them, do not close them."""
        if self.mode == "host":
            return ({"mode": "host", "kind": self.device_kind, "nfds": 1}, (self._require_fd(),))
        if self._handle is None:
            raise IPCError("this device event was imported; only its creator can export it")
        return ({"mode": "device", "kind": self.device_kind, "index": self.device_index,
                 "uuid": device_uuid(self.device_kind, self.device_index or 0),
                 "handle": self._handle, "nfds": 0}, ())

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], fds: Sequence[int] = ()) -> IpcEvent:
        """Open a peer's exported event. Takes ownership of ``fds`` (closed on failure).

        Raises ProtocolError for a malformed dict and IPCError when the event cannot be
        opened here (no such device, not an eventfd).
        """
        adopted = False
        try:
            event = cls._from_wire(wire, fds)
            adopted = True
            return event
        finally:
            if not adopted:
                for fd in fds:
                    os.close(fd)

    @classmethod
    def _from_wire(cls, wire: Mapping[str, Any], fds: Sequence[int]) -> IpcEvent:
        if not isinstance(wire, Mapping):
            raise ProtocolError(f"an event must be a map, got {type(wire).__name__}")
        mode, kind = wire.get("mode"), wire.get("kind")
        if kind not in DEVICE_KINDS:
            raise ProtocolError(f"unknown device kind {kind!r:.50} in event")
        if mode == "host":
            if len(fds) != 1 or wire.get("nfds") != 1:
                raise ProtocolError(f"a host event needs exactly one fd, got {len(fds)}")
            fd = fds[0]
            if not _is_eventfd(fd):
                raise IPCError("the fd sent with a host event is not an eventfd")
            # The flag lives in the shared file description: make sure a read can never
            # block the loop, whatever the peer set.
            os.set_blocking(fd, False)
            return cls(mode="host", device_kind=kind, fd=fd)
        if mode == "device":
            index, uuid, handle = wire.get("index"), wire.get("uuid"), wire.get("handle")
            if (fds or type(handle) is not bytes or not handle
                    or not (index is None or type(index) is int)
                    or not (uuid is None or type(uuid) is str)):
                raise ProtocolError("malformed device event")
            module = ipc_module(kind)
            local = local_device_index(kind, index, uuid)
            try:
                event = module.Event.from_ipc_handle(local, handle)
            except _BACKEND_ERRORS as exc:
                raise IPCError(f"cannot open the peer's {kind} event ({exc}); ask the "
                               f"producer for a host event (mode='host')") from exc
            return cls(mode="device", device_kind=kind, device_index=local,
                       device_event=event)
        raise ProtocolError(f"unknown event mode {mode!r:.50}")

    # -- state ----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._fd is None and self._device_event is None

    def fileno(self) -> int | None:
        """The eventfd of a host event (None for device events and once closed)."""
        return self._fd

    def _require_fd(self) -> int:
        if self._fd is None:
            raise IPCError("the event is closed" if self.closed else
                           "set()/clear() are for host events; record() a device event")
        return self._fd

    def _require_device_event(self) -> Any:
        if self._device_event is None:
            raise IPCError("the event is closed")
        return self._device_event

    def set(self) -> None:
        """Signal a host event: it stays set until :meth:`clear`."""
        try:
            os.eventfd_write(self._require_fd(), 1)
        except BlockingIOError:
            pass  # the counter is at its maximum: the event is set already

    def clear(self) -> int:
        """Reset a host event; return how many set() calls it consumed (0 if it was clear)."""
        try:
            return os.eventfd_read(self._require_fd())
        except BlockingIOError:
            return 0

    def is_set(self) -> bool:
        """Whether the event is set now (a device event: its last record has completed)."""
        if self.mode == "host":
            return _poll_readable(self._require_fd())
        try:
            return bool(self._require_device_event().query())
        except _BACKEND_ERRORS as exc:
            raise IPCError(f"querying the {self.device_kind} event failed: {exc}") from exc

    # -- producing ------------------------------------------------------------------------

    def record_blocking(self, stream: Any = None) -> None:
        """Mark "everything queued on ``stream`` so far is ready" (default: current stream).

        Device events record on the stream and return at once. The host fallback of a
        device clears the event, synchronises the stream (this blocks: call it from a
        thread or synchronous producer code, or use :meth:`record`) and sets it. A cpu
        event is just set.
        """
        if self.mode == "device":
            try:
                self._require_device_event().record(stream)
            except _BACKEND_ERRORS as exc:
                raise IPCError(f"recording the {self.device_kind} event failed: {exc}") from exc
            return
        if self.device_kind == "cpu":
            self.set()
            return
        self.clear()
        self._synchronize(stream)
        self.set()

    async def record(self, stream: Any = None) -> None:
        """:meth:`record_blocking` without blocking the loop (the fallback's stream
        synchronisation runs in a worker thread)."""
        if self.mode == "device" or self.device_kind == "cpu":
            self.record_blocking(stream)
            return
        self.clear()
        await anyio.to_thread.run_sync(self._synchronize, stream)
        self.set()

    def _synchronize(self, stream: Any) -> None:
        try:
            if stream is None:
                stream = ipc_module(self.device_kind).current_stream(self.device_index)
            stream.synchronize()
        except _BACKEND_ERRORS as exc:
            raise IPCError(f"synchronising the {self.device_kind} stream failed: {exc}") from exc

    # -- consuming ------------------------------------------------------------------------

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until the event is set: True, or False after ``timeout`` seconds (None: no
        limit). Never blocks the loop; cancellation leaves nothing behind.

        (A ``timeout`` argument rather than an outer ``anyio.fail_after``: "not ready in
        time" is a value the caller branches on, not an exception.)
        """
        if timeout is not None and timeout <= 0:
            return self.is_set()
        with anyio.move_on_after(timeout):
            if self.mode == "host":
                await self._wait_host()
            else:
                await self._wait_device()
            return True
        return False

    async def _wait_host(self) -> None:
        fd = self._require_fd()
        if _poll_readable(fd):
            return
        # A private duplicate per waiter: the loop allows one reader per fd number, and
        # close() must not pull the fd out from under a waiting task.
        waiter = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        self._waiters.add(waiter)
        try:
            while not _poll_readable(waiter):
                try:
                    await wait_fd_readable(waiter)
                except anyio.ClosedResourceError:
                    raise IPCError("the event was closed while a task waited on it") from None
        finally:
            self._waiters.discard(waiter)
            os.close(waiter)

    async def _wait_device(self) -> None:
        await devices.poll_until(self.is_set, None)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the event (idempotent). Tasks blocked in :meth:`wait` raise IPCError."""
        for waiter in list(self._waiters):
            try:
                anyio.notify_closing(waiter)
            except RuntimeError:
                break  # not on the loop thread: no task of ours can be waiting
        fd, self._fd = self._fd, None
        self._device_event = None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> IpcEvent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return f"<IpcEvent {state} {self.device_kind}>"
