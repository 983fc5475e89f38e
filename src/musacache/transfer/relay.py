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

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from musacache import devices

__all__ = ["DEPTH", "buffers", "host_side", "queue_copies", "relay", "runs", "words"]

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
    with devices.stream_switch(device, main) as use:
        for k, (one, two) in enumerate(steps):
            slot = k % depth
            use(first)
            devices.wait_for(first, free[slot])
            _enqueue(one)
            filled = devices.record_event(device, first)
            use(second)
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
    size = dst.element_size()
    if size >= 8 or dst.dtype != src.dtype or dst.dim() == 0 or dst.shape != src.shape:
        return dst, src
    ds, ss = dst.stride(), src.stride()
    if ds[-1] != 1 or ss[-1] != 1:
        return dst, src
    # Every offset and stride, in bytes, must be a multiple of the wider item.
    common = math.gcd(dst.shape[-1], dst.storage_offset(), src.storage_offset(),
                      *ds[:-1], *ss[:-1]) * size
    for wide in (torch.int64, torch.int32):
        if wide.itemsize > size and common % wide.itemsize == 0:
            return dst.view(wide), src.view(wide)
    return dst, src


def runs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pairs`` with each run of consecutive pairs that is one strided copy merged into it.

    A run: the same shapes and strides, every ``dst`` a view of one tensor and every ``src``
    of another, each pair a fixed positive distance past the one before on both sides (a
    prompt's chunks going into slots that follow each other in a pool). The merged pair has
    one more leading dim and addresses exactly the elements the pairs did, so one launch
    moves them all: on a device the copies of a put or a get are otherwise launches of 20 to
    30 microseconds each, longer than the copies they queue."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    n, i = len(pairs), 0
    while i < n:
        d0, s0 = pairs[i]
        j = i + 1
        item = d0.element_size()
        if (j < n and d0._base is not None and s0._base is not None
                and d0.dtype == s0.dtype):
            step_d = pairs[j][0].data_ptr() - d0.data_ptr()
            step_s = pairs[j][1].data_ptr() - s0.data_ptr()
            if step_d > 0 and step_s > 0 and not step_d % item and not step_s % item:
                layout = (d0.shape, d0.stride(), d0.dtype, s0.shape, s0.stride(), s0.dtype)
                while j < n:
                    d, s = pairs[j]
                    prev_d, prev_s = pairs[j - 1]
                    if (d._base is not d0._base or s._base is not s0._base
                            or (d.shape, d.stride(), d.dtype, s.shape, s.stride(),
                                s.dtype) != layout
                            or d.data_ptr() - prev_d.data_ptr() != step_d
                            or s.data_ptr() - prev_s.data_ptr() != step_s):
                        break
                    j += 1
        if j - i > 1:
            k = j - i
            out.append((d0.as_strided((k, *d0.shape), (step_d // item, *d0.stride())),
                        s0.as_strided((k, *s0.shape), (step_s // item, *s0.stride()))))
        else:
            out.append((d0, s0))
        i = j
    return out


def queue_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 main: Any) -> None:
    """``dst.copy_(src)`` for every pair, queued on ``main`` (current) and the side stream.

    Device to device: runs of pairs merged (:func:`runs`), as words. Between the host and
    the device, where the device side is not one run of bytes: relayed through dense device
    buffers, when there are at least two such pairs one way. Anything else: ``copy_`` as it
    is."""
    to_host: list[tuple[torch.Tensor, torch.Tensor]] = []
    to_device: list[tuple[torch.Tensor, torch.Tensor]] = []
    direct: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in pairs:
        d_host, s_host = host_side(d), host_side(s)
        if d_host != s_host and d.dtype == s.dtype and d.shape == s.shape:
            on_device = s if d_host else d
            if not on_device.is_contiguous():
                (to_host if d_host else to_device).append((d, s))
                continue
        direct.append((d, s))
    for d, s in runs(direct):
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
    ring = buffers(size, pairs[0][0 if up else 1].device, depth)
    if ring is None:  # no room on the device: torch's own copies, a chunk at a time
        for d, s in pairs:
            _copy(d, s)
        return
    steps: list[Step] = []
    for k, (d, s) in enumerate(pairs):
        dense = ring[k % depth][: d.numel() * d.element_size()].view(d.dtype).view(d.shape)
        if up:  # the bus into the dense buffer, then the scatter into the strided dst
            steps.append((_copier(dense, s), _copier(*words(d, dense))))
        else:  # the gather into the dense buffer, then the bus out of it
            steps.append((_copier(*words(dense, s)), _copier(d, dense)))
    relay(device, main, steps, first_on_main=up)


def buffers(nbytes: int, device: torch.device, count: int) -> list[torch.Tensor] | None:
    """``count`` device buffers of ``nbytes`` for a relay, or None when the device has no
    room for them (an engine may hold nearly all of its memory): the caller then moves its
    data the way it did before the relay, which needs less or no staging, before anything
    of the request is queued."""
    try:
        return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
    except torch.OutOfMemoryError:
        return None
    except RuntimeError as e:  # an accelerator whose allocator raises a plain RuntimeError
        if "out of memory" in str(e).lower():
            return None
        raise


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    return lambda: _copy(dst, src)  # _copy looked up when it runs (the tests replace it)


# The structure tests replace these two: they queue the work on fake streams and run the
# streams in random interleavings, as a device may.


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue one copy on the current stream."""
    dst.copy_(src, non_blocking=True)


def _enqueue(half: Callable[[], None]) -> None:
    """Queue one half of a step (its launches) on the current stream."""
    half()
