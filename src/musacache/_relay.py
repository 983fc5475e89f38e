"""Copies between the host and a device as a two-stage pipeline over two streams.

A bus transfer needs a dense buffer on the device side: the copy engine moves runs of bytes,
and a chunk of a prompt's KV (a token slice of ``(L, 2, T, H, D)``), or a chunk gathered from
paged KV, is not one run. Left to ``copy_`` (or to a kernel storing into host memory through
its device address), the dense-making and the transfer of a chunk run one after the other on
one stream, and a store from device pages moves at 0.76 to 0.8x of the bus (H200, 1 GiB).

Here the device-side work of item ``k + 1`` (a copy into a dense buffer, or a paged gather)
runs on a second stream (``devices.side_stream``) while the copy engine moves item ``k``. The
buffers are a ring of ``depth``: item ``k`` waits, on the device, for the item that last used
its buffer. The host never waits; the caller's stream (``main``) ends after everything, so
the one event a move records there still covers the whole of it. Measured on an H200 for a
1 GiB prompt in chunks of 32 MiB: 54.6 GB/s against 50.8 for a ``copy_`` per chunk and 55.1
for one contiguous copy (``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import devices

__all__ = ["DEPTH", "host_side", "queue_copies", "relay", "words"]

#: Buffers in flight: one being filled, one being moved, one spare so neither waits.
DEPTH = 3

Step = tuple[Callable[[], None], Callable[[], None]]


def relay(device: torch.device, main: Any, steps: Sequence[Step], *,
          first_on_main: bool, depth: int = DEPTH) -> None:
    """Queue each step's two halves: ``first()`` on one stream, then ``second()`` on the
    other once ``first`` is done there; step ``k``'s first half waits for step ``k - depth``'s
    second half (the buffer they share). ``first_on_main`` puts the first halves on ``main``
    (host to device: the bus transfer comes first), else on the side stream (device to host).

    Everything queued on ``main`` before the call is done before any half starts, and
    ``main`` waits for every half: the caller records its completion event on ``main``.
    Nothing here waits on the host."""
    side = devices.side_stream(device)
    first, second = (main, side) if first_on_main else (side, main)
    devices.wait_for(side, devices.record_event(device, main))
    free: list[Any] = [None] * depth
    last: Any = None
    for k, (one, two) in enumerate(steps):
        slot = k % depth
        with devices.stream_context(device, first):
            devices.wait_for(first, free[slot])
            _enqueue(one)
            filled = devices.record_event(device, first)
        with devices.stream_context(device, second):
            devices.wait_for(second, filled)
            _enqueue(two)
            last = free[slot] = devices.record_event(device, second)
    if second is not main:
        devices.wait_for(main, last)


def host_side(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in host memory (a function, so that structure tests running on
    the CPU can say which of their tensors stand for device ones)."""
    return t.device.type == "cpu"


def words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed as the widest integers their layouts allow (bits, not
    values: NaN payloads and fp8 pass unchanged), or as they are.

    A strided copy on a device moves elements: two-byte ones at 806 GB/s on an H200, eight-
    byte ones at 1,594 (a 1 GiB prompt in 32 chunks; one contiguous copy: 2,071)."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.dim() == 0:
        return dst, src
    size = dst.element_size()
    for wide in (torch.int64, torch.int32):
        w = wide.itemsize
        if w <= size:
            break
        if all(_fits(t, size, w) for t in (dst, src)):
            return dst.view(wide), src.view(wide)
    return dst, src


def _fits(t: torch.Tensor, size: int, wide: int) -> bool:
    if t.stride(-1) != 1 or (t.shape[-1] * size) % wide or (t.storage_offset() * size) % wide:
        return False
    return all((st * size) % wide == 0 for st in t.stride()[:-1])


def queue_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 main: Any) -> None:
    """``dst.copy_(src)`` for every pair, queued on ``main`` (current) and the side stream.

    Device to device: as words. Between the host and the device, where the device side is
    not one run of bytes: relayed through dense device buffers, when there are at least two
    such pairs one way. Anything else: ``copy_`` as it is."""
    to_host: list[tuple[torch.Tensor, torch.Tensor]] = []
    to_device: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in pairs:
        d_host, s_host = host_side(d), host_side(s)
        if d_host != s_host and d.dtype == s.dtype and d.shape == s.shape:
            on_device = s if d_host else d
            if not on_device.is_contiguous():
                (to_host if d_host else to_device).append((d, s))
                continue
        _copy(*words(d, s))
    for group, up in ((to_host, False), (to_device, True)):
        if len(group) == 1:
            _copy(*group[0])
        elif group:
            _relay_pairs(group, device, main, up)


def _relay_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 main: Any, up: bool) -> None:
    """Host/device pairs through a ring of dense device buffers (``up``: host to device).

    The buffers are allocated on ``main`` (current) and are used on both streams; ``main``
    waits for the side stream's last half, so freeing them afterwards, in ``main``'s order,
    is safe."""
    depth = min(DEPTH, len(pairs))
    size = max(d.numel() * d.element_size() for d, _ in pairs)
    where = pairs[0][0 if up else 1].device  # the device side's
    ring = [torch.empty(size, dtype=torch.uint8, device=where) for _ in range(depth)]
    steps: list[Step] = []
    for k, (d, s) in enumerate(pairs):
        dense = ring[k % depth][: d.numel() * d.element_size()].view(d.dtype).view(d.shape)
        # up: the bus into the dense buffer, then the scatter into the strided dst; down: the
        # gather into the dense buffer, then the bus out of it.
        bus, spread = ((dense, s), (d, dense)) if up else ((d, dense), (dense, s))
        steps.append((_copier(*bus), _copier(*words(*spread))) if up
                     else (_copier(*words(*spread)), _copier(*bus)))
    relay(device, main, steps, first_on_main=up)


# The structure tests replace these two: they queue the work on fake streams and run the
# streams in random interleavings, as a device may.


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    return lambda: _copy(dst, src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue one copy on the current stream."""
    dst.copy_(src, non_blocking=True)


def _enqueue(half: Callable[[], None]) -> None:
    """Queue one half of a step (its launches) on the current stream."""
    half()
