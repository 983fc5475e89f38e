"""RAG with document KV precomputed once, in S3, and reused by any process that answers.

Two steps, two processes, one bucket:

* ``ingest`` prefills every document on its own (the document at position 0) and puts its KV
  into a cache whose second tier is an S3 bucket with ``write_through=True``; ``flush()`` at
  the end waits until every chunk object is written.
* ``query`` runs in a *fresh* process: an empty host tier over the same bucket. It learns what
  the bucket holds when the cache opens, picks documents for the question with a toy keyword
  retriever, prefetches the leading document's chunks from S3 with a deadline, then computes
  the first token's logits with the cached prefix restored, and checks them against a plain
  prefill. Then it puts that prompt's KV and answers a follow-up question over the same
  documents.

What is reused, exactly: a key covers a whole prefix, because the KV of a token depends on
every token before it. A prompt ``[doc A][doc B][question]`` reuses doc A's KV (computed at
position 0, where A sits in this prompt too). Doc B's stored KV was computed at position 0 as
well, but here B follows A, so it is prefilled again, as is the question. The follow-up reuses
A and B: the first answer stored the whole prompt, and ``[doc A][doc B]`` is its prefix.

    python examples/rag_pipeline.py demo          # starts a moto S3 server, runs both steps
    python examples/rag_pipeline.py ingest --endpoint-url http://localhost:9000 --bucket kv
    python examples/rag_pipeline.py query  --endpoint-url http://localhost:9000 --bucket kv \\
        --question "how does the gpu scheduler work"

Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
shared config files, instance metadata); see examples/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# torch, transformers and musacache are imported inside ingest/query only: `demo` just starts
# an S3 server and two subprocesses, and --help should not wait for a model library to load.

TOPICS = ("gpu", "kernel", "storage", "network", "compiler", "database", "scheduler", "memory",
          "cache", "tokenizer", "attention", "quantization")

DEFAULT_QUESTION = "how does the gpu scheduler decide which kernel runs next"
DEFAULT_FOLLOW_UP = "and what happens when two kernels share one stream"

# float32 KV restored bit for bit, then the same kernels: only rounding separates the logits.
LOGITS_TOLERANCE = 1e-4


# -- the corpus and the retriever ---------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    doc_id: int
    keywords: tuple[str, ...]
    tokens: list[int]


def word_token(word: str, vocab_size: int) -> int:
    """A stable toy tokenizer: a word's id is a hash of it (the same in every process)."""
    digest = hashlib.blake2b(word.lower().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def make_corpus(num_docs: int, doc_tokens: int, vocab_size: int, seed: int) -> list[Document]:
    """Documents drawn from ``seed``: two topic keywords each, and a body of random ids whose
    length varies between half and all of ``doc_tokens`` (so most end inside a chunk).

    Both steps rebuild the corpus from the same flags, as both would read one document store.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    docs = []
    for i in range(num_docs):
        keywords = (TOPICS[i % len(TOPICS)], TOPICS[(3 * i + 5) % len(TOPICS)])
        length = int(rng.integers(max(1, doc_tokens // 2), doc_tokens + 1))
        title = [word_token(w, vocab_size) for w in ("document", str(i), *keywords)]
        body = rng.integers(0, vocab_size, max(0, length - len(title))).tolist()
        docs.append(Document(i, keywords, title + body))
    return docs


def retrieve(question: str, docs: list[Document], top_k: int) -> list[Document]:
    """Keyword overlap, ties broken by document id: a stand-in for a real retriever."""
    words = set(question.lower().split())
    scored = sorted(docs, key=lambda d: (-len(words & set(d.keywords)), d.doc_id))
    return scored[:top_k]


# -- the cache ------------------------------------------------------------------------------------


def cache_config(args: argparse.Namespace, spec: Any, *, write_through: bool) -> Any:
    import musacache
    from musacache.tiers.s3 import S3Tier

    s3 = S3Tier(bucket=args.bucket, prefix=args.prefix, endpoint_url=args.endpoint_url,
                region=args.region, write_through=write_through,
                create_bucket=getattr(args, "create_bucket", False), timeout=args.s3_timeout)
    return musacache.CacheConfig(
        spec=spec,
        # Random-init weights depend on the seed, so the KV does too: the seed names the model.
        namespace=f"example-llama-{args.model}-seed{args.seed}",
        chunk_size=args.chunk_size,
        tiers=(musacache.HostTier(capacity_bytes=args.host_mib * 1024**2), s3))


async def load_model(args: argparse.Namespace) -> Any:
    import asyncio

    import torch

    from musacache.demo.model import SIZES, build_model

    if args.threads:
        torch.set_num_threads(args.threads)  # on the loop's thread: the setting is global
    return await asyncio.to_thread(build_model, SIZES[args.model], seed=args.seed)


async def ingest(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import torch

    import musacache
    from musacache.demo.model import dense_from_hf, first_token_logits, kv_spec_of

    def prefill_kv(model: Any, tokens: torch.Tensor) -> torch.Tensor:
        _, hf_cache = first_token_logits(model, tokens)
        return dense_from_hf(hf_cache)

    model = await load_model(args)
    docs = make_corpus(args.num_docs, args.doc_tokens, int(model.config.vocab_size), args.seed)
    started = time.perf_counter()
    async with musacache.Cache(cache_config(args, kv_spec_of(model), write_through=True)) as cache:
        for doc in docs:
            tokens = torch.tensor(doc.tokens, dtype=torch.int64)
            kv = await asyncio.to_thread(prefill_kv, model, tokens)
            await cache.put(tokens, kv)
        # put() returns once the host tier owns the KV; the S3 writes run in the background.
        # This process is about to exit, so wait for them.
        await cache.flush()
        s3 = (await cache.stats())["tiers"]["s3"]
    return {"step": "ingest", "bucket": args.bucket, "prefix": args.prefix,
            "documents": [{"doc_id": d.doc_id, "keywords": list(d.keywords),
                           "tokens": len(d.tokens)} for d in docs],
            "tokens": sum(len(d.tokens) for d in docs),
            "s3_objects_written": s3["writes"], "s3_bytes_written": s3["bytes_in"],
            "s3_write_drops": s3["write_drops"],
            "elapsed_ms": round((time.perf_counter() - started) * 1000, 1)}


async def query(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import torch

    import musacache
    from musacache.demo.model import (
        dense_from_hf,
        first_token_logits,
        hf_from_dense,
        kv_spec_of,
    )

    def prefill(model: Any, tokens: torch.Tensor, restored_kv: torch.Tensor | None,
                ) -> tuple[torch.Tensor, Any]:
        restored = hf_from_dense(restored_kv, model) if restored_kv is not None else None
        return first_token_logits(model, tokens, restored)

    model = await load_model(args)
    vocab = int(model.config.vocab_size)
    docs = make_corpus(args.num_docs, args.doc_tokens, vocab, args.seed)
    ranked = retrieve(args.question, docs, args.top_k)
    doc_tokens = [t for d in ranked for t in d.tokens]
    questions = [args.question] + ([args.follow_up] if args.follow_up else [])
    prompts = [torch.tensor(doc_tokens + [word_token(w, vocab) for w in q.split()],
                            dtype=torch.int64) for q in questions]
    # The first forward at a new size pays for lazy initialisation; not a cost of the query.
    await asyncio.to_thread(prefill, model, torch.arange(len(prompts[0])) % vocab, None)

    answers = []
    config = cache_config(args, kv_spec_of(model), write_through=False)
    async with musacache.Cache(config) as cache:
        # open() listed the bucket: the directory now knows every chunk ingest wrote, and the
        # host tier is empty. Only the leading document's KV is valid in this prompt (it sits
        # at position 0, where it was computed), so that is what is worth bringing up.
        arrived = time.perf_counter()
        leading = torch.tensor(ranked[0].tokens, dtype=torch.int64)
        resident = await cache.prefetch(leading, timeout=args.prefetch_timeout)
        prefetch_ms = (time.perf_counter() - arrived) * 1000
        for i, (question, prompt) in enumerate(zip(questions, prompts)):
            if i:
                arrived = time.perf_counter()
            hit = await cache.get(prompt[:-1])  # the last token is computed: its logits answer
            logits, hf_cache = await asyncio.to_thread(
                prefill, model, prompt[hit.num_tokens:], hit.kv if hit else None)
            ttft_ms = (time.perf_counter() - arrived) * 1000
            # Keep this prompt's KV (host tier only: write_through is off here), so that a
            # follow-up over the same documents reuses all of them, not just the first.
            await cache.put(prompt, await asyncio.to_thread(dense_from_hf, hf_cache))
            started = time.perf_counter()
            reference, _ = await asyncio.to_thread(prefill, model, prompt, None)
            ttft_no_cache_ms = (time.perf_counter() - started) * 1000
            answers.append({
                "question": question, "prompt_tokens": len(prompt),
                "prompt_layout": [*({"part": f"doc {d.doc_id}", "tokens": len(d.tokens)}
                                    for d in ranked),
                                  {"part": "question", "tokens": len(prompt) - len(doc_tokens)}],
                "cached_tokens": hit.num_tokens, "served_by": dict(hit.tiers),
                "ttft_ms": round(ttft_ms, 3), "ttft_ms_no_cache": round(ttft_no_cache_ms, 3),
                "max_abs_diff": float((logits - reference).abs().max()),
                "logits_close": bool(torch.allclose(logits, reference, rtol=LOGITS_TOLERANCE,
                                                    atol=LOGITS_TOLERANCE)),
                "first_token": int(logits.argmax()),
            })
        s3 = (await cache.stats())["tiers"]["s3"]

    return {
        "step": "query",
        "retrieved": [{"doc_id": d.doc_id, "keywords": list(d.keywords), "tokens": len(d.tokens)}
                      for d in ranked],
        "prefetch_timeout_s": args.prefetch_timeout, "prefetched_tokens": resident,
        "prefetch_ms": round(prefetch_ms, 3),
        "s3_chunks_read": s3["hits"], "s3_bytes_read": s3["bytes_out"],
        "answers": answers, "logits_ok": all(a["logits_close"] for a in answers),
    }


# -- reports --------------------------------------------------------------------------------------


def print_ingest(r: dict[str, Any]) -> None:
    print(f"ingest: {len(r['documents'])} documents, {r['tokens']} tokens, prefilled at "
          f"position 0 each, KV written to s3://{r['bucket']}/{r['prefix']}/ "
          f"({r['s3_objects_written']} chunk objects, {r['s3_bytes_written'] / 2**20:.1f} MiB, "
          f"{r['s3_write_drops']} dropped) in {r['elapsed_ms'] / 1000:.1f} s")
    for d in r["documents"]:
        print(f"  doc {d['doc_id']:>2}  {d['tokens']:>5} tokens  keywords: "
              f"{', '.join(d['keywords'])}")


def _reuse_note(answer: dict[str, Any], first: bool) -> str:
    parts = answer["prompt_layout"]
    n = answer["cached_tokens"]
    covered, reused, rest = 0, [], []
    for p in parts:
        if covered + p["tokens"] <= n:
            reused.append(p["part"])
        else:
            rest.append(p["part"])
        covered += p["tokens"]
    why = ("a document's stored KV is valid only at the position it was computed at (0), and "
           "in this prompt the others follow another document" if first else
           "the previous answer put this whole prompt, so every document is a cached prefix now")
    return (f"reused {n} tokens ({' + '.join(reused) or 'nothing'}); prefilled "
            f"{answer['prompt_tokens'] - n} ({' + '.join(rest)}): {why}")


def print_query(r: dict[str, Any]) -> None:
    print("retrieved: " + ", ".join(f"doc {d['doc_id']} ({'/'.join(d['keywords'])})"
                                    for d in r["retrieved"]))
    lead = r["retrieved"][0]
    print(f"prefetch of doc {lead['doc_id']} from S3: {r['prefetched_tokens']} tokens in the "
          f"host tier after {r['prefetch_ms']:.0f} ms (deadline {r['prefetch_timeout_s']} s); "
          f"{r['s3_chunks_read']} chunks ({r['s3_bytes_read'] / 2**20:.1f} MiB) read from S3 "
          "in all")
    for i, a in enumerate(r["answers"]):
        print(f"{'question' if i == 0 else 'follow-up'}: {a['question']!r}")
        print("  prompt: " + " + ".join(f"[{p['part']}: {p['tokens']}]"
                                        for p in a["prompt_layout"])
              + f" = {a['prompt_tokens']} tokens")
        print("  " + _reuse_note(a, i == 0))
        print(f"  TTFT {a['ttft_ms']:.0f} ms with the cache"
              f"{' (prefetch included)' if i == 0 else ''}, {a['ttft_ms_no_cache']:.0f} ms "
              f"without; served by {a['served_by'] or 'nothing'}")
        print(f"  first-token logits equal a plain prefill's: "
              f"{'ok' if a['logits_close'] else 'MISMATCH'} (max abs diff {a['max_abs_diff']:.1e})")


# -- demo: both steps against a local moto server --------------------------------------------------

_COMMON_FLAGS = ("model", "seed", "num_docs", "doc_tokens", "chunk_size", "prefix", "threads",
                 "host_mib", "s3_timeout")


def _child_argv(args: argparse.Namespace, step: str, endpoint: str, bucket: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), step, "--endpoint-url", endpoint,
            "--bucket", bucket, "--region", "us-east-1"]
    for name in _COMMON_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    if step == "ingest":
        argv.append("--create-bucket")
    else:
        argv += ["--question", args.question, "--follow-up", args.follow_up,
                 "--top-k", str(args.top_k),
                 "--prefetch-timeout", str(args.prefetch_timeout)]
    if args.json:
        argv.append("--json")
    return argv


def demo(args: argparse.Namespace) -> int:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("the demo needs a local S3 server: pip install 'moto[server]' (in the same "
              "environment as aiobotocore), or run ingest and query with --endpoint-url",
              file=sys.stderr)
        return 2
    import logging

    # moto's HTTP server logs every request; the two steps report what matters.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # moto accepts any keys; real ones in the environment must not leak to it, and a
        # profile or endpoint set there must not redirect the children elsewhere.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID="moto-demo", AWS_SECRET_ACCESS_KEY="moto-demo",
                   AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        if not args.json:
            print(f"moto S3 server at {endpoint}, bucket {args.bucket}\n", flush=True)
        reports = {}
        for step in ("ingest", "query"):
            done = subprocess.run(_child_argv(args, step, endpoint, args.bucket), env=env,
                                  stdout=subprocess.PIPE if args.json else None, text=True,
                                  check=False)
            if done.returncode != 0:
                print(f"{step} failed with exit code {done.returncode}", file=sys.stderr)
                return done.returncode
            if args.json:
                reports[step] = json.loads(done.stdout)
            elif step == "ingest":
                print()
    finally:
        server.stop()
    if args.json:
        print(json.dumps({"endpoint": endpoint, "bucket": args.bucket, **reports}))
    return 0


# -- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    model = common.add_argument_group("model and corpus (use the same values for both steps)")
    # The sizes of musacache.demo, spelled out: importing it would load torch for --help.
    model.add_argument("--model", choices=("tiny", "small", "medium", "large"), default="small",
                       help="demo model size (default small; tiny is for tests)")
    model.add_argument("--seed", type=int, default=0, help="weights and corpus (default 0)")
    model.add_argument("--num-docs", type=int, default=8, help="documents (default 8)")
    model.add_argument("--doc-tokens", type=int, default=1024,
                       help="longest document in tokens; lengths vary down to half (default 1024)")
    model.add_argument("--chunk-size", type=int, default=256, help="tokens per cache chunk")
    s3 = common.add_argument_group("S3 (ingest and query)")
    s3.add_argument("--endpoint-url", default=None,
                    help="S3 endpoint, e.g. http://localhost:9000 for MinIO (default: AWS)")
    s3.add_argument("--bucket", default="musacache-rag-example", help="bucket name")
    s3.add_argument("--prefix", default="rag-example", help="object key prefix in the bucket")
    s3.add_argument("--region", default=None,
                    help="region (default: AWS_DEFAULT_REGION or your AWS config)")
    s3.add_argument("--s3-timeout", type=float, default=10.0,
                    help="longest wait for one S3 read, in seconds (default 10)")
    run = common.add_argument_group("run")
    run.add_argument("--host-mib", type=int, default=512, help="host tier capacity in MiB")
    run.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    run.add_argument("--json", action="store_true", help="print one JSON object")

    question = argparse.ArgumentParser(add_help=False)
    q = question.add_argument_group("question")
    q.add_argument("--question", default=DEFAULT_QUESTION,
                   help=f"the question (default {DEFAULT_QUESTION!r}); keywords: "
                        f"{', '.join(TOPICS)}")
    q.add_argument("--top-k", type=int, default=2, help="documents in the prompt (default 2)")
    q.add_argument("--follow-up", default=DEFAULT_FOLLOW_UP,
                   help="a second question over the same documents, answered after the first "
                        "('' for none)")
    q.add_argument("--prefetch-timeout", type=float, default=2.0,
                   help="seconds to wait for the leading document's chunks to reach the host "
                        "tier before prefilling; what is late is read from S3 by get (default 2)")

    p = argparse.ArgumentParser(
        description="RAG on musacache: precompute each document's KV into S3 (ingest), then "
                    "answer in a fresh process that prefetches it (query). `demo` runs both "
                    "against a moto S3 server it starts itself.",
        epilog="Credentials: the standard AWS chain (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
               "AWS_SESSION_TOKEN, ~/.aws). See examples/README.md for MinIO and AWS.")
    sub = p.add_subparsers(dest="step", required=True, metavar="{demo,ingest,query}")
    sub.add_parser("demo", parents=[common, question],
                   help="start a moto S3 server and run ingest, then query, as two processes")
    ingest_p = sub.add_parser("ingest", parents=[common],
                              help="prefill every document and write its KV to S3")
    ingest_p.add_argument("--create-bucket", action="store_true",
                          help="create the bucket if it does not exist")
    sub.add_parser("query", parents=[common, question],
                   help="in a fresh cache over the same bucket: retrieve, prefetch, answer")
    args = p.parse_args(argv)
    if args.num_docs < 1 or args.doc_tokens < 8 or args.chunk_size < 1:
        p.error("need --num-docs >= 1, --doc-tokens >= 8, --chunk-size >= 1")
    if getattr(args, "top_k", 1) < 1:
        p.error("--top-k must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step == "demo":
        return demo(args)
    import asyncio

    report = asyncio.run(ingest(args) if args.step == "ingest" else query(args))
    if args.json:
        print(json.dumps(report))
    elif args.step == "ingest":
        print_ingest(report)
    else:
        print_query(report)
    if args.step == "ingest":
        return 0 if report["s3_write_drops"] == 0 else 1
    return 0 if report["logits_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
