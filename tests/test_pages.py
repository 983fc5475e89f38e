"""transfer.Pages: an engine's pages checked and described once, then passed around (issue 11,
"One description of an engine's pages")."""

import dataclasses
import random

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import DTypeError, LayoutError, ShapeError, transfer
from test_store_retrieve import CH, flat, make_pages, random_slots, read_dense, write_dense

LAYOUTS = ["vllm", "vllm-mla", "sglang", "sglang-mla"]


def config(spec):
    return mc.CacheConfig(spec, "pages", tiers=(mc.HostTier(spec.nbytes(CH) * 64),),
                          chunk_size=CH)


def test_pages_describes_the_caches_once():
    spec = small_spec()
    caches = make_pages(spec, "vllm", 8)
    pages = transfer.Pages.open(caches, "vllm")
    assert pages.layout == "vllm" and pages.spec == spec
    assert pages.num_slots == 8 * 4 and pages.device == torch.device("cpu")
    assert pages.info == transfer.describe(caches, "vllm") == transfer.describe(pages)
    assert transfer.as_pages(pages) is pages and transfer.as_pages(pages, "vllm") is pages
    assert len(pages.tensors) == spec.num_layers and len(pages.spans) == spec.num_layers
    assert "Pages" in transfer.__all__ and "as_pages" in transfer.__all__


def test_pages_is_frozen():
    pages = transfer.Pages(make_pages(small_spec(), "vllm", 4), "vllm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        pages.layout = "sglang"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del pages.info


def test_sglang_pair_round_trips_through_the_flat_tensor_list():
    spec = small_spec()
    k, v = make_pages(spec, "sglang", 4)
    pages = transfer.Pages.open((k, v), "sglang")
    assert pages.tensors == (*k, *v)
    again = transfer.Pages.from_tensors(list(pages.tensors), "sglang")
    assert again.info == pages.info
    k2, v2 = again.kv_caches
    assert all(a is b for a, b in zip(k2 + v2, k + v, strict=True))
    with pytest.raises(LayoutError, match="as many K as V"):
        transfer.Pages.from_tensors(list(pages.tensors)[:-1], "sglang")


@pytest.mark.parametrize(("make", "layout", "error", "match"), [
    (lambda s: make_pages(s, "vllm", 4), "paged-attention", LayoutError, "unknown paged layout"),
    (lambda s: make_pages(s, "vllm", 4)[:1], "sglang", LayoutError, "pair"),
    (lambda s: make_pages(s, "vllm", 4)[0], "vllm", LayoutError, "list of per-layer tensors"),
    (lambda s: [], "vllm", LayoutError, "at least one layer"),
    (lambda s: [*make_pages(s, "vllm", 4)[:-1], torch.zeros(3)], "vllm", ShapeError, "shape"),
    (lambda s: [*make_pages(s, "vllm", 4)[:-1], make_pages(s, "vllm", 4)[0].double()],
     "vllm", DTypeError, "dtype"),
    (lambda s: [torch.zeros(3, 4, 4, 2, 8)] * 2, "vllm", ShapeError, "K/V dim is 3"),
    (lambda s: [torch.zeros(16, 2, 8)], "sglang-mla", ShapeError, "dim 1 must be 1"),
    (lambda s: [torch.zeros(4, 2, 4, 8)], "vllm", ShapeError, "vllm-packed"),
])
def test_bad_pages_raise_typed_errors(make, layout, error, match):
    with pytest.raises(error, match=match):
        transfer.Pages.open(make(small_spec()), layout)


def test_pages_and_a_different_layout_name_are_refused():
    pages = transfer.Pages.open(make_pages(small_spec(), "vllm", 4), "vllm")
    with pytest.raises(LayoutError, match="not 'flashinfer'"):
        transfer.as_pages(pages, "flashinfer")
    with pytest.raises(LayoutError, match="name the layout"):
        transfer.gather(make_pages(small_spec(), "vllm", 4), [0],
                        torch.zeros(small_spec().shape(1)))


async def test_store_with_wrong_pages_writes_nothing():
    spec = small_spec()
    other = transfer.Pages.open(make_pages(small_spec(dtype=torch.float16), "vllm", 8), "vllm")
    toks = list(range(2 * CH))
    async with mc.Cache(config(spec)) as c:
        with pytest.raises(ShapeError, match="this cache stores"):
            await c.store(toks, other, torch.arange(2 * CH))
        with pytest.raises(LayoutError):
            await c.store(toks, other, torch.arange(2 * CH), layout="sglang")
        assert await c.lookup(toks) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_pages_opened_once_match_raw_caches_byte_for_byte(layout):
    rng = random.Random(11)
    spec = small_spec(mla=layout.endswith("mla"))
    toks = [rng.randrange(1000) for _ in range(5 * CH + 3)]
    n = len(toks)
    dense = prefix_kv(spec, toks)
    src = make_pages(spec, layout, 64)
    slots = random_slots(n, 64, rng)
    write_dense(spec, layout, src, slots, dense)
    src_pages = transfer.Pages.open(src, layout)
    dst_raw, dst = make_pages(spec, layout, 64), make_pages(spec, layout, 64)
    dst_pages = transfer.Pages.open(dst, layout)
    out_slots = random_slots(n, 64, rng)
    async with mc.Cache(config(spec)) as raw, mc.Cache(config(spec)) as opened:
        assert await raw.store(toks, src, slots, layout=layout) == n
        assert await opened.store(toks, src_pages, slots) == n
        assert torch.equal((await raw.get(toks)).kv, (await opened.get(toks)).kv)
        assert await raw.retrieve(toks, dst_raw, out_slots, layout=layout) == n
        # The same Pages serves a second store and two retrieves.
        assert await opened.store(toks[:CH] + [1, 2, 3], src_pages, slots[:CH + 3]) == CH + 3
        assert await opened.retrieve(toks, dst_pages, out_slots) == n
        assert await opened.retrieve(toks, dst_pages, out_slots, skip_prefix=CH) == n - CH
    assert all(torch.equal(a, b) for a, b in zip(flat(dst_raw), flat(dst), strict=True))
    assert torch.equal(read_dense(spec, layout, dst, out_slots), dense)


def test_layers_of_pages_move_what_the_sliced_caches_move():
    rng = random.Random(5)
    spec = small_spec()
    caches = make_pages(spec, "sglang", 16)
    for t in caches[0] + caches[1]:
        t.copy_(torch.randn(t.shape))
    pages = transfer.Pages.open(caches, "sglang")
    one = pages.layers(1, 2)
    assert one.spec.num_layers == 1
    slots = random_slots(20, 16, rng)
    a = torch.zeros(dataclasses.replace(spec, num_layers=1).shape(20))
    b = torch.zeros_like(a)
    transfer.gather(one, slots, a)
    transfer.gather((caches[0][1:2], caches[1][1:2]), slots, b, "sglang")
    assert torch.equal(a, b) and a.abs().sum() > 0
    with pytest.raises(mc.InvalidInputError):
        pages.layers(1, 1)


async def test_pages_opened_once_serve_many_stores_and_retrieves():
    """``transfer.Pages`` describes the caches once, for every store and retrieve after it
    (the cost saved: ``musacache bench scale``, paged); as raw caches, the bytes are exact."""
    rng = random.Random(2)
    spec = small_spec()
    n = 12 * CH
    toks = [rng.randrange(1000) for _ in range(n)]
    src = make_pages(spec, "vllm", 64)
    slots = random_slots(n, 64, rng)
    write_dense(spec, "vllm", src, slots, prefix_kv(spec, toks))
    async with mc.Cache(config(spec)) as c:
        assert await c.store(toks, src, slots, layout="vllm") == n
        dst = make_pages(spec, "vllm", 64)
        assert await c.retrieve(toks, dst, slots) == n
        assert torch.equal(read_dense(spec, "vllm", dst, slots), prefix_kv(spec, toks))
        pages = transfer.Pages.open(src, "vllm")
        more = toks + [9] * CH
        slots2 = torch.cat([slots, slots[:CH]])
        assert await c.store(more, pages, slots2) == n + CH
        assert torch.equal((await c.get(more)).kv, read_dense(spec, "vllm", src, slots2))
        raw = make_pages(spec, "vllm", 64)
        assert await c.retrieve(toks, transfer.Pages.open(raw, "vllm"), slots) == n
        assert torch.equal(read_dense(spec, "vllm", raw, slots), prefix_kv(spec, toks))


def _random_caches(layout, layers=3, heads=2, dim=8, blocks=16, bs=4):
    shapes = {
        "vllm": (2, blocks, bs, heads, dim), "vllm-hnd": (2, blocks, heads, bs, dim),
        "flashinfer": (blocks, 2, bs, heads, dim), "vllm-packed": (blocks, heads, bs, 2 * dim),
        "vllm-packed-cpu": (blocks, heads, bs, 2 * dim), "vllm-mla": (blocks, bs, dim),
        "sglang-mla": (blocks * bs, 1, dim),
    }
    if layout == "sglang":
        return tuple([torch.randn(blocks * bs, heads, dim) for _ in range(layers)]
                     for _ in range(2))
    return [torch.randn(shapes[layout]) for _ in range(layers)]


@pytest.mark.parametrize("layout", transfer.LAYOUTS)
def test_torch_ops_path_reads_the_plane_table_as_the_native_path_does(layout):
    """The device fallback (torch ops over staging windows), run on the CPU, moves the same
    rows as the native path, whole and per layer range, for every row of the table."""
    rng = random.Random(7)
    pages = transfer.Pages.open(_random_caches(layout), layout)
    slots = torch.tensor([*rng.sample(range(pages.num_slots), 20), -1, 3])
    native, torch_ops = torch.zeros(pages.spec.shape(22)), torch.zeros(pages.spec.shape(22))
    transfer.gather(pages, slots, native)
    transfer._staged_transfer(transfer._prepare_chunks(pages, [torch_ops], "dsts", slots), True)
    assert torch.equal(native, torch_ops)
    part = torch.zeros(pages.layers(1, 3).spec.shape(22))
    transfer.gather(pages.layers(1, 3), slots, part)
    assert torch.equal(part, native[1:3])
    a = transfer.Pages.open(_random_caches(layout), layout)
    b = transfer.Pages.from_tensors([t.clone() for t in a.tensors], layout)
    src = torch.randn(a.spec.shape(21))
    transfer.scatter(src, a, slots[:21])
    transfer._staged_transfer(transfer._prepare_chunks(b, [src], "srcs", slots[:21]), False)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))


# -- raw caches passed again and again: PagesMemo ------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_memo_reuses_the_description_of_the_same_tensors(layout):
    spec = small_spec(mla=layout.endswith("mla"))
    caches = make_pages(spec, layout, 8)
    memo = transfer.PagesMemo()
    first = memo.open(caches, layout)
    again = memo.open(caches, layout)
    assert again.info is first.info and again.spans is first.spans
    assert again.tensors == first.tensors and again.layout == layout
    # A new container of the same tensors is the same caches.
    copy = (list(caches[0]), list(caches[1])) if layout == "sglang" else list(caches)
    assert memo.open(copy, layout).info is first.info
    if layout == "vllm":  # the default layout
        assert memo.open(copy, None).info is first.info
    else:  # None means the default layout, not the one opened last
        with pytest.raises(LayoutError):
            memo.open(copy, None if layout == "sglang" else "sglang")


def _swapped(layout, caches, change):
    """caches with the first tensor changed by change(tensor) -> tensor."""
    if layout == "sglang":
        k, v = list(caches[0]), list(caches[1])
        k[0] = change(k[0])
        return (k, v)
    out = list(caches)
    out[0] = change(out[0])
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("change", ["another tensor", "data swapped", "set_ to new memory",
                                    "fewer layers"])
def test_the_memo_describes_changed_caches_anew(layout, change):
    spec = small_spec(mla=layout.endswith("mla"))
    caches = make_pages(spec, layout, 8)
    memo = transfer.PagesMemo()
    first = memo.open(caches, layout)
    if change == "another tensor":
        changed = _swapped(layout, caches, lambda t: t.clone())
    elif change == "data swapped":
        changed = caches

        def swap(t):
            t.data = torch.zeros_like(t)
            return t
        _swapped(layout, caches, swap)
    elif change == "set_ to new memory":
        changed = caches
        _swapped(layout, caches, lambda t: t.set_(torch.zeros_like(t)))
    else:
        changed = ((caches[0][:-1], caches[1][:-1]) if layout == "sglang"
                   else caches[:-1])
    again = memo.open(changed, layout)
    assert again.info is not first.info
    assert again.info == transfer.Pages.open(changed, layout).info
    assert again.spans == transfer.Pages.open(changed, layout).spans
    assert again.spans != first.spans


def test_the_memo_holds_no_tensor():
    """An engine that drops its caches gets their memory back: the memo, and a cache that
    stored from them, keep only weak references."""
    import gc
    import weakref

    spec = small_spec()
    caches = make_pages(spec, "vllm", 8)
    memo = transfer.PagesMemo()
    memo.open(caches, "vllm")
    refs = [weakref.ref(t) for t in caches]
    del caches
    gc.collect()
    assert all(r() is None for r in refs)
    # A new list at whatever addresses is described anew, not matched against the dead.
    fresh = make_pages(spec, "vllm", 8)
    assert memo.open(fresh, "vllm").tensors == tuple(fresh)


async def test_a_cache_storing_from_raw_caches_lets_them_go():
    import gc
    import weakref

    spec = small_spec()
    toks = list(range(2 * CH))
    caches = make_pages(spec, "vllm", 16)
    async with mc.Cache(config(spec)) as c:
        assert await c.store(toks, caches, torch.arange(2 * CH)) == 2 * CH
        assert await c.retrieve(toks, caches, torch.arange(2 * CH)) == 2 * CH
        refs = [weakref.ref(t) for t in caches]
        del caches
        gc.collect()
        assert all(r() is None for r in refs)


async def test_raw_caches_changed_between_stores_are_read_where_they_are_now():
    """The same list object, its first layer moved to new memory with new contents: the next
    store reads the new memory (a stale description would read freed memory)."""
    spec = small_spec()
    rng = random.Random(5)
    toks_a = [rng.randrange(1000) for _ in range(2 * CH)]
    toks_b = [t + 1000 for t in toks_a]
    caches = make_pages(spec, "vllm", 16)
    slots = random_slots(2 * CH, 16, rng)
    write_dense(spec, "vllm", caches, slots, prefix_kv(spec, toks_a))
    async with mc.Cache(config(spec)) as c:
        assert await c.store(toks_a, caches, slots) == 2 * CH
        moved = caches[0].clone()
        caches[0].set_(moved.untyped_storage(), 0, moved.shape, moved.stride())
        write_dense(spec, "vllm", caches, slots, prefix_kv(spec, toks_b))
        assert await c.store(toks_b, caches, slots) == 2 * CH
        assert torch.equal((await c.get(toks_b)).kv, prefix_kv(spec, toks_b))
        assert torch.equal((await c.get(toks_a)).kv, prefix_kv(spec, toks_a))


async def test_a_wrong_spec_is_refused_on_every_call_not_only_the_first():
    spec = small_spec()
    wrong = make_pages(small_spec(dtype=torch.float16), "vllm", 8)
    right = make_pages(spec, "vllm", 8)
    toks = list(range(CH))
    async with mc.Cache(config(spec)) as c:
        for caches in (wrong, right, wrong, wrong):
            if caches is wrong:
                with pytest.raises(ShapeError, match="this cache stores"):
                    await c.store(toks, caches, torch.arange(CH))
            else:
                assert await c.store(toks, caches, torch.arange(CH)) == CH
