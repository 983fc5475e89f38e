"""Prefix semantics, the get/put/lookup contract, and bad input on the embedded cache."""

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import host_config, prefix_kv, small_spec


async def test_put_get_roundtrip_every_prefix_length(spec):
    toks = torch.randint(0, 50000, (70,))
    kv = prefix_kv(spec, toks)
    async with mc.Cache(host_config(spec)) as c:
        assert await c.put(toks, kv) == 70
        for n in range(0, 71, 7):
            hit = await c.get(toks[:n])
            assert hit.num_tokens == n
            assert hit.kv.shape == spec.shape(n)
            assert torch.equal(hit.kv, kv[:, :, :n])


async def test_partial_tail_is_stored_and_matched_by_a_longer_prompt(spec):
    toks = torch.randint(0, 50000, (1500,))
    kv = prefix_kv(spec, toks)
    async with mc.Cache(host_config(spec, chunks=256, chunk_size=256)) as c:
        assert await c.put(toks[:1000], kv[:, :, :1000]) == 1000
        assert await c.lookup(toks[:1500]) == 1000
        hit = await c.get(toks)
        assert hit.num_tokens == 1000 and torch.equal(hit.kv, kv[:, :, :1000])
        # The next turn stores the rest; the old tail stays valid for its own prefix.
        assert await c.put(toks, kv) == 1500
        assert await c.lookup(toks) == 1500
        assert torch.equal((await c.get(toks)).kv, kv)


async def test_prefix_of_a_stored_chunk_is_served(spec):
    """A prompt that diverges inside a chunk still gets the tokens before the divergence."""
    toks = torch.randint(0, 50000, (64,))
    kv = prefix_kv(spec, toks)
    other = toks.clone()
    other[40] = (other[40] + 1) % 50000
    async with mc.Cache(host_config(spec)) as c:
        await c.put(toks, kv)
        assert await c.lookup(other) == 40
        hit = await c.get(other)
        assert hit.num_tokens == 40 and torch.equal(hit.kv, kv[:, :, :40])
        assert await c.lookup(toks[:37]) == 37  # a shorter prompt ending mid-chunk


async def test_miss_is_a_value(spec):
    async with mc.Cache(host_config(spec)) as c:
        hit = await c.get([1, 2, 3])
        assert hit.num_tokens == 0 and not hit and hit.kv.shape == spec.shape(0)
        assert await c.lookup([1, 2, 3]) == 0
        assert await c.lookup([]) == 0


async def test_get_into_out_any_strides(spec):
    toks = list(range(100, 150))
    kv = prefix_kv(spec, toks)
    async with mc.Cache(host_config(spec)) as c:
        await c.put(toks, kv)
        # HF-style storage (L, 2, H, T, D) permuted to (L, 2, T, H, D): a non-contiguous out.
        backing = torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 60, spec.head_dim)
        out = backing.permute(0, 1, 3, 2, 4)[:, :, :55]
        hit = await c.get(toks + [1, 2, 3, 4, 5], out=out)
        assert hit.num_tokens == 50
        assert hit.kv.data_ptr() == out.data_ptr()
        assert torch.equal(out[:, :, :50], kv)
        assert torch.count_nonzero(out[:, :, 50:]) == 0


async def test_put_accepts_strided_views_and_longer_kv(spec):
    toks = list(range(30))
    kv = prefix_kv(spec, list(range(40)))
    hf = kv.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)  # strided view
    assert not hf.is_contiguous()
    async with mc.Cache(host_config(spec)) as c:
        assert await c.put(toks, hf) == 30
        assert torch.equal((await c.get(toks)).kv, kv[:, :, :30])


async def test_mla_spec_roundtrip():
    spec = small_spec(mla=True)
    toks = list(range(45))
    kv = prefix_kv(spec, toks)
    assert kv.shape == (2, 45, 8)
    async with mc.Cache(host_config(spec)) as c:
        assert await c.put(toks, kv) == 45
        hit = await c.get(toks[:33])
        assert hit.num_tokens == 33 and torch.equal(hit.kv, kv[:, :33])


async def test_delete_and_clear(spec):
    a = list(range(40))
    b = list(range(40)) + list(range(500, 520))
    async with mc.Cache(host_config(spec)) as c:
        await c.put(b, prefix_kv(spec, b))
        removed = await c.delete(a[:16])  # chunk 0 and everything that extends it
        assert removed >= 1
        assert await c.lookup(b) == 0
        await c.put(b, prefix_kv(spec, b))
        await c.clear()
        assert await c.lookup(b) == 0
        st = await c.stats()
        assert st["tiers"]["host"]["bytes_used"] == 0 and st["chunks"] == 0


async def test_stats_fields(spec):
    toks = list(range(40))
    async with mc.Cache(host_config(spec)) as c:
        await c.put(toks, prefix_kv(spec, toks))
        await c.get(toks)
        await c.get([9, 9, 9])
        st = await c.stats()
    host = st["tiers"]["host"]
    for k in ("hits", "misses", "bytes_in", "bytes_out", "evictions", "bytes_used",
              "capacity_bytes"):
        assert k in host
    assert host["hits"] == 3 and host["bytes_in"] == spec.nbytes(40)
    assert host["bytes_out"] == spec.nbytes(40)
    assert st["tokens"]["hit_tokens"] == 40 and st["tokens"]["miss_tokens"] == 3
    assert set(st["in_flight"]) >= {"puts", "gets", "prefetches", "promotions", "writes"}


# -- bad input: typed error, nothing changes ------------------------------------------------


async def snapshot(c: mc.Cache):
    st = await c.stats()
    return (st["chunks"], st["tiers"]["host"]["bytes_used"], st["tiers"]["host"]["bytes_in"])


@pytest.mark.parametrize("make_kv,err,match", [
    (lambda s: torch.zeros(2, 2, 20, 2, 9), mc.ShapeError, "shape"),
    (lambda s: torch.zeros(2, 20, 2, 8), mc.ShapeError, "shape"),
    (lambda s: torch.zeros(s.shape(20), dtype=torch.float16), mc.DTypeError, "float16"),
    (lambda s: torch.zeros(s.shape(20), device="meta"), mc.DeviceError, "meta"),
    (lambda s: torch.zeros(s.shape(10)), mc.ShapeError, "10 tokens"),
    (lambda s: "not a tensor", mc.ShapeError, "torch.Tensor"),
])
async def test_bad_kv_raises_and_changes_nothing(spec, make_kv, err, match):
    toks = list(range(20))
    async with mc.Cache(host_config(spec)) as c:
        await c.put(list(range(100, 120)), prefix_kv(spec, list(range(100, 120))))
        before = await snapshot(c)
        with pytest.raises(err, match=match):
            await c.put(toks, make_kv(spec))
        assert await snapshot(c) == before
        assert await c.lookup(toks) == 0


@pytest.mark.parametrize("tokens", [[[1, 2], [3, 4]], [1.0, 2.0], torch.ones(2, 3), "hello",
                                    np.ones(4, dtype=np.float32), None])
async def test_bad_tokens_raise_and_change_nothing(spec, tokens):
    async with mc.Cache(host_config(spec)) as c:
        before = await snapshot(c)
        with pytest.raises(mc.TokensError):
            await c.put(tokens, prefix_kv(spec, [1, 2, 3, 4]))
        with pytest.raises(mc.TokensError):
            await c.get(tokens)
        with pytest.raises(mc.TokensError):
            await c.lookup(tokens)
        assert await snapshot(c) == before


async def test_bad_out_raises_and_writes_nothing(spec):
    toks = list(range(20))
    async with mc.Cache(host_config(spec)) as c:
        await c.put(toks, prefix_kv(spec, toks))
        out = torch.full(spec.shape(19), -1.0)
        with pytest.raises(mc.ShapeError):
            await c.get(toks, out=out)
        assert torch.all(out == -1)
        out16 = torch.full(spec.shape(20), -1.0, dtype=torch.float16)
        with pytest.raises(mc.DTypeError):
            await c.get(toks, out=out16)
        assert torch.all(out16 == -1)


async def test_use_after_close_raises(spec):
    c = mc.Cache(host_config(spec))
    with pytest.raises(mc.CacheClosedError, match="not open"):
        await c.lookup([1])
    async with c:
        await c.put([1, 2], prefix_kv(spec, [1, 2]))
    for call in (c.lookup([1]), c.get([1]), c.put([1], prefix_kv(spec, [1])),
                 c.prefetch([1]), c.delete([1]), c.flush(), c.clear()):
        with pytest.raises(mc.CacheClosedError, match="closed"):
            await call
    await c.aclose()  # idempotent


def test_cache_needs_a_config():
    with pytest.raises(mc.ConfigError):
        mc.Cache({"spec": 1})  # type: ignore[arg-type]
