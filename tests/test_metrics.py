"""Prometheus metrics (docs/metrics.md): an embedded cache exported into a registry of the
caller's, `musacache serve --metrics` scraped over HTTP, and the doc true to the code."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")  # the test extra installs it
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import musacache as mc  # noqa: E402
from helpers import host_config, prefix_kv, small_spec  # noqa: E402
from musacache import cli, metrics  # noqa: E402
from musacache.metrics.names import CACHE_METRICS, SERVER_METRICS  # noqa: E402
from server_utils import write_config, write_tiers_config  # noqa: E402

CH = 16
DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


async def test_an_embedded_cache_exports_into_the_callers_registry():
    spec = small_spec()
    registry = CollectorRegistry()
    cfg = host_config(spec, chunks=4, chunk_size=CH, namespace="emb", tenant="acme")
    async with mc.Cache(cfg) as cache:
        assert cache._latency is None  # nothing timed until something exports
        metrics.register(cache, registry)
        lab = {"namespace": "emb", "tenant": mc._keys.tenant_tag("acme")}
        tier = {**lab, "tier": cache._mem[0].name}
        a = seq(0, 2 * CH)
        assert await cache.put(a, prefix_kv(spec, a)) == 2 * CH
        assert (await cache.get(a)).num_tokens == 2 * CH
        assert (await cache.get(seq(5000, CH))).num_tokens == 0
        assert await cache.lookup(a) == 2 * CH
        assert value(registry, "musacache_hit_tokens_total", **lab) == 2 * CH
        assert value(registry, "musacache_miss_tokens_total", **lab) == CH
        assert value(registry, "musacache_tier_chunks", **tier) == 2
        assert value(registry, "musacache_tier_used_bytes", **tier) == 2 * spec.nbytes(CH)
        assert value(registry, "musacache_tier_capacity_bytes", **tier) == 4 * spec.nbytes(CH)
        assert value(registry, "musacache_tier_hit_chunks_total", **tier) == 2
        assert value(registry, "musacache_evictions_total", **tier) == 0
        assert value(registry, "musacache_request_duration_seconds_count",
                     **lab, op="store") is None  # never called
        for op, n in (("put", 1), ("get", 2), ("lookup", 1)):
            assert value(registry, "musacache_request_duration_seconds_count",
                         **lab, op=op) == n, op
            assert value(registry, "musacache_request_duration_seconds_bucket",
                         **lab, op=op, le="+Inf") == n, op
        b = seq(1000, 4 * CH)  # a host tier of 4 chunks: this one evicts the first prompt
        await cache.put(b, prefix_kv(spec, b))
        assert value(registry, "musacache_evictions_total", **tier) == 2
        assert value(registry, "musacache_lost_chunks_total", **tier) == 2
        assert value(registry, "musacache_tier_chunks", **tier) == 4
        assert value(registry, "musacache_request_duration_seconds_count", **lab, op="put") == 2
        assert (await cache.get(a)).num_tokens == 0
        assert value(registry, "musacache_miss_tokens_total", **lab) == 3 * CH


async def test_the_tenant_string_never_shows_and_the_default_registry_is_left_alone():
    spec = small_spec()
    before = {m.name for m in prometheus_client.REGISTRY.collect()}
    registry = CollectorRegistry()
    async with mc.Cache(host_config(spec, tenant="s3cr3t-tenant")) as cache:
        collector = metrics.register(cache, registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert "s3cr3t-tenant" not in text
        assert mc._keys.tenant_tag("s3cr3t-tenant") in text
        registry.unregister(collector)
        assert "musacache_" not in prometheus_client.generate_latest(registry).decode()
    assert {m.name for m in prometheus_client.REGISTRY.collect()} == before


async def test_storage_tiers_export_their_write_queue(tmp_path):
    spec = small_spec()
    registry = CollectorRegistry()
    tiers = (mc.HostTier(spec.nbytes(CH) * 8), mc.DiskTier(path=str(tmp_path / "d"),
                                                          capacity_bytes=1 << 20,
                                                          write_through=True))
    async with mc.Cache(host_config(spec, tiers=tiers, namespace="st")) as cache:
        metrics.register(cache, registry)
        a = seq(0, 3 * CH)
        await cache.put(a, prefix_kv(spec, a))
        await cache.flush()
        disk = {"namespace": "st", "tenant": "", "tier": cache._stores[0].name}
        assert value(registry, "musacache_write_queue_depth", **disk) == 0
        assert value(registry, "musacache_tier_chunks", **disk) == 3
        assert value(registry, "musacache_tier_written_bytes_total", **disk) > 0
        assert value(registry, "musacache_write_sheds_total", **disk) == 0
        assert value(registry, "musacache_tier_faults_total", **disk) == 0


def _documented() -> set[str]:
    return set(re.findall(r"^\| `(musacache_[a-z_]+)`", DOC.read_text(), re.M))


async def test_every_metric_emitted_is_listed_in_docs_metrics_md(tmp_path):
    spec = small_spec()
    registry = CollectorRegistry()
    tiers = (mc.HostTier(spec.nbytes(CH) * 8), mc.DiskTier(path=str(tmp_path / "d"),
                                                          capacity_bytes=1 << 20))
    async with mc.Cache(host_config(spec, tiers=tiers)) as cache:
        metrics.register(cache, registry)
        await cache.lookup(seq(0, CH))
        emitted = {m.name + "_total" if m.type == "counter" else m.name
                   for m in registry.collect() if m.samples}
    emitted |= {d.exposed for d in SERVER_METRICS}
    assert emitted >= {d.exposed for d in CACHE_METRICS}
    missing = emitted - _documented()
    assert not missing, f"emitted but not in docs/metrics.md: {sorted(missing)}"
    extra = _documented() - {d.exposed for d in CACHE_METRICS + SERVER_METRICS}
    assert not extra, f"in docs/metrics.md but never emitted: {sorted(extra)}"


def test_every_metric_follows_the_naming_conventions():
    for d in CACHE_METRICS + SERVER_METRICS:
        assert d.name.startswith("musacache_"), d.name
        assert not d.name.endswith("_total"), d.name  # the exposition adds it
        if d.kind == "histogram":
            assert d.name.endswith("_seconds"), d.name
        if "bytes" in d.name:
            assert d.name.endswith("_bytes"), d.name
        assert "tenant" not in d.labels or "namespace" in d.labels


# -- musacache serve --metrics --------------------------------------------------------------

class MetricsServer:
    """``musacache serve --metrics 127.0.0.1:0`` in a subprocess, and the URL it announced."""

    def __init__(self, tmp_path: Path, config: Path) -> None:
        self.sock = str(tmp_path / "run" / "s.sock")
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(Path(mc.__file__).parent.parent),
                                              os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "musacache", "serve", "--socket", self.sock, "--config",
             str(config), "--metrics", "127.0.0.1:0", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.url = self._announced()

    def _announced(self) -> str:
        assert self.proc.stdout is not None
        seen = b""
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 60)
            line = self.proc.stdout.readline() if ready else b""
            if not line:
                self.stop()
                raise AssertionError(f"serve never announced its metrics: {seen.decode()}")
            seen += line
            found = re.search(rb"metrics on (http://\S+/metrics)", line)
            if found:
                return found.group(1).decode()

    def scrape(self) -> dict[str, object]:
        with urllib.request.urlopen(self.url, timeout=30) as r:
            assert r.status == 200
            text = r.read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)} | {"": text}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _sample(families, family: str, name: str | None = None, **labels) -> float | None:
    for s in families[family].samples:
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


async def test_serve_metrics_is_scraped_over_http(tmp_path):
    spec = small_spec()
    cfg = write_config(tmp_path / "server.toml", spec, "srv", CH, spec.nbytes(CH) * 64)
    cfg.write_text(cfg.read_text() + "[server]\nmax_caches = 4\n")
    server = MetricsServer(tmp_path, cfg)
    try:
        before = server.scrape()
        assert _sample(before, "musacache_server_peers") == 0
        # the config's own cache is open from the start
        assert _sample(before, "musacache_server_caches") == 1
        for name, fam in before.items():
            if not name:
                continue
            assert name.startswith(("musacache_", "process_")), name
            if fam.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
            if fam.type == "histogram":
                assert name.endswith("_seconds"), name
        async with mc.connect(server.sock, spec=spec, namespace="other",
                              tenant="hidden-tenant") as client:
            toks = seq(0, 2 * CH)
            await client.put(toks, prefix_kv(spec, toks))
            assert await client.lookup(toks) == 2 * CH
            during = server.scrape()
            assert _sample(during, "musacache_server_peers") == 1
            assert _sample(during, "musacache_server_open_connections") == 1
            assert _sample(during, "musacache_server_caches") == 2
            assert _sample(during, "musacache_server_connections",
                           "musacache_server_connections_total") == 1
            tag = mc._keys.tenant_tag("hidden-tenant")
            assert "hidden-tenant" not in during[""]
            assert _sample(during, "musacache_request_duration_seconds",
                           "musacache_request_duration_seconds_count",
                           namespace="other", tenant=tag, op="lookup") == 1
            assert _sample(during, "musacache_tier_chunks", namespace="other",
                           tenant=tag) == 2
        async with mc.connect(server.sock, spec=spec, namespace="srv",
                              chunk_size=CH) as client:
            await client.lookup(seq(0, CH))
            after = server.scrape()
        assert _sample(after, "musacache_server_connections",
                       "musacache_server_connections_total") == 2
        assert _sample(after, "musacache_server_requests",
                       "musacache_server_requests_total") >= 4
    finally:
        server.stop()
    assert server.proc.returncode == 0


@pytest.mark.parametrize("bad", ["nonsense", "127.0.0.1:", ":9100", "127.0.0.1:http",
                                 "127.0.0.1:70000", "127.0.0.1:-1"])
def test_a_bad_metrics_address_is_one_line(tmp_path, capsys, bad):
    cfg = write_tiers_config(tmp_path / "s.toml", 1 << 20)
    rc = cli.main(["serve", "--socket", str(tmp_path / "s.sock"), "--config", str(cfg),
                   "--metrics", bad])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and "--metrics" in err, err
    assert not (tmp_path / "s.sock").exists()


def test_a_metrics_port_in_use_is_one_line(tmp_path, capsys):
    import socket

    cfg = write_tiers_config(tmp_path / "s.toml", 1 << 20)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = cli.main(["serve", "--socket", str(tmp_path / "s.sock"), "--config", str(cfg),
                       "--metrics", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "--metrics" in err[0] and "cannot listen" in err[0], err


def test_without_prometheus_client_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    cfg = write_tiers_config(tmp_path / "s.toml", 1 << 20)
    rc = cli.main(["serve", "--socket", str(tmp_path / "s.sock"), "--config", str(cfg),
                   "--metrics", "127.0.0.1:0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "musacache[metrics]" in err[0], err
    with pytest.raises(mc.ConfigError, match=r"musacache\[metrics\]"):
        metrics.CacheCollector(lambda: [])


def test_the_core_imports_without_prometheus_client():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import musacache, musacache.server, musacache.metrics\n"
            "assert 'prometheus_client' not in [m for m in sys.modules if sys.modules[m]]\n")
    env = {**os.environ, "PYTHONPATH": str(Path(mc.__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_untimed_cache_keeps_no_latencies():
    assert mc.Cache(host_config(small_spec()))._latency is None


def test_the_grafana_dashboard_names_only_metrics_that_exist():
    import json

    dash = json.loads((DOC.parent.parent / "examples" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    used = set(re.findall(r"musacache_[a-z_]+", exprs))
    known = {d.exposed for d in CACHE_METRICS + SERVER_METRICS}
    known |= {f"{d.exposed}_bucket" for d in CACHE_METRICS if d.kind == "histogram"}
    assert used and used <= known, sorted(used - known)
