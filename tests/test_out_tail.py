"""What a read leaves past its hit: ``get(out=)`` writes ``out`` up to ``hit.num_tokens`` and
leaves every byte after it as it was; ``retrieve`` writes the slots of the tokens it returns
and no other. A seeded model check: a host tier small enough to evict into a disk tier,
concurrent puts, gets and retrieves, restarts over the same folder, and chunk files deleted or
damaged under the cache, so that a later chunk of a request reads well while an earlier one
fails."""

from __future__ import annotations

import os
import random
from pathlib import Path

import anyio
import pytest
import torch

import musacache as mc
from helpers import flip_byte, prefix_kv, small_spec

CH = 16
BS = 4  # tokens per page of the paged KV
BLOCKS = 64
SENTINEL = -12345.0


def _config(spec: mc.KVSpec, root: Path, promotion: str) -> mc.CacheConfig:
    tiers = (mc.HostTier(capacity_bytes=spec.nbytes(CH) * 3),
             mc.DiskTier(path=str(root), capacity_bytes="64MiB"))
    return mc.CacheConfig(spec, "tail", chunk_size=CH, tiers=tiers,
                          promotion=promotion)  # type: ignore[arg-type]


def _prompts(rng: random.Random) -> list[list[int]]:
    """A few prompts over two shared stems, of whole and partial chunks."""
    stems = [[rng.randrange(1000) for _ in range(CH * 4)] for _ in range(2)]
    out = []
    for _ in range(6):
        stem = rng.choice(stems)
        cut = rng.randrange(CH, len(stem) + 1)
        out.append(stem[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * CH))])
    return out


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 1024]


def _damage(root: Path, rng: random.Random) -> None:
    """Delete or damage (a byte of its header, middle or end) some of the chunk files."""
    files = _chunk_files(root)
    for p in rng.sample(files, min(len(files), rng.randrange(1, 4))):
        if rng.random() < 0.5:
            p.unlink(missing_ok=True)
        else:
            size = p.stat().st_size
            flip_byte(p, rng.choice([size // 2, size - 8, size // 4, 3 * size // 4]))


def _vllm_pages(spec: mc.KVSpec) -> list[torch.Tensor]:
    return [torch.full((2, BLOCKS, BS, spec.num_kv_heads, spec.head_dim), SENTINEL,
                       dtype=spec.dtype) for _ in range(spec.num_layers)]


def _slots(n: int, rng: random.Random) -> torch.Tensor:
    blocks = rng.sample(range(BLOCKS), -(-n // BS))
    return torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)], dtype=torch.int64)


def _paged_read(pages: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The KV at ``slots`` as ``[layers, 2, tokens, heads, dim]``."""
    b, o = slots // BS, slots % BS
    return torch.stack([p[:, b, o] for p in pages])


class _Check:
    def __init__(self, spec: mc.KVSpec) -> None:
        self.spec = spec
        self.failures: list[str] = []
        self.hits = 0
        self.partial = 0

    async def get(self, c: mc.Cache, toks: list[int]) -> None:
        out = torch.full(self.spec.shape(len(toks)), SENTINEL, dtype=self.spec.dtype)
        hit = await c.get(toks, out=out)
        n = hit.num_tokens
        self.hits += n > 0
        self.partial += 0 < n < len(toks)
        ref = prefix_kv(self.spec, toks)
        td = self.spec.token_dim
        if not torch.equal(out.narrow(td, 0, n), ref.narrow(td, 0, n)):
            self.failures.append(f"get: the {n} tokens of the hit differ from what was put")
        tail = out.narrow(td, n, len(toks) - n)
        if not bool((tail == SENTINEL).all()):
            written = int((tail != SENTINEL).any(dim=(0, 1, 3, 4)).sum())
            self.failures.append(f"get of {len(toks)} tokens hit {n} and wrote {written} "
                                 f"tokens past it")

    async def retrieve(self, c: mc.Cache, toks: list[int], rng: random.Random) -> None:
        pages = _vllm_pages(self.spec)
        slots = _slots(len(toks), rng)
        n = await c.retrieve(toks, pages, slots, layout="vllm")
        ref = prefix_kv(self.spec, toks)
        got = _paged_read(pages, slots)  # [layers, 2, tokens, heads, dim]
        if not torch.equal(got[:, :, :n], ref[:, :, :n]):
            self.failures.append(f"retrieve: the {n} tokens it wrote differ from what was put")
        if not bool((got[:, :, n:] == SENTINEL).all()):
            written = int((got[:, :, n:] != SENTINEL).any(dim=(0, 1, 3, 4)).sum())
            self.failures.append(f"retrieve of {len(toks)} tokens returned {n} and wrote "
                                 f"{written} slots past it")
        mask = torch.ones(BLOCKS * BS, dtype=torch.bool)
        mask[slots] = False
        others = torch.stack([p.reshape(2, BLOCKS * BS, -1)[:, mask] for p in pages])
        if not bool((others == SENTINEL).all()):
            self.failures.append("retrieve wrote slots it was not given")


async def _round(c: mc.Cache, check: _Check, prompts: list[list[int]], root: Path,
                 rng: random.Random) -> None:
    spec = check.spec
    ops = []
    for _ in range(18):
        toks = rng.choice(prompts)
        r = rng.random()
        if r < 0.3:
            ops.append(("put", toks))
        elif r < 0.75:
            ops.append(("get", toks))
        elif r < 0.9:
            ops.append(("retrieve", toks))
        else:
            ops.append(("damage", toks))
    seeds = [rng.randrange(1 << 30) for _ in ops]

    async def run(op: str, toks: list[int], seed: int) -> None:
        await anyio.sleep(random.Random(seed).random() * 0.002)
        if op == "put":
            await c.put(toks, prefix_kv(spec, toks))
        elif op == "get":
            await check.get(c, toks)
        elif op == "retrieve":
            await check.retrieve(c, toks, random.Random(seed))
        else:
            await c.flush()
            _damage(root, random.Random(seed))

    async with anyio.create_task_group() as tg:
        for (op, toks), seed in zip(ops, seeds, strict=True):
            tg.start_soon(run, op, toks, seed)


async def _model_check(seed: int, root: Path, promotion: str) -> _Check:
    rng = random.Random(seed)
    spec = small_spec()
    check = _Check(spec)
    prompts = _prompts(rng)
    for restart in range(3):
        async with mc.Cache(_config(spec, root, promotion)) as c:
            if restart == 0:
                for toks in prompts:
                    await c.put(toks, prefix_kv(spec, toks))
            await c.flush()
            if restart:
                _damage(root, rng)
            for _ in range(3):
                await _round(c, check, prompts, root, rng)
    return check


SEEDS = int(os.environ.get("MUSACACHE_TAIL_SEEDS", "8"))


@pytest.mark.parametrize("block", range(2))
@pytest.mark.parametrize("promotion", ["background", "sync"])
async def test_reads_leave_what_lies_past_their_hit_as_it_was(tmp_path: Path, promotion: str,
                                                              block: int) -> None:
    failed: dict[int, list[str]] = {}
    partial = 0
    for seed in range(block * SEEDS, (block + 1) * SEEDS):
        check = await _model_check(seed, tmp_path / str(seed), promotion)
        partial += check.partial
        if check.failures:
            failed[seed] = check.failures
    assert partial, "no request was cut short by a failed chunk: the check checked nothing"
    assert not failed, f"{len(failed)} of {SEEDS} seeds: " + "; ".join(
        f"seed {s}: {f[0]} ({len(f)} in all)" for s, f in sorted(failed.items())[:5])


@pytest.mark.parametrize("promotion", ["background", "sync"])
@pytest.mark.parametrize("damage", ["delete", "flip"])
async def test_get_pages_serves_every_readable_page_and_leaves_a_failed_ones_out(
        tmp_path: Path, promotion: str, damage: str) -> None:
    """A page that cannot be read is a miss whose ``outs`` keeps its bytes, and the pages
    after it are still served."""
    spec = small_spec()
    root = tmp_path / "d"
    keys = [f"p{i}" for i in range(6)]
    pages = [torch.randn(spec.nbytes(CH) // 4) for _ in keys]
    files: list[set[Path]] = []
    cfg = mc.CacheConfig(spec, "pages", chunk_size=CH, promotion=promotion,  # type: ignore[arg-type]
                         tiers=(mc.HostTier(capacity_bytes=spec.nbytes(CH) * 3),
                                mc.DiskTier(path=str(root), capacity_bytes="64MiB",
                                            write_through=True)))
    async with mc.Cache(cfg) as cache:
        for k, p in zip(keys, pages):
            assert await cache.put_pages([k], [p]) == 1
            await cache.flush()
            files.append(set(_chunk_files(root)))
    (bad,) = files[1] - files[0]  # the file of page 1 alone
    if damage == "delete":
        bad.unlink()
    else:
        flip_byte(bad, bad.stat().st_size // 2)
    async with mc.Cache(cfg) as cache:
        outs = [torch.full_like(p, SENTINEL) for p in pages]
        hit = await cache.get_pages(keys, outs)
        await cache.flush()
    assert hit == [i != 1 for i in range(len(keys))]
    assert bool((outs[1] == SENTINEL).all()), "outs[1] was written, but page 1 is a miss"
    for i in (0, 2, 3, 4, 5):
        assert torch.equal(outs[i], pages[i]), i
