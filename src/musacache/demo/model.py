"""The demo's model helpers, public so the examples (and your experiments) can use them.

A random-init Llama built offline from a config, and the conversions between a transformers
``DynamicCache`` and musacache's dense ``(L, 2, T, H, D)`` KV. Importing this module imports
transformers (the ``demo`` extra).
"""

from ._model import build_model, dense_from_hf, first_token_logits, hf_from_dense, kv_spec_of
from ._sizes import SIZES, ModelSize

__all__ = ["SIZES", "ModelSize", "build_model", "dense_from_hf", "first_token_logits",
           "hf_from_dense", "kv_spec_of"]
