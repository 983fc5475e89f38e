"""The demo's model sizes. Kept apart from _model so that the command line can list them
without importing transformers."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SIZES", "ModelSize"]


@dataclass(frozen=True)
class ModelSize:
    """The shape of one demo model; every size has ``head_dim = hidden_size / num_heads``."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


# Prefill of 4096 tokens, float32, on 2 shared AMD EPYC cores (AVX2): small about 0.7 to 1.2 s,
# medium about 4 s, large about 10 s; tiny is for the tests (milliseconds).
SIZES: dict[str, ModelSize] = {
    size.name: size
    for size in (
        ModelSize("tiny", 2, 64, 2, 1, 128, 1024),
        ModelSize("small", 4, 256, 4, 2, 688, 32000),
        ModelSize("medium", 8, 512, 8, 4, 1376, 32000),
        ModelSize("large", 12, 768, 12, 4, 2048, 32000),
    )
}
