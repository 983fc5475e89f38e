"""Serve prompts with vLLM (CPU build), with or without MusaCacheConnector; write a JSON report.

Run by tests/integrations/vllm_e2e.py, one vLLM process per call, exactly as docs/vllm.md shows:

    python tests/integrations/vllm_run.py make-model DIR
    python tests/integrations/vllm_run.py serve --model DIR --prompts P.json --out R.json \\
        [--kv-transfer-config JSON] [--ttft]

``--kv-transfer-config`` takes the same JSON as ``vllm serve --kv-transfer-config``.

The report holds, per prompt, the greedy tokens and vLLM's ``num_cached_tokens`` (a fresh
process has an empty prefix cache, so any cached token there came through the connector),
and with ``--ttft`` the seconds to the first token of each prompt, served one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def make_model(path: str, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)


def serve(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    kv = KVTransferConfig(**json.loads(args.kv_transfer_config)) \
        if args.kv_transfer_config else None
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=args.max_model_len, kv_transfer_config=kv, seed=0,
              enable_prefix_caching=not args.no_prefix_caching,
              tensor_parallel_size=args.tensor_parallel_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)
    report: dict[str, object] = {"tokens": [], "num_cached_tokens": [], "ttft": []}
    if args.ttft:  # the first request of a process pays one-off costs: not a prompt of ours
        llm.generate([TokensPrompt(prompt_token_ids=list(range(7, 71)))],
                     SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                     use_tqdm=False)
    for p in prompts:
        t0 = time.perf_counter()
        if args.ttft:
            llm.generate([TokensPrompt(prompt_token_ids=p)],
                         SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                         use_tqdm=False)
            report["ttft"].append(time.perf_counter() - t0)  # type: ignore[attr-defined]
            continue
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], greedy, use_tqdm=False)[0]
        report["tokens"].append(list(out.outputs[0].token_ids))  # type: ignore[attr-defined]
        report["num_cached_tokens"].append(out.num_cached_tokens)  # type: ignore[attr-defined]
    with open(args.out, "w") as f:
        json.dump(report, f)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("path")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--hidden", type=int, default=128)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--prompts", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--kv-transfer-config")
    s.add_argument("--max-tokens", type=int, default=8)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--ttft", action="store_true")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args()
    if args.cmd == "make-model":
        make_model(args.path, args.layers, args.hidden)
    else:
        serve(args)


if __name__ == "__main__":
    sys.exit(main())
