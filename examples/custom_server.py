"""A minimal inference server of your own, with musacache in front of the prefill.

Standard library HTTP (asyncio.start_server) serving ``POST /generate`` with a small
random-init Llama. Per request:

1. ``await cache.prefetch(tokens)``: start bringing the cached prefix up to the hottest tier
   while the request is parsed and queued;
2. ``hit = await cache.get(tokens[:-1])``: the last prompt token is always computed, because
   its logits choose the first generated token;
3. restore ``hit.kv`` into the HuggingFace cache and prefill only ``tokens[hit.num_tokens:]``;
4. ``await cache.put(tokens, kv)`` with the whole prompt's KV, so the next request that shares
   a prefix with this one skips it; greedy decoding runs meanwhile.

The same code runs against an embedded ``musacache.Cache`` or a node server reached with
``musacache.connect()``: the two have the same async API.

    python examples/custom_server.py --self-test 4                     # embedded, prints results
    python examples/custom_server.py --mode serve-and-connect --self-test 4
    python examples/custom_server.py                                   # serve on :8000
    curl -s localhost:8000/generate -d '{"prompt_ids": [1, 2, 3], "max_new_tokens": 4}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
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

MAX_BODY_BYTES = 16 * 1024**2
# float32 KV restored bit for bit, then the same kernels: only rounding separates the
# log-probabilities of a cached run from a plain prefill's.
LOGPROB_TOLERANCE = 1e-4


# -- the model side ------------------------------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]
    #: log-probability of each generated token
    logprobs: list[float]
    cached_tokens: int
    ttft_ms: float


def _decode(model: Any, logits: torch.Tensor, hf_cache: Any, max_new_tokens: int,
            ) -> tuple[list[int], list[float]]:
    """Greedy decoding from the first token's logits (runs in a worker thread)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < max_new_tokens:
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
        if len(tokens) == max_new_tokens:
            break
        logits, hf_cache = first_token_logits(model, torch.tensor([token]), hf_cache)
    return tokens, logprobs


def _prefill(model: Any, suffix: torch.Tensor, restored_kv: torch.Tensor | None,
             ) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Prefill ``suffix`` after the restored prefix; returns logits, HF cache, prompt KV."""
    restored = hf_from_dense(restored_kv, model) if restored_kv is not None else None
    logits, hf_cache = first_token_logits(model, suffix, restored)
    # dense_from_hf copies, so decoding can extend hf_cache while the cache reads this.
    return logits, hf_cache, dense_from_hf(hf_cache)


class Engine:
    """One model, one cache; requests are prefilled one at a time, as on a single device."""

    def __init__(self, model: Any, cache: Any) -> None:
        self.model = model
        self.cache = cache
        self.vocab_size = int(model.config.vocab_size)
        # The model uses every core for one forward; two at once would only fight for them.
        self._device_lock = asyncio.Lock()

    async def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        arrived = time.perf_counter()
        tokens = torch.tensor(prompt, dtype=torch.int64)
        # Without a timeout, prefetch only schedules the promotions and returns: the copies
        # overlap with the wait for the device lock below.
        await self.cache.prefetch(tokens)
        hit = await self.cache.get(tokens[:-1])
        async with self._device_lock:
            logits, hf_cache, prompt_kv = await asyncio.to_thread(
                _prefill, self.model, tokens[hit.num_tokens:], hit.kv if hit else None)
            ttft_ms = (time.perf_counter() - arrived) * 1000
            # Store the prompt while decoding: the next request sharing this prefix can hit it
            # before this one has finished generating.
            _stored, (generated, logprobs) = await asyncio.gather(
                self.cache.put(tokens, prompt_kv),
                asyncio.to_thread(_decode, self.model, logits, hf_cache, max_new_tokens))
        return Generation(generated, logprobs, hit.num_tokens, ttft_ms)


def warm_up(model: Any, num_tokens: int) -> None:
    # At full length: the first forwards at a size not seen before are slower (lazy
    # initialisation, fresh buffers), which would otherwise land on the first request.
    tokens = torch.arange(max(num_tokens, 32)) % int(model.config.vocab_size)
    _logits, hf_cache = first_token_logits(model, tokens)
    first_token_logits(model, tokens[:16], hf_from_dense(dense_from_hf(hf_cache), model))


def generate_uncached(model: Any, prompt: list[int], max_new_tokens: int,
                      ) -> tuple[list[int], list[float], float]:
    """The reference: a full prefill, no cache (tokens, logprobs, TTFT in ms)."""
    start = time.perf_counter()
    logits, hf_cache = first_token_logits(model, torch.tensor(prompt, dtype=torch.int64))
    ttft_ms = (time.perf_counter() - start) * 1000
    return *_decode(model, logits, hf_cache, max_new_tokens), ttft_ms


# -- the HTTP side -------------------------------------------------------------------------------


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error"}


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """Method, path and body of one HTTP/1.1 request (body sized by Content-Length)."""
    request_line = (await reader.readline()).decode("latin-1").strip()
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"not an HTTP/1.x request line: {request_line[:80]!r}")
    method, path, _version = parts
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise HttpError(400, f"malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(400, "chunked bodies are not supported: send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, "Content-Length is not a number") from None
    if length < 0 or length > MAX_BODY_BYTES:
        raise HttpError(413, f"body of {length} bytes (at most {MAX_BODY_BYTES})")
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def parse_generate(body: bytes, vocab_size: int, default_max_new: int,
                   ) -> tuple[list[int], int, bool]:
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, f"body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise HttpError(400, "body must be a JSON object")
    tokens = req.get("tokens", req.get("prompt_ids"))
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise HttpError(400, 'need "tokens" (or "prompt_ids"): a non-empty list of token ids')
    if not all(0 <= t < vocab_size for t in tokens):
        raise HttpError(400, f"token ids must be in [0, {vocab_size})")
    max_new = req.get("max_new_tokens", default_max_new)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or not 0 <= max_new <= 4096:
        raise HttpError(400, '"max_new_tokens" must be an int in [0, 4096]')
    logprobs = req.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise HttpError(400, '"logprobs" must be true or false')
    return tokens, max_new, logprobs


async def write_response(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    writer.write(head.encode("latin-1") + body)
    await writer.drain()


def http_handler(engine: Engine, default_max_new: int) -> Any:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path, body = await read_request(reader)
                if path != "/generate":
                    raise HttpError(404, f"no route {path}: POST /generate")
                if method != "POST":
                    raise HttpError(405, "use POST /generate")
                tokens, max_new, logprobs = parse_generate(body, engine.vocab_size,
                                                           default_max_new)
                gen = await engine.generate(tokens, max_new)
                reply = {"tokens": gen.tokens, "cached_tokens": gen.cached_tokens,
                         "prompt_tokens": len(tokens), "ttft_ms": round(gen.ttft_ms, 3)}
                if logprobs:
                    reply["logprobs"] = gen.logprobs
                await write_response(writer, 200, reply)
            except HttpError as e:
                await write_response(writer, e.status, {"error": str(e)})
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # the client went away; nobody to answer
            except Exception as e:  # one bad request must not take the server down
                print(f"error serving a request: {e!r}", file=sys.stderr)
                await write_response(writer, 500, {"error": repr(e)})
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return handle


async def post_json(host: str, port: int, path: str, payload: Any) -> tuple[int, Any]:
    """A minimal HTTP/1.1 client for the self-test (one request per connection)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        body = json.dumps(payload).encode()
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
                     + body)
        await writer.drain()
        raw = await reader.read()  # Connection: close, so the body ends at EOF
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, data = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(data)


# -- the cache: embedded, or a node server ------------------------------------------------------


def namespace_for(args: argparse.Namespace) -> str:
    # Random-init weights depend on the seed, so the KV does too: the seed is part of the model.
    return f"example-llama-{args.model}-seed{args.seed}"


def server_config_toml(spec: musacache.KVSpec, namespace: str, chunk_size: int,
                       host_bytes: int) -> str:
    return (f'namespace = "{namespace}"\n'
            f"chunk_size = {chunk_size}\n"
            "[spec]\n"
            f"num_layers = {spec.num_layers}\n"
            f"num_kv_heads = {spec.num_kv_heads}\n"
            f"head_dim = {spec.head_dim}\n"
            f'dtype = "{str(spec.dtype).removeprefix("torch.")}"\n'
            "[[tiers]]\n"
            'kind = "host"\n'
            f"capacity_bytes = {host_bytes}\n")


@contextlib.asynccontextmanager
async def node_server(config_toml: str, startup_timeout: float = 120.0) -> AsyncIterator[str]:
    """Run ``python -m musacache serve`` on a socket in a temporary folder; yield its path."""
    with tempfile.TemporaryDirectory(prefix="musacache-example-") as tmp:
        config = Path(tmp) / "server.toml"
        await asyncio.to_thread(config.write_text, config_toml)
        sock = str(Path(tmp) / "run" / "musacache.sock")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "musacache", "serve", "--socket", sock,
            "--config", str(config), "--log-level", "WARNING",
            stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            # The server prints one line once it listens; nothing else goes to stdout.
            line = await asyncio.wait_for(proc.stdout.readline(), startup_timeout)
            if b"listening" not in line:
                await proc.wait()
                raise RuntimeError(f"musacache serve exited with {proc.returncode} "
                                   "before listening (see its errors above)")
            yield sock
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


@contextlib.asynccontextmanager
async def open_cache(args: argparse.Namespace, spec: musacache.KVSpec) -> AsyncIterator[Any]:
    namespace = namespace_for(args)
    if args.mode == "embedded":
        config = musacache.CacheConfig(
            spec=spec, namespace=namespace, chunk_size=args.chunk_size,
            tiers=(musacache.HostTier(capacity_bytes=args.host_mib * 1024**2),))
        async with musacache.Cache(config) as cache:
            yield cache
    elif args.mode == "connect":
        async with musacache.connect(args.socket, spec=spec, namespace=namespace) as cache:
            yield cache
    else:
        toml = server_config_toml(spec, namespace, args.chunk_size, args.host_mib * 1024**2)
        async with node_server(toml) as sock, musacache.connect(
                sock, spec=spec, namespace=namespace, chunk_size=args.chunk_size) as cache:
            yield cache


async def token_stats(cache: Any) -> dict[str, int]:
    stats = await cache.stats()  # a coroutine on both the embedded cache and the client
    return {k: int(v) for k, v in stats["tokens"].items()}


# -- main -----------------------------------------------------------------------------------------


def self_test_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """N prompts that share a ``--prefix-tokens`` system prompt, then differ."""
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(0, vocab_size, args.prefix_tokens).tolist()
    return [prefix + rng.integers(0, vocab_size, args.suffix_tokens).tolist()
            for _ in range(args.self_test)]


async def run_self_test(args: argparse.Namespace, engine: Engine, host: str, port: int,
                        ) -> dict[str, Any]:
    results = []
    for i, prompt in enumerate(self_test_prompts(args, engine.vocab_size)):
        status, reply = await post_json(host, port, "/generate",
                                        {"prompt_ids": prompt, "logprobs": True,
                                         "max_new_tokens": args.max_new_tokens})
        if status != 200:
            raise RuntimeError(f"request {i} failed with HTTP {status}: {reply}")
        # The same prompt through a plain prefill: the cache must not change a single token,
        # nor (beyond rounding) its probability.
        reference, ref_logprobs, ttft_no_cache = await asyncio.to_thread(
            generate_uncached, engine.model, prompt, args.max_new_tokens)
        diff = max((abs(a - b) for a, b in zip(reply["logprobs"], ref_logprobs)), default=0.0)
        results.append({**reply, "uncached_tokens": reference,
                        "ttft_ms_no_cache": round(ttft_no_cache, 3),
                        "max_logprob_diff": diff,
                        "same_as_uncached": reply["tokens"] == reference
                        and diff <= LOGPROB_TOLERANCE})
    return {"mode": args.mode, "model": args.model, "chunk_size": args.chunk_size,
            "prefix_tokens": args.prefix_tokens, "requests": results,
            "all_same_as_uncached": all(r["same_as_uncached"] for r in results),
            "cache_tokens": await token_stats(engine.cache)}


def print_self_test(report: dict[str, Any]) -> None:
    print(f"mode {report['mode']}, model {report['model']}, {len(report['requests'])} requests "
          f"sharing a {report['prefix_tokens']}-token prefix")
    print(f"{'req':>3} {'prompt':>6} {'cached':>6} {'TTFT ms':>9} {'no cache':>9}  "
          "same tokens and logprobs as a plain prefill")
    for i, r in enumerate(report["requests"]):
        print(f"{i:>3} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['ttft_ms']:>9.1f} "
              f"{r['ttft_ms_no_cache']:>9.1f}  {'yes' if r['same_as_uncached'] else 'NO'} "
              f"(max logprob diff {r['max_logprob_diff']:.1e})")
    print("generation with the cache identical to a plain prefill: "
          f"{'ok' if report['all_same_as_uncached'] else 'MISMATCH'}")


async def amain(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    model = await asyncio.to_thread(build_model, SIZES[args.model], seed=args.seed)
    spec = kv_spec_of(model)
    # First forwards pay for lazy initialisation (kernels, thread pools); keep that out of the
    # first request's TTFT by running both paths once: a full prefill and one after a restore.
    warm_tokens = args.prefix_tokens + args.suffix_tokens if args.self_test else 1024
    await asyncio.to_thread(warm_up, model, warm_tokens)
    async with open_cache(args, spec) as cache:
        engine = Engine(model, cache)
        host = "127.0.0.1" if args.self_test else args.host
        port = 0 if args.self_test else args.port
        server = await asyncio.start_server(http_handler(engine, args.max_new_tokens),
                                            host, port)
        async with server:
            port = server.sockets[0].getsockname()[1]
            if not args.self_test:
                print(f"serving POST http://{host}:{port}/generate (mode {args.mode}); "
                      "Ctrl-C stops", flush=True)
                await server.serve_forever()
                return 0
            report = await run_self_test(args, engine, host, port)
    if args.json:
        print(json.dumps(report))
    else:
        print_self_test(report)
    return 0 if report["all_same_as_uncached"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A stdlib asyncio HTTP inference server (POST /generate) whose prefill "
                    "skips every prefix musacache already holds. Body: {\"tokens\": [...]} or "
                    "{\"prompt_ids\": [...], \"max_new_tokens\": k}; reply: {tokens, "
                    "cached_tokens, prompt_tokens, ttft_ms}.",
        epilog="Examples: --self-test 4 (embedded cache, prints results and exits); "
               "--mode serve-and-connect --self-test 4 (starts `musacache serve` itself); "
               "--write-config mc.toml, then `musacache serve --socket S --config mc.toml` "
               "and --mode connect --socket S.")
    p.add_argument("--mode", choices=("embedded", "connect", "serve-and-connect"),
                   default="embedded",
                   help="embedded: a Cache in this process (default); connect: a running "
                        "`musacache serve` at --socket; serve-and-connect: start one on a "
                        "temporary socket, then connect to it")
    p.add_argument("--socket", help="node server socket (--mode connect)")
    p.add_argument("--write-config", metavar="FILE.toml",
                   help="write the `musacache serve` config matching this model, then exit")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--model", choices=list(SIZES), default="small",
                   help="demo model size (default small; tiny is for tests)")
    p.add_argument("--seed", type=int, default=0, help="weights and self-test token ids")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per cache chunk")
    p.add_argument("--host-mib", type=int, default=512, help="host tier capacity in MiB")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens generated when the request does not say (default 16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--self-test", type=int, metavar="N", default=0,
                   help="serve on a free port, send N requests sharing a prefix, print the "
                        "results and exit (exit code 1 if a cached run generated different "
                        "tokens than a plain prefill)")
    p.add_argument("--prefix-tokens", type=int, default=1000,
                   help="self-test: tokens shared by every prompt (default 1000)")
    p.add_argument("--suffix-tokens", type=int, default=48,
                   help="self-test: tokens unique to each prompt (default 48)")
    p.add_argument("--json", action="store_true", help="self-test: print one JSON object")
    args = p.parse_args(argv)
    if args.mode == "connect" and not args.socket and not args.write_config:
        p.error("--mode connect needs --socket PATH (of a running `musacache serve`)")
    if args.self_test < 0 or args.suffix_tokens < 1 or args.prefix_tokens < 0:
        p.error("--self-test, --prefix-tokens must be >= 0 and --suffix-tokens >= 1")
    return args


def write_config(args: argparse.Namespace) -> int:
    spec = kv_spec_of(build_model(SIZES[args.model], seed=args.seed))
    Path(args.write_config).write_text(server_config_toml(
        spec, namespace_for(args), args.chunk_size, args.host_mib * 1024**2))
    print(f"wrote {args.write_config}; start the node server with\n"
          f"  musacache serve --socket /tmp/musacache/node.sock --config {args.write_config}\n"
          "then run this example with --mode connect --socket /tmp/musacache/node.sock "
          "and the same --model/--seed/--chunk-size")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_config:
        return write_config(args)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
