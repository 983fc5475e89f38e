"""Inference code often sets a process-wide default device (``torch.set_default_device``, or
``with torch.device(...)``). The cache's own host buffers must not follow it: a pool segment,
a staging buffer or a decode target made on another device and then written through its
address by native code would crash the process or write where nothing is (found by a probe:
a direct-path get made ``hit.kv`` on the default device and memmoved host bytes into it).
Here the default is ``meta``, whose tensors have no memory at all."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import transfer

CH = 4


@pytest.fixture
def meta_default() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _host(t: torch.Tensor) -> None:
    assert t.device.type == "cpu", t.device


@pytest.mark.parametrize("inline", [1, 256 * 1024], ids=["general", "direct"])
async def test_gets_and_puts_make_their_buffers_on_the_host(meta_default, inline):
    spec = small_spec()
    toks = list(range(3 * CH + 1))
    with torch.device("cpu"):
        want = prefix_kv(spec, toks)
    cfg = mc.CacheConfig(spec, "dd", chunk_size=CH, inline_copy_bytes=inline,
                         tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * 16),))
    async with mc.Cache(cfg) as c:
        assert await c.put(toks, want) == len(toks)
        hit = await c.get(toks)
        _host(hit.kv)
        assert hit.num_tokens == len(toks) and torch.equal(hit.kv, want)
        out = torch.empty(want.shape, dtype=want.dtype, device="cpu")
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == len(toks) and torch.equal(out, want)


@pytest.mark.parametrize("codec", ["raw", "lz4"])
async def test_disk_reads_and_writes_make_their_buffers_on_the_host(meta_default, codec):
    spec = small_spec(dtype=torch.bfloat16)
    toks = list(range(4 * CH))
    with torch.device("cpu"):
        want = prefix_kv(spec, toks)
    with tempfile.TemporaryDirectory() as path:
        cfg = mc.CacheConfig(spec, "dd", chunk_size=CH, tiers=(
            mc.HostTier(capacity_bytes=spec.nbytes(CH) * 2),
            mc.DiskTier(path=path, capacity_bytes="1MiB", codec=codec)))
        async with mc.Cache(cfg) as c:
            await c.put(toks, want)  # half of it goes down to the disk
            await c.flush()
            hit = await c.get(toks)
            _host(hit.kv)
            assert hit.num_tokens == len(toks) and torch.equal(hit.kv, want)
        async with mc.Cache(cfg) as c:  # a restart reads every chunk back from the files
            hit = await c.get(toks)
            _host(hit.kv)
            assert hit.num_tokens == len(toks) and torch.equal(hit.kv, want)


async def test_store_and_retrieve_make_their_buffers_on_the_host(meta_default):
    spec = mc.KVSpec(2, 2, 8, torch.float32)
    block, nblocks, n = 4, 8, 3 * CH
    with torch.device("cpu"):
        caches = [torch.randn(2, nblocks, block, 2, 8) for _ in range(2)]
        slots = torch.arange(n, dtype=torch.int64) + block
        want = torch.empty(spec.shape(n))
    transfer.gather(caches, slots, want, "vllm")
    cfg = mc.CacheConfig(spec, "dd", chunk_size=CH,
                         tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * 8),))
    async with mc.Cache(cfg) as c:
        toks = list(range(n))
        assert await c.store(toks, caches, slots) == n
        hit = await c.get(toks)
        _host(hit.kv)
        assert torch.equal(hit.kv, want)
        for t in caches:
            t.zero_()
        assert await c.retrieve(toks, caches, slots) == n
        got = torch.empty(spec.shape(n), device="cpu")
        transfer.gather(caches, slots, got, "vllm")
        assert torch.equal(got, want)
