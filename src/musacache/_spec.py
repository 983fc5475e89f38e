"""KVSpec: what one token's KV looks like, and the dense shape the cache speaks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ._errors import ConfigError, DTypeError, ShapeError

__all__ = ["KVSpec", "dtype_from_name", "dtype_name"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Map ``"bfloat16"``/``"bf16"``/``torch.bfloat16`` to a torch dtype; ConfigError otherwise."""
    if isinstance(name, torch.dtype):
        if dtype_name(name) not in _DTYPES:
            raise ConfigError(f"unsupported KV dtype {name}; use one of {sorted(_DTYPES)}")
        return name
    key = str(name).removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    try:
        return _DTYPES[key]
    except KeyError:
        raise ConfigError(f"unknown KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ConfigError(f"expected an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"expected an integer, got {v!r}") from None


@dataclass(frozen=True)
class KVSpec:
    """The KV of one model: ``num_layers`` layers of ``num_kv_heads`` heads of ``head_dim``.

    Dense KV is ``(L, 2, T, H, D)`` (K and V stacked on dim 1), or ``(L, T, D)`` when
    ``mla=True`` (one latent vector per token; ``num_kv_heads`` must then be 1).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError(
                f"KVSpec(mla=True) stores one latent vector per token: num_kv_heads must be 1, "
                f"got {self.num_kv_heads}"
            )

    # -- shapes ---------------------------------------------------------------------------

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """The dense shape of ``num_tokens`` tokens: ``(L, 2, T, H, D)`` or ``(L, T, D)``."""
        if self.mla:
            return (self.num_layers, num_tokens, self.head_dim)
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def token_dim(self) -> int:
        """The axis of the dense shape that counts tokens."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # an attribute: no 0-d tensor per call

    @property
    def row_elems(self) -> int:
        """Elements of one token in one layer for one of K/V (``H * D``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        kv = 1 if self.mla else 2
        return self.num_layers * kv * self.row_elems * self.itemsize

    def nbytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens

    def describe(self) -> str:
        """A short human form, used in error messages that compare two specs."""
        kind = "mla" if self.mla else "mha"
        return (f"{kind} L={self.num_layers} H={self.num_kv_heads} D={self.head_dim} "
                f"{dtype_name(self.dtype)}")

    def fingerprint(self) -> bytes:
        """Stable bytes that identify the layout (part of the key-chain seed and chunk header)."""
        return hashlib.blake2b(self.describe().encode(), digest_size=16).digest()

    # -- validation -----------------------------------------------------------------------

    def check_dense(self, kv: torch.Tensor, *, what: str = "kv") -> int:
        """Check a dense KV tensor (any strides) against this spec; return its token count."""
        if not isinstance(kv, torch.Tensor):
            raise ShapeError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.dtype:
            raise DTypeError(f"{what} has dtype {dtype_name(kv.dtype)}, the spec says "
                             f"{dtype_name(self.dtype)}")
        want = self.shape(-1)
        if kv.dim() != len(want) or any(w != -1 and w != g for w, g in zip(want, kv.shape)):
            pretty = "(L, T, D)" if self.mla else "(L, 2, T, H, D)"
            raise ShapeError(
                f"{what} has shape {tuple(kv.shape)}; the spec wants {pretty} = "
                f"{tuple('T' if w == -1 else w for w in want)}"
            )
        return int(kv.shape[self.token_dim])

    def to_dict(self) -> dict[str, object]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype), "mla": self.mla}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> KVSpec:
        try:
            return cls(_int(d["num_layers"]), _int(d["num_kv_heads"]), _int(d["head_dim"]),
                       dtype_from_name(str(d.get("dtype", "bfloat16"))), bool(d.get("mla", False)))
        except KeyError as e:
            raise ConfigError(f"KVSpec is missing {e.args[0]!r}") from None
