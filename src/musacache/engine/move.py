"""The data path: one batched move per request.

A request's bytes move in **one** worker-thread hop. On a cuda/musa device that hop only
*enqueues* work: the copies and gathers run on the device's dedicated copy stream
(``devices.copy_stream``), ordered after the caller's stream by an event the copy stream waits
on (the host does not wait), and the hop returns one event recorded at the end. The loop then
awaits that one event (``devices.wait_event``: a waiter thread, never the loop thread): one
event wait per request, no per-chunk synchronize, and the compute stream is never blocked.

Paged stores and retrieves go through ``transfer.gather_chunks`` / ``scatter_chunks``: the
whole request's chunks in one call (one native call on the CPU, O(layers) launches or one
fused kernel on a device).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from musacache import devices
from musacache._errors import CacheClosedError
from musacache._executor import Lane, outlive
from musacache.transfer import gather_chunks, scatter_chunks
from musacache.transfer.relay import queue_copies

__all__ = ["Mover", "accelerator_of", "gather_chunks", "scatter_chunks"]

# Pairs whose devices and sizes one turn of the loop looks at (16,384 at once: 5 ms).
_SCAN_RUN = 2048
# Above about this many bytes per copy, torch's copy_ already runs on all intra-op threads.
_TORCH_PARALLEL_COPY_BYTES = 4 * 1024 * 1024
# What a move asked for once the cache closed raises (CacheClosedError).
_CLOSED = "the cache closed while this operation was moving its data"


def accelerator_of(tensors: Sequence[torch.Tensor]) -> torch.device | None:
    """The cuda/musa device a move touches, or None if it is all host memory."""
    for t in tensors:
        if not t.is_cpu:  # an attribute read; t.device makes an object (a long read has 32k)
            return t.device
    return None


class Mover:
    """Runs the move step of every request: one worker-thread hop, one event wait.

    Its hops run in ``lane``, the cache executor's copy lane (``copy_threads`` at once)."""

    def __init__(self, lane: Lane, inline_bytes: int) -> None:
        self.copy_threads = lane.limit
        self.inline_bytes = inline_bytes
        self._lane = lane
        #: The cache's worker threads, whose copy lane this is.
        self.executor = lane.executor
        #: Moves run, and event waits made (one per device move): structure tests read them.
        self.moves = 0
        self.event_waits = 0
        # Moves under way (a thread's function, or a device move's event not yet done); a
        # store writes the cache's slots by address, which keeps no segment alive, so
        # ``quiesce`` waits for these before the cache frees its memory.
        self._running = 0
        self._idle: asyncio.Future[None] | None = None
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(_CLOSED)

    def _done(self) -> None:
        self._running -= 1
        if not self._running and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a copy thread. A caller cancelled while ``fn`` runs still waits for it
        to end, then is cancelled: ``fn`` reads and writes memory the caller owns and frees.
        One cancelled while ``fn`` still waits for a thread takes it off the queue instead."""
        self._check_open()
        self._running += 1
        try:
            return await self._lane.run(fn)
        finally:
            self._done()

    async def quiesce(self) -> None:
        """Refuse new moves (they raise :class:`CacheClosedError`) and wait for the running
        ones to end: the cache is closing and is about to free the memory they touch. A
        cancellation meanwhile is raised once they have ended."""
        self._closed = True
        came: BaseException | None = None
        while self._running:
            self._idle = idle = asyncio.get_running_loop().create_future()
            came = await outlive(idle) or came
        if came is not None:
            try:
                raise came
            finally:
                del came  # (a local would keep its traceback in a cycle)

    def close(self) -> None:
        """Refuse new moves (the cache is closed: nothing hops any more)."""
        self._closed = True

    def shut_down(self) -> None:
        """Refuse new moves and wait (blocking) until no copy runs: for a cache whose event
        loop is gone, whose running moves can no longer be awaited."""
        self._closed = True
        self._lane.wait_idle()

    async def run(self, work: Callable[[Any], None], *, device: torch.device | None,
                  nbytes: int) -> None:
        """Run ``work(stream)``: on the host in a worker thread (inline when tiny), or
        enqueued on ``device``'s copy stream and awaited through one event."""
        self._check_open()
        self.moves += 1
        if device is None:
            if nbytes < self.inline_bytes:
                work(None)
            else:
                await self.in_thread(lambda: work(None))
            return
        caller = devices.current_stream(device)  # a handle, taken on this thread: no sync

        queued: list[Any] = []  # the copies' event, kept if the caller is cancelled meanwhile

        def enqueue() -> None:
            stream = devices.copy_stream(device)
            # Ordered after the caller's kernels on the device; the host does not wait.
            devices.wait_for(stream, devices.record_event(device, caller))
            with devices.stream_context(device, stream):
                work(stream)
            queued.append(devices.record_event(device, stream))

        # A move is running until its copies end on the device, not when the hop that
        # queued them returns: the memory under them must not be freed before (by the
        # caller, or by aclose), whatever cancels the caller meanwhile.
        self._running += 1
        try:
            await self.in_thread(enqueue)
        finally:
            try:
                if queued:
                    self.event_waits += 1
                    if not queued[0].query():  # done already: no task, no wait
                        waiter = asyncio.ensure_future(devices.wait_event(queued[0]))
                        came = await outlive(waiter)
                        if came is not None:
                            try:
                                raise came
                            finally:
                                del came  # (a local would keep its traceback in a cycle)
                        waiter.result()  # a device error is the caller's
            finally:
                self._done()

    async def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every pair, as one move."""
        if not pairs:
            return
        if len(pairs) == 1:
            # The small-op floor (one chunk of a tiny spec): a host copy below the inline size
            # is done here, without building a plan for it.
            d, s = pairs[0]
            if accelerator_of(pairs[0]) is None \
                    and d.numel() * d.element_size() < self.inline_bytes:
                self._check_open()
                self.moves += 1
                d.copy_(s)
                return
        device: torch.device | None = None
        total = 0
        for i in range(0, len(pairs), _SCAN_RUN):  # a long read's pairs, a run per turn
            if i:
                await anyio.lowlevel.checkpoint()
            run = pairs[i : i + _SCAN_RUN]
            if device is None:
                device = accelerator_of([t for p in run for t in p])
            total += sum(d.nbytes for d, _ in run)
        if device is not None:
            def on_stream(stream: Any) -> None:
                queue_copies(pairs, device, stream)

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
        try:
            async with anyio.create_task_group() as tg:
                for i in range(nthreads):
                    tg.start_soon(self.in_thread, lambda g=pairs[i::nthreads]: serial(g)(None))
        except BaseExceptionGroup as group:
            # The cache closed under the copy: one typed error, not a group of them.
            _, rest = group.split(CacheClosedError)
            if rest is None:
                raise CacheClosedError(_CLOSED) from None
            raise
