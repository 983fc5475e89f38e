"""The ``musacache`` command: demo, serve, stats, bench.

Each subcommand imports its module only when run, so ``musacache --help`` is instant and the
demo's extra dependencies (transformers) are needed by the demo alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import ConfigError, InvalidInputError, MusaCacheError
from ._version import __version__

BENCHES = {
    "transfer": ("musacache.bench.transfer",
                 "native paged gather/scatter vs torch index_select/index_copy_ and copy_"),
    "codec": ("musacache.bench.codec", "raw, lz4 and byte-shuffle+lz4 on bf16 KV: ratio and GB/s"),
    "tiers": ("musacache.bench.tiers", "S3 tier vs raw aiobotocore put/get (starts Swift)"),
    "ipc": ("musacache.bench.ipc", "node-server zero-copy store vs bytes over the socket"),
    "cache": ("musacache.bench.cache",
              "host-tier put/get vs copy_, lookup time, event-loop gap"),
    "gpu": ("musacache.bench.gpu", "the accelerator data path and TTFT, ratios vs torch copies"),
    "scale": ("musacache.bench.scale", "the control plane at scale: every goal in one run"),
    "hostile": ("musacache.bench.hostile",
                "node server under hostile clients: a polite client's p99 and server memory"),
    "metrics": ("musacache.bench.metrics",
                "node server throughput with and without a /metrics scraper every 100 ms"),
}

SUBCOMMANDS = {
    "demo": ("musacache.demo", "TTFT with and without the cache on a small random Llama"),
    "serve": ("musacache.server", "run the node server on a Unix socket"),
    "stats": ("musacache.server.stats_cli", "live table of a running node server's tiers"),
}


def _run_module(module: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or "a dependency"
        hint = " (pip install 'musacache[demo]')" if module == "musacache.demo" else ""
        print(f"musacache: {module} needs {missing}, which is not installed{hint}", file=sys.stderr)
        return 2
    try:
        return int(mod.main(argv) or 0)
    except (MusaCacheError, OSError) as e:
        # Every subcommand's refusal (a bad config, a bad value, a file it cannot read) is
        # one line here, never a traceback.
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"musacache: error: {text}", file=sys.stderr)
        # 2 as argparse's usage errors: the command line or its config must change.
        return 2 if isinstance(e, (ConfigError, InvalidInputError)) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="musacache",
        description="musacache: an asyncio KV-cache layer for LLM inference "
                    "(device, host, disk and S3 tiers; MUSA, CUDA and CPU).",
        epilog="Run 'musacache COMMAND --help' for the options of each command.")
    parser.add_argument("--version", action="version", version=f"musacache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_mod, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks that print ratios taken in one run")
    bench.add_argument("which", choices=sorted(BENCHES), metavar="{" + ",".join(BENCHES) + "}",
                       help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))

    # Everything after the subcommand belongs to it, --help included.
    if argv and argv[0] in SUBCOMMANDS:
        return _run_module(SUBCOMMANDS[argv[0]][0], argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHES:
        return _run_module(BENCHES[argv[1]][0], argv[2:])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
