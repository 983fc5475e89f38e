"""``musacache demo``: watch time to first token fall on a real model, on a CPU, in one command.

A random-init Llama (built from a config, nothing downloaded) serves three workloads (RAG,
a multi-turn agent, a shared system prompt) twice per request: a full prefill, and a prefill of
only what musacache does not already hold. It prints TTFT with and without the cache, the hit
rate, the bytes per tier, and whether the first token's logits are the same both ways.

Needs the ``demo`` extra: ``pip install 'musacache[demo]'`` (transformers, matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from .. import devices
from .._errors import MusaCacheError
from ._sizes import SIZES
from ._workloads import WORKLOAD_NAMES

__all__ = ["main"]

EXIT_OK = 0
EXIT_LOGITS_MISMATCH = 1
EXIT_USAGE = 2


def _workload_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOAD_NAMES)}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="musacache demo",
        description="TTFT with and without musacache on a random-init Llama (offline; CPU or GPU).",
    )
    p.add_argument("--size", choices=tuple(SIZES), default="small",
                   help="model size: tiny (tests, seconds), small (default, about a minute on "
                        "2 cores), medium (about 4x small), large (about 10x small)")
    p.add_argument("--workloads", type=_workload_list, default=WORKLOAD_NAMES,
                   help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default: all)")
    p.add_argument("--scale", type=_positive_float, default=1.0,
                   help="multiply every token count (documents, turns, prompts) by this")
    p.add_argument("--chunk-size", type=_positive_int, default=256,
                   help="tokens per cache chunk (default 256)")
    p.add_argument("--host-mib", type=_positive_float, default=256.0,
                   help="host tier capacity in MiB (default 256; smaller than the demo's KV, "
                        "so older chunks are demoted to the disk tier)")
    p.add_argument("--disk-mib", type=_positive_float, default=2048.0,
                   help="disk tier capacity in MiB (default 2048)")
    p.add_argument("--disk-dir", default=None,
                   help="folder for the disk tier (default: a temporary folder, removed "
                        "after); the demo's chunks left there by an earlier run are cleared "
                        "first, so every run starts cold")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads (default: the CPUs this process may use)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "musa"), default="auto",
                   help="where the model runs (default auto: the accelerator when there is "
                        "one, else the CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and token ids")
    p.add_argument("--json", action="store_true",
                   help="print machine-readable results instead of the tables")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="save a plot of TTFT per request, with and without the cache")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.add_argument("--rag-followups", type=_positive_int, default=3, metavar="N",
                   help="RAG questions asked over one retrieval result: the first and its "
                        "follow-ups (default 3; 1 makes every question a new retrieval)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when every logits check passed, 1 when one failed, 2 on bad usage."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        from ._report import format_report, plot_ttft, to_json
        from ._runner import DemoOptions, run_demo

        if args.plot:  # fail now rather than after minutes of prefill
            import matplotlib  # noqa: F401
    except ImportError as e:
        print(f"musacache demo needs the demo extra: pip install 'musacache[demo]' ({e})",
              file=sys.stderr)
        return EXIT_USAGE

    # Intra-op threads: one per CPU this process may run on (more only contend).
    opts = DemoOptions(
        size=SIZES[args.size], seed=args.seed, threads=args.threads or devices.usable_cpus(),
        scale=args.scale, chunk_size=args.chunk_size,
        host_bytes=int(args.host_mib * 1024**2), disk_bytes=int(args.disk_mib * 1024**2),
        disk_dir=args.disk_dir, workloads=args.workloads, progress=not args.no_progress,
        rag_questions_per_retrieval=args.rag_followups, device=args.device,
    )
    try:
        devices.resolve(opts.device)
    except MusaCacheError as e:  # --device cuda on a machine without one
        print(f"musacache demo: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:  # its folder must take the file: checked now, not after the whole run
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"musacache demo: cannot write the plot {args.plot}: {folder} is not a "
                  "writable folder", file=sys.stderr)
            return EXIT_USAGE
    try:
        result = asyncio.run(run_demo(opts))
    except MusaCacheError as e:  # a --disk-dir that is a file, or not writable
        print(f"musacache demo: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        try:
            plot_ttft(result, args.plot)
        except OSError as e:
            print(f"musacache demo: cannot write the plot {args.plot}: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(format_report(result))
        if args.plot:
            print(f"plot saved to {args.plot}")
    return EXIT_OK if result.logits_ok else EXIT_LOGITS_MISMATCH
