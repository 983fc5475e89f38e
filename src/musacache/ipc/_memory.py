"""Memory IPC: export a tensor's memory to another process and rebuild the exact view there.

A :class:`TensorHandle` is the metadata of one view (device, dtype, shape, stride, storage
offset, storage size) plus the backend's handle of the storage:

* ``cpu``: the storage lives in a shared memory file. The handle carries no name; the file
  descriptor travels next to it over the Unix socket (``SCM_RIGHTS``), listed in
  :attr:`TensorHandle.fds` on the exporter side and passed as ``fds=`` to the importer.
* ``cuda`` / ``musa``: torch's 8-tuple from ``storage._share_cuda_()`` /
  ``storage._share_musa_()``, rebuilt with ``UntypedStorage._new_shared_cuda/_musa``.

CPU memory must be allocated shareable from the start (:func:`empty_shared`), or be copied
once into shared memory (:func:`to_shared`): ordinary private memory cannot be mapped by
another process after the fact, and :func:`share` refuses it instead of silently moving it.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import math
import mmap
import os
import stat
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import torch

from .._errors import DeviceError, IPCError, ProtocolError, ShapeError
from ..devices import allocation_range, device_uuid, ipc_module, local_device_index

log = logging.getLogger("musacache")

#: A device kind as IPC names it (a string: "musa" parses only where torch_musa is loaded).
DeviceKind = Literal["cpu", "cuda", "musa"]
DEVICE_KINDS: Final[tuple[DeviceKind, ...]] = ("cpu", "cuda", "musa")

#: Identity of one mapped storage in the importing process (used to map it only once).
MappingKey = tuple[Any, ...]

# The ``_share_cuda_()`` tuple: (device, handle, size, offset, refcount handle, refcount
# offset, event handle, event sync required). torch_musa mirrors it for MUSA.
_DEVICE_IPC_TUPLE_LEN: Final = 8
_MAX_NDIM: Final = 64
_MAX_EXTENT: Final = 1 << 62
_MEMFD_NAME: Final = "musacache-shared"
_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# (Linux 5.1; the fcntl module names it from Python 3.13 on)
_F_SEAL_FUTURE_WRITE: Final = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


# -- the handle ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorHandle:
    """Everything another process needs to map one tensor view, plus its fds on our side.

    ``fds`` and the private keep-alive reference are exporter-side only: they are not part of
    :meth:`to_wire`, equality or hashing. ``fds`` are *borrowed*: they stay valid as long as
    this handle object is alive (it keeps the exported storage alive), and the caller must not
    close them. Send them with the frame that carries :meth:`to_wire`.
    """

    device_kind: DeviceKind
    device_index: int | None
    device_uuid: str | None
    ipc: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int
    #: The exporting process. A device handle cannot be opened by the process that made it
    #: (the driver refuses its own IPC handle), so that process uses its own storage instead.
    pid: int | None = None
    fds: tuple[int, ...] = field(default=(), compare=False, repr=False)
    keepalive: object = field(default=None, compare=False, repr=False)

    @property
    def num_fds(self) -> int:
        """How many fds travel with this handle (1 for a non-empty CPU storage, else 0)."""
        return 1 if self.device_kind == "cpu" and self.storage_nbytes > 0 else 0

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict (str keys; ints, strs, bytes, lists, None)."""
        return {
            "kind": self.device_kind,
            "index": self.device_index,
            "uuid": self.device_uuid,
            "ipc": list(self.ipc),
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.storage_offset,
            "nbytes": self.storage_nbytes,
            "nfds": self.num_fds,
            "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> TensorHandle:
        """Validate a peer's dict and rebuild the handle. Raises ProtocolError if malformed.

        The view is checked to lie inside the storage here, so a bad handle never reaches
        ``Tensor.set_`` or touches memory outside the mapping.
        """
        if not isinstance(wire, Mapping):
            raise ProtocolError(f"a tensor handle must be a map, got {type(wire).__name__}")
        kind = _field(wire, "kind", str)
        if kind not in DEVICE_KINDS:
            raise ProtocolError(f"unknown device kind {kind!r} in tensor handle")
        index = _field(wire, "index", int, optional=True)
        uuid = _field(wire, "uuid", str, optional=True)
        dtype = _dtype_from_wire(_field(wire, "dtype", str))
        shape = _int_list(wire, "shape")
        stride = _int_list(wire, "stride")
        offset = _field(wire, "offset", int)
        nbytes = _field(wire, "nbytes", int)
        nfds = _field(wire, "nfds", int)
        ipc = tuple(_field(wire, "ipc", list))
        pid = _field(wire, "pid", int, optional=True) if "pid" in wire else None
        if len(shape) != len(stride):
            raise ProtocolError(f"shape {shape} and stride {stride} differ in rank")
        if not 0 <= nbytes <= _MAX_EXTENT or not 0 <= offset <= _MAX_EXTENT:
            raise ProtocolError(f"storage offset {offset} / size {nbytes} out of range")
        itemsize = _itemsize(dtype)
        _check_view_inside(shape, stride, offset, itemsize, nbytes)
        if kind == "cpu":
            if ipc:
                raise ProtocolError("a cpu tensor handle carries no backend payload")
        else:
            _check_device_ipc(ipc, nbytes)
        handle = cls(kind, index, uuid, ipc, dtype, shape, stride, offset, nbytes, pid)
        if nfds != handle.num_fds:
            raise ProtocolError(f"a {kind} handle of {nbytes} bytes has {handle.num_fds} fds, "
                                f"the peer says {nfds}")
        return handle


def _field(wire: Mapping[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    if name not in wire:
        raise ProtocolError(f"tensor handle is missing {name!r}")
    value = wire[name]
    if value is None and optional:
        return None
    # bool is an int subclass; a True where a size belongs is a malformed handle.
    if type(value) is not kind:
        raise ProtocolError(f"tensor handle field {name!r} must be {kind.__name__}, "
                            f"got {type(value).__name__}")
    return value


def _int_list(wire: Mapping[str, Any], name: str) -> tuple[int, ...]:
    values = _field(wire, name, list)
    if len(values) > _MAX_NDIM:
        raise ProtocolError(f"tensor handle {name!r} has {len(values)} dims (max {_MAX_NDIM})")
    if any(type(v) is not int or not 0 <= v <= _MAX_EXTENT for v in values):
        raise ProtocolError(f"tensor handle {name!r} must hold non-negative ints, got {values}")
    return tuple(values)


def _dtype_from_wire(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"unknown dtype {name!r} in tensor handle")
    return dtype


def _itemsize(dtype: torch.dtype) -> int:
    try:
        return dtype.itemsize
    except RuntimeError as exc:
        raise ProtocolError(f"dtype {dtype} cannot be shared: {exc}") from exc


def _check_view_inside(shape: Sequence[int], stride: Sequence[int], offset: int,
                       itemsize: int, nbytes: int) -> None:
    if math.prod(shape) == 0:
        return
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    if (last + 1) * itemsize > nbytes:
        raise ProtocolError(
            f"view shape={tuple(shape)} stride={tuple(stride)} offset={offset} reaches byte "
            f"{(last + 1) * itemsize}, past the end of a {nbytes}-byte storage"
        )


def _check_device_ipc(ipc: tuple[Any, ...], nbytes: int) -> None:
    if len(ipc) != _DEVICE_IPC_TUPLE_LEN:
        raise ProtocolError(f"a device tensor handle needs an {_DEVICE_IPC_TUPLE_LEN}-item "
                            f"ipc tuple, got {len(ipc)}")
    device, mem, size, offset, ref_handle, ref_offset, event, sync = ipc
    ints_ok = all(type(v) is int for v in (device, size, offset, ref_offset))
    bytes_ok = all(v is None or type(v) is bytes for v in (mem, ref_handle, event))
    if not ints_ok or not bytes_ok or type(sync) is not bool:
        raise ProtocolError("malformed device ipc tuple in tensor handle")
    if size != nbytes:
        raise ProtocolError(f"device ipc tuple says {size} bytes, the handle says {nbytes}")


# -- shared CPU memory --------------------------------------------------------------------


#: Bytes mapped MAP_SHARED from a file, unmapped when the object dies. ``torch.frombuffer``
#: holds a buffer export of it for as long as any tensor uses the memory, so the mapping
#: lives exactly as long as the tensors do. Python's own ``mmap`` would also keep a duplicate
#: of the fd open for the mapping's whole life (until 3.13's ``trackfd=False``): a server
#: mapping many workers' storages would hold one fd per storage for nothing, so mappings
#: are made through libc instead.
_Mapping = ctypes.Array[ctypes.c_ubyte]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def _map_shared(fd: int, nbytes: int) -> _Mapping:
    """Map ``nbytes`` of ``fd`` read-write and shared. The fd may be closed afterwards."""
    address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                         fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    # A subclass per mapping: ctypes arrays have a fixed length in their type, and only a
    # Python subclass can carry the weak reference the finaliser needs.
    mapping_type = cast(type[_Mapping], type("SharedMapping", (ctypes.c_ubyte * nbytes,), {}))
    mapping = mapping_type.from_address(address)
    # Not at exit: tensors may outlive atexit hooks that still read them, and the process
    # exit unmaps everything anyway.
    weakref.finalize(mapping, _libc.munmap, address, nbytes).atexit = False
    return mapping


# data_ptr of an empty_shared storage -> (its mapping, its memfd). Weak, so the registry
# never keeps memory alive; a dead entry is dropped by the mapping's finaliser.
_segments: dict[int, tuple[weakref.ref[_Mapping], int]] = {}


def _forget_segment(address: int, fd: int) -> None:
    _segments.pop(address, None)
    os.close(fd)


def empty_shared(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A contiguous CPU tensor in memory that :func:`share` can export (uninitialised values).

    The memory is an anonymous ``memfd`` (no filesystem name, nothing to unlink, nothing to
    guess), sealed against shrinking so an importer's mapping cannot turn into SIGBUS.
    Allocate a worker's paged KV cache with this once, at start-up.
    """
    dims = tuple(int(s) for s in shape)
    if any(s < 0 for s in dims):
        raise ShapeError(f"empty_shared got a negative dimension in {dims}")
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes == 0:
        # 0 bytes cannot be mapped; an empty storage needs no fd to be shared either.
        return torch.empty(dims, dtype=dtype, device="cpu")
    try:
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise IPCError(f"memfd_create failed: {exc}") from exc
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        segment = _map_shared(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        raise IPCError(f"cannot allocate {nbytes} bytes of shared memory: {exc}") from exc
    # The exporter keeps the memfd open: it is what share() sends.
    address = ctypes.addressof(segment)
    _segments[address] = (weakref.ref(segment), fd)
    # No atexit run: the process exit closes the fd anyway, and closing it earlier could
    # hand a dead fd to a share() made by another atexit hook.
    weakref.finalize(segment, _forget_segment, address, fd).atexit = False
    storage = torch.frombuffer(segment, dtype=torch.uint8).untyped_storage()
    out = torch.empty((), dtype=dtype, device="cpu")
    out.set_(storage, 0, dims, _contiguous_stride(dims))
    return out


def shared_segment(tensor: torch.Tensor) -> object | None:
    """The mapping behind a CPU tensor of :func:`empty_shared` memory, or None (other
    memory). It lives exactly as long as that memory, so a ``weakref.finalize`` on it says
    when the memory is gone, and its ``id`` names the memory until then."""
    if tensor.device.type != "cpu":
        return None
    entry = _segments.get(tensor.untyped_storage().data_ptr())
    return None if entry is None else entry[0]()


def to_shared(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in shareable memory (contiguous). The input is not changed.

    A one-time copy of the whole tensor: call it through ``anyio.to_thread.run_sync`` for a
    large tensor, and keep using the returned tensor afterwards.
    """
    if tensor.device.type != "cpu":
        raise DeviceError(f"to_shared copies CPU tensors; {tensor.device.type} memory is "
                          f"exported by share() directly")
    out = empty_shared(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _cpu_storage_fd(storage: torch.UntypedStorage) -> int | None:
    """The fd of shared memory behind ``storage``, or None when it is private memory."""
    entry = _segments.get(storage.data_ptr())
    segment = None if entry is None else entry[0]()
    if entry is not None and segment is not None and len(segment) >= storage.nbytes():
        return entry[1]
    get_fd = getattr(storage, "_get_shared_fd", None)
    if get_fd is None:
        return None
    try:
        # Only storages that share_memory_() put into fd-backed shm (the Linux default
        # strategy) have one. Unlike _share_fd_cpu_(), this never moves private memory.
        return int(get_fd())
    except RuntimeError:
        return None


def _memory_fd(tensor: torch.Tensor) -> int | bool:
    """True for memory any process may map (device memory, an empty storage), False for
    memory none may, else the fd of the CPU shared memory behind ``tensor``."""
    kind = tensor.device.type
    if kind != "cpu":
        return kind in ("cuda", "musa")
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return True
    fd = _cpu_storage_fd(storage)
    return False if fd is None else fd


def is_shareable(tensor: torch.Tensor) -> bool:
    """Whether :func:`share` can export ``tensor`` without a copy."""
    return _memory_fd(tensor) is not False


def is_sealed(tensor: torch.Tensor) -> bool:
    """Whether the node server can map ``tensor`` safely: device memory, or CPU shared memory
    sealed against shrinking (:func:`empty_shared`). torch's ``share_memory_()`` memory is
    shareable but not sealed: its owner could truncate it under the server's mapping, so the
    server refuses it."""
    fd = _memory_fd(tensor)
    if isinstance(fd, bool):
        return fd
    return bool(_seals(fd) & fcntl.F_SEAL_SHRINK)


# -- export -------------------------------------------------------------------------------


def share(tensor: torch.Tensor) -> TensorHandle:
    """Export ``tensor``'s memory: a handle for :func:`open_tensor` in another process.

    The handle keeps the exported storage alive while it exists. CPU tensors must live in
    shared memory (:func:`empty_shared`, :func:`to_shared`, or torch's ``share_memory_()``
    with the default ``file_descriptor`` strategy); private memory raises IPCError.
    """
    if not isinstance(tensor, torch.Tensor):
        raise IPCError(f"share() takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise IPCError(f"only strided tensors can be shared, got layout {tensor.layout}")
    kind = tensor.device.type
    storage = tensor.untyped_storage()
    meta: dict[str, Any] = {
        "dtype": tensor.dtype,
        "shape": tuple(int(s) for s in tensor.shape),
        "stride": tuple(int(s) for s in tensor.stride()),
        "storage_offset": int(tensor.storage_offset()),
        "storage_nbytes": int(storage.nbytes()),
    }
    if kind == "cpu":
        fd = _cpu_storage_fd(storage) if meta["storage_nbytes"] else None
        if meta["storage_nbytes"] and fd is None:
            raise IPCError(
                "this CPU tensor lives in private memory, which another process cannot map; "
                "allocate it with musacache.ipc.empty_shared(shape, dtype), or copy it once "
                "with musacache.ipc.to_shared(tensor)"
            )
        return TensorHandle("cpu", None, None, (), pid=os.getpid(),
                            fds=() if fd is None else (fd,), keepalive=storage, **meta)
    if kind in ("cuda", "musa"):
        return _share_device(tensor, cast(DeviceKind, kind), storage, meta)
    raise DeviceError(f"tensors on {kind} cannot be shared; use cpu, cuda or musa")


def _share_device(tensor: torch.Tensor, kind: DeviceKind, storage: torch.UntypedStorage,
                  meta: dict[str, Any]) -> TensorHandle:
    export = getattr(storage, f"_share_{kind}_", None)
    if export is None:
        raise IPCError(f"this torch build cannot export {kind} memory "
                       f"(UntypedStorage._share_{kind}_ is missing)")
    try:
        ipc = tuple(export())
    except RuntimeError as exc:
        raise IPCError(f"exporting {kind} memory failed: {exc}") from exc
    if len(ipc) != _DEVICE_IPC_TUPLE_LEN:
        raise IPCError(f"_share_{kind}_() returned {len(ipc)} items, expected "
                       f"{_DEVICE_IPC_TUPLE_LEN}; this torch build is not supported")
    index = tensor.device.index if tensor.device.index is not None else int(ipc[0])
    handle = TensorHandle(kind, index, device_uuid(kind, index), ipc, pid=os.getpid(),
                          keepalive=storage, **meta)
    try:
        _own_device_exports[_device_key(handle)] = weakref.ref(storage)
    except TypeError:
        pass  # a storage without weak references (test doubles) cannot be found again
    return handle


class ExportTable:
    """Exporter-side registry: keeps each exported storage alive until the peer lets go.

    Use one per connection. :meth:`export` before sending a handle; :meth:`release` when the
    peer says it closed its mapping; :meth:`close_all` when the peer disconnects or dies.
    Not thread-safe: use it from one event loop.
    """

    def __init__(self) -> None:
        self._exports: dict[int, TensorHandle] = {}

    def export(self, tensor: torch.Tensor) -> TensorHandle:
        """:func:`share` ``tensor`` and hold the handle (and so its memory and fds)."""
        handle = share(tensor)
        self._exports[id(handle)] = handle
        return handle

    def release(self, handle: TensorHandle) -> None:
        """Drop one export made by :meth:`export` (idempotent)."""
        if self._exports.get(id(handle)) is handle:
            del self._exports[id(handle)]

    def close_all(self) -> None:
        """Drop every export of this table."""
        self._exports.clear()

    @property
    def open_exports(self) -> int:
        return len(self._exports)

    def __len__(self) -> int:
        return len(self._exports)


# -- import -------------------------------------------------------------------------------

# (st_dev, st_ino) of a shared file -> our mapping of it. Weak: the mapping lives while some
# storage uses it, so a second open of the same memory reuses the mapping instead of
# mapping it again.
_cpu_mappings: weakref.WeakValueDictionary[MappingKey, _Mapping] = (
    weakref.WeakValueDictionary()
)
# Device storages this process exported, by mapping key: an import of our own handle (the
# server and a client in one process) resolves here, since the driver refuses to open it.
_own_device_exports: dict[MappingKey, weakref.ref[torch.UntypedStorage]] = {}


def close_fds(fds: Sequence[int]) -> None:
    """Close fds received from a peer that nothing will adopt (errors ignored)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fstat(fds: Sequence[int]) -> os.stat_result:
    if len(fds) != 1:
        raise IPCError(f"a cpu tensor handle needs exactly one fd, got {len(fds)}")
    try:
        return os.fstat(fds[0])
    except OSError as exc:
        raise IPCError(f"the fd sent with a cpu tensor handle is unusable: {exc}") from exc


def open_storage(handle: TensorHandle, fds: Sequence[int] = (), *,
                 require_sealed: bool = False,
                 peer_pid: int | None = None) -> tuple[MappingKey, torch.UntypedStorage]:
    """Map the storage behind ``handle``; return its key and a storage over the mapping.

    Takes ownership of ``fds``: they are closed before this returns, whatever happens (a
    CPU mapping does not need its fd once mapped). ``require_sealed`` refuses CPU memory that
    the exporter could still shrink (which would crash us with SIGBUS on access); memory from
    :func:`empty_shared` is sealed, torch's ``share_memory_()`` memory is not.

    ``peer_pid`` (the kernel's word for who sent the handle, from SO_PEERCRED) decides,
    when known, whether a device handle is our own storage: a peer may not claim to be us,
    so a device handle that carries our pid from another peer is refused. The handle's
    ``pid`` is otherwise not compared with it: a worker in its own PID namespace (a
    container) sees another number for itself than the kernel gives us, and a CPU handle is
    a memfd whose pid means nothing (such workers could not register).
    """
    try:
        if handle.device_kind == "cpu":
            return _open_cpu(handle, fds, require_sealed)
        if fds:
            raise IPCError(f"a {handle.device_kind} tensor handle takes no fds, got {len(fds)}")
        key = _device_key(handle)
        me = os.getpid()
        if peer_pid is not None and peer_pid != me and handle.pid == me:
            raise IPCError(f"the handle claims pid {handle.pid} (this process), the peer is "
                           f"pid {peer_pid}")
        if (handle.pid == me) if peer_pid is None else (peer_pid == me):
            return key, _own_device_storage(key)
        return key, _open_device(handle)
    finally:
        close_fds(fds)


def _open_cpu(handle: TensorHandle, fds: Sequence[int],
              require_sealed: bool) -> tuple[MappingKey, torch.UntypedStorage]:
    nbytes = handle.storage_nbytes
    if nbytes == 0:
        if fds:
            raise IPCError("an empty cpu tensor handle takes no fds")
        return ("cpu-empty",), torch.UntypedStorage(0)
    st = _fstat(fds)
    if not stat.S_ISREG(st.st_mode):
        raise IPCError("the fd sent with a cpu tensor handle is not a shared memory file")
    if st.st_size < nbytes:
        raise IPCError(f"the shared memory file has {st.st_size} bytes, the handle "
                       f"says {nbytes}")
    seals = _seals(fds[0])
    if require_sealed and not seals & fcntl.F_SEAL_SHRINK:
        raise IPCError("the peer's shared memory is not sealed against shrinking; allocate "
                       "it with musacache.ipc.empty_shared")
    # Every mapping is read-write, and one already made for the same memory (through another
    # peer's fd) is reused: the fd sent must itself grant what a fresh mapping would need, or
    # a peer holding a read-only fd of someone's memory could have it written.
    if fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise IPCError("the fd sent with a cpu tensor handle is not open for reading and "
                       "writing; the memory is mapped read-write")
    if seals & (fcntl.F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise IPCError("the peer's shared memory is sealed against writes; it is mapped "
                       "read-write")
    key: MappingKey = ("cpu", st.st_dev, st.st_ino)
    mapping = _cpu_mappings.get(key)
    if mapping is None or len(mapping) < nbytes:
        try:
            mapping = _map_shared(fds[0], nbytes)
        except OSError as exc:
            raise IPCError(f"cannot map the peer's shared memory: {exc}") from exc
        _cpu_mappings[key] = mapping
    return key, torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()


def _seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        # Files that are not memfds cannot carry seals at all.
        return 0


def _device_key(handle: TensorHandle) -> MappingKey:
    # (allocation handle, offset of the storage in that allocation) names one storage, as in
    # torch's own cache of shared CUDA storages.
    return (handle.device_kind, handle.device_uuid or handle.device_index,
            handle.ipc[1], handle.ipc[3])


def _own_device_storage(key: MappingKey) -> torch.UntypedStorage:
    ref = _own_device_exports.get(key)
    storage = None if ref is None else ref()
    if storage is None:
        _own_device_exports.pop(key, None)
        raise IPCError("the handle names device memory of this process that is no longer "
                       "exported (its tensor was freed)")
    return storage


def _open_device(handle: TensorHandle) -> torch.UntypedStorage:
    kind = handle.device_kind
    module = ipc_module(kind)
    local = local_device_index(kind, handle.device_index, handle.device_uuid)
    init = getattr(module, "init", None)
    if callable(init):
        init()
    rebuild = getattr(torch.UntypedStorage, f"_new_shared_{kind}", None)
    if rebuild is None:
        raise IPCError(f"this torch build cannot import {kind} memory "
                       f"(UntypedStorage._new_shared_{kind} is missing)")
    # The tuple's first item is the exporter's device index; torch uses it as a device guard,
    # so it must be the same GPU's index in *this* process.
    # Opening a handle this process already mapped is cheap: torch caches the device mapping
    # per allocation, and the new storage releases the exporter's per-export refcount when
    # it dies, so callers may drop duplicates freely.
    try:
        storage = rebuild(local, *handle.ipc[1:])
    except RuntimeError as exc:
        raise IPCError(f"opening the peer's {kind} memory failed: {exc}") from exc
    _check_allocation(kind, local, storage, handle.storage_nbytes)
    return storage


_unchecked_warned: set[str] = set()


def _check_allocation(kind: str, index: int, storage: Any, nbytes: int) -> None:
    """Refuse a device handle whose bytes run past the allocation the driver opened: torch
    maps the size and offset the peer claims as they are, and the memory past a peer's
    allocation may be another peer's. Where the driver
    cannot say (no address-range call), the handle is taken as it is, and that is logged
    once."""
    start = int(storage.data_ptr())
    got = allocation_range(kind, index, start)
    if got is None:
        if kind not in _unchecked_warned:
            _unchecked_warned.add(kind)
            log.warning("musacache: the %s driver does not say an allocation's range here: "
                        "imported IPC handles are not checked against it", kind)
        return
    base, size = got
    if start < base or start + nbytes > base + size:
        raise IPCError(f"the peer's {kind} handle claims {nbytes} bytes at offset "
                       f"{start - base} of an allocation of {size}: past its end")


def rebuild_view(storage: torch.UntypedStorage, handle: TensorHandle) -> torch.Tensor:
    """The view ``handle`` describes, over ``storage`` (no copy)."""
    out = torch.empty((), device=storage.device, dtype=handle.dtype)
    try:
        out.set_(storage, handle.storage_offset, handle.shape, handle.stride)
    except RuntimeError as exc:
        raise IPCError(f"cannot rebuild the shared view: {exc}") from exc
    return out


def open_tensor(handle: TensorHandle, fds: Sequence[int] = (), *,
                require_sealed: bool = False) -> torch.Tensor:
    """Map ``handle``'s memory and rebuild its exact view; writes are seen by both sides.

    Takes ownership of ``fds`` (always closed). The mapping lives as long as the returned
    tensor (and its views); opening the same memory again reuses the mapping. For explicit,
    per-peer lifetimes use :class:`musacache.ipc.MappingTable` instead.
    """
    _, storage = open_storage(handle, fds, require_sealed=require_sealed)
    return rebuild_view(storage, handle)
