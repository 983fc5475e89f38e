"""Key-addressed pages in the core (Cache.put_pages / get_pages / exists_pages): what the SGLang
HiCache backend stands on. Byte-exact through every tier, namespaced by the fingerprint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import host_config, small_spec

CS = 16  # tokens per chunk = per page


def page(spec: mc.KVSpec, seed: int, shape: tuple[int, ...] | None = None,
         strided: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    numel = spec.nbytes(CS) // 4
    t = torch.randn(numel, generator=g, dtype=torch.float32)
    if shape is not None:
        t = t.view(shape)
    if strided:  # the same values, in a tensor whose memory is laid out transposed
        t = t.t().contiguous().t() if t.dim() == 2 else t
    return t


async def test_pages_round_trip_byte_exact_in_any_shape() -> None:
    spec = small_spec()  # 2 layers, 2 heads, dim 8: a page is 2*2*16*2*8 = 1024 floats
    async with mc.Cache(host_config(spec, chunk_size=CS)) as cache:
        pages = [page(spec, 1), page(spec, 2, (32, 32), strided=True),
                 page(spec, 3, (2, 2, CS, 2, 8))]
        assert not pages[1].is_contiguous()
        assert await cache.put_pages(["a1", "a2", "a3"], pages) == 3
        assert await cache.exists_pages(["a1", "a2", "a3", "zz"]) == 3
        assert await cache.exists_pages(["zz", "a1"]) == 0
        outs = [torch.zeros(1024), torch.zeros(32, 32).t(), torch.zeros(2, 2, CS, 2, 8)]
        assert await cache.get_pages(["a1", "a2", "a3"], outs) == [True, True, True]
        for o, p in zip(outs, pages):
            assert torch.equal(o.reshape(-1), p.reshape(-1))
        miss = [torch.full((1024,), 7.0), torch.full((1024,), 7.0)]
        assert await cache.get_pages(["nope", "a2"], miss) == [False, True]
        assert torch.equal(miss[0], torch.full((1024,), 7.0))  # a miss writes nothing
        # Pages live beside token chunks and never match a token prompt.
        assert await cache.lookup(torch.zeros(3 * CS, dtype=torch.int32)) == 0


async def test_bad_pages_raise_before_anything_is_stored() -> None:
    spec = small_spec()
    async with mc.Cache(host_config(spec, chunk_size=CS)) as cache:
        good = page(spec, 1)
        with pytest.raises(mc.DTypeError, match="float64"):
            await cache.put_pages(["k1", "k2"], [good, good.double()])
        with pytest.raises(mc.ShapeError, match="1023 elements"):
            await cache.put_pages(["k1", "k2"], [good, good[:-1]])
        with pytest.raises(mc.InvalidInputError, match="2 keys but 1 pages"):
            await cache.put_pages(["k1", "k2"], [good])
        with pytest.raises(mc.InvalidInputError, match="keys"):
            await cache.put_pages("k1", [good])
        assert await cache.exists_pages(["k1"]) == 0
        with pytest.raises(mc.ShapeError):
            await cache.get_pages(["k1"], [torch.zeros(3)])


async def test_pages_demote_to_disk_and_come_back_exact(tmp_path) -> None:
    spec = small_spec()
    host = mc.HostTier(capacity_bytes=spec.nbytes(CS) * 2)  # two pages fit in memory
    disk = mc.DiskTier(path=str(tmp_path / "d"), capacity_bytes=spec.nbytes(CS) * 64)
    cfg = host_config(spec, chunk_size=CS, tiers=(host, disk))
    keys = [f"p{i}" for i in range(6)]
    pages = [page(spec, 10 + i) for i in range(6)]
    async with mc.Cache(cfg) as cache:
        assert await cache.put_pages(keys, pages) == 6
        await cache.flush()
        # Only two fit in memory: the others were demoted, encoded by the codec, to disk.
        assert (await cache.stats())["tiers"]["disk"]["chunks"] >= 4
        assert await cache.exists_pages(keys) == 6
        outs = [torch.zeros(1024) for _ in keys]
        assert await cache.get_pages(keys, outs) == [True] * 6
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
        assert (await cache.stats())["tiers"]["disk"]["hits"] >= 1


async def test_namespaces_keep_pages_apart(tmp_path) -> None:
    """Two ranks (namespaces) over one disk folder: each finds only its own pages, and a
    rank that comes back finds its pages again."""
    spec = small_spec()

    def cfg(ns: str) -> mc.CacheConfig:
        return host_config(spec, chunk_size=CS, namespace=ns, persist_on_close=True, tiers=(
            mc.HostTier(capacity_bytes=spec.nbytes(CS) * 8),
            mc.DiskTier(path=str(tmp_path / ns), capacity_bytes=spec.nbytes(CS) * 64)))

    p0, p1 = page(spec, 100), page(spec, 101)
    async with mc.Cache(cfg("m/tp0of2")) as r0, mc.Cache(cfg("m/tp1of2")) as r1:
        await r0.put_pages(["same-key"], [p0])
        await r1.put_pages(["same-key"], [p1])
        o0, o1 = torch.zeros(1024), torch.zeros(1024)
        assert await r0.get_pages(["same-key"], [o0]) == [True]
        assert await r1.get_pages(["same-key"], [o1]) == [True]
        assert torch.equal(o0, p0) and torch.equal(o1, p1)
    async with mc.Cache(cfg("m/tp0of2")) as again:
        out = torch.zeros(1024)
        assert await again.get_pages(["same-key"], [out]) == [True]
        assert torch.equal(out, p0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), present=st.data())
async def test_exists_counts_the_leading_run(n: int, present: st.DataObject) -> None:
    spec = small_spec()
    stored = present.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    async with mc.Cache(host_config(spec, chunk_size=CS)) as cache:
        keys = [f"k{i}" for i in range(n)]
        for k, s in zip(keys, stored):
            if s:
                await cache.put_pages([k], [page(spec, 5)])
        lead = stored.index(False) if False in stored else n
        assert await cache.exists_pages(keys) == lead


async def test_pages_through_the_node_server(tmp_path) -> None:
    """The same API over ``musacache serve``: two namespaces (ranks) on one server stay
    apart, pages come back byte-exact into strided outs."""
    from musacache.server import spawn

    spec = small_spec()
    cfg = tmp_path / "tiers.toml"
    cfg.write_text(f'chunk_size = {CS}\n[[tiers]]\nkind = "host"\ncapacity = "8MiB"\n')
    sock = str(tmp_path / "run" / "s.sock")
    with spawn(cfg, sock):
        async with mc.connect(sock, spec=spec, namespace="m/tp0of2", chunk_size=CS) as r0, \
                mc.connect(sock, spec=spec, namespace="m/tp1of2", chunk_size=CS) as r1:
            p0 = [page(spec, 1), page(spec, 2, (32, 32), strided=True)]
            assert await r0.put_pages(["k1", "k2"], p0) == 2
            assert await r0.exists_pages(["k1", "k2", "k3"]) == 2
            assert await r1.exists_pages(["k1"]) == 0
            assert await r1.put_pages(["k1"], [page(spec, 9)], after="k0") == 1
            outs = [torch.zeros(1024), torch.zeros(32, 32).t()]
            assert await r0.get_pages(["k1", "k2"], outs) == [True, True]
            assert torch.equal(outs[0], p0[0]) and torch.equal(outs[1], p0[1])
            other = [torch.zeros(1024), torch.zeros(1024)]
            assert await r1.get_pages(["k1", "k2"], other) == [True, False]
            assert torch.equal(other[0], page(spec, 9))
            with pytest.raises(mc.ShapeError):
                await r0.put_pages(["k9"], [torch.zeros(5)])
