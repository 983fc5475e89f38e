"""The data path: one batched move per request.

A request's bytes move in **one** worker-thread hop. On a cuda/musa device that hop only
*enqueues* work: the copies and gathers run on a dedicated copy stream, ordered after the
caller's stream by a stream wait (no host block), and the hop returns one event recorded at the
end. The loop then awaits that event by polling it: one event wait per request, no
``synchronize`` anywhere, and the compute stream is never blocked.

``gather_chunks`` / ``scatter_chunks`` move a whole run of a paged KV cache into (or out of)
several dense chunk tensors. ``musacache.transfer`` gains request-level versions of them; until
then these fall back to one ``transfer.gather``/``scatter`` per chunk, with the same signature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from . import devices

__all__ = ["Mover", "gather_chunks", "scatter_chunks"]

# Above about this many bytes per copy, torch's copy_ already runs on all intra-op threads.
_TORCH_PARALLEL_COPY_BYTES = 4 * 1024 * 1024


def _transfer_fn(name: str) -> Callable[..., None] | None:
    from . import transfer

    fn: Callable[..., None] | None = getattr(transfer, name, None)
    return fn


def gather_chunks(kv_caches: Any, slots: torch.Tensor, dsts: Sequence[torch.Tensor],
                  layout: str, *, stream: Any = None) -> None:
    """Gather ``len(slots)`` tokens of the pages into ``dsts``, chunk after chunk (their
    token counts add up to ``len(slots)``). Runs on ``stream`` when given (enqueue only)."""
    native = _transfer_fn("gather_chunks")
    if native is not None:
        native(kv_caches, slots, list(dsts), layout, stream=stream)
        return
    from . import transfer

    paged = transfer.describe(kv_caches, layout)
    dev = paged.device
    if dev.type != "cpu":
        slots = slots.to(dev, non_blocking=True)
    with devices.stream_context(dev, stream):
        staging: torch.Tensor | None = None
        lo = 0
        for dst in dsts:
            n = dst.shape[paged.spec().token_dim]
            part = slots[lo : lo + n]
            lo += n
            if dst.device == dev:
                transfer.gather(kv_caches, part, dst, layout)
                continue
            # Stream order makes one chunk-sized staging buffer enough: the next gather into
            # it is queued after the copy out of it. The prompt is never staged whole.
            if staging is None or staging.shape != dst.shape:
                staging = torch.empty(dst.shape, dtype=dst.dtype, device=dev)
            transfer.gather(kv_caches, part, staging, layout)
            dst.copy_(staging, non_blocking=True)


def scatter_chunks(srcs: Sequence[torch.Tensor], kv_caches: Any, slots: torch.Tensor,
                   layout: str, *, stream: Any = None) -> None:
    """Scatter the dense chunks ``srcs`` (in order) into the pages at ``slots``."""
    native = _transfer_fn("scatter_chunks")
    if native is not None:
        native(list(srcs), kv_caches, slots, layout, stream=stream)
        return
    from . import transfer

    paged = transfer.describe(kv_caches, layout)
    dev = paged.device
    if dev.type != "cpu":
        slots = slots.to(dev, non_blocking=True)
    with devices.stream_context(dev, stream):
        lo = 0
        for src in srcs:
            n = src.shape[paged.spec().token_dim]
            part = slots[lo : lo + n]
            lo += n
            if src.device != dev:
                src = src.to(dev, non_blocking=True)
            transfer.scatter(src, kv_caches, part, layout)


def accelerator_of(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The cuda/musa device a move touches, or None if it is all host memory."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return None


class Mover:
    """Runs the move step of every request: one worker-thread hop, one event wait."""

    def __init__(self, limiter: anyio.CapacityLimiter, copy_threads: int,
                 inline_bytes: int) -> None:
        self.limiter = limiter
        self.copy_threads = copy_threads
        self.inline_bytes = inline_bytes
        self._streams: dict[torch.device, Any] = {}
        #: Moves run, and event waits made (one per device move): structure tests read them.
        self.moves = 0
        self.event_waits = 0

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(fn, limiter=self.limiter)

    def copy_stream(self, device: torch.device) -> Any:
        """The dedicated copy stream of ``device`` (made once, in a worker thread)."""
        s = self._streams.get(device)
        if s is None:
            mod = devices.accelerator_module(device.type)
            if mod is None:
                raise RuntimeError(f"{device.type} is not available")
            s = mod.Stream(device)
            self._streams[device] = s
        return s

    async def run(self, work: Callable[[Any], None], *, device: torch.device | None,
                  nbytes: int) -> None:
        """Run ``work(stream)``: on the host in a worker thread (inline when tiny), or on
        ``device``'s copy stream, awaited through one event."""
        self.moves += 1
        if device is None:
            if nbytes < self.inline_bytes:
                work(None)
            else:
                await self.in_thread(lambda: work(None))
            return
        mod = devices.accelerator_module(device.type)
        if mod is None:
            raise RuntimeError(f"{device.type} is not available")
        caller = devices.current_stream(device)  # a handle, taken on this thread: no sync

        def enqueue() -> Any:
            stream = self.copy_stream(device)
            stream.wait_stream(caller)  # ordered after the caller's kernels, host not blocked
            with devices.stream_context(device, stream):
                work(stream)
            done = mod.Event()
            done.record(stream)
            return done

        done = await self.in_thread(enqueue)
        self.event_waits += 1
        # Shielded: the memory under these copies must not be freed before they finish.
        with anyio.CancelScope(shield=True):
            await devices.poll_until(lambda: bool(done.query()), None)

    async def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every pair, as one move."""
        if not pairs:
            return
        device = accelerator_of([t for p in pairs for t in p])
        total = sum(d.numel() * d.element_size() for d, _ in pairs)
        if device is not None:
            def on_stream(_stream: Any) -> None:
                for d, s in pairs:
                    d.copy_(s, non_blocking=True)

            await self.run(on_stream, device=device, nbytes=total)
            return

        def serial(group: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[Any], None]:
            def go(_stream: Any) -> None:
                for d, s in group:
                    d.copy_(s)
            return go

        # torch already spreads one large copy over its intra-op threads; splitting a batch
        # of large copies over our worker threads as well only oversubscribes the cores.
        # Small copies (which torch runs on one thread) are split.
        large = total // len(pairs) >= _TORCH_PARALLEL_COPY_BYTES
        nthreads = 1 if large or total < self.inline_bytes else min(self.copy_threads,
                                                                     len(pairs))
        if nthreads <= 1:
            await self.run(serial(pairs), device=None, nbytes=total)
            return
        self.moves += 1
        async with anyio.create_task_group() as tg:
            for i in range(nthreads):
                tg.start_soon(self.in_thread, lambda g=pairs[i::nthreads]: serial(g)(None))
