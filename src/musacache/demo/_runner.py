"""The demo pipeline: every request prefilled twice, once from scratch and once from the cache.

TTFT without the cache is a full prefill. TTFT with the cache is ``cache.get`` (restore the
cached prefix into a HuggingFace cache) plus a forward over the uncached suffix, up to the
logits that choose the first token. After each request the prompt's KV is put, as a server
would, so later requests can hit it; that time is measured apart from TTFT.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from .. import Cache, CacheConfig, DiskTier, HostTier, devices
from ._model import (
    build_model,
    dense_from_hf,
    first_token_logits,
    hf_from_dense,
    kv_spec_of,
)
from ._sizes import ModelSize
from ._workloads import WORKLOAD_NAMES, Request, Workload, WorkloadShape, make_workloads

__all__ = ["DemoOptions", "DemoResult", "RequestResult", "WorkloadResult", "run_demo"]

# In float32 the cache returns the KV bit for bit, so with and without the cache differ only
# by the rounding of differently shaped matmuls (about 1e-6 measured); KV restored one
# position late moves the logits by about 1e-2, two orders of magnitude past these.
LOGITS_RTOL = 1e-4
LOGITS_ATOL = 1e-4

# The uncached suffix after a hit is prefilled in pieces of this many tokens at --scale 1
# (see first_token_logits); a miss is one causal prefill, the same as without the cache.
SUFFIX_PIECE_TOKENS = 1024


@dataclass(frozen=True)
class DemoOptions:
    size: ModelSize
    seed: int = 0
    threads: int = 2
    scale: float = 1.0
    chunk_size: int = 256
    host_bytes: int = 256 * 1024**2
    disk_bytes: int = 2 * 1024**3
    #: Where the disk tier keeps its files; None means a temporary folder removed afterwards.
    disk_dir: str | None = None
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    progress: bool = True
    #: RAG questions per retrieval (1 = every question retrieves anew).
    rag_questions_per_retrieval: int = 3
    #: Where the model runs: "auto" (the accelerator when there is one), cpu, cuda, musa.
    device: str = "auto"


@dataclass(frozen=True)
class RequestResult:
    label: str
    group: str
    prompt_tokens: int
    #: Tokens whose KV came from the cache (at most prompt_tokens - 1: the last is computed).
    cached_tokens: int
    ttft_ms_without_cache: float
    ttft_ms_with_cache: float
    #: The part of ttft_ms_with_cache spent in cache.get and building the HuggingFace cache.
    restore_ms: float
    put_ms: float
    max_abs_diff: float
    logits_close: bool
    #: Tokens served by each tier for this request.
    tiers: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadResult:
    name: str
    title: str
    reuse: str
    requests: tuple[RequestResult, ...]
    ingest_prompts: int
    ingest_tokens: int
    ingest_ms: float
    #: Per tier: bytes_used, capacity_bytes and chunks right after this workload (the cache
    #: is shared, so these accumulate), and the counters of COUNTERS during this workload.
    tier_stats: dict[str, dict[str, Any]]
    groups: tuple[str, ...] = ()
    unit: str = "request"


@dataclass(frozen=True)
class DemoResult:
    options: DemoOptions
    model: dict[str, Any]
    tiers: tuple[str, ...]
    workloads: tuple[WorkloadResult, ...]
    elapsed_s: float

    @property
    def logits_ok(self) -> bool:
        return all(r.logits_close for w in self.workloads for r in w.requests)


def _piece_tokens(opts: DemoOptions) -> int:
    # Scaled with the prompts, so that quick runs split long suffixes as the full run does.
    return max(1, round(SUFFIX_PIECE_TOKENS * opts.scale))


def _now(model: LlamaForCausalLM) -> float:
    """The time once the model's device has finished what was queued (kernels run
    asynchronously on an accelerator, so a timer read alone would time the queueing)."""
    device = model.device
    if device.type != "cpu":
        module = devices.accelerator_module(device.type)
        if module is not None:
            module.synchronize(device)
    return time.perf_counter()


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _tier_configs(opts: DemoOptions, disk_dir: str) -> tuple[HostTier, DiskTier]:
    return (HostTier(capacity_bytes=opts.host_bytes),
            DiskTier(path=disk_dir, capacity_bytes=opts.disk_bytes))


async def _timed_request(cache: Cache, model: LlamaForCausalLM, req: Request,
                         piece_tokens: int) -> RequestResult:
    tokens = req.tokens

    t0 = _now(model)
    reference, _ = first_token_logits(model, tokens)
    t1 = _now(model)

    hit = await cache.get(tokens)
    # The first token's logits come from the last prompt token, so that token is always
    # computed, even when the whole prompt is cached.
    reused = min(hit.num_tokens, len(tokens) - 1)
    restored = hf_from_dense(hit.kv.narrow(2, 0, reused), model) if reused else None
    t2 = _now(model)
    logits, hf_cache = first_token_logits(model, tokens[reused:], restored,
                                          piece_tokens=piece_tokens if reused else 0)
    t3 = _now(model)

    await cache.put(tokens, dense_from_hf(hf_cache))
    # Waiting for the background tier writes keeps them out of the next request's timing;
    # they are part of the put cost reported.
    await cache.flush()
    t4 = time.perf_counter()

    return RequestResult(
        label=req.label, group=req.group, prompt_tokens=len(tokens), cached_tokens=reused,
        ttft_ms_without_cache=_ms(t1 - t0), ttft_ms_with_cache=_ms(t3 - t1),
        restore_ms=_ms(t2 - t1), put_ms=_ms(t4 - t3),
        max_abs_diff=float((logits - reference).abs().max()),
        logits_close=bool(torch.allclose(logits, reference, rtol=LOGITS_RTOL, atol=LOGITS_ATOL)),
        tiers=dict(hit.tiers),
    )


async def _ingest(cache: Cache, model: LlamaForCausalLM, prompts: Sequence[torch.Tensor],
                  bar: tqdm[Any]) -> float:
    """Prefill and put each prompt, as a RAG pipeline precomputes its documents; seconds."""
    start = time.perf_counter()
    for prompt in prompts:
        _, hf_cache = first_token_logits(model, prompt)
        await cache.put(prompt, dense_from_hf(hf_cache))
        bar.update(1)
    await cache.flush()
    return time.perf_counter() - start


# Counters of cache.stats()["tiers"][name] reported as their change during one workload.
COUNTERS: tuple[str, ...] = ("hits", "misses", "evictions", "promotions", "demotions")
_LEVELS: tuple[str, ...] = ("bytes_used", "capacity_bytes", "chunks")


def _tier_stats(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]],
                ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, stats in after.items():
        row: dict[str, Any] = {k: stats[k] for k in _LEVELS if k in stats}
        row.update({k: stats[k] - before.get(name, {}).get(k, 0) for k in COUNTERS if k in stats})
        out[name] = row
    return out


async def _run_workload(cache: Cache, model: LlamaForCausalLM, workload: Workload,
                        opts: DemoOptions) -> WorkloadResult:
    before = (await cache.stats())["tiers"]
    with tqdm(total=len(workload.ingest) + len(workload.requests), desc=workload.name,
              unit="prefill", file=sys.stderr, disable=not opts.progress,
              dynamic_ncols=True) as bar:
        if workload.ingest:
            bar.set_postfix_str("ingest")
        ingest_s = await _ingest(cache, model, workload.ingest, bar)
        bar.set_postfix_str("")
        results = []
        for req in workload.requests:
            results.append(await _timed_request(cache, model, req, _piece_tokens(opts)))
            bar.update(1)
    return WorkloadResult(
        name=workload.name, title=workload.title, reuse=workload.reuse,
        requests=tuple(results), ingest_prompts=len(workload.ingest),
        ingest_tokens=sum(len(p) for p in workload.ingest), ingest_ms=_ms(ingest_s),
        tier_stats=_tier_stats(before, (await cache.stats())["tiers"]), groups=workload.groups,
        unit=workload.unit,
    )


async def _warm_up(model: LlamaForCausalLM, chunk_size: int) -> None:
    """Run every code path once, untimed: first calls pay for lazy inits and thread pools.

    A throwaway cache is used so that the demo's own cache starts empty and its counters
    count only the demo.
    """
    spec = kv_spec_of(model)
    tokens = torch.arange(2 * chunk_size + 8) % model.config.vocab_size
    config = CacheConfig(spec=spec, namespace="musacache-demo-warm-up",
                         tiers=(HostTier(capacity_bytes=4 * spec.nbytes(chunk_size)),),
                         chunk_size=chunk_size)
    async with Cache(config) as cache:
        _, hf_cache = first_token_logits(model, tokens[:-8])
        await cache.put(tokens[:-8], dense_from_hf(hf_cache))
        hit = await cache.get(tokens)
        first_token_logits(model, tokens[hit.num_tokens:], hf_from_dense(hit.kv, model))


def _model_info(size: ModelSize, model: LlamaForCausalLM) -> dict[str, Any]:
    spec = kv_spec_of(model)
    return {
        "size": size.name, "layers": spec.num_layers, "hidden_size": size.hidden_size,
        "heads": size.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": size.vocab_size, "dtype": str(spec.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(model.device),
        "kv_bytes_per_token": spec.bytes_per_token,
    }


async def run_demo(opts: DemoOptions) -> DemoResult:
    """Build the model, run the chosen workloads through one cache, and measure them."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        return await _run_demo(opts)
    finally:
        torch.set_num_threads(threads_before)  # the setting is process-wide


async def _run_demo(opts: DemoOptions) -> DemoResult:
    started = time.perf_counter()
    model = build_model(opts.size, seed=opts.seed)
    cast(Any, model).to(devices.resolve(opts.device))  # in place; transformers mistypes .to
    await _warm_up(model, opts.chunk_size)
    shape = dataclasses.replace(WorkloadShape(),
                                rag_questions_per_retrieval=opts.rag_questions_per_retrieval)
    workloads = make_workloads(shape.scaled(opts.scale), vocab=opts.size.vocab_size,
                               seed=opts.seed, names=opts.workloads)
    disk_dir = opts.disk_dir or tempfile.mkdtemp(prefix="musacache-demo-")
    try:
        tiers = _tier_configs(opts, disk_dir)
        config = CacheConfig(spec=kv_spec_of(model), namespace=f"musacache-demo-{opts.size.name}",
                             tiers=tiers, chunk_size=opts.chunk_size)
        async with Cache(config) as cache:
            # The demo measures from a cold cache; chunks an earlier run left in --disk-dir
            # would turn first requests into hits.
            await cache.clear()
            results = [await _run_workload(cache, model, w, opts) for w in workloads]
    finally:
        if opts.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    return DemoResult(
        options=opts, model=_model_info(opts.size, model),
        tiers=tuple(t.name for t in tiers),
        workloads=tuple(results), elapsed_s=time.perf_counter() - started,
    )


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))
