"""Property test: get returns exactly the bytes that were put, for every prefix length,
checked against a plain-Python reference model."""

import asyncio

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import prefix_kv, small_spec

SPEC = small_spec()
CHUNK = 4

base_seqs = st.lists(st.integers(0, 3), min_size=0, max_size=23)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "lookup"]), base_seqs),
               min_size=1, max_size=25)


def room(chunks: int) -> int:
    """Bytes for ``chunks`` chunks; 0 chunks is a tier smaller than one chunk (no room: a
    zero-byte tier is a configuration error)."""
    return SPEC.nbytes(CHUNK) * chunks or 1


def run_model(operations, capacity_chunks: int, tiers_factory=None) -> None:
    async def main() -> None:
        tiers = tiers_factory() if tiers_factory else (
            mc.HostTier(capacity_bytes=room(capacity_chunks)),)
        cfg = mc.CacheConfig(SPEC, "prop", tiers=tiers, chunk_size=CHUNK)
        stored: list[list[int]] = []  # the reference: every prompt ever put
        unbounded = capacity_chunks >= 10_000
        async with mc.Cache(cfg) as c:
            for op, seq in operations:
                best = max((lcp(seq, p) for p in stored), default=0)
                if op == "put":
                    n = await c.put(seq, prefix_kv(SPEC, seq))
                    if unbounded:
                        assert n == len(seq)
                    stored.append(seq)
                elif op == "lookup":
                    n = await c.lookup(seq)
                    assert n <= best
                    if unbounded:
                        assert n == best
                else:
                    hit = await c.get(seq)
                    assert hit.num_tokens <= best
                    if unbounded:
                        assert hit.num_tokens == best
                    assert torch.equal(hit.kv, prefix_kv(SPEC, seq[: hit.num_tokens]))
            st_ = await c.stats()
            assert st_["pins"] == 0
            for tier in st_["tiers"].values():
                if tier["capacity_bytes"] is not None:
                    assert tier["bytes_used"] <= tier["capacity_bytes"]

    asyncio.run(main())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_get_matches_reference_unbounded(operations):
    run_model(operations, capacity_chunks=100_000)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(0, 6))
def test_get_never_serves_wrong_bytes_under_eviction(operations, cap):
    run_model(operations, capacity_chunks=cap)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(0, 3), st.integers(0, 4))
def test_two_memory_tiers_never_serve_wrong_bytes(operations, top, bottom):
    def tiers():
        return (mc.DeviceTier(capacity_bytes=room(top), device="cpu"),
                mc.HostTier(capacity_bytes=room(bottom)))
    run_model(operations, capacity_chunks=top + bottom, tiers_factory=tiers)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(0, 3), st.integers(0, 3), st.sampled_from(["lz4", "raw"]))
def test_memory_over_storage_never_serves_wrong_bytes(operations, top, bounded, codec):
    """Host tier over a storage tier (unbounded, or bounded to a few objects): chunks move
    down through the write-behind queue and back up through promotions."""
    from fake_store import MemStore

    def tiers():
        cap = None if bounded == 0 else bounded * (SPEC.nbytes(CHUNK) + 1024)
        return (mc.HostTier(capacity_bytes=room(top)),
                MemStore(codec=codec, capacity_bytes=cap))
    run_model(operations, capacity_chunks=0, tiers_factory=tiers)
