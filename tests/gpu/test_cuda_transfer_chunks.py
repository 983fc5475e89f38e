"""The request-level transfer on a real CUDA device: the fused Triton kernel writing pinned
host chunks through their device address, the torch-ops fallback, and the copy stream with
its events. Each is checked byte for byte against the same move done on the CPU."""

from __future__ import annotations

import anyio
import pytest
import torch

from musacache import devices, transfer

pytestmark = pytest.mark.gpu

L, NB, BS, H, D = 4, 64, 16, 8, 128


def cpu_reference(pages: list[torch.Tensor], slots: torch.Tensor, sizes: list[int],
                  ) -> list[torch.Tensor]:
    host_pages = [p.cpu() for p in pages]
    chunks = [torch.zeros(L, 2, n, H, D, dtype=torch.bfloat16) for n in sizes]
    transfer.gather_chunks(host_pages, slots, chunks, "vllm")
    return chunks


def request(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    pages = [torch.randn(2, NB, BS, H, D, generator=gen).to(torch.bfloat16).cuda()
             for _ in range(L)]
    sizes = [256, 256, 100]
    slots = torch.randperm(NB * BS, generator=gen)[:sum(sizes)]
    slots[7] = -1
    return pages, slots, sizes


def test_gather_chunks_into_pinned_host_chunks(device_backend: str) -> None:
    pages, slots, sizes = request(0)
    expected = cpu_reference(pages, slots, sizes)
    chunks = [torch.zeros(L, 2, n, H, D, dtype=torch.bfloat16, pin_memory=True)
              for n in sizes]
    stream = devices.copy_stream(torch.device("cuda", 0))
    devices.wait_for(stream, devices.record_event(torch.device("cuda", 0)))
    transfer.gather_chunks(pages, slots, chunks, "vllm", stream=stream)
    done = devices.record_event(torch.device("cuda", 0), stream)
    assert anyio.run(devices.wait_event, done, 30)
    assert all(torch.equal(a, b) for a, b in zip(chunks, expected, strict=True))


def test_scatter_chunks_from_pinned_host_chunks(device_backend: str) -> None:
    pages, slots, sizes = request(1)
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(L, 2, n, H, D, generator=gen).to(torch.bfloat16).pin_memory()
              for n in sizes]
    host_pages = [p.cpu() for p in pages]
    transfer.scatter_chunks(chunks, host_pages, slots, "vllm")
    transfer.scatter_chunks(chunks, pages, slots, "vllm")
    torch.cuda.synchronize()
    assert all(torch.equal(p.cpu(), h) for p, h in zip(pages, host_pages, strict=True))


def test_transfer_gather_on_cuda_matches_index_select() -> None:
    pages, slots, _ = request(3)
    out = torch.empty(L, 2, len(slots), H, D, dtype=torch.bfloat16, device="cuda")
    transfer.gather(pages, slots, out, "vllm")
    index = slots.clamp(min=0).cuda()
    for layer, page in enumerate(pages):
        picked = page.view(2, NB * BS, H, D).index_select(1, index)
        valid = slots >= 0
        assert torch.equal(out[layer][:, valid.cuda()], picked[:, valid.cuda()])
