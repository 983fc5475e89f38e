"""Ways to move a 1 GiB prompt's KV in 32 chunks of 32 MiB on a cuda device, each chunk a token
slice of the ``(L, 2, T, H, D)`` tensor (many runs of bytes), against one contiguous copy:
per-chunk ``copy_`` as bf16 and as int64 words, ``cudaMemcpy2DAsync`` (through the runtime torch
ships), and a relay over two streams (the dense-making of one chunk beside the bus transfer of
the one before); and for paged KV, the fused kernel writing pinned host chunks through their
device address against gathering into device chunks and moving them by the copy engine.
Best of 8 each. docs/benchmarks.md, "Measured on an H200".

    python docs/scripts/gpu_copy_paths.py
"""

import ctypes
import glob
import math
import os
import time
from collections.abc import Callable

import torch

from musacache import transfer

DEV = torch.device("cuda")
BF16 = torch.bfloat16
L, H, D, T, C = 32, 8, 128, 8192, 256
N = T // C


def best(fn: Callable[[], None], reps: int = 8) -> float:
    fn()
    torch.cuda.synchronize()
    out = math.inf
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out = min(out, time.perf_counter() - t)
    return out


def report(name: str, fn: Callable[[], None], nbytes: int) -> None:
    t = best(fn)
    print(f"{name:<52} {t * 1e3:8.3f} ms {nbytes / t / 1e9:8.1f} GB/s", flush=True)


def main() -> None:
    kv = torch.randn(L, 2, T, H, D, device=DEV).to(BF16)
    nbytes = kv.numel() * kv.element_size()
    chunk_bytes = nbytes // N
    chunks = [kv.narrow(2, i * C, C) for i in range(N)]
    out = torch.empty_like(kv)
    outs = [out.narrow(2, i * C, C) for i in range(N)]
    dev_slots = [torch.empty(L, 2, C, H, D, dtype=BF16, device=DEV) for _ in range(N)]
    pool = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host_slots = [pool[i * chunk_bytes:(i + 1) * chunk_bytes].view(BF16).view(L, 2, C, H, D)
                  for i in range(N)]
    host = torch.empty(kv.shape, dtype=BF16).pin_memory()
    other = torch.empty_like(kv)

    def per_chunk(pairs: list[tuple[torch.Tensor, torch.Tensor]], words: bool = False,
                  ) -> Callable[[], None]:
        def go() -> None:
            for d, s in pairs:
                if words:
                    d, s = d.view(torch.int64), s.view(torch.int64)
                d.copy_(s, non_blocking=True)
        return go

    report("D2D one contiguous copy_", lambda: other.copy_(kv), nbytes)
    report("D2D per chunk, bf16 copy_", per_chunk(list(zip(dev_slots, chunks))), nbytes)
    report("D2D per chunk, int64 words", per_chunk(list(zip(dev_slots, chunks)), True), nbytes)
    report("D2H one contiguous copy_ (pinned)", lambda: host.copy_(kv, non_blocking=True), nbytes)
    report("H2D one contiguous copy_ (pinned)", lambda: out.copy_(host, non_blocking=True), nbytes)
    report("D2H per chunk, copy_", per_chunk(list(zip(host_slots, chunks))), nbytes)
    report("H2D per chunk, copy_", per_chunk(list(zip(outs, host_slots))), nbytes)

    side, bus = torch.cuda.Stream(), torch.cuda.Stream()
    ring = [torch.empty(L, 2, C, H, D, dtype=BF16, device=DEV) for _ in range(3)]

    def relayed_d2h() -> None:
        side.wait_stream(torch.cuda.current_stream())
        free: list[torch.cuda.Event | None] = [None] * 3
        for i, (d, s) in enumerate(zip(host_slots, chunks)):
            b = ring[i % 3]
            with torch.cuda.stream(side):
                if free[i % 3] is not None:
                    side.wait_event(free[i % 3])
                b.copy_(s)
                filled = torch.cuda.Event()
                filled.record(side)
            with torch.cuda.stream(bus):
                bus.wait_event(filled)
                d.copy_(b, non_blocking=True)
                free[i % 3] = torch.cuda.Event()
                free[i % 3].record(bus)
        torch.cuda.current_stream().wait_stream(bus)

    report("D2H per chunk, relayed over two streams, 3 buffers", relayed_d2h, nbytes)

    lib = None
    here = os.path.dirname(torch.__file__)
    for name in [*glob.glob(os.path.join(here, "..", "nvidia", "**", "libcudart.so*"),
                            recursive=True), "libcudart.so"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is not None:
        copy2d = lib.cudaMemcpy2DAsync
        copy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        width, pitch = C * H * D * 2, T * H * D * 2

        def rows_out(dsts: list[torch.Tensor]) -> Callable[[], None]:
            def go() -> None:
                stream = torch.cuda.current_stream().cuda_stream
                for d, s in zip(dsts, chunks):
                    assert copy2d(d.data_ptr(), width, s.data_ptr(), pitch, width, L * 2, 4,
                                  stream) == 0
            return go

        report("D2D per chunk, cudaMemcpy2DAsync", rows_out(dev_slots), nbytes)
        report("D2H per chunk, cudaMemcpy2DAsync", rows_out(host_slots), nbytes)

    bs = 16
    blocks = 2 * (T // bs)
    pages = [torch.randn(2, blocks, bs, H, D, device=DEV).to(BF16) for _ in range(L)]
    picked = torch.randperm(blocks)[: T // bs]
    slots = (picked[:, None] * bs + torch.arange(bs)).reshape(-1).contiguous()

    def through_device(window: int) -> Callable[[], None]:
        def go() -> None:
            side.wait_stream(torch.cuda.current_stream())
            for a in range(0, N, window):
                with torch.cuda.stream(side):
                    transfer.gather_chunks(pages, slots[a * C:(a + window) * C],
                                           dev_slots[a:a + window], "vllm", stream=side)
                    filled = torch.cuda.Event()
                    filled.record(side)
                with torch.cuda.stream(bus):
                    bus.wait_event(filled)
                    for i in range(a, min(a + window, N)):
                        host_slots[i].copy_(dev_slots[i], non_blocking=True)
            torch.cuda.current_stream().wait_stream(bus)
        return go

    piped = transfer._piped_host_chunks
    transfer._piped_host_chunks = lambda *a: False  # type: ignore[assignment]  # the old path
    report("store: kernel into pinned chunks (UVA)",
           lambda: transfer.gather_chunks(pages, slots, host_slots, "vllm"), nbytes)
    transfer._piped_host_chunks = piped  # type: ignore[assignment]
    report("store: transfer.gather_chunks now (windows through the copy engine)",
           lambda: transfer.gather_chunks(pages, slots, host_slots, "vllm"), nbytes)
    report("store: kernel into device chunks, then D2H, windows of 8", through_device(8),
           nbytes)


if __name__ == "__main__":
    main()
