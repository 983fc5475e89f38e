"""The node server's config: a file with only its tiers is complete; capacity is split over
``max_caches``; bad settings are ConfigErrors naming the problem."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import musacache as mc
from musacache.server import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def test_a_tiers_only_file_is_a_complete_server_config(tmp_path):
    (tmp_path / "s.toml").write_text('[[tiers]]\nkind = "host"\ncapacity = "4GiB"\n'
                                     '[server]\nmax_caches = 8\n')
    cfg = ServerConfig.from_toml(tmp_path / "s.toml", socket_path="/run/musacache/c.sock")
    assert cfg.cache is None and cfg.max_caches == 8 and cfg.chunk_size == 256
    (host,) = cfg.shared_tiers()
    assert host.capacity_bytes == 4 * 1024**3 // 8
    one = cfg.cache_config(mc.KVSpec(2, 2, 8), "llama", 16, "t")
    assert one.namespace == "llama" and one.tenant == "t" and one.chunk_size == 16


def test_the_deployment_guide_example_loads(tmp_path):
    text = (ROOT / "docs/deployment.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "s.toml").write_text(toml)
    cfg = ServerConfig.from_toml(tmp_path / "s.toml", socket_path="/run/musacache/c.sock")
    assert cfg.max_caches == 8 and cfg.allow_uids == (1001,)
    host, disk = cfg.shared_tiers()
    assert host.capacity_bytes == 64 * 1024**3 // 8 and disk.capacity_bytes == 1024**4 // 8


@pytest.mark.parametrize(("text", "match"), [
    ('[server]\nmax_caches = 2\n', r"\[\[tiers\]\]"),
    ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nmax_caches = 0\n', "max_caches"),
    ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nmax_caches = true\n', "max_caches"),
    ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nbogus = 1\n', "bogus"),
    ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nallow_uids = 5\n', "allow_uids"),
    ('namespace = "x"\n[[tiers]]\nkind = "host"\ncapacity = 1024\n', r"\[spec\]"),
    ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nready_timeout = -1\n',
     "ready_timeout"),
])
def test_bad_server_configs_name_the_problem(tmp_path, text, match):
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(mc.ConfigError, match=match):
        ServerConfig.from_toml(tmp_path / "s.toml", socket_path="/run/musacache/c.sock")


def test_a_storage_tier_instance_backs_one_cache_only(tmp_path):
    class Plugin(mc.StorageTier):  # an instance holds its own state
        name = "plugin"

        async def start(self, ctx):  # pragma: no cover - never started here
            return []

        async def read(self, meta):  # pragma: no cover
            return b""

        async def write(self, meta, data):  # pragma: no cover
            return None

        async def delete(self, key):  # pragma: no cover
            return None

        async def aclose(self):  # pragma: no cover
            return None

    tiers = (mc.HostTier(1 << 20), Plugin())
    with pytest.raises(mc.ConfigError, match="one cache only"):
        ServerConfig("/run/musacache/c.sock", tiers=tiers, max_caches=2)
    assert ServerConfig("/run/musacache/c.sock", tiers=tiers, max_caches=1).max_caches == 1


# (max_caches is left out: 0 in the constructor means "the default", and the file's
# max_caches = 0 is refused by the test above.)
@pytest.mark.parametrize("name", ["max_connections", "max_requests_per_peer",
                                  "max_fds_per_peer", "max_buffers_per_peer",
                                  "max_stage_bytes", "max_frame_size"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_every_per_peer_and_server_limit_must_be_a_positive_int(name, bad):
    """Each limit (max_buffers_per_peer among them: it bounds the client buffers a
    connection keeps mapped) refuses a bad value with a ConfigError that names it."""
    with pytest.raises(mc.ConfigError, match=f"{name} must be a positive int"):
        ServerConfig("/run/musacache/c.sock", tiers=(mc.HostTier(1 << 20),), **{name: bad})
