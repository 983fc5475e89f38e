"""Smoke tests of examples/: each script runs as a user would run it (``python examples/X.py``,
a fresh process), with tiny sizes, and its printed JSON is checked against what the example
claims to show.

The model examples need transformers (the ``demo`` extra); the RAG demo needs moto. With
CI=true a missing one fails the test; elsewhere it skips.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from s3_servers import need

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# One torch thread: two threads on a busy 2-core machine wait at barriers more than they compute.
TINY_MODEL = ["--model", "tiny", "--threads", "1"]

pytestmark = pytest.mark.slow


def need_transformers() -> None:
    need(importlib.util.find_spec("transformers") is not None,
         "transformers (pip install -e '.[demo]')")


def run_example(script: str, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run ``python examples/<script> <args> --json`` from the repository root; its JSON."""
    env = dict(os.environ)
    # The examples must import the musacache under test, installed or not.
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, f"examples/{script}", *args, "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, (f"{script} exited with {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing; stderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


# -- custom_server.py ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["embedded", "serve-and-connect"])
def test_custom_server_self_test(mode: str) -> None:
    need_transformers()
    prefix, suffix, new = 40, 8, 4
    report = run_example("custom_server.py", "--mode", mode, *TINY_MODEL, "--self-test", "3",
                         "--prefix-tokens", str(prefix), "--suffix-tokens", str(suffix),
                         "--chunk-size", "16", "--max-new-tokens", str(new))
    assert report["mode"] == mode
    requests = report["requests"]
    assert len(requests) == 3
    first, *later = requests
    assert first["cached_tokens"] == 0  # a cold cache
    for r in requests:
        assert r["prompt_tokens"] == prefix + suffix
        assert len(r["tokens"]) == new
        # Greedy decoding after a restored prefix picks exactly the tokens a plain prefill does,
        # with the same probabilities (float32: equal up to rounding).
        assert r["tokens"] == r["uncached_tokens"]
        assert len(r["logprobs"]) == new
        assert r["max_logprob_diff"] < 1e-4
        assert r["ttft_ms"] > 0
    for r in later:
        # The shared prefix is served (the tokens before the divergence inside its chunk too);
        # the last prompt token never is.
        assert prefix <= r["cached_tokens"] <= prefix + suffix - 1
    assert report["all_same_as_uncached"] is True
    # The cache itself agrees: the later requests' hits were counted where the cache lives.
    assert report["cache_tokens"]["hit_tokens"] == sum(r["cached_tokens"] for r in later)


# -- agent_multiturn.py ----------------------------------------------------------------------------


def test_agent_multiturn_reuses_partial_tails() -> None:
    need_transformers()
    chunk = 16
    report = run_example("agent_multiturn.py", *TINY_MODEL, "--turns", "4",
                         "--system-tokens", "40", "--turn-tokens", "20", "40",
                         "--chunk-size", str(chunk))
    turns = report["turns"]
    assert len(turns) == 5
    assert turns[0]["cached_tokens"] == 0
    for prev, cur in itertools.pairwise(turns):
        assert 20 <= cur["context_tokens"] - prev["context_tokens"] <= 40
        # Everything the previous turn put is reused, its partial last chunk included...
        assert cur["lookup_tokens"] == prev["context_tokens"]
        assert cur["cached_tokens"] == prev["context_tokens"]
        # ...where a whole-chunks-only cache stops at the last chunk boundary.
        assert cur["whole_chunk_cached_tokens"] == prev["context_tokens"] // chunk * chunk
        assert cur["new_tokens"] == cur["context_tokens"] - cur["cached_tokens"]
    assert report["hit_rate"] > report["whole_chunk_hit_rate"] > 0
    total = sum(t["context_tokens"] for t in turns)
    assert report["hit_rate"] == pytest.approx(
        sum(t["cached_tokens"] for t in turns) / total)
    assert report["logits_ok"] is True
    assert all(t["logits_close"] for t in turns)


# -- rag_pipeline.py ------------------------------------------------------------------------------


def test_rag_pipeline_demo_against_moto() -> None:
    need_transformers()
    need(importlib.util.find_spec("moto") is not None, "moto[server]")
    report = run_example("rag_pipeline.py", "demo", *TINY_MODEL, "--num-docs", "4",
                         "--doc-tokens", "100", "--chunk-size", "16",
                         "--prefetch-timeout", "30")
    ingest, query = report["ingest"], report["query"]
    assert len(ingest["documents"]) == 4
    assert ingest["s3_objects_written"] >= ingest["tokens"] // 16
    assert ingest["s3_write_drops"] == 0

    # The query ran in a fresh process: whatever it reused came out of the bucket.
    doc_a, doc_b = query["retrieved"]
    assert query["s3_chunks_read"] >= doc_a["tokens"] // 16
    assert query["s3_bytes_read"] > 0
    assert query["prefetched_tokens"] == doc_a["tokens"]
    first, follow_up = query["answers"]
    # Exact prefixes: doc A (at position 0, as it was ingested) is reused, doc B is not.
    assert first["cached_tokens"] == doc_a["tokens"]
    assert first["served_by"] == {"host": doc_a["tokens"]}
    # The first answer put its prompt, so the follow-up reuses both documents.
    assert follow_up["cached_tokens"] == doc_a["tokens"] + doc_b["tokens"]
    for answer in (first, follow_up):
        assert answer["logits_close"] is True
        assert answer["max_abs_diff"] < 1e-4
    assert query["logits_ok"] is True


# -- paged_engine.py ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["embedded", "serve-and-connect"])
def test_paged_engine_restores_exact_kv(mode: str) -> None:
    system, turn = 100, 30
    report = run_example("paged_engine.py", "--mode", mode, "--layers", "2", "--kv-heads", "2",
                         "--head-dim", "16", "--block-size", "8", "--num-blocks", "64",
                         "--chunk-size", "32", "--system-tokens", str(system),
                         "--turn-tokens", str(turn), "--conversations", "2", "--turns", "3")
    assert report["mode"] == mode
    requests = report["requests"]
    assert len(requests) == 6
    last_prompt: dict[int, int] = {}
    for r in requests:
        assert r["ok"] is True and r["restored_ok"] is True
        assert r["computed_tokens"] == r["prompt_tokens"] - r["restored_tokens"]
        assert r["stored_tokens"] == r["prompt_tokens"]
        conv = r["conversation"]
        if conv in last_prompt:
            # A later turn restores the whole previous turn of its conversation.
            assert r["restored_tokens"] == last_prompt[conv]
        elif conv > 0:
            assert r["restored_tokens"] == system  # the shared system prompt only
        else:
            assert r["restored_tokens"] == 0
        last_prompt[conv] = r["prompt_tokens"]
    # Each request got other blocks than the one before it (freed blocks queue at the back),
    # so a restored prefix was written by the cache, not left over in the pages.
    for prev, cur in itertools.pairwise(requests):
        assert cur["first_block"] != prev["first_block"]
    assert report["all_ok"] is True
    assert report["restored_tokens"] == sum(r["restored_tokens"] for r in requests) > 0
