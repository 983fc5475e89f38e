"""Configuration and entry-point edges a probe of the docs found (each raised an untyped
error, a traceback, or was accepted and failed later)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import musacache as mc
from musacache import devices
from musacache.server import ServerConfig

SPEC = mc.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)


@pytest.mark.parametrize("size", ["16i", "16ib", "8 ib", "1.5", "0.1KiB"])
def test_sizes_that_are_no_whole_byte_count_are_refused(size: str) -> None:
    with pytest.raises(mc.ConfigError, match="capacity_bytes"):
        mc.HostTier(capacity_bytes=size)


def test_fractional_sizes_of_whole_bytes_are_read() -> None:
    assert mc.HostTier(capacity_bytes="1.5KiB").capacity_bytes == 1536


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('namespace = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(mc.ConfigError, match="utf-8"):
        mc.CacheConfig.from_toml(bad)
    with pytest.raises(mc.ConfigError, match="utf-8"):
        mc.CacheConfig.from_env({"MUSACACHE_CONFIG": str(bad)})


@pytest.mark.parametrize("var", ["MUSACACHE_TIERS__0__CAPACITY",
                                 "MUSACACHE_TIERS__0__CAPACITY_BYTES"])
def test_the_environment_overrides_a_capacity_spelt_either_way(tmp_path: Path,
                                                               var: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text('namespace = "m"\n[spec]\nnum_layers = 2\nnum_kv_heads = 1\nhead_dim = 8\n'
                 '[[tiers]]\nkind = "host"\ncapacity = "1GiB"\n')
    cfg = mc.CacheConfig.from_env({"MUSACACHE_CONFIG": str(f), var: "2GiB"})
    assert cfg.tiers[0].capacity_bytes == 2 * 1024**3


@pytest.mark.parametrize("kw", [{"timeout": math.nan}, {"timeout": math.inf},
                                {"timeout": "abc"}, {"timeout": 0}, {"timeout": -1},
                                {"connect_timeout": -1}, {"connect_timeout": "x"},
                                {"connect_timeout": math.nan}])
def test_connect_refuses_timeouts_it_cannot_keep(kw: dict[str, object]) -> None:
    # A NaN bound never expired: a call to a server that answered nothing hung for good.
    with pytest.raises(mc.InvalidInputError, match="timeout"):
        mc.connect("/nonexistent.sock", spec=SPEC, namespace="m", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["gpu", "cuda0", "cuda:x", "CPU"])
def test_a_misspelt_device_is_refused_when_the_config_is_made(tmp_path: Path,
                                                              device: str) -> None:
    with pytest.raises(mc.ConfigError, match="device"):
        mc.CacheConfig(SPEC, "m", device=device)
    with pytest.raises(mc.ConfigError, match="device"):
        mc.DeviceTier(capacity_bytes="1MiB", device=device)
    # A server with one starts no more (it listened, and refused every client).
    f = tmp_path / "server.toml"
    f.write_text(f'device = "{device}"\n[[tiers]]\nkind = "host"\ncapacity = "1MiB"\n')
    with pytest.raises(mc.ConfigError, match="device"):
        ServerConfig.from_toml(f, socket_path=str(tmp_path / "s.sock"))


@pytest.mark.skipif(hasattr(torch, "musa"), reason="torch_musa is installed here")
def test_musa_without_torch_musa_says_what_is_missing() -> None:
    with pytest.raises(mc.DeviceError, match="torch_musa"):
        devices.resolve("musa:0")


async def test_a_cache_no_tier_of_which_holds_a_chunk_says_so(caplog) -> None:
    # It stored nothing, and said nothing (the property tests keep such caches: no error).
    chunk = SPEC.nbytes(16)
    cfg = mc.CacheConfig(SPEC, "m", chunk_size=16,
                         tiers=(mc.HostTier(capacity_bytes=chunk - 1),))
    with caplog.at_level("WARNING", logger="musacache"):
        async with mc.Cache(cfg) as c:
            assert await c.put(list(range(16)), torch.zeros(SPEC.shape(16))) == 0
    assert "no tier can hold a chunk" in caplog.text


def test_a_server_split_too_small_says_why(tmp_path: Path) -> None:
    f = tmp_path / "server.toml"
    f.write_text('[[tiers]]\nkind = "host"\ncapacity = 3\n')
    with pytest.raises(mc.ConfigError, match="max_caches=4"):
        ServerConfig.from_toml(f, socket_path=str(tmp_path / "s.sock"))


def test_a_memory_tier_after_a_storage_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(mc.ConfigError, match="hot to cold"):
        mc.CacheConfig(SPEC, "m", tiers=(mc.DiskTier(path=str(tmp_path), capacity_bytes="1MiB"),
                                         mc.HostTier(capacity_bytes="1MiB")))
    # Storage tiers alone are a config.
    mc.CacheConfig(SPEC, "m", tiers=(mc.DiskTier(path=str(tmp_path), capacity_bytes="1MiB"),))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "musacache", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args", [("bench", "codec", "--dtype", "float64"),
                                  ("bench", "scale", "--only", "curve", "--sizes", "abc"),
                                  ("demo", "--plot", "/nonexistent-folder/ttft.png")])
def test_bad_values_are_usage_errors_not_tracebacks(args: tuple[str, ...]) -> None:
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip()
