"""``musacache demo`` end to end on a tiny model: real transformers, real cache, real numbers.

One demo run (module fixture) is shared by the checks on its JSON; a second, shorter run
proves the logits check fails when the restored KV is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import need_module

need_module("transformers")
need_module("matplotlib")

from musacache.demo import _model, _runner, _sizes, _workloads, main  # noqa: E402

# Tiny model, token counts / 16, chunks of 16 tokens: the structure of the default run
# (documents span whole chunks, turns end mid-chunk) in a few seconds. One thread, because
# two threads on a busy 2-core machine spend more time waiting at barriers than computing.
TINY = ["--size", "tiny", "--scale", "0.0625", "--chunk-size", "16", "--threads", "1",
        "--no-progress"]
CHUNK = 16
SYSTEM_PROMPT_TOKENS = 4096 // 16


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("demo")
    plot = out / "ttft.png"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([*TINY, "--json", "--plot", str(plot), "--disk-dir", str(out / "disk")])
    return code, json.loads(buf.getvalue()), plot


@pytest.mark.slow
def test_demo_exits_zero_and_every_logits_check_passes(
        demo_run: tuple[int, dict[str, Any], Path]) -> None:
    code, report, _ = demo_run
    assert code == 0
    assert report["logits_ok"] is True
    assert set(report["workloads"]) == {"rag", "multi_turn", "system_prompt"}
    for w in report["workloads"].values():
        assert w["logits_ok"] is True
        assert w["max_abs_diff"] <= report["logits_tolerance"]["atol"] + 1e-3
        assert all(r["logits_close"] for r in w["per_request"])


@pytest.mark.slow
def test_demo_reports_ttft_speedup_and_tiers(demo_run: tuple[int, dict[str, Any], Path]) -> None:
    _, report, _ = demo_run
    for w in report["workloads"].values():
        for column in ("without_cache", "with_cache"):
            assert w["ttft_ms"][column]["p50"] > 0
            assert w["ttft_ms"][column]["p95"] >= w["ttft_ms"][column]["p50"]
        assert w["speedup_p50"] == pytest.approx(
            w["ttft_ms"]["without_cache"]["p50"] / w["ttft_ms"]["with_cache"]["p50"])
        assert sum(t["bytes_used"] for t in w["tiers"].values()) > 0


@pytest.mark.slow
def test_rag_reuses_the_ingested_first_document(demo_run: tuple[int, dict[str, Any], Path],
                                                ) -> None:
    _, report, _ = demo_run
    rag = report["workloads"]["rag"]
    assert rag["ingest"]["prompts"] == 8
    doc_tokens = rag["ingest"]["tokens"] // 8
    # Every question starts with an ingested document, so it hits at least that much.
    assert all(r["cached_tokens"] >= doc_tokens for r in rag["per_request"])
    assert 0 < rag["hit_rate"] < 1


@pytest.mark.slow
def test_multi_turn_reuses_partial_tail_chunks(demo_run: tuple[int, dict[str, Any], Path],
                                               ) -> None:
    _, report, _ = demo_run
    turns = report["workloads"]["multi_turn"]["per_request"]
    assert turns[0]["cached_tokens"] == 0  # a cold conversation
    # Each turn reuses the whole previous prompt, which ends mid-chunk.
    for prev, cur in itertools.pairwise(turns):
        assert cur["cached_tokens"] == prev["prompt_tokens"]
    mt = report["workloads"]["multi_turn"]
    assert mt["hit_rate"] > mt["hit_rate_whole_chunks_only"]


@pytest.mark.slow
def test_system_prompt_is_computed_once(demo_run: tuple[int, dict[str, Any], Path]) -> None:
    _, report, _ = demo_run
    users = report["workloads"]["system_prompt"]["per_request"]
    assert users[0]["cached_tokens"] == 0
    assert all(u["cached_tokens"] >= SYSTEM_PROMPT_TOKENS for u in users[1:])


@pytest.mark.slow
def test_plot_is_a_png(demo_run: tuple[int, dict[str, Any], Path]) -> None:
    import matplotlib.image

    _, _, plot = demo_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(plot).shape[:2]
    assert width > height > 100  # three subplots side by side


@pytest.mark.slow
def test_logits_check_fails_when_restored_kv_is_wrong(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = _model.hf_from_dense

    def off_by_one(kv: torch.Tensor, model: Any) -> Any:
        # The KV of the right tokens, one position late: what a slot-mapping bug looks like.
        return real(torch.cat([kv.narrow(2, 0, 1), kv.narrow(2, 0, kv.shape[2] - 1)], dim=2),
                    model)

    monkeypatch.setattr(_runner, "hf_from_dense", off_by_one)
    code = main([*TINY, "--workloads", "multi_turn", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["logits_ok"] is False
    assert report["workloads"]["multi_turn"]["max_abs_diff"] > report["logits_tolerance"]["atol"]


def test_hf_cache_round_trip_is_exact() -> None:
    model = _model.build_model(_sizes.SIZES["tiny"], seed=0)
    spec = _model.kv_spec_of(model)
    kv = torch.randn(spec.shape(5), dtype=spec.dtype)
    back = _model.dense_from_hf(_model.hf_from_dense(kv, model))
    assert back.shape == kv.shape
    assert torch.equal(back, kv)


def test_bad_usage_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workloads", "rag,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    import musacache as mc

    model = _model.build_model(_sizes.SIZES["tiny"], seed=0)
    spec = _model.kv_spec_of(model)
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator()
                           .manual_seed(1))
    request = _workloads.Request(prompt, "same prompt twice")

    async def twice() -> list[_runner.RequestResult]:
        config = mc.CacheConfig(spec=spec, namespace="test-demo-full-hit", chunk_size=16,
                                tiers=(mc.HostTier(capacity_bytes=1 << 20),))
        async with mc.Cache(config) as cache:
            return [await _runner._timed_request(cache, model, request, piece_tokens=16)
                    for _ in range(2)]

    first, second = asyncio.run(twice())
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(prompt) - 1
    assert second.logits_close, second.max_abs_diff


def test_cache_keyword_follows_the_forward_signature() -> None:
    class Newer:
        def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...

    class Older:  # takes anything in **kwargs: an unknown cache= would vanish there
        def forward(self, input_ids: Any = None, past_key_values: Any = None,
                    **kwargs: Any) -> None: ...

    assert _model.cache_keyword(Newer) == "cache"
    assert _model.cache_keyword(Older) == "past_key_values"


def test_a_forward_fills_the_cache_it_is_given() -> None:
    # With a keyword the installed transformers ignores, the cache stays empty and
    # dense_from_hf fails: this runs at the lowest declared version too (.ci/demo-lowest.sh).
    model = _model.build_model(_sizes.SIZES["tiny"], seed=0)
    spec = _model.kv_spec_of(model)
    prompt = torch.arange(12) % model.config.vocab_size
    _, cache = _model.first_token_logits(model, prompt[:8])
    assert _model.dense_from_hf(cache).shape == spec.shape(8)
    _, cache = _model.first_token_logits(model, prompt[8:], cache)
    assert _model.dense_from_hf(cache).shape == spec.shape(12)


def test_device_option(capsys: pytest.CaptureFixture[str]) -> None:
    from musacache import devices

    assert "--device" in _help_text(capsys)
    if not devices.available("cuda"):
        assert main(["--device", "cuda", *TINY]) == 2
        assert "cuda" in capsys.readouterr().err
    assert main(["--device", "tpu"]) == 2


def _help_text(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["--help"]) == 0
    return capsys.readouterr().out
