"""The device layer: cpu, cuda and musa behind one small interface.

Everything accelerator-specific goes through :func:`accelerator_module`, which returns
``torch.cuda`` or ``torch.musa`` (the latter only where ``torch_musa`` is installed; it is
imported lazily, never at package import). Both follow the same API, so the code paths are
shared and their dispatch is tested on the CPU with a fake module.

Capabilities are probed at run time and cached; :func:`capabilities` reports them (they also
appear in ``Cache.stats()``).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import anyio
import torch

from ._errors import ConfigError, DeviceError, IPCError, ReadyTimeoutError

__all__ = [
    "ACCELERATORS",
    "Capabilities",
    "DeviceEvent",
    "HostEvent",
    "ReadyEvent",
    "accelerator_module",
    "alloc_host",
    "available",
    "capabilities",
    "copy_stream",
    "current_stream",
    "default_device",
    "has_accelerator",
    "record_event",
    "resolve",
    "side_stream",
    "stream_context",
    "stream_switch",
    "synchronize",
    "usable_cpus",
    "wait_event",
    "wait_for",
    "wait_ready",
]

ACCELERATORS = ("cuda", "musa")
_KINDS = ("cpu", *ACCELERATORS)

# Tests replace entries here with fakes; None means "probe it".
_module_overrides: dict[str, ModuleType | None] = {}
_caps_cache: dict[str, Capabilities] = {}
_probe_lock = threading.Lock()


def _reset_probes() -> None:
    """Forget cached probes (used by tests that install fake accelerator modules)."""
    _caps_cache.clear()
    _copy_streams.clear()


def accelerator_module(kind: str) -> ModuleType | None:
    """``torch.cuda`` / ``torch.musa`` if that backend is importable, else None."""
    if kind in _module_overrides:
        return _module_overrides[kind]
    if kind == "cuda":
        return torch.cuda
    if kind == "musa":
        mod = getattr(torch, "musa", None)
        if mod is None:
            try:
                importlib.import_module("torch_musa")  # registers torch.musa and device "musa"
            except Exception:  # not installed, or installed against another torch
                return None
            mod = getattr(torch, "musa", None)
        return mod
    return None


def _module(device: torch.device) -> ModuleType:
    """``device``'s accelerator module (``torch.cuda`` or ``torch.musa``); DeviceError if it
    is not available here."""
    mod = accelerator_module(device.type)
    if mod is None:
        raise DeviceError(f"{device.type} is not available")
    return mod


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the system has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # sched_getaffinity is Linux-only
        return max(1, os.cpu_count() or 1)


def available(kind: str) -> bool:
    """Whether at least one device of ``kind`` can be used now."""
    if kind == "cpu":
        return True
    mod = accelerator_module(kind)
    if mod is None:
        return False
    try:
        return bool(mod.is_available()) and int(mod.device_count()) > 0
    except Exception:
        return False


def has_accelerator() -> bool:
    return any(available(k) for k in ACCELERATORS)


def default_device() -> torch.device:
    """cuda if present, else musa if present, else cpu."""
    for kind in ACCELERATORS:
        if available(kind):
            return torch.device(kind, 0)
    return torch.device("cpu")


def resolve(device: str | torch.device | None = "auto") -> torch.device:
    """Turn ``"auto"``, ``"cuda"``, ``"musa:1"``, ``"cpu"`` into a usable torch.device."""
    if device is None or device == "auto":
        return default_device()
    try:
        dev = torch.device(device) if isinstance(device, str) else device
    except RuntimeError:
        # torch rejects "musa" until torch_musa is imported; probe and retry once.
        kind = str(device).split(":", 1)[0]
        if kind in ACCELERATORS and accelerator_module(kind) is not None:
            dev = torch.device(device)
        elif kind in ACCELERATORS:
            raise DeviceError(f"device {device!r} is not available on this machine"
                              + (" (musa needs torch_musa)" if kind == "musa" else "")
                              ) from None
        else:
            raise ConfigError(
                f"unknown device {device!r}; use auto, cpu, cuda[:i] or musa[:i]") from None
    if dev.type not in _KINDS:
        raise ConfigError(f"unsupported device type {dev.type!r}; use cpu, cuda or musa")
    if not available(dev.type):
        raise DeviceError(f"device {dev} is not available on this machine")
    if dev.type != "cpu":
        mod = accelerator_module(dev.type)
        index = 0 if dev.index is None else dev.index
        if mod is not None and index >= int(mod.device_count()):
            raise DeviceError(f"device {dev} does not exist: {mod.device_count()} visible")
        dev = torch.device(dev.type, index)
    return dev


@dataclass(frozen=True)
class Capabilities:
    """What a device kind can do here, probed at run time."""

    kind: str
    available: bool
    device_count: int
    pinned_memory: bool
    streams: bool
    events: bool
    memory_ipc: bool
    event_ipc: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def capabilities(kind: str) -> Capabilities:
    """Probe (once) and return what ``kind`` supports."""
    with _probe_lock:
        cached = _caps_cache.get(kind)
        if cached is not None:
            return cached
        caps = _probe(kind)
        _caps_cache[kind] = caps
        return caps


def _probe(kind: str) -> Capabilities:
    if kind == "cpu":
        # Pinned host memory needs an accelerator runtime; the CPU build of torch raises.
        return Capabilities("cpu", True, 1, has_accelerator(), False, False, True, False)
    if kind not in ACCELERATORS:
        raise ConfigError(f"unknown device kind {kind!r}")
    mod = accelerator_module(kind)
    if mod is None or not available(kind):
        return Capabilities(kind, False, 0, False, False, False, False, False)
    storage_cls = torch.UntypedStorage
    memory_ipc = hasattr(storage_cls, f"_new_shared_{kind}") and hasattr(
        storage_cls, f"_share_{kind}_")
    event_ipc = _probe_event_ipc(mod)
    return Capabilities(kind, True, int(mod.device_count()), True,
                        hasattr(mod, "Stream"), hasattr(mod, "Event"), memory_ipc, event_ipc)


def _probe_event_ipc(mod: ModuleType) -> bool:
    """Interprocess events are unproven on MUSA: try to export one, fall back if it fails."""
    try:
        ev = mod.Event(interprocess=True)
        ev.record()
        handle = ev.ipc_handle()
        return bool(handle)
    except Exception:
        return False


# -- device identity for IPC (musacache.ipc) -------------------------------------------
# Kinds are strings here, not torch.device: without torch_musa, torch.device("musa") does not
# parse, yet a peer's handle naming a MUSA device must still be decoded (and refused cleanly).


def ipc_module(kind: str) -> ModuleType:
    """:func:`accelerator_module` for IPC: the module, or DeviceError saying why there is none."""
    if kind not in ACCELERATORS:
        raise DeviceError(f"device kind {kind!r} is not an accelerator")
    mod = accelerator_module(kind)
    if mod is None:
        if kind == "musa":
            raise DeviceError("a MUSA device was named but torch_musa is not installed (or "
                              "does not load) in this process")
        raise DeviceError(f"{kind} is not available in this process")
    return mod


def parse_device(device: torch.device | str) -> tuple[str, int | None]:
    """Split ``"cuda:1"`` / ``torch.device("musa", 0)`` / ``"cpu"`` into ``(kind, index)``."""
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        if rest and not rest.isdigit():
            raise DeviceError(f"cannot parse device {device!r}; use 'cpu', 'cuda:N' or 'musa:N'")
        index = int(rest) if rest else None
    else:
        raise DeviceError(f"expected a torch.device or a string, got {type(device).__name__}")
    if kind not in _KINDS:
        raise DeviceError(f"device kind {kind!r} has no IPC support; use one of {_KINDS}")
    return kind, index


def device_uuid(kind: str, index: int) -> str | None:
    """A stable identity of device ``index`` (its UUID), or None where the backend has none.

    The index alone is not an identity across processes: two processes with different
    ``CUDA_VISIBLE_DEVICES`` / ``MUSA_VISIBLE_DEVICES`` number the same GPU differently.
    """
    try:
        props = ipc_module(kind).get_device_properties(index)
    except (RuntimeError, AttributeError, AssertionError, DeviceError):
        # Backends without properties (or without a UUID in them) fall back to index matching.
        return None
    uuid = getattr(props, "uuid", None)
    return None if uuid is None else str(uuid)


def local_device_index(kind: str, index: int | None, uuid: str | None) -> int:
    """The index, in this process, of a peer's device ``(index, uuid)``.

    The UUID wins when both sides know it; otherwise the peer's index is trusted. Raises
    IPCError when the device is not visible here.
    """
    count = int(ipc_module(kind).device_count())
    if uuid is not None:
        for local in range(count):
            if device_uuid(kind, local) == uuid:
                return local
        if any(device_uuid(kind, local) is not None for local in range(count)):
            raise IPCError(
                f"the exporter's {kind} device {uuid} is not visible in this process "
                f"(check {kind.upper()}_VISIBLE_DEVICES on both sides)")
    if index is None or not 0 <= index < count:
        raise IPCError(f"the exporter's {kind} device index {index} does not exist here "
                       f"({count} {kind} device(s) visible)")
    return index


# The driver libraries and entry points that say which allocation holds a device address:
# CUDA's driver API, and MUSA's, which mirrors it name for name (``cu`` -> ``mu``).
_RANGE_CALLS = {
    "cuda": (("libcuda.so.1", "libcuda.so"), ("cuMemGetAddressRange_v2", "cuMemGetAddressRange")),
    "musa": (("libmusa.so", "libmusa.so.1"), ("muMemGetAddressRange_v2", "muMemGetAddressRange")),
}
_range_fns: dict[str, Any] = {}
_range_lock = threading.Lock()


def _range_fn(kind: str) -> Any:
    """The driver's address-range call for ``kind`` (ctypes), or None where it is missing."""
    with _range_lock:
        if kind in _range_fns:
            return _range_fns[kind]
        import ctypes

        fn = None
        libs, names = _RANGE_CALLS.get(kind, ((), ()))
        for lib_name in libs:
            try:
                lib = ctypes.CDLL(lib_name)
            except OSError:
                continue
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    fn.argtypes = (ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)
                    break
            if fn is not None:
                break
        _range_fns[kind] = fn
        return fn


def allocation_range(kind: str, index: int, address: int) -> tuple[int, int] | None:
    """``(base, size)`` of the device allocation that holds ``address`` on device ``index``,
    as the driver says; None where it cannot say (no driver library, a call that fails).
    The server checks an imported IPC handle against it: the handle's size is the peer's
    word, and torch maps whatever it claims."""
    fn = _range_fn(kind)
    if fn is None:
        return None
    import ctypes

    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    with ipc_module(kind).device(index):  # the device's context is current for the call
        status = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    return (int(base.value), int(size.value)) if status == 0 else None


# -- pinned host memory -----------------------------------------------------------------


def alloc_host(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes``; page-locked for fast DMA when ``pinned``.

    Pages are not touched, so the memory is committed lazily by the OS. cuda pins through
    torch's pinned allocator; musa through ``musaHostRegister`` on an ordinary allocation,
    which is how torch_musa exposes it.
    """
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    if available("cuda"):
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    mod = accelerator_module("musa")
    if mod is not None and available("musa"):
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        rt = mod.musart()
        # flags=0: portable default; the registration lives as long as the tensor.
        status = rt.musaHostRegister(buf.data_ptr(), nbytes, 0)
        if status not in (0, None) and getattr(status, "value", 0) != 0:
            raise DeviceError(f"musaHostRegister failed with status {status}")
        _register_unpin(buf, rt)
        return buf
    raise DeviceError("pinned host memory needs a cuda or musa device; none is available")


def _register_unpin(buf: torch.Tensor, rt: Any) -> None:
    import weakref

    ptr = buf.data_ptr()
    weakref.finalize(buf.untyped_storage(), rt.musaHostUnregister, ptr)


# -- streams -----------------------------------------------------------------------------


def current_stream(device: torch.device) -> Any | None:
    """The caller's current stream on ``device`` (None on the CPU).

    Taken on the caller's thread, so a copy run later in a worker thread is ordered after the
    kernels that produced its source.
    """
    if device.type == "cpu":
        return None
    mod = _module(device)
    return mod.current_stream(device)


@contextmanager
def stream_context(device: torch.device, stream: Any | None) -> Iterator[None]:
    """Run the body with ``stream`` current (a no-op on the CPU)."""
    if stream is None or device.type == "cpu":
        with nullcontext():
            yield
        return
    mod = _module(device)
    with mod.stream(stream):
        yield


@contextmanager
def stream_switch(device: torch.device, home: Any | None) -> Iterator[Callable[[Any], None]]:
    """Yield ``use(stream)``, which makes ``stream`` current on this thread; ``home`` (the
    stream current on entry) is current again on exit. A no-op on the CPU.

    For work that alternates between two streams many times (``musacache.transfer.relay``): a
    ``stream`` context costs tens of microseconds to enter (it looks the device up each time),
    ``set_stream`` a few. A module without ``set_stream`` gets a context per switch."""
    if home is None or device.type == "cpu":
        yield lambda stream: None
        return
    mod = _module(device)
    setter = getattr(mod, "set_stream", None)
    if setter is not None:
        try:
            yield setter
        finally:
            setter(home)
        return
    with ExitStack() as stack:
        def use(stream: Any) -> None:
            stack.close()
            stack.enter_context(mod.stream(stream))

        yield use


def synchronize(device: torch.device, stream: Any | None) -> None:
    """Block the calling (worker) thread until ``stream``'s work is done."""
    if stream is not None and device.type != "cpu":
        stream.synchronize()


_copy_streams: dict[tuple[str, int, int], Any] = {}
_copy_streams_lock = threading.Lock()


def copy_stream(device: torch.device) -> Any | None:
    """The device's dedicated copy stream (None on the CPU), made on first use and kept.

    Transfers between the host and the device run here, so they overlap the compute stream
    and never block it; they are ordered against it by events (:func:`record_event`,
    :func:`wait_for`), not by synchronizing.
    """
    return _kept_stream(device, 0)


def side_stream(device: torch.device) -> Any | None:
    """A second kept stream on ``device`` (None on the CPU): the device-side half of a
    two-stage transfer (``musacache.transfer.relay``), so that the copy engine's bus transfer of one
    chunk overlaps the SMs' gather or scatter of the next."""
    return _kept_stream(device, 1)


def _kept_stream(device: torch.device, lane: int) -> Any | None:
    if device.type == "cpu":
        return None
    mod = _module(device)
    index = 0 if device.index is None else device.index
    key = (device.type, index, lane)
    with _copy_streams_lock:
        stream = _copy_streams.get(key)
        if stream is None:
            stream = mod.Stream(device=torch.device(device.type, index))
            _copy_streams[key] = stream
        return stream


def record_event(device: torch.device, stream: Any | None = None) -> Any | None:
    """A new event recorded on ``stream`` (the current stream when None); None on the CPU,
    where work is done when the call that queued it returns."""
    if device.type == "cpu":
        return None
    mod = _module(device)
    event = mod.Event()
    event.record(stream if stream is not None else mod.current_stream(device))
    return event


def wait_for(stream: Any | None, event: Any | None) -> None:
    """Make ``stream`` wait on the device for ``event``; the host does not wait."""
    if stream is not None and event is not None:
        stream.wait_event(event)


# Threads that wait for device events: a bounded pool of its own, so that waiting requests
# never take the worker threads that copies and codecs need.
_EVENT_WAITERS = 16
_event_limiter: anyio.CapacityLimiter | None = None


def _waiters() -> anyio.CapacityLimiter:
    global _event_limiter
    if _event_limiter is None:
        _event_limiter = anyio.CapacityLimiter(_EVENT_WAITERS)
    return _event_limiter


async def wait_event(event: Any | None, timeout: float | None = None) -> bool:
    """Await a device event without blocking the loop; True once it has completed, False
    if ``timeout`` passed first. None (the CPU's "event") is done already.

    A worker thread blocks in the event's ``synchronize()`` and the loop wakes as soon as it
    returns, which is sooner than polling (the loop's timers tick in milliseconds). An event
    without ``synchronize()`` is polled with backoff. A cancelled or timed-out wait leaves
    its thread to finish with the event; the device always gets there.
    """
    if event is None or event.query():
        return True
    sync = getattr(event, "synchronize", None)
    if sync is None:
        return await poll_until(lambda: bool(event.query()), timeout)
    with anyio.move_on_after(timeout):
        await anyio.to_thread.run_sync(sync, limiter=_waiters(), abandon_on_cancel=True)
        return True
    return bool(event.query())


# -- ready events ------------------------------------------------------------------------


@runtime_checkable
class ReadyEvent(Protocol):
    """Anything :func:`wait_ready` accepts: it has an awaitable ``wait(timeout)``."""

    async def wait(self, timeout: float | None = None) -> bool: ...


class HostEvent:
    """A thread-safe one-shot event: set it from any thread (or process, via ipc), await it
    on the loop without blocking."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._waiters: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            self._flag.set()
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def clear(self) -> None:
        self._flag.clear()

    async def wait(self, timeout: float | None = None) -> bool:
        if self._flag.is_set():
            return True
        done = anyio.Event()
        token = anyio.lowlevel.current_token()

        def wake() -> None:
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except RuntimeError:  # called on the loop thread itself
                done.set()

        with self._lock:
            if self._flag.is_set():
                return True
            self._waiters.append(wake)
        try:
            with anyio.move_on_after(timeout):
                await done.wait()
        finally:
            with self._lock:
                if wake in self._waiters:
                    self._waiters.remove(wake)
        return self._flag.is_set()


class DeviceEvent:
    """A cuda/musa event recorded on a stream; awaited by polling ``query()`` with backoff,
    so the loop never blocks on the device."""

    def __init__(self, device: str | torch.device = "auto", *, interprocess: bool = False) -> None:
        self.device = resolve(device)
        if self.device.type == "cpu":
            raise DeviceError("DeviceEvent needs a cuda or musa device; use HostEvent on the CPU")
        mod = accelerator_module(self.device.type)
        if mod is None:
            raise DeviceError(f"{self.device.type} is not available")
        self._event = mod.Event(interprocess=interprocess) if interprocess else mod.Event()
        self._mod = mod

    @property
    def raw(self) -> Any:
        return self._event

    def record(self, stream: Any | None = None) -> None:
        self._event.record(stream if stream is not None else self._mod.current_stream(self.device))

    def query(self) -> bool:
        return bool(self._event.query())

    async def wait(self, timeout: float | None = None) -> bool:
        return await poll_until(self.query, timeout)


async def poll_until(done: Callable[[], bool], timeout: float | None) -> bool:
    """Poll ``done()`` with exponential backoff from 20 us to 2 ms; True once it is."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 20e-6
    while not done():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await anyio.sleep(delay)
        delay = min(delay * 2, 2e-3)
    return True


async def wait_ready(event: Any, timeout: float | None = None) -> None:
    """Wait for a ``ready`` event of any supported kind; TimeoutError if it is not set in time.

    Accepted: :class:`HostEvent`, :class:`DeviceEvent`, an ``ipc.IpcEvent``, a raw
    ``torch.cuda.Event``-like object with ``query()``, or an ``anyio``/``asyncio`` Event.
    """
    if event is None:
        return
    wait = getattr(event, "wait", None)
    if isinstance(event, (HostEvent, DeviceEvent)) or _accepts_timeout(event):
        ok = await event.wait(timeout)
    elif hasattr(event, "query"):
        ok = await poll_until(lambda: bool(event.query()), timeout)
    elif wait is not None:
        ok = True
        with anyio.move_on_after(timeout) as scope:
            await wait()
        ok = not scope.cancelled_caught
    else:
        raise DeviceError(
            f"ready= must be an event with wait() or query(), got {type(event).__name__}")
    if not ok:
        raise ReadyTimeoutError(f"ready event was not set within {timeout} s")


def _accepts_timeout(event: Any) -> bool:
    import inspect

    wait = getattr(event, "wait", None)
    if wait is None or not inspect.iscoroutinefunction(wait):
        return False
    try:
        return "timeout" in inspect.signature(wait).parameters
    except (TypeError, ValueError):
        return False
