"""An agent loop: every turn resends the whole conversation, and only the new part is prefilled.

An agent framework calls the model once per step with the full context: system prompt, task,
then every tool result and model reply so far. Each turn here appends 200 to 400 tokens (a tool
output and a reply, random ids from a fixed seed) and then, like a server would:

    n = await cache.lookup(context)          # what is cached (moves no data)
    hit = await cache.get(context[:-1])       # the KV of that prefix; the last token is computed
    prefill(context[hit.num_tokens:])         # only the new tokens
    await cache.put(context, kv)              # the whole context, for the next turn

A turn rarely ends on a chunk boundary, so the previous turn's context ends in a partial chunk
(a *tail*). musacache stores tails and matches them as a prefix of the next, longer prompt.
A cache that keeps whole chunks only would reuse ``floor(prefix / chunk) * chunk`` tokens and
prefill the rest again on every turn; the example prints both hit rates and both TTFTs.

    python examples/agent_multiturn.py                   # small model, 8 turns, a table
    python examples/agent_multiturn.py --json            # the same as one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np
import torch

import musacache
from musacache.demo.model import (
    SIZES,
    build_model,
    dense_from_hf,
    first_token_logits,
    hf_from_dense,
    kv_spec_of,
)

# float32 KV restored bit for bit, then the same kernels: only rounding separates the logits.
LOGITS_TOLERANCE = 1e-4


def prefill(model: Any, tokens: torch.Tensor, restored_kv: torch.Tensor | None,
            ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Prefill ``tokens`` after ``restored_kv`` (worker thread): logits, the whole KV, seconds.

    The clock covers rebuilding the HuggingFace cache and the forward: both are on the path to
    the first token.
    """
    start = time.perf_counter()
    restored = hf_from_dense(restored_kv, model) if restored_kv is not None else None
    logits, hf_cache = first_token_logits(model, tokens, restored)
    elapsed = time.perf_counter() - start
    return logits, dense_from_hf(hf_cache), elapsed


async def run_agent(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    model = await asyncio.to_thread(build_model, SIZES[args.model], seed=args.seed)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(args.seed)
    lo, hi = args.turn_tokens
    start_tokens = rng.integers(0, vocab, args.system_tokens).tolist()
    appended = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()
                for _ in range(args.turns)]
    longest = args.system_tokens + sum(len(a) for a in appended)
    # The first forwards at a size not seen before are slower (lazy initialisation, fresh
    # buffers); run the longest one once so that the turns' timings pay less for it.
    await asyncio.to_thread(prefill, model, torch.arange(longest) % vocab, None)

    config = musacache.CacheConfig(
        spec=kv_spec_of(model), namespace=f"example-llama-{args.model}-seed{args.seed}",
        chunk_size=args.chunk_size,
        tiers=(musacache.HostTier(capacity_bytes=args.host_mib * 1024**2),))
    chunk = args.chunk_size
    turns = []
    context: list[int] = list(start_tokens)
    async with musacache.Cache(config) as cache:
        # Turn 0 is the system prompt and the task; every later turn appends a tool result and
        # the model's reply.
        for turn in range(args.turns + 1):
            if turn:
                context += appended[turn - 1]
            tokens = torch.tensor(context, dtype=torch.int64)

            available = await cache.lookup(tokens)
            t0 = time.perf_counter()
            hit = await cache.get(tokens[:-1])
            get_s = time.perf_counter() - t0
            n = hit.num_tokens
            logits, kv, prefill_s = await asyncio.to_thread(
                prefill, model, tokens[n:], hit.kv if n else None)
            await cache.put(tokens, kv)

            # The same turn on a cache that drops partial chunks: it holds whole chunks only.
            n_whole = (n // chunk) * chunk
            _, _, whole_s = await asyncio.to_thread(
                prefill, model, tokens[n_whole:],
                hit.kv.narrow(config.spec.token_dim, 0, n_whole) if n_whole else None)
            # And with no cache at all.
            reference, _, full_s = await asyncio.to_thread(prefill, model, tokens, None)

            turns.append({
                "turn": turn, "context_tokens": len(context),
                "new_tokens": len(context) - n, "lookup_tokens": available,
                "cached_tokens": n, "whole_chunk_cached_tokens": n_whole,
                "ttft_ms_cache": round((get_s + prefill_s) * 1000, 3),
                "ttft_ms_whole_chunks_only": round((get_s + whole_s) * 1000, 3),
                "ttft_ms_no_cache": round(full_s * 1000, 3),
                "logits_close": bool(torch.allclose(logits, reference, rtol=LOGITS_TOLERANCE,
                                                    atol=LOGITS_TOLERANCE)),
            })

    prompt_total = sum(t["context_tokens"] for t in turns)

    def total(key: str) -> int:
        return sum(t[key] for t in turns)

    def median_after_first(key: str) -> float:
        # Turn 0 has nothing to reuse; the median shrugs off a turn slowed by a busy machine.
        return round(float(np.median([t[key] for t in turns[1:]])), 3)

    return {
        "model": args.model, "chunk_size": chunk, "turns": turns,
        "prompt_tokens": prompt_total,
        "hit_rate": total("cached_tokens") / prompt_total,
        "whole_chunk_hit_rate": total("whole_chunk_cached_tokens") / prompt_total,
        "prefilled_tokens": prompt_total - total("cached_tokens"),
        "whole_chunk_prefilled_tokens": prompt_total - total("whole_chunk_cached_tokens"),
        "median_ttft_ms": {"cache": median_after_first("ttft_ms_cache"),
                           "whole_chunks_only": median_after_first("ttft_ms_whole_chunks_only"),
                           "no_cache": median_after_first("ttft_ms_no_cache")},
        "logits_ok": all(t["logits_close"] for t in turns),
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"agent loop: model {r['model']}, chunk {r['chunk_size']} tokens, "
          f"{len(r['turns']) - 1} turns after the system prompt")
    print(f"{'turn':>4} {'context':>7} {'cached':>6} {'whole':>6} {'prefill':>7} "
          f"{'TTFT ms':>8} {'whole':>8} {'none':>8}  logits")
    for t in r["turns"]:
        print(f"{t['turn']:>4} {t['context_tokens']:>7} {t['cached_tokens']:>6} "
              f"{t['whole_chunk_cached_tokens']:>6} {t['new_tokens']:>7} "
              f"{t['ttft_ms_cache']:>8.1f} {t['ttft_ms_whole_chunks_only']:>8.1f} "
              f"{t['ttft_ms_no_cache']:>8.1f}  {'ok' if t['logits_close'] else 'MISMATCH'}")
    tt = r["median_ttft_ms"]
    print(f"hit rate: {r['hit_rate']:.1%} with partial tails kept (musacache), "
          f"{r['whole_chunk_hit_rate']:.1%} if partial tail chunks were dropped")
    print(f"tokens prefilled: {r['prefilled_tokens']} vs {r['whole_chunk_prefilled_tokens']} "
          f"(whole chunks only) vs {r['prompt_tokens']} (no cache)")
    print(f"median TTFT of turns 1-{len(r['turns']) - 1}: {tt['cache']:.1f} ms vs "
          f"{tt['whole_chunks_only']:.1f} ms (whole chunks only) vs {tt['no_cache']:.1f} ms "
          "(no cache)")
    print(f"logits with the cache equal a full prefill's: {'ok' if r['logits_ok'] else 'MISMATCH'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A multi-turn agent loop on musacache: per turn lookup, get, prefill only "
                    "the new tokens, put. Prints cached tokens, hit rate and TTFT per turn, "
                    "with the cache, with a cache that drops partial tail chunks, and without.")
    p.add_argument("--model", choices=list(SIZES), default="small",
                   help="demo model size (default small; tiny is for tests)")
    p.add_argument("--turns", type=int, default=8, help="turns after the first (default 8)")
    p.add_argument("--system-tokens", type=int, default=600,
                   help="system prompt and task, the first turn's context (default 600)")
    p.add_argument("--turn-tokens", type=int, nargs=2, default=(200, 400), metavar=("MIN", "MAX"),
                   help="tokens each turn appends, drawn uniformly (default 200 400)")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per cache chunk")
    p.add_argument("--host-mib", type=int, default=512, help="host tier capacity in MiB")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    lo, hi = args.turn_tokens
    if args.turns < 1 or args.system_tokens < 1 or not 1 <= lo <= hi or args.chunk_size < 1:
        p.error("need --turns >= 1, --system-tokens >= 1, 1 <= MIN <= MAX, --chunk-size >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run_agent(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["logits_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
