"""The node server across real processes: zero-copy store/retrieve between workers, worker and
server deaths, bad frames, and socket security."""

import asyncio
import multiprocessing as mp
import os
import random
import signal
import socket
import stat
import struct
import time

import pytest
import torch

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import ipc
from musacache.ipc import _wire as proto
from musacache.server import Server, ServerConfig
from server_utils import (
    ServerProcess,
    worker_hang_in_store,
    worker_retrieve,
    worker_store,
    write_config,
)

CH = 16
NB, BS = 64, 4  # 256 slots per worker


@pytest.fixture
def server(tmp_path):
    spec = small_spec()
    cfg = write_config(tmp_path / "server.toml", spec, "srv", CH, spec.nbytes(CH) * 256)
    sock = str(tmp_path / "run" / "musacache.sock")
    proc = ServerProcess(sock, cfg).start()
    yield proc, spec
    proc.stop()


def spawn_pool(n):
    return mp.get_context("spawn").Pool(n)


def rand_slots(rng, n):
    blocks = rng.sample(range(NB), (n + BS - 1) // BS)
    return [blocks[i // BS] * BS + i % BS for i in range(n)]


def test_worker_a_stores_worker_b_retrieves_byte_exact(server):
    proc, spec = server
    rng = random.Random(1)
    toks = [rng.randrange(30000) for _ in range(150)]
    with spawn_pool(1) as pool:
        n = pool.apply(worker_store, (proc.sock, spec.to_dict(), "srv", toks,
                                      rand_slots(rng, 150), NB, BS))
        assert n == 150
        got, ok = pool.apply(worker_retrieve, (proc.sock, spec.to_dict(), "srv", toks,
                                               rand_slots(rng, 150), NB, BS))
    assert got == 150 and ok


def test_four_workers_at_once_on_overlapping_prompts(server):
    proc, spec = server
    rng = random.Random(2)
    system = [rng.randrange(30000) for _ in range(70)]
    prompts = [system + [rng.randrange(30000) for _ in range(20 + 15 * i)] for i in range(4)]
    with spawn_pool(4) as pool:
        stores = [pool.apply_async(worker_store, (proc.sock, spec.to_dict(), "srv", p,
                                                  rand_slots(rng, len(p)), NB, BS))
                  for p in prompts]
        assert [r.get(60) for r in stores] == [len(p) for p in prompts]
        order = prompts[::-1]
        gets = [pool.apply_async(worker_retrieve, (proc.sock, spec.to_dict(), "srv", p,
                                                   rand_slots(rng, len(p)), NB, BS))
                for p in order]
        results = [r.get(60) for r in gets]
    assert results == [(len(p), True) for p in order]


async def stats_of(sock, spec):
    async with mc.connect(sock, spec=spec, namespace="srv", timeout=10) as c:
        return await c.stats()


def test_killed_worker_leaves_no_mapping_fd_or_pin(server):
    proc, spec = server
    rng = random.Random(3)
    toks = [rng.randrange(30000) for _ in range(60)]

    async def baseline():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", timeout=10) as c:
            before = (await c.stats())["server"]
            ctx = mp.get_context("spawn")
            started = ctx.Event()
            worker = ctx.Process(target=worker_hang_in_store, args=(
                proc.sock, spec.to_dict(), "srv", toks, rand_slots(rng, 60), NB, BS, started))
            worker.start()
            assert await asyncio.to_thread(started.wait, 30)
            during = await c.stats()
            assert during["server"]["peers"] == 2
            assert during["server"]["open_mappings"] >= spec.num_layers
            assert during["in_flight"]["puts"] == 1
            os.kill(worker.pid, signal.SIGKILL)
            await asyncio.to_thread(worker.join, 10)
            for _ in range(200):
                after = await c.stats()
                if after["server"]["peers"] == 1 and after["in_flight"]["puts"] == 0:
                    break
                await asyncio.sleep(0.05)
            srv = after["server"]
            assert srv["peers"] == 1
            assert srv["open_mappings"] == 0 and srv["open_events"] == 0
            assert srv["open_fds"] == before["open_fds"]
            assert after["pins"] == 0 and after["in_flight"]["puts"] == 0
            # The half-done store is never served.
            assert await c.lookup(toks) == 0

    asyncio.run(baseline())


def test_killed_server_fails_fast_then_reconnects(tmp_path):
    spec = small_spec()
    cfg = write_config(tmp_path / "s.toml", spec, "srv", CH, spec.nbytes(CH) * 64)
    sock = str(tmp_path / "run" / "s.sock")
    proc = ServerProcess(sock, cfg).start()

    async def run():
        async with mc.connect(sock, spec=spec, namespace="srv", timeout=20,
                              connect_timeout=2) as c:
            pages = [ipc.empty_shared((2, NB, BS, 2, 8), spec.dtype) for _ in range(2)]
            await c.register_kv_caches(pages, "vllm")
            toks = list(range(40))
            assert await c.put(toks, prefix_kv(spec, toks)) == 40
            proc.kill()
            t0 = time.monotonic()
            with pytest.raises(mc.CacheUnavailableError):
                await c.lookup(toks)
            with pytest.raises(mc.CacheUnavailableError):
                await c.lookup(toks)  # reconnecting fails fast too while it is down
            assert time.monotonic() - t0 < 5
            proc.start()
            assert await c.lookup(toks) == 0  # a fresh server: empty, but reachable
            # Registrations were replayed on the new connection: retrieve works.
            assert await c.put(toks, prefix_kv(spec, toks)) == 40
            slots = list(range(40))
            assert await c.retrieve(toks, slots) == 40
            assert c.reconnects >= 1

    try:
        asyncio.run(run())
    finally:
        proc.stop()


def test_socket_is_private(server):
    proc, _spec = server
    st = os.stat(proc.sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(proc.sock)).st_mode) == 0o700


def test_bad_frames_get_errors_and_others_keep_being_served(server):
    proc, spec = server
    rng = random.Random(4)

    async def run():
        async with mc.connect(proc.sock, spec=spec, namespace="srv", timeout=10) as good:
            toks = list(range(30))
            await good.put(toks, prefix_kv(spec, toks))
            for i in range(60):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(proc.sock)
                kind = i % 3
                if kind == 0:
                    payload = rng.randbytes(rng.randrange(1, 200))
                elif kind == 1:  # a valid header announcing a huge body
                    payload = struct.pack(">2sBBI", b"MK", proto.PROTOCOL_VERSION, 0, 2**31)
                else:  # a well-formed frame with an unknown op
                    payload = proto.encode_request(1, "no_such_op", {})
                s.sendall(payload)
                s.settimeout(5)
                try:
                    s.recv(4096)  # an error reply, or the server closing on us
                except (TimeoutError, ConnectionResetError):
                    pass
                s.close()
                assert await good.lookup(toks) == 30
            st = (await good.stats())["server"]
            assert st["bad_frames"] >= 20

    asyncio.run(run())


def inproc_config(tmp_path, spec):
    """A server run inside the test's own process (for tests that patch its module)."""
    return ServerConfig(str(tmp_path / "r" / "s.sock"),
                        mc.CacheConfig(spec, "srv", tiers=(mc.HostTier(spec.nbytes(CH) * 8),),
                                       chunk_size=CH))


async def test_spec_mismatch_fails_at_connect(tmp_path):
    spec = small_spec()
    cfg = inproc_config(tmp_path, spec)
    async with Server(cfg) as srv:
        task = asyncio.create_task(srv.serve_forever())
        with pytest.raises(mc.FingerprintMismatchError, match="other"):
            async with mc.connect(cfg.socket_path, spec=spec, namespace="other"):
                pass
        with pytest.raises(mc.FingerprintMismatchError):
            async with mc.connect(cfg.socket_path, spec=small_spec(dtype=torch.float16),
                                  namespace="srv"):
                pass
        srv.stop()
        await task


async def test_foreign_uid_is_refused(tmp_path, monkeypatch):
    spec = small_spec()
    cfg = inproc_config(tmp_path, spec)
    async with Server(cfg) as srv:
        task = asyncio.create_task(srv.serve_forever())
        import musacache.server as server_mod
        real = os.getuid()
        monkeypatch.setattr(server_mod.os, "getuid", lambda: real + 4242)
        with pytest.raises((mc.PermissionDeniedError, mc.CacheUnavailableError)):
            async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", timeout=5):
                pass
        assert srv.counters.refused == 1
        monkeypatch.setattr(server_mod.os, "getuid", lambda: real)
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv") as ok:
            assert await ok.lookup([1, 2]) == 0
        srv.stop()
        await task


async def test_client_api_matches_the_embedded_cache(tmp_path):
    """The same coroutine runs against Cache and against a Client."""
    spec = small_spec()
    config = mc.CacheConfig(spec, "srv", tiers=(mc.HostTier(spec.nbytes(CH) * 32),),
                            chunk_size=CH)

    async def workload(cache):
        toks = list(range(200, 260))
        kv = prefix_kv(spec, toks)
        assert await cache.put(toks, kv) == 60
        assert await cache.lookup(toks[:45] + [1]) == 45
        hit = await cache.get(toks)
        assert hit.num_tokens == 60 and torch.equal(hit.kv, kv)
        out = torch.zeros(spec.shape(60))
        hit = await cache.get(toks, out=out)
        assert torch.equal(out, kv) and hit.kv.data_ptr() == out.data_ptr()
        assert await cache.prefetch(toks, timeout=1) == 60
        await cache.flush()
        assert await cache.delete(toks) >= 1
        assert await cache.lookup(toks) == 0
        with pytest.raises(mc.ShapeError):
            await cache.put(toks, kv[:, :, :10])
        with pytest.raises(mc.TokensError):
            await cache.lookup([[1, 2]])
        # An out that cannot be written is refused alike, also after a get into a good one of
        # the same shape (the client's fast path took them: found by a probe)
        for bad in ([1, 2], torch.zeros(spec.shape(60)).requires_grad_(),
                    torch.zeros(1).expand(spec.shape(60))):
            with pytest.raises(mc.InvalidInputError):
                await cache.get(toks, out=bad)
        # KV from a prefill run with grad on is cached by its values
        graded = prefix_kv(spec, toks).requires_grad_()
        assert await cache.put(toks, graded) == 60
        hit = await cache.get(toks)
        assert torch.equal(hit.kv, graded.detach()) and not hit.kv.requires_grad

    await _on_cache_and_client(tmp_path, config, workload)


async def _on_cache_and_client(tmp_path, config, workload):
    """Run ``workload(cache)`` on an embedded Cache, then on a Client of a server."""
    async with mc.Cache(config) as embedded:
        await workload(embedded)
    cfg = ServerConfig(str(tmp_path / "r" / "s.sock"), config)
    async with Server(cfg) as srv:
        task = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=config.spec,
                              namespace=config.namespace) as client:
            await workload(client)
        srv.stop()
        await task


def test_stats_cli_shows_the_servers_tiers(server):
    import json
    import subprocess
    import sys

    proc, spec = server

    async def put_something():
        async with mc.connect(proc.sock, spec=spec, namespace="srv") as c:
            toks = list(range(50))
            await c.put(toks, prefix_kv(spec, toks))
            await c.get(toks)

    asyncio.run(put_something())
    run = [sys.executable, "-m", "musacache", "stats", "--socket", proc.sock]
    table = subprocess.run(run + ["--once"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "host" in table.stdout and "hits" in table.stdout and "srv" in table.stdout
    raw = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=60)
    assert raw.returncode == 0, raw.stderr
    st = json.loads(raw.stdout)
    (cache,) = st["caches"]
    assert cache["namespace"] == "srv"
    assert cache["tiers"]["host"]["chunks"] == 4 and cache["tiers"]["host"]["hits"] >= 4
    assert st["server"]["connections"] >= 2
    # The stats client itself is a monitor, not one of the peers it reports.
    assert st["server"]["peers"] == 0 and st["server"]["monitors"] == 1
    gone = subprocess.run([sys.executable, "-m", "musacache", "stats", "--socket",
                           proc.sock + ".nope", "--once"], capture_output=True, text=True,
                          timeout=60)
    assert gone.returncode == 1 and "no musacache server listens at" in gone.stderr
    assert gone.stderr.count(".nope") == 1, gone.stderr  # the path is named once


def test_stats_table_names_tier_kinds_and_heads_every_column():
    from musacache.server.stats_cli import render

    snap = {"server": {"version": "x", "socket": "/run/musacache/s.sock", "caches": 1,
                       "max_caches": 4},
            "caches": [{"namespace": "llama", "chunk_size": 256, "tenant": "#abcd",
                        "tiers": {"host": {"kind": "host", "bytes_out": 0},
                                  "disk": {"kind": "DiskStore", "bytes_out": 0}}}]}
    later = {**snap, "caches": [{**snap["caches"][0],
                                 "tiers": {"host": {"kind": "host", "bytes_out": 2048},
                                           "disk": {"kind": "disk", "bytes_out": 0}}}]}
    table = render(later, 1.0, snap)
    assert "DiskStore" not in table
    disk_row = next(line for line in table.splitlines() if line.strip().startswith("disk"))
    assert disk_row.split()[1] == "disk"
    header = next(line for line in table.splitlines() if "capacity" in line)
    assert header.rstrip().endswith("out/s")
    host_row = next(line for line in table.splitlines() if line.strip().startswith("host"))
    assert host_row.rstrip().endswith("2.0 KiB/s") and "out" not in host_row


async def test_page_ops_check_their_tensors_alike_in_the_cache_and_the_client(tmp_path):
    """Found by a probe: put_pages of pages that require grad raised autograd's RuntimeError
    from the copy into a slot (the cache) and pages on the meta device or outs that cannot
    be written in place were not refused up front; the client checked dtype and size only."""
    spec = small_spec()
    config = mc.CacheConfig(spec, "pages", tiers=(mc.HostTier(spec.nbytes(CH) * 32),),
                            chunk_size=CH)

    async def workload(cache):
        pages = [prefix_kv(spec, list(range(i * CH, (i + 1) * CH))) for i in range(2)]
        graded = [p.clone().requires_grad_() for p in pages]
        assert await cache.put_pages(["a", "b"], graded) == 2
        outs = [torch.zeros_like(p) for p in pages]
        assert await cache.get_pages(["a", "b"], outs) == [True, True]
        assert all(torch.equal(o, p) for o, p in zip(outs, pages, strict=True))
        meta = torch.empty_like(pages[0], device="meta")
        with pytest.raises(mc.DeviceError, match=r"pages\[1\] is on the meta device"):
            await cache.put_pages(["c", "d"], [pages[0], meta])
        with pytest.raises(mc.InvalidInputError, match="negated"):
            await cache.put_pages(["c"], [torch._neg_view(pages[0])])
        assert await cache.exists_pages(["c"]) == 0
        bad_outs = {
            "requires grad": torch.zeros_like(pages[0]).requires_grad_(),
            "overlapping": torch.zeros(1, dtype=spec.dtype).expand(pages[0].shape),
            "meta device": meta,
        }
        for match, bad in bad_outs.items():
            fresh = torch.zeros_like(pages[0])
            with pytest.raises(mc.InvalidInputError, match=match):
                await cache.get_pages(["a", "b"], [fresh, bad])
            assert int(fresh.abs().sum()) == 0  # refused before anything was written

    await _on_cache_and_client(tmp_path, config, workload)


def test_a_registration_is_named_by_its_number_only():
    from musacache.server.client import _find_reg

    regs = [object(), object()]
    assert _find_reg(regs, None, None, 1) is regs[1]  # type: ignore[arg-type]
    for bad in ("0", 0.0, True, 2, -1):
        with pytest.raises(mc.InvalidInputError, match="no registration"):
            _find_reg(regs, None, None, bad)  # type: ignore[arg-type]
