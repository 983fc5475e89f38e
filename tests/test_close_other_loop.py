"""A cache closed from an event loop other than the one that opened it.

Opened and used under one ``asyncio.run``, closed under a second: the old loop's tasks and
connections cannot be awaited from the new one. ``aclose()`` releases what needs no loop (the
copy threads, the storage tiers' files, the memory) and raises :class:`EventLoopError`, a
:class:`MusaCacheError` that names the rule. While the cache's own loop still runs, nothing is
released, and the cache can still be closed there.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache.tiers.disk import DiskTier
from musacache.tiers.s3 import S3Tier
from s3_servers import unique_bucket

CH = 8


def _open_fds_under(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def _copy_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The cache's copy threads that are still alive, waited for a while (they end once idle)."""
    deadline = time.monotonic() + 5.0
    while True:
        left = [t for t in threading.enumerate()
                if t not in before and t.name.startswith("musacache-copy") and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _config(tmp_path: Path, moto_endpoint: str | None) -> mc.CacheConfig:
    spec = small_spec()
    tiers: list[Any] = [mc.HostTier(spec.nbytes(CH) * 2),
                        DiskTier(path=str(tmp_path / "disk"), capacity_bytes="1MiB")]
    if moto_endpoint is not None:
        tiers.append(S3Tier(bucket=unique_bucket(), endpoint_url=moto_endpoint,
                            create_bucket=True, write_through=True))
    # Every move in a copy thread, so the first loop starts them.
    return mc.CacheConfig(spec, "other-loop", chunk_size=CH, inline_copy_bytes=0,
                          tiers=tuple(tiers))


async def _fill(cache: mc.Cache, rng: random.Random) -> None:
    spec = cache.spec
    await cache.open()
    for _ in range(rng.randint(2, 6)):
        toks = [rng.randrange(1000) for _ in range(CH * rng.randint(1, 4))]
        assert await cache.put(toks, prefix_kv(spec, toks)) == len(toks)
    if rng.random() < 0.5:
        await cache.flush()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_s3", [False, True], ids=["disk", "disk+s3"])
def test_aclose_in_a_second_asyncio_run(tmp_path: Path, request: pytest.FixtureRequest,
                                        seed: int, with_s3: bool) -> None:
    endpoint = request.getfixturevalue("moto_endpoint") if with_s3 else None
    before = set(threading.enumerate())
    cache = mc.Cache(_config(tmp_path, endpoint))
    asyncio.run(_fill(cache, random.Random(seed)))
    assert _open_fds_under(tmp_path)  # the disk tier holds its folder's lock

    async def close() -> BaseException | None:
        try:
            await cache.aclose()
        except BaseException as e:  # (checked below: it must be typed)
            return e
        return None

    error = asyncio.run(close())
    left = {"threads": _copy_threads(before), "fds": _open_fds_under(tmp_path)}
    assert left == {"threads": [], "fds": []}, (left, repr(error))
    if error is not None:
        assert isinstance(error, mc.MusaCacheError), repr(error)
        assert type(error).__name__ == "EventLoopError", repr(error)
        assert "event loop that opened it" in str(error)
    assert asyncio.run(cache.stats())["state"] == "closed"
    asyncio.run(cache.aclose())  # closed: a second close is a no-op

    # The folder is free again: a new cache opens over it and closes cleanly.
    async def reopen() -> None:
        async with mc.Cache(_config(tmp_path, None)) as again:
            assert (await again.stats())["state"] == "open"

    asyncio.run(reopen())


def test_aclose_from_another_loop_while_its_own_still_runs(tmp_path: Path) -> None:
    """Nothing is released while the cache's own loop runs; it closes there afterwards."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    before = set(threading.enumerate())
    try:
        cache = mc.Cache(_config(tmp_path, None))
        asyncio.run_coroutine_threadsafe(_fill(cache, random.Random(7)), loop).result(60)

        async def close_here() -> None:
            await cache.aclose()

        with pytest.raises(mc.MusaCacheError, match="event loop that opened it") as got:
            asyncio.run(close_here())
        assert type(got.value).__name__ == "EventLoopError"
        toks = list(range(CH))
        got = asyncio.run_coroutine_threadsafe(cache.lookup(toks), loop).result(60)
        assert got == 0
        asyncio.run_coroutine_threadsafe(cache.aclose(), loop).result(60)
        assert asyncio.run_coroutine_threadsafe(cache.stats(), loop).result(60)["state"] \
            == "closed"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert _copy_threads(before) == []
    assert _open_fds_under(tmp_path) == []
