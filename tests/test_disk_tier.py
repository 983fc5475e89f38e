"""The disk storage tier: atomic files, restart rebuild, and clean-up of damaged files."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import anyio
import pytest
import torch

from musacache._errors import ConfigError, TierError
from musacache._keys import Fingerprint
from musacache._spec import KVSpec
from musacache.codec import HEADER_SIZE, decode_chunk, encode_chunk
from musacache.tiers.base import ChunkMeta, StorageTier, TierContext
from musacache.tiers.disk import DiskStore, DiskTier, file_name

SPEC = KVSpec(2, 2, 16, torch.bfloat16)
FP = Fingerprint("disk-test", SPEC, 16)
CTX = TierContext(FP)


def _key(tag: str) -> bytes:
    return hashlib.blake2b(tag.encode(), digest_size=32).digest()


def _chunk(i: int, tokens: int = 16, fp: Fingerprint = FP) -> tuple[ChunkMeta, bytes]:
    meta = ChunkMeta(_key(f"k{i}"), _key(f"k{i - 1}"), tokens, fp.spec.nbytes(tokens))
    data = torch.randn(fp.spec.shape(tokens), generator=torch.Generator().manual_seed(i))
    return meta, encode_chunk(fp, meta, data.to(fp.spec.dtype))


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    return DiskTier(path=str(tmp_path / "cold"), capacity_bytes="64MiB")


# -- config --------------------------------------------------------------------------------------


def test_config_fields_and_build(tier: DiskTier) -> None:
    assert tier.capacity_bytes == 64 * 1024**2
    store = tier.build()
    assert isinstance(store, StorageTier) and isinstance(store, DiskStore)
    assert (store.name, store.capacity_bytes, store.codec, store.write_through,
            store.timeout, store.max_concurrency, store.shared) == (
        "disk", 64 * 1024**2, "lz4", False, 10.0, 4, False)


@pytest.mark.parametrize("kwargs", [
    {"capacity_bytes": -1},
    {"capacity_bytes": "-5GiB"},
    {"capacity_bytes": "lots"},
    {"codec": "zstd"},
    {"timeout": 0},
    {"timeout": "soon"},
    {"max_concurrency": 0},
    {"max_concurrency": 1.5},
    {"write_through": "yes"},
    {"fsync": 1},
    {"path": ""},
])
def test_config_rejects(tmp_path: Path, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"path": str(tmp_path), "capacity_bytes": 1024, **kwargs}
    with pytest.raises(ConfigError):
        DiskTier(**args)


# -- chunk I/O -----------------------------------------------------------------------------------


async def test_write_read_delete(tier: DiskTier) -> None:
    store = tier.build()
    assert await store.start(CTX) == []
    meta, obj = _chunk(1)
    await store.write(meta, obj)
    got = await store.read(meta)
    assert got == obj
    assert decode_chunk(FP, got, expect=meta)[0].key == meta.key
    path = store.root / meta.key[:1].hex() / file_name(meta.key, meta.parent, 16)
    assert path.is_file() and path.stat().st_size == len(obj)
    assert await store.read(_chunk(2)[0]) is None
    await store.delete(meta.key)
    assert await store.read(meta) is None
    await store.delete(meta.key)  # absent: not an error
    stats = store.stats()
    assert (stats["writes"], stats["reads"], stats["read_misses"], stats["bytes_in"]) == (
        1, 1, 2, len(obj))
    await store.aclose()


async def test_a_rewrite_replaces_the_file(tier: DiskTier) -> None:
    # Issue 10 item 1: a key re-put after a delete may carry new KV. A file of the same size
    # under the name is not proof that it holds the newer bytes: the write must replace it.
    store = tier.build()
    await store.start(CTX)
    meta, _ = _chunk(1)
    old, new = (encode_chunk(FP, meta, torch.full(SPEC.shape(16), v, dtype=SPEC.dtype), "raw")
                for v in (1.0, 2.0))
    assert len(old) == len(new) and old != new
    await store.write(meta, old)
    await store.write(meta, new)
    assert store.stats()["writes"] == 2
    assert await store.read(meta) == new
    await store.aclose()


async def test_fsync_policy_writes_the_same(tmp_path: Path) -> None:
    store = DiskTier(path=str(tmp_path), capacity_bytes=1 << 20, fsync=True).build()
    await store.start(CTX)
    meta, obj = _chunk(3)
    await store.write(meta, obj)
    assert await store.read(meta) == obj
    await store.aclose()


async def test_write_is_atomic(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tier.build()
    await store.start(CTX)
    meta, obj = _chunk(1)
    final = store.root / meta.key[:1].hex() / file_name(meta.key, meta.parent, 16)
    seen: list[tuple[bool, int]] = []
    real_replace = os.replace

    def spy_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # At the moment of the rename the final name is still absent and the temp file is
        # complete: a reader sees either nothing or the whole object.
        seen.append((Path(dst).exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)
    await store.write(meta, obj)
    assert seen == [(False, len(obj))]

    def failing_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    meta2, obj2 = _chunk(2)
    with pytest.raises(TierError, match="No space left"):
        await store.write(meta2, obj2)
    # The failed write left neither a final file nor its temp file behind.
    assert [p.name for p in _files(store.root)] == [final.name]
    assert store.stats()["write_failures"] == 1
    await store.aclose()


# -- restart -------------------------------------------------------------------------------------


async def test_restart_rebuilds_the_directory(tier: DiskTier) -> None:
    store = tier.build()
    await store.start(CTX)
    chunks = [_chunk(i) for i in range(6)] + [_chunk(100, tokens=5)]
    for meta, obj in chunks:
        await store.write(meta, obj)
    await store.aclose()

    again = tier.build()
    metas = {m.key: m for m in await again.start(CTX)}
    assert set(metas) == {m.key for m, _ in chunks}
    for meta, obj in chunks:
        got = metas[meta.key]
        assert (got.parent, got.num_tokens, got.raw_bytes, got.stored_bytes) == (
            meta.parent, meta.num_tokens, meta.raw_bytes, len(obj))
        assert abs(got.last_used - time.time()) < 120
        assert await again.read(got) == obj
    await again.aclose()


async def test_last_used_follows_reads(tier: DiskTier) -> None:
    store = tier.build()
    await store.start(CTX)
    (m_old, o_old), (m_new, o_new) = _chunk(1), _chunk(2)
    for meta, obj in ((m_old, o_old), (m_new, o_new)):
        await store.write(meta, obj)
        path = store.root / meta.key[:1].hex() / file_name(meta.key, meta.parent, 16)
        os.utime(path, (1_000_000, 1_000_000))
    await store.read(m_old)  # the older write is now the more recently used
    await store.aclose()
    again = tier.build()
    metas = {m.key: m for m in await again.start(CTX)}
    assert metas[m_new.key].last_used == 1_000_000
    assert metas[m_old.key].last_used > time.time() - 120
    await again.aclose()


async def test_start_removes_damaged_files(tier: DiskTier) -> None:
    store = tier.build()
    await store.start(CTX)
    chunks = [_chunk(i) for i in range(6)]
    for meta, obj in chunks:
        await store.write(meta, obj)
    root = store.root
    await store.aclose()

    def path_of(meta: ChunkMeta) -> Path:
        return root / meta.key[:1].hex() / file_name(meta.key, meta.parent, meta.num_tokens)

    good, flipped, truncated, padded, renamed, foreign = (m for m, _ in chunks)
    raw = bytearray(path_of(flipped).read_bytes())
    raw[40] ^= 0xFF  # a header byte: caught by the header checksum
    path_of(flipped).write_bytes(raw)
    path_of(truncated).write_bytes(path_of(truncated).read_bytes()[:-10])
    path_of(padded).write_bytes(path_of(padded).read_bytes() + b"extra")
    # A valid object under a name that claims another key.
    wrong = ChunkMeta(_key("not-it"), renamed.parent, 16, renamed.raw_bytes)
    path_of(wrong).parent.mkdir(exist_ok=True)
    path_of(renamed).rename(path_of(wrong))
    # An object of another model, under a name that fits this folder.
    other_fp = Fingerprint("someone-else", SPEC, 16)
    path_of(foreign).write_bytes(_chunk(5, fp=other_fp)[1])
    # A crashed write, a half header, and a file that is not ours at all.
    (path_of(good).parent / f".{path_of(good).name}.dead.tmp").write_bytes(b"partial")
    half = _chunk(50)[0]
    path_of(half).parent.mkdir(exist_ok=True)
    path_of(half).write_bytes(path_of(good).read_bytes()[: HEADER_SIZE // 2])
    keep = path_of(good).parent / "notes.txt"
    keep.write_text("not a chunk")

    again = tier.build()
    metas = await again.start(CTX)
    assert [m.key for m in metas] == [good.key]
    remaining = {p.name for p in _files(root)}
    assert remaining == {path_of(good).name, "notes.txt"}
    stats = again.stats()
    assert stats["removed_corrupt"] == 6  # flipped, truncated, padded, renamed, foreign, half
    assert stats["removed_temp"] == 1
    assert stats["ignored_files"] == 1
    await again.aclose()


async def test_one_cache_per_folder(tier: DiskTier) -> None:
    first = tier.build()
    await first.start(CTX)
    second = tier.build()
    with pytest.raises(TierError, match="in use"):
        await second.start(CTX)
    # Another fingerprint is another folder: no conflict.
    other = tier.build()
    await other.start(TierContext(Fingerprint("other", SPEC, 16)))
    await other.aclose()
    await first.aclose()
    await second.start(CTX)
    await second.aclose()


# -- faults --------------------------------------------------------------------------------------


async def test_faults_are_tier_errors(tier: DiskTier) -> None:
    store = tier.build()
    await store.start(CTX)
    meta, _ = _chunk(1)
    # A directory where the chunk file should be: reading it is a fault, not a miss.
    final = store.root / meta.key[:1].hex() / file_name(meta.key, meta.parent, 16)
    final.mkdir(parents=True)
    with pytest.raises(TierError):
        await store.read(meta)
    assert store.stats()["read_faults"] == 1
    # A file where the fan-out folder should be: writing is a fault.
    meta2, obj2 = next(c for c in map(_chunk, range(2, 50)) if c[0].key[0] != meta.key[0])
    (store.root / meta2.key[:1].hex()).write_bytes(b"")
    with pytest.raises(TierError):
        await store.write(meta2, obj2)
    assert store.stats()["write_failures"] == 1
    with pytest.raises(TierError, match="not started"):
        await tier.build().read(meta)
    await store.aclose()


async def test_slow_read_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskTier(path=str(tmp_path), capacity_bytes=1 << 20, timeout=0.3).build()
    await store.start(CTX)
    meta, obj = _chunk(1)
    await store.write(meta, obj)

    def hung_read(path: Path) -> bytes:
        time.sleep(1.0)  # a stuck network file system
        return b""

    monkeypatch.setattr(DiskStore, "_read_regular", staticmethod(hung_read))
    start = time.monotonic()
    with pytest.raises(TierError, match="took over"):
        await store.read(meta)
    assert time.monotonic() - start < 1.0
    await store.aclose()
    await anyio.sleep(0.8)  # let the abandoned worker finish before the loop closes


def test_config_from_toml(tmp_path: Path) -> None:
    from musacache._config import CacheConfig

    toml = tmp_path / "cache.toml"
    toml.write_text(f"""
namespace = "m"
[spec]
num_layers = 2
num_kv_heads = 2
head_dim = 16
[[tiers]]
kind = "host"
capacity_bytes = "1MiB"
[[tiers]]
kind = "disk"
path = "{tmp_path / 'cold'}"
capacity_bytes = "2GiB"
codec = "raw"
fsync = true
""")
    tier = CacheConfig.from_toml(toml).tiers[1]
    assert isinstance(tier, DiskTier)
    assert (tier.capacity_bytes, tier.codec, tier.fsync, tier.name) == (
        2 * 1024**3, "raw", True, "disk")
