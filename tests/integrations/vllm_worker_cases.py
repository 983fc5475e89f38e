"""The connector's worker side against a real node server, without a vLLM engine around it.

vLLM's own objects where the connector sees them (KVTransferConfig, FullAttentionSpec, its
per-layer ``[num_blocks, H, block_size, 2*D]`` CPU tensors, read as CPU_ATTN reads them); the
scheduler's metadata is built by hand. Covers what the two-process test cannot force: the
layerwise hooks, a load that comes up short, a server that dies under a running vLLM.
Run in the vLLM venv by tests/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_env import require

require("vllm", ".ci/vllm-env.sh")

from vllm.config import CacheConfig, KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode  # noqa: E402

from musacache.integrations._vllm_plan import RequestOp, slots_for  # noqa: E402
from musacache.integrations.vllm import (  # noqa: E402
    MusaCacheConnector,
    MusaCacheConnectorMetadata,
)
from musacache.server import spawn  # noqa: E402

NB, H, BS, D, LAYERS = 16, 2, 32, 32, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def connector(sock: str, *, role: KVConnectorRole = KVConnectorRole.WORKER,
              spec: FullAttentionSpec | None = None, names: list[str] | None = None,
              cache_dtype: str | None = None, ranks: int = 1,
              **extra: object) -> MusaCacheConnector:
    kv = KVTransferConfig(kv_connector="MusaCacheConnector",
                          kv_connector_module_path="musacache.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"musacache.socket": sock,
                                                     **{f"musacache.{k}": v
                                                        for k, v in extra.items()}})
    vllm_config = SimpleNamespace(kv_transfer_config=kv, model_config=SimpleNamespace(
        model="tiny/llama"), compilation_config=SimpleNamespace(static_forward_context={}),
        parallel_config=SimpleNamespace(world_size=ranks))
    if cache_dtype is not None:
        vllm_config.cache_config = CacheConfig(cache_dtype=cache_dtype)  # type: ignore[arg-type]
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D,
                                     dtype=torch.float32)
    kvcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names or NAMES,
                                                            kv_cache_spec=spec)])
    c = MusaCacheConnector(vllm_config, role, kvcc)  # type: ignore[arg-type]
    return c


def pages(names: list[str] | None = None, dtype: torch.dtype = torch.float32,
          ) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(NB, H, BS, 2 * D, dtype=dtype) for n in names or NAMES}


def token_kv(kv: dict[str, torch.Tensor], slots: np.ndarray) -> torch.Tensor:
    """Each token's K and V rows as CPU_ATTN reads them, [layers, 2, T, H, D]."""
    out = []
    for n in kv:
        k, v = kv[n].view(NB, H, 2 * BS, D).chunk(2, dim=2)
        b, o = torch.from_numpy(slots // BS), torch.from_numpy(slots % BS)
        out.append(torch.stack([k[b, :, o], v[b, :, o]]))
    return torch.stack(out)


def write_token_kv(kv: dict[str, torch.Tensor], slots: np.ndarray, vals: torch.Tensor) -> None:
    """What a forward writes for these tokens: the inverse of token_kv."""
    b, o = torch.from_numpy(slots // BS), torch.from_numpy(slots % BS)
    for i, n in enumerate(kv):
        view = kv[n].view(NB, H, 2 * BS, D)
        view[b, :, o] = vals[i, 0]
        view[b, :, BS + o] = vals[i, 1]


def op(tokens: list[int], blocks: list[int], req_id: str = "r", **ranges: int) -> RequestOp:
    n = max(ranges.get("load_end", 0), ranges.get("save_end", 0))
    return RequestOp(req_id, np.asarray(tokens[:n], dtype=np.int32),
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


def admitted(sch: MusaCacheConnector, req: object) -> int:
    """The external hit the scheduler side finds for ``req`` (polled until its lookup
    answers), told back as allocated: vLLM's admission of the request."""
    for _ in range(500):
        ext, _ = sch.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        if ext is not None:
            break
        time.sleep(0.01)
    assert ext is not None
    sch.update_state_after_alloc(req, None, ext)  # type: ignore[arg-type]
    return ext


def recomputed(sch: MusaCacheConnector, w: MusaCacheConnector, kinds: object,
               kv: dict[str, torch.Tensor], kv_true: torch.Tensor) -> RequestOp:
    """vLLM rewinds request "r" to token 0 and computes all ``kv_true.shape[2]`` tokens
    again (the forward writes ``kv_true``): the step's op, once run through ``w``."""
    meta = sch.build_connector_meta(kinds.output(  # type: ignore[attr-defined]
        [], kinds.cached(["r"], set(), [None], [0]),  # type: ignore[attr-defined]
        {"r": kv_true.shape[2]}, set()))
    (o,) = meta.ops  # type: ignore[attr-defined]
    write_token_kv(kv, o.slot_mapping, kv_true[:, :, :len(o.slot_mapping)])
    step(w, meta.ops)  # type: ignore[attr-defined]
    return o


def saved_prompt(sock: str, tokens: list[int], kv_true: torch.Tensor) -> None:
    """Another vLLM prefilled ``tokens`` (their KV: ``kv_true``) and saved them."""
    a = connector(sock)
    try:
        kv = pages()
        a.register_kv_caches(kv)
        o = op(tokens, list(range(NB)), save_start=0, save_end=len(tokens))
        write_token_kv(kv, o.slot_mapping, kv_true)
        step(a, [o])
        assert a.get_kv_connector_stats().data["save_tokens"] == len(tokens)
    finally:
        a.shutdown()


def loaded(sock: str, tokens: list[int], n: int, **kw: object) -> torch.Tensor:
    """The KV of ``tokens[:n]`` a fresh vLLM loads from the cache (zeros where it misses)."""
    c = connector(sock, **kw)  # type: ignore[arg-type]
    try:
        kv = pages()
        c.register_kv_caches(kv)
        o = op(tokens, list(range(NB)), load_start=0, load_end=n)
        step(c, [o])
        return token_kv(kv, o.slot_mapping)
    finally:
        c.shutdown()


def test_a_timed_out_load_never_shares_the_staging_area_with_a_save(server) -> None:
    """Found by a probe: a load that timed out (server stalled) was abandoned while the
    server still wrote into the CPU staging area; the same step's save of another request
    gathered into that area, and the server stored the load's KV under the save's tokens."""
    torch.manual_seed(1)
    first = list(range(1000, 1256))
    other = list(range(5000, 5256))
    kv_first = torch.randn(LAYERS, 2, 256, H, D)
    kv_other = torch.randn(LAYERS, 2, 256, H, D)
    saved_prompt(server.socket_path, first, kv_first)
    w = connector(server.socket_path, timeout=2)
    try:
        kv = pages()
        w.register_kv_caches(kv)
        load = op(first, [0, 1, 2, 3, 4, 5, 6, 7], "load", load_start=0, load_end=256)
        save = op(other, [8, 9, 10, 11, 12, 13, 14, 15], "save", save_start=0, save_end=256)
        write_token_kv(kv, save.slot_mapping, kv_other)   # this step's forward, done early
        w.bind_connector_metadata(MusaCacheConnectorMetadata([load, save]))
        os.kill(server.pid, signal.SIGSTOP)                # the server stalls
        try:
            w.start_load_kv(SimpleNamespace())             # gives up after 2 s
            assert w.get_block_ids_with_load_errors() == set(range(8))
            saver = threading.Thread(target=w.wait_for_save)
            saver.start()
            time.sleep(1.0)                                # (the save is under way)
        finally:
            os.kill(server.pid, signal.SIGCONT)           # the server catches up
        saver.join()
        w.clear_connector_metadata()
    finally:
        w.shutdown()
    got = loaded(server.socket_path, other, 255)
    assert torch.equal(got, kv_other[:, :, :255])


def test_a_step_whose_load_failed_saves_nothing_and_the_recompute_is_saved(server) -> None:
    """Found by a probe: a step whose load came up short still saved what it computed
    (over blocks never loaded), and after vLLM rewound the request the planner saved
    nothing more: the cache served KV computed over garbage."""
    from vllm_sim import vllm_kinds

    torch.manual_seed(2)
    prompt = list(range(2000, 2300))
    kv_true = torch.randn(LAYERS, 2, 300, H, D)
    saved_prompt(server.socket_path, prompt[:256], kv_true[:, :, :256])
    kinds = vllm_kinds()
    sch = connector(server.socket_path, role=KVConnectorRole.SCHEDULER)
    w = connector(server.socket_path)
    try:
        kv = pages()
        w.register_kv_caches(kv)
        req = kinds.request("r", prompt)
        assert admitted(sch, req) == 256
        blocks = list(range(3, 13))
        meta = sch.build_connector_meta(kinds.output(
            [kinds.new_req("r", prompt, blocks, 256)], kinds.cached([], set(), [], []),
            {"r": 44}, set()))
        (o,) = meta.ops  # type: ignore[attr-defined]
        # (whole blocks of 32 only: vLLM's CPU backend, see test_cpu_backend_blocks_...)
        assert (o.load_start, o.load_end, o.save_start, o.save_end) == (0, 256, 256, 288)
        # The chunk is evicted between the lookup and the load: the load comes up empty.
        w._loop.run(w._server.client.clear(), 5)  # type: ignore[union-attr]
        w.bind_connector_metadata(meta)
        w.start_load_kv(SimpleNamespace())
        assert w.get_block_ids_with_load_errors() == set(range(3, 11))
        write_token_kv(kv, slots_for(blocks, BS, 300)[256:], kv_true[:, :, 256:] + 100)
        w.wait_for_save()
        w.clear_connector_metadata()
        stats = w.get_kv_connector_stats()
        assert stats is not None and stats.data.get("save_tokens", 0) == 0
        assert stats.data["save_skipped_tokens"] == 32
        # vLLM rewinds the request to its first failed block and computes it all again.
        o = recomputed(sch, w, kinds, kv, kv_true)
        assert (o.save_start, o.save_end) == (0, 288)
    finally:
        sch.shutdown()
        w.shutdown()
    assert torch.equal(loaded(server.socket_path, prompt, 288), kv_true[:, :, :288])


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_that_fails_on_one_rank_is_saved_by_no_rank(server, monkeypatch,
                                                          layerwise: bool) -> None:
    """Found by reading (docs/vllm.md left it open): with tensor parallelism each rank caches
    its own heads, and a rank's copy can be evicted while another's stays. The other rank's
    load then succeeds and its step saved what the forward computed, though every rank's
    attention output is summed with the failed rank's, computed over blocks never loaded;
    a store never overwrites a cached chunk, so later prompts were served that KV. Now the
    ranks' outputs go through vLLM's own aggregation to the scheduler side, which holds the
    saves back until it has seen them, and vLLM rewinds the request first."""
    import vllm.distributed.parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm_sim import vllm_kinds

    torch.manual_seed(4)
    prompt = list(range(3000, 3300))
    kv_true = torch.randn(LAYERS, 2, 300, H, D)
    saved_prompt(server.socket_path, prompt[:256], kv_true[:, :, :256])  # rank 0's copy only
    kinds = vllm_kinds()
    sch = connector(server.socket_path, role=KVConnectorRole.SCHEDULER, ranks=2)
    r0 = connector(server.socket_path, layerwise=layerwise)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)
    r1 = connector(server.socket_path, layerwise=layerwise)
    try:
        assert "/tp0/" in r0.namespace and "/tp1/" in r1.namespace
        req = kinds.request("r", prompt)
        assert admitted(sch, req) == 256  # the scheduler looks up rank 0's namespace
        blocks = list(range(3, 13))
        meta = sch.build_connector_meta(kinds.output(
            [kinds.new_req("r", prompt, blocks, 256)], kinds.cached([], set(), [], []),
            {"r": 44}, set()))
        (o,) = meta.ops  # type: ignore[attr-defined]
        assert (o.load_start, o.load_end, o.saves) == (0, 256, False)
        computed = slots_for(blocks, BS, 300)[256:]
        outputs = []
        for w in (r0, r1):
            kv = pages()
            w.register_kv_caches(kv)
            w.bind_connector_metadata(meta)
            w.start_load_kv(SimpleNamespace())
            for n in NAMES:
                w.wait_for_layer_load(n)
                # What the forward computes past the load, over rank 1's unloaded blocks.
                write_token_kv(kv, computed, kv_true[:, :, 256:] + 100)
                if layerwise:
                    w.save_kv_layer(n, torch.empty(0), None)
            w.wait_for_save()
            out = KVConnectorOutput(invalid_block_ids=w.get_block_ids_with_load_errors(),
                                    kv_connector_stats=w.get_kv_connector_stats(),
                                    kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0},
                                             kv_connector_output=out))
        kvo = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
        assert kvo is not None and kvo.kv_connector_output is not None
        got = kvo.kv_connector_output
        assert got.invalid_block_ids == set(range(3, 11))  # rank 1's, for both ranks
        assert got.kv_connector_stats.data.get("save_tokens", 0) == 0
        sch.update_connector_output(got)
        assert sch._planner is not None and sch._planner.seen == 1
    finally:
        sch.shutdown()
        r0.shutdown()
        r1.shutdown()
    # Rank 0's namespace holds the 256 tokens it was given, nothing computed over the load.
    monkeypatch.undo()
    assert torch.equal(loaded(server.socket_path, prompt, 299), torch.cat(
        [kv_true[:, :, :256], torch.zeros(LAYERS, 2, 43, H, D)], dim=2))


def kernel_write(kv: dict[str, torch.Tensor], slots: np.ndarray, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """What vLLM's CPU backend writes for these tokens (``keys``/``values`` [layers, T, H,
    D]): its own ``cpu_attn_reshape_and_cache``, on the views its attention layer makes."""
    from vllm import _custom_ops as ops

    for i, name in enumerate(kv):
        key_cache, value_cache = kv[name].view(NB, H, 2 * BS, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[i], values[i], key_cache, value_cache,
                                       torch.from_numpy(slots), "vec", k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("n", [300, 256, 64])
def test_keys_come_back_where_the_cpu_backends_kernel_wrote_them(server, n: int) -> None:
    """Found by comparing what two vLLM runs cached: vLLM's CPU backend writes each block's
    keys transposed ([head_dim, block_size] per head), so the rows of a part of a block are
    other tokens' key bytes. A prompt whose end cut a block was saved and loaded by rows,
    and the last block's keys came back scattered over other tokens (a 400-token prompt
    reloaded with wrong keys for its last 15 tokens). The connector now moves whole blocks
    only, which come back byte for byte where the kernel wrote them."""
    from vllm_sim import vllm_kinds

    torch.manual_seed(5)
    prompt = list(range(7000, 7000 + n))
    keys = torch.randn(LAYERS, n, H, D)
    values = torch.randn(LAYERS, n, H, D)
    kinds = vllm_kinds()

    def run(name: str, blocks: list[int], write: bool) -> tuple[RequestOp, dict]:
        sch = connector(server.socket_path, role=KVConnectorRole.SCHEDULER)
        w = connector(server.socket_path)
        try:
            kv = pages()
            w.register_kv_caches(kv)
            req = kinds.request(name, prompt)
            hit = admitted(sch, req)
            meta = sch.build_connector_meta(kinds.output(
                [kinds.new_req(name, prompt, blocks, hit)], kinds.cached([], set(), [], []),
                {name: n - hit}, set()))
            (o,) = meta.ops  # type: ignore[attr-defined]
            if write:  # the forward of the whole prompt
                kernel_write(kv, slots_for(blocks, BS, n), keys, values)
            step(w, meta.ops)  # type: ignore[attr-defined]
            return o, kv
        finally:
            sch.shutdown()
            w.shutdown()

    saved, _ = run("a", list(range(NB)), write=True)
    assert saved.save_start == 0 and saved.save_end == n - n % BS
    other = [15, 3, 9, 1, 12, 6, 0, 10, 2, 14]
    o, kv = run("b", other, write=False)
    assert o.loads and o.load_end % BS == 0 and o.load_end >= n - n % BS - BS
    want = pages()
    m = o.load_end
    kernel_write(want, slots_for(other, BS, m), keys[:, :m], values[:, :m])
    for name in NAMES:
        assert torch.equal(kv[name], want[name]), name


def test_a_layerwise_load_from_a_dead_server_frees_every_layer(server) -> None:
    """Found by a probe: the load failed at once, but its layer events were never set, so
    each wait_for_layer_load waited out the whole timeout."""
    c = connector(server.socket_path, layerwise=True, timeout=600)
    try:
        c.register_kv_caches(pages())
        server.kill()
        c.bind_connector_metadata(MusaCacheConnectorMetadata(
            [op(list(range(64)), [0, 1], load_start=0, load_end=64)]))
        c.start_load_kv(SimpleNamespace())
        fut = c._worker._pending_load[0]  # type: ignore[union-attr]
        with pytest.raises(Exception):  # noqa: B017 - the load fails, whatever the cause
            fut.result(30)
        assert all(ev.is_set() for ev in c._worker._layer_events)  # type: ignore[union-attr]
        for n in NAMES:
            c.wait_for_layer_load(n)
        c.wait_for_save()
        c.clear_connector_metadata()
        assert c.get_block_ids_with_load_errors() == {0, 1}
    finally:
        c.shutdown()


def test_pipeline_stages_never_share_a_cache(server, monkeypatch) -> None:
    """Found by a probe: every pipeline stage cached under "<model>/tp<rank>", so a stage
    holding other layers loaded another stage's KV."""
    import vllm.distributed.parallel_state as ps

    torch.manual_seed(3)
    stage0 = [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
    stage1 = [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]
    s0 = connector(server.socket_path, names=stage0)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 1)
    s1 = connector(server.socket_path, names=stage1)
    try:
        assert "/pp0/" in s0.namespace and "/pp1/" in s1.namespace
        kv0 = pages(stage0)
        write_token_kv(kv0, slots_for([0, 1], BS, 64), torch.randn(LAYERS, 2, 64, H, D))
        assert_kept_apart(s0, kv0, s1, pages(stage1))
    finally:
        s0.shutdown()
        s1.shutdown()


def assert_kept_apart(writer: MusaCacheConnector, writer_kv: dict[str, torch.Tensor],
                      reader: MusaCacheConnector, reader_kv: dict[str, torch.Tensor]) -> None:
    """What ``writer`` saves (64 tokens from blocks 0 and 1), ``reader`` cannot load."""
    tokens = list(range(64))
    writer.register_kv_caches(writer_kv)
    step(writer, [op(tokens, [0, 1], save_start=0, save_end=64)])
    reader.register_kv_caches(reader_kv)
    step(reader, [op(tokens, [2, 3], load_start=0, load_end=63)])
    assert reader.get_block_ids_with_load_errors() == {2, 3}
    assert not any(t.any() for t in reader_kv.values())


def test_fp8_formats_never_share_a_cache(server) -> None:
    """Found by a probe: vLLM holds every fp8 KV format as uint8, so a vLLM running
    fp8_e5m2 was served the bytes one running fp8_e4m3 wrote."""
    def fp8(fmt: str) -> MusaCacheConnector:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D,
                                 dtype=STR_DTYPE_TO_TORCH_DTYPE[fmt],
                                 kv_quant_mode=get_kv_quant_mode(fmt))
        return connector(server.socket_path, spec=spec, cache_dtype=fmt)

    a, b = fp8("fp8_e4m3"), fp8("fp8_e5m2")
    try:
        assert a.namespace != b.namespace
        kva = {n: torch.randint(1, 255, (NB, H, BS, 2 * D), dtype=torch.uint8) for n in NAMES}
        assert_kept_apart(a, kva, b, pages(dtype=torch.uint8))
    finally:
        a.shutdown()
        b.shutdown()


def test_a_quantized_kv_cache_of_unknown_format_is_refused(server) -> None:
    from musacache import ConfigError

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("fp8"))
    with pytest.raises(ConfigError, match="cache_dtype"):
        connector(server.socket_path, spec=spec)


def test_a_non_causal_model_gets_no_hits_and_saves_nothing(server) -> None:
    """Found by a probe: vLLM turns its own prefix caching off for non-causal attention
    (a token's KV depends on later tokens); the connector still offered prefix hits."""
    from vllm_sim import vllm_kinds

    kinds = vllm_kinds()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32,
                             non_causal=True)
    sch = connector(server.socket_path, role=KVConnectorRole.SCHEDULER, spec=spec)
    try:
        prompt = list(range(300))
        req = kinds.request("p", prompt)
        assert sch.get_num_new_matched_tokens(req, 0) == (0, False)
        sch.update_state_after_alloc(req, None, 0)  # type: ignore[arg-type]
        meta = sch.build_connector_meta(kinds.output(
            [kinds.new_req("p", prompt, list(range(10)), 0)], kinds.cached([], set(), [], []),
            {"p": 300}, set()))
        assert meta.ops == []  # type: ignore[attr-defined]
    finally:
        sch.shutdown()


def test_a_failed_load_taints_the_requests_saves_until_vllm_rewinds_it(server) -> None:
    """Found by a probe: with async scheduling vLLM plans a request's next step before it
    sees that the step's load failed; the worker had forgotten the failure by then and saved
    KV computed over blocks never loaded, which the recompute's save could not replace (a
    store never overwrites a cached chunk)."""
    from vllm_sim import vllm_kinds

    torch.manual_seed(3)
    prompt = list(range(3000, 3500))
    kv_true = torch.randn(LAYERS, 2, 500, H, D)
    saved_prompt(server.socket_path, prompt[:256], kv_true[:, :, :256])
    kinds = vllm_kinds()
    sch = connector(server.socket_path, role=KVConnectorRole.SCHEDULER)
    w = connector(server.socket_path, timeout=2)
    try:
        kv = pages()
        w.register_kv_caches(kv)
        req = kinds.request("r", prompt)
        assert admitted(sch, req) == 256
        blocks = list(range(NB))
        slots = slots_for(blocks, BS, 500)
        # Step N: load [0, 256), which times out (the server stalls); compute [256, 400).
        meta = sch.build_connector_meta(kinds.output(
            [kinds.new_req("r", prompt, blocks, 256)], kinds.cached([], set(), [], []),
            {"r": 144}, set()))
        w.bind_connector_metadata(meta)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            w.start_load_kv(SimpleNamespace())
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert w.get_block_ids_with_load_errors()
        write_token_kv(kv, slots[256:400], kv_true[:, :, 256:400] + 100)  # over garbage
        w.wait_for_save()
        w.clear_connector_metadata()
        # Step N+1, planned before step N's output was seen: the rest of the prompt, and
        # its save of [256, 500), all over the blocks never loaded.
        meta = sch.build_connector_meta(kinds.output(
            [], kinds.cached(["r"], set(), [None], [400]), {"r": 100}, set()))
        (o,) = meta.ops  # type: ignore[attr-defined]
        assert (o.save_start, o.save_end) == (256, 480)  # (whole blocks of 32)
        write_token_kv(kv, slots[400:500], kv_true[:, :, 400:500] + 100)
        step(w, meta.ops)  # type: ignore[attr-defined]
        # vLLM sees the failure, rewinds the request to 0 and computes it all again.
        assert recomputed(sch, w, kinds, kv, kv_true).save_start == 0
    finally:
        sch.shutdown()
        w.shutdown()
    assert torch.equal(loaded(server.socket_path, prompt, 480), kv_true[:, :, :480])


def test_a_connect_cut_short_by_its_time_limit_leaves_nothing_open(server) -> None:
    """Found by a probe: a hook's time limit that ran out between hello and the staging
    area's registration left the half-opened client open (a socket on each side and a
    server mapping per time)."""
    w = connector(server.socket_path, timeout=1)
    try:
        w.register_kv_caches(pages())
        srv = w._server  # type: ignore[attr-defined]
        opened: list[object] = []

        async def stall(client: object) -> None:
            opened.append(client)
            await asyncio.sleep(30)  # (the registration that never answers)

        for _ in range(3):
            w._loop.run(srv.aclose(), 5)  # type: ignore[attr-defined]
            srv.on_connect.insert(0, stall)
            with pytest.raises(TimeoutError):
                w._loop.run(srv.get(), 0.5)  # type: ignore[attr-defined]
            srv.on_connect.remove(stall)
            srv._failed_at = -1e9
        assert len(opened) == 3 and srv.client is None
        assert all(c._conn is None for c in opened)  # type: ignore[attr-defined]
    finally:
        w.shutdown()
