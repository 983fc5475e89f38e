"""The demo's model: a random-init Llama built offline, and its KV in and out of musacache.

HuggingFace keeps one ``(batch, kv_heads, tokens, head_dim)`` tensor per layer for K and for V.
musacache speaks dense ``(L, 2, T, H, D)``. The two helpers here convert between them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from .._spec import KVSpec
from ._sizes import ModelSize

__all__ = [
    "build_model",
    "cache_keyword",
    "dense_from_hf",
    "hf_from_dense",
    "kv_spec_of",
    "first_token_logits",
]


# The longest default prompt is three 2048-token documents plus a question. Llama's default
# RoPE computes its angles from the positions, so this is the declared limit, not a table size.
_MAX_POSITIONS = 16384


def build_model(size: ModelSize, *, seed: int) -> LlamaForCausalLM:
    """A float32 Llama with random weights from ``seed``, in eval mode; nothing is downloaded."""
    config = LlamaConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=_MAX_POSITIONS,
    )
    # The RNG state is restored so that building a model does not shift the caller's
    # random streams (the workloads draw their token ids from their own generators anyway).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # SDPA is the fastest attention transformers has on a CPU; named so that no other
    # default (eager materialises the whole attention matrix) sneaks into the timings.
    model.set_attn_implementation("sdpa")
    return model.eval()


def kv_spec_of(model: LlamaForCausalLM) -> KVSpec:
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = int(config.num_key_value_heads or heads)
    return KVSpec(num_layers=int(config.num_hidden_layers), num_kv_heads=kv_heads,
                  head_dim=int(head_dim), dtype=next(model.parameters()).dtype)


def hf_from_dense(kv: torch.Tensor, model: LlamaForCausalLM) -> DynamicCache:
    """A DynamicCache holding dense ``(L, 2, T, H, D)`` KV, ready to be extended by a forward.

    The per-layer tensors handed over are permuted views; DynamicCache copies them into its own
    contiguous storage, so ``kv`` may be freed or reused afterwards.
    """
    kv = kv.to(model.device)  # a host-tier hit comes back in host memory
    per_layer = [
        (kv[layer, 0].permute(1, 0, 2).unsqueeze(0), kv[layer, 1].permute(1, 0, 2).unsqueeze(0))
        for layer in range(kv.shape[0])
    ]
    return DynamicCache(per_layer, config=model.config)


def dense_from_hf(cache: DynamicCache) -> torch.Tensor:
    """The KV held by ``cache`` as a strided ``(L, 2, T, H, D)`` view (one stacking copy).

    The layers are separate tensors, so one copy is unavoidable; the permute that follows is
    free, and musacache accepts the strided view as it is.
    """
    per_layer = []
    for layer in cache.layers:
        # A sliding-window layer keeps only its window, which is not the prompt's prefix.
        if type(layer) is not DynamicLayer or layer.keys is None or layer.values is None:
            raise TypeError(f"expected full-attention DynamicLayer KV, got {type(layer).__name__}")
        per_layer.append(torch.stack((layer.keys[0], layer.values[0])))  # (2, H, T, D)
    return torch.stack(per_layer).permute(0, 1, 3, 2, 4)


def first_token_logits(model: LlamaForCausalLM, input_ids: torch.Tensor,
                       cache: DynamicCache | None = None, *, piece_tokens: int = 0,
                       ) -> tuple[torch.Tensor, DynamicCache]:
    """Prefill ``input_ids`` (1-D) after whatever ``cache`` holds.

    Returns the logits that choose the first generated token (those of the last prompt
    token; only that row goes through the LM head) and the cache, now holding the whole
    prompt's KV. With ``piece_tokens > 0`` the input is prefilled in pieces of that many
    tokens (chunked prefill).

    Why pieces: after a restored prefix, attention needs an explicit causal mask (PyTorch's
    ``is_causal`` aligns the triangle top-left), and the CPU kernel then computes every
    query-key score, masked or not. For a suffix of ``s`` tokens after ``p`` cached ones
    that is ``s * (p + s)`` scores against ``(p + s)**2 / 2`` for a full causal prefill:
    more, once ``s > p``. Pieces skip most of the masked half.
    """
    if input_ids.numel() == 0:
        raise ValueError("nothing to prefill: the last prompt token must always be computed")
    if cache is None:
        cache = DynamicCache(config=model.config)
    input_ids = input_ids.to(model.device)
    pieces = input_ids.split(piece_tokens) if piece_tokens > 0 else (input_ids,)
    # inference_mode is scoped to the forward alone: tensors the cache allocates while it is on
    # would become inference tensors that its worker threads could no longer write in place.
    keyword = cache_keyword(type(model))
    with torch.inference_mode():
        for piece in pieces:
            out = model(input_ids=piece.unsqueeze(0), use_cache=True, logits_to_keep=1,
                        **{keyword: cache})
    return out.logits[0, -1], cache


def cache_keyword(model_class: type[Any]) -> str:
    """The name under which this transformers' forward takes the KV cache.

    Later 5.x releases call it ``cache`` (and deprecate ``past_key_values``); earlier ones take
    only ``past_key_values`` and swallow an unknown ``cache=`` into ``**kwargs``, which
    silently leaves the cache empty. The forward's own signature says which it is.
    """
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
