"""MusaCacheStorage against the real SGLang package (its HiCacheStorage contract and its
StorageBackendFactory's dynamic path). Run in the SGLang venv by tests/test_sglang.py.

The host pool is a stand-in with the page-buffer methods SGLang's host pools have
(``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``, for the
``layer_first`` and ``page_first`` layouts of ``MHATokenToKVPoolHost`` and an MLA pool):
SGLang's own pools need a GPU device pool to be built.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_env import require

require("sglang", ".ci/sglang-env.sh")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from musacache import ConfigError  # noqa: E402
from musacache.integrations.sglang import MusaCacheStorage  # noqa: E402
from musacache.server import spawn  # noqa: E402

PAGE = 16


class MHATokenToKVPoolHostStandin:
    """SGLang's MHA host pool, reduced to its storage-facing methods."""

    def __init__(self, size: int, layers: int = 3, heads: int = 2, head_dim: int = 8,
                 layout: str = "layer_first", dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, layers, heads, \
            head_dim
        self.size, self.layout, self.dtype = size, layout, dtype
        dims = (2, layers, size, heads, head_dim) if layout == "layer_first" else \
            (2, size, layers, heads, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        shape = self.get_data_page(index, flat=False).shape
        self.get_data_page(index, flat=False).copy_(data_page.reshape(shape))


class MLATokenToKVPoolHostStandin(MHATokenToKVPoolHostStandin):
    """SGLang's MLA host pool; with decode context parallel (``dcp_size`` > 1) its pages are
    ``PAGE`` physical tokens of a logical page ``dcp_size`` times as long, and it takes
    page starts in logical slots, as SGLang's ``_storage_page_index`` does."""

    def __init__(self, size: int, layers: int = 3, dim: int = 24, dcp_size: int = 1) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = PAGE, layers, 1, dim
        self.size, self.layout, self.dtype = size, "layer_first", torch.bfloat16
        self.dcp_size = dcp_size
        self.kv_buffer = torch.zeros((layers, size, 1, dim), dtype=self.dtype)

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.dcp_size > 1:
            if index < 0 or index % self.logical_page_size:
                raise ValueError("DCP L3 page start must be a nonnegative logical page "
                                 "boundary.")
            index //= self.dcp_size
        page = self.kv_buffer[:, index:index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.head_dim),
                           dtype=self.dtype).flatten()


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, **more: object) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name="tiny/llama", extra_config=dict(extra),
        **more)


def dynamic_extra(**ours: str) -> dict:
    """What ``--hicache-storage-backend-extra-config`` carries (docs/sglang.md)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    import re

    extra = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    for k in [k for k in extra if k.startswith("musacache.")]:
        del extra[k]
    extra.update({f"musacache.{k}": v for k, v in ours.items()})
    return extra


def make(extra: dict, pool: object, **cfg: object) -> HiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg),
                                                   pool)
    assert isinstance(backend, MusaCacheStorage)
    backend.register_mem_pool_host(pool)
    return backend


def fill(pool: MHATokenToKVPoolHostStandin, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture
def tiers(tmp_path: Path) -> Path:
    cfg = tmp_path / "tiers.toml"
    cfg.write_text(f'[[tiers]]\nkind = "host"\ncapacity = "16MiB"\n[[tiers]]\nkind = "disk"\n'
                   f'path = "{tmp_path / "disk"}"\ncapacity = "64MiB"\n')
    return cfg


@pytest.fixture
def server(tmp_path: Path, tiers: Path):
    sock = str(tmp_path / "run" / "node.sock")
    with spawn(tiers, sock):
        yield sock


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_pair_round_trip_byte_exact(tiers: Path, layout: str) -> None:
    pool = MHATokenToKVPoolHostStandin(size=8 * PAGE, layout=layout)
    fill(pool, 1)
    want = pool.kv_buffer.clone()
    backend = make(dynamic_extra(config=str(tiers)), pool)
    try:
        keys = [f"{i:064x}" for i in range(5)]
        host = torch.arange(2 * PAGE, 7 * PAGE, dtype=torch.int64)   # pages 2..6
        assert backend.batch_set_v1(keys, host) == [True] * 5
        assert backend.batch_exists(keys) == 5
        assert backend.batch_exists(keys[:3] + ["f" * 64] + keys[3:]) == 3
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys, host) == [True] * 5
        got = pool.kv_buffer
        if layout == "layer_first":
            assert torch.equal(bits(got[:, :, 2 * PAGE:7 * PAGE]),
                               bits(want[:, :, 2 * PAGE:7 * PAGE]))
            assert not got[:, :, :2 * PAGE].any() and not got[:, :, 7 * PAGE:].any()
        else:
            assert torch.equal(bits(got[:, 2 * PAGE:7 * PAGE]), bits(want[:, 2 * PAGE:7 * PAGE]))
            assert not got[:, :2 * PAGE].any() and not got[:, 7 * PAGE:].any()
        # A key never stored is a miss and leaves its page alone.
        pool.kv_buffer.fill_(3)
        assert backend.batch_get_v1(["e" * 64, keys[0]], host[:2 * PAGE]) == [False, True]
        assert (pool.get_data_page(2 * PAGE, flat=False) == 3).all()
    finally:
        backend.close()


def test_copying_interface(tiers: Path) -> None:
    pool = MHATokenToKVPoolHostStandin(size=4 * PAGE)
    backend = make(dynamic_extra(config=str(tiers)), pool)
    try:
        g = torch.Generator().manual_seed(5)
        values = [torch.randn(pool.get_dummy_flat_data_page().shape, generator=g).to(
            torch.bfloat16) for _ in range(3)]
        assert backend.batch_set(["a", "b", "c"], values) is True
        assert backend.set("d", values[0]) is True
        assert backend.exists("b") and not backend.exists("zz")
        got = backend.batch_get(["a", "zz", "c"])
        assert got[1] is None
        assert torch.equal(bits(got[0]), bits(values[0]))
        assert torch.equal(bits(got[2]), bits(values[2]))
        target = pool.get_dummy_flat_data_page()
        assert backend.get("d", target) is not None and torch.equal(bits(target),
                                                                     bits(values[0]))
        assert backend.get("zz") is None
        backend.clear()
        assert backend.batch_exists(["a", "b"]) == 0
    finally:
        backend.close()


def test_two_ranks_on_one_node_server_are_kept_apart(server: str, tiers: Path) -> None:
    pools = [MHATokenToKVPoolHostStandin(size=4 * PAGE) for _ in range(2)]
    fill(pools[0], 10)
    fill(pools[1], 11)
    want = [p.kv_buffer.clone() for p in pools]
    extra = dynamic_extra(socket=server, config=str(tiers))
    ranks = [make(extra, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
    try:
        host = torch.arange(0, 2 * PAGE, dtype=torch.int64)
        keys = ["aa" * 32, "bb" * 32]
        assert ranks[0].batch_set_v1(keys, host) == [True, True]
        assert ranks[1].batch_exists(keys) == 0            # rank 0's pages are not rank 1's
        assert ranks[1].batch_set_v1(keys, host) == [True, True]
        for p in pools:
            p.kv_buffer.zero_()
        for r in range(2):
            assert ranks[r].batch_get_v1(keys, host) == [True, True]
            assert torch.equal(bits(pools[r].kv_buffer[:, :, :2 * PAGE]),
                               bits(want[r][:, :, :2 * PAGE]))
        assert not torch.equal(bits(want[0][:, :, :2 * PAGE]), bits(want[1][:, :, :2 * PAGE]))
    finally:
        for b in ranks:
            b.close()


def test_mla_only_the_storage_writer_writes(server: str, tiers: Path) -> None:
    pools = [MLATokenToKVPoolHostStandin(size=4 * PAGE) for _ in range(2)]
    fill(pools[1], 21)
    fill(pools[0], 20)
    extra = dynamic_extra(socket=server)
    ranks = [make(extra, pools[r], tp_rank=r, tp_size=2, mla=True) for r in range(2)]
    try:
        host = torch.arange(PAGE, 2 * PAGE, dtype=torch.int64)
        # Rank 1 is not the writer: it reports success and stores nothing.
        assert ranks[1].batch_set_v1(["m1"], host) == [True]
        assert ranks[0].batch_exists(["m1"]) == 0
        want = pools[0].kv_buffer.clone()
        assert ranks[0].batch_set_v1(["m1"], host) == [True]
        # MLA KV is the same on every rank: rank 1 reads what rank 0 wrote.
        assert ranks[1].batch_get_v1(["m1"], host) == [True]
        assert torch.equal(bits(pools[1].kv_buffer[:, PAGE:2 * PAGE]),
                           bits(want[:, PAGE:2 * PAGE]))
    finally:
        for b in ranks:
            b.close()


def test_a_dead_server_is_a_miss_not_an_error(tmp_path: Path, tiers: Path) -> None:
    sock = str(tmp_path / "run2" / "node.sock")
    srv = spawn(tiers, sock)
    pool = MHATokenToKVPoolHostStandin(size=2 * PAGE)
    backend = make(dynamic_extra(socket=sock, timeout=5), pool)
    try:
        host = torch.arange(0, PAGE, dtype=torch.int64)
        assert backend.batch_set_v1(["k"], host) == [True]
        srv.kill()
        assert backend.batch_exists(["k"]) == 0
        assert backend.batch_get_v1(["k"], host) == [False]
        assert backend.batch_set_v1(["k2"], host) == [False]
        assert backend.get_stats()["faults"] >= 3
    finally:
        backend.close()
        srv.kill()


def test_bad_extra_config_is_refused() -> None:
    from musacache import ConfigError

    with pytest.raises(ConfigError, match=r"musacache\.socket"):
        MusaCacheStorage(storage_config(dynamic_extra()), {})
    with pytest.raises(ConfigError, match="unknown"):
        MusaCacheStorage(storage_config(dynamic_extra(config="x", sockets="y")), {})
    for bad in (float("nan"), float("inf"), 1e10, 0, "5"):
        with pytest.raises(ConfigError, match="timeout"):
            MusaCacheStorage(storage_config(dynamic_extra(config="x", timeout=bad)), {})


def test_pools_of_other_layouts_or_kv_dtypes_never_share_pages(server: str) -> None:
    # A layer-first and a page-first page of one size hold the same values in other orders,
    # and SGLang stores every fp8 variant as uint8: a page one of them stored is a miss to
    # the other, never a hit with its KV scrambled.
    first = MHATokenToKVPoolHostStandin(size=2 * PAGE, layout="layer_first")
    other = MHATokenToKVPoolHostStandin(size=2 * PAGE, layout="page_first")
    e4m3 = MHATokenToKVPoolHostStandin(size=2 * PAGE, dtype=torch.uint8)
    e5m2 = MHATokenToKVPoolHostStandin(size=2 * PAGE, dtype=torch.uint8)
    e4m3.device_pool = SimpleNamespace(dtype=torch.float8_e4m3fn)  # type: ignore[attr-defined]
    e5m2.device_pool = SimpleNamespace(dtype=torch.float8_e5m2)  # type: ignore[attr-defined]
    fill(first, 3)
    e4m3.kv_buffer.copy_(torch.arange(e4m3.kv_buffer.numel()).reshape(e4m3.kv_buffer.shape))
    extra = dynamic_extra(socket=server)
    backends = [make(extra, p) for p in (first, other, e4m3, e5m2)]
    try:
        host = torch.arange(0, PAGE, dtype=torch.int64)
        key = ["ab" * 32]
        assert backends[0].batch_set_v1(key, host) == [True]
        assert backends[2].batch_set_v1(key, host) == [True]
        other.kv_buffer.fill_(5)
        e5m2.kv_buffer.fill_(5)
        for b, pool in ((backends[1], other), (backends[3], e5m2)):
            assert b.batch_exists(key) == 0
            assert b.batch_get_v1(key, host) == [False]
            assert (pool.kv_buffer == 5).all()
        # Each still reads its own.
        want = first.kv_buffer.clone()
        first.kv_buffer.zero_()
        assert backends[0].batch_get_v1(key, host) == [True]
        assert torch.equal(bits(first.kv_buffer[:, :, :PAGE]), bits(want[:, :, :PAGE]))
    finally:
        for b in backends:
            b.close()


def test_decode_context_parallel_pages_step_by_logical_page(tiers: Path) -> None:
    # Under DCP SGLang slices host_indices by logical page (PAGE * dcp_size slots) while
    # each rank's pool holds PAGE tokens of it: the second page starts a logical page on.
    pool = MLATokenToKVPoolHostStandin(size=8 * PAGE, dcp_size=2)
    fill(pool, 7)
    want = pool.kv_buffer.clone()
    backend = make(dynamic_extra(config=str(tiers)), pool, mla=True, tp_size=2, dcp_size=2, dcp_rank=0,
                   logical_page_size=2 * PAGE)
    try:
        host = torch.arange(2 * 2 * PAGE, 5 * 2 * PAGE, dtype=torch.int64)  # 3 logical pages
        keys = ["d1", "d2", "d3"]
        assert backend.batch_set_v1(keys, host) == [True] * 3
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys, host) == [True] * 3
        assert torch.equal(bits(pool.kv_buffer[:, 2 * PAGE:5 * PAGE]),
                           bits(want[:, 2 * PAGE:5 * PAGE]))
        assert not pool.kv_buffer[:, :2 * PAGE].any() and not pool.kv_buffer[:, 5 * PAGE:].any()
        # A page start the pool refuses is the backend's typed error, not the pool's own.
        with pytest.raises(ConfigError, match="refused a page view"):
            backend.batch_get_v1(["d1"], host[PAGE:])
    finally:
        backend.close()


def test_a_sequence_stored_in_batches_is_evicted_tail_first(tmp_path: Path) -> None:
    # SGLang stores a long sequence a batch per call, naming the pages before each batch
    # (prefix_keys): a batch hangs under them, so eviction drops the sequence's last page,
    # not the last page of its first batch (which left the rest stored but unreachable).
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    pool = MHATokenToKVPoolHostStandin(size=8 * PAGE)
    fill(pool, 9)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    cfg = tmp_path / "small.toml"
    cfg.write_text(f'[[tiers]]\nkind = "host"\ncapacity = {4 * page_bytes}\n')
    backend = make(dynamic_extra(config=str(cfg)), pool)
    try:
        seq = ["a1", "a2", "a3", "a4"]
        pages = torch.arange(0, 4 * PAGE, dtype=torch.int64)
        assert backend.batch_set_v1(seq[:2], pages[:2 * PAGE],
                                    HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
        assert backend.batch_set_v1(seq[2:], pages[2 * PAGE:],
                                    HiCacheStorageExtraInfo(prefix_keys=seq[:2])) == [True] * 2
        assert backend.batch_exists(seq) == 4
        assert backend.batch_set_v1(["b1"], torch.arange(4 * PAGE, 5 * PAGE),
                                    HiCacheStorageExtraInfo(prefix_keys=[])) == [True]
        assert backend.batch_exists(seq) == 3
        assert not backend.exists("a4")
    finally:
        backend.close()


def test_a_closed_backend_says_so(tiers: Path) -> None:
    from musacache import CacheClosedError

    backend = make(dynamic_extra(config=str(tiers)), MHATokenToKVPoolHostStandin(size=PAGE))
    backend.close()
    with pytest.raises(CacheClosedError, match="closed"):
        backend.batch_exists(["k"])


def test_opening_a_node_server_outlasts_a_short_call_timeout(tmp_path: Path,
                                                              tiers: Path) -> None:
    # musacache.timeout bounds each call; starting the node server from the tiers file takes
    # longer, and register_mem_pool_host waits for it (it raised a bare TimeoutError).
    sock = str(tmp_path / "run3" / "node.sock")
    pool = MHATokenToKVPoolHostStandin(size=PAGE)
    backend = make(dynamic_extra(socket=sock, config=str(tiers), timeout=0.05), pool)
    try:
        assert backend.batch_exists(["k"]) == 0
    finally:
        backend.close()
        # The server the backend started outlives it (detached): stopped by its pid, which
        # the kernel gives for the socket's other end.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   12))[0]
        os.kill(pid, signal.SIGTERM)
