"""``musacache bench gpu``: the data path on an accelerator, as ratios taken in one run.

Every row times a musacache operation and the plain torch copy of the same bytes, in the
same run, alternating them round by round (best of ``--repeats`` after a warm-up):

=====================  =============================================  ==============
row                    baseline                                       goal
=====================  =============================================  ==============
host put, steady       ``pinned.copy_(device)`` (D2H)                 >= 0.9x
host put, cold         same, into a fresh cache (the pool grows)      >= 0.5x
host get               ``device.copy_(pinned)`` (H2D)                 >= 0.9x
device-tier put / get  ``device.copy_(device)`` (D2D)                 >= 0.5x
store                  D2H copy (and naive index_select + D2H)        >= 0.9x
retrieve               H2D copy                                       >= 0.9x
transfer.gather        ``index_select`` per layer                     >= 1.0x
one-chunk get          its H2D copy (a ratio of times)                <= 1.2x
server store/retrieve  embedded store/retrieve                        >= 0.8x
TTFT restore           prefill time / restore-then-last-token time    >= 7x host,
                                                                      >= 12x device
=====================  =============================================  ==============

The default shape is Llama-3-8B's KV (32 layers, 8 KV heads, 128 dims, bf16) and an
8192-token prompt: 1 GiB. The TTFT rows build a random-weight Llama of ``--model-size``
(``8b`` by default, ``1b`` or ``tiny`` to fit a smaller GPU) and check that the restored KV
is bit-exact and that its logits are identical to the same forward over the prefill's own KV
(the full prefill itself differs from any cached-KV forward by bf16 rounding; that difference
is printed, not judged). They also print the get alone and the forward alone, so that a miss
shows whose time it is.

On a machine without a GPU it prints "no GPU: nothing to measure" and exits 0.
``--device cpu`` runs every row on the CPU anyway, at any size: a smoke test of the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import Cache, CacheConfig, DeviceTier, HostTier, devices, ipc, transfer
from .._spec import KVSpec

NO_GPU = "no GPU: nothing to measure"
MODEL_SIZES = ("8b", "1b", "tiny")


@dataclass
class Row:
    """One line of the table: ``ratio`` is musacache's speed over the baseline's (for
    ``lower_is_better`` rows, musacache's time over the baseline's)."""

    name: str
    baseline: str
    baseline_gbps: float | None = None
    musacache_gbps: float | None = None
    ratio: float | None = None
    goal: str = ""
    ok: bool | None = None
    note: str = ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="musacache bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto",
                   help="auto (default: the accelerator, or stop on a CPU machine), cuda[:i], "
                        "musa[:i], or cpu to smoke-test the bench itself")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per request")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, help="vllm page size, tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-size", choices=MODEL_SIZES, default="8b",
                   help="the TTFT model: Llama-3-8B's shape (default), a 1B shape, or tiny")
    p.add_argument("--ttft-tokens", type=int, default=None,
                   help="prompt length of the TTFT rows (default: --tokens)")
    p.add_argument("--skip", default="",
                   help="comma-separated row groups to leave out: host, device, paged, "
                        "gather, chunk, server, ttft")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


# -- timing ---------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        module = devices.accelerator_module(device.type)
        if module is not None:
            module.synchronize(device)


async def _best(device: torch.device, repeats: int,
                methods: dict[str, Callable[[], Awaitable[object]]],
                before: Callable[[], Awaitable[object]] | None = None) -> dict[str, float]:
    """Best seconds of each method; they take turns each round, round 0 warms up.

    ``before`` runs untimed ahead of every timed call (to reset state, e.g. a fresh cache).
    """
    best = dict.fromkeys(methods, math.inf)
    for round_ in range(repeats + 1):
        for name, fn in methods.items():
            if before is not None:
                await before()
            _sync(device)
            start = time.perf_counter()
            await fn()
            _sync(device)
            elapsed = time.perf_counter() - start
            if round_ > 0:
                best[name] = min(best[name], elapsed)
    return best


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _row(name: str, baseline: str, nbytes: int, ours: float, theirs: float, goal: float,
         note: str = "") -> Row:
    ratio = theirs / ours
    return Row(name, baseline, _gbps(nbytes, theirs), _gbps(nbytes, ours), ratio,
               f">= {goal}x", ratio >= goal, note)


async def _awaitable(fn: Callable[[], object]) -> object:
    return fn()


def _call(fn: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    return lambda: _awaitable(fn)


# -- the rows -------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.spec = KVSpec(args.layers, args.heads, args.head_dim, torch.bfloat16)
        self.tokens = args.tokens
        self.nbytes = self.spec.nbytes(self.tokens)
        self.pinned = device.type != "cpu"
        self.gen = torch.Generator().manual_seed(0)
        self.kv = torch.randn(self.spec.shape(self.tokens), device=device).to(torch.bfloat16)
        # Pinned the way the host tier pins (cuda's allocator, or musaHostRegister on musa).
        self.host = devices.alloc_host(self.nbytes, pinned=self.pinned).view(
            torch.bfloat16).view(self.spec.shape(self.tokens))
        self.host.copy_(self.kv)
        self.out = torch.empty_like(self.kv)
        self.rows: list[Row] = []

    def prompt(self, n: int | None = None) -> torch.Tensor:
        return torch.randint(0, 1 << 30, (n or self.tokens,), generator=self.gen)

    def config(self, tier: Any, name: str) -> CacheConfig:
        return CacheConfig(spec=self.spec, namespace=f"bench-gpu-{name}", tiers=(tier,),
                           chunk_size=self.args.chunk_size, persist_on_close=False)

    def host_tier(self, copies: float) -> HostTier:
        return HostTier(capacity_bytes=int(self.nbytes * copies), pinned=self.pinned)

    async def d2h(self) -> None:
        self.host.copy_(self.kv, non_blocking=self.pinned)

    async def h2d(self) -> None:
        self.out.copy_(self.host, non_blocking=self.pinned)

    async def host_rows(self) -> None:
        reps = self.args.repeats
        # Room for 1.5 requests: once warm, every put evicts (the steady state of a server).
        async with Cache(self.config(self.host_tier(1.5), "host")) as cache:
            t = await _best(self.device, reps, {
                "put": lambda: cache.put(self.prompt(), self.kv), "d2h": self.d2h})
            self.rows.append(_row("host put, steady", "D2H copy_", self.nbytes, t["put"],
                                  t["d2h"], 0.9))
            tokens = self.prompt()
            await cache.put(tokens, self.kv)
            t = await _best(self.device, reps, {
                "get": lambda: cache.get(tokens, out=self.out), "h2d": self.h2d})
            self.rows.append(_row("host get", "H2D copy_", self.nbytes, t["get"], t["h2d"],
                                  0.9))
            chunk = self.args.chunk_size
            chunk_out = self.out.narrow(self.spec.token_dim, 0, chunk)
            chunk_host = self.host.narrow(self.spec.token_dim, 0, chunk)
            t = await _best(self.device, reps, {
                "get": lambda: cache.get(tokens[:chunk], out=chunk_out),
                "copy": _call(lambda: chunk_out.copy_(chunk_host, non_blocking=self.pinned))})
            ratio = t["get"] / t["copy"]
            self.rows.append(Row(
                "one-chunk get", "its H2D copy_", _gbps(self.spec.nbytes(chunk), t["copy"]),
                _gbps(self.spec.nbytes(chunk), t["get"]), ratio, "<= 1.2x (time)",
                ratio <= 1.2, f"{t['get'] * 1e3:.2f} ms vs {t['copy'] * 1e3:.2f} ms"))

        # Cold: every timed put goes into a cache opened just before, whose pool is empty.
        state: dict[str, Cache] = {}

        async def fresh() -> None:
            old = state.pop("cache", None)
            if old is not None:
                await old.aclose()
            state["cache"] = Cache(self.config(self.host_tier(1.5), "cold"))
            await state["cache"].open()

        try:
            t = await _best(self.device, max(1, reps // 2), {
                "put": lambda: state["cache"].put(self.prompt(), self.kv), "d2h": self.d2h},
                before=fresh)
        finally:
            if "cache" in state:
                await state["cache"].aclose()
        self.rows.append(_row("host put, cold", "D2H copy_", self.nbytes, t["put"], t["d2h"],
                              0.5))

    async def device_rows(self) -> None:
        reps = self.args.repeats
        tier = DeviceTier(capacity_bytes=int(self.nbytes * 1.5), device=str(self.device))
        other = torch.empty_like(self.kv)

        async def d2d() -> None:
            other.copy_(self.kv)

        async with Cache(self.config(tier, "device")) as cache:
            t = await _best(self.device, reps, {
                "put": lambda: cache.put(self.prompt(), self.kv), "d2d": d2d})
            self.rows.append(_row("device-tier put", "D2D copy_", self.nbytes, t["put"],
                                  t["d2d"], 0.5))
            tokens = self.prompt()
            await cache.put(tokens, self.kv)
            t = await _best(self.device, reps, {
                "get": lambda: cache.get(tokens, out=self.out), "d2d": d2d})
            self.rows.append(_row("device-tier get", "D2D copy_", self.nbytes, t["get"],
                                  t["d2d"], 0.5))

    def pages(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        bs = self.args.block_size
        blocks = 2 * -(-self.tokens // bs)
        shape = (2, blocks, bs, self.spec.num_kv_heads, self.spec.head_dim)
        # CPU pages live in shared memory, so that the node server can map them too.
        pages = [ipc.empty_shared(shape, torch.bfloat16) if self.device.type == "cpu"
                 else torch.empty(shape, dtype=torch.bfloat16, device=self.device)
                 for _ in range(self.spec.num_layers)]
        for page in pages:
            page.copy_(torch.randn(shape, device=self.device))
        chosen = torch.randperm(blocks, generator=self.gen)[:-(-self.tokens // bs)]
        slots = (chosen[:, None] * bs + torch.arange(bs)).reshape(-1)[:self.tokens]
        return pages, slots.contiguous()

    async def paged_rows(self) -> None:
        reps = self.args.repeats
        pages, slots = self.pages()
        dev_slots = slots.to(self.device)
        staging = torch.empty_like(self.kv)

        async def naive() -> None:  # what an engine does without musacache's path
            for layer, page in enumerate(pages):
                flat = page.view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
                torch.index_select(flat, 1, dev_slots, out=staging[layer])
            self.host.copy_(staging, non_blocking=self.pinned)

        async with Cache(self.config(self.host_tier(1.5), "paged")) as cache:
            t = await _best(self.device, reps, {
                "store": lambda: cache.store(self.prompt(), pages, slots),
                "d2h": self.d2h, "naive": naive})
            self.rows.append(_row("store (vllm pages -> host)", "D2H copy_", self.nbytes,
                                  t["store"], t["d2h"], 0.9,
                                  f"naive index_select + D2H: {_gbps(self.nbytes, t['naive']):.1f}"
                                  " GB/s"))
            tokens = self.prompt()
            await cache.store(tokens, pages, slots)
            t = await _best(self.device, reps, {
                "retrieve": lambda: cache.retrieve(tokens, pages, slots), "h2d": self.h2d})
            self.rows.append(_row("retrieve (host -> vllm pages)", "H2D copy_", self.nbytes,
                                  t["retrieve"], t["h2d"], 0.9))

    async def gather_rows(self) -> None:
        pages, slots = self.pages()
        dev_slots = slots.to(self.device)
        out = torch.empty_like(self.kv)

        def index_select() -> None:
            for layer, page in enumerate(pages):
                flat = page.view(2, -1, self.spec.num_kv_heads, self.spec.head_dim)
                torch.index_select(flat, 1, dev_slots, out=out[layer])

        t = await _best(self.device, self.args.repeats, {
            "gather": _call(lambda: transfer.gather(pages, slots, self.out, "vllm")),
            "index_select": _call(index_select)})
        if not torch.equal(out, self.out):
            raise RuntimeError("transfer.gather and index_select disagree")
        self.rows.append(_row("transfer.gather on the device", "index_select per layer",
                              self.nbytes, t["gather"], t["index_select"], 1.0))

    async def server_rows(self) -> None:
        from musacache.server.client import connect

        from .ipc import _start_server

        reps = self.args.repeats
        pages, slots = self.pages()
        with tempfile.TemporaryDirectory(prefix="musacache-bench-gpu-") as tmp:
            (Path(tmp) / "run").mkdir()
            proc, sock = _start_server(Path(tmp), self.spec, capacity=int(self.nbytes * 1.5))
            try:
                async with connect(sock, spec=self.spec, namespace="bench-ipc",
                                   timeout=600) as client, \
                        Cache(self.config(self.host_tier(1.5), "embedded")) as cache:
                    await client.register_kv_caches(pages, "vllm")
                    t = await _best(self.device, reps, {
                        "server": lambda: client.store(self.prompt(), slots),
                        "embedded": lambda: cache.store(self.prompt(), pages, slots)})
                    self.rows.append(_row("server store", "embedded store", self.nbytes,
                                          t["server"], t["embedded"], 0.8))
                    tokens = self.prompt()
                    await client.store(tokens, slots)
                    await cache.store(tokens, pages, slots)
                    t = await _best(self.device, reps, {
                        "server": lambda: client.retrieve(tokens, slots),
                        "embedded": lambda: cache.retrieve(tokens, pages, slots)})
                    self.rows.append(_row("server retrieve", "embedded retrieve", self.nbytes,
                                          t["server"], t["embedded"], 0.8))
            finally:
                proc.stop(30)

    async def ttft_rows(self) -> None:
        from ..demo import _model

        model, spec = _ttft_model(self.args.model_size, self.device)
        n = self.args.ttft_tokens or self.tokens
        tokens = self.prompt(n) % model.config.vocab_size
        reps = max(1, self.args.repeats // 2)
        reference, hf = _model.first_token_logits(model, tokens)
        kv = _model.dense_from_hf(hf)
        nbytes = spec.nbytes(n)
        prefill = (await _best(self.device, reps, {
            "prefill": _call(lambda: _model.first_token_logits(model, tokens))}))["prefill"]
        tiers: dict[str, HostTier | DeviceTier] = {
            "host": HostTier(capacity_bytes=int(nbytes * 1.2), pinned=self.pinned)}
        if self.device.type != "cpu":
            tiers["device"] = DeviceTier(capacity_bytes=int(nbytes * 1.2),
                                         device=str(self.device))
        goals = {"host": 7.0, "device": 12.0}
        out = torch.empty(spec.shape(n), dtype=spec.dtype, device=self.device)
        reused = n - 1  # the last prompt token is always computed: it yields the logits
        # The same suffix forward over the KV the prefill made, not through the cache: what a
        # restore must reproduce exactly. The full prefill differs from any cached-KV forward
        # by bf16 rounding (other attention kernels, other GEMM shapes), whatever the cache.
        def uncached() -> torch.Tensor:
            return _model.first_token_logits(
                model, tokens[reused:], _model.hf_from_dense(kv.narrow(2, 0, reused), model))[0]

        same_path = uncached()
        forward = (await _best(self.device, reps, {"forward": _call(uncached)}))["forward"]
        for name, tier in tiers.items():
            config = CacheConfig(spec=spec, namespace=f"bench-gpu-ttft-{name}", tiers=(tier,),
                                 chunk_size=self.args.chunk_size, persist_on_close=False)
            async with Cache(config) as cache:
                await cache.put(tokens, kv)
                logits: list[torch.Tensor] = []

                async def restore(cache: Cache = cache, logits: list[torch.Tensor] = logits,
                                  ) -> None:
                    hit = await cache.get(tokens, out=out)
                    used = min(hit.num_tokens, reused)
                    restored = _model.hf_from_dense(hit.kv.narrow(2, 0, used), model)
                    logits[:] = [_model.first_token_logits(model, tokens[used:], restored)[0]]

                t = await _best(self.device, reps, {
                    "restore": restore, "get": lambda: cache.get(tokens, out=out)})
                hit = await cache.get(tokens, out=out)
                exact = hit.num_tokens >= reused and torch.equal(
                    hit.kv.narrow(2, 0, reused).to(kv.device), kv.narrow(2, 0, reused))
                same = bool(torch.equal(logits[0], same_path))
                path_diff = float((logits[0].float() - same_path.float()).abs().max())
                diff = float((logits[0].float() - reference.float()).abs().max())
                speedup = prefill / t["restore"]
                self.rows.append(Row(
                    f"TTFT restore from {name} ({self.args.model_size}, {n} tokens)",
                    "full prefill", None, None, speedup, f">= {goals[name]}x",
                    speedup >= goals[name] and exact and same,
                    f"prefill {prefill * 1e3:.0f} ms, restore {t['restore'] * 1e3:.1f} ms "
                    f"(get {t['get'] * 1e3:.1f} ms, the forward alone {forward * 1e3:.1f} ms); "
                    f"KV {'bit-exact' if exact else 'DIFFERS'}; logits "
                    f"{'identical to' if same else f'differ by {path_diff:.3g} from'} the "
                    f"uncached-KV forward; {diff:.3g} from the full prefill (bf16 kernels)"))


def _ttft_model(size: str, device: torch.device) -> tuple[Any, KVSpec]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..demo import _model

    shapes: dict[str, dict[str, Any]] = {
        "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
        "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
        "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    }
    config = LlamaConfig(max_position_embeddings=131072, **shapes[size])
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place: an 8B model in float32 would be 32 GB
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.eval(), _model.kv_spec_of(model)


GROUPS = ("host", "device", "paged", "gather", "chunk", "server", "ttft")


async def _run(args: argparse.Namespace, device: torch.device) -> list[Row]:
    bench = Bench(args, device)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("host", bench.host_rows), ("device", bench.device_rows),
        ("paged", bench.paged_rows), ("gather", bench.gather_rows),
        ("server", bench.server_rows), ("ttft", bench.ttft_rows)]
    for group, step in steps:
        if group in skip:
            continue
        try:
            await step()
        except Exception as exc:  # one broken row must not hide the others' figures
            bench.rows.append(Row(f"{group} rows", "", note=f"error: {exc!r}", ok=False))
    return bench.rows


def _table(rows: list[Row], device: torch.device, nbytes: int) -> str:
    lines = [f"musacache bench gpu on {device}: {nbytes / 2**30:.2f} GiB per request",
             f"{'operation':<44} {'baseline':<24} {'base GB/s':>10} {'ours GB/s':>10} "
             f"{'ratio':>7}  goal"]
    for r in rows:
        def num(v: float | None) -> str:
            return "" if v is None else f"{v:.1f}"

        verdict = "" if r.ok is None else ("ok" if r.ok else "MISSED")
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"{r.name:<44} {r.baseline:<24} {num(r.baseline_gbps):>10} "
                     f"{num(r.musacache_gbps):>10} {ratio:>7}  {r.goal} {verdict}"
                     + (f"  [{r.note}]" if r.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.skip:
        unknown = {s.strip() for s in args.skip.split(",") if s.strip()} - set(GROUPS)
        if unknown:
            print(f"musacache bench gpu: unknown --skip group(s) {sorted(unknown)}",
                  file=sys.stderr)
            return 2
    if args.device == "auto":
        device = devices.default_device()
        if device.type == "cpu":
            print(NO_GPU)
            return 0
    else:
        device = devices.resolve(args.device)
    rows = asyncio.run(_run(args, device))
    nbytes = KVSpec(args.layers, args.heads, args.head_dim, torch.bfloat16).nbytes(args.tokens)
    if args.json:
        print(json.dumps({"device": str(device), "bytes": nbytes,
                          "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(_table(rows, device, nbytes))
    return 1 if any(r.note.startswith("error:") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
