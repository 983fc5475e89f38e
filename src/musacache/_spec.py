"""KVSpec: what one token's KV looks like, and the dense shape the cache speaks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import ConfigError, DeviceError, DTypeError, InvalidInputError, ShapeError
from ._validate import boolean, positive_int, shown

__all__ = ["MAX_BYTES_PER_TOKEN", "KVSpec", "check_has_data", "check_plain_values",
           "check_writable", "dtype_from_name", "dtype_name", "may_overlap", "storage_short"]

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
    if not isinstance(name, str):
        raise ConfigError(f"a KV dtype is a name such as 'bfloat16', got {shown(name)}")
    key = name.removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    try:
        return _DTYPES[key]
    except KeyError:
        raise ConfigError(f"unknown KV dtype {shown(name)}; use one of {sorted(_DTYPES)}") \
            from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: Dimensions are stored in 32-bit fields of every chunk object's header.
_MAX_DIM = 2**31 - 1
#: The most bytes one token's KV may take: 4 GiB, thousands of times any model's (a 405B
#: model's is 0.5 MiB). Sizes derived from it (a chunk, a tier's slot) then stay far inside
#: 64 bits, which the chunk header, the native module and the wire protocol carry.
MAX_BYTES_PER_TOKEN = 2**32


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
            object.__setattr__(self, name, positive_int(getattr(self, name), f"KVSpec.{name}",
                                                        maximum=_MAX_DIM))
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        boolean(self.mla, "KVSpec.mla")
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError(
                f"KVSpec(mla=True) stores one latent vector per token: num_kv_heads must be 1, "
                f"got {self.num_kv_heads}"
            )
        if self.bytes_per_token > MAX_BYTES_PER_TOKEN:
            raise ConfigError(
                f"KVSpec({self.describe()}) takes {self.bytes_per_token} bytes per token; at "
                f"most {MAX_BYTES_PER_TOKEN} (4 GiB) are supported")

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

    # -- validation -----------------------------------------------------------------------

    def check_dense(self, kv: torch.Tensor, *, what: str = "kv") -> int:
        """Check a dense KV tensor (any strides) against this spec; return its token count.

        Raises :class:`ShapeError`, :class:`DTypeError`, :class:`DeviceError` (a ``meta``
        tensor has no data) or :class:`InvalidInputError` (a sparse or other non-strided
        tensor), naming ``what``.
        """
        if not isinstance(kv, torch.Tensor):
            raise ShapeError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
        check_has_data(kv, what)
        if kv.dtype != self.dtype:
            raise DTypeError(f"{what} has dtype {dtype_name(kv.dtype)}, the spec says "
                             f"{dtype_name(self.dtype)}")
        check_plain_values(kv, what)
        want = self.shape(-1)
        if kv.dim() != len(want) or any(w != -1 and w != g for w, g in zip(want, kv.shape)):
            pretty = "(L, T, D)" if self.mla else "(L, 2, T, H, D)"
            raise ShapeError(
                f"{what} has shape {tuple(kv.shape)}; the spec wants {pretty} = "
                f"{tuple('T' if w == -1 else w for w in want)}"
            )
        return int(kv.shape[self.token_dim])

    @staticmethod
    def check_memory(t: torch.Tensor, *, what: str = "kv") -> None:
        """Raise :class:`InvalidInputError` if ``t``'s storage does not reach its last element
        (resized or freed under it, as FSDP frees parameters). For tensors a caller hands
        in, not the cache's own: asking a tensor for its storage makes torch keep a Python
        object on it, and the storage's free then holds the GIL (a pool segment's: 20 to
        60 ms of the event loop, stopped while a worker thread unmapped it)."""
        end = storage_short(t)
        if end is not None:
            raise InvalidInputError(
                f"{what}'s storage holds {t.untyped_storage().nbytes()} bytes but its elements "
                f"reach byte {end}: its storage was resized or freed under it (as FSDP frees "
                "parameters), so the cache can neither read nor write it")

    def check_out(self, out: torch.Tensor, *, what: str = "out") -> int:
        """:meth:`check_dense`, plus what a tensor the cache writes into must allow: no element
        may share memory with another (an ``expand``-ed or otherwise overlapping view), and it
        may not require grad (autograd forbids the in-place write). Returns the token count."""
        n = self.check_dense(out, what=what)
        check_writable(out, what)
        return n

    def to_dict(self) -> dict[str, object]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype), "mla": self.mla}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVSpec:
        """From a ``[spec]`` table or :meth:`to_dict`; values are checked, never converted."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a KVSpec table must be a mapping, got {type(d).__name__}")
        known = {"num_layers", "num_kv_heads", "head_dim", "dtype", "mla"}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"[spec]: unknown setting(s) {sorted(unknown, key=str)}; "
                              f"known: {sorted(known)}")
        missing = [k for k in ("num_layers", "num_kv_heads", "head_dim") if k not in d]
        if missing:
            raise ConfigError(f"KVSpec is missing {', '.join(map(repr, missing))}")
        dtype = d.get("dtype", "bfloat16")
        if not isinstance(dtype, (str, torch.dtype)):
            raise ConfigError(f"KVSpec.dtype must be a dtype name, got {shown(dtype)}")
        return cls(d["num_layers"], d["num_kv_heads"], d["head_dim"], dtype_from_name(dtype),
                   d.get("mla", False))


def storage_short(t: torch.Tensor) -> int | None:
    """The byte past ``t``'s last element if its storage does not reach it (a storage
    resized or freed under the tensor, as FSDP frees parameters), else None. Native code
    reads and writes through the address alone: it would go past the allocation."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    end = int((t.storage_offset() + last + 1) * t.element_size())
    return end if end > t.untyped_storage().nbytes() else None


def may_overlap(t: torch.Tensor) -> bool:
    """True unless the elements of ``t`` provably occupy distinct memory.

    Dims of size 1 are ignored; the rest, ordered by stride, must each step past everything the
    smaller-stride dims span. Every view made by slicing, permuting or ``narrow``-ing a tensor
    of its own passes; ``expand`` (stride 0) and overlapping ``as_strided`` views do not. A
    rare interleaved ``as_strided`` view that does not overlap is also refused: this check
    guards writes, so it may be strict but never lax.
    """
    if t.numel() == 0:
        return False
    span = 0  # elements covered by the dims taken so far, minus one
    for size, stride in sorted(((sz, st) for sz, st in zip(t.shape, t.stride()) if sz > 1),
                               key=lambda p: p[1]):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_has_data(t: torch.Tensor, what: str) -> None:
    """A dense (strided) tensor with memory behind it: :class:`InvalidInputError` for a
    sparse or other layout, :class:`DeviceError` on the meta device."""
    if t.layout != torch.strided:
        raise InvalidInputError(f"{what} is a {t.layout} tensor; the cache reads and writes "
                                "dense (strided) tensors only")
    if t.device.type == "meta":
        raise DeviceError(f"{what} is on the meta device: it has a shape but no data")


def check_plain_values(t: torch.Tensor, what: str) -> None:
    """Memory that holds the tensor's values as they are (the cache moves memory)."""
    if t.is_neg():
        raise InvalidInputError(
            f"{what} is a lazily negated view (torch._neg_view): its memory holds the "
            f"negation of its values, and the cache moves memory. Pass "
            f"{what}.resolve_neg()")


def check_writable(t: torch.Tensor, what: str) -> None:
    """What a tensor the cache writes into must allow: it may not require grad (autograd
    forbids the in-place write), nor be an inference tensor outside inference mode, and no
    element may share memory with another (an ``expand``-ed or otherwise overlapping view)."""
    if t.requires_grad:
        raise InvalidInputError(f"{what} requires grad; the cache writes into it in place. "
                                f"Pass {what}.detach() or a tensor made without grad")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise InvalidInputError(
            f"{what} was made under torch.inference_mode(), and torch allows writing into "
            "it in place only there: call the cache inside torch.inference_mode(), or pass "
            "a tensor made outside it")
    if may_overlap(t):
        raise InvalidInputError(
            f"{what} has overlapping memory (shape {tuple(t.shape)}, strides "
            f"{t.stride()}): several of its elements are one memory location, so the "
            "cache cannot write into it. Pass a tensor of its own (torch.empty), or a "
            "sliced or permuted view of one")
