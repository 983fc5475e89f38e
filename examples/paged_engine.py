"""A toy paged-attention engine with musacache as its KV connector.

The engine keeps its KV the way vLLM does: one tensor per layer, ``[2, num_blocks, block_size,
H, D]`` (layout ``"vllm"``), blocks handed out by a free-block allocator, one block table per
sequence, and a ``slot_mapping`` (``slot = block * block_size + offset``) that says where each
token's K and V live. The pages are allocated with ``musacache.ipc.empty_shared``, so a node
server in another process can read and write them in place.

How this maps onto vLLM's KVConnector (v1) interface:

=======================================  ====================================================
vLLM KVConnector                         here
=======================================  ====================================================
``get_num_new_matched_tokens`` (sched.)   ``await cache.lookup(tokens[:-1])``: how many prompt
                                          tokens need no prefill
``update_state_after_alloc``              the block table and slot mapping, built after the
                                          allocator gave the sequence its blocks
``start_load_kv`` / ``wait_for_layer_     ``await cache.retrieve(tokens, kv_caches, slots)``:
load``                                    the cached prefix scattered into the pages
the forward pass (``reshape_and_cache``)  ``compute_into_pages`` in a worker thread; it sets a
                                          ready event once the new tokens' KV is in the pages
``save_kv_layer`` / ``wait_for_save``     ``await cache.store(tokens, kv_caches, slots,
                                          skip_prefix=..., ready=event)``: issued before the
                                          compute finishes; musacache reads the pages only once
                                          the event is set
=======================================  ====================================================

The model is a stand-in whose KV is cheap but honest: the KV of token ``j`` is a pseudo-random
function of tokens ``0..j`` (a running hash), as in a causal decoder. So every restored page can
be checked bit for bit against a recomputation, and a page the cache did not fill, or filled
from the wrong prefix, shows up as a mismatch.

    python examples/paged_engine.py                            # embedded Cache
    python examples/paged_engine.py --mode serve-and-connect   # through `musacache serve`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import musacache
from musacache import devices, ipc, transfer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MASK = (1 << 64) - 1
# A page the engine allocated but nobody wrote: the check then fails instead of passing on
# whatever an earlier sequence left in that block.
POISON = -7.0


# -- the toy model ------------------------------------------------------------------------------


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """The same finaliser over a uint64 array (numpy multiplication wraps modulo 2**64)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ToyModel:
    """KV of token ``j`` = a hash of tokens ``0..j`` spread over (layer, K/V, head, dim)."""

    def __init__(self, spec: musacache.KVSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        width = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
        self._lanes = np.arange(width, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)

    def states(self, tokens: Sequence[int]) -> np.ndarray:
        """One 64-bit state per token, depending on it and on every token before it.

        A real model reads the prefix's KV from the pages to compute new tokens; this one
        needs only a running hash of the ids, which costs next to nothing to redo.
        """
        out = np.empty(len(tokens), dtype=np.uint64)
        h = _mix64(self.seed)
        for i, t in enumerate(tokens):
            h = _mix64(h ^ int(t))
            out[i] = h
        return out

    def kv(self, states: np.ndarray) -> torch.Tensor:
        """Dense ``(L, 2, n, H, D)`` KV of the tokens with these states."""
        s = self.spec
        bits = _mix64_np(states[:, None] ^ self._lanes[None, :]) >> np.uint64(11)
        values = bits.astype(np.float64) * (2.0 / 2**53) - 1.0  # uniform in [-1, 1)
        values = values.reshape(len(states), s.num_layers, 2, s.num_kv_heads, s.head_dim)
        dense = torch.from_numpy(np.ascontiguousarray(values.transpose(1, 2, 0, 3, 4)))
        return dense.to(s.dtype)


# -- the engine ---------------------------------------------------------------------------------


class BlockAllocator:
    """Free KV blocks, first in first out: a freed block goes to the back of the line, so the
    next sequence gets other pages than the one before it."""

    def __init__(self, num_blocks: int) -> None:
        self._free = deque(range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)


@dataclass
class SeqState:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)

    def slot_mapping(self, block_size: int) -> torch.Tensor:
        positions = torch.arange(len(self.tokens))
        blocks = torch.tensor(self.block_table, dtype=torch.int64)[positions // block_size]
        return blocks * block_size + positions % block_size


class PagedEngine:
    def __init__(self, model: ToyModel, cache: Any, *, num_blocks: int, block_size: int,
                 interprocess: bool) -> None:
        spec = model.spec
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        # Shared memory, so that `musacache serve` can map the very same pages.
        self.kv_caches = [
            ipc.empty_shared((2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim),
                             spec.dtype)
            for _ in range(spec.num_layers)]
        for layer in self.kv_caches:
            layer.fill_(POISON)
        self.interprocess = interprocess
        self.chunk_size = 0  # the cache's, known once started

    async def start(self) -> None:
        server_info = getattr(self.cache, "server_info", None)  # a Client knows the server's
        self.chunk_size = int(server_info["chunk_size"] if server_info
                              else self.cache.config.chunk_size)
        if self.interprocess:
            # Once per worker: from now on store/retrieve send only tokens and slots.
            await self.cache.register_kv_caches(self.kv_caches, "vllm")

    def _ready_event(self) -> Any:
        # The server waits on an eventfd it received; the embedded cache on a thread-safe event.
        return ipc.IpcEvent.create("cpu") if self.interprocess else devices.HostEvent()

    def compute_into_pages(self, tokens: list[int], start: int, slots: torch.Tensor,
                           ready: Any) -> None:
        """The forward pass (worker thread): KV of ``tokens[start:]`` written into the pages,
        as vLLM's ``reshape_and_cache`` does, then ``ready`` is set."""
        new_kv = self.model.kv(self.model.states(tokens)[start:])
        transfer.scatter(new_kv, self.kv_caches, slots[start:], "vllm")
        ready.set()

    async def prefill(self, tokens: list[int]) -> dict[str, Any]:
        seq = SeqState(tokens)
        toks = torch.tensor(tokens, dtype=torch.int64)
        # Scheduler: the last token is always computed (its logits pick the next token).
        matched = await self.cache.lookup(toks[:-1])
        seq.block_table = self.allocator.allocate(-(-len(tokens) // self.block_size))
        slots = seq.slot_mapping(self.block_size)
        for layer in self.kv_caches:
            layer[:, seq.block_table] = POISON
        try:
            # Load: may bring fewer tokens than lookup said if chunks were evicted meanwhile;
            # the engine then simply computes more.
            restored = await self.cache.retrieve(toks[:-1], self.kv_caches, slots[:-1],
                                                 layout="vllm")
            ready = self._ready_event()
            try:
                compute = asyncio.create_task(asyncio.to_thread(
                    self.compute_into_pages, tokens, restored, slots, ready))
                # Save: issued while the forward runs; it reads the pages once `ready` is set
                # and skips the prefix that came from the cache. When that prefix ends inside a
                # chunk, musacache builds this prompt's longer version of the chunk from its
                # own copy of the head plus the pages after `restored`.
                store = asyncio.create_task(self.cache.store(
                    toks, self.kv_caches, slots, layout="vllm", skip_prefix=restored,
                    ready=ready))
                try:
                    await compute
                except BaseException:
                    store.cancel()  # `ready` will never be set: do not leave the save waiting
                    raise
                stored = await store
            finally:
                if isinstance(ready, ipc.IpcEvent):
                    ready.close()
            restored_ok, all_ok = await asyncio.to_thread(self.check, tokens, slots, restored)
        finally:
            # The sequence is done: its blocks go back, and later sequences overwrite them.
            self.allocator.release(seq.block_table)
        return {"prompt_tokens": len(tokens), "matched_tokens": matched,
                "restored_tokens": restored, "computed_tokens": len(tokens) - restored,
                "stored_tokens": stored, "blocks": len(seq.block_table),
                "first_block": seq.block_table[0], "restored_ok": restored_ok, "ok": all_ok}

    def check(self, tokens: list[int], slots: torch.Tensor, restored: int) -> tuple[bool, bool]:
        """The pages against a recomputation from scratch: (restored prefix equal, all equal)."""
        spec = self.model.spec
        expected = self.model.kv(self.model.states(tokens))
        pages = torch.empty(spec.shape(len(tokens)), dtype=spec.dtype)
        transfer.gather(self.kv_caches, slots, pages, "vllm")
        td = spec.token_dim
        restored_ok = torch.equal(pages.narrow(td, 0, restored),
                                  expected.narrow(td, 0, restored))
        return restored_ok, restored_ok and torch.equal(pages, expected)


# -- the workload ---------------------------------------------------------------------------------


def make_requests(args: argparse.Namespace, vocab_size: int = 32000,
                  ) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, tokens): conversations share a system prompt; each turn resends
    the conversation so far plus new tokens, taking turns between conversations."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab_size, args.system_tokens).tolist()
    convs = [list(system) for _ in range(args.conversations)]
    requests = []
    for turn in range(args.turns):
        for c, conv in enumerate(convs):
            conv += rng.integers(0, vocab_size, args.turn_tokens).tolist()
            requests.append((c, turn, list(conv)))
    return requests


# -- the cache: embedded, or a node server ------------------------------------------------------


def spec_from(args: argparse.Namespace) -> musacache.KVSpec:
    return musacache.KVSpec(num_layers=args.layers, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, dtype=DTYPES[args.dtype])


def namespace_for(args: argparse.Namespace) -> str:
    # The toy model's KV depends on its seed: the seed is part of the model's name.
    return f"example-toy-paged-model-seed{args.seed}"


def server_config_toml(args: argparse.Namespace) -> str:
    return (f'namespace = "{namespace_for(args)}"\n'
            f"chunk_size = {args.chunk_size}\n"
            "[spec]\n"
            f"num_layers = {args.layers}\n"
            f"num_kv_heads = {args.kv_heads}\n"
            f"head_dim = {args.head_dim}\n"
            f'dtype = "{args.dtype}"\n'
            "[[tiers]]\n"
            'kind = "host"\n'
            f"capacity_bytes = {args.host_mib * 1024**2}\n")


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
async def open_cache(args: argparse.Namespace) -> AsyncIterator[Any]:
    spec = spec_from(args)
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
        async with node_server(server_config_toml(args)) as sock, musacache.connect(
                sock, spec=spec, namespace=namespace, chunk_size=args.chunk_size) as cache:
            yield cache


# -- main -----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ToyModel(spec_from(args), args.seed)
    results = []
    async with open_cache(args) as cache:
        engine = PagedEngine(model, cache, num_blocks=args.num_blocks,
                             block_size=args.block_size, interprocess=args.mode != "embedded")
        await engine.start()
        for conv, turn, tokens in make_requests(args):
            results.append({"conversation": conv, "turn": turn,
                            **await engine.prefill(tokens)})
    total = sum(r["prompt_tokens"] for r in results)
    restored = sum(r["restored_tokens"] for r in results)
    return {"mode": args.mode, "layout": "vllm", "block_size": args.block_size,
            "chunk_size": args.chunk_size, "requests": results, "prompt_tokens": total,
            "restored_tokens": restored, "computed_tokens": total - restored,
            "all_ok": all(r["ok"] for r in results)}


def print_report(r: dict[str, Any]) -> None:
    print(f"toy paged engine, mode {r['mode']}, layout {r['layout']}, blocks of "
          f"{r['block_size']} tokens, cache chunks of {r['chunk_size']}")
    print(f"{'req':>3} {'conv':>4} {'turn':>4} {'prompt':>6} {'lookup':>6} {'restored':>8} "
          f"{'computed':>8} {'blocks':>6} {'1st blk':>7}  pages vs recomputed KV")
    for i, q in enumerate(r["requests"]):
        print(f"{i:>3} {q['conversation']:>4} {q['turn']:>4} {q['prompt_tokens']:>6} "
              f"{q['matched_tokens']:>6} {q['restored_tokens']:>8} {q['computed_tokens']:>8} "
              f"{q['blocks']:>6} {q['first_block']:>7}  {'ok' if q['ok'] else 'mismatch'}")
    print(f"tokens: {r['prompt_tokens']} in prompts, {r['restored_tokens']} restored from the "
          f"cache, {r['computed_tokens']} computed")
    print(f"KV restored from the cache equals recomputed KV: "
          f"{'ok' if r['all_ok'] else 'mismatch'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A toy paged-attention engine (vLLM layout, block tables, slot mapping) "
                    "that loads cached prefixes with cache.retrieve and saves new KV with "
                    "cache.store(..., ready=event); checks every page against a recomputation.")
    p.add_argument("--mode", choices=("embedded", "connect", "serve-and-connect"),
                   default="embedded",
                   help="embedded: a Cache in this process (default); connect: a running "
                        "`musacache serve` at --socket; serve-and-connect: start one, connect")
    p.add_argument("--socket", help="node server socket (--mode connect)")
    p.add_argument("--write-config", metavar="FILE.toml",
                   help="write the `musacache serve` config for these settings, then exit")
    model = p.add_argument_group("model and pages")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=4)
    model.add_argument("--head-dim", type=int, default=64)
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    model.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    model.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pages")
    work = p.add_argument_group("workload")
    work.add_argument("--conversations", type=int, default=2,
                      help="conversations sharing the system prompt (default 2)")
    work.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    work.add_argument("--system-tokens", type=int, default=700, help="default 700")
    work.add_argument("--turn-tokens", type=int, default=150,
                      help="tokens each turn appends (default 150)")
    work.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per cache chunk")
    p.add_argument("--host-mib", type=int, default=256, help="host tier capacity in MiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.mode == "connect" and not args.socket and not args.write_config:
        p.error("--mode connect needs --socket PATH (of a running `musacache serve`)")
    longest = args.system_tokens + args.turns * args.turn_tokens
    if -(-longest // args.block_size) > args.num_blocks:
        p.error(f"the longest prompt ({longest} tokens) needs more than --num-blocks "
                f"{args.num_blocks} blocks of {args.block_size}")
    if min(args.conversations, args.turns, args.turn_tokens, args.system_tokens) < 1:
        p.error("--conversations, --turns, --turn-tokens and --system-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_config:
        Path(args.write_config).write_text(server_config_toml(args))
        print(f"wrote {args.write_config}; start the node server with\n"
              f"  musacache serve --socket /tmp/musacache/node.sock --config {args.write_config}\n"
              "then run this example with --mode connect --socket /tmp/musacache/node.sock and the "
              "same settings")
        return 0
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
