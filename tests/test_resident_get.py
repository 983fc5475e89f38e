"""A get of chunks held by a host top tier copies them by slot address
(``musacache.engine.resident``): the same bytes as the general path for every layout of
``out``, with the rest of a prompt read from below, pins held for the copy and let go of
whatever happens. Its speed against a plain copy: ``musacache bench cache``."""

from __future__ import annotations

import random

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musacache as mc
import musacache.cache as engine_mod
from helpers import host_config, prefix_kv, small_spec

CH = 16


async def _pins(c: mc.Cache) -> int:
    return int((await c.stats())["pins"])


async def _on_disk_with_host_head(spec: mc.KVSpec, path: str, toks: list[int],
                                  head: int) -> mc.Cache:
    """An open cache over a host tier and a disk holding all of ``toks``, with only the
    first ``head`` tokens' chunks back in host memory."""
    tiers = (mc.HostTier(spec.nbytes(CH) * 8),
             mc.DiskTier(path=path, capacity_bytes=1 << 24, write_through=True))
    async with mc.Cache(host_config(spec, tiers=tiers, inline_copy_bytes=0)) as c:
        assert await c.put(toks, prefix_kv(spec, toks)) == len(toks)
    c = mc.Cache(host_config(spec, tiers=tiers, inline_copy_bytes=0))
    await c.open()
    assert (await c.get(toks[:head])).num_tokens == head  # promoted back after the get
    await c.flush()
    assert (await c.stats())["tiers"]["host"]["chunks"] == head // CH
    return c


def _outs(spec: mc.KVSpec, n: int) -> dict[str, torch.Tensor]:
    """``out`` tensors of ``n`` tokens laid out in several ways."""
    shape = spec.shape(n)
    outs = {"contiguous": torch.empty(shape, dtype=spec.dtype)}
    if spec.mla:
        # (L, T, D) from (T, L, D) storage; and every other layer of a bigger tensor
        outs["tokens_outer"] = torch.empty(n, shape[0], shape[2], dtype=spec.dtype).transpose(0, 1)
        outs["layer_slice"] = torch.empty(2 * shape[0], n, shape[2], dtype=spec.dtype)[::2]
        outs["strided_dim"] = torch.empty(shape[0], n, 2 * shape[2], dtype=spec.dtype)[..., ::2]
    else:
        layers, _, _, h, d = shape
        # heads outside tokens: a row per head and token
        outs["heads_outer"] = torch.empty(layers, 2, h, n, d, dtype=spec.dtype).transpose(2, 3)
        outs["kv_outer"] = torch.empty(2, layers, n, h, d, dtype=spec.dtype).transpose(0, 1)
        outs["padded_tokens"] = torch.empty(layers, 2, n, h + 1, d, dtype=spec.dtype)[:, :, :, :h]
        outs["strided_dim"] = torch.empty(layers, 2, n, h, 2 * d, dtype=spec.dtype)[..., ::2]
    return outs


SPECS = {
    "mha": small_spec(),
    "gqa_bf16": mc.KVSpec(num_layers=3, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16),
    "mla": small_spec(mla=True),
}


@pytest.mark.parametrize("name", list(SPECS))
async def test_every_layout_of_out_gets_the_bytes_put(name):
    spec = SPECS[name]
    toks = list(range(1000, 1000 + 5 * CH + 7))  # five whole chunks and a short one
    want = prefix_kv(spec, toks)
    async with mc.Cache(host_config(spec, chunks=16, inline_copy_bytes=0)) as c:
        await c.put(toks, want)
        # (rows that are not contiguous, "strided_dim", take the general path)
        for layout, out in _outs(spec, len(toks)).items():
            out.fill_(-1)
            hit = await c.get(toks, out=out)
            assert hit.num_tokens == len(toks) and hit.tiers == {"host": len(toks)}, layout
            assert torch.equal(out, want), layout
            assert hit.kv.data_ptr() == out.data_ptr(), layout
        hit = await c.get(toks)
        assert torch.equal(hit.kv, want)
        assert await _pins(c) == 0


async def test_a_match_that_ends_inside_a_chunk(spec):
    toks = list(range(3 * CH + 8))
    async with mc.Cache(host_config(spec, chunks=8, inline_copy_bytes=0)) as c:
        await c.put(toks, prefix_kv(spec, toks))
        for n in (3 * CH + 5, 2 * CH + 3, 2 * CH + 8):  # within the short chunk, the third
            hit = await c.get(toks[:n])
            assert hit.num_tokens == n and hit.tiers == {"host": n}
            assert torch.equal(hit.kv, prefix_kv(spec, toks[:n]))


async def test_the_rest_comes_from_below_after_the_leading_resident_chunks(spec, tmp_path):
    toks = list(range(6 * CH))
    c = await _on_disk_with_host_head(spec, str(tmp_path), toks, 4 * CH)
    try:
        hit = await c.get(toks)
        assert hit.num_tokens == len(toks)
        assert hit.tiers == {"host": 4 * CH, "disk": 2 * CH}
        assert torch.equal(hit.kv, prefix_kv(spec, toks))
        await c.flush()  # (background promotions pin what they copy)
        st = await c.stats()
        assert st["pins"] == 0 and st["tiers"]["host"]["hits"] >= 4
    finally:
        await c.aclose()


async def test_a_single_resident_chunk_then_disk(spec, tmp_path):
    # One chunk alone in host memory is not worth the address arrays: the general path.
    toks = list(range(3 * CH))
    c = await _on_disk_with_host_head(spec, str(tmp_path), toks, CH)
    try:
        out = torch.zeros(spec.shape(len(toks)), dtype=spec.dtype)
        hit = await c.get(toks, out=out)
        assert hit.tiers == {"host": CH, "disk": 2 * CH}
        assert torch.equal(out, prefix_kv(spec, toks))
        await c.flush()  # (background promotions pin what they copy)
        assert await _pins(c) == 0
    finally:
        await c.aclose()


async def test_eviction_and_delete_during_the_copy_keep_the_slots(spec):
    toks = list(range(4 * CH))
    async with mc.Cache(host_config(spec, chunks=4, inline_copy_bytes=0)) as c:
        await c.put(toks, prefix_kv(spec, toks))
        mover = c._engine.mover
        real = mover.run
        entered, gate = anyio.Event(), anyio.Event()

        async def held(*a, **k):
            entered.set()
            await gate.wait()
            await real(*a, **k)

        mover.run = held
        got = {}
        async with anyio.create_task_group() as tg:
            async def reader():
                got["hit"] = await c.get(toks)
            tg.start_soon(reader)
            await entered.wait()
            mover.run = real
            # every chunk pinned: a put that needs their room fails, a delete waits for them
            other = list(range(500, 500 + 4 * CH))
            assert await c.put(other, prefix_kv(spec, other)) == 0
            await c.delete(toks)
            assert await _pins(c) == 4
            gate.set()
        assert torch.equal(got["hit"].kv, prefix_kv(spec, toks))
        assert await _pins(c) == 0
        assert (await c.stats())["tiers"]["host"]["bytes_used"] == 0


async def _cancel_get(c: mc.Cache, toks: np.ndarray, turns: int | None) -> None:
    """A get cancelled after ``turns`` turns of the loop, or (None) once its copy started."""
    moves = c._engine.mover.moves
    with anyio.CancelScope() as scope:
        async def cancel_soon() -> None:
            if turns is None:
                while c._engine.mover.moves == moves:
                    await anyio.lowlevel.checkpoint()
            else:
                for _ in range(turns):
                    await anyio.lowlevel.checkpoint()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            await c.get(toks)
            pytest.fail("the get was not cancelled")
    assert scope.cancelled_caught


async def test_a_cancelled_long_get_lets_go_of_every_pin():
    spec = mc.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    n = 700  # several runs of pins, each a turn of the loop
    toks = np.arange(n * CH, dtype=np.int32)
    async with mc.Cache(host_config(spec, chunks=n, inline_copy_bytes=0)) as c:
        kv = torch.arange(int(np.prod(spec.shape(n * CH))), dtype=torch.int16).view(
            spec.shape(n * CH)).view(spec.dtype)
        await c.put(toks, kv)
        for turns in (1, 2, 3, 4, 5, 6, None):
            await _cancel_get(c, toks, turns)
            assert await _pins(c) == 0, turns
        hit = await c.get(toks)  # and the cache still serves it whole
        assert hit.num_tokens == n * CH and hit.kv.view(torch.int16).equal(kv.view(torch.int16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), dim=st.sampled_from([1, 4, 8]),
       mla=st.booleans(), chunks=st.integers(2, 9), extra=st.integers(0, CH - 1),
       cut=st.integers(0, 3 * CH), layout=st.integers(0, 5),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.int8]))
def test_by_address_matches_the_general_path(layers, heads, dim, mla, chunks, extra, cut,
                                             layout, dtype):
    spec = mc.KVSpec(num_layers=layers, num_kv_heads=1 if mla else heads, head_dim=dim,
                     dtype=dtype, mla=mla)
    toks = list(range(7, 7 + chunks * CH + extra))
    ask = toks[: max(1, len(toks) - cut)]
    kv = prefix_kv(spec, toks) if dtype != torch.int8 else (
        torch.arange(int(np.prod(spec.shape(len(toks))))) % 127).to(torch.int8).view(
            spec.shape(len(toks)))

    async def run() -> tuple[list[torch.Tensor], list[mc.Hit]]:
        outs = list(_outs(spec, len(ask)).values())
        out = outs[layout % len(outs)].fill_(0)
        async with mc.Cache(host_config(spec, chunks=chunks + 1, inline_copy_bytes=0)) as c:
            await c.put(toks, kv)
            hits = [await c.get(ask), await c.get(ask, out=out)]
            assert await _pins(c) == 0
        return [out], hits

    by_address = anyio.run(run)
    mp = pytest.MonkeyPatch()
    mp.setattr(engine_mod, "RESIDENT_MIN", 1 << 62)
    try:
        general = anyio.run(run)
    finally:
        mp.undo()
    def raw(t: torch.Tensor) -> torch.Tensor:  # bit for bit (NaN == NaN)
        return t.contiguous().view(torch.uint8)

    assert raw(by_address[0][0]).equal(raw(general[0][0]))
    for a, g in zip(by_address[1], general[1], strict=True):
        assert a.num_tokens == g.num_tokens == len(ask) and a.tiers == g.tiers
        assert raw(a.kv).equal(raw(g.kv))
    assert raw(by_address[1][1].kv).equal(raw(kv.narrow(spec.token_dim, 0, len(ask))))


@pytest.mark.parametrize("layout", ["vllm", "sglang", "vllm-mla"])
@pytest.mark.parametrize("skip", [0, 5, CH, 2 * CH + 3])
async def test_retrieve_into_host_pages_by_slot_address(layout, skip, tmp_path):
    """A retrieve into host pages takes the leading chunks the host tier holds by address,
    the rest (on disk here) the general way; holes (-1) and a skipped prefix are left as
    they were."""
    from test_store_retrieve import BS, make_pages, random_slots, read_dense

    spec = small_spec(mla=layout == "vllm-mla")
    rng = np.random.default_rng(skip)
    toks = list(range(300, 300 + 5 * CH + 6))
    n = len(toks)
    want = prefix_kv(spec, toks)
    nb = 4 * n // BS
    # the five whole chunks in host memory, the short last one on disk only
    c = await _on_disk_with_host_head(spec, str(tmp_path), toks, 5 * CH)
    try:
        pages = make_pages(spec, layout, nb)
        slots = random_slots(n, nb, random.Random(skip))
        holes = [int(i) for i in rng.choice(n, 3, replace=False)]
        slots[holes] = -1
        got = await c.retrieve(toks, pages, slots, layout=layout, skip_prefix=skip)
        assert got == n - skip
        after = read_dense(spec, layout, pages, slots.clamp(min=0))
        td = spec.token_dim
        for i in range(n):
            col = after.narrow(td, i, 1)
            if i < skip or i in holes:
                continue
            assert torch.equal(col, want.narrow(td, i, 1)), i
        await c.flush()  # (background promotions pin what they copy)
        assert await _pins(c) == 0
    finally:
        await c.aclose()
