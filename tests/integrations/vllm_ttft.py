"""TTFT of vLLM (CPU) with MusaCacheConnector: a second vLLM process against the first.

    python tests/integrations/vllm_ttft.py [--layers 4] [--hidden 512] [--tokens 3072]

Makes a random Llama, starts ``musacache serve`` (host over disk), serves three distinct
prompts one at a time in a first vLLM process (each a miss: computed, then saved), then the
same three in a second, fresh vLLM process (each a hit: loaded from the node server), and
prints min and median time to first token of each run and their ratio. Run it under the vLLM
venv (``bash .ci/vllm-env.sh``). docs/benchmarks.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from vllm_e2e import _run, _tiers, kv_transfer_config

from musacache.server import spawn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=3072)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="musacache-ttft-") as d:
        tmp = Path(d)
        model = tmp / "model"
        _run("make-model", str(model), "--layers", str(args.layers), "--hidden",
             str(args.hidden))
        rng = random.Random(7)
        prompts = [[rng.randrange(1, 4000) for _ in range(args.tokens)] for _ in range(3)]
        (tmp / "p.json").write_text(json.dumps(prompts))
        cfg = _tiers(tmp, "tiers")
        sock = str(tmp / "run" / "node.sock")
        ttft = {}
        with spawn(cfg, sock):
            for run in ("first", "second"):
                out = tmp / f"{run}.json"
                _run("serve", "--model", str(model), "--prompts", str(tmp / "p.json"),
                     "--out", str(out), "--ttft", "--no-prefix-caching",
                     "--max-model-len", str(args.tokens + 64),
                     "--kv-transfer-config", kv_transfer_config(sock, cfg))
                ttft[run] = json.loads(out.read_text())["ttft"]
    print(f"random Llama, {args.layers} layers, hidden {args.hidden}, float32; "
          f"{args.tokens}-token prompts, 3 per run, one at a time")
    for run in ("first", "second"):
        t = ttft[run]
        print(f"  {run:6} vLLM process TTFT: min {min(t) * 1e3:8.1f} ms  median "
              f"{statistics.median(t) * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in t)})")
    print(f"  second / first: min {min(ttft['second']) / min(ttft['first']):.2f}  median "
          f"{statistics.median(ttft['second']) / statistics.median(ttft['first']):.2f}")


if __name__ == "__main__":
    main()
