"""An ``out`` (or ``kv``) whose memory is not what its shape says: a storage resized or freed
under the tensor (FSDP frees parameters this way) or a lazily negated view. The cache moves
memory by address, so either would be written past an allocation or read without the
negation. Each must raise a typed error and leave memory untouched, on the direct path and
the general one (found by a probe: a direct-path get into a shrunk ``out`` crashed the
process, and one into a negated view left ``out == -kv``)."""

from __future__ import annotations

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import transfer

CH = 4


def _cfg(spec: mc.KVSpec, inline: int) -> mc.CacheConfig:
    return mc.CacheConfig(spec, "om", chunk_size=CH, inline_copy_bytes=inline,
                          tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * 16),))


PATHS = pytest.mark.parametrize("inline", [1, 256 * 1024], ids=["general", "direct"])


@PATHS
@pytest.mark.parametrize("keep", [0, 8])
@pytest.mark.parametrize("permuted", [False, True])
async def test_a_get_into_a_shrunk_storage_raises(inline, keep, permuted):
    spec = small_spec()
    toks = list(range(2 * CH))
    want = prefix_kv(spec, toks)
    async with mc.Cache(_cfg(spec, inline)) as c:
        await c.put(toks, want)
        if permuted:  # the same shape, other strides: the direct path's strided branch
            base = torch.zeros(want.permute(1, 0, 2, 3, 4).shape)
            out = base.permute(1, 0, 2, 3, 4)
        else:
            out = torch.zeros(want.shape)
        out.untyped_storage().resize_(keep)
        with pytest.raises(mc.InvalidInputError, match="storage"):
            await c.get(toks, out=out)
        assert out.untyped_storage().nbytes() == keep
        hit = await c.get(toks)  # the cache is unharmed
        assert torch.equal(hit.kv, want)


async def test_a_put_from_a_shrunk_storage_raises():
    spec = small_spec()
    toks = list(range(2 * CH))
    kv = prefix_kv(spec, toks)
    kv.untyped_storage().resize_(16)
    async with mc.Cache(_cfg(spec, 1)) as c:
        with pytest.raises(mc.InvalidInputError, match="storage"):
            await c.put(toks, kv)
        assert await c.lookup(toks) == 0


@PATHS
async def test_a_get_into_a_negated_view_raises(inline):
    spec = small_spec()
    toks = list(range(2 * CH))
    want = prefix_kv(spec, toks)
    async with mc.Cache(_cfg(spec, inline)) as c:
        await c.put(toks, want)
        base = torch.zeros(want.shape)
        out = torch._neg_view(base)
        assert out.is_neg()
        with pytest.raises(mc.InvalidInputError, match="negated"):
            await c.get(toks, out=out)
        assert not base.any()


def test_native_transfer_refuses_a_negated_or_shrunk_dense_tensor():
    spec = mc.KVSpec(2, 2, 8, torch.float32)
    caches = [torch.randn(2, 4, 4, 2, 8) for _ in range(2)]
    slots = torch.arange(8, dtype=torch.int64)
    base = torch.zeros(spec.shape(8))
    with pytest.raises(mc.InvalidInputError, match="negated"):
        transfer.gather(caches, slots, torch._neg_view(base), "vllm")
    assert not base.any()
    short = torch.zeros(spec.shape(8))
    short.untyped_storage().resize_(64)
    with pytest.raises(mc.InvalidInputError, match="storage"):
        transfer.gather(caches, slots, short, "vllm")
    with pytest.raises(mc.InvalidInputError, match="storage"):
        transfer.scatter(short, caches, slots, "vllm")
