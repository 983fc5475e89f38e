"""The direct read path (``_fastpath``) against the general one.

Two caches with the same configuration run the same random sequence of puts, gets (with and
without ``out``, good and bad), lookups and deletes: one with the direct path, one with it
turned off. After every step both must have answered alike (the same bytes, the same ``Hit``,
the same error and an untouched ``out``), and must hold the same state (every counter of
``stats()``, the moves made, each memory tier's LRU order). The bytes are also checked against
the KV that was put. The sequences are built so that a good share of the gets is served by the
direct path, and the test checks that it was.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache.engine import core as _core
from musacache.tiers.disk import DiskTier

CHUNK = 4


def _configs(tmp: Any) -> dict[str, tuple[mc.KVSpec, Any]]:
    f32 = small_spec()
    mla = small_spec(mla=True, dtype=torch.bfloat16)
    f16 = mc.KVSpec(1, 1, 8, torch.float16)
    return {
        # Evictions drop chunks; requests over 3 chunks are copied off the loop (general path).
        "host": (f32, lambda: dict(tiers=(mc.HostTier(f32.nbytes(CHUNK) * 6),),
                                   inline_copy_bytes=f32.nbytes(3 * CHUNK) + 1)),
        # Evictions demote into a second memory tier; a get there promotes (general path),
        # and a promoted chunk is then in both.
        "host+mem": (f16, lambda: dict(
            tiers=(mc.HostTier(f16.nbytes(CHUNK) * 4),
                   mc.DeviceTier(f16.nbytes(CHUNK) * 8, device="cpu", name="mem2")),
            tenant="tenant-a")),
        # Every chunk is also written through to disk: the direct path touches it there too.
        # (No evictions here: promotions from disk finish in worker-thread order, so two
        # caches would not stay in step, whichever path reads.)
        "host+disk": (mla, lambda: dict(
            tiers=(mc.HostTier(mla.nbytes(CHUNK) * 64),
                   DiskTier(path=str(tmp / f"disk{random.random()}"), capacity_bytes="64MiB",
                            write_through=True)),
            namespace="other-model")),
    }


def _tokens_as(seq: list[int], rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return list(seq)
    if kind == 1:
        return np.asarray(seq, dtype=np.int64)
    if kind == 2:
        return torch.tensor(seq, dtype=torch.int64)
    if kind == 3:
        return torch.tensor(seq, dtype=torch.int32)
    if kind == 4:  # int32, not contiguous
        return np.repeat(np.asarray(seq, dtype=np.int32), 2)[::2]
    return np.asarray(seq, dtype=np.int32)


def _out(spec: mc.KVSpec, n: int, kind: str) -> tuple[torch.Tensor, bool]:
    """An ``out`` for ``n`` tokens of ``kind``, filled with a sentinel; whether it is valid."""
    shape = spec.shape(n)
    sentinel = -3.0
    if kind == "contiguous":
        return torch.full(shape, sentinel, dtype=spec.dtype), True
    if kind == "strided":  # every other element of the last dim
        wide = torch.full((*shape[:-1], shape[-1] * 2), sentinel, dtype=spec.dtype)
        return wide[..., ::2], True
    if kind == "permuted":  # tokens outermost in memory, as a HuggingFace cache may be
        td = spec.token_dim
        order = [td, *[d for d in range(len(shape)) if d != td]]
        base = torch.full([shape[d] for d in order], sentinel, dtype=spec.dtype)
        return base.permute(*[order.index(d) for d in range(len(shape))]), True
    if kind == "short":
        return torch.full(spec.shape(n + 1), sentinel, dtype=spec.dtype), False
    if kind == "dtype":
        return torch.full(shape, sentinel, dtype=torch.float64), False
    if kind == "overlap":  # (with no tokens, nothing overlaps)
        return torch.full((1,), sentinel, dtype=spec.dtype).expand(shape), n == 0
    if kind == "grad":
        return torch.full(shape, sentinel, dtype=torch.float32).requires_grad_(), False
    if kind == "meta":
        return torch.empty(shape, dtype=spec.dtype, device="meta"), False
    raise AssertionError(kind)


OUT_KINDS = ["none", "none", "contiguous", "contiguous", "strided", "permuted", "short", "dtype",
             "overlap", "grad", "meta"]


async def _state(c: mc.Cache) -> dict[str, Any]:
    st = await c.stats()
    for tier in st["tiers"].values():
        tier.pop("store_path", None)  # each cache has a directory of its own
    eng = c._engine
    lru = {t.name: [e.key for _k, e in t.lru.items()] for t in eng.mem}
    return {"stats": st, "moves": eng.mover.moves, "lru": lru}


async def _both(a: mc.Cache, b: mc.Cache, op: str, *args: Any, **kw: Any) -> tuple[Any, Any]:
    """Run ``op`` on each cache; their results, or the exception each raised."""
    got = []
    for c in (a, b):
        try:
            got.append(await getattr(c, op)(*args, **kw))
        except mc.MusaCacheError as e:
            got.append(e)
    return got[0], got[1]


def _same_error(ea: Any, eb: Any) -> None:
    assert isinstance(ea, mc.MusaCacheError) and isinstance(eb, mc.MusaCacheError), (ea, eb)
    assert type(ea) is type(eb) and str(ea) == str(eb)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("which", ["host", "host+mem", "host+disk"])
async def test_direct_path_agrees_with_general_path(tmp_path: Any, which: str, seed: int) -> None:
    spec, make = _configs(tmp_path)[which]
    rng = random.Random(f"{which}-{seed}")
    fast_served = {"get": 0, "lookup": 0}
    def config() -> mc.CacheConfig:
        kw = make()
        return mc.CacheConfig(spec, kw.pop("namespace", "fast"), chunk_size=CHUNK, **kw)

    async with mc.Cache(config()) as a, mc.Cache(config()) as b:
        b._fast = None  # the reference: the general path only
        direct = a._fast
        assert direct is not None
        real_get, real_lookup = direct.get, direct.lookup

        def spy_get(tokens: Any, out: Any) -> Any:
            r = real_get(tokens, out)
            fast_served["get"] += r is not None
            return r

        def spy_lookup(tokens: Any) -> Any:
            r = real_lookup(tokens)
            fast_served["lookup"] += r is not None
            return r

        direct.get, direct.lookup = spy_get, spy_lookup  # type: ignore[method-assign]
        # Prompts over a 3-token vocabulary: many share prefixes, end inside chunks, and
        # extend one another's partial tails.
        stems = [[rng.randrange(3) for _ in range(4 * CHUNK + 3)] for _ in range(5)]
        for step in range(90):
            seq = rng.choice(stems)[: rng.randrange(0, 4 * CHUNK + 4)]
            op = rng.choices(["put", "get", "lookup", "delete", "clear"], [3, 8, 2, 1, 0.3])[0]
            toks = _tokens_as(seq, rng)
            where = f"step {step}: {op} of {len(seq)} tokens"
            if op == "clear":
                await a.clear()
                await b.clear()
            elif op == "put":
                ra, rb = await _both(a, b, "put", toks, prefix_kv(spec, seq))
                assert ra == rb, where
            elif op in ("lookup", "delete"):
                ra, rb = await _both(a, b, op, toks)
                assert ra == rb, where
            else:
                kind = rng.choice(OUT_KINDS)
                if kind == "none":
                    ha, hb = await _both(a, b, "get", toks)
                else:
                    out_a, ok = _out(spec, len(seq), kind)
                    out_b, _ = _out(spec, len(seq), kind)
                    before = out_a.detach().clone() if kind != "meta" else None
                    ha, hb = await _both(a, b, "get", toks, out=out_a)
                    if not ok:
                        _same_error(ha, hb)
                        if before is not None:  # refused before anything was written
                            assert torch.equal(out_a.detach(), before), where
                        await a.flush()
                        await b.flush()
                        assert await _state(a) == await _state(b), where
                        continue
                    await _both(a, b, "get", toks, out=out_b)  # b's own out, same state
                    assert ha.kv.data_ptr() == out_a.data_ptr() or ha.num_tokens == 0, where
                    assert torch.equal(out_a, out_b), where  # untouched past the hit, too
                assert isinstance(ha, mc.Hit) and isinstance(hb, mc.Hit), (where, ha, hb)
                assert (ha.num_tokens, ha.tiers) == (hb.num_tokens, hb.tiers), where
                assert ha.kv.shape == hb.kv.shape and ha.kv.dtype == hb.kv.dtype, where
                assert torch.equal(ha.kv, hb.kv), where
                assert torch.equal(ha.kv, prefix_kv(spec, seq[: ha.num_tokens])), where
                assert ha.kv.device == hb.kv.device == a.device, where
            await a.flush()
            await b.flush()
            assert await _state(a) == await _state(b), where
    # The sequences reach the direct path often (else this test would show nothing).
    assert fast_served["get"] >= 5 and fast_served["lookup"] >= 3, fast_served


@pytest.mark.parametrize("which", ["host", "host+mem", "host+disk"])
async def test_one_chunk_gets_agree_with_the_general_path(tmp_path: Any, which: str) -> None:
    """The straight path for a prompt of one chunk (``FastPath._whole``: one hash, one probe;
    and ``_one``'s memmove for a get) against the general path: prompts of at most one chunk
    among longer ones, looked up and asked with and without ``out``; the same answers and
    state after every step, and a good share of those gets taken straight through."""
    spec, make = _configs(tmp_path)[which]
    rng = random.Random(f"one-{which}")
    straight = {"served": 0, "asked": 0}

    def config() -> mc.CacheConfig:
        kw = make()
        return mc.CacheConfig(spec, kw.pop("namespace", "fast"), chunk_size=CHUNK, **kw)

    async with mc.Cache(config()) as a, mc.Cache(config()) as b:
        b._fast = None
        direct = a._fast
        assert direct is not None
        real_one = direct._one

        def spy_one(*args: Any) -> Any:
            r = real_one(*args)
            straight["asked"] += 1
            straight["served"] += r is not None
            return r

        direct._one = spy_one  # type: ignore[method-assign]
        stored: list[list[int]] = []
        for step in range(80):
            seq = [rng.randrange(2) for _ in range(rng.randrange(1, CHUNK + 1))]
            op = rng.choices(["put", "put-long", "get", "get-out", "lookup"], [2, 1, 4, 3, 2])[0]
            if op in ("get", "get-out", "lookup") and stored and rng.random() < 0.7:
                seq = rng.choice(stored)  # most gets ask for a prompt put before
            elif op == "put":
                stored.append(seq)
            where = f"step {step}: {op} of {seq}"
            if op == "put-long":
                seq = seq + [rng.randrange(2) for _ in range(CHUNK + 1)]
            if op.startswith("put"):
                ra, rb = await _both(a, b, "put", seq, prefix_kv(spec, seq))
                assert ra == rb, where
            elif op == "lookup":
                ra, rb = await _both(a, b, "lookup", _tokens_as(seq, rng))
                assert ra == rb, where
            else:
                toks = _tokens_as(seq, rng)
                if op == "get":
                    ha, hb = await _both(a, b, "get", toks)
                else:
                    out_a, _ = _out(spec, len(seq), "contiguous")
                    out_b, _ = _out(spec, len(seq), "contiguous")
                    ha, hb = await _both(a, b, "get", toks, out=out_a)
                    await _both(a, b, "get", toks, out=out_b)
                    assert torch.equal(out_a, out_b), where
                    assert ha.num_tokens == 0 or ha.kv.data_ptr() == out_a.data_ptr(), where
                assert (ha.num_tokens, ha.tiers) == (hb.num_tokens, hb.tiers), where
                assert ha.kv.shape == hb.kv.shape and torch.equal(ha.kv, hb.kv), where
                assert torch.equal(ha.kv, prefix_kv(spec, seq[: ha.num_tokens])), where
            await a.flush()
            await b.flush()
            assert await _state(a) == await _state(b), where
    assert straight["served"] >= 12, straight


async def test_a_direct_get_touches_its_chunks_in_the_storage_tiers_too(tmp_path: Any) -> None:
    """A get served straight from the top tier also makes its chunks the newest in every
    lower tier holding them (here a write-through disk tier), as the general path does.
    (Writes finish in worker-thread order, so only the newest end is checked.)"""
    spec = mc.KVSpec(1, 1, 8, torch.float16)
    cfg = mc.CacheConfig(spec, "fast", chunk_size=CHUNK, tiers=(
        mc.HostTier(spec.nbytes(CHUNK) * 16),
        DiskTier(path=str(tmp_path / "disk"), capacity_bytes="1MiB", write_through=True)))
    prompts = [[i, 1, 2, 3] for i in range(4)] + [[9, 8, 7, 6, 5, 4]]
    async with mc.Cache(cfg) as c:
        for p in prompts:
            await c.put(p, prefix_kv(spec, p))
        await c.flush()
        disk = c._engine.stores[0]
        served = {"one": 0}
        real_one = c._fast._one

        def spy_one(*args: Any) -> Any:
            r = real_one(*args)
            served["one"] += r is not None
            return r

        c._fast._one = spy_one  # type: ignore[method-assign,union-attr]
        for p in [prompts[2], prompts[0], prompts[4], prompts[3]]:
            out = torch.empty(spec.shape(len(p)), dtype=spec.dtype)
            for hit in (await c.get(p), await c.get(p, out=out)):
                assert hit.num_tokens == len(p)
                newest = [k for k, _e in disk.lru.items()][-1]
                assert newest == _first_key(c, p)  # (parents are touched last)
        assert served["one"] == 6  # the two-chunk prompt went the general loop's way


def _first_key(c: mc.Cache, toks: list[int]) -> bytes:
    return c._engine.chain.keys(np.asarray(toks, dtype=np.int32))[0][3]


async def test_a_resident_get_and_lookup_skip_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A get whose chunks are all in the host top tier neither pins nor plans a move, and a
    lookup of a cached prompt does not go through the engine's matcher."""
    spec = mc.KVSpec(1, 1, 8, torch.float16)
    cfg = mc.CacheConfig(spec, "fast", chunk_size=16,
                         tiers=(mc.HostTier(spec.nbytes(16) * 8),))
    toks = list(range(100, 120))  # a full chunk and a partial tail
    kv = prefix_kv(spec, toks)
    async with mc.Cache(cfg) as c:
        assert await c.put(toks, kv) == 20

        def general(*a: Any, **k: Any) -> Any:
            raise AssertionError("the general read path was taken")

        monkeypatch.setattr(_core.Engine, "sources", general)
        monkeypatch.setattr(_core.Engine, "match", general)
        monkeypatch.setattr(_core.Engine, "pin", general)
        hit = await c.get(toks)
        assert hit.num_tokens == 20 and torch.equal(hit.kv, kv)
        out = torch.empty(spec.shape(20), dtype=spec.dtype)
        hit = await c.get(np.asarray(toks, dtype=np.int32), out=out)
        assert hit.kv is out and torch.equal(out, kv)
        assert await c.lookup(toks) == 20
        assert await c.lookup(toks[:16]) == 16
        st = await c.stats()
        assert st["ops"]["gets"] == 2 and st["ops"]["lookups"] == 2
        assert st["tiers"]["host"]["hits"] == 4
        assert st["tokens"]["hit_tokens"] == 40 and st["pins"] == 0


async def test_direct_write_into_out_is_seen_by_autograd() -> None:
    """The direct path writes ``out`` by address; like ``copy_`` it records the in-place write
    (a graph that saved ``out`` refuses to run its backward pass on the new values)."""
    spec = mc.KVSpec(1, 1, 8, torch.float32)
    cfg = mc.CacheConfig(spec, "fast", chunk_size=16, tiers=(mc.HostTier(spec.nbytes(16) * 4),))
    toks = list(range(16))
    async with mc.Cache(cfg) as c:
        await c.put(toks, prefix_kv(spec, toks))
        out = torch.zeros(spec.shape(16))
        w = torch.ones(spec.shape(16), requires_grad=True)
        y = (w * out).sum()  # saves out for the backward pass
        hit = await c.get(toks, out=out)
        assert hit.num_tokens == 16 and torch.equal(out, prefix_kv(spec, toks))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


async def test_a_miss_with_a_shared_tier_still_asks_it() -> None:
    """With a shared storage tier, a prompt this node never saw may have been written by
    another: the direct path leaves that miss to the general path, which refreshes."""
    from fake_store import MemStore

    spec = mc.KVSpec(1, 1, 8, torch.float16)
    objects: dict[bytes, bytes] = {}
    toks = list(range(40))

    def config() -> mc.CacheConfig:
        return mc.CacheConfig(spec, "fast", chunk_size=16, refresh_interval=0,
                              tiers=(mc.HostTier(spec.nbytes(16) * 8),
                                     MemStore(objects, shared=True, write_through=True)))

    async with mc.Cache(config()) as reader, mc.Cache(config()) as writer:
        assert reader._fast is not None
        assert await writer.put(toks, prefix_kv(spec, toks)) == 40
        await writer.flush()  # written after the reader listed the tier
        assert await reader.lookup(toks) == 40
        hit = await reader.get(toks)
        assert hit.num_tokens == 40 and torch.equal(hit.kv, prefix_kv(spec, toks))


def test_native_copy_bytes() -> None:
    from musacache._native import lib

    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    assert lib.mc_copy_bytes(dst.data_ptr() + 8, src.data_ptr() + 16, 32) == lib.MC_OK
    assert torch.equal(dst[8:40], src[16:48]) and not dst[:8].any() and not dst[40:].any()
    assert lib.mc_copy_bytes(dst.data_ptr(), src.data_ptr(), 0) == lib.MC_OK
    assert lib.mc_copy_bytes(dst.data_ptr(), src.data_ptr(), -1) == lib.MC_ERR_ARGUMENT
    assert lib.mc_copy_bytes(0, src.data_ptr(), 4) == lib.MC_ERR_ARGUMENT
    assert lib.mc_copy_bytes(dst.data_ptr(), 0, 4) == lib.MC_ERR_ARGUMENT


async def test_a_native_module_built_before_copy_bytes_still_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from musacache.engine import fastpath as _fastpath

    monkeypatch.setattr(_fastpath, "_copy_bytes", _fastpath._ctypes_copy)
    spec = small_spec()
    cfg = mc.CacheConfig(spec, "fast", chunk_size=CHUNK, tiers=(mc.HostTier(spec.nbytes(CHUNK) * 8),))
    toks = list(range(10))
    async with mc.Cache(cfg) as c:
        await c.put(toks, prefix_kv(spec, toks))
        hit = await c.get(toks)
        assert hit.num_tokens == 10 and torch.equal(hit.kv, prefix_kv(spec, toks))


async def test_a_get_while_clear_runs_finds_nothing() -> None:
    """``clear`` swaps in an empty directory at once and frees the old entries in batches: a
    get or lookup between two batches must not find what is being cleared."""
    import anyio

    spec = mc.KVSpec(1, 1, 8, torch.float16)
    cfg = mc.CacheConfig(spec, "fast", chunk_size=16,
                         tiers=(mc.HostTier(spec.nbytes(16) * 400),))
    prompts = [[i, *range(15)] for i in range(300)]
    async with mc.Cache(cfg) as c:
        for p in prompts:
            await c.put(p, prefix_kv(spec, p))
        assert (await c.get(prompts[0])).num_tokens == 16
        seen = []

        async def reader() -> None:
            await anyio.lowlevel.checkpoint()  # clear has swapped and freed one batch
            seen.append((await c.get(prompts[0])).num_tokens)
            seen.append(await c.lookup(prompts[0]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(c.clear)
            tg.start_soon(reader)
        assert seen == [0, 0]


@pytest.mark.parametrize("direct", [True, False])
async def test_out_made_under_inference_mode(direct: bool) -> None:
    """An engine runs under ``torch.inference_mode()`` and hands in ``out`` made there: the get
    writes it (inference tensors have no version counter to bump). The same ``out`` outside
    inference mode is refused with a typed error before anything is written (torch forbids
    that in-place write), on either path."""
    spec = mc.KVSpec(1, 1, 8, torch.float16)
    cfg = mc.CacheConfig(spec, "fast", chunk_size=16, tiers=(mc.HostTier(spec.nbytes(16) * 4),))
    toks = list(range(16))
    async with mc.Cache(cfg) as c:
        if not direct:
            c._fast = None
        await c.put(toks, prefix_kv(spec, toks))
        with torch.inference_mode():
            out = torch.zeros(spec.shape(16), dtype=spec.dtype)
            hit = await c.get(toks, out=out)
            assert hit.num_tokens == 16 and torch.equal(out, prefix_kv(spec, toks))
            fresh = await c.get(toks)
            assert torch.equal(fresh.kv, prefix_kv(spec, toks))
        with torch.inference_mode():
            out = torch.zeros(spec.shape(16), dtype=spec.dtype)
        with pytest.raises(mc.InvalidInputError, match="inference_mode"):
            await c.get(toks, out=out)
        assert not out.any()


@pytest.mark.parametrize("form", ["list", "tuple", "np64", "npu32", "np32-strided", "np32-be",
                                  "torch64", "torch32", "torch-strided"])
def test_as_tokens_agrees_across_forms(form: str) -> None:
    """The shortcuts in ``as_tokens`` (plain-int lists, CPU tensors without a detach, one
    comparison for the int32 range) give the same array and the same errors as before."""
    from musacache._keys import as_tokens

    good = [0, 7, 2**31 - 1, 123456, -(2**31), 5]
    bad = [3, 2**31, 4] if form != "npu32" else None

    def make(seq: list[int]) -> Any:
        return {
            "list": lambda: list(seq), "tuple": lambda: tuple(seq),
            "np64": lambda: np.asarray(seq, dtype=np.int64),
            "npu32": lambda: np.asarray([abs(x) % 2**31 for x in seq], dtype=np.uint32),
            "np32-strided": lambda: np.repeat(np.asarray(seq, dtype=np.int64), 2)[::2],
            "np32-be": lambda: np.asarray(seq, dtype=">i8"),
            "torch64": lambda: torch.tensor(seq, dtype=torch.int64),
            "torch32": lambda: torch.tensor(seq, dtype=torch.int64).to(torch.int32)
            if max(seq) < 2**31 else torch.tensor(seq, dtype=torch.int64),
            "torch-strided": lambda: torch.tensor(seq, dtype=torch.int64).repeat_interleave(2)[::2],
        }[form]()

    want = np.asarray(good if form != "npu32" else [abs(x) % 2**31 for x in good], dtype="<i4")
    got = as_tokens(make(good))
    assert got.dtype == np.dtype("<i4") and got.flags.c_contiguous and np.array_equal(got, want)
    if bad is not None:
        with pytest.raises(mc.TokensError, match="int32"):
            as_tokens(make(bad))


def test_new_hit_is_the_same_hit_as_the_constructor_makes():
    """The direct path builds its Hit without the frozen dataclass's __init__: it must be the
    same value, still frozen, and still false on a miss."""
    import dataclasses

    from musacache.cache import Hit, _new_hit

    kv = torch.arange(4.0)
    made, fast = Hit(3, kv, {"host": 3}), _new_hit(3, kv, {"host": 3})
    assert fast == made and type(fast) is Hit and repr(fast) == repr(made)
    assert [f.name for f in dataclasses.fields(fast)] == ["num_tokens", "kv", "tiers"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.num_tokens = 5  # type: ignore[misc]
    assert not _new_hit(0, kv[:0], {}) and bool(fast)


# -- out: what is checked at every call, and what is remembered -------------------------------


def _serve_spy(c: mc.Cache) -> list[int | None]:
    """What each ``FastPath.serve`` call of ``c`` answered (None: the general path's)."""
    fast = c._fast
    assert fast is not None
    answers: list[int | None] = []
    real = fast.serve

    def spy(buf: bytes, out: torch.Tensor) -> int | None:
        answers.append(real(buf, out))
        return answers[-1]

    fast.serve = spy  # type: ignore[method-assign]
    return answers


def _small_cache() -> mc.Cache:
    spec = mc.KVSpec(1, 2, 8, torch.float16)
    return mc.Cache(mc.CacheConfig(spec, "fast", chunk_size=CHUNK,
                                   tiers=(mc.HostTier(spec.nbytes(CHUNK) * 16),)))


async def test_the_overlap_of_a_strided_out_is_remembered_per_shape_and_strides() -> None:
    """A strided ``out`` is proven not to overlap itself once per (shape, strides), and a
    tensor of the same shape with other strides is checked afresh: an overlapping one (a
    token dim of stride 0, as ``expand`` makes) is refused with the typed error, nothing
    written. Fails if the remembered answer were keyed by the shape alone."""
    async with _small_cache() as c:
        spec = c.spec
        toks = [1, 2, 3, 4]
        await c.put(toks, prefix_kv(spec, toks))
        answers = _serve_spy(c)
        fast = c._fast
        assert fast is not None
        shape = spec.shape(CHUNK)  # (L, 2, T, H, D)
        for _ in range(2):  # the second time from what was remembered
            out = torch.zeros(1, 2, 2, CHUNK, 8, dtype=spec.dtype).permute(0, 1, 3, 2, 4)
            assert not out.is_contiguous() and out.shape == shape
            hit = await c.get(toks, out=out)
            assert hit.num_tokens == CHUNK and torch.equal(out, prefix_kv(spec, toks))
        assert answers == [CHUNK, CHUNK] and list(fast.overlaps.values()) == [False]
        base = torch.zeros(1, 2, 1, 2, 8, dtype=spec.dtype)
        overlapping = base.expand(1, 2, CHUNK, 2, 8)  # the same shape; every token one row
        assert overlapping.shape == shape
        with pytest.raises(mc.InvalidInputError, match="overlapping memory"):
            await c.get(toks, out=overlapping)
        assert answers[-1] is None and not base.any()
        assert sorted(fast.overlaps.values()) == [False, True]


def _re_pointed(out: torch.Tensor, spec: mc.KVSpec) -> None:
    out.set_(torch.zeros(spec.shape(CHUNK), dtype=spec.dtype))


def _resized(out: torch.Tensor, spec: mc.KVSpec) -> None:
    out.resize_(spec.shape(CHUNK + 1))


def _restrided(out: torch.Tensor, spec: mc.KVSpec) -> None:
    shape = spec.shape(CHUNK)
    out.as_strided_(shape, (0,) * len(shape))  # the same shape, every element one location


def _new_dtype(out: torch.Tensor, spec: mc.KVSpec) -> None:
    out.data = torch.zeros(spec.shape(CHUNK), dtype=torch.float32)


def _needs_grad(out: torch.Tensor, spec: mc.KVSpec) -> None:
    out.requires_grad_()


def _made_inference(out: torch.Tensor, spec: mc.KVSpec) -> None:
    with torch.inference_mode():
        made = torch.zeros(spec.shape(CHUNK), dtype=spec.dtype)
    out.data = made


@pytest.mark.parametrize("change, error", [
    (_re_pointed, None), (_resized, "shape"), (_restrided, "overlapping"),
    (_new_dtype, "dtype"), (_needs_grad, "requires grad"), (_made_inference, "inference_mode")])
async def test_an_out_changed_in_place_between_two_gets_is_checked_again(
        change: Any, error: str | None) -> None:
    """The same ``out`` object, served once, then changed in place: re-pointed at other
    memory (``set_``), resized, given overlapping strides (``as_strided_``), another dtype or
    made to require grad (``.data =``, ``requires_grad_``), or swapped for an inference
    tensor. The next get checks it again: the new memory gets the bytes, and anything the
    general path refuses is refused with its typed error, the direct path having written
    nothing. Fails if any check were skipped for a tensor seen before."""
    async with _small_cache() as c:
        spec = c.spec
        toks = [5, 6, 7, 8]
        await c.put(toks, prefix_kv(spec, toks))
        answers = _serve_spy(c)
        out = torch.zeros(spec.shape(CHUNK), dtype=spec.dtype)
        first = out.data
        assert (await c.get(toks, out=out)).num_tokens == CHUNK
        first.zero_()
        change(out, spec)
        if error is None:
            hit = await c.get(toks, out=out)
            assert hit.num_tokens == CHUNK and torch.equal(out, prefix_kv(spec, toks))
            assert not first.any()  # the old memory was not written
            assert answers == [CHUNK, CHUNK]
        else:
            with pytest.raises(mc.InvalidInputError, match=error):
                await c.get(toks, out=out)
            assert answers == [CHUNK, None]
            assert not first.any()
