"""The cache, the paged transfer and the node server on a real CUDA device.

Deselected by default; on a GPU machine: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import musacache as mc
from musacache import devices, ipc, transfer

pytestmark = pytest.mark.gpu

CH = 16


def spec_() -> mc.KVSpec:
    return mc.KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def kv_for(spec: mc.KVSpec, n: int, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(n)
    return torch.randn(spec.shape(n), generator=g).to(spec.dtype).to(device)


def test_device_tier_is_cuda_and_capabilities_probe():
    assert devices.resolve("auto").type == "cuda"
    caps = devices.capabilities("cuda")
    assert caps.available and caps.pinned_memory and caps.memory_ipc


async def test_put_get_on_a_cuda_device_tier_with_host_below():
    spec = spec_()
    tiers = (mc.DeviceTier(capacity_bytes=spec.nbytes(CH) * 4, device="cuda"),
             mc.HostTier(capacity_bytes=spec.nbytes(CH) * 64))
    async with mc.Cache(mc.CacheConfig(spec, "gpu", tiers=tiers, chunk_size=CH)) as c:
        assert c.device.type == "cuda"
        assert (await c.stats())["tiers"]["host"]["pinned"] is True
        toks = list(range(150))
        kv = kv_for(spec, 150, "cuda")
        assert await c.put(toks, kv) == 150
        hit = await c.get(toks)
        assert hit.kv.device.type == "cuda" and torch.equal(hit.kv, kv)
        # From a CPU tensor too, and into a strided cuda out.
        other = list(range(1000, 1040))
        kv2 = kv_for(spec, 40, "cpu")
        assert await c.put(other, kv2) == 40
        backing = torch.zeros(4, 2, 2, 40, 64, dtype=spec.dtype, device="cuda")
        out = backing.permute(0, 1, 3, 2, 4)
        hit = await c.get(other, out=out)
        assert hit.num_tokens == 40 and torch.equal(out.cpu(), kv2)
        st = (await c.stats())["tiers"]
        assert st["device"]["evictions"] > 0 and st["host"]["demotions"] > 0


@pytest.mark.parametrize("layout", ["vllm", "vllm-mla", "sglang", "sglang-mla"])
def test_paged_transfer_on_cuda_matches_cpu(layout):
    rng = random.Random(0)
    mla = layout.endswith("mla")
    L, H, D, NB, BS = 3, 1 if mla else 2, 32, 16, 8
    slots = rng.sample(range(NB * BS), 50)
    slots[7] = -1

    def caches(device):
        if layout == "vllm":
            return [torch.randn(2, NB, BS, H, D, device=device) for _ in range(L)]
        if layout == "vllm-mla":
            return [torch.randn(NB, BS, D, device=device) for _ in range(L)]
        if layout == "sglang":
            return ([torch.randn(NB * BS, H, D, device=device) for _ in range(L)],
                    [torch.randn(NB * BS, H, D, device=device) for _ in range(L)])
        return [torch.randn(NB * BS, 1, D, device=device) for _ in range(L)]

    cpu = caches("cpu")
    gpu = [t.cuda() for t in cpu] if not isinstance(cpu, tuple) else \
        ([t.cuda() for t in cpu[0]], [t.cuda() for t in cpu[1]])
    shape = (L, 50, D) if mla else (L, 2, 50, H, D)
    out_cpu, out_gpu = torch.zeros(shape), torch.zeros(shape, device="cuda")
    transfer.gather(cpu, torch.tensor(slots), out_cpu, layout)
    transfer.gather(gpu, torch.tensor(slots, device="cuda"), out_gpu, layout)
    assert transfer.backend_for(out_gpu) in ("torch", "musa_aiter")
    assert torch.equal(out_cpu, out_gpu.cpu())
    src = torch.randn(shape)
    transfer.scatter(src, cpu, torch.tensor(slots), layout)
    transfer.scatter(src.cuda(), gpu, torch.tensor(slots, device="cuda"), layout)
    flat_c = cpu if not isinstance(cpu, tuple) else cpu[0] + cpu[1]
    flat_g = gpu if not isinstance(gpu, tuple) else gpu[0] + gpu[1]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(flat_c, flat_g))


async def test_store_retrieve_cuda_pages_with_a_device_ready_event():
    spec = spec_()
    NB, BS = 64, 16
    pages = [torch.zeros(2, NB, BS, 2, 64, dtype=spec.dtype, device="cuda") for _ in range(4)]
    toks = list(range(100))
    dense = kv_for(spec, 100, "cuda")
    slots = torch.randperm(NB * BS, device="cuda")[:100]
    transfer.scatter(dense, pages, slots, "vllm")
    ready = devices.DeviceEvent("cuda")
    ready.record()
    tiers = (mc.HostTier(capacity_bytes=spec.nbytes(CH) * 32),)
    async with mc.Cache(mc.CacheConfig(spec, "gpu-paged", tiers=tiers, chunk_size=CH)) as c:
        assert await c.store(toks, pages, slots, layout="vllm", ready=ready) == 100
        other = [torch.zeros_like(p) for p in pages]
        slots2 = torch.randperm(NB * BS, device="cuda")[:100]
        assert await c.retrieve(toks, other, slots2, layout="vllm") == 100
        back = torch.empty_like(dense)
        transfer.gather(other, slots2, back, "vllm")
        assert torch.equal(back, dense)


def test_node_server_registers_cuda_pages(tmp_path):
    """A client registers cuda pages with a node server in another process (a CUDA IPC handle
    cannot be opened by the process that made it); the server maps them by memory IPC, fills
    them on retrieve, reads them on store after the client's event, and the bytes match."""
    from musacache.server.spawn import spawn

    spec = spec_()
    (tmp_path / "r").mkdir()
    conf = tmp_path / "server.toml"
    conf.write_text(
        f'namespace = "gpu-srv"\nchunk_size = {CH}\n[spec]\nnum_layers = {spec.num_layers}\n'
        f"num_kv_heads = {spec.num_kv_heads}\nhead_dim = {spec.head_dim}\n"
        f'dtype = "bfloat16"\n[[tiers]]\nkind = "host"\ncapacity = {spec.nbytes(CH) * 32}\n')
    sock = str(tmp_path / "r" / "s.sock")
    server = spawn(conf, sock)

    async def run():
        async with mc.connect(sock, spec=spec, namespace="gpu-srv", chunk_size=CH) as cl:
            pages = [torch.zeros(2, 16, 16, 2, 64, dtype=spec.dtype, device="cuda")
                     for _ in range(4)]
            await cl.register_kv_caches(pages, "vllm")
            toks = list(range(64))
            kv = kv_for(spec, 64, "cpu")
            await cl.put(toks, kv)
            slots = torch.randperm(256)[:64]
            assert await cl.retrieve(toks, slots.tolist()) == 64
            back = torch.empty_like(kv, device="cuda")
            transfer.gather(pages, slots.cuda(), back, "vllm")
            assert torch.equal(back.cpu(), kv)  # the server wrote the right slots
            for p in pages:  # new content, written on the stream the event is recorded on
                p.copy_(torch.randn(p.shape, device="cuda").to(spec.dtype))
            ev = ipc.IpcEvent.create("cuda")
            await ev.record()
            toks2 = list(range(500, 564))
            assert await cl.store(toks2, slots.tolist(), ready=ev) == 64
            transfer.gather(pages, slots.cuda(), back, "vllm")
            hit = await cl.get(toks2)
            assert hit.num_tokens == 64 and torch.equal(hit.kv.cpu(), back.cpu())

    try:
        asyncio.run(run())
    finally:
        server.stop(30)


async def test_host_only_cache_returns_device_tensors_when_asked():
    """CacheConfig(device="cuda"): a cache with only a pinned host tier hands back cuda KV."""
    spec = spec_()
    tiers = (mc.HostTier(capacity_bytes=spec.nbytes(CH) * 64),)
    config = mc.CacheConfig(spec, "gpu-host", tiers=tiers, chunk_size=CH, device="cuda")
    async with mc.Cache(config) as c:
        assert c.device.type == "cuda"
        toks = list(range(100))
        kv = kv_for(spec, 100, "cuda")
        assert await c.put(toks, kv) == 100
        hit = await c.get(toks)
        assert hit.kv.device.type == "cuda" and torch.equal(hit.kv, kv)
        assert c._engine.mover.event_waits >= 2  # the put and the get each awaited one event
