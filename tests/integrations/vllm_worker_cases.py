"""The connector's worker side against a real node server, without a vLLM engine around it.

vLLM's own objects where the connector sees them (KVTransferConfig, FullAttentionSpec, its
per-layer ``[num_blocks, H, block_size, 2*D]`` CPU tensors, read as CPU_ATTN reads them); the
scheduler's metadata is built by hand. Covers what the two-process test cannot force: the
layerwise hooks, a load that comes up short, a server that dies under a running vLLM.
Run in the vLLM venv by tests/test_vllm.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_env import require

require("vllm", ".ci/vllm-env.sh")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from musacache.integrations._vllm_plan import RequestOp, slots_for  # noqa: E402
from musacache.integrations.vllm import (  # noqa: E402
    MusaCacheConnector,
    MusaCacheConnectorMetadata,
)
from musacache.server import spawn  # noqa: E402

NB, H, BS, D, LAYERS = 16, 2, 32, 32, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def connector(sock: str, **extra: object) -> MusaCacheConnector:
    kv = KVTransferConfig(kv_connector="MusaCacheConnector",
                          kv_connector_module_path="musacache.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"musacache.socket": sock,
                                                     **{f"musacache.{k}": v
                                                        for k, v in extra.items()}})
    vllm_config = SimpleNamespace(kv_transfer_config=kv, model_config=SimpleNamespace(
        model="tiny/llama"), compilation_config=SimpleNamespace(static_forward_context={}))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    kvcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=NAMES,
                                                            kv_cache_spec=spec)])
    c = MusaCacheConnector(vllm_config, KVConnectorRole.WORKER, kvcc)  # type: ignore[arg-type]
    return c


def pages() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(NB, H, BS, 2 * D) for n in NAMES}


def token_kv(kv: dict[str, torch.Tensor], slots: np.ndarray) -> torch.Tensor:
    """Each token's K and V rows as CPU_ATTN reads them, [layers, 2, T, H, D]."""
    out = []
    for n in NAMES:
        k, v = kv[n].view(NB, H, 2 * BS, D).chunk(2, dim=2)
        b, o = torch.from_numpy(slots // BS), torch.from_numpy(slots % BS)
        out.append(torch.stack([k[b, :, o], v[b, :, o]]))
    return torch.stack(out)


def op(tokens: list[int], blocks: list[int], **ranges: int) -> RequestOp:
    n = max(ranges.get("load_end", 0), ranges.get("save_end", 0))
    return RequestOp("r", np.asarray(tokens[:n], dtype=np.int32),
                     slots_for(blocks, BS, n), BS, **ranges)


def step(c: MusaCacheConnector, ops: list[RequestOp], layerwise: bool = False) -> None:
    """One forward as vLLM drives the hooks."""
    c.bind_connector_metadata(MusaCacheConnectorMetadata(ops))
    c.start_load_kv(SimpleNamespace())
    for n in NAMES:
        c.wait_for_layer_load(n)
        if layerwise:
            c.save_kv_layer(n, torch.empty(0), None)
    c.wait_for_save()
    c.clear_connector_metadata()


@pytest.fixture
def server(tmp_path: Path):
    cfg = tmp_path / "tiers.toml"
    cfg.write_text('[[tiers]]\nkind = "host"\ncapacity = "32MiB"\n')
    sock = str(tmp_path / "run" / "node.sock")
    with spawn(cfg, sock) as srv:
        yield srv


@pytest.mark.parametrize("layerwise", [False, True])
def test_save_then_load_into_other_blocks(server, layerwise: bool) -> None:
    tokens = list(range(100, 400))                  # 300 tokens: a chunk and a partial tail
    a = connector(server.socket_path, layerwise=layerwise)
    b = connector(server.socket_path, layerwise=layerwise)
    try:
        kv_a = pages()
        for t in kv_a.values():
            t.copy_(torch.randn(t.shape))
        a.register_kv_caches(kv_a)
        blocks_a = [3, 9, 1, 12, 5, 7, 0, 2, 4, 6]
        step(a, [op(tokens, blocks_a, save_start=0, save_end=300)], layerwise)
        assert a.get_kv_connector_stats().data["save_tokens"] == 300
        # Another worker (another vLLM) loads tokens 64..300 into different blocks, vLLM
        # holding the first 64 itself.
        kv_b = pages()
        b.register_kv_caches(kv_b)
        blocks_b = [8, 10, 11, 13, 14, 15, 1, 2, 3, 4]
        o = op(tokens, blocks_b, load_start=64, load_end=300)
        step(b, [o], layerwise)
        assert b.get_block_ids_with_load_errors() == set()
        want = token_kv(kv_a, slots_for(blocks_a, BS, 300))
        got = token_kv(kv_b, o.slot_mapping)
        assert torch.equal(got[:, :, 64:], want[:, :, 64:])
        assert not got[:, :, :64].any()              # vLLM's own tokens are not written
        stats = b.get_kv_connector_stats().data
        assert stats["load_tokens"] == 236 and stats["load_bytes"] > 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_short_load_reports_the_blocks_vllm_must_recompute(server) -> None:
    tokens = list(range(7, 107))
    c = connector(server.socket_path)
    try:
        kv = pages()
        kv[NAMES[0]].normal_()
        kv[NAMES[1]].normal_()
        c.register_kv_caches(kv)
        step(c, [op(tokens, [0, 1, 2, 3], save_start=0, save_end=40)])   # the cache has 40
        o = op(tokens, [5, 6, 7, 8], load_start=0, load_end=100)         # vLLM was told 100
        step(c, [o])
        # Tokens 40..99 were not loaded: their blocks (token 40 is in the second block).
        assert c.get_block_ids_with_load_errors() == {6, 7, 8}
        assert c.get_block_ids_with_load_errors() == set()              # reported once
    finally:
        c.shutdown()


def test_a_dead_server_fails_no_hook(server) -> None:
    tokens = list(range(50))
    c = connector(server.socket_path, timeout=5)
    try:
        c.register_kv_caches(pages())
        server.kill()
        step(c, [op(tokens, [0, 1], load_start=0, load_end=50)])
        assert c.get_block_ids_with_load_errors() == {0, 1}
        step(c, [op(tokens, [0, 1], save_start=0, save_end=50)], layerwise=False)
        stats = c.get_kv_connector_stats().data
        assert stats["save_failures"] == 1 and stats["load_failures"] == 1
    finally:
        c.shutdown()


def test_layerwise_load_when_vllm_waits_on_one_layer_only(server) -> None:
    """vLLM need not wait on every layer: the load still lands whole and reports its short
    tail (wait_for_save settles a load still running)."""
    tokens = list(range(300, 380))
    a = connector(server.socket_path, layerwise=True)
    try:
        kv = pages()
        for t in kv.values():
            t.normal_()
        a.register_kv_caches(kv)
        step(a, [op(tokens, [4, 5], save_start=0, save_end=64)], layerwise=True)
        want = token_kv(kv, slots_for([4, 5], BS, 64))
        for t in kv.values():
            t.zero_()
        o = op(tokens, [6, 7, 8], load_start=0, load_end=80)   # 16 more than cached
        a.bind_connector_metadata(MusaCacheConnectorMetadata([o]))
        a.start_load_kv(SimpleNamespace())
        a.wait_for_layer_load(NAMES[0])                         # only the first layer
        a.wait_for_save()
        a.clear_connector_metadata()
        assert torch.equal(token_kv(kv, o.slot_mapping[:64]), want)
        assert a.get_block_ids_with_load_errors() == {8}
    finally:
        a.shutdown()
