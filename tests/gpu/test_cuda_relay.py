"""The two-stream relay on a real CUDA device (``musacache.transfer.relay``): puts and gets of strided
KV through pinned host slots, the device tier's copies as words, and store/retrieve of host
chunks in windows. Every check is bit for bit, NaN payloads included (the data is random
16-bit patterns)."""

from __future__ import annotations

import anyio
import pytest
import torch

import musacache as mc
from musacache import devices, transfer

pytestmark = pytest.mark.gpu

CH = 64
CUDA = torch.device("cuda", 0)


def spec_() -> mc.KVSpec:
    return mc.KVSpec(num_layers=6, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)


def bits(shape: tuple[int, ...], seed: int, device: str = "cuda") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, shape, dtype=torch.int16,
                         generator=gen).to(device).view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("tier", ["host", "device"])
async def test_put_and_get_of_a_strided_prompt_are_bit_exact(tier: str) -> None:
    spec = spec_()
    n = 16 * CH + 17
    t = (mc.HostTier(capacity_bytes=spec.nbytes(n) * 2) if tier == "host"
         else mc.DeviceTier(capacity_bytes=spec.nbytes(n) * 2, device="cuda"))
    config = mc.CacheConfig(spec, f"relay-{tier}", tiers=(t,), chunk_size=CH)
    async with mc.Cache(config) as c:
        whole = bits(spec.shape(n + 40), 1)
        kv = whole.narrow(spec.token_dim, 40, n)  # a strided view: each chunk is many runs
        # The producer's kernel is still queued when put is called: the relay must wait.
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            big = big @ big / 64
        kv.copy_(bits(kv.shape, 2))
        expected = kv.cpu()
        toks = list(range(n))
        assert await c.put(toks, kv) == n
        backing = torch.zeros(spec.shape(n + 8), dtype=spec.dtype, device="cuda")
        out = backing.narrow(spec.token_dim, 8, n)
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == n
        assert same_bits(out, expected)
        assert not backing.narrow(spec.token_dim, 0, 8).view(torch.int16).any()


def test_store_and_retrieve_windows_of_host_chunks(device_backend: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    layers, nb, bs, h, d = 4, 128, 16, 8, 128
    token_bytes = layers * 2 * h * d * 2
    monkeypatch.setattr(transfer, "PIPE_WINDOW_BYTES", 300 * token_bytes)  # several windows
    pages = [bits((2, nb, bs, h, d), 10 + i) for i in range(layers)]
    sizes = [256] * 6 + [77]
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(nb * bs, generator=gen)[: sum(sizes)]
    host_pages = [p.cpu() for p in pages]
    expected = [torch.zeros(layers, 2, s, h, d, dtype=torch.bfloat16) for s in sizes]
    transfer.gather_chunks(host_pages, slots, expected, "vllm")
    chunks = [torch.zeros(layers, 2, s, h, d, dtype=torch.bfloat16, pin_memory=True)
              for s in sizes]
    stream = devices.copy_stream(CUDA)
    devices.wait_for(stream, devices.record_event(CUDA))
    transfer.gather_chunks(pages, slots, chunks, "vllm", stream=stream)
    done = devices.record_event(CUDA, stream)
    assert anyio.run(devices.wait_event, done, 30)
    assert all(same_bits(a, b) for a, b in zip(chunks, expected, strict=True))

    back = [torch.zeros_like(p) for p in pages]
    slots[100] = -1
    transfer.scatter_chunks(chunks, back, slots, "vllm", stream=stream)
    done = devices.record_event(CUDA, stream)
    assert anyio.run(devices.wait_event, done, 30)
    host_back = [torch.zeros_like(p) for p in host_pages]
    transfer.scatter_chunks(expected, host_back, slots, "vllm")
    assert all(same_bits(a, b) for a, b in zip(back, host_back, strict=True))
