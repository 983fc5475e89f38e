"""Bad input raises a typed MusaCacheError that names the problem, and changes nothing
(issue 10, item 14: each of these raised a foreign exception, or was silently accepted)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import musacache as mc
from helpers import host_config, prefix_kv, small_spec
from musacache._config import MAX_CHUNK_SIZE
from musacache._keys import as_tokens
from musacache._spec import may_overlap
from musacache.tiers import register_tier_kind, tier_kinds

SPEC_TABLE = "[spec]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 8\n"
HOST_TABLE = '[[tiers]]\nkind = "host"\ncapacity = "1MiB"\n'


def _load(tmp_path: Path, text: str) -> mc.CacheConfig:
    path = tmp_path / "cache.toml"
    path.write_text(text)
    return mc.CacheConfig.from_toml(path)


# -- tokens -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,match", [
    (torch.arange(8, device="meta"), "meta device"),
    (torch.arange(8).to_sparse(), "dense tensor"),
])
def test_meta_or_sparse_tokens_are_a_tokens_error(tokens, match):
    with pytest.raises(mc.TokensError, match=match):
        as_tokens(tokens)


async def test_meta_tokens_change_nothing_in_the_cache(spec):
    async with mc.Cache(host_config(spec)) as cache:
        with pytest.raises(mc.TokensError):
            await cache.put(torch.arange(20, device="meta"), prefix_kv(spec, torch.arange(20)))
        with pytest.raises(mc.TokensError):
            await cache.lookup(torch.arange(20).to_sparse())
        assert (await cache.stats())["chunks"] == 0


# -- dense KV and out ----------------------------------------------------------------------------


def test_meta_and_sparse_kv_are_typed_errors():
    spec = small_spec()
    with pytest.raises(mc.DeviceError, match="kv is on the meta device"):
        spec.check_dense(torch.empty(spec.shape(4), device="meta"))
    sparse = torch.zeros(spec.shape(4)).to_sparse()
    with pytest.raises(mc.InvalidInputError, match="sparse"):
        spec.check_dense(sparse)
    with pytest.raises(mc.DeviceError, match="out is on the meta device"):
        spec.check_out(torch.empty(spec.shape(4), device="meta"))


async def test_meta_or_sparse_kv_in_put_and_get_changes_nothing(spec):
    toks = torch.arange(20)
    async with mc.Cache(host_config(spec)) as cache:
        with pytest.raises(mc.DeviceError):
            await cache.put(toks, torch.empty(spec.shape(20), dtype=spec.dtype, device="meta"))
        with pytest.raises(mc.InvalidInputError):
            await cache.put(toks, prefix_kv(spec, toks).to_sparse())
        assert await cache.lookup(toks) == 0
        await cache.put(toks, prefix_kv(spec, toks))
        with pytest.raises(mc.DeviceError):
            await cache.get(toks, out=torch.empty(spec.shape(20), dtype=spec.dtype,
                                                  device="meta"))
        assert await cache.lookup(toks) == 20


def test_check_out_refuses_what_cannot_be_written_in_place():
    spec = small_spec()
    n = 4
    expanded = torch.zeros(spec.shape(1)).expand(spec.shape(n))
    with pytest.raises(mc.InvalidInputError, match="overlapping memory"):
        spec.check_out(expanded)
    base = torch.zeros(spec.num_layers * 2 * n * spec.row_elems)
    # consecutive tokens share all but one element: a sliding window over one buffer
    overlapping = base.as_strided(spec.shape(n), (2 * n * spec.row_elems, n * spec.row_elems,
                                                  1, spec.head_dim, 1))
    with pytest.raises(mc.InvalidInputError, match="overlapping memory"):
        spec.check_out(overlapping)
    with pytest.raises(mc.InvalidInputError, match="requires grad"):
        spec.check_out(torch.zeros(spec.shape(n), requires_grad=True))
    # check_dense reads: an expanded or grad-requiring *source* is fine
    assert spec.check_dense(expanded) == n
    assert spec.check_dense(torch.zeros(spec.shape(n), requires_grad=True)) == n


def test_check_out_accepts_views_of_a_tensor_of_its_own():
    spec = small_spec()
    n = 6
    assert spec.check_out(torch.empty(spec.shape(n))) == n
    # a permuted HF-style cache: (L, 2, H, T, D) storage viewed as (L, 2, T, H, D)
    hf = torch.empty(spec.num_layers, 2, spec.num_kv_heads, n, spec.head_dim)
    assert spec.check_out(hf.permute(0, 1, 3, 2, 4)) == n
    assert spec.check_out(torch.empty(spec.shape(2 * n))[:, :, ::2]) == n
    assert spec.check_out(torch.empty(spec.shape(n + 3)).narrow(2, 3, n)) == n
    assert spec.check_out(torch.empty(spec.shape(0))) == 0


def test_may_overlap():
    assert not may_overlap(torch.empty(3, 4))
    assert not may_overlap(torch.empty(3, 4).t())
    assert not may_overlap(torch.empty(1, 5).expand(1, 5))
    assert may_overlap(torch.empty(1, 5).expand(3, 5))
    assert may_overlap(torch.empty(10).as_strided((3, 4), (2, 1)))
    assert not may_overlap(torch.empty(0, 4).expand(0, 4))


# -- call arguments: prefetch(timeout=) ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["1", [1.0], 1j, math.nan, math.inf, -1.0, True])
def test_prefetch_timeouts_are_validated_by_one_function(bad):
    # The engine calls _validate.timeout before any promotion starts.
    from musacache._validate import timeout

    with pytest.raises(mc.InvalidInputError, match="prefetch timeout"):
        timeout(bad, "prefetch timeout")


# -- CacheConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    ("copy_threads", "2", "copy_threads must be an integer"),
    ("copy_threads", 1.5, "copy_threads must be an integer"),
    ("copy_threads", 0, "copy_threads must be positive"),
    ("refresh_interval", "x", "refresh_interval must be a number"),
    ("refresh_interval", math.nan, "refresh_interval must be a finite number"),
    ("refresh_interval", -1, "refresh_interval must not be negative"),
    ("tenant", 123, "tenant must be a string"),
    ("tenant", b"abc", "tenant must be a string"),
    ("tenant", "", "tenant must not be empty"),
    ("chunk_size", 2**32 + 1, f"chunk_size must be at most {MAX_CHUNK_SIZE}"),
    ("chunk_size", 128.7, "chunk_size must be an integer"),
    ("persist_on_close", "yes", "persist_on_close must be true or false"),
    ("tiers", "host", "tiers must be a sequence"),
    ("tiers", (object(),), "tiers\\[0\\] is a object"),
])
def test_bad_cache_config_values_are_config_errors(field, value, match):
    with pytest.raises(mc.ConfigError, match=match):
        mc.CacheConfig(spec=small_spec(), namespace="m", **{field: value})


def test_the_largest_chunk_size_fits_the_chunk_header(tmp_path):
    from musacache._keys import Fingerprint
    from musacache.codec import encode_chunk, read_header
    from musacache.tiers.base import ChunkMeta

    cfg = mc.CacheConfig(spec=small_spec(), namespace="m", chunk_size=MAX_CHUNK_SIZE)
    fp = Fingerprint("m", cfg.spec, cfg.chunk_size)
    kv = torch.zeros(cfg.spec.shape(1))
    meta = ChunkMeta(key=b"k" * 32, parent=b"p" * 32, num_tokens=1, raw_bytes=kv.nbytes)
    assert read_header(encode_chunk(fp, meta, kv)).chunk_size == MAX_CHUNK_SIZE


def test_memory_tiers_must_hold_something():
    for tier in (mc.HostTier, mc.DeviceTier):
        with pytest.raises(mc.ConfigError, match="capacity_bytes must be at least 1"):
            tier(capacity_bytes=0)
        with pytest.raises(mc.ConfigError, match="segment_bytes must be at least 1"):
            tier(capacity_bytes="1MiB", segment_bytes=0)
    with pytest.raises(mc.ConfigError, match="pinned must be true, false or 'auto'"):
        mc.HostTier(capacity_bytes="1MiB", pinned=1)
    with pytest.raises(mc.ConfigError, match="tier name must be a string"):
        mc.HostTier(capacity_bytes="1MiB", name=7)


def test_a_storage_tier_instance_is_its_own_config():
    from fake_store import MemStore

    store = MemStore()
    cfg = mc.CacheConfig(spec=small_spec(), namespace="m",
                         tiers=(mc.HostTier(capacity_bytes="1MiB"), store))
    assert cfg.tiers[1].build() is store
    assert isinstance(store, mc.tiers.base.TierConfig)
    assert isinstance(mc.DiskTier(path="/tmp/x", capacity_bytes=1), mc.tiers.base.TierConfig)
    assert not isinstance(mc.HostTier(capacity_bytes=1), mc.tiers.base.TierConfig)


# -- KVSpec --------------------------------------------------------------------------------------


@pytest.mark.parametrize("table,match", [
    ({"num_layers": "4", "num_kv_heads": 1, "head_dim": 8}, "num_layers must be an integer"),
    ({"num_layers": 4.0, "num_kv_heads": 1, "head_dim": 8}, "num_layers must be an integer"),
    ({"num_layers": 4, "num_kv_heads": 1, "head_dim": 8, "mla": "false"},
     "mla must be true or false"),
    ({"num_layers": 4, "num_kv_heads": 1, "head_dim": 8, "heads": 2}, "unknown setting"),
    ({"num_layers": 4, "num_kv_heads": 1}, "missing 'head_dim'"),
    ({"num_layers": 4, "num_kv_heads": 1, "head_dim": 2**40}, "head_dim must be at most"),
])
def test_kvspec_tables_are_checked_not_converted(table, match):
    with pytest.raises(mc.ConfigError, match=match):
        mc.KVSpec.from_dict(table)


def test_kvspec_round_trips_through_its_dict():
    spec = mc.KVSpec(3, 1, 16, torch.float16, mla=True)
    assert mc.KVSpec.from_dict(spec.to_dict()) == spec


def test_kvspec_has_no_unused_fingerprint():
    assert not hasattr(mc.KVSpec, "fingerprint")


# -- TOML and the environment --------------------------------------------------------------------


def test_toml_chunk_size_is_not_truncated(tmp_path):
    with pytest.raises(mc.ConfigError, match=r"chunk_size must be an integer, got 128\.7"):
        _load(tmp_path, f'namespace = "m"\nchunk_size = 128.7\n{SPEC_TABLE}{HOST_TABLE}')


def test_toml_num_layers_must_be_a_number_not_a_string(tmp_path):
    with pytest.raises(mc.ConfigError, match="num_layers must be an integer, got '4'"):
        _load(tmp_path, f'namespace = "m"\n[spec]\nnum_layers = "4"\nnum_kv_heads = 2\n'
                        f'head_dim = 8\n{HOST_TABLE}')


def test_toml_host_tier_of_zero_bytes_is_refused(tmp_path):
    with pytest.raises(mc.ConfigError, match=r"host\.capacity_bytes must be at least 1"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}[[tiers]]\nkind = "host"\ncapacity = 0\n')


def test_disk_tier_without_path_names_the_missing_setting(tmp_path):
    text = f'namespace = "m"\n{SPEC_TABLE}{HOST_TABLE}[[tiers]]\nkind = "disk"\ncapacity = "1GiB"\n'
    with pytest.raises(mc.ConfigError, match=r"tiers\[1\] \(disk\): missing required setting"
                                             r"\(s\) \['path'\]"):
        _load(tmp_path, text)
    env = {"MUSACACHE_NAMESPACE": "m", "MUSACACHE_SPEC__NUM_LAYERS": "2",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "2", "MUSACACHE_SPEC__HEAD_DIM": "8",
           "MUSACACHE_TIERS__0__KIND": "disk", "MUSACACHE_TIERS__0__CAPACITY": "1GiB"}
    with pytest.raises(mc.ConfigError, match=r"missing required setting\(s\) \['path'\]"):
        mc.CacheConfig.from_env(env)


def test_a_file_without_tiers_is_refused_not_given_4_gib(tmp_path):
    with pytest.raises(mc.ConfigError, match=r"names no tiers: add one \[\[tiers\]\] table"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}')
    # a misspelt table name is an unknown setting, not a silent default
    with pytest.raises(mc.ConfigError, match="names no tiers"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}[[tier]]\nkind = "host"\ncapacity = 1\n')
    env = {"MUSACACHE_NAMESPACE": "m", "MUSACACHE_SPEC__NUM_LAYERS": "2",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "2", "MUSACACHE_SPEC__HEAD_DIM": "8"}
    with pytest.raises(mc.ConfigError, match="names no tiers"):
        mc.CacheConfig.from_env(env)


def test_a_tier_without_kind(tmp_path):
    with pytest.raises(mc.ConfigError, match=r"tiers\[0\] has no kind"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}[[tiers]]\ncapacity = 1\n')


def test_env_names_stay_strings():
    env = {"MUSACACHE_NAMESPACE": "2024", "MUSACACHE_TENANT": "123",
           "MUSACACHE_SPEC__NUM_LAYERS": "2", "MUSACACHE_SPEC__NUM_KV_HEADS": "2",
           "MUSACACHE_SPEC__HEAD_DIM": "8", "MUSACACHE_TIERS__0__KIND": "host",
           "MUSACACHE_TIERS__0__CAPACITY": "1MiB", "MUSACACHE_TIERS__0__NAME": "7"}
    cfg = mc.CacheConfig.from_env(env)
    assert (cfg.namespace, cfg.tenant, cfg.tiers[0].name) == ("2024", "123", "7")


def test_a_plug_in_kind_is_built_from_toml(tmp_path, monkeypatch):
    import musacache.tiers

    monkeypatch.setattr(musacache.tiers, "_registered", dict(musacache.tiers._registered))
    from fake_store import MemStore

    @dataclasses.dataclass(frozen=True)
    class FakeTier:
        latency: float = 0.0
        name: str = "fake"

        def build(self) -> MemStore:
            return MemStore()

    register_tier_kind("fake-for-test", FakeTier)
    assert "fake-for-test" in tier_kinds()
    cfg = _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}{HOST_TABLE}'
                          '[[tiers]]\nkind = "fake-for-test"\nlatency = 0.5\n')
    assert cfg.tiers[1] == FakeTier(latency=0.5)
    with pytest.raises(mc.ConfigError, match="unknown setting"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}{HOST_TABLE}'
                        '[[tiers]]\nkind = "fake-for-test"\ncolour = "red"\n')
    with pytest.raises(mc.ConfigError, match="unknown tier kind 'floppy'"):
        _load(tmp_path, f'namespace = "m"\n{SPEC_TABLE}[[tiers]]\nkind = "floppy"\n')


# -- the cache's own calls: checked before any work starts ------------------------------------


async def test_get_into_an_out_it_cannot_write_is_refused_and_writes_nothing(spec):
    toks = torch.arange(40)
    async with mc.Cache(host_config(spec)) as cache:
        await cache.put(toks, prefix_kv(spec, toks))
        shape = spec.shape(len(toks))
        expanded = torch.zeros((1,) * len(shape), dtype=spec.dtype).expand(shape)
        with pytest.raises(mc.InvalidInputError, match="overlapping"):
            await cache.get(toks, out=expanded)
        assert int(expanded.abs().sum()) == 0
        grad_out = torch.zeros(shape, dtype=spec.dtype, requires_grad=True)
        with pytest.raises(mc.InvalidInputError, match="requires grad"):
            await cache.get(toks, out=grad_out)
        assert int(grad_out.detach().abs().sum()) == 0


@pytest.mark.parametrize("bad", ["1", [1], 1j, math.nan, -1.0, math.inf])
async def test_a_bad_prefetch_timeout_starts_no_promotion(tmp_path, bad):
    spec = small_spec()
    disk = mc.DiskTier(path=str(tmp_path / "d"), capacity_bytes="16MiB", write_through=True)
    config = mc.CacheConfig(spec=spec, namespace="t", chunk_size=16,
                            tiers=(mc.HostTier(capacity_bytes=spec.nbytes(16)), disk))
    toks = torch.arange(64)
    async with mc.Cache(config) as cache:
        await cache.put(toks, prefix_kv(spec, toks))
        await cache.flush()
        async def promotions() -> tuple[int, dict[str, object]]:
            st = await cache.stats()
            return st["in_flight"]["promotions"], st["tiers"]["host"]

        before = await promotions()
        with pytest.raises(mc.InvalidInputError, match="prefetch timeout"):
            await cache.prefetch(toks, timeout=bad)
        assert await promotions() == before


@pytest.mark.parametrize("bad", ["1", math.nan, -2])
async def test_a_bad_ready_timeout_is_refused_before_the_pages_are_read(spec, bad):
    caches = [torch.zeros(2, 4, 16, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)
              for _ in range(spec.num_layers)]
    toks = torch.arange(20)
    async with mc.Cache(host_config(spec)) as cache:
        with pytest.raises(mc.InvalidInputError, match="ready_timeout"):
            await cache.store(toks, caches, torch.arange(20), ready_timeout=bad)
        assert await cache.lookup(toks) == 0


async def test_store_from_meta_caches_is_a_typed_error(spec):
    caches = [torch.empty(2, 4, 16, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                          device="meta") for _ in range(spec.num_layers)]
    toks = torch.arange(20)
    async with mc.Cache(host_config(spec)) as cache:
        with pytest.raises(mc.MusaCacheError):
            await cache.store(toks, caches, torch.arange(20))
        assert await cache.lookup(toks) == 0


@pytest.mark.parametrize("which", ["tokens", "slot_mapping"])
@pytest.mark.parametrize("op", ["store", "retrieve"])
async def test_meta_tokens_or_slots_in_store_and_retrieve_are_typed_and_change_nothing(
        spec, op, which):
    # Found by a probe: both raised torch's NotImplementedError ("Cannot copy out of meta
    # tensor") from the copy to the host, where put and get said TokensError.
    caches = [torch.randn(2, 4, 16, spec.num_kv_heads, spec.head_dim).to(spec.dtype)
              for _ in range(spec.num_layers)]
    before = [c.clone() for c in caches]
    toks, slots = torch.arange(20), torch.arange(20)
    meta = torch.zeros(20, dtype=torch.int64, device="meta")
    args = (meta, slots) if which == "tokens" else (toks, meta)
    error = mc.TokensError if which == "tokens" else mc.DeviceError
    async with mc.Cache(host_config(spec)) as cache:
        if op == "retrieve":
            await cache.put(toks, prefix_kv(spec, toks))
        with pytest.raises(error, match="meta device"):
            await getattr(cache, op)(args[0], caches, args[1])
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
        assert await cache.lookup(toks) == (20 if op == "retrieve" else 0)


async def test_a_put_of_kv_that_requires_grad_caches_its_values(spec):
    # A prefill run with grad on hands over such KV. Found by a probe: the put raised
    # autograd's RuntimeError from the copy into a slot, after it had evicted other chunks
    # to make room for it.
    toks, other = torch.arange(32), torch.arange(100, 132)
    async with mc.Cache(host_config(spec, chunks=4)) as cache:
        await cache.put(toks, prefix_kv(spec, toks))
        kv = prefix_kv(spec, other).requires_grad_(spec.dtype.is_floating_point)
        assert kv.requires_grad
        assert await cache.put(other, kv) == 32
        hit = await cache.get(other)
        assert hit.num_tokens == 32 and not hit.kv.requires_grad
        assert torch.equal(hit.kv, kv.detach())
        assert await cache.lookup(toks) == 32  # room for both: nothing was evicted
