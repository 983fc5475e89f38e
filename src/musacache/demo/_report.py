"""What the demo prints: a table per workload, a JSON document, and a plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._runner import (
    LOGITS_ATOL,
    LOGITS_RTOL,
    DemoResult,
    RequestResult,
    WorkloadResult,
    percentile,
)

__all__ = ["format_report", "plot_ttft", "summarise", "to_json"]

JSON_FORMAT_VERSION = 1


def _ttft(requests: Sequence[RequestResult]) -> dict[str, dict[str, float]]:
    without = [r.ttft_ms_without_cache for r in requests]
    with_ = [r.ttft_ms_with_cache for r in requests]
    return {
        "without_cache": {"p50": percentile(without, 50), "p95": percentile(without, 95)},
        "with_cache": {"p50": percentile(with_, 50), "p95": percentile(with_, 95)},
    }


def _hit_rate(requests: Sequence[RequestResult]) -> float:
    return sum(r.cached_tokens for r in requests) / sum(r.prompt_tokens for r in requests)


def _summary(requests: Sequence[RequestResult], chunk_size: int) -> dict[str, Any]:
    ttft = _ttft(requests)
    return {
        "requests": len(requests),
        "ttft_ms": ttft,
        "speedup_p50": ttft["without_cache"]["p50"] / ttft["with_cache"]["p50"],
        "hit_rate": _hit_rate(requests),
        # The hit rate if partial tail chunks were thrown away, as caches that keep only whole
        # chunks do; the gap to hit_rate is what reusing tails is worth.
        "hit_rate_whole_chunks_only": (
            sum(r.cached_tokens // chunk_size * chunk_size for r in requests)
            / sum(r.prompt_tokens for r in requests)),
    }


def summarise(w: WorkloadResult, chunk_size: int) -> dict[str, Any]:
    """The figures of one workload, as they appear in the JSON and the tables."""
    put = [r.put_ms for r in w.requests]
    summary = _summary(w.requests, chunk_size)
    summary.update({
        "restore_ms_p50": percentile([r.restore_ms for r in w.requests], 50),
        "put_ms": {"total": sum(put), "mean": sum(put) / len(put)},
        "ingest": {"prompts": w.ingest_prompts, "tokens": w.ingest_tokens, "ms": w.ingest_ms},
        "logits_ok": all(r.logits_close for r in w.requests),
        "max_abs_diff": max(r.max_abs_diff for r in w.requests),
        "tiers": w.tier_stats,
    })
    groups = {g: [r for r in w.requests if r.group == g] for g in w.groups}
    summary["groups"] = {g: _summary(rs, chunk_size) for g, rs in groups.items() if rs}
    return summary


def to_json(result: DemoResult) -> dict[str, Any]:
    opts = result.options
    return {
        "format": JSON_FORMAT_VERSION,
        "model": result.model,
        "settings": {
            "seed": opts.seed, "threads": opts.threads, "scale": opts.scale,
            "chunk_size": opts.chunk_size, "tiers": list(result.tiers),
            "host_bytes": opts.host_bytes, "disk_bytes": opts.disk_bytes,
        },
        "logits_tolerance": {"rtol": LOGITS_RTOL, "atol": LOGITS_ATOL},
        "logits_ok": result.logits_ok,
        "elapsed_s": result.elapsed_s,
        "workloads": {
            w.name: {
                "title": w.title,
                "reuse": w.reuse,
                **summarise(w, opts.chunk_size),
                "per_request": [
                    {"label": r.label, "group": r.group, "prompt_tokens": r.prompt_tokens,
                     "cached_tokens": r.cached_tokens,
                     "ttft_ms_without_cache": r.ttft_ms_without_cache,
                     "ttft_ms_with_cache": r.ttft_ms_with_cache, "restore_ms": r.restore_ms,
                     "put_ms": r.put_ms, "max_abs_diff": r.max_abs_diff,
                     "logits_close": r.logits_close, "tiers": r.tiers}
                    for r in w.requests
                ],
            }
            for w in result.workloads
        },
    }


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


def _workload_table(w: WorkloadResult, chunk_size: int) -> list[str]:
    s = summarise(w, chunk_size)
    ttft = s["ttft_ms"]
    lines = [
        w.title,
        f"  reused on a hit: {w.reuse}",
        "                        TTFT p50     TTFT p95",
        f"  without cache    {ttft['without_cache']['p50']:10.1f} ms"
        f"  {ttft['without_cache']['p95']:8.1f} ms",
        f"  with musacache   {ttft['with_cache']['p50']:10.1f} ms"
        f"  {ttft['with_cache']['p95']:8.1f} ms"
        f"   (of which get + restore p50 {s['restore_ms_p50']:.1f} ms)",
        f"  speedup (p50)    {s['speedup_p50']:10.1f}x",
        f"  hit rate         {100 * s['hit_rate']:10.1f} %   cached tokens / prompt tokens "
        f"({100 * s['hit_rate_whole_chunks_only']:.1f} % if partial tail chunks were dropped)",
    ]
    for group, g in s["groups"].items():
        lines.append(
            f"    {group:<8} {g['requests']:3d} requests: p50 "
            f"{g['ttft_ms']['without_cache']['p50']:.1f} -> {g['ttft_ms']['with_cache']['p50']:.1f}"
            f" ms ({g['speedup_p50']:.1f}x), hit rate {100 * g['hit_rate']:.1f} %")
    if s["ingest"]["prompts"]:
        lines.append(f"  ingest           {s['ingest']['prompts']} prompts, "
                     f"{s['ingest']['tokens']} tokens prefilled and put in "
                     f"{s['ingest']['ms'] / 1000:.2f} s (before the timed requests)")
    lines.append(f"  put              {s['put_ms']['mean']:.1f} ms per request, "
                 f"{s['put_ms']['total'] / 1000:.2f} s in all (outside TTFT, includes flush)")
    tiers = ", ".join(f"{name} {_mib(t.get('bytes_used', 0))} ({t.get('hits', 0)} chunk hits)"
                      for name, t in s["tiers"].items())
    lines.append(f"  bytes per tier   {tiers}")
    verdict = "PASS" if s["logits_ok"] else "FAIL"
    lines.append(
        f"  logits check     {verdict}: first-token logits with the cache "
        f"{'match' if s['logits_ok'] else 'DO NOT match'} those without "
        f"(torch.allclose rtol={LOGITS_RTOL:g} atol={LOGITS_ATOL:g}) in "
        f"{sum(r.logits_close for r in w.requests)}/{len(w.requests)} requests; "
        f"max abs diff {s['max_abs_diff']:.2e}")
    return lines


def format_report(result: DemoResult) -> str:
    m = result.model
    opts = result.options
    head = [
        f"musacache demo: random-init Llama '{m['size']}' ({m['layers']} layers, hidden "
        f"{m['hidden_size']}, {m['heads']} heads / {m['kv_heads']} KV heads, "
        f"{m['parameters'] / 1e6:.1f} M parameters, {m['dtype']}), "
        f"{opts.threads} torch threads",
        f"cache: tiers {' -> '.join(result.tiers)}, chunks of {opts.chunk_size} tokens, "
        f"{m['kv_bytes_per_token']} KV bytes per token",
        "TTFT = time to the first token's logits; with the cache it includes cache.get.",
        "",
    ]
    body: list[str] = []
    for w in result.workloads:
        body.extend(_workload_table(w, opts.chunk_size))
        body.append("")
    verdict = ("all logits checks passed" if result.logits_ok
               else "A LOGITS CHECK FAILED: the cache changed the model's output")
    return "\n".join([*head, *body, f"{verdict}; {result.elapsed_s:.1f} s in all"])


def plot_ttft(result: DemoResult, path: str) -> None:
    """One subplot per workload: TTFT of each request, with and without the cache."""
    # A bare Figure renders to a file with Agg and leaves pyplot's global state (backend,
    # open figures) alone, so a caller's own plotting is unaffected.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    def ms_label(value: float, _pos: int) -> str:
        # Plain milliseconds at 1, 2 and 5 of each decade; log axes default to 10^x.
        mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0
        return f"{value:g}" if round(mantissa, 6) in (1, 2, 5) else ""

    n = len(result.workloads)
    fig = Figure(figsize=(5.2 * n, 4.2))
    axes = fig.subplots(1, n, squeeze=False)
    for ax, w in zip(axes[0], result.workloads, strict=True):
        s = summarise(w, result.options.chunk_size)
        x = list(range(1, len(w.requests) + 1))
        ax.plot(x, [r.ttft_ms_without_cache for r in w.requests], "o-", color="tab:red",
                label="without cache (full prefill)")
        ax.plot(x, [r.ttft_ms_with_cache for r in w.requests], "s-", color="tab:blue",
                label="with musacache")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(ms_label))
        ax.yaxis.set_minor_formatter(FuncFormatter(ms_label))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"{w.unit} (in arrival order)")
        ax.set_ylabel("TTFT (ms, log scale)")
        ax.set_title(f"{w.name}: p50 speedup {s['speedup_p50']:.1f}x, "
                     f"hit rate {100 * s['hit_rate']:.0f} %", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = result.model
    fig.suptitle(f"musacache demo: time to first token, random-init Llama '{m['size']}' "
                 f"({m['layers']} layers, hidden {m['hidden_size']}, {m['dtype']}), "
                 f"{result.options.threads} CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
