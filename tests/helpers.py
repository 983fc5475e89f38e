"""Helpers shared by the tests (imported as ``from helpers import ...``)."""

from __future__ import annotations

import asyncio
import os
import threading
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import musacache as mc

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_service(available: bool, what: str) -> None:
    """Skip locally, fail in CI, when a service a test needs is missing."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available")
    pytest.skip(f"{what} is not available", allow_module_level=True)


def need_module(name: str) -> None:
    """Skip locally, fail in CI, when an optional dependency a test needs is missing."""
    import importlib.util

    need_service(importlib.util.find_spec(name) is not None, f"the {name} package")


def small_spec(mla: bool = False, dtype: torch.dtype = torch.float32) -> mc.KVSpec:
    return mc.KVSpec(num_layers=2, num_kv_heads=1 if mla else 2, head_dim=8, dtype=dtype, mla=mla)


def prefix_kv(spec: mc.KVSpec, tokens: torch.Tensor | list[int]) -> torch.Tensor:
    """Deterministic KV for a token sequence where position j depends only on tokens[:j+1]
    (like a causal model), so two prompts that share a prefix share its KV exactly."""
    toks = torch.as_tensor(tokens, dtype=torch.int64)
    ph = torch.empty(len(toks), dtype=torch.int64)
    acc = 7
    for j, t in enumerate(toks.tolist()):
        acc = (acc * 1000003 + t + 1) % 8388593
        ph[j] = acc
    shape = spec.shape(len(toks))
    if spec.mla:
        base = ph.view(1, -1, 1)
        offs = (torch.arange(shape[0]).view(-1, 1, 1) * 7 + torch.arange(shape[2]).view(1, 1, -1) * 13)
    else:
        base = ph.view(1, 1, -1, 1, 1)
        offs = (torch.arange(shape[0]).view(-1, 1, 1, 1, 1) * 7
                + torch.arange(2).view(1, -1, 1, 1, 1) * 3
                + torch.arange(shape[3]).view(1, 1, 1, -1, 1) * 11
                + torch.arange(shape[4]).view(1, 1, 1, 1, -1) * 13)
    # Values stay below 2**24 so they are exact in float32 (and distinct in bf16 often enough).
    return ((base + offs) % 16777213).to(spec.dtype)


def host_config(spec: mc.KVSpec, chunks: int = 64, chunk_size: int = 16, **kw: object) -> mc.CacheConfig:
    tiers = kw.pop("tiers", None) or (mc.HostTier(capacity_bytes=spec.nbytes(chunk_size) * chunks),)
    return mc.CacheConfig(spec=spec, namespace=str(kw.pop("namespace", "test-model")),
                          tiers=tiers, chunk_size=chunk_size, **kw)  # type: ignore[arg-type]


async def on_every_turn(op: Callable[[], Awaitable[object]],
                        turn: Callable[[], Awaitable[None] | None]) -> None:
    """Run ``op`` while a task that yields at every turn of the loop calls ``turn()`` once
    before the first turn and after each (and awaits it, if it is a coroutine function)."""
    running = True

    async def call() -> None:
        got = turn()
        if got is not None:
            await got

    async def turns() -> None:
        await call()
        while running:
            await asyncio.sleep(0)
            await call()

    task = asyncio.create_task(turns())
    await asyncio.sleep(0)
    try:
        await op()
    finally:
        running = False
        await task


async def stats_per_turn(cache: mc.Cache, op: Callable[[], Awaitable[object]],
                         ) -> list[dict[str, Any]]:
    """``cache.stats()`` before the first turn of the loop and after each while ``op`` runs:
    what the cache shows changing in one turn."""
    seen: list[dict[str, Any]] = []

    async def sample() -> None:
        seen.append(await cache.stats())

    await on_every_turn(op, sample)
    return seen


async def most_per_turn(op: Callable[[], Awaitable[object]], reading: Callable[[], int]) -> int:
    """The most ``reading()`` fell across one turn of the loop while ``op`` ran."""
    last: list[int] = []
    most = 0

    def turn() -> None:
        nonlocal most
        now = reading()
        if last:
            most = max(most, last[0] - now)
        last[:] = [now]

    await on_every_turn(op, turn)
    return most


class StepMemory:
    """The most memory one turn of the loop allocated beyond what it started with, and the
    most it freed, while ``op`` runs (a task that yields at every turn measures each)."""

    def __init__(self) -> None:
        self.grew = 0
        self.shrank = 0
        self.turns = 0

    async def measure(self, op: Callable[[], Awaitable[object]]) -> None:
        start: list[int] = []

        def turn() -> None:
            cur, peak = tracemalloc.get_traced_memory()
            if start:
                self.grew = max(self.grew, peak - start[0])
                self.shrank = max(self.shrank, start[0] - cur)
                self.turns += 1
            start[:] = [cur]
            tracemalloc.reset_peak()

        tracemalloc.start()
        try:
            await on_every_turn(op, turn)
        finally:
            tracemalloc.stop()


def random_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids, the same for the same seed."""
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(0, 50_000, n)]


async def on_disk_only(cache: mc.Cache) -> None:
    """Every chunk of ``cache`` evicted from its top (host) tier to storage, once any
    promotion still running has finished."""
    eng = cache._engine
    await cache.flush()
    await eng.evict(eng.mem[0], len(eng.mem[0].lru))
    await cache.flush()


def flip_byte(path: str | os.PathLike[str], at: int) -> None:
    """Flip a bit of byte ``at`` of the file ``path`` (negative: from its end)."""
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    raw[at] ^= 0x40
    with open(path, "wb") as fh:
        fh.write(raw)


def slow_and_backup_disks(spec: mc.KVSpec, root: Any, chunk_size: int,
                          **config: Any) -> mc.CacheConfig:
    """A host tier over two raw disks under ``root``: ``slow`` (``root/d1``, a 0.2 s read
    timeout) and ``backup`` (``root/d2``, written through), so every chunk is on both."""
    slow = mc.DiskTier(path=os.path.join(root, "d1"), capacity_bytes="64MiB", codec="raw",
                       timeout=0.2, name="slow")
    backup = mc.DiskTier(path=os.path.join(root, "d2"), capacity_bytes="64MiB", codec="raw",
                         name="backup", write_through=True)
    return mc.CacheConfig(spec, "two-disks", chunk_size=chunk_size, tiers=(
        mc.HostTier(capacity_bytes=spec.nbytes(chunk_size) * 4), slow, backup), **config)


async def until_set(flag: threading.Event, timeout: float = 30) -> None:
    """Wait (polling, without blocking the loop) until a worker thread sets ``flag``."""
    with anyio.fail_after(timeout):
        while not flag.is_set():  # noqa: ASYNC110
            await anyio.sleep(0.01)


def hang_direct_reads(monkeypatch: pytest.MonkeyPatch, *, under: Path | None = None,
                      ) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Make the disk tier's direct reads (of files under ``under``, or all) wait for
    ``release`` before reading; returns ``(started, release, returned)``."""
    from musacache.tiers import disk as disk_mod

    started, release, returned = threading.Event(), threading.Event(), threading.Event()
    read = disk_mod.read_chunk_to

    def hung(fp: Any, fd: int, size: int, copy: Any, **kw: Any) -> Any:
        if under is not None and not os.readlink(f"/proc/self/fd/{fd}").startswith(str(under)):
            return read(fp, fd, size, copy, **kw)
        started.set()
        release.wait(30)
        try:
            return read(fp, fd, size, copy, **kw)
        finally:
            returned.set()

    monkeypatch.setattr(disk_mod, "read_chunk_to", hung)
    return started, release, returned
