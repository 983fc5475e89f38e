"""Host buffers a put stages chunks in on their way to a storage tier, reused between puts.

A chunk that goes straight to storage (no memory tier takes it) is copied into a host tensor,
encoded, and dropped. A fresh multi-MiB tensor per chunk costs more in page faults than the
copy that fills it (the first touch of every page), so the buffers are kept and handed out
again. At most ``keep_bytes`` of idle buffers are kept; a put that needs more allocates the
rest as before.
"""

from __future__ import annotations

import torch

__all__ = ["STAGE_KEEP_BYTES", "StagePool"]

# Idle staging kept per cache: a 64 MiB put (8 chunks of 8 MiB) reuses all of its buffers.
STAGE_KEEP_BYTES = 64 * 1024 * 1024


class StagePool:
    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: list[torch.Tensor] = []  # flat buffers, newest last (likeliest in cache)
        self._idle_bytes = 0

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype`` (contents undefined)."""
        numel = 1
        for s in shape:
            numel *= s
        for i in range(len(self._idle) - 1, -1, -1):
            flat = self._idle[i]
            if flat.dtype == dtype and flat.numel() >= numel:
                self._idle.pop(i)
                self._idle_bytes -= flat.numel() * flat.element_size()
                break
        else:
            flat = torch.empty(numel, dtype=dtype, device="cpu")
        return flat[:numel].view(shape)

    def give(self, tensors: list[torch.Tensor]) -> None:
        """Take back tensors from :meth:`take` that nothing reads or writes any more (one
        not given back, after a failure, is simply freed)."""
        for t in tensors:
            # The whole buffer the tensor is part of, kept and counted whole: the part last
            # used (a chunk's short tail) held all of it while counting only itself, and no
            # longer served a whole chunk, which then allocated again (402 MiB kept against a 64
            # MiB cap after 400 puts).
            storage = t.untyped_storage()
            size = storage.nbytes()
            if self._idle_bytes + size <= self.keep_bytes:
                flat = torch.empty(0, dtype=t.dtype, device="cpu").set_(storage)
                self._idle.append(flat)
                self._idle_bytes += size
