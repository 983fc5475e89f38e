"""MemoryPool.views: the slots a put places into, viewed a run at a time, are exactly the
views one slot at a time would give (same memory, shape and strides), whatever the order of
the indices: rising and falling runs, runs broken by a segment's end, repeats, gaps."""

import anyio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from musacache.tiers.memory import MemoryPool


def pool_of(slot_elems: int, itemsize: int, per_segment: int, segments: int,
            pad_bytes: int = 0) -> MemoryPool:
    slot_bytes = slot_elems * itemsize + pad_bytes
    pool = MemoryPool(capacity_bytes=slot_bytes * per_segment * segments,
                      slot_bytes=slot_bytes, device=torch.device("cpu"), pinned=False,
                      segment_bytes=slot_bytes * per_segment)

    async def grow() -> None:
        await pool.prealloc(slot_bytes * per_segment * segments)

    anyio.run(grow)
    return pool


def same_views(pool: MemoryPool, indices: list[int], dtype: torch.dtype,
               shape: tuple[int, ...]) -> None:
    got = pool.views(indices, dtype, shape)
    want = [pool.view(i, dtype, shape) for i in indices]
    assert len(got) == len(want)
    for i, g, w in zip(indices, got, want, strict=True):
        assert (g.data_ptr(), g.shape, g.stride(), g.dtype) == \
            (w.data_ptr(), w.shape, w.stride(), w.dtype), f"slot {i}"


@settings(max_examples=300, deadline=None)
@given(data=st.data(), per_segment=st.integers(1, 6), segments=st.integers(1, 3),
       dtype=st.sampled_from([torch.uint8, torch.float16, torch.bfloat16, torch.float32]),
       tokens=st.integers(1, 4), pad_items=st.integers(0, 3))
def test_views_are_the_views_of_each_slot(data, per_segment, segments, dtype, tokens,
                                         pad_items):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (2, tokens, 3)  # a chunk's KV: layers, tokens, rows
    n = 2 * tokens * 3
    pool = pool_of(n, itemsize, per_segment, segments, pad_items * itemsize)
    total = per_segment * segments
    # Runs (rising or falling) with arbitrary indices mixed in, as a free list hands them out.
    indices: list[int] = []
    for _ in range(data.draw(st.integers(1, 5))):
        start = data.draw(st.integers(0, total - 1))
        length = data.draw(st.integers(1, total))
        step = data.draw(st.sampled_from([1, -1]))
        indices += [i for i in range(start, start + step * length, step) if 0 <= i < total]
    same_views(pool, indices, dtype, shape)


def test_a_chunk_shorter_than_its_slot_and_a_slot_not_a_whole_number_of_items():
    pool = pool_of(12, 2, 4, 2)
    same_views(pool, [0, 1, 2, 3, 4, 5], torch.float16, (2, 1, 3))  # 6 of 12 items a slot
    odd = pool_of(12, 1, 4, 2, pad_bytes=1)  # 13-byte slots: no fp16 run can span them
    same_views(odd, [3, 2, 1, 0], torch.uint8, (2, 2, 3))


def test_writes_through_a_run_land_in_each_slot():
    pool = pool_of(6, 4, 8, 1)
    for i in range(8):
        pool.view(i, torch.float32, (2, 3)).fill_(-1)
    idx = [5, 4, 3, 6, 7]
    for k, v in enumerate(pool.views(idx, torch.float32, (2, 3))):
        v.fill_(k + 1)
    for k, i in enumerate(idx):
        assert torch.equal(pool.view(i, torch.float32, (2, 3)), torch.full((2, 3), k + 1.0))
    for i in (0, 1, 2):
        assert torch.equal(pool.view(i, torch.float32, (2, 3)), torch.full((2, 3), -1.0))
