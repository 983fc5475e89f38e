"""The device layer's cuda/musa dispatch, tested on the CPU with fake accelerator modules."""

import threading
import types

import anyio
import pytest
import torch

import musacache as mc
from musacache import devices


class FakeEvent:
    made: list["FakeEvent"] = []
    ipc_ok = True

    def __init__(self, interprocess=False):
        self.interprocess = interprocess
        self.recorded_on = None
        self.polls = 0
        self.ready_after = 3
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.recorded_on = stream

    def query(self):
        self.polls += 1
        return self.polls >= self.ready_after

    def ipc_handle(self):
        if not FakeEvent.ipc_ok:
            raise RuntimeError("interprocess events are not supported")
        return b"\x01" * 64


class FakeStream:
    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


def fake_accel(count=1, ipc_ok=True):
    FakeEvent.ipc_ok = ipc_ok
    registered = []
    stream = FakeStream()
    entered = []

    class Ctx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            entered.append(self.s)

        def __exit__(self, *a):
            return False

    rt = types.SimpleNamespace(
        musaHostRegister=lambda ptr, size, flags: registered.append((ptr, size, flags)) or 0,
        musaHostUnregister=lambda ptr: 0)
    mod = types.SimpleNamespace(
        is_available=lambda: count > 0, device_count=lambda: count, Event=FakeEvent,
        Stream=FakeStream, current_stream=lambda device=None: stream, stream=Ctx,
        musart=lambda: rt)
    mod.registered, mod.the_stream, mod.entered = registered, stream, entered
    return mod


@pytest.fixture
def fakes(monkeypatch):
    installed = {}

    def install(kind, mod):
        monkeypatch.setitem(devices._module_overrides, kind, mod)
        installed[kind] = mod
        devices._reset_probes()
        return mod

    monkeypatch.setitem(devices._module_overrides, "cuda", None)
    monkeypatch.setitem(devices._module_overrides, "musa", None)
    devices._reset_probes()
    yield install
    devices._reset_probes()


def test_cpu_only_machine(fakes):
    assert not devices.has_accelerator()
    assert devices.default_device() == torch.device("cpu")
    assert devices.resolve("auto") == torch.device("cpu")
    caps = devices.capabilities("cpu")
    assert caps.pinned_memory is False  # the CPU build of torch cannot pin
    assert devices.capabilities("musa").available is False
    with pytest.raises(mc.DeviceError, match="not available"):
        devices.resolve("cuda")
    with pytest.raises(mc.DeviceError):
        devices.alloc_host(64, pinned=True)
    with pytest.raises(mc.ConfigError):
        devices.resolve("tpu")


def test_cuda_dispatch_and_capabilities(fakes):
    fakes("cuda", fake_accel(count=2))
    assert devices.default_device() == torch.device("cuda", 0)
    assert devices.resolve("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(mc.DeviceError, match="2 visible"):
        devices.resolve("cuda:5")
    caps = devices.capabilities("cuda")
    assert caps.available and caps.device_count == 2 and caps.event_ipc and caps.streams
    assert devices.capabilities("cpu").pinned_memory  # pinning is possible with an accelerator


def test_musa_event_ipc_is_probed_with_fallback(fakes):
    fakes("musa", fake_accel(ipc_ok=False))
    caps = devices.capabilities("musa")
    assert caps.available and caps.event_ipc is False
    devices._reset_probes()
    fakes("musa", fake_accel(ipc_ok=True))
    assert devices.capabilities("musa").event_ipc is True


def test_musa_pinned_memory_uses_host_register(fakes):
    mod = fakes("musa", fake_accel())
    buf = devices.alloc_host(4096, pinned=True)
    assert buf.numel() == 4096
    assert mod.registered == [(buf.data_ptr(), 4096, 0)]


def test_streams_dispatch(fakes):
    mod = fakes("cuda", fake_accel())
    dev = torch.device("cuda", 0)
    s = devices.current_stream(dev)
    assert s is mod.the_stream
    with devices.stream_context(dev, s):
        pass
    assert mod.entered == [s]
    devices.synchronize(dev, s)
    assert s.synced == 1
    assert devices.current_stream(torch.device("cpu")) is None


async def test_device_event_is_awaited_by_polling(fakes):
    mod = fakes("cuda", fake_accel())
    ev = devices.DeviceEvent("cuda")
    ev.record()
    assert ev.raw.recorded_on is mod.the_stream
    assert await ev.wait(timeout=2) is True
    assert ev.raw.polls >= 3
    never = devices.DeviceEvent("cuda")
    never.raw.ready_after = 10**9
    assert await never.wait(timeout=0.05) is False
    with pytest.raises(TimeoutError):
        await devices.wait_ready(never, timeout=0.05)


def test_device_event_needs_an_accelerator(fakes):
    with pytest.raises(mc.DeviceError):
        devices.DeviceEvent("cpu")


async def test_host_event_set_from_another_thread_wakes_the_loop():
    ev = devices.HostEvent()
    threading.Timer(0.05, ev.set).start()
    with anyio.fail_after(5):
        assert await ev.wait(timeout=5) is True
    ev2 = devices.HostEvent()
    assert await ev2.wait(timeout=0.02) is False
    with pytest.raises(TimeoutError):
        await devices.wait_ready(ev2, timeout=0.02)


async def test_wait_ready_accepts_anyio_events_and_rejects_junk():
    e = anyio.Event()
    e.set()
    await devices.wait_ready(e, timeout=1)
    await devices.wait_ready(None)
    with pytest.raises(mc.DeviceError):
        await devices.wait_ready(object(), timeout=1)


# -- copy streams and event ordering ---------------------------------------------------------


class StreamMaker:
    """A fake Stream class that remembers what it made and what each stream waited for."""

    def __init__(self):
        self.made = []

    def __call__(self, device=None):
        stream = types.SimpleNamespace(device=device, waited=[])
        stream.wait_event = stream.waited.append
        self.made.append(stream)
        return stream


def test_copy_stream_is_one_per_device_and_kept(fakes):
    mod = fake_accel(count=2)
    mod.Stream = StreamMaker()
    fakes("cuda", mod)
    first = devices.copy_stream(torch.device("cuda", 0))
    assert devices.copy_stream(torch.device("cuda")) is first  # index None is device 0
    other = devices.copy_stream(torch.device("cuda", 1))
    assert other is not first and other.device == torch.device("cuda", 1)
    assert len(mod.Stream.made) == 2
    assert devices.copy_stream(torch.device("cpu")) is None
    side = devices.side_stream(torch.device("cuda", 0))
    assert side is not first and side is devices.side_stream(torch.device("cuda"))
    assert side.device == torch.device("cuda", 0) and len(mod.Stream.made) == 3
    assert devices.side_stream(torch.device("cpu")) is None


def test_record_event_and_wait_for_order_streams_without_the_host(fakes):
    mod = fake_accel()
    mod.Stream = StreamMaker()
    fakes("cuda", mod)
    dev = torch.device("cuda", 0)
    copy = devices.copy_stream(dev)
    produced = devices.record_event(dev)  # on the compute (current) stream
    assert produced.recorded_on is mod.the_stream
    devices.wait_for(copy, produced)
    assert copy.waited == [produced]
    done = devices.record_event(dev, copy)
    assert done.recorded_on is copy
    assert mod.the_stream.synced == 0  # nobody synchronized anything
    assert devices.record_event(torch.device("cpu")) is None
    devices.wait_for(None, produced)  # the CPU: nothing to order


class BlockingEvent:
    """An event whose synchronize() blocks its thread until the test releases it."""

    def __init__(self):
        self.released = threading.Event()
        self.synchronize_threads = []

    def query(self):
        return self.released.is_set()

    def synchronize(self):
        self.synchronize_threads.append(threading.get_ident())
        self.released.wait(10)


async def test_wait_event_waits_in_a_thread_and_never_blocks_the_loop():
    event = BlockingEvent()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while not event.released.is_set():
            ticks += 1
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        threading.Timer(0.1, event.released.set).start()
        with anyio.fail_after(5):
            assert await devices.wait_event(event) is True
    assert ticks >= 5  # the loop ran other tasks while the event was pending
    assert event.synchronize_threads and threading.get_ident() not in (
        event.synchronize_threads)


async def test_wait_event_times_out_and_polls_events_without_synchronize():
    stuck = BlockingEvent()
    with anyio.fail_after(5):
        assert await devices.wait_event(stuck, timeout=0.05) is False
    stuck.released.set()  # let the abandoned thread finish
    assert await devices.wait_event(None) is True
    polled = FakeEvent()
    with anyio.fail_after(5):
        assert await devices.wait_event(polled, timeout=2) is True
    assert polled.polls >= 3
