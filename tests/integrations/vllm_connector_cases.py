"""The vLLM connector against vLLM's own classes (run in the vLLM venv by tests/test_vllm.py).

- the scheduler-side properties of tests/test_vllm_plan.py, driven with vLLM's Request,
  NewRequestData, CachedRequestData and SchedulerOutput;
- the settings from ``kv_connector_extra_config``;
- vLLM's per-layer packed KV tensor ``[num_blocks, H, block_size, 2*D]`` (any physical
  order) moved by musacache's native transfer, against a torch reference.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_env import require

require("vllm", ".ci/vllm-env.sh")

from vllm_sim import run_request, vllm_kinds  # noqa: E402

from musacache import ConfigError, KVSpec, transfer  # noqa: E402
from musacache.integrations.vllm import (  # noqa: E402
    ConnectorSettings,
    MusaCacheConnector,
    MusaCacheConnectorMetadata,
    MusaCacheStepDone,
    _as_musacache_pages,
)
from test_vllm_plan import check_trace  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 700), cached=st.integers(0, 800), local=st.integers(0, 700),
       budget=st.sampled_from([1 << 30, 64, 200]), preempt=st.booleans())
def test_planner_with_vllms_own_request_and_scheduler_output(
        n: int, cached: int, local: int, budget: int, preempt: bool) -> None:
    cached = min(cached, n)
    prompt = list(range(3, 3 + n))
    planner, trace = run_request(vllm_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=0 if preempt else local, block_size=16,
                                 chunk_size=256, budget=budget,
                                 preempt_at=max(1, n // 2) if preempt else None,
                                 decode_steps=2)
    check_trace(prompt, cached, 16, 256, planner, trace, preempted=preempt)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 700), cached=st.integers(0, 800), lag=st.integers(0, 1))
def test_planner_of_several_ranks_with_vllms_own_classes(n: int, cached: int,
                                                         lag: int) -> None:
    cached = min(cached, n)
    prompt = list(range(3, 3 + n))
    planner, trace = run_request(vllm_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=0, block_size=16, chunk_size=256, budget=200,
                                 preempt_at=None, decode_steps=2, ranks=2, lag=lag)
    check_trace(prompt, cached, 16, 256, planner, trace, preempted=False)


def test_connector_is_a_kv_connector_with_every_hook() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )

    assert issubclass(MusaCacheConnector, KVConnectorBase_V1)
    assert issubclass(MusaCacheConnectorMetadata, KVConnectorMetadata)
    assert issubclass(MusaCacheStepDone, KVConnectorWorkerMetadata)
    # Workers send it to the scheduler's process, where vLLM merges every rank's.
    merged = pickle.loads(pickle.dumps(MusaCacheStepDone(3))).aggregate(MusaCacheStepDone(4))
    assert isinstance(merged, MusaCacheStepDone) and merged.step == 4
    abstract = getattr(MusaCacheConnector, "__abstractmethods__", frozenset())
    assert not abstract, f"unimplemented: {sorted(abstract)}"


def test_settings_from_extra_config() -> None:
    s = ConnectorSettings.from_extra_config({"musacache.socket": "/run/mc.sock",
                                             "musacache.config": "/etc/tiers.toml",
                                             "musacache.layerwise": True,
                                             "other.connector.key": 1})
    assert (s.socket, s.config, s.layerwise) == ("/run/mc.sock", "/etc/tiers.toml", True)
    with pytest.raises(ConfigError, match=r"musacache\.socket"):
        ConnectorSettings.from_extra_config({"musacache.config": "x.toml"})
    with pytest.raises(ConfigError, match=r"musacache\.sockett"):
        ConnectorSettings.from_extra_config({"musacache.socket": "s", "musacache.sockett": 1})
    with pytest.raises(ConfigError, match="timeout"):
        ConnectorSettings.from_extra_config({"musacache.socket": "s", "musacache.timeout": 0})


@pytest.mark.parametrize("key", ["timeout", "lookup_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e10, "nan", -1.0])
def test_timeouts_a_thread_cannot_wait_are_refused(key: str, value: object) -> None:
    """Found by a probe: NaN (json.loads accepts it), inf and 1e10 (past
    threading.TIMEOUT_MAX) were accepted; no load or save could then run."""
    with pytest.raises(ConfigError, match=key):
        ConnectorSettings.from_extra_config({"musacache.socket": "s",
                                             f"musacache.{key}": value})


def _mm(ident: str) -> list[object]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=10, length=100),
                                  mm_hash=ident)]


def _extra_keys() -> dict[str, dict[str, object]]:
    from vllm.lora.request import LoRARequest

    return {"lora": {"lora_request": LoRARequest("adapter-a", 1, "/tmp/a")},
            "image": {"mm_features": _mm("img-cat")},
            "cache_salt": {"cache_salt": "tenant-1"},
            "prompt_embeds": {"prompt_embeds": torch.randn(400, 8),
                              "prompt_is_token_ids": [not 10 <= i < 110 for i in range(400)]}}


@pytest.mark.parametrize("kind", ["lora", "image", "cache_salt", "prompt_embeds"])
def test_requests_vllm_keys_apart_are_never_cached(kind: str) -> None:
    """Found by a probe: the cache was keyed on token ids alone, so requests that vLLM's
    own block hashes keep apart (LoRA adapter, images, cache_salt, prompt embeddings) were
    served each other's KV. Such a request is neither looked up nor saved."""
    import concurrent.futures

    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.request import Request

    from musacache.integrations._vllm_plan import SchedulerPlanner

    extra = _extra_keys()[kind]
    asked: list[object] = []

    def start_lookup(tokens: object) -> concurrent.futures.Future[int]:
        asked.append(tokens)
        f: concurrent.futures.Future[int] = concurrent.futures.Future()
        f.set_result(400)
        return f

    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=start_lookup)
    prompt = list(range(3000, 3400))
    req = Request("a", prompt, SamplingParams(max_tokens=4), None, **extra)  # type: ignore[arg-type]
    assert planner.num_new_matched_tokens(req, 0) == (0, False)
    assert asked == []
    planner.after_alloc(req, 0)
    new = NewRequestData.from_request(req, (list(range(25)),))
    ops = planner.build(vllm_kinds().output([new], vllm_kinds().cached([], set(), [], []),
                                            {"a": 400}, set()))
    assert ops == []
    planner.build(vllm_kinds().output([], vllm_kinds().cached([], set(), [], []), {}, {"a"}))
    assert planner.tracked() == 0
    # The same prompt without extra keys is cached as before.
    plain = Request("b", prompt, SamplingParams(max_tokens=4), None)
    assert planner.num_new_matched_tokens(plain, 0) == (399, False)


@settings(max_examples=60, deadline=None)
@given(nb=st.integers(1, 9), h=st.integers(1, 4), bs=st.sampled_from([1, 4, 16, 32]),
       d=st.sampled_from([8, 32, 64]), layers=st.integers(1, 3),
       order=st.sampled_from(["nhbd", "nbhd", "hnbd"]), kv_in=st.sampled_from(["last-dim",
                                                                               "block"]),
       data=st.data())
def test_packed_vllm_pages_round_trip_against_torch(nb: int, h: int, bs: int, d: int,
                                                    layers: int, order: str, kv_in: str,
                                                    data: st.DataObject) -> None:
    """vLLM 0.32's logical [NB, H, BS, 2*D] per layer. GPU backends: K|V halves of the last
    dim, any physical order of the other dims. CPU_ATTN: the reference is vLLM's own reading
    (cpu_attn.py: view [NB, H, 2*BS, D], chunk dim 2)."""
    if kv_in == "block" and order != "nhbd":
        order = "nhbd"  # CPU_ATTN's tensor is contiguous (it views it)

    def packed() -> torch.Tensor:
        if order == "nhbd":
            return torch.randn(nb, h, bs, 2 * d).to(torch.bfloat16)
        if order == "nbhd":  # the NHD backends: blocks, tokens, heads in memory
            return torch.randn(nb, bs, h, 2 * d).to(torch.bfloat16).permute(0, 2, 1, 3)
        return torch.randn(h, nb, bs, 2 * d).to(torch.bfloat16).permute(1, 0, 2, 3)

    def k_v(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_in == "block":
            k, v = t.view(nb, h, 2 * bs, d).chunk(2, dim=2)
            return k, v
        return t[..., :d], t[..., d:]

    kv = [packed() for _ in range(layers)]
    spec = KVSpec(layers, h, d, torch.bfloat16)
    pages = _as_musacache_pages(kv, spec, kv_in)
    layout = pages.layout
    assert pages.spec == spec and transfer.describe(pages).spec() == spec
    slots = torch.tensor(data.draw(st.lists(st.integers(-1, nb * bs - 1), min_size=1,
                                            max_size=3 * nb * bs)), dtype=torch.int64)
    out = torch.zeros(spec.shape(len(slots)), dtype=torch.bfloat16)
    transfer.gather(pages, slots, out, layout)
    for i, t in enumerate(kv):
        k, v = k_v(t)
        for j, s in enumerate(slots.tolist()):
            if s < 0:
                assert not out[i, :, j].any()
                continue
            b, o = divmod(s, bs)
            assert torch.equal(out[i, 0, j], k[b, :, o])
            assert torch.equal(out[i, 1, j], v[b, :, o])
    # Scatter writes back exactly the rows gathered (the last write of a repeated slot).
    back = [torch.zeros_like(t) for t in kv]
    bpages = _as_musacache_pages(back, spec, kv_in)
    transfer.scatter(out, bpages, slots)
    last = {s: j for j, s in enumerate(slots.tolist()) if s >= 0}
    for i, t in enumerate(back):
        k, v = k_v(t)
        for s, j in last.items():
            b, o = divmod(s, bs)
            assert torch.equal(k[b, :, o], out[i, 0, j])
            assert torch.equal(v[b, :, o], out[i, 1, j])
