"""Memory and event IPC on a real CUDA device, across two processes (spawned: CUDA cannot
be used in a forked child)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection as Pipe
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import pytest
import torch

from musacache.ipc import (
    IpcEvent,
    MappingTable,
    TensorHandle,
    empty_shared,
    event_ipc_capability,
    open_tensor,
    share,
)

pytestmark = pytest.mark.gpu

KV_SHAPE = (2, 2, 16, 4, 8)  # (L, 2, T, H, D)


def kv_pattern(device: str) -> torch.Tensor:
    numel = torch.Size(KV_SHAPE).numel()
    # Values below 256 are exact in bfloat16, so comparisons can be exact.
    return (torch.arange(numel, device=device) % 250).view(KV_SHAPE).to(torch.bfloat16)


def token_window(kv: torch.Tensor) -> torch.Tensor:
    return kv.permute(0, 2, 1, 3, 4)[:, 4:12]


def consumer_writes(window: torch.Tensor, whole: torch.Tensor) -> None:
    """What the consumer writes, in order: token 4 (the window's first) of every layer, then
    all of layer 1's V plane, which overwrites layer 1's V of token 4 again."""
    window[:, 0].fill_(7)
    whole[1, 1].fill_(3)


def expected_after_writes(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` after :func:`consumer_writes`, built index by index rather than through views."""
    expected = kv.clone()
    expected[:, :, 4] = 7
    expected[1, 1, :] = 3
    return expected


@contextlib.contextmanager
def spawned(target: Callable[[Pipe], None]) -> Iterator[tuple[Pipe, BaseProcess]]:
    """``target(pipe)`` in a spawned child (CUDA cannot be used in a forked one): our end
    of the pipe and the child, killed on the way out if it still runs."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=target, args=(theirs,))
    child.start()
    try:
        yield ours, child
    finally:
        if child.is_alive():
            child.kill()
            child.join()


def receive(pipe: Pipe, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError("the other process did not answer in time")
    return pipe.recv()


def _consumer_child(pipe: Pipe) -> None:
    """The server side: map the producer's KV, check it, write into it, signal by event."""
    message = receive(pipe, 60)
    table = MappingTable()
    window = table.open_tensor(TensorHandle.from_wire(message["window"]))
    whole = table.open_tensor(TensorHandle.from_wire(message["whole"]))
    report: dict[str, Any] = {
        "window_ok": bool(torch.equal(window.tensor, token_window(kv_pattern("cuda")))),
        "stride_ok": window.tensor.stride() == tuple(message["window"]["stride"]),
        "mappings": table.open_mappings,
        "imports": table.open_imports,
    }
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        consumer_writes(window.tensor, whole.tensor)
        done = IpcEvent.create("cuda:0", mode="device")
        done.record_blocking(stream)
    wire, fds = done.export()
    report["event"] = wire
    report["fds"] = len(fds)
    pipe.send(report)
    receive(pipe, 60)  # keep mappings and the event alive until the producer has looked
    table.close_all()
    report_closed = {"mappings": table.open_mappings, "imports": table.open_imports}
    pipe.send(report_closed)


async def test_cuda_memory_and_event_ipc_across_processes() -> None:
    assert event_ipc_capability("cuda") == "device"
    kv = kv_pattern("cuda:0")
    expected = expected_after_writes(kv)
    torch.cuda.synchronize()
    window_handle, whole_handle = share(token_window(kv)), share(kv)
    assert window_handle.device_uuid is not None and window_handle.fds == ()
    with spawned(_consumer_child) as (ours, child):
        ours.send({"window": window_handle.to_wire(), "whole": whole_handle.to_wire()})
        report = await anyio.to_thread.run_sync(receive, ours, 120)
        assert report["window_ok"] and report["stride_ok"]
        assert (report["mappings"], report["imports"]) == (1, 2)  # two views, one storage
        assert report["fds"] == 0
        event = IpcEvent.from_wire(report["event"])
        assert event.mode == "device"
        assert await event.wait(timeout=30)
        # Every byte: the consumer's writes landed in our memory, in order, and nothing else
        # changed (the window's token 4 of layer 1's V was overwritten by the whole-plane fill).
        assert torch.equal(kv, expected)
        ours.send("done")
        closed = await anyio.to_thread.run_sync(receive, ours, 60)
        assert closed == {"mappings": 0, "imports": 0}
        event.close()
        await anyio.to_thread.run_sync(child.join, 30)
        assert child.exitcode == 0


async def test_cuda_host_fallback_event_synchronises_the_stream() -> None:
    event = IpcEvent.create("cuda:0", mode="host")
    assert event.mode == "host"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.ones(4096, 4096, device="cuda:0")
        for _ in range(5):
            x = x @ x / 4096
    await event.record(stream)
    assert event.is_set()
    assert stream.query()  # everything before the record is done once the event is set
    event.close()


def test_cpu_tensor_opened_in_process_still_works_next_to_cuda() -> None:
    # The CPU path must not depend on CUDA state (a server maps both kinds of worker).
    kv = empty_shared((4, 4), torch.float32)
    handle = share(kv)
    peer = open_tensor(handle, [os.dup(fd) for fd in handle.fds])
    peer.fill_(2)
    assert bool((kv == 2).all())


def _claims_child(pipe: Pipe) -> None:
    """Open a true handle and one that claims more bytes than its allocation holds."""
    from musacache import IPCError

    message = receive(pipe, 60)
    report: dict[str, str] = {}
    for name in ("true", "inflated"):
        try:
            open_tensor(TensorHandle.from_wire(message[name]))
            report[name] = "opened"
        except IPCError as exc:
            report[name] = f"refused: {exc}"
        except Exception as exc:  # reported to the test, which fails on it
            report[name] = f"error: {exc!r}"
    pipe.send(report)


async def test_a_cuda_handle_claiming_past_its_allocation_is_refused() -> None:
    from musacache.devices import allocation_range

    kv = torch.zeros(4096, device="cuda:0")
    torch.cuda.synchronize()
    got = allocation_range("cuda", 0, kv.data_ptr())
    assert got is not None, "the CUDA driver did not say the allocation's range"
    base, size = got
    assert base <= kv.data_ptr() and kv.data_ptr() + kv.nbytes <= base + size
    true = share(kv).to_wire()
    inflated = dict(true)
    claim = base + size - kv.data_ptr() + (1 << 20)  # a MiB past the allocation's end
    inflated["nbytes"] = claim
    inflated["ipc"] = list(true["ipc"])
    inflated["ipc"][2] = claim
    inflated["pid"] = true["pid"]
    with spawned(_claims_child) as (ours, child):
        ours.send({"true": true, "inflated": inflated})
        report = await anyio.to_thread.run_sync(receive, ours, 120)
        assert report["true"] == "opened", report
        assert report["inflated"].startswith("refused") and "past its end" in \
            report["inflated"], report
        await anyio.to_thread.run_sync(child.join, 30)
        assert child.exitcode == 0
