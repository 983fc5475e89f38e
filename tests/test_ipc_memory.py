"""Memory IPC: shared CPU memory across real processes, handle validation, lifetimes, and the
cuda/musa dispatch exercised with fake torch device modules."""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
from types import SimpleNamespace
from typing import Any

import anyio
import msgpack
import pytest
import torch

from musacache._errors import DeviceError, IPCError, ProtocolError
from musacache.ipc import (
    ExportTable,
    IpcEvent,
    MappingTable,
    TensorHandle,
    empty_shared,
    is_shareable,
    open_storage,
    open_tensor,
    share,
    to_shared,
)
from musacache.ipc._wire import Connection, Request

MEMFD_NAME = "memfd:musacache-shared"


def memfd_maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum(MEMFD_NAME in line for line in maps)


def memfd_fds() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/" + MEMFD_NAME)
        except OSError:
            pass
    return count


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def dup_fds(handle: TensorHandle) -> list[int]:
    """What the peer would receive: its own copies of the exporter's fds."""
    return [os.dup(fd) for fd in handle.fds]


def wire_trip(handle: TensorHandle, *, foreign: bool = False) -> TensorHandle:
    """``handle`` through msgpack; ``foreign``: as if another process had exported it."""
    wire = handle.to_wire()
    if foreign:
        wire["pid"] = os.getpid() + 1
    return TensorHandle.from_wire(msgpack.unpackb(msgpack.packb(wire)))


# -- shared CPU memory -------------------------------------------------------------------


def test_empty_shared_is_a_sealed_anonymous_memfd() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    fds_before = memfd_fds()
    kv = empty_shared((4, 2, 16, 8), torch.bfloat16)
    assert kv.shape == (4, 2, 16, 8) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert is_shareable(kv) and is_shareable(kv[1:, :, ::2])
    handle = share(kv)
    (fd,) = handle.fds
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/" + MEMFD_NAME)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    # Nothing with a name was created (others' processes may come and go in /dev/shm).
    created = set(os.listdir("/dev/shm")) - shm_before
    assert not [name for name in created if str(os.getpid()) in name or "musacache" in name]
    assert memfd_fds() == fds_before + 1
    del kv, handle
    gc.collect()
    assert memfd_fds() == fds_before  # the fd lives exactly as long as the memory


def test_share_refuses_private_memory_and_to_shared_copies() -> None:
    private = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert not is_shareable(private)
    with pytest.raises(IPCError, match="empty_shared"):
        share(private)
    copy = to_shared(private.t())
    assert torch.equal(copy, private.t()) and copy.is_contiguous()
    copy[0, 0] = 99
    assert private[0, 0] == 0
    assert share(copy).storage_nbytes == 12 * 4
    assert share(torch.empty(0, 3)).num_fds == 0  # nothing to map, nothing to send


def test_torch_share_memory_is_accepted_without_moving_it() -> None:
    tensor = torch.arange(10, dtype=torch.int64)
    tensor.share_memory_()  # torch's fd strategy: an unlinked /dev/shm file
    address = tensor.data_ptr()
    handle = share(tensor[2:8])
    assert tensor.data_ptr() == address
    peer = open_tensor(wire_trip(handle), dup_fds(handle))
    peer[0] = -5
    assert tensor[2] == -5
    with pytest.raises(IPCError, match="sealed"):
        open_tensor(wire_trip(handle), dup_fds(handle), require_sealed=True)


# -- handles -----------------------------------------------------------------------------


def test_handle_wire_roundtrip() -> None:
    kv = empty_shared((2, 3, 5), torch.float16)
    handle = share(kv.transpose(0, 2)[1:])
    back = wire_trip(handle)
    assert back == handle
    assert back.fds == () and back.num_fds == 1
    assert (back.shape, back.stride, back.storage_offset) == ((4, 3, 2), (1, 5, 15), 1)
    assert back.storage_nbytes == 2 * 3 * 5 * 2


def _wire(**changes: Any) -> dict[str, Any]:
    wire = {"kind": "cpu", "index": None, "uuid": None, "ipc": [], "dtype": "float32",
            "shape": [4, 4], "stride": [4, 1], "offset": 0, "nbytes": 64, "nfds": 1}
    wire.update(changes)
    return wire


@pytest.mark.parametrize(
    "wire",
    [
        _wire(shape=[4, 5]),  # one element past the end
        _wire(offset=1),
        _wire(stride=[5, 1]),
        _wire(dtype="float64"),
        _wire(shape=[-1, 4]),
        _wire(shape=[4, True]),
        _wire(shape=[4]),
        _wire(dtype="no_such_dtype"),
        _wire(dtype="Tensor"),
        _wire(kind="tpu"),
        _wire(nfds=0),
        _wire(ipc=[1]),
        _wire(nbytes="64"),
        _wire(shape=[1] * 100, stride=[1] * 100),
        _wire(kind="cuda", nfds=0, ipc=[0, b"h", 64, 0, b"r", 0, None]),
        _wire(kind="cuda", nfds=0, ipc=[0, b"h", 32, 0, b"r", 0, None, False]),
        _wire(kind="cuda", nfds=0, ipc=[0, "h", 64, 0, b"r", 0, None, False]),
        {"kind": "cpu"},
        [1, 2, 3],
    ],
)
def test_malformed_handles_are_protocol_errors(wire: Any) -> None:
    with pytest.raises(ProtocolError):
        TensorHandle.from_wire(wire)


def test_well_formed_reference_handle_is_accepted() -> None:
    # The base of the malformed cases above must itself be valid.
    assert TensorHandle.from_wire(_wire()).shape == (4, 4)
    assert TensorHandle.from_wire(_wire(shape=[0, 9], stride=[9, 1])).shape == (0, 9)


VIEWS = {
    "contiguous": lambda t: t,
    "slice": lambda t: t[1:3],
    "step": lambda t: t[:, ::2],
    "permute": lambda t: t.permute(2, 0, 1),
    "scalar": lambda t: t[1, 2, 3],
    "empty": lambda t: t[:, 1:1],
    "expanded": lambda t: t[0, 0, :1].expand(5, 7),
}


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_open_rebuilds_the_exact_view_and_writes_go_both_ways(view: str,
                                                               dtype: torch.dtype) -> None:
    base = empty_shared((4, 6, 5), dtype)
    base.copy_(torch.arange(base.numel()).view(base.shape) % 100)
    original = VIEWS[view](base)
    handle = share(original)
    peer = open_tensor(wire_trip(handle), dup_fds(handle))
    assert peer.dtype == dtype and peer.shape == original.shape
    assert peer.stride() == original.stride()
    assert peer.storage_offset() == original.storage_offset()
    assert torch.equal(peer, original)
    if original.numel():
        flat_index = tuple(0 for _ in range(original.dim()))
        peer[flat_index] = 77
        assert original[flat_index] == 77
        original[flat_index] = 11
        assert peer[flat_index] == 11


def test_open_errors_close_the_fds() -> None:
    handle = share(empty_shared((8,), torch.float32))
    wire = wire_trip(handle)
    r, w = os.pipe()
    with pytest.raises(IPCError, match="not a shared memory file"):
        open_tensor(wire, [r])
    assert not fd_is_open(r)
    os.close(w)
    two = dup_fds(handle) + dup_fds(handle)
    with pytest.raises(IPCError, match="exactly one fd"):
        open_tensor(wire, two)
    assert not any(fd_is_open(fd) for fd in two)
    small = os.memfd_create("small")
    os.ftruncate(small, 4)
    with pytest.raises(IPCError, match="4 bytes"):
        open_tensor(wire, [small])
    assert not fd_is_open(small)
    with pytest.raises(IPCError, match="one fd"):
        open_tensor(wire, [])


# -- lifetimes -----------------------------------------------------------------------------


def test_mapping_table_maps_once_and_releases_on_close() -> None:
    kv = empty_shared((64, 1024), torch.float32)  # 256 KiB
    first, second = share(kv[:10]), share(kv[20:])
    gc.collect()
    maps_before = memfd_maps()
    table = MappingTable(require_sealed=True)
    a = table.open_tensor(wire_trip(first), dup_fds(first))
    b = table.open_tensor(wire_trip(second), dup_fds(second))
    assert table.stats() == {"open_mappings": 1, "open_imports": 2, "open_events": 0,
                             "open_fds": 0}
    assert memfd_maps() == maps_before + 1  # two views, one mapping
    assert a.tensor.untyped_storage().data_ptr() == b.tensor.untyped_storage().data_ptr()
    a.tensor[0, 0] = 5
    assert kv[0, 0] == 5
    a.close()
    a.close()  # idempotent
    with pytest.raises(IPCError, match="closed"):
        a.tensor  # noqa: B018
    assert table.open_mappings == 1 and table.open_imports == 1
    b.close()
    gc.collect()
    assert table.open_mappings == 0
    assert memfd_maps() == maps_before


def test_open_tensor_twice_maps_once_while_either_lives() -> None:
    kv = empty_shared((128, 1024), torch.float32)
    handle = share(kv)
    gc.collect()
    maps_before = memfd_maps()
    first = open_tensor(wire_trip(handle), dup_fds(handle))
    second = open_tensor(wire_trip(handle), dup_fds(handle))
    assert memfd_maps() == maps_before + 1
    assert first.data_ptr() == second.data_ptr()
    del first
    gc.collect()
    assert memfd_maps() == maps_before + 1
    del second
    gc.collect()
    assert memfd_maps() == maps_before


def test_a_read_only_or_write_sealed_fd_never_reaches_a_mapping_made_for_another() -> None:
    # Found by a probe: with the memory already mapped (another peer registered it), a
    # peer holding only a read-only fd of it had the server write into it: the reuse of the
    # mapping never looked at the fd sent.
    kv = empty_shared((1024,), torch.float32)
    kv.fill_(7)
    handle = share(kv)
    owner = open_tensor(wire_trip(handle), dup_fds(handle))  # the mapping, read-write
    read_only = os.open(f"/proc/self/fd/{handle.fds[0]}", os.O_RDONLY | os.O_CLOEXEC)
    with pytest.raises(IPCError, match="not open for reading and writing"):
        open_tensor(wire_trip(handle), [read_only])  # (takes the fd and closes it)
    # Memory its owner sealed against writes (F_SEAL_FUTURE_WRITE: a later read-write
    # mapping fails, one made before goes on working), sent under the same handle.
    sealed = os.memfd_create("sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(sealed, 4096)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x0010)
    with pytest.raises(IPCError, match="sealed against writes"):
        open_tensor(wire_trip(handle), [sealed])
    assert int(owner.sum()) == 7 * 1024 and int(kv.sum()) == 7 * 1024


def test_a_view_held_past_close_keeps_its_mapping_valid() -> None:
    kv = empty_shared((1024,), torch.float32)
    kv.fill_(1)
    handle = share(kv)
    gc.collect()
    maps_before = memfd_maps()
    table = MappingTable()
    held = table.open_tensor(wire_trip(handle), dup_fds(handle)).tensor
    table.close_all()
    assert table.open_mappings == 0
    assert held.sum() == 1024  # still mapped: never a dangling pointer
    assert memfd_maps() == maps_before + 1
    del held
    gc.collect()
    assert memfd_maps() == maps_before


def test_export_table_keeps_memory_alive_until_released() -> None:
    gc.collect()
    fds_before, maps_before = memfd_fds(), memfd_maps()
    kv = empty_shared((256,), torch.float32)
    kv.fill_(3)
    exports = ExportTable()
    handle = exports.export(kv[10:20])
    del kv
    gc.collect()
    assert exports.open_exports == 1 and memfd_fds() == fds_before + 1
    peer = open_tensor(wire_trip(handle), dup_fds(handle))
    assert torch.equal(peer, torch.full((10,), 3.0))
    exports.release(handle)
    exports.release(handle)
    assert exports.open_exports == 0
    del handle
    gc.collect()
    assert memfd_fds() == fds_before  # the exporter let go; the importer's mapping remains
    assert memfd_maps() == maps_before + 1
    del peer
    gc.collect()
    assert memfd_maps() == maps_before
    again = ExportTable()
    for _ in range(3):
        again.export(empty_shared((4,), torch.float32))
    again.close_all()
    gc.collect()
    assert len(again) == 0 and memfd_fds() == fds_before


async def test_aopen_and_close_all_with_events() -> None:
    kv = empty_shared((32,), torch.float32)
    handle = share(kv)
    table = MappingTable()
    imported = await table.aopen_tensor(wire_trip(handle), dup_fds(handle))
    producer = IpcEvent.create()
    wire, fds = producer.export()
    event = table.open_event(wire, [os.dup(fd) for fd in fds])
    assert table.stats() == {"open_mappings": 1, "open_imports": 1, "open_events": 1,
                             "open_fds": 1}
    table.close_all()
    assert table.stats() == {"open_mappings": 0, "open_imports": 0, "open_events": 0,
                             "open_fds": 0}
    assert imported.closed and event.closed
    extra = dup_fds(handle)
    with pytest.raises(IPCError, match="closed"):
        table.open_tensor(wire_trip(handle), extra)
    assert not fd_is_open(extra[0])
    producer.close()


async def test_aopen_cancelled_before_it_runs_closes_the_fds() -> None:
    handle = share(empty_shared((16,), torch.float32))
    table = MappingTable()
    fds = dup_fds(handle)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await table.aopen_tensor(wire_trip(handle), fds)
    assert not fd_is_open(fds[0])
    assert table.stats()["open_imports"] == 0


# -- cuda / musa dispatch with fakes ---------------------------------------------------------


class FakeDeviceTensor(torch.Tensor):
    """A CPU tensor that claims to live on a device, with a fake storage to export."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    fake_device: Any
    fake_storage: Any

    @property
    def device(self) -> Any:  # type: ignore[override]
        return self.fake_device

    def untyped_storage(self) -> Any:  # type: ignore[override]
        return self.fake_storage


def fake_device_module(uuids: tuple[str, ...]) -> SimpleNamespace:
    mod = SimpleNamespace(inits=0)

    def init() -> None:
        mod.inits += 1

    mod.init = init
    mod.device_count = lambda: len(uuids)
    mod.get_device_properties = lambda i: SimpleNamespace(uuid=uuids[i])
    return mod


def ipc_tuple(index: int, nbytes: int) -> tuple[Any, ...]:
    return (index, b"mem-handle", nbytes, 512, b"refcount-file", 8, b"event-handle", True)


@pytest.mark.parametrize("kind", ["cuda", "musa"])
def test_device_dispatch_calls_the_backend_and_rebuilds_the_view(monkeypatch, kind: str) -> None:
    backing = torch.arange(60, dtype=torch.float32)
    base = backing.view(3, 4, 5)
    storage = SimpleNamespace(nbytes=lambda: 240, calls=[])

    def share_device() -> tuple[Any, ...]:
        storage.calls.append("share")
        return ipc_tuple(1, 240)

    setattr(storage, f"_share_{kind}_", share_device)
    tensor = torch.Tensor._make_subclass(FakeDeviceTensor, base.permute(1, 0, 2)[1:])
    tensor.fake_device = SimpleNamespace(type=kind, index=1)
    tensor.fake_storage = storage

    exporter = fake_device_module(("UUID-A", "UUID-B"))
    monkeypatch.setattr(torch, kind, exporter, raising=False)
    handle = share(tensor)
    assert storage.calls == ["share"]
    assert handle.device_kind == kind and handle.device_index == 1
    assert handle.device_uuid == "UUID-B" and handle.ipc == ipc_tuple(1, 240)
    assert handle.fds == () and handle.num_fds == 0

    # In the importer the same device is index 0 (other *_VISIBLE_DEVICES).
    importer = fake_device_module(("UUID-B",))
    monkeypatch.setattr(torch, kind, importer, raising=False)
    opened: list[tuple[Any, ...]] = []

    def new_shared(*args: Any) -> torch.UntypedStorage:
        opened.append(args)
        return backing.untyped_storage()

    monkeypatch.setattr(torch.UntypedStorage, f"_new_shared_{kind}", new_shared, raising=False)
    peer = open_tensor(wire_trip(handle, foreign=True))
    assert opened == [ipc_tuple(0, 240)] and importer.inits == 1
    expected = base.permute(1, 0, 2)[1:]
    assert torch.equal(peer, expected) and peer.stride() == expected.stride()
    assert peer.storage_offset() == expected.storage_offset()

    table = MappingTable()
    one = table.open_tensor(wire_trip(handle, foreign=True))
    two = table.open_tensor(wire_trip(handle, foreign=True))
    assert table.open_mappings == 1 and table.open_imports == 2
    one.close()
    two.close()
    assert table.open_mappings == 0

    with pytest.raises(IPCError, match="takes no fds"):
        open_tensor(wire_trip(handle, foreign=True), [os.eventfd(0)])
    monkeypatch.setattr(torch, kind, fake_device_module(("UUID-C",)), raising=False)
    with pytest.raises(IPCError, match="not visible"):
        open_tensor(wire_trip(handle, foreign=True))


class _WeakStorage(SimpleNamespace):
    """A fake device storage that, like torch's, can be weakly referenced."""

    __slots__ = ("__weakref__",)


def test_own_process_device_handle_uses_the_storage_directly(monkeypatch) -> None:
    """A handle this process exported is resolved to its own storage: the driver cannot
    open a process's own IPC handle ("invalid device context"), so the backend is never
    asked, and a peer that claims our pid is refused."""
    backing = torch.arange(24, dtype=torch.float32)
    storage = _WeakStorage(nbytes=lambda: 96, _share_cuda_=lambda: ipc_tuple(0, 96))
    tensor = torch.Tensor._make_subclass(FakeDeviceTensor, backing.view(4, 6))
    tensor.fake_device = SimpleNamespace(type="cuda", index=0)
    tensor.fake_storage = storage
    monkeypatch.setattr(torch, "cuda", fake_device_module(("U",)))

    def backend(*args: Any) -> Any:
        raise AssertionError("the driver must not be asked to open our own handle")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", backend, raising=False)
    handle = share(tensor)
    assert handle.pid == os.getpid()
    _, got = open_storage(wire_trip(handle), peer_pid=os.getpid())
    assert got is storage
    # The pid must be the peer's own (SO_PEERCRED), so no one can claim to be the server.
    with pytest.raises(IPCError, match="claims pid"):
        MappingTable(peer_pid=os.getpid() + 1).open_tensor(wire_trip(handle))
    # Another process's handle still goes to the driver.
    opened: list[Any] = []
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda",
                        lambda *a: opened.append(a) or backing.untyped_storage(), raising=False)
    open_storage(wire_trip(handle, foreign=True))
    assert len(opened) == 1
    # Once our tensor is gone, our old handle names nothing.
    del tensor, storage, handle
    gc.collect()
    with pytest.raises(IPCError, match="no longer exported"):
        open_storage(TensorHandle.from_wire({**_wire(kind="cuda", nfds=0, nbytes=96,
                                                     ipc=list(ipc_tuple(0, 96))),
                                             "pid": os.getpid()}))


def test_a_worker_in_its_own_pid_namespace_is_served(monkeypatch) -> None:
    """A worker in a container numbers itself in its own PID namespace, so the pid its
    handles carry is never the SO_PEERCRED pid the server sees (found by a probe: every
    register and put of such a worker was refused). The pid means nothing for a memfd, and
    for a device handle only "ours or not" matters, which the kernel's pid decides."""
    kv = empty_shared((4, 4), torch.float32)
    kv.copy_(torch.arange(16, dtype=torch.float32).view(4, 4))
    handle = share(kv)
    in_container = TensorHandle.from_wire({**handle.to_wire(), "pid": 1})
    table = MappingTable(require_sealed=True, peer_pid=os.getpid() + 1)
    imp = table.open_tensor(in_container, dup_fds(handle))
    assert torch.equal(imp.tensor, kv)
    imp.close()
    table.close_all()
    # A device handle of pid 1 from a peer that is not us goes to the driver.
    monkeypatch.setattr(torch, "cuda", fake_device_module(("U",)))
    opened: list[Any] = []
    backing = torch.arange(24, dtype=torch.float32)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda",
                        lambda *a: opened.append(a) or backing.untyped_storage(), raising=False)
    device = TensorHandle.from_wire({**_wire(kind="cuda", index=0, uuid="U", nfds=0, nbytes=96,
                                             shape=[4, 6], stride=[6, 1],
                                             ipc=list(ipc_tuple(0, 96))), "pid": 1})
    open_storage(device, peer_pid=os.getpid() + 1)
    assert len(opened) == 1


def test_musa_without_torch_musa_is_a_device_error(monkeypatch) -> None:
    monkeypatch.delattr(torch, "musa", raising=False)
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    handle = TensorHandle.from_wire(_wire(kind="musa", nfds=0,
                                          ipc=list(ipc_tuple(0, 64))))
    with pytest.raises(DeviceError, match="torch_musa"):
        open_tensor(handle)


def test_export_failure_is_an_ipc_error(monkeypatch) -> None:
    def refuse() -> tuple[Any, ...]:
        raise RuntimeError("driver says no")

    tensor = torch.Tensor._make_subclass(FakeDeviceTensor, torch.zeros(4))
    tensor.fake_device = SimpleNamespace(type="cuda", index=0)
    tensor.fake_storage = SimpleNamespace(nbytes=lambda: 16, _share_cuda_=refuse)
    monkeypatch.setattr(torch, "cuda", fake_device_module(("U",)))
    with pytest.raises(IPCError, match="driver says no"):
        share(tensor)


# -- across real processes -------------------------------------------------------------------

KV_SHAPE = (2, 2, 8, 2, 16)  # (L, 2, T, H, D)


def kv_pattern(seed: int) -> torch.Tensor:
    # Values below 256 are exact in bfloat16, so comparisons can be exact.
    numel = torch.Size(KV_SHAPE).numel()
    return ((torch.arange(numel) % 250) + seed).view(KV_SHAPE).to(torch.bfloat16)


def token_window(kv: torch.Tensor) -> torch.Tensor:
    """A strided view: tokens 2..5 of every layer, tokens moved in front of K/V."""
    return kv.permute(0, 2, 1, 3, 4)[:, 2:6]


def _worker_child(path: str) -> None:
    anyio.run(_worker_main, path)


async def _worker_main(path: str) -> None:
    """The inference worker: owns the KV cache, exports it, and talks through events."""
    async with await Connection.connect(path) as conn:
        kv = empty_shared(KV_SHAPE, torch.bfloat16)
        kv.copy_(kv_pattern(1))
        window = token_window(kv)
        exports = ExportTable()
        handle = exports.export(window)
        ready, ack = IpcEvent.create(), IpcEvent.create()
        ready_wire, ready_fds = ready.export()
        ack_wire, ack_fds = ack.export()
        await conn.send_request(1, "register",
                                {"kv": handle.to_wire(), "ready": ready_wire, "ack": ack_wire},
                                fds=[*handle.fds, *ready_fds, *ack_fds])
        acked = await ack.wait(timeout=30)
        saw = acked and bool((window[:, 0] == 7).all())
        window[:, 1].fill_(9)
        ready.set()
        await conn.send_request(2, "report", {"saw_server_write": saw})
        await anyio.sleep(60)  # the server kills us here


async def test_two_processes_share_kv_and_a_killed_peer_leaves_nothing(tmp_path) -> None:
    multiprocessing.resource_tracker.ensure_running()  # its pipe is not ours to count
    gc.collect()
    fds_before, maps_before = open_fd_count(), memfd_maps()
    path = str(tmp_path / "kv.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    child = multiprocessing.get_context("spawn").Process(target=_worker_child, args=(path,))
    child.start()
    table = MappingTable(require_sealed=True)
    try:
        with anyio.fail_after(60):
            await anyio.wait_readable(listener)
            server_sock, _ = listener.accept()
            conn = Connection(server_sock, expect="request", ops={"register", "report"})
            assert conn.peer_credentials() == (child.pid, os.getuid(), os.getgid())
            register = await conn.receive()
            assert isinstance(register, Request) and len(register.fds) == 3
            handle = TensorHandle.from_wire(register.args["kv"])
            kv = table.open_tensor(handle, register.fds[:1])
            ready = table.open_event(register.args["ready"], register.fds[1:2])
            ack = table.open_event(register.args["ack"], register.fds[2:3])
            window = kv.tensor
            expected = token_window(kv_pattern(1))
            assert torch.equal(window, expected) and window.stride() == expected.stride()
            window[:, 0].fill_(7)
            ack.set()
            assert await ready.wait(timeout=30)
            assert bool((window[:, 1] == 9).all())
            report = await conn.receive()
            assert isinstance(report, Request) and report.args == {"saw_server_write": True}
            assert table.stats() == {"open_mappings": 1, "open_imports": 1, "open_events": 2,
                                     "open_fds": 2}
            assert memfd_maps() == maps_before + 1

            os.kill(child.pid, signal.SIGKILL)
            await anyio.to_thread.run_sync(child.join, 20)
            assert child.exitcode == -signal.SIGKILL
            assert await conn.receive() is None  # the peer's death reads as EOF
            # What the server does for a dead peer:
            table.close_all()
            await conn.aclose()
        del window, kv, ready, ack
        gc.collect()
        assert table.stats() == {"open_mappings": 0, "open_imports": 0, "open_events": 0,
                                 "open_fds": 0}
        assert memfd_maps() == maps_before
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        child.close()
        listener.close()
    assert open_fd_count() == fds_before


@pytest.mark.parametrize("kind", ["cuda", "musa"])
def test_a_device_handle_past_its_allocation_is_refused(monkeypatch, kind: str) -> None:
    """torch maps the size and offset a peer's device handle claims as they are; the memory
    past the peer's allocation may be another peer's. The driver's word on the allocation
    (its address range) bounds the claim; where the driver cannot say, it is taken."""
    from musacache.ipc import _memory

    monkeypatch.setattr(torch, kind, fake_device_module(("U",)), raising=False)
    backing = torch.arange(24, dtype=torch.float32)
    monkeypatch.setattr(torch.UntypedStorage, f"_new_shared_{kind}",
                        lambda *a: backing.untyped_storage(), raising=False)
    start = backing.untyped_storage().data_ptr()
    asked: list[tuple[str, int, int]] = []

    def driver_says(size: int | None) -> None:
        def allocation(k: str, index: int, address: int) -> tuple[int, int] | None:
            asked.append((k, index, address))
            return None if size is None else (start, size)

        monkeypatch.setattr(_memory, "allocation_range", allocation)

    handle = TensorHandle.from_wire({**_wire(kind=kind, index=0, uuid="U", nfds=0, nbytes=96,
                                             shape=[4, 6], stride=[6, 1],
                                             ipc=list(ipc_tuple(0, 96))), "pid": 1})
    driver_says(96)
    open_storage(handle, peer_pid=os.getpid() + 1)
    assert asked == [(kind, 0, start)]
    driver_says(64)  # the allocation is smaller than the claim
    with pytest.raises(IPCError, match="past its end"):
        open_storage(handle, peer_pid=os.getpid() + 1)
    driver_says(None)  # no address-range call in this driver: taken as it is
    open_storage(handle, peer_pid=os.getpid() + 1)
