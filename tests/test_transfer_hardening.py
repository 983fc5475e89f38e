"""The paged transfers refuse, with a typed error and before anything is written, the page
tensors and slot mappings that would make them read or write the wrong memory (each found by a
probe: a segfault, 2 MiB written past a storage, negated values, a race, a partial write)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import musacache as mc
from musacache import _native, transfer

NB, BS, H, D = 2, 2, 1, 4


def two_layers(permuted_second: bool = False) -> list[torch.Tensor]:
    first = torch.arange(2 * NB * BS * H * D, dtype=torch.float32).view(2, NB, BS, H, D)
    if not permuted_second:
        return [first, first.clone() + 100]
    # memory [2, BS, NB, H, D] seen as [2, NB, BS, H, D]: its block dim inside its slot dim
    second = (100 + torch.arange(2 * NB * BS * H * D, dtype=torch.float32)).view(
        2, BS, NB, H, D).transpose(1, 2)
    return [first, second]


def both_ways(caches: list[torch.Tensor], slots: torch.Tensor, error: type[Exception],
              match: str) -> None:
    """gather and scatter both refuse, leaving ``out`` and the pages as they were."""
    out = torch.full((2, 2, len(slots), H, D), -7.0)
    before = out.clone()
    with pytest.raises(error, match=match):
        transfer.gather(caches, slots, out, "vllm")
    assert torch.equal(out, before)
    # (the layers whose memory may be read: not one whose storage shrank)
    intact = [c for c in caches if not c.is_neg() and
              c.untyped_storage().nbytes() >= c.numel() * c.element_size()]
    snap = [c.clone() for c in intact]
    with pytest.raises(error, match=match):
        transfer.scatter(torch.full_like(out, 55.0), caches, slots, "vllm")
    assert all(torch.equal(c, s) for c, s in zip(intact, snap, strict=True))


def test_a_refused_layer_refuses_the_call_before_another_layer_is_copied():
    # Layers of two stride groups are two native calls: the second's check came after the
    # first had copied.
    both_ways(two_layers(permuted_second=True), torch.tensor([0, 3]), mc.InvalidInputError,
              "block_stride")


def test_pages_whose_storage_shrank_are_refused():
    caches = two_layers()
    caches[1].untyped_storage().resize_(64)
    both_ways(caches, torch.tensor([0, 3]), mc.InvalidInputError, "storage holds 64 bytes")
    view = torch.zeros(2, NB * BS * H * D + 10)[:, 10:].view(2, NB, BS, H, D)
    view.untyped_storage().resize_(0)  # a view at an offset: its address is not null
    both_ways([two_layers()[0], view], torch.tensor([0, 3]), mc.InvalidInputError,
              "storage holds 0 bytes")


def test_a_slot_mapping_whose_storage_was_freed_is_refused():
    slots = torch.arange(6)[2:4]
    slots.untyped_storage().resize_(0)
    both_ways(two_layers(), slots, mc.InvalidInputError, "slot_mapping's storage")


def test_negated_views_are_refused():
    first, second = two_layers()
    both_ways([first, torch._neg_view(second)], torch.tensor([0, 3]), mc.InvalidInputError,
              "negated")


def test_layers_sharing_their_pages_are_written_in_layer_order():
    # vLLM shares one KV cache between layers for some models: a scatter into such pages
    # ends with the last layer's values, as per-layer copies would, on every run (its
    # planes' threads raced: either layer's values, or half of each).
    nb, bs, h, d = 64, 16, 4, 64
    shared = torch.zeros(2, nb, bs, h, d)
    slots = torch.arange(nb * bs)
    src = torch.stack([torch.full((2, nb * bs, h, d), 1.0), torch.full((2, nb * bs, h, d), 2.0)])
    was = _native.get_thread_min_bytes()
    _native.set_thread_min_bytes(1)  # threads for this small a copy too
    try:
        for _ in range(20):
            shared.zero_()
            transfer.scatter(src, [shared, shared], slots, "vllm", threads=4)
            assert bool((shared == 2.0).all())
    finally:
        _native.set_thread_min_bytes(was)


async def test_store_and_retrieve_check_known_caches_again_at_every_call():
    # The cache keeps the description of the caches it saw last (PagesMemo): a storage that
    # shrank in place under the same tensors is still refused, before any page is touched.
    spec = mc.KVSpec(num_layers=2, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    cfg = mc.CacheConfig(spec, "hard", tiers=(mc.HostTier(spec.nbytes(4) * 16),), chunk_size=4)
    async with mc.Cache(cfg) as cache:
        caches = [torch.randn(2, NB, BS, H, D) for _ in range(2)]
        toks, slots = [1, 2, 3, 4], torch.tensor([0, 1, 2, 3])
        assert await cache.store(toks, caches, slots, layout="vllm") == 4
        out = [torch.zeros(2, NB, BS, H, D) for _ in range(2)]
        assert await cache.retrieve(toks, out, slots, layout="vllm") == 4
        out[1].untyped_storage().resize_(64)
        out[0].zero_()
        with pytest.raises(mc.InvalidInputError, match="storage holds 64 bytes"):
            await cache.retrieve(toks, out, slots, layout="vllm")
        assert int(out[0].abs().sum()) == 0
        permuted = two_layers(permuted_second=True)
        permuted[0].zero_()
        with pytest.raises(mc.InvalidInputError, match="block_stride"):
            await cache.retrieve(toks, permuted, slots, layout="vllm")
        assert int(permuted[0].abs().sum()) == 0
        await asyncio.sleep(0)
